"""The one validation module: one-line ``ValueError``s that name the field and what is allowed.

Every config field, model field and command-line value is checked with these before anything is
read, compiled or written; the message format is ``FIELD=VALUE is not allowed; WHAT IS``. An input
that passes these checks and still cannot be used (a file, a record) raises ``InputError``, the
package's one class for it.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np


class InputError(ValueError):
  """An input that cannot be used, as one line naming it: a command-line argument
  (``ARG VALUE: what is wrong; expected WHAT``: a missing, foreign or corrupt file), or the input
  pipeline's reading or preparing (an unreadable record, a worker that died: the dataset and,
  where one is to blame, the file)."""


def not_allowed(field: str, value, allowed: str) -> ValueError:
  """The error every check raises: ``field=value is not allowed; allowed``."""
  return ValueError(f"{field}={value!r} is not allowed; {allowed}")


def check_choice(field: str, value, allowed: Sequence) -> None:
  """``value`` must be one of ``allowed``."""
  if value not in tuple(allowed):
    raise not_allowed(field, value, f"choose one of {', '.join(map(repr, allowed))}")


def is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value) -> bool:
  return (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, (bool, np.bool_)))


def check_int(field: str, value, minimum: int = 1, maximum: Optional[int] = None) -> int:
  """An integer ``>= minimum`` (and ``<= maximum``); returns it as ``int``."""
  ok = is_int(value) and value >= minimum and (maximum is None or value <= maximum)
  if not ok:
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    raise not_allowed(field, value, f"it must be an integer {bound}")
  return int(value)


def check_flag(field: str, value) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise not_allowed(field, value, "it must be True or False")
  return bool(value)


def check_range(field: str, value, low: Optional[float] = None, high: Optional[float] = None,
                low_open: bool = False, high_open: bool = False) -> float:
  """A finite number in the interval from ``low`` to ``high`` (open ends where asked); returns it.

  ``None`` leaves that side unbounded.
  """
  ok = is_number(value) and math.isfinite(float(value))
  if ok and low is not None:
    ok = float(value) > low if low_open else float(value) >= low
  if ok and high is not None:
    ok = float(value) < high if high_open else float(value) <= high
  if not ok:
    if low is not None and high is not None:
      where = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
      where = f"{'>' if low_open else '>='} {low:g}"
    elif high is not None:
      where = f"{'<' if high_open else '<='} {high:g}"
    else:
      where = "finite"
    raise not_allowed(field, value, f"it must be a number {where}")
  return float(value)


def check_pair(field: str, value, at_most_one: bool) -> Tuple[float, float]:
  """A ``(low, high)`` pair of numbers with ``0 < low <= high`` (and ``high <= 1``)."""
  ok = (isinstance(value, (tuple, list)) and len(value) == 2 and all(map(is_number, value))
        and 0.0 < float(value[0]) <= float(value[1]))
  if ok and at_most_one:
    ok = float(value[1]) <= 1.0
  if not ok:
    limit = "0 < low <= high <= 1" if at_most_one else "0 < low <= high"
    raise not_allowed(field, value, f"it must be a pair (low, high) with {limit}")
  return float(value[0]), float(value[1])


def prefixed(prefix: str, error: ValueError) -> ValueError:
  """The same one-line error with its field named from the config root (``model.alpha_min=...``)."""
  return ValueError(f"{prefix}{error}")


def frozen(value):
  """``(type, value)``, recursively for lists and tuples, so that equal-looking values of different
  types (``1``, ``1.0``, ``True``) are different keys; TypeError if ``value`` is unhashable."""
  if isinstance(value, (list, tuple)):
    return type(value), tuple(frozen(v) for v in value)
  hash(value)
  return type(value), value


_PASSED: Dict[tuple, None] = {}  # keys of the checks that passed, oldest first
_MAX_PASSED = 1024


def check_once(check: Callable[[], None], key) -> None:
  """Runs ``check()`` unless it already passed for ``key`` in this process.

  ``key`` names the check and what it reads (e.g. ``frozen`` field values); ``None`` or an
  unhashable key runs the check every time, and a check that fails is never remembered. The newest
  1,024 keys are kept.
  """
  try:
    if key is not None and key in _PASSED:
      return
  except TypeError:
    key = None
  check()
  if key is not None:
    if len(_PASSED) >= _MAX_PASSED:
      del _PASSED[next(iter(_PASSED))]
    _PASSED[key] = None


class ArgumentParser(argparse.ArgumentParser):
  """``argparse.ArgumentParser`` whose errors are one line (``error: prog: message``, exit 2)
  instead of the usage text followed by the message."""

  def error(self, message):
    print(f"error: {self.prog}: {message}", file=sys.stderr)
    sys.exit(2)
