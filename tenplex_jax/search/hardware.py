"""Hardware presets and the device topology the search prices collectives on.

Three bandwidth tiers, fastest first:

1. **fast domain**: devices joined by NVLink/NVSwitch/ICI. ``fast_domain``
   consecutive devices of a host form one domain (2 for the A6000's NVLink
   pairs, the whole host for NVSwitch machines).
2. **host**: devices in the same host but different fast domains talk over
   PCIe (``host_bw``).
3. **inter-host**: the network (``inter_bw`` is the aggregate NIC bandwidth
   of one host, shared by every group of an axis that leaves the host at the
   same time; see ``docs/search.md``).

Bandwidths are bytes per second in one direction; latencies are seconds per
ring step. Numbers are vendor peaks; the achieved fraction is a calibration
constant (:class:`tenplex_jax.search.cost.Calibration`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tenplex_jax.errors import SearchError

GiB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
  """One accelerator type and the links around it (no device count).

  Example:
    >>> hw = hardware_preset("a6000")
    >>> hw.memory_bytes // GiB, hw.fast_domain, hw.inter_bw / 1e9
    (48, 2, 12.5)
  """

  name: str
  memory_bytes: int
  peak_flops: float
  devices_per_host: int
  fast_domain: int
  fast_bw: float
  fast_latency: float
  host_bw: float
  host_latency: float
  inter_bw: float
  inter_latency: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
  """A concrete device set: a :class:`Hardware` times a device count.

  Devices are numbered host-major (device ``i`` lives on host
  ``i // devices_per_host``), the order of ``jax.devices()``.

  Example:
    >>> topo = Topology.from_preset("a6000", devices=16, devices_per_host=4)
    >>> topo.hosts, topo.fast_domain
    (4, 2)
  """

  hardware: Hardware
  devices: int
  devices_per_host: int

  def __post_init__(self):
    if self.devices < 1 or self.devices_per_host < 1:
      raise SearchError(
          f"topology needs devices >= 1 and devices_per_host >= 1, got"
          f" devices={self.devices}, devices_per_host={self.devices_per_host}")

  @classmethod
  def from_preset(cls, hardware: str | Hardware, *, devices: int,
                  devices_per_host: int | None = None) -> "Topology":
    """Builds a topology from a preset name or a :class:`Hardware`.

    ``devices_per_host`` defaults to the preset's (capped at ``devices``).

    Example:
      >>> Topology.from_preset("h100", devices=4).devices_per_host
      4
    """
    hw = hardware_preset(hardware) if isinstance(hardware, str) else hardware
    dph = devices_per_host or min(hw.devices_per_host, devices)
    return cls(hardware=hw, devices=devices, devices_per_host=dph)

  @property
  def hosts(self) -> int:
    """Number of hosts (the last may be partly used)."""
    return -(-self.devices // self.devices_per_host)

  @property
  def fast_domain(self) -> int:
    """Devices per fast (NVLink/ICI) domain, at most one host."""
    return max(1, min(self.hardware.fast_domain, self.devices_per_host))

  @property
  def memory_bytes(self) -> int:
    return self.hardware.memory_bytes


def _hw(**kw) -> Hardware:
  return Hardware(**kw)


# Vendor numbers (dense bf16/fp16 tensor peak, one-direction link bandwidth).
_PRESETS: Mapping[str, Hardware] = {
    # Tenplex section 6.1: 4 x RTX A6000 per host, NVLink bridges between
    # pairs (112.5 GB/s both ways), PCIe 4.0 x16 otherwise, 100 Gb/s IB.
    "a6000": _hw(name="a6000", memory_bytes=48 * GiB, peak_flops=154.8e12,
                 devices_per_host=4, fast_domain=2, fast_bw=56.25e9,
                 fast_latency=5e-6, host_bw=32e9, host_latency=10e-6,
                 inter_bw=12.5e9, inter_latency=15e-6),
    # DGX-1 style: NVLink 2 hybrid cube mesh (treated as one domain), 4 x EDR IB.
    "v100": _hw(name="v100", memory_bytes=16 * GiB, peak_flops=125e12,
                devices_per_host=8, fast_domain=8, fast_bw=75e9,
                fast_latency=5e-6, host_bw=16e9, host_latency=10e-6,
                inter_bw=50e9, inter_latency=15e-6),
    # DGX A100: NVSwitch (300 GB/s one way), 8 x 200 Gb/s HDR per host.
    "a100-40g": _hw(name="a100-40g", memory_bytes=40 * GiB, peak_flops=312e12,
                    devices_per_host=8, fast_domain=8, fast_bw=300e9,
                    fast_latency=3e-6, host_bw=32e9, host_latency=10e-6,
                    inter_bw=200e9, inter_latency=10e-6),
    "a100-80g": _hw(name="a100-80g", memory_bytes=80 * GiB, peak_flops=312e12,
                    devices_per_host=8, fast_domain=8, fast_bw=300e9,
                    fast_latency=3e-6, host_bw=32e9, host_latency=10e-6,
                    inter_bw=200e9, inter_latency=10e-6),
    # DGX H100: NVSwitch (450 GB/s one way), 8 x 400 Gb/s NDR per host.
    "h100": _hw(name="h100", memory_bytes=80 * GiB, peak_flops=989e12,
                devices_per_host=8, fast_domain=8, fast_bw=450e9,
                fast_latency=3e-6, host_bw=64e9, host_latency=10e-6,
                inter_bw=400e9, inter_latency=10e-6),
    # TPUs: ICI joins all chips of a slice, so the "inter-host" tier is ICI
    # too (aggregate of the host's chips). 4 chips per host.
    "tpu-v4": _hw(name="tpu-v4", memory_bytes=32 * GiB, peak_flops=275e12,
                  devices_per_host=4, fast_domain=4, fast_bw=100e9,
                  fast_latency=2e-6, host_bw=100e9, host_latency=2e-6,
                  inter_bw=400e9, inter_latency=3e-6),
    "tpu-v5e": _hw(name="tpu-v5e", memory_bytes=16 * GiB, peak_flops=197e12,
                   devices_per_host=4, fast_domain=4, fast_bw=50e9,
                   fast_latency=2e-6, host_bw=50e9, host_latency=2e-6,
                   inter_bw=200e9, inter_latency=3e-6),
    # Generic host CPU devices (jax_num_cpu_devices): for small real models in
    # tests and on laptops. All devices share one host's memory bus.
    "cpu": _hw(name="cpu", memory_bytes=8 * GiB, peak_flops=1e11,
               devices_per_host=1024, fast_domain=1024, fast_bw=10e9,
               fast_latency=10e-6, host_bw=10e9, host_latency=10e-6,
               inter_bw=10e9, inter_latency=50e-6),
}

HARDWARE_PRESETS: tuple[str, ...] = tuple(_PRESETS)


def hardware_preset(name: str) -> Hardware:
  """Returns a hardware preset by name.

  Names: ``a6000``, ``v100``, ``a100-40g``, ``a100-80g``, ``h100``,
  ``tpu-v4``, ``tpu-v5e``, ``cpu``.

  Example:
    >>> hardware_preset("a100-80g").memory_bytes // GiB
    80
  """
  try:
    return _PRESETS[name]
  except KeyError:
    raise SearchError(
        f"unknown hardware preset {name!r}; expected one of"
        f" {HARDWARE_PRESETS}") from None
