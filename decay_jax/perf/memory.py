"""Ahead-of-time memory and compile reports of the trainer's train step (``train.setup``):
XLA's memory analysis per device, the shards of the train state and batch, and whether the peak
fits common device sizes. ``decay_jax.cli.memory`` tables them; ``decay_jax.cli.bench`` prints
them beside its timings.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

import jax
import numpy as np

from decay_jax.train import setup

GIB = 2 ** 30
# Device memory sizes of the "fits" column (GB = 10^9 bytes): 16 GB (V100/T4 class), 80 GB
# (A100/H100), 141 GB (H200).
CAPACITIES_GB = (16, 80, 141)
# Usable fraction of a device's memory assumed by ``fits`` (runtime, workspace, fragmentation).
HEADROOM = 0.9


def peak_bytes(m) -> int:
  """One device's peak from XLA's memory analysis ``m``: arguments + outputs + temporaries, less
  the outputs that alias (donated) arguments."""
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


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
          "temp_gib": gib(m.temp_size_in_bytes), "peak_estimate_gib": gib(peak_bytes(m))}


def shard_bytes(tree) -> int:
  """Bytes of one device's shards of a tree of sharded ``ShapeDtypeStruct``s (the largest shard)."""
  return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
             for a in jax.tree_util.tree_leaves(tree))


def build(config, batch: Optional[int] = None, channels: int = 0, mesh=None) -> setup.TrainSetup:
  """The trainer's train step of ``config`` (``setup.build``) without reading its dataset
  (``setup.data_info``: ``channels`` 0 is the dataset's for in-memory data, else the task's);
  ``batch``: the global batch (default ``config.batch_size``); nothing compiled."""
  return setup.build(config, info=setup.data_info(config, channels), mesh=mesh, batch=batch)


def compile_train_step(config, batch: Optional[int] = None, channels: int = 0) -> Dict[str, Any]:
  """Lowers and compiles the train step of ``config`` on abstract inputs.

  Returns ``setup`` (``build``'s ``TrainSetup``), the abstract inputs ``a_state``/``a_batch``, the
  ``compiled`` step, ``lower_seconds`` and ``compile_seconds`` (wall clock;
  ``compile_cpu_seconds``: CPU time of this process, all threads, which a busy machine inflates
  less).
  """
  s = build(config, batch, channels)
  a_state, a_batch = s.abstract_args()
  t0 = time.perf_counter()
  lowered = s.train_step.lower(a_state, a_batch)
  t1, cpu1 = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  t2, cpu2 = time.perf_counter(), time.process_time()
  return dict(setup=s, a_state=a_state, a_batch=a_batch, compiled=compiled,
              lower_seconds=t1 - t0, compile_seconds=t2 - t1, compile_cpu_seconds=cpu2 - cpu1)


def report(config, batch: Optional[int] = None, channels: int = 0) -> Dict[str, Any]:
  """One row of the memory/compile table for ``config`` (its mesh, remat and dtype)."""
  c = compile_train_step(config, batch, channels)
  a_state, mesh = c["a_state"], c["setup"].mesh
  gib = lambda b: round(b / GIB, 3)
  row = {"preset": config.model.preset, "task": config.task, "dtype": config.model.dtype,
         "remat": config.model.remat_policy, "devices": mesh.size,
         "data": mesh.shape["data"], "fsdp": mesh.shape["fsdp"], "global_batch": c["setup"].batch_size,
         "batch_per_device": c["setup"].batch_size // mesh.size, "accum_steps": config.accum_steps,
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
