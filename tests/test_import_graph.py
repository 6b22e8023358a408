"""The package's import graph: no import cycle and no use of another
module's private names; the environment read in one place (issue 25,
structure).

Every ``import``/``from ... import`` in ``tenplex_jax`` counts, at module
level or inside a function (a function-local import hides a cycle, it does
not remove it); a package's imports of its own submodules are left out. A
private name counts whether it is imported (``from M import _x``) or read
through the module (``import M as m; m._x``) or through a class or function
imported from it (``from M import C; C._x``).

The runtime (the launcher and the Ray integration) is a package of its
own: outside ``tenplex_jax.runtime`` only its two old paths import it.

The ``TENPLEX_*`` environment: the launcher and the Ray integration read
theirs only in ``tenplex_jax/runtime/env.py``, and every variable is read in
one module (one parse decides it: the store's settings that a launcher
passes on, its token, CA and run id, are the store's to read).
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


def _private(name):
  return name.startswith("_") and not name.startswith("__")


def _dotted(node):
  """``a.b.c`` for a chain of attributes on a name, else None."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name):
    return None
  return ".".join([node.id, *reversed(parts)])


def _graph(mods):
  """``{module: {imported modules}}`` and ``[(module, line, source,
  name)]`` for each private name of another module that a module imports
  (``from SOURCE import _name``) or reads through the module or a name it
  imported from it (``SOURCE._name``, ``alias._name``, ``Class._name``)."""
  edges, private = {m: set() for m in mods}, []
  for m, path in mods.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    pkg = m if path.endswith("__init__.py") else m.rpartition(".")[0]
    aliases = {}  # a name bound to a module of the package -> that module
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
            aliases[a.asname or a.name] = sub
            continue
          edges[m].add(src)
          if src != m:  # a class or function of another module
            aliases[a.asname or a.name] = f"{src}:{a.name}"
          if _private(a.name) and src != m:
            private.append((m, n.lineno, src, a.name))
      elif isinstance(n, ast.Import):
        edges[m].update(a.name for a in n.names if a.name in mods)
        for a in n.names:
          if a.name in mods:  # import a.b as c: c; import a.b: a (a.b...)
            aliases[a.asname or a.name.partition(".")[0]] = \
                a.name if a.asname else a.name.partition(".")[0]
    for n in ast.walk(tree):
      if not (isinstance(n, ast.Attribute) and _private(n.attr)):
        continue
      path_ = _dotted(n.value)
      if path_ is None:
        continue
      head, _, rest = path_.partition(".")
      if head not in aliases:
        continue
      src = aliases[head] + ("." + rest if rest else "")
      owner = src.partition(":")[0]  # Name._x of a name it imported
      while owner and owner not in mods:  # module.Class._x
        owner = owner.rpartition(".")[0]
      if owner and owner != m:
        private.append((m, n.lineno, src, n.attr))
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


def _is_environ(n):
  return isinstance(n, ast.Attribute) and n.attr == "environ" and \
      isinstance(n.value, ast.Name) and n.value.id == "os"


def _constants(tree):
  """A module's top-level names bound to a string, or to a tuple, list or
  set of strings: ``{name: (str, ...)}``."""
  out = {}
  for n in tree.body:
    if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
      v = n.value
      if isinstance(v, ast.Constant) and isinstance(v.value, str):
        vals = (v.value,)
      elif isinstance(v, (ast.Tuple, ast.List, ast.Set)) and all(
          isinstance(e, ast.Constant) and isinstance(e.value, str)
          for e in v.elts):
        vals = tuple(e.value for e in v.elts)
      else:
        continue
      for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
        if isinstance(t, ast.Name):
          out[t.id] = vals
  return out


def _env_reads(mods):
  """``[(module, line, variable or None)]``: every read of an environment
  variable (``os.environ.get/pop/setdefault(K)``, ``os.environ[K]``, ``K
  in os.environ``, ``os.getenv(K)``), ``K`` a string, a module constant
  (imported ones included) or a loop variable over a constant tuple; None
  where the check cannot tell which variable."""
  trees = {}
  for m, path in mods.items():
    with open(path) as f:
      trees[m] = ast.parse(f.read(), path)
  consts = {m: _constants(t) for m, t in trees.items()}
  out = []
  for m, tree in trees.items():
    names = dict(consts[m])
    for n in ast.walk(tree):
      if isinstance(n, ast.ImportFrom) and n.module in consts:
        for a in n.names:
          if a.name in consts[n.module]:
            names[a.asname or a.name] = consts[n.module][a.name]
    loops = {}  # for/comprehension targets over a constant collection
    for n in ast.walk(tree):
      if isinstance(n, (ast.For, ast.comprehension)) and isinstance(
          n.target, ast.Name) and isinstance(n.iter, ast.Name) and \
          n.iter.id in names:
        loops[n.target.id] = names[n.iter.id]
    for n in ast.walk(tree):
      key = None
      if isinstance(n, ast.Call) and n.args:
        f = n.func
        if isinstance(f, ast.Attribute) and (
            (f.attr in ("get", "pop", "setdefault") and _is_environ(f.value))
            or (f.attr == "getenv" and isinstance(f.value, ast.Name)
                and f.value.id == "os")):
          key = n.args[0]
      elif isinstance(n, ast.Subscript) and _is_environ(n.value) and \
          isinstance(n.ctx, ast.Load):
        key = n.slice
      elif isinstance(n, ast.Compare) and any(
          _is_environ(c) for c in n.comparators):
        key = n.left
      if key is None:
        continue
      if isinstance(key, ast.Constant) and isinstance(key.value, str):
        found = (key.value,)
      elif isinstance(key, ast.Name) and key.id in names:
        found = names[key.id]
      elif isinstance(key, ast.Name) and key.id in loops:
        found = loops[key.id]
      else:
        found = (None,)
      out += [(m, n.lineno, v) for v in found]
  return out


