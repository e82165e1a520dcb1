"""One line and exit status 2 for bad command-line input, before anything is compiled.

absl and ml_collections report a missing ``--config`` file as a multi-line ``OSError`` raised on
first use, a misspelt ``--config.x`` override as a ``KeyError`` traceback, and a flag error as a
``FATAL`` line plus usage advice. ``run(main)`` replaces their flag parser with one that turns each
of these into ``error: --FLAG...: what is wrong and what is expected`` on stderr and exit 2, and
turns the input errors that escape ``main`` (``train.checkpoint.CheckpointError``: a missing,
unreadable or corrupt checkpoint, wherever it is read) into the same single line. Other exceptions
keep their traceback: they are bugs, not bad input.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Callable, List, NoReturn

from absl import app, flags
from ml_collections.config_flags import config_flags

from decay_jax import logs
from decay_jax.data.loader import InputError
from decay_jax.train.checkpoint import CheckpointError

FLAGS = flags.FLAGS
MAX_CHARS = 300
_DID_YOU_MEAN = re.compile(r'Did you mean "([^"]+)" instead of "([^"]+)"')


def one_line(text) -> str:
  """``text`` with its whitespace (newlines included) collapsed, cut to ``MAX_CHARS``."""
  line = " ".join(str(text).split())
  return line if len(line) <= MAX_CHARS else line[:MAX_CHARS - 3] + "..."


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


def run(main: Callable[[List[str]], int]) -> None:
  """``absl.app.run(main)`` with the one-line flag errors of ``parse_flags``, and a checkpoint or an
  input file that cannot be read (or an input worker that died) printed as one line with exit
  status 2."""

  def guarded(argv):
    try:
      status = main(argv)
    except (CheckpointError, InputError) as e:
      print(f"error: {one_line(e)}", file=sys.stderr)
      status = 2
    if status == 2:
      logs.exit_with(2)  # bad input: the one line is out; stray tracebacks are not
    return status

  logs.quiet_failed_reads()
  app.run(guarded, flags_parser=parse_flags)
