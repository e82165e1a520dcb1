"""Ahead-of-time memory and compile report of the train step: does a config fit, how long it compiles.

    python -m decay_jax.cli.memory --config=configs/mae_vit_h14.py --devices=64 --fsdp=1,64 \
        --remat=none,full,dots
    python -m decay_jax.cli.memory --task=sit --preset=XL/2 --devices=8 --dtype=bfloat16

For every ``(fsdp, remat)`` pair the trainer's jitted train step (``decay_jax.train.step``: AdamW,
EMA when the config has one, ``accum_steps`` microbatches, donated state) is lowered and compiled
on abstract inputs (``jax.ShapeDtypeStruct`` carrying the run's shardings; nothing is allocated),
at the config's global batch, and XLA's memory analysis of the compiled program is printed per
device:

  ``params``, ``opt``, ``ema``: this device's shards of the train state (FSDP divides them),
  ``batch``: this device's share of the input batch,
  ``temp``: XLA's temporary buffers: the activations kept for the backward pass, the gradients and
    the working buffers of the step (what remat and smaller per-device batches reduce),
  ``peak``: argument + output + temp - alias (the donated state is aliased to the output).

``--devices=N`` makes N fake CPU devices (no accelerator needed to size a pod); without it the
machine's own devices are used. On CPU the numbers are XLA's CPU schedule, a proxy for a GPU/TPU:
other backends fuse and schedule differently and add their own workspace (cuDNN, collectives).
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from typing import Any, Dict, Optional

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

from decay_jax import paths
from decay_jax import sharding as shd
from decay_jax.cli import errors
from decay_jax.data import on_device
from decay_jax.models import factory, layers
from decay_jax.train import export, trainer
from decay_jax.train import config as config_lib
from decay_jax.train import step as step_lib

GIB = 2 ** 30
# Device memory sizes of the "fits" column (GB = 10^9 bytes): 16 GB (V100/T4 class), 80 GB
# (A100/H100), 141 GB (H200).
CAPACITIES_GB = (16, 80, 141)
# Usable fraction of a device's memory assumed by ``fits`` (runtime, workspace, fragmentation).
HEADROOM = 0.9


def build(config, batch: int, channels: int = 0):
  """``(model, task, tx, schedule)`` of a config without reading its dataset (shape only).

  ``channels``: input channels (0: the dataset's for in-memory data, else 3, or 4 for SiT).
  The task and the optimiser are the trainer's (``trainer.make_task``, ``trainer.make_optimizer``).
  """
  info = dict(export.data_info(config, channels), num_train=batch * 1000)
  model = factory.build_model(config, info)
  task = trainer.make_task(config, model, info)
  tx, schedule = trainer.make_optimizer(config, task, 1000, 10)
  return model, task, tx, schedule


def abstract_batch(model, config, batch: int, mesh):
  """The input batch as ``ShapeDtypeStruct``s split over the mesh: image (B, H, W, C), label (B,)."""
  return export.abstract_batch(model, config.task, batch, mesh,
                               on_device.stream_dtype(config.data))


def memory_report(compiled) -> dict:
  """XLA's memory analysis of one device's program in GiB ({} where the backend has none)."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # some backends do not implement it
    return {}
  if m is None:
    return {}
  gib = lambda b: round(b / GIB, 3)
  return {"argument_gib": gib(m.argument_size_in_bytes), "output_gib": gib(m.output_size_in_bytes),
          "temp_gib": gib(m.temp_size_in_bytes),
          "peak_estimate_gib": gib(m.argument_size_in_bytes + m.output_size_in_bytes
                                   + m.temp_size_in_bytes - m.alias_size_in_bytes)}


def shard_bytes(tree) -> int:
  """Bytes of one device's shards of a tree of sharded ``ShapeDtypeStruct``s (the largest shard)."""
  return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
             for a in jax.tree_util.tree_leaves(tree))


