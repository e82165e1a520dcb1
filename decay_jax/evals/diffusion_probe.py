"""Representations of a U-ViT noise-prediction network for the frozen-feature evaluators.

A diffusion model has no clean-image encoder; its representation is read at a small noise level
(docs/uvit.md, "Diffusion-feature probe"). ``probed(model, t_p)`` returns the same U-ViT (same
parameter tree) with a ``features(images)`` method as the MAE's:

    x_t = sqrt(ab(t_p)) x + sqrt(1 - ab(t_p)) eps,   ab(t) = exp(-(0.1 t + 9.95 t^2))  (VPSDE)
    features(x) = every block's output (in -> mid -> out) at network time 999 t_p, patch tokens
                  only (time and label tokens dropped): ``(2K + 1, N, patches, D)``

(a model of the discrete schedule is read at its step ``n = round(1000 t_p)``, network time n)

so KNN, the linear probes and the per-block curve (``knn``, ``linear``, ``layers``) run on it
unchanged; their ``mean`` feature is the mean over patch tokens. ``eps`` depends on the image
alone: its key is a fixed key folded with a 32-bit fingerprint of the image (``fingerprint_keys``),
so a feature does not depend on the batch, the order or the device
count [CHOICE: docs/uvit.md 5.2 folds in the example index, which the shared feature extraction does not
carry]. Conditional models are probed with their null label (they must have been trained with
label dropout). The mid block, index K, is the spec's pre-registered layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from decay_jax.diffusion import vp
from decay_jax.models import uvit as uvit_lib

PROBE_T = 0.01  # docs/uvit.md 5.2's default noise level (about DDPM step 10)
NOISE_KEY = 20240417


def fingerprint_keys(images):
  """One PRNG key per image ``(N, H, W, C)`` from its pixels only: the pixels rounded to 1/1024
  and summed with fixed random uint32 weights modulo 2^32. Integer sums do not depend on the order
  of the additions, so the key is the same in any program, batch or sharding."""
  weights = jax.random.bits(jax.random.key(NOISE_KEY), images.shape[1:], jnp.uint32)
  pixels = jnp.round(images.astype(jnp.float32) * 1024).astype(jnp.int32).astype(jnp.uint32)
  codes = jnp.sum(pixels * weights, axis=(1, 2, 3), dtype=jnp.uint32)
  return jax.vmap(lambda c: jax.random.fold_in(jax.random.key(NOISE_KEY), c))(codes)


class ProbedUViT(uvit_lib.UViT):
  """A ``UViT`` whose ``features`` are the noised-input block outputs of the module docstring.

  ``probe_t``: the noise level t_p in (0, 1); ``probe_label``: the label fed to a conditional
  model (its null label), -1 for unconditional ones; ``probe_schedule``: the run's
  ``diffusion.schedule``.
  """
  probe_t: float = PROBE_T
  probe_label: int = -1
  probe_schedule: str = "vpsde"

  @property
  def feature_blocks(self) -> int:
    """Blocks the evaluators see: ``2K + 1`` (U-ViT's ``depth`` argument is not the count)."""
    return self.num_blocks

  def features(self, images):
    """``(2K + 1, N, patches, D)`` float32 block outputs of the noised ``images (N, H, W, C)``."""
    schedule, n = vp.schedule(self.probe_schedule), images.shape[0]
    if isinstance(schedule, vp.DiscreteVP):  # a training time of the schedule: its step n
      t = jnp.full((n,), round(schedule.num_steps * self.probe_t), jnp.int32)
    else:
      t = jnp.full((n,), self.probe_t, jnp.float32)
    eps = jax.vmap(lambda k: jax.random.normal(k, images.shape[1:]))(fingerprint_keys(images))
    x_t = schedule.perturb(images.astype(jnp.float32), eps, t)
    y = jnp.full((n,), self.probe_label, jnp.int32) if self.conditional else None
    return self.block_outputs(x_t, schedule.training_net_time(t), y)[:, :, self.extras:]


def probed(model: uvit_lib.UViT, probe_t: float = PROBE_T, null_label: int = -1,
           schedule: str = "vpsde") -> ProbedUViT:
  """The probe view of ``model`` (same fields, same parameters) trained on ``schedule``."""
  if not 0.0 < probe_t < 1.0:
    raise ValueError(f"probe_t={probe_t!r} is not allowed; it must be in (0, 1)")
  if model.conditional and null_label < 0:
    raise ValueError("a conditional U-ViT is probed with its null label: it must have been "
                     "trained with diffusion.class_dropout_prob > 0")
  fields = {f: getattr(model, f) for f in model.__dataclass_fields__
            if f not in ("parent", "name")}
  return ProbedUViT(**fields, probe_t=probe_t, probe_label=null_label, probe_schedule=schedule)
