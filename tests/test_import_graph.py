"""The package's import graph: no import cycle and no import of another
module's private names (issue 25, structure).

Every ``import``/``from ... import`` in ``tenplex_jax`` counts, at module
level or inside a function (a function-local import hides a cycle, it does
not remove it); a package's imports of its own submodules are left out.
"""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "tenplex_jax")


def _modules():
  mods = {}
  for d, _, files in os.walk(ROOT):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(d, f)
        rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3]
        name = rel.replace(os.sep, ".")
        mods[name[:-len(".__init__")] if name.endswith(".__init__")
             else name] = path
  return mods


def _graph(mods):
  """``{module: {imported modules}}`` and ``[(module, line, source,
  name)]`` for each ``from SOURCE import _name`` of another module."""
  edges, private = {m: set() for m in mods}, []
  for m, path in mods.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    pkg = m if path.endswith("__init__.py") else m.rpartition(".")[0]
    for n in ast.walk(tree):
      if isinstance(n, ast.ImportFrom):
        base = pkg.split(".")
        src = ".".join(base[:len(base) - n.level + 1] +
                       ([n.module] if n.module else [])) if n.level \
            else n.module
        if not src or not src.startswith("tenplex_jax"):
          continue
        for a in n.names:
          sub = f"{src}.{a.name}"
          if sub in mods:
            edges[m].add(sub)
            continue
          edges[m].add(src)
          if a.name.startswith("_") and not a.name.startswith("__") \
              and src != m:
            private.append((m, n.lineno, src, a.name))
      elif isinstance(n, ast.Import):
        edges[m].update(a.name for a in n.names if a.name in mods)
  for m in edges:  # a package importing its own submodules, and itself
    edges[m] = {t for t in edges[m]
                if t in mods and t != m and not t.startswith(m + ".")}
  return edges, private


def _cycles(edges):
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(edges[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycle_and_no_private_imports():
  mods = _modules()
  assert "tenplex_jax.store.api" in mods and len(mods) > 30
  edges, private = _graph(mods)
  assert _cycles(edges) == []
  assert private == []


def test_the_check_sees_a_cycle_and_a_private_import(tmp_path):
  """The check itself: a cycle closed by a function-local import, and a
  private name imported from another module, are both found."""
  x, y = tmp_path / "x.py", tmp_path / "y.py"
  x.write_text("def f():\n  from tenplex_jax.y import _hidden\n"
               "  return _hidden\n")
  y.write_text("import tenplex_jax.x\n_hidden = 1\n")
  edges, private = _graph({"tenplex_jax.x": str(x), "tenplex_jax.y": str(y)})
  assert _cycles(edges) == [["tenplex_jax.x", "tenplex_jax.y"]]
  assert private == [("tenplex_jax.x", 2, "tenplex_jax.y", "_hidden")]
