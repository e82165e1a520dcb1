"""Validation and preset helpers shared by the model classes: one-line errors before compilation."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from decay_jax import validate
from decay_jax.models import layers, schedules

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


class DecayedShortcuts:
  """Mixin of the decayed models: ``shortcuts``, the identity coefficients rebuilt from the fields
  ``depth``, ``alpha_min``, ``schedule_convention``, ``schedule_shape``, ``shortcut_form``."""

  @property
  def shortcuts(self) -> schedules.Shortcuts:
    return schedules.shortcuts(self.depth, self.alpha_min, self.schedule_convention,
                               self.schedule_shape, self.shortcut_form)


class PatchGrid:
  """Mixin of the image encoders: ``grid`` patches per side and ``num_patches`` of an image of
  ``img_size`` in ``patch_size`` patches."""

  @property
  def grid(self) -> int:
    return self.img_size // self.patch_size

  @property
  def num_patches(self) -> int:
    return self.grid ** 2


def check_positive_ints(m, names) -> None:
  for field in names:
    validate.check_int(field, getattr(m, field))


def check_patches(m) -> None:
  """An image encoder's ``img_size`` must be a multiple of its ``patch_size``."""
  if m.img_size % m.patch_size:
    raise ValueError(f"img_size={m.img_size} is not allowed; it must be a multiple of "
                     f"patch_size={m.patch_size}")


def check_common(m) -> None:
  """Fields every decayed model has: the schedule, the shortcut form, dtype, attention, remat."""
  validate.check_range("alpha_min", m.alpha_min, 0.0, 1.0, low_open=True)
  validate.check_choice("schedule_convention", m.schedule_convention, schedules.CONVENTIONS)
  validate.check_choice("schedule_shape", m.schedule_shape, schedules.SHAPES)
  validate.check_choice("shortcut_form", m.shortcut_form, schedules.FORMS)
  validate.check_choice("attention_impl", m.attention_impl, layers.ATTENTION_IMPLS)
  validate.check_choice("remat_policy", m.remat_policy, layers.REMAT_POLICIES)
  try:
    name = jnp.dtype(m.dtype).name
  except TypeError:
    name = m.dtype if isinstance(m.dtype, str) else repr(m.dtype)
  validate.check_choice("dtype", name, COMPUTE_DTYPES)
  if m.attention_impl == "cudnn" and name not in layers.CUDNN_DTYPES:
    raise ValueError(f"attention_impl='cudnn' is not allowed with dtype={name}; cuDNN flash "
                     f"attention needs dtype {' or '.join(layers.CUDNN_DTYPES)} (or choose "
                     "attention_impl=xla)")


def check_once(m, check: Callable) -> None:
  """``check(m)`` the first time these field values are seen in this process.

  Flax re-runs ``__post_init__`` on every clone of a module (each init, apply and trace), so
  without this the fields of one model were checked dozens of times per run.
  """
  try:
    key = (type(m).__name__, check.__name__) + tuple(
        (f.name, validate.frozen(getattr(m, f.name))) for f in dataclasses.fields(m)
        if f.name not in ("parent", "name"))
  except TypeError:  # an unhashable field value: check every time
    key = None
  validate.check_once(lambda: check(m), key)


def from_preset(cls, presets: dict, preset: str, overrides: dict):
  """``cls(**presets[preset], **overrides)`` with one-line errors for unknown names."""
  validate.check_choice("preset", preset, tuple(presets))
  fields = {f.name for f in dataclasses.fields(cls)} - {"parent", "name"}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; allowed: {sorted(fields)}")
  return cls(**{**presets[preset], **overrides})
