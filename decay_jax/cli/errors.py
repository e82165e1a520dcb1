"""One line and an exit status for bad command-line input and for runtime failures.

absl and ml_collections report a missing ``--config`` file as a multi-line ``OSError`` raised on
first use, a misspelt ``--config.x`` override as a ``KeyError`` traceback, and a flag error as a
``FATAL`` line plus usage advice. ``run(main)`` replaces their flag parser with one that turns each
of these into ``error: --FLAG...: what is wrong and what is expected`` on stderr and exit 2, and
turns the input errors that escape ``main`` (``train.checkpoint.CheckpointError``: a missing,
unreadable or corrupt checkpoint, wherever it is read) into the same single line.

Runtime failures (``train.failures``: divergence, a workdir held by another run, a full disk or
quota, an unreachable object store, SIGTERM outside the train loop) are printed the same way, each
with its own exit status (3, 73, 74, 75, 143; the table is in ``train/failures.py`` and
docs/training.md). An exception whose cause is a full disk or an unreachable server is one of them
wherever it was raised. Other exceptions keep their traceback: they are bugs, not bad input.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Callable, List, NoReturn, Optional

from absl import app, flags
from absl import logging as absl_logging
from ml_collections.config_flags import config_flags

from decay_jax import logs
from decay_jax.train import failures
from decay_jax.train.checkpoint import CheckpointError
from decay_jax.validate import InputError

FLAGS = flags.FLAGS
MAX_CHARS = 300
RUNTIME_MAX_CHARS = 600  # a runtime failure's line lists checkpoints and paths: let it be whole
_DID_YOU_MEAN = re.compile(r'Did you mean "([^"]+)" instead of "([^"]+)"')


def one_line(text, limit: int = MAX_CHARS) -> str:
  """``text`` with its whitespace (newlines included) collapsed, cut to ``limit`` characters."""
  line = " ".join(str(text).split())
  return line if len(line) <= limit else line[:limit - 3] + "..."


def fail(message) -> NoReturn:
  print(f"error: {one_line(message)}", file=sys.stderr)
  sys.exit(2)


def _exception_text(e: BaseException) -> str:
  # KeyError's str() is the repr of its argument (quotes and a literal "\n"): use the argument.
  return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def _override_of(argv: List[str], e: BaseException) -> str:
  """The ``--config.a.b=v`` argument that ``e`` (raised while applying overrides) is about."""
  text = _exception_text(e)
  overrides = [a for a in argv[1:] if a.startswith("--") and "." in a.split("=", 1)[0]]
  for arg in overrides:
    parts = arg.split("=", 1)[0].lstrip("-").split(".")[1:]
    if any(f"'{p}'" in text or f'"{p}"' in text for p in parts):
      return arg
  return overrides[0] if len(overrides) == 1 else "a --config.x override"


def _check_config_files() -> None:
  """Loads every config flag now (ml_collections defers a missing or broken file until use)."""
  for name, flag in FLAGS._flags().items():  # pylint: disable=protected-access
    if not config_flags.is_config_flag(flag) or flag.value is None and not flag.present:
      continue
    try:
      path = config_flags.get_config_filename(flag)
    except Exception:  # pylint: disable=broad-except  (a config_dict flag: no file)
      path = ""
    if path and not os.path.isfile(path.split(":", 1)[0]):
      fail(f"--{name}={path}: no such config file (expected a Python file with get_config(), "
           "e.g. configs/mae_cpu_mnist.py)")
    try:
      flag.value  # pylint: disable=pointless-statement
    except Exception as e:  # pylint: disable=broad-except
      fail(f"--{name}={path}: the config file cannot be loaded ({type(e).__name__}: "
           f"{_exception_text(e)})")


def parse_flags(argv: List[str]) -> List[str]:
  """absl's flag parsing with one-line errors (exit 2) instead of tracebacks and usage text."""
  try:
    rest = FLAGS(argv)
  except flags.Error as e:
    fail(str(e))
  except (KeyError, AttributeError, TypeError, ValueError) as e:  # a --config.x override
    arg = _override_of(argv, e)
    detail = _exception_text(e)
    guess = _DID_YOU_MEAN.search(detail)
    if guess:
      detail = f"the config has no field {guess.group(2)!r}; did you mean {guess.group(1)!r}?"
    elif isinstance(e, (KeyError, AttributeError)):
      name = detail.strip().strip("'\"")
      detail = (f"the config has no field {name!r}" if name.isidentifier()
                else f"the config has no such field ({detail})")
    fail(f"{arg}: {detail}")
  except Exception as e:  # pylint: disable=broad-except  (a config file that raises on import)
    files = [a for a in argv[1:] if a.startswith("--") and "=" in a and "." not in a.split("=")[0]
             and a.split("=", 1)[1].split(":")[0].endswith(".py")]
    fail(f"{files[0] if files else 'a --config file'}: the config file cannot be loaded "
         f"({type(e).__name__}: {_exception_text(e)})")
  _check_config_files()
  return rest


class _ReportedElsewhere(logging.Filter):
  """Drops the library log records that repeat, with a traceback, a failure that reaches ``main``
  anyway (printed there as one line, or with its traceback if it is a bug): orbax's reports of
  the writer threads of a save that failed, gcsfs's "out of retries"."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.exc_info and ("/orbax/" in record.pathname
                                     or "/gcsfs/" in record.pathname))


def _quiet_reported() -> None:
  handlers = [absl_logging.get_absl_handler()] + logging.getLogger().handlers
  for h in handlers:
    if not any(isinstance(f, _ReportedElsewhere) for f in h.filters):
      h.addFilter(_ReportedElsewhere())


def _stop(status: int) -> NoReturn:
  """Ends the process now: the one line is out; what other threads might still print (reads and
  writes in flight after a failure) is not, and none of them is waited for."""
  for handler in [absl_logging.get_absl_handler()] + logging.getLogger().handlers:
    handler.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
  os._exit(status)  # pylint: disable=protected-access


def report(e: BaseException) -> Optional[int]:
  """Prints ``error: <one line>`` for an exception that is bad input or a runtime failure and
  returns its exit status; None for anything else (a bug: it keeps its traceback)."""
  if isinstance(e, (CheckpointError, InputError)):
    print(f"error: {one_line(e)}", file=sys.stderr)
    return 2
  if isinstance(e, failures.Terminated):
    e = failures.Stopped("stopped by SIGTERM")
  if not isinstance(e, failures.RunFailure):
    e = failures.from_exception(e)
    if e is None:
      return None
  print(f"error: {one_line(e, RUNTIME_MAX_CHARS)}", file=sys.stderr)
  return e.status


def run(main: Callable[[List[str]], int]) -> None:
  """``absl.app.run(main)`` with the one-line flag errors of ``parse_flags``; a checkpoint or an
  input file that cannot be read (or an input worker that died) printed as one line with exit
  status 2; a runtime failure (``train.failures``) printed as one line with its own status."""

  def guarded(argv):
    try:
      status = main(argv)
    except (Exception, failures.Terminated) as e:  # pylint: disable=broad-except
      status = report(e)
      if status is None:
        raise  # a bug: its traceback
      if status != 2:
        _stop(status)
    if status == 2:
      logs.exit_with(2)  # bad input: the one line is out; stray tracebacks are not
    return status

  logs.quiet_failed_reads()
  _quiet_reported()
  app.run(guarded, flags_parser=parse_flags)
