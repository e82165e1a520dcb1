"""Masked-autoencoder pre-training (docs/official_code.md 1 and 2): the loss of the official MAE on
masks drawn per example, reconstructions as the picture."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import plots
from decay_jax.data import on_device
from decay_jax.models import factory, flops, layers
from decay_jax.models import mae as mae_lib
from decay_jax.train import config as config_lib
from decay_jax.train.tasks import base


class MAETask(base.Task):
  """Masked-autoencoder pretraining (docs/official_code.md 1 and 2)."""
  name = "mae"
  picture_needs_batch = True  # reconstructions of fixed evaluation images
  picture_name = "reconstruction"
  default_config = staticmethod(config_lib.mae_config)
  probed = True
  model_builder = staticmethod(factory.mae)
  evaluators = ("knn", "linear", "layers", "rank")
  model_class = mae_lib.MaskedAutoencoder  # fine-tuning and REPA's encoder start from one
  embed = "patch_embed"
  torch_reference = True

  def init_inputs(self, batch: int):
    m = self.model
    return (jnp.zeros((batch, m.img_size, m.img_size, m.in_chans), jnp.float32),
            jnp.zeros((batch, m.num_patches), jnp.float32))

  def prepare(self, batch, rng):
    """Adds the masking noise ``(N, L)`` (argsort of it picks the kept patches) and, with
    ``residual.drop_path``, the drop-path draws of the encoder (``with_drop_draws``)."""
    n = batch["image"].shape[0]
    batch = dict(batch, noise=jax.random.uniform(rng, (n, self.model.num_patches)))
    return self.with_drop_draws(batch, rng, self.model.depth, self.model.residual)

  def loss(self, params, batch) -> Tuple[jax.Array, Dict[str, Any]]:
    out = self.model.apply({"params": params}, batch["image"], batch["noise"],
                           base.drop_draws(batch))
    metrics = {"loss": out["loss"]}
    for i, v in enumerate(out["encoder_norms"]):
      metrics[f"feature_norm/encoder_{i:02d}"] = v
    for i, v in enumerate(out["decoder_norms"]):
      metrics[f"feature_norm/decoder_{i:02d}"] = v
    return out["loss"], metrics

  def picture(self, params, batch, rng, num: int = 8, live=None) -> np.ndarray:
    """Rows: masked input, reconstruction (visible patches pasted back), target image.
    (``live``: the SiT task's; MAE trains without an EMA.)"""
    del live
    m = self.model
    imgs = on_device.to_model_input(jnp.asarray(batch["image"][:num]), self.mean, self.std)
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
    rows = [plots.to_uint8(x, self.mean, self.std) for x in (masked, recon, np.asarray(imgs))]
    return plots.image_grid(rows)

  def train_flops_per_example(self) -> float:
    return 3.0 * flops.mae_forward_flops(self.model)
