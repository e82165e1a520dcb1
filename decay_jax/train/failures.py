"""Runtime failures of a run: each is one line for the user and an exit status of its own.

A run can stop for reasons that are not bugs: training diverged, another run holds the workdir,
the disk (or the quota) is full, the object store cannot be reached, a scheduler sent SIGTERM.
The trainer and the checkpoint code raise these classes with a complete one-line message;
``decay_jax.cli.errors.run`` prints ``error: <message>`` and exits with ``status``. Everything
else keeps its traceback: it is a bug.

Exit statuses (docs/training.md, "Checkpoints"):

====  ==========================================================================================
0     finished (or resumed a finished run)
2     bad input: command line, config, input files, a workdir with no intact checkpoint
3     training diverged (non-finite loss, gradient or parameters)
73    the workdir is held by another run (sysexits EX_CANTCREAT)
74    the disk or quota is full (sysexits EX_IOERR)
75    the object store cannot be reached (sysexits EX_TEMPFAIL: try again later)
143   stopped by SIGTERM (128 + 15, what a shell reports for a process that SIGTERM ended):
      preempted; a checkpoint was saved if a step had run; rerunning resumes
====  ==========================================================================================
"""

from __future__ import annotations

import errno
import signal
from typing import Iterator, Optional

DIVERGED = 3
WORKDIR_BUSY = 73
STORAGE_FULL = 74
UNREACHABLE = 75
PREEMPTED = 128 + signal.SIGTERM  # 143


class RunFailure(Exception):
  """A run stopped for a reason outside the program; ``str()`` is the one line to print."""

  status = 1


class Diverged(RunFailure, FloatingPointError):
  status = DIVERGED


class WorkdirBusyError(RunFailure):
  status = WORKDIR_BUSY


class StorageFullError(RunFailure):
  status = STORAGE_FULL


class StoreUnreachableError(RunFailure):
  status = UNREACHABLE


class Stopped(RunFailure):
  """SIGTERM outside the train loop, as the one line the command prints."""

  status = PREEMPTED


class Terminated(BaseException):
  """SIGTERM outside the train loop (startup, restore, compilation): raised by the handler of
  ``raise_on_sigterm`` from wherever the main thread is. A ``BaseException``, like
  ``KeyboardInterrupt``, so that no ``except Exception`` on the way (a read that counts any
  failure as damage) takes it for something else."""

  status = PREEMPTED


_SIGTERM_SEEN = [False]


def raise_on_sigterm() -> None:
  """Makes SIGTERM raise ``Terminated`` in the main thread (the trainer's loop replaces this with
  its save-at-the-next-step handler while it runs, and puts it back after).

  Python drops an exception raised where it cannot propagate (a garbage-collection callback, a
  ``__del__``): the handler lands there when the signal arrives while one runs, and the run
  would go on. So the handler also records the signal, and ``stop_if_terminated`` (called by the
  trainer before its loop) raises it again from a place where it propagates."""
  _SIGTERM_SEEN[0] = False

  def handle(signum, frame):
    del signum, frame
    _SIGTERM_SEEN[0] = True
    raise Terminated("SIGTERM")

  try:
    signal.signal(signal.SIGTERM, handle)
  except ValueError:  # not the main thread: leave SIGTERM as it is
    pass


def stop_if_terminated() -> None:
  """Raises ``Terminated`` if ``raise_on_sigterm``'s handler saw SIGTERM and its exception was
  dropped (see there)."""
  if _SIGTERM_SEEN[0]:
    raise Terminated("SIGTERM")


# ------------------------------------------------------------------------------------------------
# Recognising a full disk and an unreachable store in whatever the libraries raised.
# ------------------------------------------------------------------------------------------------

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_FULL_TEXT = ("RESOURCE_EXHAUSTED", "No space left on device", "Disk quota exceeded",
              "quota exceeded", "QuotaExceeded", "File too large")
_UNREACHABLE_TEXT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "Cannot connect to host",
                     "Failed to connect", "Connection refused", "Name or service not known",
                     "Temporary failure in name resolution", "Could not resolve host",
                     "Connection reset by peer", "Server disconnected")


def chain(e: Optional[BaseException]) -> Iterator[BaseException]:
  """``e``, its causes and contexts, and the members of exception groups, each once."""
  seen, todo = set(), [e]
  while todo:
    x = todo.pop()
    if x is None or id(x) in seen:
      continue
    seen.add(id(x))
    yield x
    todo += [x.__cause__, x.__context__] + list(getattr(x, "exceptions", ()) or ())


def first_line(e: BaseException, limit: int = 120) -> str:
  """``Type: message`` of ``e`` on one line, tensorstore's detail URL dropped, cut to ``limit``."""
  text = " ".join(str(e).split()).split(" See full TensorStore details")[0]
  if len(text) > limit:
    text = text[:limit - 3] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def storage_full(e: BaseException) -> Optional[BaseException]:
  """The exception of ``e``'s chain that says the disk or the quota is full, if any."""
  for x in chain(e):
    if isinstance(x, OSError) and x.errno in _FULL_ERRNOS:
      return x
    if any(t.lower() in str(x).lower() for t in _FULL_TEXT):
      return x
  return None


def full_detail(x: BaseException) -> str:
  """What the system said about a full disk, short: ``No space left on device`` (tensorstore's
  long RESOURCE_EXHAUSTED text cut to its cause), else the first line of ``x``."""
  text = str(x)
  for phrase in _FULL_TEXT[1:]:
    if phrase.lower() in text.lower():
      return phrase
  if isinstance(x, OSError) and x.strerror:
    return x.strerror
  return first_line(x, 100)


def unreachable(e: BaseException) -> Optional[BaseException]:
  """The exception of ``e``'s chain that says a server could not be reached, if any."""
  for x in chain(e):
    if isinstance(x, (ConnectionError, TimeoutError)):
      return x
    name = type(x).__name__
    if name in ("ClientConnectorError", "ServerDisconnectedError", "ServerTimeoutError",
                "gaierror", "TransportError", "ConnectTimeout", "ConnectError"):
      return x
    if any(t in str(x) for t in _UNREACHABLE_TEXT):
      return x
  return None


def from_exception(e: BaseException, workdir: Optional[str] = None,
                   checkpoints: Optional[str] = None) -> Optional[RunFailure]:
  """``e`` as a one-line ``StorageFullError`` or ``StoreUnreachableError`` if that is what it is
  (None otherwise: a bug, to be shown with its traceback). ``workdir`` and ``checkpoints`` (what
  ``checkpoint.describe_steps`` says of it) complete the line."""
  where = f" in workdir={workdir!r}" if workdir else ""
  full = storage_full(e)
  if full is not None:
    path = getattr(full, "filename", None)
    return StorageFullError(
        f"no space left{where} (disk or quota full: {full_detail(full)}"
        + (f", writing {path}" if path else "") + "); "
        + (f"{checkpoints}; " if checkpoints else "")
        + "free space or raise the quota, then rerun the same command")
  away = unreachable(e)
  if away is not None:
    return StoreUnreachableError(
        f"a server or object store cannot be reached ({first_line(away, 120)})"
        + (f" (workdir={workdir!r})" if workdir else "") + "; check "
        "the network, the endpoint and the credentials, then rerun the same command"
        + (": it resumes from the newest checkpoint" if workdir else ""))
  return None
