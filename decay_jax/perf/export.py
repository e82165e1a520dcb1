"""The trainer's train step and the sample command's sampler, built from a config for any mesh, and
their export to StableHLO for platforms this machine does not have (``jax.export``).

A ``jax.sharding.AbstractMesh`` has axis names and sizes but no devices, so a 64-device TPU or GPU
program of any config lowers on a laptop CPU, sharding annotations included:

    mesh = export.abstract_mesh(config.mesh.data, config.mesh.fsdp, 64)
    program = export.train_program(config, mesh)
    exported = jax.export.export(program.fn, platforms=("tpu",))(*program.args)
    text = exported.mlir_module()      # StableHLO with sdy.sharding on every argument

The programs are the ones that run: ``train_program`` is the trainer's own step
(``decay_jax.train.setup.build``: the task's optimiser, ``step.make_train_step`` jitted with the
state's FSDP shardings, the batch split over all devices and the state donated), and
``sample_program`` jits the task's ``sample`` with the shardings of ``decay_jax.cli.sample``. The
arguments are ``jax.ShapeDtypeStruct``s carrying their shardings: nothing is allocated, nothing
compiled, no dataset read (``setup.data_info`` stands in for it).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from decay_jax import sharding as shd
from decay_jax import validate
from decay_jax.train import config as config_lib
from decay_jax.train import setup, tasks

# The platform names ``jax.export`` lowers for.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class Program:
  """A jitted function and abstract arguments to lower it with.

  Attributes:
    fn: the jitted function (``jax.jit`` result, with its in/out shardings and donation).
    args: the positional arguments, pytrees of ``jax.ShapeDtypeStruct`` with shardings.
    mesh: the mesh of those shardings (``Mesh`` or ``AbstractMesh``).
    name: what it is (``'train_step'`` or ``'sample'``).
  """
  fn: Any
  args: Tuple[Any, ...]
  mesh: Any
  name: str


def abstract_mesh(data: int, fsdp: int, num_devices: int,
                  field: str = "devices") -> AbstractMesh:
  """The ``(data, fsdp)`` mesh ``sharding.make_mesh`` would make of ``num_devices``, deviceless.

  Same rules as ``make_mesh``: ``data=-1`` takes all the devices ``fsdp`` leaves. A mesh that does
  not use every device is refused (a program is exported for the whole slice).

  Args:
    data: ``config.mesh.data`` (-1: all devices that ``fsdp`` leaves).
    fsdp: ``config.mesh.fsdp``.
    num_devices: devices of the target slice.
    field: the name of ``num_devices`` in error messages (the CLI passes ``'--devices'``).

  Returns:
    ``AbstractMesh`` with axes ``('data', 'fsdp')`` of sizes ``(data, fsdp)``.
  """
  n = validate.check_int(field, num_devices)
  if not validate.is_int(fsdp) or fsdp < 1:
    raise validate.not_allowed("mesh.fsdp", fsdp, "it must be an integer >= 1")
  if n % fsdp:
    raise validate.not_allowed(field, n, f"it must be divisible by mesh.fsdp={fsdp}")
  if data == -1:
    data = n // fsdp
  if not validate.is_int(data) or data < 1 or data * fsdp != n:
    raise validate.not_allowed(field, n, f"it must equal mesh.data={data} x mesh.fsdp={fsdp} "
                               "(or set mesh.data=-1)")
  return AbstractMesh((data, fsdp), shd.BATCH_AXES)


def train_program(config, mesh, channels: int = 0) -> Program:
  """The trainer's jitted train step of ``config`` on ``mesh`` and its abstract inputs.

  Args:
    config: a training config (its dtype, remat, accum_steps, EMA and optimiser are used as is).
    mesh: a ``Mesh`` or an ``AbstractMesh`` with axes ``('data', 'fsdp')``.
    channels: see ``setup.data_info``.

  Returns:
    ``Program`` with ``fn(state, batch) -> (state, metrics)`` and ``args = (state, batch)``: the
    train state with its FSDP shardings and the ``(config.batch_size, H, W, C)`` batch.
  """
  s = setup.build(config, info=setup.data_info(config, channels), mesh=mesh)
  return Program(s.train_step, s.abstract_args(), mesh, "train_step")


def sample_batch_size(requested: int, num_devices: int) -> int:
  """Images per sampling call as the sample command rounds them: a multiple of the device count."""
  return max(num_devices, (requested // num_devices) * num_devices)


def jit_sample(task, sample_cfg, mesh) -> Callable:
  """The task's ``sample`` jitted as the sample command runs it: noise, labels and output split over
  the devices, the weights wherever their shardings put them (FSDP), the key replicated.

  The returned ``fn(params, noise (N, H, W, C), labels (N,), key) -> (N, H, W, C)``.
  """
  s = shd.batch_sharding(mesh)
  return jax.jit(lambda p, x, y, k: task.sample(p, x, y, k, sample_cfg),
                 in_shardings=(None, s, s, None), out_shardings=s)


def sample_program(config, mesh, sample_cfg=None, batch: int = 0, channels: int = 0) -> Program:
  """The sample command's sampler for a SiT ``config`` on ``mesh``, with abstract inputs.

  Args:
    config: a SiT training config.
    mesh: a ``Mesh`` or an ``AbstractMesh`` with axes ``('data', 'fsdp')``.
    sample_cfg: the sampler settings (default: ``config.sample``, the command's defaults).
    batch: images per call before rounding (0: ``sample_cfg.batch_size``).
    channels: see ``setup.data_info``.

  Returns:
    ``Program`` with ``args = (weights, noise, labels, key)``: the weights with the FSDP
    shardings the sample command restores them with.
  """
  config_lib.validate(config)
  if not tasks.get(config.task).samples:
    raise validate.not_allowed("task", config.task, "sampling needs a SiT config ('sit')")
  info, model, _ = setup.check_config(config, info=setup.data_info(config, channels), mesh=mesh)
  task = setup.make_task(config, model, info)
  sample_cfg = sample_cfg or config.sample
  n = sample_batch_size(batch or sample_cfg.batch_size, mesh.size)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), *task.init_inputs(1))["params"])
  s = shd.batch_sharding(mesh)
  args = (setup.with_shardings(params, shd.param_shardings(params, mesh)),
          jax.ShapeDtypeStruct((n,) + task.image_shape(), jnp.float32, sharding=s),
          jax.ShapeDtypeStruct((n,), jnp.int32, sharding=s),
          jax.eval_shape(lambda: jax.random.key(0)))
  return Program(jit_sample(task, sample_cfg, mesh), args, mesh, "sample")


def check_platforms(platforms: Sequence[str], field: str = "platforms") -> Tuple[str, ...]:
  """The platforms as a tuple after checking each is one ``jax.export`` knows."""
  platforms = tuple(platforms)
  if not platforms:
    raise validate.not_allowed(field, "", f"give one or more of {', '.join(PLATFORMS)}")
  for p in platforms:
    if p not in PLATFORMS:
      raise validate.not_allowed(field, ",".join(platforms),
                                 f"{p!r} is not a platform; choose from {', '.join(PLATFORMS)}")
  return platforms


def export(program: Program, platform: str):
  """``(jax.export.Exported, seconds)`` of ``program`` lowered for one platform."""
  check_platforms((platform,), "platform")
  t0 = time.perf_counter()
  exported = jax.export.export(program.fn, platforms=(platform,))(*program.args)
  return exported, time.perf_counter() - t0


def mesh_text(mesh) -> str:
  """``'data=8 x fsdp=8 (64 devices)'``."""
  axes = " x ".join(f"{name}={size}" for name, size in mesh.shape.items())
  return f"{axes} ({mesh.size} devices)"


def lower(program: Program, platforms: Sequence[str]) -> list:
  """Lowers ``program`` for each platform; one row per platform.

  Returns:
    ``[{'platform', 'seconds', 'chars' (StableHLO text), 'bytes' (serialized module), 'mesh',
    'text', 'exported'}]``. ``seconds`` is the export alone; the first platform also pays for
    tracing, which the later ones reuse.
  """
  rows = []
  for platform in check_platforms(platforms):
    exported, seconds = export(program, platform)
    text = exported.mlir_module()
    rows.append({"platform": platform, "seconds": seconds, "chars": len(text),
                 "bytes": len(exported.mlir_module_serialized), "mesh": mesh_text(program.mesh),
                 "text": text, "exported": exported})
  return rows


def check_abstract(config, which: str) -> None:
  """Refuses in one line what cannot lower over an ``AbstractMesh`` (it needs devices to lower).

  cuDNN attention is partitioned by ``custom_partitioning``, whose Python callbacks run in the
  SPMD partitioner; dopri5's step-size checks (equinox ``error_if``) are host callbacks.
  """
  if config.model.get("attention_impl") == "cudnn":
    raise validate.not_allowed(
        "model.attention_impl", "cudnn", "cuDNN attention needs devices to lower (its "
        "custom_partitioning runs Python at partitioning time); lower with None or 'xla'")
  if which == "sample" and str(config.sample.method).lower() == "dopri5":
    raise validate.not_allowed(
        "sample.method", config.sample.method, "dopri5 needs devices to lower (equinox's "
        "step checks are host callbacks); lower 'heun' or 'euler'")


def program_for(config, num_devices: int, which: str = "train_step",
                field: str = "devices") -> Program:
  """``train_program`` or ``sample_program`` of ``config`` on an abstract ``num_devices`` mesh."""
  validate.check_choice("program", which, ("train_step", "sample"))
  if which == "sample" and not tasks.get(config.task).samples:
    raise validate.not_allowed("program", which, f"only SiT samples; the config's task is "
                               f"{config.task!r}")
  check_abstract(config, which)
  mesh = abstract_mesh(config.mesh.data, config.mesh.fsdp, num_devices, field)
  if which == "sample":
    return sample_program(config, mesh)
  return train_program(config, mesh)


def summary(row: dict, name: str = "") -> str:
  """One line per lowering: ``tpu: train_step lowered in 2.0 s, StableHLO 5,460,981 chars ...``."""
  what = f"{name} " if name else ""
  return (f"{row['platform']}: {what}lowered in {row['seconds']:.2f} s, StableHLO "
          f"{row['chars']:,} chars ({row['bytes']:,} bytes serialized), mesh {row['mesh']}")
