"""Fine-tuning's on-device batch augmentation (docs/finetune.md, "Recipe"): timm's random erasing
(``random_erasing``) and Mixup / CutMix with label smoothing as timm's ``Mixup(mode='batch')``,
which upstream MAE applies to every per-GPU batch.

The batch is cut into groups of ``group`` consecutive examples (upstream: one GPU's 32); each group
draws its own switch (CutMix with probability ``switch_prob``, else Mixup), its own
``lam ~ Beta(cutmix_alpha, cutmix_alpha)`` or ``Beta(mixup_alpha, mixup_alpha)`` and, for CutMix,
its own box; each example is mixed with its mirror in the group (``i <-> G - 1 - i``):

    Mixup:   x <- lam x + (1 - lam) flip(x)
    CutMix:  x[y0:y1, x0:x1] <- flip(x)[y0:y1, x0:x1],  lam <- 1 - (y1 - y0)(x1 - x0) / (H W)
    target = lam smooth(y) + (1 - lam) smooth(flip(y)),  smooth = one-hot with off = s / K and
             on = 1 - s + off

The CutMix box (timm ``rand_bbox``): ``r = sqrt(1 - lam)``, ``cut = floor(side r)``, centre
``cy ~ U{0..H-1}``, ``cx ~ U{0..W-1}``, edges ``clip(c -/+ floor(cut / 2), 0, side)``.
Images are ``(N, H, W, C)``; labels ``(N,)`` int; targets ``(N, K)`` float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def smooth_one_hot(labels, num_classes: int, smoothing: float):
  """``(N,) -> (N, K)``: ``1 - smoothing + smoothing / K`` at the label, ``smoothing / K`` elsewhere."""
  off = smoothing / num_classes
  return jax.nn.one_hot(labels, num_classes, dtype=jnp.float32) * (1.0 - smoothing) + off


def cutmix_box(height: int, width: int, lam, cy, cx):
  """``(y0, y1, x0, x1)`` of the CutMix box for ``lam`` centred at ``(cy, cx)``, and the corrected
  ``lam = 1 - box area / image area``."""
  ratio = jnp.sqrt(1.0 - lam)
  cut_h = jnp.floor(height * ratio).astype(jnp.int32)
  cut_w = jnp.floor(width * ratio).astype(jnp.int32)
  y0 = jnp.clip(cy - cut_h // 2, 0, height)
  y1 = jnp.clip(cy + cut_h // 2, 0, height)
  x0 = jnp.clip(cx - cut_w // 2, 0, width)
  x1 = jnp.clip(cx + cut_w // 2, 0, width)
  corrected = 1.0 - ((y1 - y0) * (x1 - x0)).astype(jnp.float32) / (height * width)
  return (y0, y1, x0, x1), corrected


def mix_group(images, targets, lam, use_cutmix, cy, cx):
  """One group ``(G, H, W, C)`` / ``(G, K)`` mixed with its mirror; returns images, targets."""
  _, h, w, _ = images.shape
  flipped = images[::-1]
  (y0, y1, x0, x1), cut_lam = cutmix_box(h, w, lam, cy, cx)
  rows = jnp.arange(h)[:, None]
  cols = jnp.arange(w)[None, :]
  inside = ((rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1))[None, :, :, None]
  cut = jnp.where(inside, flipped, images)
  blend = (lam * images.astype(jnp.float32)
           + (1.0 - lam) * flipped.astype(jnp.float32)).astype(images.dtype)
  mixed = jnp.where(use_cutmix, cut, blend)
  lam = jnp.where(use_cutmix, cut_lam, lam)
  return mixed, lam * targets + (1.0 - lam) * targets[::-1]


def mixup_cutmix(rng, images, labels, num_classes: int, group: int = 32,
                 mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0, switch_prob: float = 0.5,
                 smoothing: float = 0.1):
  """Mixed images ``(N, H, W, C)`` and soft targets ``(N, K)``, one draw per group of ``group``.

  As timm: an alpha of 0 turns that mode off (the other one always runs); both 0 mix nothing and
  only smooth the labels.
  """
  n, h, w, c = images.shape
  if n % group:
    raise ValueError(f"batch {n} is not allowed; it must be a multiple of the mixup group {group}")
  targets = smooth_one_hot(labels, num_classes, smoothing)
  if mixup_alpha <= 0 and cutmix_alpha <= 0:
    return images, targets
  groups = n // group
  k_switch, k_cut, k_mix, k_y, k_x = jax.random.split(rng, 5)
  if mixup_alpha <= 0 or cutmix_alpha <= 0:
    use_cutmix = jnp.full((groups,), cutmix_alpha > 0)
  else:
    use_cutmix = jax.random.uniform(k_switch, (groups,)) < switch_prob
  beta = lambda key, a: jax.random.beta(key, a, a, (groups,)) if a > 0 else jnp.ones((groups,))
  lam = jnp.where(use_cutmix, beta(k_cut, cutmix_alpha), beta(k_mix, mixup_alpha))
  cy = jax.random.randint(k_y, (groups,), 0, h)
  cx = jax.random.randint(k_x, (groups,), 0, w)
  mixed, soft = jax.vmap(mix_group)(images.reshape(groups, group, h, w, c),
                                     targets.reshape(groups, group, num_classes),
                                     lam, use_cutmix, cy, cx)
  return mixed.reshape(n, h, w, c), soft.reshape(n, num_classes)


def soft_cross_entropy(logits, targets):
  """timm ``SoftTargetCrossEntropy``: batch mean of ``sum_k -t_k log_softmax(z)_k``."""
  return jnp.mean(jnp.sum(-targets * jax.nn.log_softmax(logits.astype(jnp.float32)), axis=-1))


def random_erasing(rng, images, prob: float = 0.25, area=(0.02, 1.0 / 3.0), aspect=(0.3, 1 / 0.3),
                   tries: int = 10):
  """timm ``RandomErasing(p, mode='pixel', count 1)`` on normalised images ``(N, H, W, C)``, per
  example: with probability ``prob``, up to ``tries`` boxes of area ``U(area) x H W`` and aspect
  ``exp(U(log aspect))`` (``h = round(sqrt(area x aspect))``, ``w = round(sqrt(area / aspect))``);
  the first with ``h < H`` and ``w < W`` is placed uniformly and filled with N(0, 1) noise per
  pixel and channel; when none fits nothing is erased."""
  n, h, w, c = images.shape
  k_apply, k_area, k_aspect, k_top, k_left, k_noise = jax.random.split(rng, 6)
  erase = jax.random.uniform(k_apply, (n,)) <= prob
  target = jax.random.uniform(k_area, (n, tries), minval=area[0], maxval=area[1]) * (h * w)
  ratio = jnp.exp(jax.random.uniform(k_aspect, (n, tries), minval=jnp.log(aspect[0]),
                                     maxval=jnp.log(aspect[1])))
  bh = jnp.round(jnp.sqrt(target * ratio)).astype(jnp.int32)
  bw = jnp.round(jnp.sqrt(target / ratio)).astype(jnp.int32)
  fits = (bh < h) & (bw < w)
  first = jnp.argmax(fits, axis=1)
  bh = jnp.take_along_axis(bh, first[:, None], 1)[:, 0]
  bw = jnp.take_along_axis(bw, first[:, None], 1)[:, 0]
  erase = erase & fits.any(axis=1)
  top = jnp.floor(jax.random.uniform(k_top, (n,)) * (h - bh + 1)).astype(jnp.int32)
  left = jnp.floor(jax.random.uniform(k_left, (n,)) * (w - bw + 1)).astype(jnp.int32)
  rows = jnp.arange(h)[None, :, None]
  cols = jnp.arange(w)[None, None, :]
  box = ((rows >= top[:, None, None]) & (rows < (top + bh)[:, None, None])
         & (cols >= left[:, None, None]) & (cols < (left + bw)[:, None, None]) & erase[:, None, None])
  noise = jax.random.normal(k_noise, images.shape, jnp.float32).astype(images.dtype)
  return jnp.where(box[..., None], noise, images)
