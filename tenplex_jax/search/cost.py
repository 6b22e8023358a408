"""The analytical cost model: step time and peak memory per device.

Every function here is vectorised over candidates (numpy arrays of equal
length), so the search prices thousands of layouts in one pass. Formulas are
written out in ``docs/search.md``; the short form:

* compute: ``(6 N + 12 L s h) * B s`` FLOPs per step (plus the recompute of
  remat), at ``peak * mfu * w/(w + w0) * r/(r + r0)`` per device, where ``w``
  is the per-device GEMM width ``h / t`` and ``r`` the rows per micro-batch
  ``b s``;
* tensor parallel: Megatron's 2 + 2 activation all-reduces per layer and
  micro-batch (6 with full remat) of ``b s h`` elements;
* pipeline: 1F1B, ``(m + p - 1)`` slots of one micro-batch's stage time
  (bubble fraction ``(p - 1) / (m + p - 1)``), plus point-to-point sends of
  ``b s h / t`` elements each way per micro-batch;
* data parallel: ring all-reduce of the local gradient once per step,
  ``1 - dp_overlap`` of it exposed;
* FSDP: per micro-batch, all-gather the parameters for forward and backward
  (and the recompute) and reduce-scatter the gradient, ``1 - fsdp_overlap``
  exposed;
* ring collectives: all-reduce ``2 (n-1)/n * bytes / bw + 2 (n-1) lat``,
  all-gather / reduce-scatter ``(n-1)/n * bytes / bw + (n-1) lat``.

All tunable constants live in :class:`Calibration`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tenplex_jax.errors import SearchError
from tenplex_jax.search.hardware import GiB, Topology
from tenplex_jax.search.model import LOGICAL_TO_MESH, ModelSpec

REMAT_CHOICES: tuple[str, ...] = ("none", "selective", "full")
MESH_AXES: tuple[str, ...] = ("data", "fsdp", "pipeline", "tensor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
  """All calibration constants of the cost model, in one place.

  None is fitted to a measurement on this project's machines; each is a
  published ballpark (see ``docs/search.md``). Change them here, not in the
  formulas.

  Attributes:
    mfu: fraction of peak FLOP/s a transformer layer reaches with large
      GEMMs, non-GEMM kernels included, before communication and bubbles
      (Megatron-LM reaches 0.5-0.6 of peak per GPU on large GPT models).
    gemm_width0: per-device GEMM width ``h / t`` at which kernel efficiency
      halves; models the loss of large tensor degrees (``w / (w + w0)``).
    gemm_rows0: rows per micro-batch ``b s`` at which efficiency halves
      (``r / (r + r0)``); models the loss of tiny micro-batches.
    fast_efficiency: achieved fraction of NVLink/ICI bandwidth (NCCL bus
      bandwidth over link peak).
    host_efficiency: achieved fraction of PCIe bandwidth between fast domains.
    inter_efficiency: achieved fraction of the network bandwidth for NCCL
      collectives. 0.4 (5 GB/s on 100 Gb/s InfiniBand) is the one constant
      set with the paper's Fig. 3 in mind: PCIe hosts like the paper's A6000
      machines stage inter-host traffic through host memory and share one
      NIC; docs/search.md shows how the ranking moves with it.
    dp_overlap: fraction of the data-parallel gradient all-reduce hidden
      behind the backward pass. 0 (all exposed) matches Megatron-LM 23.06
      used in the paper, which reduces gradients after the backward pass;
      raise it for frameworks that bucket and overlap the reduction.
    fsdp_overlap: fraction of FSDP gathers/scatters hidden by prefetching.
    memory_margin: fraction of device memory kept free (allocator
      fragmentation, XLA temporaries the model does not see). A layout is
      feasible when ``memory_bytes <= (1 - memory_margin) * device memory``.
    overhead_bytes: fixed per-device memory for the runtime, CUDA context,
      cuBLAS/NCCL workspaces.
    logits_bytes: bytes per logit element kept for the loss: fp32 logits and
      their gradient (4 + 4).
    microbatch_overhead_s: host-side seconds per micro-batch slot on a stage
      (schedule step, point-to-point handshakes, kernel launches of a forward
      and a backward pass); penalises very many tiny micro-batches.
  """

  mfu: float = 0.55
  gemm_width0: float = 128.0
  gemm_rows0: float = 128.0
  fast_efficiency: float = 0.8
  host_efficiency: float = 0.7
  inter_efficiency: float = 0.4
  dp_overlap: float = 0.0
  fsdp_overlap: float = 0.5
  memory_margin: float = 0.10
  overhead_bytes: int = 1 * GiB
  logits_bytes: float = 8.0
  microbatch_overhead_s: float = 2e-3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """What one training step processes and how state is stored.

  Bytes per parameter default to mixed-precision Adam: bf16/fp16 weights (2),
  bf16/fp16 gradients (2), and ``optimizer_bytes`` = 12 for the fp32 master
  copy plus the two fp32 Adam moments (4 + 4 + 4): 16 bytes per parameter in
  all. Use ``grad_bytes=4`` for fp32 gradient accumulation (18 bytes) or
  ``optimizer_bytes=8`` when the weights themselves are fp32 and there is no
  master copy.

  Example:
    >>> Workload(global_batch=128, seq_len=1024).state_bytes
    16
  """

  global_batch: int
  seq_len: int
  param_bytes: int = 2
  grad_bytes: int = 2
  optimizer_bytes: int = 12
  activation_bytes: int = 2

  def __post_init__(self):
    if self.global_batch < 1 or self.seq_len < 1:
      raise SearchError(
          f"global_batch and seq_len must be >= 1, got {self.global_batch},"
          f" {self.seq_len}")

  @property
  def state_bytes(self) -> int:
    """Bytes of training state per parameter (weights + grads + optimizer)."""
    return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclasses.dataclass(frozen=True)
class AxisLink:
  """How the groups of one mesh axis communicate.

  Attributes:
    tier: ``'none'`` (size 1), ``'fast'``, ``'host'`` or ``'inter'``.
    bw: achieved bandwidth per group in bytes/s (efficiency and NIC sharing
      applied).
    latency: seconds per ring step.
  """

  tier: str
  bw: float
  latency: float


def axis_link(topo: Topology, calib: Calibration, *, size: int,
              stride: int) -> AxisLink:
  """Prices one mesh axis: the slowest tier its groups span.

  Group members of an axis with ``size`` n and ``stride`` st are devices
  ``base + k st``. A group inside one fast domain uses the fast tier, inside
  one host the PCIe tier, otherwise the network, whose per-host bandwidth is
  shared by the ``devices_per_host / members_per_host`` groups leaving the
  host at once (all groups of an axis run the same collective together).

  Example:
    >>> from tenplex_jax.search.hardware import Topology
    >>> topo = Topology.from_preset("a6000", devices=16, devices_per_host=4)
    >>> axis_link(topo, Calibration(), size=2, stride=1).tier
    'fast'
    >>> axis_link(topo, Calibration(), size=4, stride=1).tier
    'host'
    >>> link = axis_link(topo, Calibration(), size=2, stride=8)
    >>> link.tier, round(link.bw / 1e9, 3)
    ('inter', 1.25)
  """
  hw = topo.hardware
  if size <= 1:
    return AxisLink("none", float("inf"), 0.0)
  dph = topo.devices_per_host
  bases = np.arange(min(stride, dph * topo.fast_domain))
  members = bases[:, None] + np.arange(size)[None, :] * stride
  hosts = members // dph
  domains = members // topo.fast_domain
  host_lo, host_hi = hosts.min(axis=1), hosts.max(axis=1)
  dom_lo, dom_hi = domains.min(axis=1), domains.max(axis=1)
  fast = (hw.fast_bw * calib.fast_efficiency, hw.fast_latency)
  pcie = (hw.host_bw * calib.host_efficiency, hw.host_latency)
  if np.all(host_lo == host_hi):
    if np.all(dom_lo == dom_hi):
      return AxisLink("fast", *fast)
    return AxisLink("host", *pcie)
  spanned = int((host_hi - host_lo + 1).max())
  per_host = max(1, size // spanned)
  sharing = max(1.0, dph / per_host)
  bw = hw.inter_bw * calib.inter_efficiency / sharing
  if per_host > 1:  # the ring also runs inside each host
    same_domain = per_host <= topo.fast_domain and stride * (per_host - 1) < topo.fast_domain
    bw = min(bw, fast[0] if same_domain else pcie[0])
  return AxisLink("inter", bw, hw.inter_latency)


def mesh_links(topo: Topology, calib: Calibration, *, data: int, fsdp: int,
               pipeline: int, tensor: int) -> dict[str, AxisLink]:
  """Links of all four axes for the device order data > fsdp > pipeline > tensor.

  Device ``i`` of the flattened mesh ``(data, fsdp, pipeline, tensor)`` is
  global device ``i``: tensor is innermost (neighbours, NVLink first),
  data outermost.

  Example:
    >>> from tenplex_jax.search.hardware import Topology
    >>> topo = Topology.from_preset("a6000", devices=16, devices_per_host=4)
    >>> links = mesh_links(topo, Calibration(), data=2, fsdp=1, pipeline=4, tensor=2)
    >>> [links[a].tier for a in ("tensor", "pipeline", "data")]
    ['fast', 'inter', 'inter']
  """
  strides = {"tensor": 1, "pipeline": tensor, "fsdp": tensor * pipeline,
             "data": tensor * pipeline * fsdp}
  sizes = {"data": data, "fsdp": fsdp, "pipeline": pipeline, "tensor": tensor}
  return {a: axis_link(topo, calib, size=sizes[a], stride=strides[a])
          for a in MESH_AXES}


def ring_allreduce(n, nbytes, bw, latency):
  """Ring all-reduce seconds: ``2 (n-1)/n * bytes / bw + 2 (n-1) latency``.

  Example:
    >>> round(float(ring_allreduce(2, 1e9, 1e10, 0.0)), 3)
    0.1
  """
  n = np.asarray(n, dtype=np.float64)
  out = 2.0 * (n - 1.0) / n * nbytes / bw + 2.0 * (n - 1.0) * latency
  return np.where(n > 1, out, 0.0)


def ring_gather(n, nbytes, bw, latency):
  """Ring all-gather or reduce-scatter of ``nbytes`` (the full, gathered size).

  ``(n-1)/n * bytes / bw + (n-1) latency``.

  Example:
    >>> round(float(ring_gather(4, 4e9, 1e10, 0.0)), 3)
    0.3
  """
  n = np.asarray(n, dtype=np.float64)
  out = (n - 1.0) / n * nbytes / bw + (n - 1.0) * latency
  return np.where(n > 1, out, 0.0)


def sharded_param_count(model: ModelSpec, *, data: int, fsdp: int,
                        pipeline: int, tensor: int) -> float:
  """Parameter elements one device holds under the candidate's rules.

  A logical axis shards over its mesh axis (``LOGICAL_TO_MESH``) only when
  every dimension carrying it divides; otherwise it stays replicated and its
  full size counts. Several names mapping to one mesh axis shard once.

  Example:
    >>> from tenplex_jax.search.model import model_preset
    >>> m = model_preset("gpt3-2.7b")
    >>> full = sharded_param_count(m, data=1, fsdp=1, pipeline=1, tensor=1)
    >>> full == m.param_count
    True
    >>> round(sharded_param_count(m, data=1, fsdp=1, pipeline=4, tensor=2) / full, 3)
    0.145
  """
  sizes = {"data": data, "fsdp": fsdp, "pipeline": pipeline, "tensor": tensor}
  active = {n: model.divisible(n, sizes[ax]) for n, ax in LOGICAL_TO_MESH.items()}
  total = 0.0
  for g in model.groups:
    axes = {LOGICAL_TO_MESH[n] for n in g.names if n in LOGICAL_TO_MESH and active[n]}
    div = 1
    for ax in axes:
      div *= sizes[ax]
    total += g.count / div
  return total


def estimate(model: ModelSpec, topo: Topology, work: Workload,
             calib: Calibration, *, data, fsdp, pipeline, tensor,
             microbatches, remat, params_per_device,
             links: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """Vectorised step time and memory for candidates given as arrays.

  Args:
    model, topo, work, calib: the inputs.
    data, fsdp, pipeline, tensor, microbatches: int arrays, one per candidate.
    remat: int array of indices into ``REMAT_CHOICES``.
    params_per_device: parameter elements per device
      (:func:`sharded_param_count`).
    links: ``links[axis]['bw' | 'latency']`` arrays from :func:`mesh_links`.

  Returns:
    Arrays ``step_time_s``, ``memory_bytes`` and the breakdown terms
    (``compute_s``, ``bubble_s``, ``tensor_comm_s``, ``pipeline_p2p_s``,
    ``data_comm_s``, ``fsdp_comm_s``, ``weights_bytes``, ``activation_bytes``,
    ``logits_bytes``, ``fsdp_buffer_bytes``, ``overhead_bytes``).
  """
  d = np.asarray(data, np.float64)
  f = np.asarray(fsdp, np.float64)
  p = np.asarray(pipeline, np.float64)
  t = np.asarray(tensor, np.float64)
  m = np.asarray(microbatches, np.float64)
  r = np.asarray(remat)
  L, h, a = float(model.layers), float(model.hidden), float(model.heads)
  V, N = float(model.vocab), float(model.param_count)
  s = float(work.seq_len)
  b = work.global_batch / (d * f * m)           # samples per micro-batch per replica
  n_dev = d * f * p * t
  ab = work.activation_bytes

  # ---- memory -----------------------------------------------------------
  weights = np.asarray(params_per_device, np.float64) * work.state_bytes
  # Korthikanti et al. 2022, eq. 2 (no sequence parallelism), 2-byte
  # activations: s b h (10 + 24/t + 5 a s / (h t)) bytes per layer.
  full_layer = s * b * h * (10.0 + 24.0 / t + 5.0 * a * s / (h * t)) * (ab / 2.0)
  selective_layer = s * b * h * (10.0 + 24.0 / t) * (ab / 2.0)
  layers_per_stage = L / p
  inflight = np.where(p > 1, np.minimum(p, m), 1.0)
  act = np.select(
      [r == 0, r == 1],
      [layers_per_stage * inflight * full_layer,
       layers_per_stage * inflight * selective_layer],
      layers_per_stage * inflight * ab * s * b * h + full_layer)
  logits = b * s * V / t * calib.logits_bytes
  # FSDP keeps two gathered layers (current + prefetched); bounded by the
  # per-stage parameters spread over the stage's layers.
  layer_params = np.asarray(params_per_device, np.float64) * f / layers_per_stage
  fsdp_buf = np.where(f > 1, 2.0 * layer_params * work.param_bytes, 0.0)
  overhead = np.full_like(d, float(calib.overhead_bytes))
  memory = weights + act + logits + fsdp_buf + overhead

  # ---- compute ----------------------------------------------------------
  # FLOPs per token: 6 N for the GEMMs (fwd + bwd) plus 12 L s h for the
  # attention scores; remat adds a forward (2 N + 4 L s h) or, selective, the
  # attention scores' forward (4 L s h). The LM head (6 V h, tied to the
  # embedding) runs on the last pipeline stage only, so that stage is the
  # slowest: the slot time of the pipeline is the last stage's time.
  head = 6.0 * V * h
  body = 6.0 * (N - V * h) + 12.0 * L * s * h
  recompute = np.select([r == 0, r == 1], [0.0, 4.0 * L * s * h],
                        (body + head) / 3.0)
  stage_flops = np.where(p > 1, (body + recompute) / p + head, body + recompute + head)
  flops = (body + head + recompute) * work.global_batch * s
  width = h / t
  rows = b * s
  eff = calib.mfu * width / (width + calib.gemm_width0) * rows / (rows + calib.gemm_rows0)
  rate = topo.hardware.peak_flops * eff
  # One micro-batch on the slowest stage: b s tokens over t devices.
  c_mb = stage_flops * b * s / (t * rate)
  compute = flops / (n_dev * rate)              # the balanced share, for reports

  # ---- tensor parallel: activation all-reduces per layer and micro-batch --
  # Per layer 2 forward + 2 backward (+2 recomputed forward with full remat);
  # plus the vocab-parallel embedding's forward all-reduce (first stage) and
  # the LM head's input-gradient all-reduce (last stage): 2 without pipeline,
  # 1 on the slowest stage with it.
  n_ar = np.where(r == 2, 6.0, 4.0)
  n_extra = np.where(V > 0, np.where(p > 1, 1.0, 2.0), 0.0)
  tp_mb = (layers_per_stage * n_ar + n_extra) * ring_allreduce(
      t, b * s * h * ab, links["tensor"]["bw"], links["tensor"]["latency"])

  # ---- pipeline: point-to-point + bubble ---------------------------------
  p2p_bytes = b * s * h * ab / t
  p2p_mb = np.where(p > 1, 2.0 * (links["pipeline"]["latency"]
                                  + p2p_bytes / links["pipeline"]["bw"]), 0.0)
  slot = c_mb + tp_mb + p2p_mb + calib.microbatch_overhead_s
  bubble = (p - 1.0) * slot

  # ---- data parallel: gradient all-reduce once per step --------------------
  grad_bytes = np.asarray(params_per_device, np.float64) * work.grad_bytes
  dp = ring_allreduce(d, grad_bytes, links["data"]["bw"], links["data"]["latency"])
  dp_exposed = (1.0 - calib.dp_overlap) * dp

  # ---- FSDP: gather params (fwd, bwd, recompute) + scatter grads per mb ----
  gathered = np.asarray(params_per_device, np.float64) * f
  n_ag = np.where(r == 2, 3.0, 2.0)
  fsdp_mb = (n_ag * ring_gather(f, gathered * work.param_bytes, links["fsdp"]["bw"],
                                links["fsdp"]["latency"])
             + ring_gather(f, gathered * work.grad_bytes, links["fsdp"]["bw"],
                           links["fsdp"]["latency"]))
  fsdp_exposed = (1.0 - calib.fsdp_overlap) * m * fsdp_mb

  step = m * slot + bubble + dp_exposed + fsdp_exposed
  return {
      "step_time_s": step,
      "memory_bytes": memory,
      "compute_s": compute,
      "stage_imbalance_s": m * c_mb - compute,
      "tensor_comm_s": m * tp_mb,
      "pipeline_p2p_s": m * p2p_mb,
      "bubble_s": bubble,
      "microbatch_overhead_s": m * calib.microbatch_overhead_s,
      "data_comm_s": dp_exposed,
      "fsdp_comm_s": fsdp_exposed,
      "weights_bytes": weights,
      "activation_bytes": act,
      "logits_bytes": logits,
      "fsdp_buffer_bytes": fsdp_buf,
      "overhead_bytes": overhead,
  }


def check_remat(remat: Sequence[str]) -> None:
  bad = [x for x in remat if x not in REMAT_CHOICES]
  if bad or not remat:
    raise SearchError(f"remat choices must be a non-empty subset of {REMAT_CHOICES}, got {tuple(remat)}")
