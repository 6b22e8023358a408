"""A local Ray cluster whose nodes share nothing but the network and the code.

Each node is ``ray start --block`` in its own mount namespace (``unshare -m``,
root only) with a private tmpfs over ``/dev/shm``, ``/tmp`` and its working
directory, bound to its own loopback address (the head on 127.0.0.2, the
others on 127.0.0.3, 127.0.0.4, ...) and joined to the head by address. A
file one node writes to its ``/dev/shm`` or ``/tmp`` is invisible to the
others; what a node held is gone with its processes (the namespace and its
tmpfs mounts die with the last of them). The code (this checkout, the
Python environment) is on the shared root file system, as in a container
image; where it lies under ``/tmp`` those directories are bound back into
each node's private ``/tmp``.

The driver runs on the head "host": the head's Ray session directory
(``temp_dir``, its sockets and logs) is a host directory the driver reads,
everything else of the head (its ``/dev/shm`` with the object store and the
tenplex store, its ``/tmp``) is private. Every node's Ray output goes to
``<base>/node-<k>.log``.

  with ShareNothingCluster() as c:     # skips nothing: raises if not root
    c.add_node(head=True); c.add_node(); c.add_node()
    ray.init(address=c.address, _node_ip_address=c.head_ip)
    ...
    c.kill_node(c.nodes[2])            # SIGKILL: its memory and disk gone
  # every process, mount and directory is gone, also after an exception
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tenplex_jax.store.server import free_port


def namespaces_permitted() -> str | None:
  """``None`` where private mount namespaces with tmpfs mounts work here,
  else the reason they do not."""
  if sys.platform != "linux":
    return f"mount namespaces need Linux (this is {sys.platform})"
  if os.geteuid() != 0:
    return "mount namespaces (unshare -m) and tmpfs mounts need root"
  for tool in ("unshare", "nsenter", "mount"):
    if shutil.which(tool) is None:
      return f"{tool} is not installed"
  r = subprocess.run(
      ["unshare", "-m", "--propagation", "private", "sh", "-c",
       "mount -t tmpfs tmpfs /dev/shm && mount -t tmpfs tmpfs /tmp"],
      capture_output=True, text=True, timeout=30, check=False)
  if r.returncode:
    return (f"unshare -m with tmpfs mounts failed here:"
            f" {(r.stderr or r.stdout).strip()[:200]}")
  return None


_REAPER = """
import os, shutil, signal, sys, time
parent, base = int(sys.argv[1]), sys.argv[2]
while os.path.isdir(base) and os.getppid() == parent:  # (not by pid:
  time.sleep(1)  # a dead parent's pid can be another process's)
try:
  with open(os.path.join(base, "namespaces")) as f:
    nodes = {tuple(x.split()) for x in f if len(x.split()) == 2}
except OSError:
  nodes = set()
ours = os.readlink("/proc/self/ns/mnt")
for _ in range(50):
  left = 0
  for d in os.listdir("/proc"):
    try:
      ns = os.readlink("/proc/%s/ns/mnt" % d) if d.isdigit() else ours
      if ns == ours:
        continue
      if (ns, str(os.getsid(int(d)))) in nodes:  # namespace and session
        os.kill(int(d), signal.SIGKILL)
        left += 1
    except OSError:
      pass
  if not left:
    break
  time.sleep(0.2)
