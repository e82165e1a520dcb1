"""One setup of the train state, its shardings and the jitted step, shared by everything that runs
or compiles a train step: the trainer, the lowering export (``decay_jax.perf.export``), the memory
report (``decay_jax.cli.memory``) and the benchmark (``decay_jax.cli.bench``). As in MaxText, what
is compiled ahead of time is what trains.

    s = setup.build(config)                          # reads the dataset's size and channels
    state = s.init_state()                           # born sharded
    compiled = s.train_step.lower(state, batch).compile()

    s = setup.build(config, info=setup.data_info(config), mesh=abstract_mesh)   # nothing read
    s.train_step.lower(*s.abstract_args())           # ShapeDtypeStructs with the run's shardings

``data_info`` stands in for a dataset that is not on this machine (ImageNet's size, the task's
channels); ``abstract_batch`` is the stream's batch (uint8 pixels or float32 latents) split over the
mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from decay_jax import sharding as shd
from decay_jax.data import on_device, pipeline
from decay_jax.models import flops
from decay_jax.train import config as config_lib
from decay_jax.train import step as step_lib
from decay_jax.train import tasks

# Stand-in training-set size (ImageNet-1k train) for datasets that are not on this machine: it
# sets the schedule's step counts only, which enter the program as constants, not its structure.
STANDIN_NUM_TRAIN = 1_281_167


def data_info(config, channels: int = 0) -> Dict[str, int]:
  """``pipeline.dataset_info`` without reading a dataset that may not be here (for lowering and
  memory reports): in-memory data (embedded MNIST, ``npz:``) is read, as its header is cheap;
  otherwise ``config.data.image_size``, ``channels`` (0: the task's ``standin_channels``, 4 for SiT
  latents, else 3), ``STANDIN_NUM_TRAIN`` examples and ImageNet's 1000 classes."""
  dataset = config.data.dataset
  if dataset == pipeline.EMBEDDED_MNIST or dataset.startswith(pipeline.NPZ_PREFIX):
    return pipeline.dataset_info(config.data)
  return {"image_size": config.data.image_size,
          "channels": channels or tasks.get(config.task).standin_channels,
          "num_train": STANDIN_NUM_TRAIN, "num_classes": 1000}


def check_config(config, pretrained_model=None, info: Optional[Dict[str, int]] = None,
                 mesh=None, batch: Optional[int] = None):
  """Every check that needs no compilation; raises a one-line ValueError. Returns
  ``(info, model, mesh)``.

  ``pretrained_model``: the model a run starts from (``Task.load_start``); ``info``: the dataset's
  (default: read with ``pipeline.dataset_info``); ``mesh``: default ``config.mesh`` over this
  machine's devices; ``batch``: the global batch (default ``config.batch_size``).
  """
  config_lib.validate(config)
  checked = config
  if batch and batch != config.batch_size:  # the task checks the batch that will be compiled
    checked = config.copy_and_resolve_references()
    checked.batch_size = batch
  tasks.get(config.task).check_config(checked)
  info = info or pipeline.dataset_info(config.data)
  model = tasks.build_model(config, info, pretrained_model)
  mesh = mesh if mesh is not None else shd.make_mesh(config.mesh.data, config.mesh.fsdp)
  shd.check_batch(batch or config.batch_size, mesh, config.accum_steps)
  return info, model, mesh


def make_task(config, model, info) -> tasks.Task:
  """The task object of ``config`` over ``model`` (``tasks.from_config``)."""
  return tasks.from_config(config, model, info)


def abstract_batch(task, batch: int, mesh, image_dtype=jnp.uint8) -> Dict[str, jax.ShapeDtypeStruct]:
  """The trainer's input batch, abstract and split over the mesh.

  Returns:
    ``{'image': (B, H, W, C) image_dtype, 'label': (B,) int32}`` and the task's
    ``batch_extras`` (REPA's stored targets) with ``sharding.batch_sharding``,
    ``(H, W, C)`` the task's ``image_shape()`` (``image_dtype``: the stream's,
    ``on_device.stream_dtype``: uint8 pixels, float32 latents).
  """
  s = shd.batch_sharding(mesh)
  extras = {k: jax.ShapeDtypeStruct((batch,) + tuple(shape), dtype, sharding=s)
            for k, (shape, dtype) in task.batch_extras().items()}
  return {"image": jax.ShapeDtypeStruct((batch,) + tuple(task.image_shape()), image_dtype,
                                        sharding=s),
          "label": jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=s), **extras}


