"""Arms of a comparison: a grid over config fields, times seeds.

A grid is a list of ``FIELD=V1,V2,...`` texts (``FIELD`` a dotted config path such as
``model.alpha_min`` or ``model.branch_gain``); the arms are the Cartesian product of the values,
in the order given (the first field varies slowest). Arms that are no product (decay, LayerScale,
a control) are listed one by one instead: ``FIELD=V[+FIELD=V...]`` each (``parse_arms``). Each arm runs ``seeds`` times, with
``config.seed + 0, 1, ...``. Values are read as the type of the field's current value (bool:
true/false, int, float, str).

Directories: ``<field>_<value>`` per field joined by ``_`` (``model.alpha_min`` is written
``alpha`` so that the demo's ``alpha_0.6`` stays the directory it always was), and ``_seed<N>``
added for seeds other than the config's own: adding seeds to a finished comparison reuses its runs.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, List, Sequence, Tuple

from decay_jax import validate

# Short names in directories and tables; other fields use the last part of their path.
_SHORT = {"model.alpha_min": "alpha"}


@dataclasses.dataclass(frozen=True)
class Arm:
  """One cell of the grid: ``overrides`` ``((field, value), ...)`` applied to the base config."""
  overrides: Tuple[Tuple[str, Any], ...]

  @property
  def name(self) -> str:
    """``alpha_min=0.6, branch_gain=layerscale``: the arm's label in tables."""
    return ", ".join(f"{field.rsplit('.', 1)[-1]}={_text(v)}" for field, v in self.overrides)

  def dirname(self, seed: int, base_seed: int) -> str:
    parts = [f"{_SHORT.get(field, field.rsplit('.', 1)[-1])}_{_text(v)}"
             for field, v in self.overrides]
    if seed != base_seed:
      parts.append(f"seed{seed}")
    return "_".join(parts) or "base"

  def config(self, base, seed: int):
    """A resolved copy of ``base`` with this arm's values and ``seed``."""
    cfg = base.copy_and_resolve_references()
    for field, value in self.overrides:
      *parents, leaf = field.split(".")
      node = cfg
      for p in parents:
        node = node[p]
      node[leaf] = value
    cfg.seed = seed
    return cfg


def _text(value) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, float):
    return f"{value:g}"
  return str(value)


def _current(config, field: str):
  node = config
  for part in field.split("."):
    try:
      node = node[part]
    except (KeyError, AttributeError, TypeError):
      raise validate.not_allowed("grid", field, "the config has no such field (a dotted path "
                                 "such as model.alpha_min)") from None
  return node


def _parse(field: str, current, text: str):
  text = text.strip()
  try:
    if isinstance(current, bool):
      if text.lower() not in ("true", "false"):
        raise ValueError
      return text.lower() == "true"
    if isinstance(current, int):
      return int(text)
    if isinstance(current, float):
      return float(text)
    if isinstance(current, str):
      return text
  except ValueError:
    raise validate.not_allowed("grid", f"{field}={text}", f"{field} takes a "
                               f"{type(current).__name__}") from None
  raise validate.not_allowed("grid", field, f"a {type(current).__name__} field cannot be varied "
                             "from the command line; use one config per arm")


def parse(config, specs: Sequence[str]) -> List[Arm]:
  """The arms of ``specs`` (``["model.alpha_min=0.6,1.0", ...]``) over ``config``.

  Raises:
    ValueError: one line naming the spec: no ``=``, no values, an unknown field, a value of the
      wrong type, a field given twice.
  """
  axes, seen = [], set()
  for spec in specs:
    field, sep, values = spec.partition("=")
    field = field.strip()
    if not sep or not field or not values.strip():
      raise validate.not_allowed("grid", spec, "write FIELD=V1,V2,... (e.g. "
                                 "model.alpha_min=0.6,1.0)")
    if field in seen:
      raise validate.not_allowed("grid", field, "it is given twice; list all its values once")
    seen.add(field)
    current = _current(config, field)
    parsed = [_parse(field, current, v) for v in values.split(",")]
    if len(set(parsed)) != len(parsed):
      raise validate.not_allowed("grid", spec, "a value is repeated")
    axes.append([(field, v) for v in parsed])
  return [Arm(tuple(cell)) for cell in itertools.product(*axes)]


def parse_arms(config, specs: Sequence[str]) -> List[Arm]:
  """One arm per spec ``FIELD=V[+FIELD=V...]`` (e.g. ``model.alpha_min=1+model.branch_gain=rezero``).

  Raises:
    ValueError: one line naming the spec, as ``parse``; also two equal arms.
  """
  arms = []
  for spec in specs:
    cells = []
    for part in spec.split("+"):
      field, sep, value = part.partition("=")
      field = field.strip()
      if not sep or not field or not value.strip() or "," in value:
        raise validate.not_allowed("arm", spec, "write FIELD=V joined by '+' (e.g. "
                                   "model.alpha_min=1+model.branch_gain=rezero)")
      if field in dict(cells):
        raise validate.not_allowed("arm", spec, f"{field} is given twice")
      cells.append((field, _parse(field, _current(config, field), value)))
    arm = Arm(tuple(cells))
    if arm in arms:
      raise validate.not_allowed("arm", spec, "the same arm is given twice")
    arms.append(arm)
  return arms


def seeds(config, count: int) -> List[int]:
  """``config.seed, config.seed + 1, ...``: ``count`` of them."""
  if count < 1:
    raise validate.not_allowed("seeds", count, "it must be at least 1")
  return [int(config.seed) + i for i in range(count)]