shutil.rmtree(base, ignore_errors=True)
"""


# The GCS health-checks each raylet every ``health_check_period_ms`` and
# declares the node dead after ``health_check_failure_threshold`` checks in
# a row fail. A killed node refuses the connection: each check fails at
# once (dead in about threshold x period). A node starved of CPU (or
# stopped) accepts it and answers late: each check fails only after
# ``health_check_timeout_ms``. Ray's 10 s timeout declares a node that
# answers nothing for about 5 x 13 s dead, and its raylet then exits
# (on a 2-core host loaded 10-fold, this happened; with 30 s too, once,
# at load 10-26: a node the test had not killed marked dead): 60 s gives a
# node that answers nothing about 5 x 63 s by the health checks, while a
# killed one is still dead within seconds (a node with every process
# stopped was still declared dead after 33 s, by some other mechanism of
# Ray's: docs/ray.md).
STARVATION_TOLERANT = {"health_check_timeout_ms": 60_000}


def _same_auth_as_ray_start() -> None:
  """Makes this process (and the nodes it starts, which inherit its
  environment) use Ray's token authentication exactly when ``ray start``
  would: with ``RAY_AUTH_MODE`` unset, Ray 2.60's ``ray start --head``
  turns it on by itself if a token exists (``~/.ray/auth_token``, which a
  local ``ray.init()`` writes); the driver's own GCS client, made before
  any ``ray.init``, then has to send that token too, or the head never
  answers it (the cluster's start timed out). Ray's own check, so both
  decide alike; sets ``RAY_AUTH_MODE=token`` here when it applies."""
  try:
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available)
  except ImportError:  # a Ray without token authentication
    return
  maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _code_dirs_under_tmp() -> list[str]:
  """The top directories under ``/tmp`` that hold this process's code (its
  import path, Python and environment, e.g. a checkout and its venv made
  with ``mktemp -d``): each node gets them back over its private ``/tmp``,
  the rest of which it does not see."""
  import tenplex_jax
  paths = [*sys.path, sys.prefix, sys.exec_prefix, sys.executable,
           os.path.dirname(os.path.dirname(tenplex_jax.__file__))]
  tops = set()
  for p in paths:
    if not p:
      continue
    rel = os.path.relpath(os.path.realpath(p), "/tmp")
    if rel != "." and not rel.startswith(".."):
      tops.add(os.path.join("/tmp", rel.split(os.sep)[0]))
  return sorted(t for t in tops if os.path.isdir(t))


class ShareNothingCluster:
  """Ray nodes in private mount namespaces on loopback addresses.

  ``system_config``: the head's ``ray start --system-config`` (Ray's
  settings for the whole cluster); default :data:`STARVATION_TOLERANT`,
  ``{}`` for Ray's own defaults."""

  def __init__(self, base: str | None = None, head_ip: str = "127.0.0.2",
               start_timeout: float = 240.0,
               system_config: dict | None = None):
    # Not under /tmp (every node mounts its own over it, the head's Ray
    # session directory must stay visible to the driver) and short (Ray's
    # socket paths there must stay within AF_UNIX's 107 bytes).
    self.base = tempfile.mkdtemp(prefix="tsn-", dir=base or "/var/tmp")
    # A reaper ends every node and removes the base directory if this
    # process dies without shutdown() (e.g. a driver aborted by Ray).
    self._reaper = subprocess.Popen(
        [sys.executable, "-c", _REAPER, str(os.getpid()), self.base],
        stdin=subprocess.DEVNULL, start_new_session=True)
    self.head_ip, self.start_timeout = head_ip, start_timeout
    self.system_config = (STARVATION_TOLERANT if system_config is None
                          else system_config)
    self.nodes: list[dict] = []
    self.address: str | None = None
    self._next = int(head_ip.rsplit(".", 1)[1])

  def __enter__(self) -> ShareNothingCluster:
    return self

  def __exit__(self, *exc) -> None:
    self.shutdown()

  def add_node(self, num_cpus: int = 1, num_gpus: int = 0,
               resources: dict | None = None) -> dict:
    """Starts the next node (the head first) and waits until Ray lists it
    alive; returns its record (``ip``, ``proc``, ``node_id``, ``log``).

    ``ray start`` gives a node 30 s (not configurable) to register with
    the GCS; on a loaded host it can miss that and exit. Such a start is
    torn down (every process of its namespace) and made again on the same
    address, up to three times. So is a start whose ``ray start`` was
    killed (SIGKILL) before Ray listed the node: on a busy host with pid
    numbers wrapping, another program's stale kill can reach the new
    process group before the node is up."""
    for attempt in range(3):
      try:
        return self._start_node(num_cpus, num_gpus, resources)
      except RuntimeError as e:
        retry = ("timed out during startup" in str(e)
                 or f"exited with {-signal.SIGKILL}:" in str(e))
        if not retry or attempt == 2:
          raise
        node = self.nodes.pop()
        self._kill(node)
        self._next -= 1
    raise AssertionError("unreachable")

  def _start_node(self, num_cpus: int, num_gpus: int,
                  resources: dict | None) -> dict:
    head = not self.nodes
    k = len(self.nodes)
    ip = f"127.0.0.{self._next}"
    self._next += 1
    work = os.path.join(self.base, f"node-{k}")
    os.makedirs(work, exist_ok=True)
    ports = {f"--{name}": str(free_port(ip)) for name in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
        "runtime-env-agent-port", "metrics-export-port")}
    if head:
      ports.update({f"--{name}": str(free_port(ip)) for name in (
          "ray-client-server-port", "dashboard-port")})
    cmd = ["ray", "start", "--block", "--disable-usage-stats",
           "--node-ip-address", ip, f"--num-cpus={num_cpus}",
           f"--num-gpus={num_gpus}", "--min-worker-port=0",
           "--max-worker-port=0", *[x for kv in ports.items() for x in kv]]
    if resources:
      cmd += ["--resources", json.dumps(resources)]
    if head:
      _same_auth_as_ray_start()  # before the nodes inherit the environment
      self.port = free_port(ip)
      self.temp_dir = os.path.join(self.base, "h")
      cmd += ["--head", f"--port={self.port}", "--include-dashboard=false",
              f"--temp-dir={self.temp_dir}"]
      if self.system_config:
        cmd += ["--system-config", json.dumps(self.system_config)]
    else:
      cmd += [f"--address={self.address}", "--temp-dir=/tmp/ray"]
    # The working directory first (/tmp may hold its path); then the code
    # directories under /tmp are bound back over the private /tmp, through
    # a bind of the host's /tmp made before it is covered.
    code = _code_dirs_under_tmp()
    keep = "".join(
        f" mkdir -p {shlex.quote(d)}; mount --bind .host-tmp/"
        f"{shlex.quote(os.path.relpath(d, '/tmp'))} {shlex.quote(d)};"
        for d in code)
    script = (
        f"set -e; mount -t tmpfs tmpfs {shlex.quote(work)};"
        f" cd {shlex.quote(work)};"
        + (" mkdir .host-tmp; mount --bind /tmp .host-tmp;" if code else "")
        + " mount -t tmpfs tmpfs /dev/shm; mount -t tmpfs tmpfs /tmp;"
        + (keep + " umount .host-tmp; rmdir .host-tmp;" if code else "")
        + f" exec {shlex.join(cmd)}")
    log_path = os.path.join(self.base, f"node-{k}.log")
    with open(log_path, "ab") as log:
      proc = subprocess.Popen(
          ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
          start_new_session=True)  # its own process group: killed as one
    node = {"ip": ip, "proc": proc, "work": work, "log": log_path,
            "head": head, "node_id": None}
    self.nodes.append(node)
    if head:
      self.address = f"{ip}:{self.port}"
    node["ns"] = self._namespace(proc)
    if node["ns"]:
      with open(os.path.join(self.base, "namespaces"), "a") as f:
        f.write(f"{node['ns']} {proc.pid}\n")
    node["node_id"] = self._wait_alive(node)
    return node

  @staticmethod
  def _namespace(proc: subprocess.Popen) -> str | None:
    """The id of ``proc``'s mount namespace once unshare made it (never
    ours: the teardown kills every process in it)."""
    ours = os.readlink("/proc/self/ns/mnt")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
      try:
        ns = os.readlink(f"/proc/{proc.pid}/ns/mnt")
      except OSError:
        return None
      if ns != ours:
        return ns
      time.sleep(0.01)
    return None

  def _wait_alive(self, node: dict) -> str:
    """Polls the GCS until a node on ``node``'s address is alive."""
    from ray._raylet import GcsClient
    deadline = time.monotonic() + self.start_timeout
    client = None
    while time.monotonic() < deadline:
      if node["proc"].poll() is not None:
        raise RuntimeError(
            f"ray start on {node['ip']} exited with"
            f" {node['proc'].returncode}: {self._tail(node)}")
      try:
        client = client or GcsClient(address=self.address)
        for info in client.get_all_node_info(timeout=5).values():
          if (info.node_manager_address == node["ip"]
              and info.state == 0):  # ALIVE
            return info.node_id.hex()
      except Exception:  # noqa: BLE001 - the GCS is not up yet
        client = None
      time.sleep(0.5)
    raise TimeoutError(f"the Ray node on {node['ip']} was not alive after"
                       f" {self.start_timeout:.0f} s: {self._tail(node)}")

  @staticmethod
  def _tail(node: dict, n: int = 1500) -> str:
    try:
      with open(node["log"], "rb") as f:
        return f.read().decode(errors="replace")[-n:]
    except OSError:
      return "(no log)"

  def run_in(self, node: dict, argv: list[str], **kwargs
             ) -> subprocess.CompletedProcess:
    """Runs ``argv`` inside ``node``'s mount namespace (its /dev/shm,
    /tmp and working directory)."""
    return subprocess.run(
        ["nsenter", "-t", str(node["proc"].pid), "-m", "--wd=" + node["work"],
         *argv], **kwargs)

  def kill_node(self, node: dict, wait_dead: bool = False) -> None:
    """Kills every process of ``node`` at once (SIGKILL, no warning): its
    namespace, its /dev/shm and /tmp go with them. ``wait_dead``: then
    waits until Ray's node table has it dead (it misses its health checks
    first: seconds)."""
    self._kill(node)
    node["killed"] = True
    if not wait_dead or node.get("node_id") is None:
      return
    from ray._raylet import GcsClient
    client = GcsClient(address=self.address)
    deadline = time.monotonic() + self.start_timeout
    while time.monotonic() < deadline:
      alive = {i.node_id.hex() for i in client.get_all_node_info(
          timeout=30).values() if i.state == 0}
      if node["node_id"] not in alive:
        return
      time.sleep(0.5)
    raise TimeoutError(f"Ray still lists node {node['ip']} alive"
                       f" {self.start_timeout:.0f} s after its kill")

  def left_in(self, node: dict, timeout: float = 60.0) -> list[int]:
    """The processes still in ``node``'s namespace once they are gone or
    ``timeout`` seconds have passed: a SIGKILLed process stays listed
    until its exit has released its memory, which on a loaded host can
    outlast :meth:`kill_node`'s own wait."""
    deadline = time.monotonic() + timeout
    while (left := self._members(node)) and time.monotonic() < deadline:
      time.sleep(0.5)
    return left

  @staticmethod
  def _members(node: dict) -> list[int]:
    """Every process in ``node``'s mount namespace and session (Ray's
    workers make their own process groups, none its own session).

    Not by the namespace alone: the kernel gives a new namespace the
    lowest free id, so a node started after another's end gets the dead
    one's id (``mnt:[...]``) at once, in this cluster or another (seen:
    three nodes of one cluster, and nodes of the clusters before it, with
    the same id). The session is that of the node's ``unshare``
    (``start_new_session``): its pid, which the same wrap of pid numbers
    would have to give a later node's ``unshare`` too."""
    ns, out = node.get("ns"), []
    if ns is None:  # its pid only while unreaped: then no one else's
      return [] if node["proc"].poll() is not None else [node["proc"].pid]
    sid = node["proc"].pid
    for d in os.listdir("/proc"):
      if d.isdigit():
        try:
          if (os.readlink(f"/proc/{d}/ns/mnt") == ns
              and os.getsid(int(d)) == sid):
            out.append(int(d))
        except OSError:  # ended meanwhile
          pass
    return out

  def _kill(self, node: dict, sig: int = signal.SIGKILL) -> None:
    for pid in self._members(node):
      try:
        os.kill(pid, sig)
      except ProcessLookupError:
        pass
    try:
      node["proc"].wait(timeout=30)
    except subprocess.TimeoutExpired:
      pass
    if sig == signal.SIGKILL:  # until the namespace is empty
      deadline = time.monotonic() + 30
      while self._members(node) and time.monotonic() < deadline:
        for pid in self._members(node):
          try:
            os.kill(pid, sig)
          except ProcessLookupError:
            pass
        time.sleep(0.1)

  def shutdown(self) -> None:
    """Ends every node (the workers first, the head last), then removes
    the base directory (idempotent; ``nodes`` keeps their records)."""
    for node in reversed(self.nodes):
      self._kill(node)  # every process in its namespace
    if self._reaper.poll() is None:
      self._reaper.kill()
      self._reaper.wait()
    shutil.rmtree(self.base, ignore_errors=True)
