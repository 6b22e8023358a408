"""What TLS costs on a store restore: a state (default 1 GiB) restored from
two store servers over plain HTTP and over HTTPS, side by side in one run.

An old job of ``--procs`` processes saves the state once, each process its
shards into its own store directory (so each of the two stores holds half
of the state). Then, per method, two ``tenplex-jax store serve`` processes
serve those directories on 127.0.0.1 (``http``: plain; ``https``: with
``--tls-cert``/``--tls-key``, certificates made with ``trustme``, clients
verifying against ``TENPLEX_JAX_STORE_CA``), both with a job token, and a
new job of ``--new-procs`` fresh processes on new "hosts" (no local store)
restores the whole state from them: every byte crosses the loopback
network. The servers and the restoring processes are fresh per method;
the order of the methods rotates per round (``--repeat``). Time: the
slowest process's ``restore_with_report`` (process start-up excluded; each
worker touches and frees ``--prefault-gib`` of fresh memory first, as
benchmarks/bench_store.py). Also the CPU seconds (user + system) of the
restoring processes (whole processes: start-up, prefault and the check
included, the same for both methods) and of the two servers (start-up
included), which show the cost of encryption on a loaded machine better
than wall time. Values are checked bitwise.

  python benchmarks/bench_store_tls.py --gib 1 --out bench_store_tls_result.json

Needs ``trustme`` (the test extra).
"""

import argparse
import json
import math
import os
import platform
import resource
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
import bench_store  # noqa: E402  (its save/restore workers)

METHODS = ("http", "https")
CA_ENV = "TENPLEX_JAX_STORE_CA"
TOKEN_ENV = "TENPLEX_JAX_STORE_TOKEN"


def make_pki(d):
  import trustme
  ca = trustme.CA()
  cert = ca.issue_cert("127.0.0.1")
  out = {k: os.path.join(d, f"{k}.pem") for k in ("ca", "cert", "key")}
  ca.cert_pem.write_to_path(out["ca"])
  cert.private_key_and_cert_chain_pem.write_to_path(out["cert"])
  cert.private_key_pem.write_to_path(out["key"])
  os.chmod(out["key"], 0o600)
  return out


def server(d, log, env, tls):
  """``store serve`` of ``d``; (process, URL)."""
  ready = os.path.join(d, ".ready")
  if os.path.exists(ready):
    os.unlink(ready)
  cmd = [sys.executable, "-m", "tenplex_jax", "store", "serve", "--dir", d,
         "--port", "0", "--ready-file", ready, "--read-only"]
  if tls:
    cmd += ["--tls-cert", tls["cert"], "--tls-key", tls["key"]]
  p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                       start_new_session=True)
  while not os.path.exists(ready):
    if p.poll() is not None:
      raise RuntimeError(f"store server of {d} failed (see the log)")
    time.sleep(0.05)
  with open(ready) as f:
    return p, ("https://" if tls else "http://") + f.read().strip()