_ENV_MODULE = "tenplex_jax.runtime.env"


def _env_problems(reads):
  """What breaks "the environment read in one place": a runtime module
  other than ``runtime/env.py`` reading a ``TENPLEX_*`` variable, a
  variable read in more than one module, a read the check cannot name
  (outside ``runtime/env.py``, which reads its table's names in a loop)."""
  problems, where = [], {}
  for m, line, v in reads:
    if v is None:
      if m != _ENV_MODULE:
        problems.append(f"{m}:{line}: reads a variable named at run time")
      continue
    if not v.startswith("TENPLEX_"):
      continue
    where.setdefault(v, set()).add(m)
    if m.startswith("tenplex_jax.runtime") and m != _ENV_MODULE:
      problems.append(f"{m}:{line}: reads ${v} (the runtime reads its"
                      f" environment in {_ENV_MODULE})")
  problems += [f"${v} is read in {sorted(ms)}" for v, ms in
               sorted(where.items()) if len(ms) > 1]
  return problems


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


def test_the_check_sees_a_private_name_read_through_its_module(tmp_path):
  x, y = tmp_path / "x.py", tmp_path / "y.py"
  x.write_text("import tenplex_jax.y\nfrom tenplex_jax import y as why\n"
               "from tenplex_jax.y import Store\n"
               "a = why._hidden\nb = tenplex_jax.y._hidden\n"
               "c = why.public, Store.public, why.Store.public\n"
               "d = Store._cache, why.Store._cache\n")
  y.write_text("_hidden = 1\npublic = 2\nclass Store:\n  _cache = {}\n"
               "  public = 3\n")
  _, private = _graph({"tenplex_jax.x": str(x), "tenplex_jax.y": str(y)})
  assert sorted(private) == [
      ("tenplex_jax.x", 4, "tenplex_jax.y", "_hidden"),
      ("tenplex_jax.x", 5, "tenplex_jax.y", "_hidden"),
      ("tenplex_jax.x", 7, "tenplex_jax.y.Store", "_cache"),
      ("tenplex_jax.x", 7, "tenplex_jax.y:Store", "_cache")]


def test_the_environment_is_read_in_one_place():
  from tenplex_jax.runtime.env import VARIABLES
  mods = _modules()
  reads = _env_reads(mods)
  # env.py reads its table's names in a loop: VARIABLES names them.
  assert {v for m, _, v in reads if m == _ENV_MODULE} == {None}
  reads += [(_ENV_MODULE, 0, v) for v in VARIABLES]
  assert "TENPLEX_NUM_PROCS" in VARIABLES and len(VARIABLES) > 15
  assert ("tenplex_jax.store.api", "TENPLEX_RUN") in {
      (m, v) for m, _, v in reads}  # the check sees the store's reads
  assert _env_problems(reads) == []


def test_the_check_sees_environment_reads(tmp_path):
  """The check itself: a runtime module reading a variable, one variable
  read in two modules (through a constant, an imported constant and a loop
  over a constant tuple), and a variable named at run time, are all found."""
  a = tmp_path / "a.py"
  a.write_text("import os\nVAR = 'TENPLEX_X'\nKEYS = ('TENPLEX_Y', 'HOME')\n"
               "x = os.environ.get(VAR)\n"
               "y = {k: os.environ[k] for k in KEYS if k in os.environ}\n")
  b = tmp_path / "b.py"
  b.write_text("import os\nfrom tenplex_jax.a import VAR\n"
               "def f(name):\n  return os.getenv(VAR), os.environ[name]\n")
  reads = _env_reads({"tenplex_jax.a": str(a),
                      "tenplex_jax.runtime.b": str(b)})
  assert sorted(_env_problems(reads)) == [
      "$TENPLEX_X is read in ['tenplex_jax.a', 'tenplex_jax.runtime.b']",
      "tenplex_jax.runtime.b:4: reads $TENPLEX_X (the runtime reads its"
      " environment in tenplex_jax.runtime.env)",
      "tenplex_jax.runtime.b:4: reads a variable named at run time"]
  assert ("tenplex_jax.a", 5, "TENPLEX_Y") in reads


def test_the_runtime_is_a_package_of_its_own():
  """The launcher and the Ray integration live in ``tenplex_jax.runtime``:
  outside it only their old paths import it, and those define nothing
  (each makes its old name the runtime's module); the runtime's
  environment reader sits below everything else (it imports only
  ``errors``), so any module may use it without pulling in a launcher."""
  mods = _modules()
  edges, _ = _graph(mods)
  into = {m: sorted(t for t in edges[m] if t.startswith("tenplex_jax.runtime"))
          for m in edges if not m.startswith("tenplex_jax.runtime")}
  old_paths = {"tenplex_jax.ray": ["tenplex_jax.runtime.ray"],
               "tenplex_jax.store.launch": ["tenplex_jax.runtime.launch"]}
  assert {m: t for m, t in into.items() if t} == old_paths
  for m in old_paths:
    with open(mods[m]) as f:
      tree = ast.parse(f.read())
    assert not [n for n in ast.walk(tree) if isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))], m
  assert edges["tenplex_jax.runtime.env"] == {"tenplex_jax.errors"}
