"""One run per workdir: a lease file, ``workdir/lease.json``, held while a run trains.

The file names its holder (host, pid, start time, the command) and carries a heartbeat that a
daemon thread rewrites every ``HEARTBEAT_S`` seconds. A run that finds a live lease of another run
stops with one line naming the holder (``failures.WorkdirBusyError``, exit status 73). A lease is
stale, and is taken over with a log line saying so, when its heartbeat is older than ``STALE_S``
seconds, or when its holder ran on this machine (same host name, boot and pid namespace) and its
process is gone. The lease is released (the file removed) at the end of the run, on exceptions
too; a run killed outright leaves it behind, stale at once for a rerun on the same machine and
after ``STALE_S`` seconds for one elsewhere.

Files go through ``decay_jax.paths`` (local disk or ``gs://``). Neither offers an atomic
compare-and-swap here, so a run writes its claim, waits ``SETTLE_S`` seconds and reads it back:
of two runs that claim at once, the one whose claim was overwritten stops. The heartbeat also reads
before it writes: a run whose lease was taken over (its heartbeat stalled longer than ``STALE_S``)
learns it there and stops before its next checkpoint (``check``). Heartbeat ages compare the
holder's clock with the reader's: hosts sharing a workdir need clocks within a few seconds (NTP).
Only process 0 of a multi-process run holds the lease; the others learn whether it got it.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, Dict, Optional

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from decay_jax import paths
from decay_jax.train import failures

NAME = "lease.json"
HEARTBEAT_S = 5.0   # how often the holder rewrites its heartbeat
STALE_S = 60.0      # a heartbeat older than this: the holder is gone
SETTLE_S = 0.3      # local disk: wait after a claim before reading it back (object stores: 2 s)

_HELD: Dict[str, "Lease"] = {}  # workdir -> the lease this process holds on it
_LOCK = threading.Lock()


def _read_proc(path: str) -> Optional[str]:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return None


def _process_start(pid: int) -> Optional[str]:
  """The start time of ``pid`` in clock ticks since boot (/proc), which tells a reused pid."""
  stat = _read_proc(f"/proc/{pid}/stat")
  return stat.rsplit(")", 1)[1].split()[19] if stat else None


def _machine() -> Dict[str, Optional[str]]:
  """What makes a pid on the lease comparable with ours: host name, boot and pid namespace."""
  try:
    namespace = os.readlink("/proc/self/ns/pid")
  except OSError:
    namespace = None
  return {"host": socket.gethostname(), "boot_id": _read_proc("/proc/sys/kernel/random/boot_id"),
          "pid_namespace": namespace}


def _since(t: float) -> str:
  return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _alive(record: Dict[str, Any]) -> Optional[bool]:
  """Whether the holder's process still runs: None when it ran on another machine (unknowable)."""
  if any(record.get(k) != v for k, v in _machine().items()):
    return None
  pid = record.get("pid")
  if not isinstance(pid, int):
    return None
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  start = record.get("pid_start")
  return start is None or _process_start(pid) in (None, start)


def stale_reason(record: Any, now: Optional[float] = None) -> Optional[str]:
  """Why a lease record no longer holds the workdir (None: it holds it)."""
  if not isinstance(record, dict) or not isinstance(record.get("heartbeat"), (int, float)):
    return "the lease file is unreadable"
  now = time.time() if now is None else now
  age = now - record["heartbeat"]
  if age > float(record.get("stale_s", STALE_S)):
    return f"its heartbeat is {age:.0f} s old"
  if _alive(record) is False:
    return f"its process {record.get('pid')} on this machine is gone"
  return None


def describe(record: Dict[str, Any], now: Optional[float] = None) -> str:
  """``host h, pid 12, since 2025-01-01 10:00:00 UTC, heartbeat 3 s ago``."""
  now = time.time() if now is None else now
  parts = [f"host {record.get('host')}", f"pid {record.get('pid')}"]
  if isinstance(record.get("started"), (int, float)):
    parts.append(f"since {_since(record['started'])}")
  if isinstance(record.get("heartbeat"), (int, float)):
    parts.append(f"heartbeat {max(0.0, now - record['heartbeat']):.0f} s ago")
  return ", ".join(parts)


def _read(path) -> Any:
  """The lease record at ``path``: None if there is none, the text if it is not JSON."""
  try:
    text = path.read_text()
  except FileNotFoundError:
    return None
  try:
    return json.loads(text)
  except ValueError:
    return text


def _write(path, record: Dict[str, Any]) -> None:
  """Writes the record whole: a unique temporary name renamed into place on local disk (two runs
  never share a temporary file), one upload on an object store."""
  text = json.dumps(record, indent=1)
  if paths.is_uri(path):
    path.write_text(text)
    return
  tmp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
  tmp.write_text(text)
  os.replace(tmp, path)


