"""Upstream MAE's fine-tuning optimiser: layer-wise lr decay and its weight-decay groups
(docs/finetune.md 2).

Each parameter has a layer id from its timm name: ``cls_token``, ``pos_embed`` and ``patch_embed.*``
are 0, ``blocks.j.*`` is ``j + 1`` (so is block ``j``'s row of the hyper-connection weights
``hyper_*``, stacked ``(depth, ...)`` like the blocks), everything else (``fc_norm``, ``head``) is
``depth + 1``. Its
learning rate is ``lr(step) * layer_decay ** (depth + 1 - id)``. Weight decay (0.05) applies to
tensors whose torch shape has rank >= 2 except ``cls_token`` and ``pos_embed``; never to biases or
LayerNorm parameters. The update equals torch's AdamW over those parameter groups:

    p <- p - lr_g * (adam(g) + wd_g * p),   lr_g = lr(step) * scale_g

For the scanned blocks (leaves with a leading layer axis) the scale is a per-layer vector
broadcast over that axis, so one leaf carries all ``depth`` groups.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decay_jax.train import optim

NO_WEIGHT_DECAY = ("cls_token", "pos_embed")  # timm's VisionTransformer.no_weight_decay()
STEM = ("cls_token", "pos_embed", "patch_embed")
BLOCKS = "blocks"
HYPER = "hyper_"  # hyper-connection weights, one row per block (models/hyper.py)


def _top(path) -> str:
  return getattr(path[0], "key", str(path[0]))


def layer_ids(params, depth: int):
  """The layer id of every leaf: an int, or for scanned block leaves ``1 + arange(depth)``."""
  def rule(path, _):
    name = _top(path)
    if name in STEM:
      return 0
    if name == BLOCKS or name.startswith(HYPER):
      return np.arange(1, depth + 1)
    return depth + 1
  return jax.tree_util.tree_map_with_path(rule, params)


def lr_scales(params, depth: int, layer_decay: float):
  """``layer_decay ** (depth + 1 - id)`` per leaf, shaped to broadcast against it (float32)."""
  def scale(ids, p):
    s = np.asarray(layer_decay, np.float64) ** (depth + 1 - np.asarray(ids))
    if np.ndim(s):  # a block leaf: one scale per layer along the leading axis
      s = s.reshape((-1,) + (1,) * (p.ndim - 1))
    return jnp.asarray(s, jnp.float32)
  return jax.tree_util.tree_map(scale, layer_ids(params, depth), params)


def weight_decay_mask(params):
  """True where upstream decays: pre-training's rank rule (``optim.weight_decay_mask``: torch rank
  >= 2, a block leaf's layer axis not counted) except ``cls_token`` and ``pos_embed``."""
  return jax.tree_util.tree_map_with_path(
      lambda path, decayed: decayed and _top(path) not in NO_WEIGHT_DECAY,
      optim.weight_decay_mask(params, stacked=(BLOCKS,)))


def scale_per_leaf(scales) -> optax.GradientTransformation:
  """Multiplies each update leaf by its entry of ``scales`` (a tree like the parameters)."""
  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    return jax.tree_util.tree_map(lambda u, s: u * s.astype(u.dtype), updates, scales), state

  return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(params, depth: int, schedule: Callable, layer_decay: float,
                   weight_decay: float, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8) -> optax.GradientTransformation:
  """AdamW with torch's defaults (betas 0.9, 0.999; eps 1e-8), decoupled weight decay on
  ``weight_decay_mask``, the learning rate ``schedule(step)`` and the layer-wise scales."""
  return optax.chain(
      optax.scale_by_adam(b1, b2, eps),
      optax.add_decayed_weights(weight_decay, mask=weight_decay_mask(params)),
      optax.scale_by_learning_rate(schedule),
      scale_per_leaf(lr_scales(params, depth, layer_decay)))


def from_config(optim_cfg, batch_size: int, total_steps: int, warmup_steps: int, params,
                depth: int):
  """``(optax transformation, lr schedule)`` of a fine-tuning config's ``optim`` section
  (``lr = base_lr x batch / 256`` unless ``lr`` is set; the schedule of ``optim.lr_schedule``)."""
  schedule = optim.lr_schedule(optim_cfg, batch_size, total_steps, warmup_steps)
  tx = make_optimizer(params, depth, schedule, optim_cfg.layer_decay, optim_cfg.weight_decay,
                      optim_cfg.b1, optim_cfg.b2, optim_cfg.eps)
  return tx, schedule