def train_step_pieces(config, batch: Optional[int] = None, channels: int = 0) -> Dict[str, Any]:
  """The trainer's jitted train step of ``config`` and its pieces, nothing compiled.

  Returns ``train_step`` (``trainer.jit_train_step``), ``model``, ``task``, ``tx``, ``schedule``,
  ``mesh``, ``batch``, the ``abstract`` state, its ``shardings`` and the abstract inputs
  ``a_state``/``a_batch``. ``batch``: the global batch (default: ``config.batch_size``).
  """
  config_lib.validate(config)
  mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp)
  batch = batch or config.batch_size
  shd.check_batch(batch, mesh, config.accum_steps)
  model, task, tx, schedule = build(config, batch, channels)
  abstract = step_lib.abstract_state(task, tx, config.seed, config.ema_decay > 0)
  shardings = step_lib.state_shardings(abstract, tx, mesh)
  train_step = trainer.jit_train_step(config, task, tx, schedule, shardings, mesh)
  a_state = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                   abstract, shardings)
  a_batch = abstract_batch(model, config, batch, mesh)
  return dict(train_step=train_step, model=model, task=task, tx=tx, schedule=schedule, mesh=mesh,
              batch=batch, abstract=abstract, shardings=shardings, a_state=a_state,
              a_batch=a_batch)


def compile_train_step(config, batch: Optional[int] = None, channels: int = 0) -> Dict[str, Any]:
  """Lowers and compiles the train step of ``config`` on abstract inputs.

  Returns ``train_step_pieces`` plus the ``compiled`` step, ``lower_seconds`` and
  ``compile_seconds`` (wall clock; ``compile_cpu_seconds``: CPU time of this process, all
  threads, which a busy machine inflates less).
  """
  c = train_step_pieces(config, batch, channels)
  t0 = time.perf_counter()
  lowered = c["train_step"].lower(c["a_state"], c["a_batch"])
  t1, cpu1 = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  t2, cpu2 = time.perf_counter(), time.process_time()
  return dict(c, compiled=compiled, lower_seconds=t1 - t0, compile_seconds=t2 - t1,
              compile_cpu_seconds=cpu2 - cpu1)


def report(config, batch: Optional[int] = None, channels: int = 0) -> Dict[str, Any]:
  """One row of the memory/compile table for ``config`` (its mesh, remat and dtype)."""
  c = compile_train_step(config, batch, channels)
  a_state, mesh = c["a_state"], c["mesh"]
  gib = lambda b: round(b / GIB, 3)
  row = {"preset": config.model.preset, "task": config.task, "dtype": config.model.dtype,
         "remat": config.model.remat_policy, "devices": mesh.size,
         "data": mesh.shape["data"], "fsdp": mesh.shape["fsdp"], "global_batch": c["batch"],
         "batch_per_device": c["batch"] // mesh.size, "accum_steps": config.accum_steps,
         "params": sum(int(np.prod(l.shape)) for l in jax.tree_util.tree_leaves(a_state["params"])),
         "params_gib": gib(shard_bytes(a_state["params"])),
         "opt_gib": gib(shard_bytes(a_state["opt_state"])),
         "ema_gib": gib(shard_bytes(a_state.get("ema", {}))),
         "batch_gib": gib(shard_bytes(c["a_batch"])),
         "lower_seconds": round(c["lower_seconds"], 2),
         "compile_seconds": round(c["compile_seconds"], 2),
         "compile_cpu_seconds": round(c["compile_cpu_seconds"], 2),
         **memory_report(c["compiled"])}
  return row


def fits(peak_gib: float, capacity_gb: float) -> bool:
  """Whether a per-device peak fits a device of ``capacity_gb`` (10^9 bytes) with the headroom."""
  return peak_gib * GIB <= HEADROOM * capacity_gb * 1e9


COLUMNS = ("devices", "data", "fsdp", "remat", "dtype", "global_batch", "batch_per_device",
           "params_gib", "opt_gib", "ema_gib", "batch_gib", "temp_gib", "peak_estimate_gib",
           "lower_seconds", "compile_seconds", "compile_cpu_seconds")


def fits_column(row) -> str:
  """The capacities of CAPACITIES_GB the row's peak fits, e.g. '80, 141' ('none' if no one)."""
  if "peak_estimate_gib" not in row:
    return "?"
  ok = [str(c) for c in CAPACITIES_GB if fits(row["peak_estimate_gib"], c)]
  return ", ".join(ok) or "none"


