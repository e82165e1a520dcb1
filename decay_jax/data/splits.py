"""Split strings of the npz and image-folder sources: ``'name'`` or a Python slice ``'name[a:b]'``."""

from __future__ import annotations

import re
from typing import Sequence, Tuple

_SPLIT_RE = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\])?$")


def parse(split, field: str, names: Sequence[str], where: str) -> Tuple[str, slice]:
  """``'train'`` -> ``('train', slice(None))``; ``'train[:8000]'`` -> ``('train', slice(None, 8000))``.

  Args:
    split: the configured split string.
    field: the config field that holds it (named in the error).
    names: the split names the source has.
    where: the source, as the error should name it (e.g. ``"this npz"``).

  Raises:
    ValueError: one line naming ``field`` and the allowed splits.
  """
  match = _SPLIT_RE.match(split) if isinstance(split, str) else None
  allowed = ", ".join(repr(n) for n in names)
  if match is None or match.group(1) not in names:
    example = f"{names[0]}[:8000]" if names else "train[:8000]"
    raise ValueError(f"{field}={split!r} is not allowed; {where} has the splits {allowed} "
                     f"(or a slice of one, such as {example!r})")
  name, start, stop = match.groups()
  to_int = lambda s: int(s) if s else None
  return name, slice(to_int(start), to_int(stop))


def select(n: int, sl: slice, split: str, field: str) -> range:
  """The example indices a slice selects out of ``n``; raises if it selects none."""
  indices = range(n)[sl]
  if len(indices) == 0:
    raise ValueError(f"{field}={split!r} is not allowed; it selects no examples")
  return indices
