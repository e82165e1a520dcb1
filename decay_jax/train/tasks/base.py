"""What every task answers, with the defaults of pre-training, and the helpers the diffusion tasks
share.

The trainer, the lowering export, the memory report and the benchmark ask a task object (never
its name) for:
  * ``model`` and ``init_inputs(batch)``: the Flax module and the arguments of its ``init``;
  * ``image_shape()``: one input image's ``(H, W, C)`` as the stream delivers it;
  * ``prepare(batch, rng) -> batch``: every random number of a step (masks, noise, times, label
    drops, erasing, Mixup/CutMix, drop-path draws) drawn for the whole batch, per example, before
    the batch is split into microbatches; so accumulation changes nothing but summation order;
  * ``loss(params, batch) -> (loss, metrics)``: the objective of a prepared (micro)batch, a mean
    over its examples and deterministic given it;
  * ``picture(params, batch, rng) -> uint8 (H, W, 3)``: an image grid for monitoring;
  * ``train_flops_per_example()``: model FLOPs of one training example (forward + backward);
  * ``make_optimizer(config, total_steps, warmup_steps) -> (tx, schedule)``;
  * class-level, what registers a task (``train.tasks`` finds nothing else): ``name`` (the
    config's ``task``), ``default_config()`` (``train.config``'s defaults of the task),
    ``model_builder`` (the ``models.factory`` builder of its model; ``build_model(config, info)``),
    ``evaluators`` (the ``evals.registry`` rows it runs while training), ``sampler_modes``
    (``{mode: methods}`` of a diffusion task's samplers, else empty), ``model_class`` and
    ``embed`` (the model a run starts from when another run's ``init_from`` names one of this
    task, and its patch embedding, whose kernel gives the channels), ``torch_reference``
    (whether ``decay_jax.cli.bench --torch`` has a PyTorch reference of its step);
  * class-level: ``from_config(config, model, info)``, ``check_config(config)`` (one-line errors
    for the task's own config sections), ``load_start(config, mesh)`` and ``start_params`` (the
    pre-trained weights a run starts from), ``frozen_params()`` (a frozen network's weights the
    step reads, e.g. REPA's encoder: the state's ``frozen``), ``batch_extras()`` (inputs besides
    image and label), ``final_results(workdir)``, ``standin_channels`` (input channels when the
    dataset is not read, for lowering and memory reports) and ``samples`` (whether
    ``decay_jax.cli.sample`` and the sampler export take this task).
Batches are dicts: ``image (N, H, W, C)`` and ``label (N,)`` int32; the train step turns uint8
images into the model's float input with the task's ``mean``/``std`` before ``prepare``
(``decay_jax.data.on_device``), and ``picture`` does the same with its batch.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import plots
from decay_jax.data import pipeline
from decay_jax.models import factory
from decay_jax.train import optim


class Task:
  """Defaults shared by the tasks; a task overrides what differs."""
  name = ""
  picture_needs_batch = True
  picture_name = "picture"
  standin_channels = 3  # RGB images
  samples = False  # only SiT has the sample command and the sampler export
  probed = False  # decay_jax.cli.evaluate probes the representations of the task's runs
  keeps_pixels = False  # the step hands prepare the uint8 pixels too (repa_pixels)
  default_config: Callable[[], Any]  # train.config's defaults of the task (a staticmethod)
  model_builder: Callable  # a models.factory builder (a staticmethod)
  evaluators: Tuple[str, ...] = ()  # evals.registry rows run while training
  sampler_modes: Dict[str, Tuple[str, ...]] = {}  # diffusion tasks: {mode: methods}
  model_class: Optional[type] = None  # the model another run may start from (init_from)
  embed = ""  # ... and its patch embedding (the kernel's input channels)
  torch_reference = False  # decay_jax.cli.bench --torch times a PyTorch reference of the step

  def __init__(self, model, mean=(0.0,), std=(1.0,)):
    self.model = model
    self.mean, self.std = mean, std

  @classmethod
  def from_config(cls, config, model, info: Dict[str, Any]) -> "Task":
    """The task of a training config over ``model``; ``info`` is ``pipeline.dataset_info``.
    Its constructor takes the model, the config sections of ``sections`` and the data's
    normalisation."""
    mean, std = pipeline.normalization(config.data, info["channels"])
    return cls(model, *cls.sections(config), mean=mean, std=std)

  @classmethod
  def build_model(cls, config, info: Dict[str, Any], pretrained=None):
    """The task's Flax model of ``config`` (``models.factory.build_model`` with ``model_builder``);
    ``info``: the data's ``image_size``, ``channels`` (and ``num_classes``)."""
    return factory.build_model(config, info, cls.model_builder, pretrained)

  @classmethod
  def sections(cls, config) -> Tuple[Any, ...]:
    """The config sections the task's constructor takes after the model (none by default)."""
    del config
    return ()

  @classmethod
  def check_config(cls, config) -> None:
    """One-line ValueErrors for the task's own config sections (none by default)."""

  @classmethod
  def load_start(cls, config, mesh) -> Optional[Tuple[Any, Any]]:
    """``(model, params)`` a run starts from before its first step, or None (random init)."""
    del config, mesh
    return None

  def start_params(self, params, start) -> Any:
    """The first step's parameters from freshly initialised ``params`` and ``load_start``'s pair."""
    del start
    return params

  def frozen_params(self) -> Any:
    """Weights of a frozen network the step reads (REPA's target encoder): the train state's
    ``frozen`` entry, never optimised or averaged; None (the default) for no such entry."""
    return None

  def batch_extras(self) -> Dict[str, Tuple[Tuple[int, ...], Any]]:
    """Inputs the stream delivers besides ``image`` and ``label``: ``{key: (shape of one
    example, dtype)}`` (none by default; REPA's stored targets for SiT)."""
    return {}

  def image_shape(self) -> Tuple[int, int, int]:
    m = self.model
    return (m.img_size, m.img_size, m.in_chans)

  def make_optimizer(self, config, total_steps: int, warmup_steps: int):
    """``(optax transformation, lr schedule)``: pre-training's AdamW (``train.optim``)."""
    return optim.make_optimizer(config.optim, config.batch_size, total_steps, warmup_steps)

  def with_drop_draws(self, batch, rng, blocks: int, residual):
    """``batch`` plus ``drop_u (N, blocks, 2)``, the uniform draws of stochastic depth in
    pre-training (one per example, block and sublayer; example-major, so microbatches split them
    like the images), where ``residual.drop_path > 0``; ``batch`` unchanged otherwise. They come
    from ``fold_in(rng, DROP_STREAM)`` of the step's RNG, so the task's other draws are unchanged
    and the step stays a function of ``(rng, step)``."""
    if not residual.drop_path:
      return batch
    n = batch["image"].shape[0]
    u = jax.random.uniform(jax.random.fold_in(rng, DROP_STREAM), (n, blocks, 2))
    return dict(batch, drop_u=u)

  @classmethod
  def final_results(cls, workdir: str) -> Dict[str, float]:
    """Extra entries of the run's ``results.json`` read from its logs (none by default)."""
    del workdir
    return {}


DROP_STREAM = 0x64726f70  # fold_in constant of the drop-path draws ("drop")


def drop_draws(batch):
  """The model's ``drop_u (blocks, N, 2)`` from a prepared batch, or None (no stochastic depth)."""
  return jnp.swapaxes(batch["drop_u"], 0, 1) if "drop_u" in batch else None


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
  noise = jax.random.normal(rng, (n,) + task.image_shape())
  labels = jnp.arange(n) % task.num_labels
  if task._sample_fn is None:  # pylint: disable=protected-access
    task._sample_fn = jax.jit(task.sample)  # pylint: disable=protected-access
  images = np.asarray(task._sample_fn(params, noise, labels, jax.random.fold_in(rng, 1)))  # pylint: disable=protected-access
  cols = int(np.ceil(np.sqrt(n)))
  rows = [plots.to_uint8(images[i:i + cols], task.mean, task.std) for i in range(0, n, cols)]
  if rows[-1].shape[0] < cols:  # pad the last row with white tiles
    pad = np.full((cols - rows[-1].shape[0],) + rows[-1].shape[1:], 255, np.uint8)
    rows[-1] = np.concatenate([rows[-1], pad])
  return images, labels, plots.image_grid(rows)
