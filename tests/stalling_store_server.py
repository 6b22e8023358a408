"""A store server for fault tests: serves N tensor reads (GET /tensor or
batched POST /read), then stalls.

  python tests/stalling_store_server.py DIR READY_FILE STALLED_FILE N

It serves ``DIR`` like ``tenplex-jax store serve`` and writes ``HOST:PORT``
to ``READY_FILE``. After answering ``N`` read requests it holds every
further one without answering and writes ``STALLED_FILE``: a restore is
then provably in flight against this server, and the test SIGKILLs it.
"""

import os
import sys
import threading
import time

from tenplex_jax.store import server
from tenplex_jax.store.format import HostStore

root, ready, stalled, limit = sys.argv[1:5]
limit = int(limit)
lock = threading.Lock()
served = [0]


def _count_or_stall() -> None:
  with lock:
    served[0] += 1
    n = served[0]
  if n > limit:
    with open(stalled + ".tmp", "w") as f:
      f.write(str(n))
    os.replace(stalled + ".tmp", stalled)
    time.sleep(3600)  # until the test kills this process


class StallingHandler(server._Handler):

  def do_GET(self):
    if self.path.startswith("/tensor/"):
      _count_or_stall()
    super().do_GET()

  def do_POST(self):
    if self.path.startswith("/read"):  # batched piece reads
      _count_or_stall()
    super().do_POST()


os.makedirs(root, exist_ok=True)
srv = server._StoreServer(("127.0.0.1", 0), HostStore(root))
srv.RequestHandlerClass = StallingHandler
with open(ready + ".tmp", "w") as f:
  f.write(f"127.0.0.1:{srv.server_address[1]}")
os.replace(ready + ".tmp", ready)
srv.serve_forever(poll_interval=0.2)