class Lease:
  """The lease this process holds on ``workdir`` (see the module's docstring)."""

  def __init__(self, workdir: str, heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S):
    self.workdir = workdir
    self.path = paths.resolve(workdir) / NAME
    self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
    self.lost: Optional[Dict[str, Any]] = None
    now = time.time()
    self.record = dict(_machine(), pid=os.getpid(), pid_start=_process_start(os.getpid()),
                       started=now, heartbeat=now, heartbeat_s=heartbeat_s, stale_s=stale_s,
                       token=uuid.uuid4().hex, command=" ".join(sys.argv)[:300])
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  # The claim. ---------------------------------------------------------------------------------

  def _busy(self, holder: Dict[str, Any]) -> failures.WorkdirBusyError:
    return failures.WorkdirBusyError(
        f"workdir={self.workdir!r} is in use by another run ({describe(holder)}; {NAME}); wait "
        "for it to end or stop it, or use another --workdir (a lease whose heartbeat is "
        f"{float(holder.get('stale_s', STALE_S)):.0f} s old, or whose process on this machine is "
        "gone, is taken over)")

  def claim(self) -> None:
    """Takes the workdir or raises ``WorkdirBusyError`` naming the holder."""
    self.path.parent.mkdir(parents=True, exist_ok=True)
    held = _read(self.path)
    if held is not None:
      reason = stale_reason(held)
      if reason is None:
        raise self._busy(held)
      what = describe(held) if isinstance(held, dict) else "unreadable"
      logging.warning("taking over the lease of workdir %s from a run that is gone (%s): %s",
                      self.workdir, what, reason)
    self.record["heartbeat"] = time.time()
    _write(self.path, self.record)
    time.sleep(2.0 if paths.is_uri(self.path) else SETTLE_S)
    now = _read(self.path)
    if not isinstance(now, dict) or now.get("token") != self.record["token"]:
      raise self._busy(now if isinstance(now, dict) else {"host": "?", "pid": "?"})
    self._thread = threading.Thread(target=self._beat, name="workdir-lease", daemon=True)
    self._thread.start()

  def _beat(self) -> None:
    warned = False
    while not self._stop.wait(self.heartbeat_s):
      try:
        now = _read(self.path)
        if not isinstance(now, dict) or now.get("token") != self.record["token"]:
          self.lost = now if isinstance(now, dict) else {"host": "?", "pid": "?"}
          logging.error("the lease of workdir %s was taken over by another run (%s); this run "
                        "stops before its next checkpoint", self.workdir, describe(self.lost))
          return
        self.record["heartbeat"] = time.time()
        _write(self.path, self.record)
        warned = False
      except Exception as e:  # pylint: disable=broad-except  (a store hiccup: try again next beat)
        if not warned:
          logging.warning("the lease heartbeat of workdir %s failed (%s); retrying every %.0f s",
                          self.workdir, failures.first_line(e, 100), self.heartbeat_s)
          warned = True

  def check(self) -> None:
    """Raises ``WorkdirBusyError`` if another run has taken the workdir over."""
    if self.lost is not None:
      raise failures.WorkdirBusyError(
          f"workdir={self.workdir!r} was taken over by another run ({describe(self.lost)}) while "
          "this one trained (its heartbeat stalled): stopped before writing another checkpoint; "
          "let the other run finish, or stop it and rerun this command")

  # Release. -----------------------------------------------------------------------------------

  def release(self) -> None:
    """Stops the heartbeat and removes the file if it is still ours."""
    with _LOCK:
      if _HELD.get(self.workdir) is not self:
        return  # released already
      _HELD.pop(self.workdir)
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=10)
    try:
      now = _read(self.path)
      if isinstance(now, dict) and now.get("token") == self.record["token"]:
        self.path.unlink()
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("the lease of workdir %s could not be removed (%s); the next run takes it "
                      "over", self.workdir, failures.first_line(e, 100))

  def __enter__(self) -> "Lease":
    return self

  def __exit__(self, *exc) -> None:
    self.release()


class _NotHeld:
  """What processes other than 0 get: nothing to check or release."""

  def check(self) -> None:
    pass

  def release(self) -> None:
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    pass


class _Nested(_NotHeld):
  """A second hold of a lease this process holds: checks it, leaves releasing to the first."""

  def __init__(self, lease: Lease):
    self.lease = lease

  def check(self) -> None:
    self.lease.check()


def acquire(workdir: str, heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S):
  """Holds ``workdir`` for this run (process 0) and returns the lease (a context manager).

  Re-entrant within a process: a second ``acquire`` of a workdir this process holds (the command
  holds it before it writes config.json, the trainer again) returns a handle whose ``release``
  does nothing: the first holder releases. With several processes, all raise if process 0 did not
  get it.
  """
  workdir = os.fspath(paths.resolve(workdir))
  error: Optional[BaseException] = None
  lease: Any = _NotHeld()
  if jax.process_index() == 0:
    with _LOCK:
      held = _HELD.get(workdir)
    if held is not None:
      lease = _Nested(held)
    else:
      candidate = Lease(workdir, heartbeat_s, stale_s)
      try:
        candidate.claim()
        with _LOCK:
          _HELD[workdir] = candidate
        lease = candidate
      except Exception as e:  # pylint: disable=broad-except  (told to the other processes first)
        error = e
  if jax.process_count() > 1:
    got = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
    if not got and error is None:
      error = failures.WorkdirBusyError(f"workdir={workdir!r} could not be held by process 0 "
                                        "(its log says why)")
  if error is not None:
    raise error
  return lease


@atexit.register
def _release_all() -> None:
  """At interpreter exit, gives up what an exception left held (a killed process cannot)."""
  for lease in list(_HELD.values()):
    lease.release()