def _cpu(pid):
  """User + system CPU seconds of a running process so far."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop(procs):
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  for p in procs:
    try:
      p.wait(10)
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait(10)


def one(method, base, stores, pki, tmp, log):
  """Serves the two stores with ``method`` and restores from them in fresh
  processes; the record."""
  from tenplex_jax.store import RemoteStore
  tls = pki if method == "https" else None
  env = {**os.environ, "PYTHONPATH": ROOT}
  env.pop(CA_ENV, None)
  if tls:
    env[CA_ENV] = pki["ca"]
  srvs = []
  old_env = dict(os.environ)
  try:
    srvs = [server(d, log, env, tls) for d in stores]
    urls = [u for _, u in srvs]
    os.environ.clear()
    os.environ.update(env)  # bench_store.run hands os.environ on
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = bench_store.run({**base, "method": "tenplex", "action": "restore",
                         "procs": base["new_procs"], "stores": stores,
                         "shared": None,
                         "locations": [urls] * base["new_procs"]},
                        tmp, f"{method}-restore")
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds (user + system): the restoring processes (waited for,
    # so counted in RUSAGE_CHILDREN) and the servers (still running).
    client_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    server_cpu = sum(_cpu(p.pid) for p, _ in srvs)
    wire = []
    for u in urls:
      with RemoteStore(u, ca_file=pki["ca"] if tls else None) as rs:
        wire.append(rs.stats())
  finally:
    os.environ.clear()
    os.environ.update(old_env)
    stop([p for p, _ in srvs])
  return {"restore_s": max(x["seconds"] for x in r),
          "client_cpu_s": client_cpu, "server_cpu_s": server_cpu,
          "restore_s_per_process": [x["seconds"] for x in r],
          "ok": all(x["ok"] for x in r),
          "network_bytes": sum(x["network_bytes"] for x in r),
          "local_bytes": sum(x["local_bytes"] for x in r),
          "wire_bytes": sum(w["bytes_sent"] for w in wire),
          "server_read_s": sum(w.get("read_s", 0) for w in wire),
          "server_send_s": sum(w.get("send_s", 0) for w in wire),
          "restore_phases": {k: max(x["phases"][k] for x in r)
                             for k in r[0]["phases"]}}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gib", type=float, default=1.0, help="state size")
  ap.add_argument("--tensors", type=int, default=8)
  ap.add_argument("--procs", type=int, default=2,
                  help="saving processes = stores = servers")
  ap.add_argument("--new-procs", type=int, default=2,
                  help="restoring processes")
  ap.add_argument("--devices", type=int, default=2)
  ap.add_argument("--methods", default=",".join(METHODS))
  ap.add_argument("--repeat", type=int, default=1)
  ap.add_argument("--prefault-gib", type=float, default=None,
                  help="as benchmarks/bench_store.py")
  ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm")
                  else None)
  ap.add_argument("--out", default=None)
  a = ap.parse_args()
  if a.prefault_gib is None:
    import psutil
    share = a.gib / a.new_procs
    cap = 0.3 * psutil.virtual_memory().available / (1 << 30) / (
        a.new_procs + 1)
    a.prefault_gib = round(min(4 * share, cap), 2)
  methods = [m for m in a.methods.split(",") if m]
  cols = 1024 * math.lcm(a.procs * a.devices, a.new_procs * a.devices)
  rows = max(1, int(a.gib * (1 << 30) / a.tensors / (cols * 4)))
  base = {"procs": a.procs, "new_procs": a.new_procs,
          "prefault_gib": a.prefault_gib, "devices": a.devices, "rows": rows,
          "cols": cols, "tensors": a.tensors}
  state_bytes = rows * cols * 4 * a.tensors
  runs = {m: [] for m in methods}
  tmp = tempfile.mkdtemp(prefix="tenplex-bench-tls-", dir=a.dir)
  os.chmod(tmp, 0o700)
  old_env = dict(os.environ)
  try:
    pki = make_pki(tmp)
    os.environ[TOKEN_ENV] = "bench-" + os.urandom(16).hex()
    os.environ.pop(CA_ENV, None)
    log = open(os.path.join(tmp, "servers.log"), "w")
    stores = [os.path.join(tmp, f"host{i}") for i in range(a.procs)]
    t0 = time.perf_counter()
    bench_store.run({**base, "method": "tenplex", "action": "save",
                     "stores": stores, "shared": None}, tmp, "save")
    print(f"saved {state_bytes / (1 << 30):.2f} GiB into {a.procs} stores"
          f" in {time.perf_counter() - t0:.1f} s (setup, not timed)",
          flush=True)
    try:
      for rnd in range(a.repeat):
        order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
        for m in order:
          rec = one(m, base, stores, pki, tmp, log)
          runs[m].append(rec)
          print(f"round {rnd} {m:>5}: restore {rec['restore_s']:.2f} s"
                f" ({rec['network_bytes'] / (1 << 30):.2f} GiB over the"
                f" network) ok={rec['ok']}", flush=True)
    finally:
      log.close()
  finally:
    os.environ.clear()
    os.environ.update(old_env)
    shutil.rmtree(tmp, ignore_errors=True)
  med = {m: {"restore_s": statistics.median(r["restore_s"] for r in rs),
             "client_cpu_s": statistics.median(r["client_cpu_s"]
                                               for r in rs),
             "server_cpu_s": statistics.median(r["server_cpu_s"]
                                               for r in rs),
             "network_bytes": rs[-1]["network_bytes"],
             "ok": all(r["ok"] for r in rs)} for m, rs in runs.items()}
  for m in med:
    med[m]["gib_per_s"] = med[m]["network_bytes"] / (1 << 30) / \
        med[m]["restore_s"]
  if "http" in med and "https" in med:
    med["https"]["x_http"] = med["https"]["restore_s"] / \
        med["http"]["restore_s"]
    med["https"]["extra_cpu_s"] = sum(
        med["https"][k] - med["http"][k]
        for k in ("client_cpu_s", "server_cpu_s"))
  print(f"\n{state_bytes / (1 << 30):.2f} GiB ({a.tensors} tensors"
        f" [{rows}, {cols}]) from {a.procs} store servers onto"
        f" {a.new_procs}x{a.devices} processes x devices;"
        f" {os.cpu_count()} CPU cores; median of {a.repeat}")
  print(f"{'method':>6} {'restore s':>9} {'GiB/s':>6} {'x http':>7}"
        f" {'client CPU s':>12} {'server CPU s':>12} ok")
  for m, r in med.items():
    rel = f"{r['x_http']:.2f}x" if "x_http" in r else "-"
    print(f"{m:>6} {r['restore_s']:9.2f} {r['gib_per_s']:6.2f} {rel:>7}"
          f" {r['client_cpu_s']:12.2f} {r['server_cpu_s']:12.2f} {r['ok']}")
  doc = {"machine": {"cpu_count": os.cpu_count(),
                     "platform": platform.platform(),
                     "python": platform.python_version(),
                     "openssl": ssl.OPENSSL_VERSION, "dir": a.dir},
         "state_bytes": state_bytes, "tensors": a.tensors,
         "tensor_shape": [rows, cols], "procs": a.procs,
         "new_procs": a.new_procs, "devices_per_proc": a.devices,
         "repeat": a.repeat, "prefault_gib": a.prefault_gib,
         "summary": med, "runs": runs}
  if a.out:
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1)
  if not all(r["ok"] for r in med.values()):
    sys.exit("some restore did not give back the saved values")


if __name__ == "__main__":
  main()
