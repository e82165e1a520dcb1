"""Tasks: what differs between MAE, fine-tuning, SiT and U-ViT training (model, loss, metrics,
pictures, FLOPs).

The trainer (``decay_jax.train.trainer``) is one loop; a task supplies
  * ``model`` and ``init_inputs(batch)``: the Flax module and the arguments of its ``init``;
  * ``prepare(batch, rng) -> batch``: every random number of a step (masks, noise, times, label
    drops, erasing, Mixup/CutMix, drop-path draws) drawn for the whole batch, per example, before
    the batch is split into microbatches; so accumulation changes nothing but summation order;
  * ``loss(params, batch) -> (loss, metrics)``: the objective of a prepared (micro)batch, a mean
    over its examples and deterministic given it;
  * ``picture(params, batch, rng) -> uint8 (H, W, 3)``: an image grid for monitoring (MAE:
    reconstructions of ``batch``; SiT: samples, ``batch`` unused);
  * ``train_flops_per_example()``: model FLOPs of one training example (forward + backward).
Batches are dicts: ``image (N, H, W, C)`` and ``label (N,)`` int32; the train step turns uint8
images into the model's float input with the task's ``mean``/``std`` before ``prepare``
(``decay_jax.data.on_device``), and ``picture`` does the same with its batch.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax.data import mixup
from decay_jax.data import on_device
from decay_jax.models import flops, layers
from decay_jax.diffusion import dpm_solver, samplers
from decay_jax.diffusion import transport as transport_lib
from decay_jax.diffusion import vp
from decay_jax.models import mae as mae_lib
from decay_jax.models import routing
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


def loss_by_time(per_example, t, buckets: int = 4) -> Dict[str, jax.Array]:
  """Mean loss per quarter of the time interval: ``per_example (N,)``, ``t (N,)`` in [0, 1]."""
  bucket = jnp.clip((t * buckets).astype(jnp.int32), 0, buckets - 1)
  out = {}
  for b in range(buckets):
    w = (bucket == b).astype(jnp.float32)
    out[f"loss_by_t/{b / buckets:.2f}-{(b + 1) / buckets:.2f}"] = (
        (per_example * w).sum() / jnp.maximum(w.sum(), 1.0))
  return out


def sample_grid(task, params, rng, n: int):
  """``(images, labels, uint8 grid)``: ``n`` samples of a diffusion task from noise drawn from
  ``rng`` with labels ``0, 1, 2, ...`` (ignored by unconditional models), rows of ``ceil(sqrt n)``."""
  noise = jax.random.normal(rng, (n,) + task.sample_shape())
  labels = jnp.arange(n) % task.num_labels
  if task._sample_fn is None:  # pylint: disable=protected-access
    task._sample_fn = jax.jit(task.sample)  # pylint: disable=protected-access
  images = np.asarray(task._sample_fn(params, noise, labels, jax.random.fold_in(rng, 1)))  # pylint: disable=protected-access
  cols = int(np.ceil(np.sqrt(n)))
  rows = [to_uint8(images[i:i + cols], task.mean, task.std) for i in range(0, n, cols)]
  if rows[-1].shape[0] < cols:  # pad the last row with white tiles
    pad = np.full((cols - rows[-1].shape[0],) + rows[-1].shape[1:], 255, np.uint8)
    rows[-1] = np.concatenate([rows[-1], pad])
  return images, labels, grid(rows)


class MAETask:
  """Masked-autoencoder pretraining (docs/official_code.md 1 and 2)."""
  name = "mae"
  picture_needs_batch = True  # reconstructions of fixed evaluation images
  picture_name = "reconstruction"

  def __init__(self, model: mae_lib.MaskedAutoencoder, mean=(0.0,), std=(1.0,)):
    self.model = model
    self.mean, self.std = mean, std

  def init_inputs(self, batch: int):
    m = self.model
    return (jnp.zeros((batch, m.img_size, m.img_size, m.in_chans), jnp.float32),
            jnp.zeros((batch, m.num_patches), jnp.float32))

  def prepare(self, batch, rng):
    """Adds the masking noise ``(N, L)`` (argsort of it picks the kept patches)."""
    n = batch["image"].shape[0]
    return dict(batch, noise=jax.random.uniform(rng, (n, self.model.num_patches)))

  def loss(self, params, batch) -> Tuple[jax.Array, Dict[str, Any]]:
    out = self.model.apply({"params": params}, batch["image"], batch["noise"])
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
    rows = [to_uint8(x, self.mean, self.std) for x in (masked, recon, np.asarray(imgs))]
    return grid(rows)

  def train_flops_per_example(self) -> float:
    return 3.0 * flops.mae_forward_flops(self.model)


class FinetuneTask:
  """End-to-end fine-tuning (docs/finetune.md): random erasing per example (``erase_prob``), then
  Mixup/CutMix with label smoothing per group of ``mixup_cfg.group`` examples, drop path, and the
  soft-target cross-entropy of the classifier's logits. (RandAugment runs on the host.)"""
  name = "finetune"
  picture_needs_batch = True  # the mixed training inputs of fixed evaluation images
  picture_name = "mixed_inputs"

  def __init__(self, model, mixup_cfg, mean=(0.0,), std=(1.0,)):
    self.model = model
    self.train_model = model.clone(train=True)
    self.mixup_cfg = mixup_cfg
    self.mean, self.std = mean, std

  def init_inputs(self, batch: int):
    m = self.model
    return (jnp.zeros((batch, m.img_size, m.img_size, m.in_chans), jnp.float32),)

  def mix(self, images, labels, rng, group: Optional[int] = None):
    """Mixup/CutMix of the config in groups of ``group`` examples (default ``mixup_cfg.group``)."""
    c = self.mixup_cfg
    return mixup.mixup_cutmix(rng, images, labels, self.model.num_classes, group=group or c.group,
                              mixup_alpha=c.mixup_alpha, cutmix_alpha=c.cutmix_alpha,
                              switch_prob=c.switch_prob, smoothing=c.smoothing)

  def prepare(self, batch, rng):
    """The erased and mixed images, their soft targets ``(N, classes)`` and the drop-path draws
    ``(N, depth, 2)`` (example-major, so microbatches split them like the images)."""
    k_erase, k_mix, k_drop = jax.random.split(rng, 3)
    images = batch["image"]
    if self.mixup_cfg.erase_prob > 0:
      images = mixup.random_erasing(k_erase, images, self.mixup_cfg.erase_prob)
    images, targets = self.mix(images, batch["label"], k_mix)
    drop_u = jax.random.uniform(k_drop, (images.shape[0], self.model.depth, 2))
    return {"image": images, "target": targets, "drop_u": drop_u}

  def loss(self, params, batch):
    logits = self.train_model.apply({"params": params}, batch["image"],
                                    jnp.swapaxes(batch["drop_u"], 0, 1))
    loss = mixup.soft_cross_entropy(logits, batch["target"])
    return loss, {"loss": loss}

  def picture(self, params, batch, rng, num: int = 8, live=None) -> np.ndarray:
    """Rows: the images, then what Mixup/CutMix made of them (groups of ``num``)."""
    del params, live
    imgs = on_device.to_model_input(jnp.asarray(batch["image"][:num]), self.mean, self.std)
    mixed, _ = self.mix(imgs, batch["label"][:num], rng, group=num)
    return grid([to_uint8(x, self.mean, self.std) for x in (np.asarray(imgs), np.asarray(mixed))])

  def train_flops_per_example(self) -> float:
    return 3.0 * flops.vit_forward_flops(self.model)


