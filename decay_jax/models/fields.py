"""Validation and preset helpers shared by the model classes: one-line errors before compilation.

The residual fields and their checks are in ``decay_jax.models.residual``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from decay_jax import validate
from decay_jax.models import layers, residual

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


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


def check_execution(m) -> None:
  """The execution fields of the transformer models: compute dtype, attention kernel, remat."""
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
  """``cls(**presets[preset], **overrides)`` with one-line errors for unknown names.

  A class with a ``residual`` field also takes its flat fields (``alpha_min=0.7``), set on the
  ``residual`` given or on the class default (``residual.Residual.from_fields``).
  """
  validate.check_choice("preset", preset, tuple(presets))
  fields = {f.name for f in dataclasses.fields(cls)} - {"parent", "name"}
  if "residual" in fields:
    fields |= set(residual.NAMES)
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; allowed: {sorted(fields)}")
  kwargs = {**presets[preset], **overrides}
  if "residual" in fields:
    default = cls.__dataclass_fields__["residual"].default
    spec, kwargs = residual.Residual.from_fields(kwargs, default)
    kwargs["residual"] = spec
  return cls(**kwargs)
