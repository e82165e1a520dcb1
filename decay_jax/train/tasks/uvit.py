"""U-ViT noise-prediction training (docs/uvit.md) and its DPM-Solver / Euler samplers."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import validate
from decay_jax.diffusion import dpm_solver, vp
from decay_jax.models import factory, flops
from decay_jax.train import config as config_lib
from decay_jax.train.tasks import base


class UViTTask(base.Task):
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
  default_config = staticmethod(config_lib.uvit_config)
  probed = True
  model_builder = staticmethod(factory.uvit)
  evaluators = ("generation",)
  sampler_modes = dpm_solver.SAMPLERS

  def __init__(self, model, diffusion_cfg, sample_cfg=None, mean=(0.0,), std=(1.0,)):
    super().__init__(model, mean, std)
    self.schedule = vp.schedule(diffusion_cfg.schedule)
    self.class_dropout_prob = float(diffusion_cfg.class_dropout_prob)
    self.sample_cfg = sample_cfg
    self._sample_fn = None

  @classmethod
  def sections(cls, config):
    return (config.diffusion, config.sample)

  @classmethod
  def check_config(cls, config) -> None:
    validate.check_choice("diffusion.schedule", config.diffusion.schedule, vp.SCHEDULES)
    validate.check_range("diffusion.class_dropout_prob", config.diffusion.class_dropout_prob,
                         0.0, 1.0, high_open=True)
    if config.diffusion.class_dropout_prob > 0 and not config.model.conditional:
      raise validate.not_allowed(
          "diffusion.class_dropout_prob", config.diffusion.class_dropout_prob,
          "an unconditional model (model.conditional=False) has no labels to drop; use 0")
    validate.check_choice("sample.mode", config.sample.mode, tuple(cls.sampler_modes))
    validate.check_choice("sample.method", config.sample.method,
                          cls.sampler_modes[config.sample.mode])
    if config.sample.mode != "dpm" and config.diffusion.schedule != "vpsde":
      raise validate.not_allowed("sample.mode", config.sample.mode,
                                 "the Euler samplers need diffusion.schedule='vpsde'")

  @property
  def null_label(self) -> Optional[int]:
    """The label index that means "no class" (the last one), when trained with dropout."""
    return self.model.num_classes - 1 if self.class_dropout_prob > 0 else None

  @property
  def num_labels(self) -> int:
    """Labels to sample from: the classes without the null label (1 for unconditional models)."""
    return max(self.model.num_classes - (self.null_label is not None), 1)

  def init_inputs(self, batch: int):
    y = jnp.zeros((batch,), jnp.int32) if self.model.conditional else None
    return (jnp.zeros((batch,) + self.image_shape(), jnp.float32), jnp.zeros((batch,), jnp.float32),
            y)

  def prepare(self, batch, rng):
    """Adds the training times ``t (N,)`` (steps n for 'discrete'), the noise ``eps``, for
    conditional models the labels ``y (N,)`` after dropout to the null label and, with
    ``residual.drop_path``, the drop-path draws (``with_drop_draws``)."""
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
    m = self.model
    return self.with_drop_draws(out, rng, m.num_blocks, m.block_residual)

  def loss(self, params, batch):
    drop_u = base.drop_draws(batch)
    model_fn = lambda x, t, y=None: self.model.apply({"params": params}, x, t, y, drop_u)
    kwargs = {"y": batch["y"]} if self.model.conditional else None
    per_example = self.schedule.per_example_loss(model_fn, batch["image"], batch["eps"],
                                                 batch["t"], kwargs)
    loss = per_example.mean()
    t01 = batch["t"] / getattr(self.schedule, "num_steps", 1)  # discrete steps -> (0, 1]
    return loss, dict(base.loss_by_time(per_example, t01), loss=loss)

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
    return base.sample_grid(self, params, rng, num or self.sample_cfg.grid_size)[2]

  def train_flops_per_example(self) -> float:
    return 3.0 * flops.uvit_forward_flops(self.model)