def markdown(rows) -> str:
  head = "| " + " | ".join(COLUMNS) + " | fits (GB) |"
  sep = "|" + "|".join("---:" if c not in ("remat", "dtype") else "---" for c in COLUMNS) + "|---|"
  return "\n".join([head, sep] + ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS)
                                  + f" | {fits_column(r)} |" for r in rows])


# ------------------------------------------------------------------------------------------------
# Command line.

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """Command-line flags, defined only when this module is the program (bench imports it)."""
  config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
  flags.DEFINE_enum("task", "mae", ["mae", "sit"], "Without --config: the task's defaults.")
  flags.DEFINE_string("preset", None, "Override model.preset (e.g. H/14, XL/2).")
  flags.DEFINE_string("dtype", None, "Override model.dtype (float32, bfloat16).")
  flags.DEFINE_integer("devices", 0, "Fake CPU devices (0: this machine's devices).")
  flags.DEFINE_list("fsdp", None, "mesh.fsdp values to compare (default: the config's).")
  flags.DEFINE_list("remat", None, "Remat policies to compare: none, full, dots (default: the "
                    "config's).")
  flags.DEFINE_integer("batch", 0, "Global batch (0: the config's batch_size).")
  flags.DEFINE_integer("channels", 0, "Input channels (0: 3 for MAE, 4 for SiT).")
  flags.DEFINE_string("out", None, "Append every row as one JSON line to this file.")


def _int_list(field: str, values) -> list:
  try:
    return [int(v) for v in values]
  except ValueError:
    raise ValueError(f"--{field}={','.join(values)} is not allowed; give integers such as 1,8")


def main(argv):
  del argv
  if FLAGS.devices:  # before anything touches the backend
    if FLAGS.devices < 1:
      print(f"error: --devices={FLAGS.devices} is not allowed; it must be >= 1", file=sys.stderr)
      return 2
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", FLAGS.devices)
  base = FLAGS.config
  if base is None:
    base = config_lib.mae_config() if FLAGS.task == "mae" else config_lib.sit_config()
  try:
    fsdps = _int_list("fsdp", FLAGS.fsdp) if FLAGS.fsdp else [base.mesh.fsdp]
    for r in FLAGS.remat or []:
      if r not in layers.REMAT_POLICIES:
        raise ValueError(f"--remat={r} is not allowed; choose from "
                         f"{', '.join(layers.REMAT_POLICIES)}")
    remats = FLAGS.remat or [base.model.remat_policy]
    configs = []
    for fsdp, remat in itertools.product(fsdps, remats):  # validate every one before compiling
      c = base.copy_and_resolve_references()
      c.mesh.data, c.mesh.fsdp = -1, fsdp
      config_lib.override(c, **config_lib.model_overrides(FLAGS.preset, FLAGS.dtype, remat))
      config_lib.validate(c)
      mesh = shd.make_mesh(c.mesh.data, c.mesh.fsdp)
      shd.check_batch(FLAGS.batch or c.batch_size, mesh, c.accum_steps)
      build(c, FLAGS.batch or c.batch_size, FLAGS.channels)  # the model checks its own fields
      configs.append(c)
  except ValueError as e:  # bad value: one line, nothing compiled
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{configs[0].task} {configs[0].model.preset}: {len(configs)} compile(s) on "
        f"{jax.device_count()} {jax.devices()[0].device_kind} device(s)", flush=True)
  rows, t0 = [], time.perf_counter()
  for i, c in enumerate(configs):
    row = report(c, FLAGS.batch or None, FLAGS.channels)
    rows.append(row)
    done = time.perf_counter() - t0
    eta = done / (i + 1) * (len(configs) - i - 1)
    print(f"[{i + 1}/{len(configs)}] fsdp={row['fsdp']} remat={row['remat']}: peak "
          f"{row.get('peak_estimate_gib')} GiB/device, compiled in {row['compile_seconds']} s; "
          f"ETA {eta:.0f} s", flush=True)
    if FLAGS.out:
      paths.append_text(FLAGS.out, json.dumps(row) + "\n")
  print(f"\n{configs[0].task} {configs[0].model.preset}, {rows[0]['params'] / 1e6:.1f}M params, "
        "per-device GiB (XLA memory analysis):")
  print(markdown(rows))
  return 0


def run():
  _define_flags()
  errors.run(main)


if __name__ == "__main__":
  run()
