"""Tasks: what differs between MAE and SiT training (model, loss, metrics, pictures, FLOPs).

The trainer (``decay_jax.train.trainer``) is one loop; a task supplies
  * ``model`` and ``init_inputs(batch)``: the Flax module and the arguments of its ``init``;
  * ``loss(params, batch, rng) -> (loss, metrics)``: the per-microbatch objective;
  * ``picture(params, batch, rng) -> uint8 (H, W, 3)``: an image grid for monitoring;
  * ``train_flops_per_example()``: model FLOPs of one training example (forward + backward).
Batches are dicts: ``image (N, H, W, C)`` float32 and ``label (N,)`` int32.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import flops, layers
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib


def to_uint8(images, mean, std) -> np.ndarray:
  """Normalised ``(N, H, W, C)`` -> uint8 RGB for pictures (grey images get 3 channels)."""
  x = np.asarray(images, np.float32) * np.asarray(std) + np.asarray(mean)
  x = np.clip(np.round(x * 255.0), 0, 255).astype(np.uint8)
  return np.repeat(x, 3, axis=-1) if x.shape[-1] == 1 else x


def grid(rows, pad: int = 2) -> np.ndarray:
  """Rows of equally sized uint8 images ``[(N, H, W, 3), ...]`` -> one ``(R*(H+pad), N*(W+pad), 3)``."""
  r, (n, h, w, c) = len(rows), rows[0].shape
  out = np.full((r * (h + pad) + pad, n * (w + pad) + pad, c), 255, np.uint8)
  for i, row in enumerate(rows):
    for j, im in enumerate(row):
      out[pad + i * (h + pad):pad + i * (h + pad) + h, pad + j * (w + pad):pad + j * (w + pad) + w] = im
  return out


class MAETask:
  """Masked-autoencoder pretraining (official_facts.md 1 and 2)."""
  name = "mae"

  def __init__(self, model: mae_lib.MaskedAutoencoder, mean=(0.0,), std=(1.0,)):
    self.model = model
    self.mean, self.std = mean, std

  def init_inputs(self, batch: int):
    m = self.model
    return (jnp.zeros((batch, m.img_size, m.img_size, m.in_chans), jnp.float32),
            jnp.zeros((batch, m.num_patches), jnp.float32))

  def loss(self, params, batch, rng) -> Tuple[jax.Array, Dict[str, Any]]:
    out = self.model.apply({"params": params}, batch["image"], rngs={"masking": rng})
    metrics = {"loss": out["loss"]}
    for i, v in enumerate(out["encoder_norms"]):
      metrics[f"feature_norm/encoder_{i:02d}"] = v
    for i, v in enumerate(out["decoder_norms"]):
      metrics[f"feature_norm/decoder_{i:02d}"] = v
    return out["loss"], metrics

  def picture(self, params, batch, rng, num: int = 8) -> np.ndarray:
    """Rows: masked input, reconstruction (visible patches pasted back), target image."""
    m = self.model
    imgs = batch["image"][:num]
    out = jax.jit(lambda p, x, r: m.apply({"params": p}, x, rngs={"masking": r}))(params, imgs, rng)
    pred, mask = np.asarray(out["pred"]), np.asarray(out["mask"])[..., None]
    target = np.asarray(layers.patchify(imgs, m.patch_size))
    if m.norm_pix_loss:  # undo the per-patch normalisation with the target's own statistics
      mean = target.mean(-1, keepdims=True)
      std = np.sqrt(target.var(-1, keepdims=True, ddof=1) + 1e-6)
      pred = pred * std + mean
    unp = lambda x: np.asarray(layers.unpatchify(jnp.asarray(x), m.patch_size, m.img_size,
                                                 m.img_size, m.in_chans))
    masked = unp(target * (1 - mask))  # removed patches shown at the normalised mean (grey)
    recon = unp(target * (1 - mask) + pred * mask)
    rows = [to_uint8(x, self.mean, self.std) for x in (masked, recon, np.asarray(imgs))]
    return grid(rows)

  def train_flops_per_example(self) -> float:
    return 3.0 * flops.mae_forward_flops(self.model)


class SiTTask:
  """Flow-matching training of SiT on the linear path (official_facts.md 5.1).

  ``x_t = t x_1 + (1 - t) x_0``, ``x_0 ~ N(0, I)`` noise, ``x_1`` data, ``t ~ U[0, 1)``; the model
  regresses the velocity ``x_1 - x_0``; labels are dropped to the null class with probability
  ``class_dropout_prob`` (classifier-free guidance training).
  """
  name = "sit"

  def __init__(self, model: sit_lib.SiT, mean=(0.0,), std=(1.0,)):
    self.model = model
    self.mean, self.std = mean, std

  def init_inputs(self, batch: int):
    m = self.model
    return (jnp.zeros((batch, m.input_size, m.input_size, m.in_channels), jnp.float32),
            jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.int32))

  def loss(self, params, batch, rng):
    x1, y = batch["image"], batch["label"]
    k_t, k_noise, k_drop = jax.random.split(rng, 3)
    t = jax.random.uniform(k_t, (x1.shape[0],))
    x0 = jax.random.normal(k_noise, x1.shape)
    tb = t[:, None, None, None]
    xt = tb * x1 + (1 - tb) * x0
    v = self.model.apply({"params": params}, xt, t, y, train=True, rngs={"label_drop": k_drop})
    per_example = ((v - (x1 - x0)) ** 2).mean(axis=(1, 2, 3))
    loss = per_example.mean()
    return loss, {"loss": loss}

  def picture(self, params, batch, rng, num: int = 8) -> np.ndarray:
    imgs = np.asarray(batch["image"][:num])
    return grid([to_uint8(imgs, self.mean, self.std)])

  def train_flops_per_example(self) -> float:
    return 3.0 * flops.sit_forward_flops(self.model)
