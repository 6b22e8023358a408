"""Renders a ``bench_determinism.py`` JSON result as the tables in docs/determinism.md.

  python benchmarks/render_determinism_md.py benchmarks/bench_determinism_100m_s30_result.json

Two tables and a paragraph: XLA's temporary buffers per device by method
(MiB, from the compiled programs), step times (wall medians and minima, ratios
to ``plain`` and ``plain_acc``, and CPU seconds), and a line per profiled cell
with its op time by kind; for runs that recorded them, a third table of the
kernel's share per step (system seconds and minor page faults). Each row is
one cell of the run; a run without ``plain`` is compared with its first method
and ``plain_acc``.
"""

from __future__ import annotations

import json
import sys

MIB = 1 << 20


def _f(v, nd=2) -> str:
  return "-" if v is None else f"{v:.{nd}f}"


def _cells(doc: dict) -> list[dict]:
  rows = [r for r in doc["rows"] if "seconds" in r]
  return sorted(rows, key=lambda r: (r["size"], r["dtype"] != "float32",
                                     r["workers_per_device"], r["layout"]))


def _methods(rows: list[dict]) -> list[str]:
  seen: dict[str, None] = {}
  for r in rows:
    for m in r["seconds"]:
      seen.setdefault(m, None)
  return list(seen)


def _base(ms: list[str]) -> str:
  """The method the others are compared with first: ``plain`` where the
  run has it, else its first method."""
  return "plain" if "plain" in ms else ms[0]


def memory_table(doc: dict) -> str:
  rows = _cells(doc)
  ms = _methods(rows)
  base = _base(ms)
  det_acc = base != "plain_acc" and {"det", "plain_acc"} <= set(ms)
  head = (f"| dtype | layout | V/n | temp MiB: {' / '.join(ms)} |"
          + "".join(f" {m} / {base} |" for m in ms if m != base)
          + (" det / plain_acc |" if det_acc else ""))
  lines = [head, "|---|---|---:|---|" + "---:|" * (head.count("|") - 5)]
  for r in rows:
    xb = r["xla_bytes_per_device"]
    temp = {m: xb[m]["temp"] for m in ms if m in xb}
    line = (f"| {r['dtype']} | {r['layout']} | {r['workers_per_device']} |"
            f" {' / '.join(str(round(temp[m] / MIB)) if m in temp else '-' for m in ms)} |")
    for m in ms:
      if m != base:
        line += f" {_f(temp[m] / temp[base] if m in temp else None)} |"
    if det_acc:
      line += f" {_f(temp['det'] / temp['plain_acc'])} |"
    lines.append(line)
  return "\n".join(lines)


def _ratios(r: dict, base: str) -> dict | None:
  """``r``'s times over ``base``'s (median, min; CPU where recorded)."""
  if f"ratio_to_{base}_by" in r:
    return r[f"ratio_to_{base}_by"]
  if base not in r["seconds"]:
    return None
  med, lo = r["seconds"], r["min_seconds"]  # (results before the CPU times)
  return {"median": {m: t / med[base] for m, t in med.items()},
          "min": {m: t / lo[base] for m, t in lo.items()}, "cpu_median": {}}


def time_table(doc: dict) -> str:
  rows = _cells(doc)
  ms = _methods(rows)
  first = _base(ms)
  others = [m for m in ms if m not in ("plain", "plain_acc", first)]
  head = f"| dtype | layout | V/n | {first} s (med / min) |"
  if first == "plain" and "plain_acc" in ms:
    head += " plain_acc / plain |"
  for m in others:
    if "plain" in ms:
      head += f" {m} / plain (med / min) |"
    if "plain_acc" in ms:
      head += f" {m} / plain_acc (med / min / CPU) |"
  head += " CPU s per step: " + " / ".join(ms) + " |"
  lines = [head, "|---|---|---:|" + "---|" * (head.count("|") - 4)]
  for r in rows:
    by, acc = _ratios(r, "plain"), _ratios(r, "plain_acc")
    line = (f"| {r['dtype']} | {r['layout']} | {r['workers_per_device']} |"
            f" {_f(r['seconds'][first])} / {_f(r['min_seconds'][first])} |")
    if first == "plain" and "plain_acc" in ms:
      line += f" {_f(by['median'].get('plain_acc'))} |"
    for m in others:
      if "plain" in ms:
        line += f" {_f(by['median'].get(m))} / {_f(by['min'].get(m))} |"
      if "plain_acc" in ms:
        line += (f" {_f(acc['median'].get(m))} / {_f(acc['min'].get(m))} /"
                 f" {_f(acc['cpu_median'].get(m))} |")
    cpu = r.get("cpu_seconds", {})
    line += " " + " / ".join(_f(cpu.get(m)) for m in ms) + " |"
    lines.append(line)
  return "\n".join(lines)


def kernel_table(doc: dict) -> str:
  """System seconds and minor page faults per step by method (medians), with
  the run's ``GLIBC_TUNABLES``; empty for runs that did not record them."""
  rows = [r for r in _cells(doc) if "minor_faults" in r]
  if not rows:
    return ""
  ms = _methods(rows)
  head = ("| dtype | layout | V/n | GLIBC_TUNABLES | system s per step: "
          + " / ".join(ms) + " | minor faults per step (thousands): "
          + " / ".join(ms) + " |")
  lines = [head, "|---|---|---:|---|---|---|"]
  for r in rows:
    sys_s, faults = r["system_seconds"], r["minor_faults"]
    lines.append(
        f"| {r['dtype']} | {r['layout']} | {r['workers_per_device']} |"
        f" {r.get('glibc_tunables') or '(none)'} |"
        f" {' / '.join(_f(sys_s.get(m)) for m in ms)} |"
        f" {' / '.join(str(round(faults[m] / 1000)) if m in faults else '-' for m in ms)} |")
  return "\n".join(lines)


def profile_lines(doc: dict) -> str:
  out = []
  for cell, by_method in doc.get("profiles", {}).items():
    parts = []
    for m, p in by_method.items():
      ops = ", ".join(f"{k} {v:.0f}" for k, v in
                      p["op_ms_per_step_all_devices"].items() if v >= 1)
      parts.append(f"{m} {p['wall_ms_per_step']:.0f} ms wall ({ops})")
    out.append(f"XLA op time per step summed over the devices, {cell} (ms): "
               + "; ".join(parts) + ".")
  return "\n\n".join(out)


def render(doc: dict) -> str:
  return "\n\n".join(s for s in (memory_table(doc), time_table(doc),
                                 kernel_table(doc), profile_lines(doc)) if s)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1:
    print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
    return 2
  with open(argv[0]) as f:
    print(render(json.load(f)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
