"""Renders a bench_reshard JSON result as the Markdown tables in docs/.

  python benchmarks/render_md.py results/bench_reshard.json
"""

import json
import sys

MIB = 1 << 20


def f(v, nd=2):
  return "-" if v is None else f"{v:.{nd}f}"


def render(doc: dict) -> str:
  lines = ["| transition | method | cold s | warm s | cold s, every round"
           " | peak MiB | moved MiB | note |",
           "|---|---|---:|---:|---|---:|---:|---|"]
  for r in doc["results"]:
    note = r.get("failure", "")
    if r.get("check") not in (None, "ok"):
      note += " check failed"
    lines.append(
        f"| {r['transition']} | {r['method']} | {f(r.get('cold_seconds'), 3)}"
        f" | {f(r.get('warm_seconds'), 3)} |"
        f" {' / '.join(f(v, 3) for v in r.get('cold_all', []))} |"
        f" {'-' if r.get('peak_bytes') is None else round(r['peak_bytes'] / MIB)}"
        f" | {'-' if r.get('moved_bytes') is None else round(r['moved_bytes'] / MIB)}"
        f" | {note} |")
  lines += ["", "| transition | cold device_put / reshard | cold orbax / reshard"
            " | cold central / reshard | warm reshard / device_put"
            " | warm reshard / memcpy | targets met (cold dp, cold orbax,"
            " warm dp, warm memcpy) |", "|---|---:|---:|---:|---:|---:|---|"]
  yn = {True: "yes", False: "**no**", None: "n/a"}
  for t, s in doc["summary"].items():
    dp = f(s["cold_device_put_over_reshard"])
    if "cold_device_put_over_reshard_at_least" in s:
      dp = f">= {s['cold_device_put_over_reshard_at_least']:.1f} (stalled)"
    lines.append(
        f"| {t} | {dp} | {f(s['cold_orbax_over_reshard'])} |"
        f" {f(s['cold_central_over_reshard'])} |"
        f" {f(s['warm_reshard_over_device_put'])} |"
        f" {f(s['warm_reshard_over_memcpy'])} |"
        f" {', '.join(yn[v] for v in s['targets'].values())} |")
  return "\n".join(lines)


if __name__ == "__main__":
  print(render(json.load(open(sys.argv[1]))))
