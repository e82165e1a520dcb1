"""Console logging: keep INFO for our own progress, drop the library chatter."""

import logging
import numbers
import os
import platform
import sys

from absl import logging as absl_logging

_NOISY = ("/orbax/", "/jax/_src/", "/tensorflow/", "/tensorflow_datasets/", "/absl/")


class _QuietLibraries(logging.Filter):
  """Passes WARNING and above from libraries (orbax logs every file it writes at INFO)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.WARNING:
      return True
    return not any(part in record.pathname for part in _NOISY)


def quiet_libraries() -> None:
  """Installs the filter on the absl handler and the root logger's handlers."""
  handlers = [absl_logging.get_absl_handler()] + logging.getLogger().handlers
  for h in handlers:
    if not any(isinstance(f, _QuietLibraries) for f in h.filters):
      h.addFilter(_QuietLibraries())


def cpu_malloc_hint(backend: str, environ=None) -> str | None:
  """A one-line tip when XLA:CPU runs under glibc without launch/cpu_env.sh, else None.

  glibc unmaps XLA:CPU's per-step scratch block on free and faults it in again next step
  (launch/cpu_env.sh has the numbers); the launch scripts set the fix, a bare `python -m` does not.
  """
  environ = os.environ if environ is None else environ
  if backend != "cpu" or platform.libc_ver()[0] != "glibc":
    return None
  if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
    return None
  return ("CPU run without launch/cpu_env.sh: glibc unmaps and re-faults XLA's scratch memory "
          "every step (kernel time); `source launch/cpu_env.sh` before python avoids it")


# The final metrics a results line shows first, when present.
HEADLINE = ("step", "loss", "knn/top1", "knn/top5", "preempted")


def compact(values: dict, first=(), limit: int = 6, width: int = 160, skip: str = "",
            more: str = "more") -> str:
  """``a 0.123, b 4.56, ... (+N more)``: ``values`` on one short line.

  The ``first`` keys lead (when present), then the others in order, leaving out keys that contain
  ``skip``; at most ``limit`` entries and about ``width`` characters; non-integer numbers at 4
  significant digits. What is left out is counted at the end.
  """
  head = [k for k in first if k in values]
  keys = head + [k for k in values if k not in head and not (skip and skip in k)]
  items = []
  for k in keys:
    v = values[k]
    real = isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral)
    item = (f"{k} {v:.4g}" if real else f"{k} {v}")[:width]
    if len(items) == limit or (items and sum(len(i) + 2 for i in items) + len(item) > width):
      break
    items.append(item)
  left = len(values) - len(items)
  return ", ".join(items) + (f" (+{left} {more})" if left > 0 else "")


def compact_results(results: dict) -> str:
  """A run's final metrics on one line: ``HEADLINE`` first, no per-block curves (``/block_NN``),
  at most 8 entries and about 170 characters (results.json has them all)."""
  return compact(results, HEADLINE, limit=8, width=170, skip="/block_",
                 more="more in results.json")


def exit_with(status: int) -> None:
  """Ends the process with ``status``. After bad input (2) the one line is out and nothing was
  written; tensorstore reads still in flight after a failed orbax read would print a traceback
  each from other threads, so stderr is closed and the process ends at once."""
  if status == 2:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    os._exit(2)
  sys.exit(status)


def _is_checkpoint_io(code) -> bool:
  """Whether a code object (``None`` allowed) belongs to orbax or tensorstore."""
  name = getattr(code, "co_filename", "")
  return "/orbax/" in name or "/tensorstore/" in name


def _from_checkpoint_io(tb) -> bool:
  while tb is not None:
    if _is_checkpoint_io(tb.tb_frame.f_code):
      return True
    tb = tb.tb_next
  return False


def _only_asyncio(tb) -> bool:
  """Whether every frame of a traceback is asyncio's own (an exception raised inside a C-level
  awaitable, such as a tensorstore future, shows no frame of its library)."""
  while tb is not None:
    if "/asyncio/" not in tb.tb_frame.f_code.co_filename:
      return False
    tb = tb.tb_next
  return True


class _OrphanReadTasks(logging.Filter):
  """Drops asyncio's "Task exception was never retrieved" (and its "Future ..." twin) for tasks
  and futures of orbax/tensorstore reads (the siblings of a read that failed first; their own
  failure is the same one): those whose traceback passes through orbax or tensorstore, and the
  ``_wrap_awaitable`` tasks orbax makes of tensorstore futures, whose traceback holds nothing but
  asyncio (our commands create no such tasks themselves)."""

  def filter(self, record: logging.LogRecord) -> bool:
    msg = str(record.msg)
    if not msg.startswith(("Task exception was never retrieved",
                           "Future exception was never retrieved")):
      return True
    exc = record.exc_info[1] if record.exc_info else None
    if exc is None:
      return True
    if _from_checkpoint_io(exc.__traceback__):
      return False
    return not ("coro=<_wrap_awaitable()" in msg and _only_asyncio(exc.__traceback__))


def quiet_failed_reads() -> None:
  """Silences the known-harmless reports that follow a failed orbax read, which would bury the
  one-line error. Orbax gathers its tensorstore reads in a private event loop and closes it at the
  first failure, so (1) the reads still in flight complete from tensorstore's threads into the
  closed loop, each ``call_soon_threadsafe`` raising ``RuntimeError('Event loop is closed')``
  into ``sys.unraisablehook``; (2) read coroutines freed unfinished report there too (dropped
  only when the coroutine or the traceback belongs to orbax/tensorstore); (3) sibling read tasks
  that failed as well are reported by asyncio's logger when collected. Everything else goes
  where it went before."""
  previous = sys.unraisablehook
  if getattr(previous, "_decay_jax", False):
    return

  def hook(unraisable):
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
      return
    if (_is_checkpoint_io(getattr(unraisable.object, "cr_code", None))
        or _from_checkpoint_io(unraisable.exc_traceback)):
      return
    previous(unraisable)

  hook._decay_jax = True  # pylint: disable=protected-access
  sys.unraisablehook = hook
  asyncio_logger = logging.getLogger("asyncio")
  if not any(isinstance(f, _OrphanReadTasks) for f in asyncio_logger.filters):
    asyncio_logger.addFilter(_OrphanReadTasks())


def run_command(main) -> None:
  """Runs an argparse command's ``main() -> status`` with ``quiet_failed_reads`` and ends the
  process through ``exit_with``."""
  quiet_failed_reads()
  exit_with(main())
