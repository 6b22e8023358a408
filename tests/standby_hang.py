"""A module that standby processes and actors import in tests
(``standby_imports``): the first importer to claim the token file hangs.

``STANDBY_HANG_TOKEN`` names the token file (default: one per user in
``/dev/shm``, for Ray workers, which get no test environment). The first
process to remove it writes its pid to ``TOKEN.hung`` and never finishes
its import (a standby whose imports hang: a stuck file system, a lock);
every other importer appends its pid to ``TOKEN.imported`` and goes on.
The test removes all three files when it ends.
"""

import os
import time

TOKEN = os.environ.get("STANDBY_HANG_TOKEN",
                       f"/dev/shm/tenplex-test-standby-hang-{os.getuid()}")

try:
  os.unlink(TOKEN)  # only one process succeeds
except FileNotFoundError:
  with open(TOKEN + ".imported", "a") as f:
    f.write(f"{os.getpid()}\n")
else:
  with open(TOKEN + ".hung.tmp", "w") as f:
    f.write(str(os.getpid()))
  os.replace(TOKEN + ".hung.tmp", TOKEN + ".hung")
  while True:
    time.sleep(1)