class SiTTask:
  """Flow-matching training of SiT through ``decay_jax.diffusion.transport`` (docs/official_code.md 5.1).

  Default (official) transport: linear path ``x_t = t x_1 + (1 - t) x_0`` with ``x_0 ~ N(0, I)``
  noise and ``x_1`` data, ``t ~ U[0, 1]``, velocity target ``x_1 - x_0``; labels are dropped to the
  null class with probability ``class_dropout_prob`` (classifier-free guidance training).
  Metrics include the loss per quarter of the time interval.
  """
  name = "sit"
  picture_needs_batch = False  # samples from fixed noise
  picture_name = "samples"

  def __init__(self, model: sit_lib.SiT, transport_cfg=None, sample_cfg=None, mean=(0.0,),
               std=(1.0,)):
    self.model = model
    cfg = dict(transport_cfg or {})
    self.transport = transport_lib.Transport(**cfg)
    self.sample_cfg = sample_cfg
    self.mean, self.std = mean, std
    self._sample_fn = None

  def init_inputs(self, batch: int):
    return (jnp.zeros((batch,) + self.sample_shape(), jnp.float32),
            jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.int32))

  def sample_shape(self) -> Tuple[int, int, int]:
    """One sample's ``(H, W, C)``."""
    m = self.model
    return (m.input_size, m.input_size, m.in_channels)

  @property
  def num_labels(self) -> int:
    """Labels to sample from (the null class, index ``num_classes``, is not one)."""
    return self.model.num_classes

  def prepare(self, batch, rng):
    """Adds the times ``t (N,)``, the noise ``x0`` (like the image) and the classifier-free
    guidance label drops ``drop (N,)`` int32 (1: replaced by the null class)."""
    x1 = batch["image"]
    k_t, k_noise, k_drop = jax.random.split(rng, 3)
    drop = jax.random.uniform(k_drop, x1.shape[:1]) < self.model.class_dropout_prob
    return dict(batch, t=self.transport.sample_time(k_t, x1.shape[0]),
                x0=jax.random.normal(k_noise, x1.shape), drop=drop.astype(jnp.int32))

  def loss(self, params, batch):
    x1, y, t = batch["image"], batch["label"], batch["t"]
    model_fn = lambda x, tt, y: self.model.apply({"params": params}, x, tt, y, train=True,
                                                 force_drop_ids=batch["drop"])
    per_example = self.transport.loss(model_fn, x1, batch["x0"], t, y=y)
    loss = per_example.mean()
    return loss, dict(loss_by_time(per_example, t), loss=loss)

  def sample(self, params, noise, labels, rng, cfg=None):
    """Images from noise ``(N, H, W, C)`` and labels ``(N,)`` with the sampler of ``cfg``
    (default: this task's ``sample_cfg``). Classifier-free guidance when ``cfg_scale != 1``."""
    c = cfg or self.sample_cfg
    m = self.model
    model_fn = lambda x, t, y: m.apply({"params": params}, x, t, y)
    if c.cfg_scale != 1.0:
      lo, hi = c.cfg_interval
      model_fn = samplers.cfg_model_fn(model_fn, c.cfg_scale, m.num_classes,
                                       channels=c.cfg_channels or None,
                                       interval=None if (lo, hi) == (0.0, 1.0) else (lo, hi))
    kwargs = {"y": labels}
    if c.mode == "ode":
      return samplers.sample_ode(self.transport, model_fn, noise, kwargs, method=c.method,
                                 num_steps=c.num_steps, atol=c.atol, rtol=c.rtol)
    return samplers.sample_sde(self.transport, model_fn, noise, rng, kwargs, method=c.method,
                               diffusion_form=c.diffusion_form, diffusion_norm=c.diffusion_norm,
                               last_step=c.last_step, last_step_size=c.last_step_size,
                               num_steps=c.num_steps)

  def picture(self, params, batch, rng, num: Optional[int] = None, live=None) -> np.ndarray:
    """A grid of samples from fixed noise (from ``rng``) and labels ``0, 1, 2, ...``; for a routed
    model, with the heat-map of its routing weights on these samples noised to t = 0.1, 0.5, 0.9.

    ``params`` sample (the EMA in training); the heat-map reads ``live`` (the trained weights, when
    given): an EMA of 0.999 or 0.9999 keeps the routing near its uniform start for thousands of
    steps, while the trained weights show where the routing is heading."""
    m = self.model
    images, labels, picture = sample_grid(self, params, rng, num or self.sample_cfg.grid_size)
    if m.residual_routing in routing.ROUTED:  # routing weights per sublayer, next to the samples
      return routing.side_by_side(picture, routing.routing_picture(
          m, params if live is None else live, self.transport, images, labels,
          jax.random.fold_in(rng, 2)))
    return picture

  def train_flops_per_example(self) -> float:
    return 3.0 * flops.sit_forward_flops(self.model)


