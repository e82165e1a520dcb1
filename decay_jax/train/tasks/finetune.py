"""End-to-end fine-tuning of the classifier over a pre-trained MAE encoder (docs/finetune.md)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from decay_jax import plots, validate
from decay_jax.data import mixup, on_device
from decay_jax.models import factory, flops, vit
from decay_jax.train import config as config_lib
from decay_jax.train import finetune_optim, pretrained, writers
from decay_jax.train.tasks import base
from decay_jax.train.tasks.mae import MAETask


class FinetuneTask(base.Task):
  """End-to-end fine-tuning (docs/finetune.md): random erasing per example (``erase_prob``), then
  Mixup/CutMix with label smoothing per group of ``mixup_cfg.group`` examples, drop path, and the
  soft-target cross-entropy of the classifier's logits. (RandAugment runs on the host.)"""
  name = "finetune"
  picture_needs_batch = True  # the mixed training inputs of fixed evaluation images
  picture_name = "mixed_inputs"
  default_config = staticmethod(config_lib.finetune_config)
  model_builder = staticmethod(factory.finetune)
  evaluators = ("accuracy",)

  def __init__(self, model, mixup_cfg, mean=(0.0,), std=(1.0,)):
    super().__init__(model, mean, std)
    self.train_model = model.clone(train=True)
    self.mixup_cfg = mixup_cfg

  @classmethod
  def sections(cls, config):
    return (config.mixup,)

  @classmethod
  def check_config(cls, config) -> None:
    validate.check_range("optim.layer_decay", config.optim.layer_decay, 0.0, 1.0, low_open=True)
    validate.check_int("mixup.group", config.mixup.group)
    if config.batch_size % config.mixup.group:  # mixed before the microbatch split
      raise validate.not_allowed("mixup.group", config.mixup.group,
                                 f"it must divide batch_size = {config.batch_size}")
    validate.check_range("mixup.smoothing", config.mixup.smoothing, 0.0, 1.0, high_open=True)
    validate.check_range("mixup.erase_prob", config.mixup.erase_prob, 0.0, 1.0)

  @classmethod
  def load_start(cls, config, mesh):
    """The pre-trained MAE of ``config.init_from`` (``train.pretrained``), if one is set."""
    return pretrained.load(config.init_from, mesh, MAETask) if config.init_from else None

  def start_params(self, params, start):
    """The encoder of pre-training over fresh ``params``; ``fc_norm`` and ``head`` stay fresh."""
    if start is None:
      return params
    params = vit.init_from_mae(params, *start)
    logging.info("initialised from the pre-trained MAE: patch_embed, cls_token, pos_embed and %d "
                 "blocks (alpha_min %s); fc_norm and head fresh", self.model.depth,
                 self.model.alpha_min)
    return params

  def make_optimizer(self, config, total_steps: int, warmup_steps: int):
    """Layer-wise lr decay over the classifier's parameter names (``finetune_optim``)."""
    model = self.model
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *self.init_inputs(1))["params"])
    return finetune_optim.from_config(config.optim, config.batch_size, total_steps, warmup_steps,
                                      shapes, model.depth)

  @classmethod
  def final_results(cls, workdir: str):
    """The best top-1 accuracy of the run beside the last (upstream logs both)."""
    curve = writers.read_scalars(workdir, "accuracy/top1")
    return {"accuracy/top1_best": max(v for _, v in curve)} if curve else {}

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
    return plots.image_grid([plots.to_uint8(x, self.mean, self.std) for x in (np.asarray(imgs), np.asarray(mixed))])

  def train_flops_per_example(self) -> float:
    return 3.0 * flops.vit_forward_flops(self.model)
