"""Flow-matching training of SiT (docs/official_code.md 5.1) and its samplers."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from decay_jax import plots
from decay_jax.diffusion import samplers
from decay_jax.diffusion import transport as transport_lib
from decay_jax.models import factory, flops, routing, routing_start
from decay_jax.models import sit as sit_lib
from decay_jax.train import config as config_lib
from decay_jax.train import pretrained
from decay_jax.train import repa as repa_lib
from decay_jax.train.tasks import base
from decay_jax.train.tasks.mae import MAETask


class SiTTask(base.Task):
  """Flow-matching training of SiT through ``decay_jax.diffusion.transport`` (docs/official_code.md 5.1).

  Default (official) transport: linear path ``x_t = t x_1 + (1 - t) x_0`` with ``x_0 ~ N(0, I)``
  noise and ``x_1`` data, ``t ~ U[0, 1]``, velocity target ``x_1 - x_0``; labels are dropped to the
  null class with probability ``class_dropout_prob`` (classifier-free guidance training).
  Metrics include the loss per quarter of the time interval. With ``model.repa_depth`` (REPA,
  docs/repa.md) the loss is ``loss_v + repa.proj_coeff * loss_proj`` (``train.repa``), both logged.
  """
  name = "sit"
  picture_needs_batch = False  # samples from fixed noise
  picture_name = "samples"
  standin_channels = 4  # SiT trains on VAE latents when its dataset is not in memory
  samples = True
  default_config = staticmethod(config_lib.sit_config)
  probed = True
  model_builder = staticmethod(factory.sit)
  evaluators = ("generation",)
  sampler_modes = {"ode": samplers.ODE_METHODS, "sde": samplers.SDE_METHODS}
  model_class = sit_lib.SiT  # a SiT run may start from another (routing added, or continued)
  embed = "x_embedder"
  torch_reference = True

  def __init__(self, model: sit_lib.SiT, transport_cfg=None, sample_cfg=None, repa_cfg=None,
               mean=(0.0,), std=(1.0,)):
    super().__init__(model, mean, std)
    self.transport = transport_lib.Transport(**dict(transport_cfg or {}))
    self.sample_cfg = sample_cfg
    self._sample_fn = None
    self.proj_coeff = float(repa_cfg.proj_coeff) if repa_cfg is not None else 0.5
    self.encoder_dir = repa_cfg.encoder if repa_cfg is not None and model.repa_depth else ""
    self.encoder_normalize = repa_cfg.encoder_normalize if self.encoder_dir else "imagenet"
    self._encoder = None  # (Encoder, host params), read at the first need

  @classmethod
  def sections(cls, config):
    return (config.transport.to_dict(), config.sample, config.get("repa"))

  @classmethod
  def check_config(cls, config) -> None:
    repa_lib.check_config(config)

  def encoder(self):
    """``(Encoder, params)`` of ``repa.encoder``, or ``(None, None)`` (targets in the batch)."""
    if not self.encoder_dir:
      return None, None
    if self._encoder is None:
      self._encoder = repa_lib.load_encoder(self.encoder_dir, self.encoder_normalize, MAETask)
    return self._encoder

  @property
  def keeps_pixels(self) -> bool:
    """The on-the-fly REPA encoder preprocesses the uint8 pixels itself."""
    return bool(self.encoder_dir)

  def frozen_params(self):
    """The REPA encoder's weights (the train state's ``frozen``), or None."""
    return self.encoder()[1]

  def batch_extras(self):
    """REPA without an encoder: the stored targets ``repa_target_I (T, D_I)`` float32."""
    m = self.model
    if not m.repa_depth or self.encoder_dir:
      return {}
    return {repa_lib.TARGET.format(i): ((m.grid ** 2, d), jnp.float32)
            for i, d in enumerate(m.repa_dims)}

  def init_inputs(self, batch: int):
    return sit_lib.init_args(self.model, batch)

  def image_shape(self) -> Tuple[int, int, int]:
    """One sample's ``(H, W, C)``."""
    m = self.model
    return (m.input_size, m.input_size, m.in_channels)

  @property
  def num_labels(self) -> int:
    """Labels to sample from (the null class, index ``num_classes``, is not one)."""
    return self.model.num_classes

  def prepare(self, batch, rng):
    """Adds the times ``t (N,)``, the noise ``x0`` (like the image), the classifier-free
    guidance label drops ``drop (N,)`` int32 (1: replaced by the null class) and, with
    ``residual.drop_path``, the drop-path draws (``with_drop_draws``)."""
    batch = dict(batch)
    frozen = batch.pop("frozen", None)  # the train state's frozen encoder (step.make_train_step)
    if self.model.repa_depth:  # REPA: the targets join the batch, split with it into microbatches
      found = repa_lib.targets(batch, len(self.model.repa_dims), self.encoder()[0], frozen)
      repa_lib.check_targets(found, self.model.grid ** 2, self.model.repa_dims)
      batch.pop(repa_lib.PIXELS, None)
      batch.update({repa_lib.TARGET.format(i): y for i, y in enumerate(found)})
    x1 = batch["image"]
    k_t, k_noise, k_drop = jax.random.split(rng, 3)
    drop = jax.random.uniform(k_drop, x1.shape[:1]) < self.model.class_dropout_prob
    batch = dict(batch, t=self.transport.sample_time(k_t, x1.shape[0]),
                 x0=jax.random.normal(k_noise, x1.shape), drop=drop.astype(jnp.int32))
    return self.with_drop_draws(batch, rng, self.model.depth, self.model.residual)

  def loss(self, params, batch):
    x1, y, t = batch["image"], batch["label"], batch["t"]
    drop_u = base.drop_draws(batch)
    if self.model.repa_depth:
      return self.repa_loss(params, batch, drop_u)
    model_fn = lambda x, tt, y: self.model.apply({"params": params}, x, tt, y, train=True,
                                                 force_drop_ids=batch["drop"], drop_u=drop_u)
    per_example = self.transport.loss(model_fn, x1, batch["x0"], t, y=y)
    loss = per_example.mean()
    # loss_v: the flow-matching term alone, named as with REPA, so runs with and without the
    # alignment loss compare on it (decay_jax.cli.compare's "flow loss").
    return loss, dict(base.loss_by_time(per_example, t), loss=loss, loss_v=loss)

  def repa_loss(self, params, batch, drop_u):
    """REPA: ``loss_v + proj_coeff * loss_proj`` on the prepared batch's targets."""
    x1, t = batch["image"], batch["t"]
    _, x_t, _ = self.transport.plan(x1, batch["x0"], t)
    out, zs = self.model.apply({"params": params}, x_t, t, batch["label"], train=True,
                               force_drop_ids=batch["drop"], drop_u=drop_u, features=True)
    per_example = self.transport.loss_from_output(out, x1, batch["x0"], t)
    targets = [batch[repa_lib.TARGET.format(i)] for i in range(len(zs))]
    loss_v, loss_proj = per_example.mean(), repa_lib.proj_loss_per_example(zs, targets).mean()
    loss = loss_v + self.proj_coeff * loss_proj
    return loss, dict(base.loss_by_time(per_example, t), loss=loss, loss_v=loss_v,
                      loss_proj=loss_proj)

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
    images, labels, picture = base.sample_grid(self, params, rng, num or self.sample_cfg.grid_size)
    if m.residual_routing in routing.ROUTED:  # routing weights per sublayer, next to the samples
      return plots.side_by_side(picture, routing_picture(
          m, params if live is None else live, self.transport, images, labels,
          jax.random.fold_in(rng, 2)))
    return picture

  def train_flops_per_example(self) -> float:
    return flops.sit_train_flops(self.model)

  @classmethod
  def load_start(cls, config, mesh):
    """The pre-trained SiT of ``config.init_from`` (``train.pretrained``: a SiT run's trained
    weights, or a params directory such as a converted REPA checkpoint), if one is set."""
    return pretrained.load(config.init_from, mesh, cls) if config.get("init_from") else None

  def start_params(self, params, start):
    """``load_start``'s parameters in this model (``models.routing_start``): copied for the same
    SiT, or a plain SiT's with routing added (new routing parameters at zero)."""
    if start is None:
      return params
    source, source_params = start
    params = routing_start.start_from(source_params, source, self.model)
    logging.info("initialised from the pre-trained SiT: %s", routing_start.describe(source,
                                                                                   self.model))
    return params


def routing_picture(model, params, transport, images, labels, rng,
                    times: Sequence[float] = (0.1, 0.5, 0.9)) -> np.ndarray:
  """Heat-map of the mean routing weights on ``x_t`` of ``images (N, H, W, C)`` (data, t = 1) and
  fresh noise at each of ``times``, labels ``(N,)``."""
  noise = jax.random.normal(rng, images.shape)
  fn = jax.jit(lambda p, x, t, y: model.apply({"params": p}, x, t, y, mutable=["intermediates"])[1])
  panels = []
  for tv in times:
    t = jnp.full((images.shape[0],), tv, jnp.float32)
    _, xt, _ = transport.plan(images, noise, t)
    panels.append((f"t = {tv:g}", routing.weights_from_state(model, fn(params, xt, t, labels))))
  return plots.weight_heatmap(panels, f"routing weights: {model.residual_routing}"
                 + (f", decay {model.routing_decay} (alpha_min {model.alpha_min:g})"
                    if model.alpha_min < 1 else ""))
