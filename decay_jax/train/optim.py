"""Optimiser and learning-rate schedule of the official recipes (docs/official_code.md 2.3, 2.4, 5.2).

MAE: AdamW(b1 0.9, b2 0.95, eps 1e-8), decoupled weight decay 0.05 on every tensor of rank >= 2
(cls, decoder cls and mask tokens included: they are 3-D) and on nothing else,
``lr = base_lr * effective_batch / 256``, linear warmup from 0 then half-cycle cosine to ``min_lr``,
updated every optimiser step. SiT: AdamW(0.9, 0.999), lr 1e-4 constant, weight decay 0. U-ViT:
AdamW(0.99, 0.999), weight decay 0.03 on every parameter (``decay_params='all'``), ``lr(s) = peak
min(s / W, 1)`` (``warmup_constant``).

``optax.adamw`` is torch's AdamW: the decay term is multiplied by the learning rate and eps sits
outside the square root.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("warmup_cosine", "warmup_constant", "constant")


def peak_lr(optim_cfg, batch_size: int) -> float:
  """``lr`` if set, else ``base_lr * batch_size / 256`` (the MAE scaling rule)."""
  if optim_cfg.get("lr") is not None:
    return float(optim_cfg.lr)
  return float(optim_cfg.base_lr) * batch_size / 256


def lr_schedule(optim_cfg, batch_size: int, total_steps: int, warmup_steps: int):
  """Step -> learning rate. ``warmup_cosine`` is upstream ``lr_sched.adjust_learning_rate``:

  ``lr(s) = peak * s / W`` for ``s < W``, else
  ``min_lr + (peak - min_lr) * (1 + cos(pi * (s - W) / (T - W))) / 2``.
  """
  peak = peak_lr(optim_cfg, batch_size)
  if optim_cfg.schedule == "constant":
    return lambda step: jnp.full((), peak, jnp.float32)
  if optim_cfg.schedule == "warmup_constant":  # U-ViT: LambdaLR min(s / W, 1); lr 0 at step 0
    return lambda step: peak * jnp.minimum(jnp.asarray(step, jnp.float32) / max(warmup_steps, 1),
                                           1.0)
  min_lr = float(optim_cfg.get("min_lr", 0.0))
  decay = max(total_steps - warmup_steps, 1)

  def schedule(step):
    s = jnp.asarray(step, jnp.float32)
    warm = peak * s / max(warmup_steps, 1)
    progress = jnp.clip((s - warmup_steps) / decay, 0.0, 1.0)
    cos = min_lr + (peak - min_lr) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
    return jnp.where(s < warmup_steps, warm, cos)

  return schedule


def weight_decay_mask(params, stacked: tuple = ("blocks", "enc_blocks", "dec_blocks")):
  """True for tensors of rank >= 2 (decayed), False for biases and norm parameters.

  For scanned blocks the leading layer axis does not count.

  A scanned LayerNorm scale has shape ``(depth, C)``: rank 1 per layer, so it is not decayed.
  The learnable-alpha ablation parameter ``(depth, 2)`` is a per-layer scalar pair: not decayed.
  Hyper-connections (``hyper_*``, stacked ``(depth, 2, ...)``): the static mixing weights and the
  scales are structure like alpha (not decayed, else ``A_r`` would be pulled from the identity
  towards 0); the dynamic projections ``hyper_dynamic_alpha`` / ``hyper_dynamic_beta`` are weight
  matrices (decayed, towards the static connections).
  """
  def rule(path, p):
    names = [getattr(k, "key", str(k)) for k in path]
    rank = p.ndim - (1 if names and names[0] in stacked else 0)
    if names == ["alpha"]:
      return False
    if names and names[0].startswith("hyper_"):
      return names[0] in ("hyper_dynamic_alpha", "hyper_dynamic_beta")
    return rank >= 2

  return jax.tree_util.tree_map_with_path(rule, params)


def make_optimizer(optim_cfg, batch_size: int, total_steps: int, warmup_steps: int):
  """Returns ``(optax transformation, lr schedule)``."""
  schedule = lr_schedule(optim_cfg, batch_size, total_steps, warmup_steps)
  everything = optim_cfg.get("decay_params", "matrices") == "all"  # U-ViT: torch AdamW, no groups
  tx = optax.adamw(schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                   weight_decay=optim_cfg.weight_decay,
                   mask=None if everything else weight_decay_mask)
  if optim_cfg.get("grad_clip_norm"):
    tx = optax.chain(optax.clip_by_global_norm(optim_cfg.grad_clip_norm), tx)
  return tx, schedule
