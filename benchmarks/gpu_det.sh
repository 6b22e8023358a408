#!/usr/bin/env bash
# The deterministic step on one GPU, 100M params, float32 and bfloat16, DP,
# V/n = 1 and 8: each worker isolated by optimisation barriers (``det``, the
# GPU default since _ISOLATE_BY_COND) against the per-worker lax.cond
# (``det_cond``, the GPU default before), the plain step, plain gradient
# accumulation (``plain_acc``) and the same with a cond per microbatch
# (``plain_acc_cond``), all from one run; --check-bits: ``det`` and
# ``det_cond`` each against V single-worker steps summed by tree_sum (what V
# devices with one worker each compute), and against each other.
# One command, under 4 minutes on an H200; the JSON goes to $OUT.
#   OUT=/some/dir bash benchmarks/gpu_det.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_det_out}
mkdir -p "$OUT"
# The GPU determinism flags (determinism.GPU_DETERMINISM_FLAGS), as a user
# of the deterministic step sets them; every program is compiled with them.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true --xla_gpu_exclude_nondeterministic_ops=true"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import jax, tenplex_jax; print("jax", jax.__version__, jax.devices(), tenplex_jax.__file__, flush=True)'
python3 -c 'import jax, sys; sys.exit(0 if jax.default_backend() == "gpu" else "no GPU backend: " + jax.default_backend())'
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
# The benchmark rewrites its JSON after every cell: a run cut by the
# timeout keeps the cells it finished.
timeout 210 python3 benchmarks/bench_determinism.py --sizes 100m \
  --dtypes float32,bfloat16 --layouts dp --devices 1 --ratios 1,8 --reps 20 \
  --methods plain,plain_acc,plain_acc_cond,det,det_cond --check-bits \
  --out "$OUT/bench_determinism_gpu_barrier_result.json" \
  > "$OUT/gpu_det.stdout" 2> >(tee "$OUT/gpu_det.stderr" >&2) \
  || echo "bench_determinism exited $? (124: the timeout; the JSON keeps the finished cells)"
python3 - "$OUT/bench_determinism_gpu_barrier_result.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["machine"], "jax", d["jax"], "complete", d["complete"])
for r in d["rows"]:
    s = r.get("seconds", {})
    b = s.get("plain_acc") or 1
    print(r["dtype"], "V/n", r["workers_per_device"],
          {k: f"{v * 1e3:.2f} ms" for k, v in s.items()},
          "/plain_acc", {k: round(v / b, 3) for k, v in s.items()},
          "temp MiB", {k: m["temp"] >> 20 for k, m in r["xla_bytes_per_device"].items()},
          "bits", r.get("bitwise"))
PY