def with_shardings(abstract, shardings):
  """``ShapeDtypeStruct``s of ``abstract`` carrying ``shardings`` (arguments to lower with)."""
  return jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def rates(flops_per_step: float, batch: int, step_seconds: float, devices: int,
          peak_tflops: float = 0.0) -> Dict[str, float]:
  """The one computation of throughput and MFU (trainer logs and benchmark alike).

  Returns ``examples_per_sec``, ``examples_per_sec_per_device``,
  ``model_tflops_per_sec_per_device`` (model FLOPs, not hardware FLOPs: remat's recomputation is
  not counted) and, when the device's peak is known (``flops.peak_flops_per_device``, or
  ``peak_tflops`` given), ``mfu = model FLOP/s per device / peak``.
  """
  per_sec = batch / step_seconds
  out = {"examples_per_sec": per_sec, "examples_per_sec_per_device": per_sec / devices,
         "model_tflops_per_sec_per_device": flops_per_step / step_seconds / devices / 1e12}
  peak = flops.peak_flops_per_device(peak_tflops)
  if peak:
    out["mfu"] = out["model_tflops_per_sec_per_device"] * 1e12 / peak
  return out


@dataclasses.dataclass(frozen=True)
class TrainSetup:
  """The pieces of one training run's step, built once by ``build``.

  Attributes:
    config: the training config.
    info: the dataset's ``image_size``, ``channels``, ``num_train``, ``num_classes``.
    model, task: the Flax module and its ``tasks.Task``.
    mesh: the ``(data, fsdp)`` mesh (a ``Mesh`` or an ``AbstractMesh``).
    batch_size: the global batch of one step.
    total_steps, warmup_steps: the schedule's step counts (``config.steps_for``).
    tx, schedule: the optimiser and its learning-rate schedule (``Task.make_optimizer``).
    abstract: the train state's shapes and dtypes; ``shardings``: its FSDP shardings.
    train_step: the jitted, donated step ``(state, batch) -> (state, metrics)``.
  """
  config: Any
  info: Dict[str, int]
  model: Any
  task: tasks.Task
  mesh: Any
  batch_size: int
  total_steps: int
  warmup_steps: int
  tx: Any
  schedule: Callable
  abstract: Any
  shardings: Any
  train_step: Any

  @property
  def use_ema(self) -> bool:
    return self.config.ema_decay > 0

  def init_state(self) -> Dict[str, Any]:
    """The train state at step 0, born sharded (``jit`` with the state's out shardings)."""
    task, tx, seed, ema = self.task, self.tx, self.config.seed, self.use_ema
    frozen = task.frozen_params()
    state = jax.jit(lambda: step_lib.init_state(task, tx, seed, ema, frozen),
                    out_shardings=self.shardings)()
    if frozen is not None:  # the frozen network's weights: step arguments, not constants
      state["frozen"] = jax.device_put(frozen, self.shardings["frozen"])
    return state

  def abstract_batch(self) -> Dict[str, jax.ShapeDtypeStruct]:
    return abstract_batch(self.task, self.batch_size, self.mesh,
                          on_device.stream_dtype(self.config.data))

  def abstract_args(self) -> Tuple[Any, Dict[str, jax.ShapeDtypeStruct]]:
    """``(state, batch)`` as ``ShapeDtypeStruct``s with their shardings: nothing allocated."""
    return with_shardings(self.abstract, self.shardings), self.abstract_batch()

  @property
  def flops_per_step(self) -> float:
    """Model FLOPs of one optimiser step (forward + backward of the global batch)."""
    return self.task.train_flops_per_example() * self.batch_size

  def rates(self, step_seconds: float) -> Dict[str, float]:
    """Throughput and MFU of this step at ``step_seconds`` per step (``rates``)."""
    return rates(self.flops_per_step, self.batch_size, step_seconds, self.mesh.size,
                 self.config.get("peak_tflops_per_device", 0.0))


def build(config, *, info: Optional[Dict[str, int]] = None, mesh=None,
          batch: Optional[int] = None, pretrained_model=None) -> TrainSetup:
  """The train step of ``config`` and everything it is built from; nothing compiled.

  Args:
    config: a training config (its dtype, remat, accum_steps, EMA and optimiser are used as is).
    info: the dataset's info (default: read it; ``data_info(config)`` for a stand-in).
    mesh: a ``Mesh`` or an ``AbstractMesh`` with axes ``('data', 'fsdp')`` (default: the config's
      mesh over this machine's devices).
    batch: the global batch (default: ``config.batch_size``).
    pretrained_model: the model a fine-tuning run starts from (``Task.load_start``).
  """
  batch = batch or config.batch_size
  info, model, mesh = check_config(config, pretrained_model, info, mesh, batch)
  task = make_task(config, model, info)
  total_steps, warmup_steps = config_lib.steps_for(config, info["num_train"])
  tx, schedule = task.make_optimizer(config, total_steps, warmup_steps)
  abstract = step_lib.abstract_state(task, tx, config.seed, config.ema_decay > 0)
  shardings = step_lib.state_shardings(abstract, tx, mesh)
  train_step = step_lib.jit_train_step(
      step_lib.make_train_step(task, tx, schedule, config.accum_steps, config.ema_decay),
      shardings, mesh)
  return TrainSetup(config=config, info=info, model=model, task=task, mesh=mesh, batch_size=batch,
                    total_steps=total_steps, warmup_steps=warmup_steps, tx=tx, schedule=schedule,
                    abstract=abstract, shardings=shardings, train_step=train_step)