class UViTTask:
  """U-ViT noise-prediction training (docs/uvit.md; baofff/U-ViT ``sde.py`` / ``train.py``).

  ``x_t = sqrt(ab(t)) x_0 + sqrt(1 - ab(t)) eps`` with ``t ~ U[0, 1)`` on the continuous VPSDE
  (``diffusion.schedule='vpsde'``, network time 999 t) or ``n ~ U{1..1000}`` on the discrete SD
  schedule ('discrete', network time n); the loss is ``mean over (H, W, C) of (eps - eps_hat)^2``,
  averaged over the batch, unweighted. Conditional models (``num_classes > 0``) trained with
  ``diffusion.class_dropout_prob > 0`` see their last class index as the null label with that
  probability (U-ViT's dataset-level dropout). Sampling: DPM-Solver-fast (``sample.mode='dpm'``,
  ``method='fast'``, ``num_steps`` = model calls), DPM-Solver++ ('pp'), or Euler-Maruyama
  (``mode`` 'sde' / 'ode', ``method='euler'``); guidance ``eps_c + s (eps_c - eps_null)`` with
  ``s = cfg_scale`` when it is not 0.
  """
  name = "uvit"
  picture_needs_batch = False
  picture_name = "samples"

  def __init__(self, model, diffusion_cfg, sample_cfg=None, mean=(0.0,), std=(1.0,)):
    self.model = model
    self.schedule = vp.schedule(diffusion_cfg.schedule)
    self.class_dropout_prob = float(diffusion_cfg.class_dropout_prob)
    self.sample_cfg = sample_cfg
    self.mean, self.std = mean, std
    self._sample_fn = None

  @property
  def null_label(self) -> Optional[int]:
    """The label index that means "no class" (the last one), when trained with dropout."""
    return self.model.num_classes - 1 if self.class_dropout_prob > 0 else None

  def sample_shape(self) -> Tuple[int, int, int]:
    m = self.model
    return (m.img_size, m.img_size, m.in_chans)

  @property
  def num_labels(self) -> int:
    """Labels to sample from: the classes without the null label (1 for unconditional models)."""
    return max(self.model.num_classes - (self.null_label is not None), 1)

  def init_inputs(self, batch: int):
    y = jnp.zeros((batch,), jnp.int32) if self.model.conditional else None
    return (jnp.zeros((batch,) + self.sample_shape(), jnp.float32), jnp.zeros((batch,), jnp.float32),
            y)

  def prepare(self, batch, rng):
    """Adds the training times ``t (N,)`` (steps n for 'discrete'), the noise ``eps`` and, for
    conditional models, the labels ``y (N,)`` after dropout to the null label."""
    x0 = batch["image"]
    k_t, k_noise, k_drop = jax.random.split(rng, 3)
    out = dict(batch, t=self.schedule.sample_time(k_t, x0.shape[0]),
               eps=jax.random.normal(k_noise, x0.shape))
    if self.model.conditional:
      y = batch["label"].astype(jnp.int32)
      if self.null_label is not None:
        drop = jax.random.uniform(k_drop, y.shape) < self.class_dropout_prob
        y = jnp.where(drop, self.null_label, y)
      out["y"] = y
    return out

  def loss(self, params, batch):
    model_fn = lambda x, t, y=None: self.model.apply({"params": params}, x, t, y)
    kwargs = {"y": batch["y"]} if self.model.conditional else None
    per_example = self.schedule.per_example_loss(model_fn, batch["image"], batch["eps"],
                                                 batch["t"], kwargs)
    loss = per_example.mean()
    t01 = batch["t"] / getattr(self.schedule, "num_steps", 1)  # discrete steps -> (0, 1]
    return loss, dict(loss_by_time(per_example, t01), loss=loss)

  def sample(self, params, noise, labels, rng, cfg=None):
    """Images from noise ``(N, H, W, C)`` (and labels ``(N,)``, ignored without classes) with the
    sampler of ``cfg`` (default: this task's ``sample_cfg``)."""
    c = cfg or self.sample_cfg
    m = self.model
    model_fn = lambda x, t, y=None: m.apply({"params": params}, x, t, y)
    kwargs = None
    if m.conditional:
      kwargs = {"y": labels}
      if c.cfg_scale:
        if self.null_label is None:
          raise ValueError(f"sample.cfg_scale={c.cfg_scale} is not allowed; the model was "
                           "trained without label dropout (diffusion.class_dropout_prob 0)")
        model_fn = dpm_solver.cfg_eps(model_fn, c.cfg_scale, self.null_label)
    if c.mode == "dpm" and c.method == "fast":
      return dpm_solver.dpm_solver_fast(model_fn, noise, self.schedule, nfe=c.num_steps,
                                        model_kwargs=kwargs)
    if c.mode == "dpm":
      return dpm_solver.dpm_solver_pp(model_fn, noise, self.schedule, steps=c.num_steps,
                                      model_kwargs=kwargs)
    return dpm_solver.euler_maruyama(model_fn, noise, self.schedule, rng, c.num_steps,
                                     ode=c.mode == "ode", model_kwargs=kwargs)

  def picture(self, params, batch, rng, num: Optional[int] = None, live=None) -> np.ndarray:
    """A grid of samples from fixed noise (from ``rng``) and labels ``0, 1, 2, ...``."""
    del batch, live
    return sample_grid(self, params, rng, num or self.sample_cfg.grid_size)[2]

  def train_flops_per_example(self) -> float:
    return 3.0 * flops.uvit_forward_flops(self.model)
