"""Private files on shared hosts: what stores, the launcher and store servers
write is readable by its owner only, and what they use must be theirs.

* Directories are made ``0700`` and files ``0600`` (a stricter umask makes
  them stricter still: the modes are passed to ``mkdir``/``open``, which
  apply the umask). A file written again over one with looser modes loses
  its group and other bits.
* :func:`check_dir` refuses a store root (or job directory) owned by another
  user or writable by group or others, any directory above it that another
  user could use to swap it (a root-owned sticky directory such as
  ``/dev/shm`` or ``/tmp`` is fine, as ssh accepts), and the store's own
  ``procs/`` directories that are not ours: such a directory's owner could
  replace manifests, ``CURRENT`` and chunks, with their checksums, between a
  save and a restore.
* :func:`check_token_file` refuses a token file that group or others can
  read or write (as ssh refuses such a private key).

The checks run before anything is written to or read from the path; they
raise :class:`~tenplex_jax.errors.UnsafePathError` with one line naming the
path, its owner and mode, and the fix. Root (uid 0) may own what we use: it
can read everything anyway.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
from typing import IO

from tenplex_jax.errors import UnsafePathError

__all__ = ["DIR_MODE", "FILE_MODE", "UnsafePathError", "check_dir",
           "check_token_file", "copytree", "makedirs", "open_private"]

DIR_MODE = 0o700
FILE_MODE = 0o600

_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
          "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL}


def makedirs(path: str, *, exist_ok: bool = True) -> None:
  """``os.makedirs`` with every directory it makes ``0700`` (& ~umask);
  directories that exist keep their modes."""
  path = os.path.abspath(path)
  missing = []
  p = path
  while not os.path.isdir(p):
    missing.append(p)
    parent = os.path.dirname(p)
    if parent == p:
      break
    p = parent
  if not missing and not exist_ok:
    raise FileExistsError(f"[Errno 17] File exists: {path!r}")
  for d in reversed(missing):
    try:
      os.mkdir(d, DIR_MODE)
    except FileExistsError:
      if (d == path and not exist_ok) or not os.path.isdir(d):
        raise


def open_private(path: str, mode: str = "w") -> IO:
  """``open(path, mode)`` for writing (``w``, ``a``, ``x``, each also with
  ``b``), creating the file ``0600`` (& ~umask); a file that exists with
  group or other bits loses them before anything is written."""
  kind = mode.replace("b", "")
  if kind not in _FLAGS:
    raise ValueError(f"open_private: mode {mode!r} is not w, a or x")
  fd = os.open(path, _FLAGS[kind] | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
  try:
    st = os.fstat(fd)
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
      os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o700)
    return os.fdopen(fd, mode)
  except BaseException:
    os.close(fd)
    raise


def copytree(src: str, dst: str) -> None:
  """Copies directory ``src`` to the new directory ``dst`` (contents only:
  regular files and directories), every directory ``0700`` and every file
  ``0600`` (& ~umask) whatever the source's modes."""
  os.mkdir(dst, DIR_MODE)
  with os.scandir(src) as it:
    entries = list(it)
  for e in entries:
    s, d = e.path, os.path.join(dst, e.name)
    if e.is_dir(follow_symlinks=False):
      copytree(s, d)
    elif e.is_file(follow_symlinks=False):
      with open(s, "rb") as fi, open_private(d, "xb") as fo:
        shutil.copyfileobj(fi, fo, 4 << 20)
    else:
      raise UnsafePathError(f"{s} is neither a regular file nor a directory;"
                            " a store holds only those")


def _who(uid: int) -> str:
  try:
    return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
  except KeyError:
    return f"uid {uid}"


def _trusted(uid: int) -> bool:
  return uid in (os.geteuid(), 0)


def _refuse(what: str, given: str, path: str, st: os.stat_result,
            why: str, fix: str) -> UnsafePathError:
  """``why`` may name ``{who}`` (the owner) and ``{mode}``."""
  at = "it" if path == given else path
  why = why.format(who=_who(st.st_uid),
                   mode=f"{stat.S_IMODE(st.st_mode):04o}")
  return UnsafePathError(f"refusing {what} {given}: {at} {why}. {fix}")


def _fix(path: str) -> str:
  return ("Fix: use a directory that you own and only you can write (mkdir"
          " -m 700 DIR), or make this one so: chown"
          f" {_who(os.geteuid()).split(' ')[0]} {path} && chmod go-w {path}")


