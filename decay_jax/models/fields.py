"""Validation and preset helpers shared by the model classes: one-line errors before compilation."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from decay_jax import layers, schedules

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def check_positive_ints(m, names) -> None:
  for field in names:
    v = getattr(m, field)
    if not (isinstance(v, (int, np.integer)) and v >= 1):
      raise ValueError(f"{field}={v!r} is not allowed; it must be an integer >= 1")


def check_common(m) -> None:
  """Fields every decayed model has: the schedule, the shortcut form, dtype, attention, remat."""
  schedules.check_alpha_min(m.alpha_min)
  schedules.check_choice("schedule_convention", m.schedule_convention, schedules.CONVENTIONS)
  schedules.check_choice("schedule_shape", m.schedule_shape, schedules.SHAPES)
  schedules.check_choice("shortcut_form", m.shortcut_form, schedules.FORMS)
  schedules.check_choice("attention_impl", m.attention_impl, layers.ATTENTION_IMPLS)
  schedules.check_choice("remat_policy", m.remat_policy, layers.REMAT_POLICIES)
  try:
    name = jnp.dtype(m.dtype).name
  except TypeError:
    name = repr(m.dtype)
  schedules.check_choice("dtype", name, COMPUTE_DTYPES)


def from_preset(cls, presets: dict, preset: str, overrides: dict):
  """``cls(**presets[preset], **overrides)`` with one-line errors for unknown names."""
  schedules.check_choice("preset", preset, tuple(presets))
  fields = {f.name for f in dataclasses.fields(cls)} - {"parent", "name"}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; allowed: {sorted(fields)}")
  return cls(**{**presets[preset], **overrides})