def _check_one(what: str, given: str, path: str, st: os.stat_result,
               *, above: bool) -> None:
  if not _trusted(st.st_uid):
    raise _refuse(what, given, path, st, "is owned by another user,"
                  " {who} (mode {mode}), who could replace what it holds",
                  _fix(path))
  if st.st_mode & 0o022:
    if above and st.st_mode & stat.S_ISVTX:
      return  # sticky (e.g. /dev/shm, /tmp): others cannot move our entries
    raise _refuse(what, given, path, st, "is writable by group or others"
                  " (owner {who}, mode {mode}), who could replace what it"
                  " holds", _fix(path))


def check_dir(path: str, *, what: str = "store", inner: bool = True
              ) -> None:
  """Refuses a directory that others could tamper with.

  Checks, as far as they exist: every directory above ``path`` (owned by
  us or root, and not writable by group or others unless sticky), ``path``
  itself (owned by us or root, not writable by group or others, even if
  sticky), a symbolic link on the way (owned by us or root), and with
  ``inner`` the store's ``procs/`` and ``procs/<k>/`` directories (as
  ``path``). Reads only metadata; a path that does not exist yet passes
  (check again once it is made).

  Args:
    path: the store root (or job directory). URLs are not paths: callers
      check only local directories.
    what: names the directory in the message (``store``, ``job
      directory``).
    inner: also check ``procs/`` and ``procs/<k>/``.

  Raises:
    UnsafePathError: one line naming the path, its owner and mode, and the
      fix.

  Example:
    >>> import os, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...   check_dir(d)  # ours, 0700: fine
    ...   os.chmod(d, 0o777)
    ...   check_dir(d)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tenplex_jax.errors.UnsafePathError: refusing store /...: it is writable by group or others (owner ..., mode 0777), who could replace what it holds. Fix: ...
  """
  given = os.path.abspath(path)
  # Symbolic links on the way: their owner could point them elsewhere.
  p = "/"
  for part in given.strip("/").split("/"):
    if not part:
      continue
    p = os.path.join(p, part)
    try:
      st = os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
      break
    if stat.S_ISLNK(st.st_mode):
      if not _trusted(st.st_uid):
        raise _refuse(what, given, p, st, "is a symbolic link owned by"
                      " another user, {who}, who could point it elsewhere",
                      "Fix: use a path without it")
      p = os.path.realpath(p)
  real = os.path.realpath(given)
  chain = []
  p = real
  while True:
    chain.append(p)
    parent = os.path.dirname(p)
    if parent == p:
      break
    p = parent
  for p in reversed(chain):
    try:
      st = os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
      return  # not made yet: nothing below exists either
    _check_one(what, given, p, st, above=p != real)
  if not inner:
    return
  procs = os.path.join(real, "procs")
  try:
    st = os.stat(procs)
  except (FileNotFoundError, NotADirectoryError):
    return
  _check_one(what, given, procs, st, above=False)
  try:
    names = os.listdir(procs)
  except OSError:
    return
  for n in names:
    d = os.path.join(procs, n)
    try:
      lst = os.lstat(d)
      st = os.stat(d) if stat.S_ISLNK(lst.st_mode) else lst
    except OSError:
      continue
    if stat.S_ISLNK(lst.st_mode) and not _trusted(lst.st_uid):
      raise _refuse(what, given, d, lst, "is a symbolic link owned by"
                    " another user, {who}, who could point it elsewhere",
                    f"Fix: remove it (rm {d})")
    if stat.S_ISDIR(st.st_mode):
      _check_one(what, given, d, st, above=False)


def check_token_file(path: str, *, what: str = "--token-file") -> None:
  """Refuses a token file that group or others can read or write (any of
  the mode bits 077), or that another user owns, as ssh refuses such a
  private key: :class:`~tenplex_jax.errors.UnsafePathError`, one line with
  the path, owner, mode and fix. A missing file is left to the reader.

  Example:
    >>> import os, tempfile
    >>> fd, f = tempfile.mkstemp()  # 0600
    >>> check_token_file(f)
    >>> os.chmod(f, 0o644)
    >>> check_token_file(f)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tenplex_jax.errors.UnsafePathError: refusing --token-file ...: group or others can access it (mode 0644, ...), so ... Fix: chmod 600 ...
    >>> os.close(fd); os.unlink(f)
  """
  try:
    st = os.stat(path)
  except OSError:
    return
  if not _trusted(st.st_uid):
    raise UnsafePathError(
        f"refusing {what} {path}: it is owned by {_who(st.st_uid)}, not by"
        f" you (mode {stat.S_IMODE(st.st_mode):04o}); another user could"
        f" change the token. Write the token to a file you own and chmod"
        f" 600 it")
  if st.st_mode & 0o077:
    raise UnsafePathError(
        f"refusing {what} {path}: group or others can access it (mode"
        f" {stat.S_IMODE(st.st_mode):04o}, owner {_who(st.st_uid)}), so"
        f" anyone on this host could use the job's token. Fix: chmod 600"
        f" {path}")
