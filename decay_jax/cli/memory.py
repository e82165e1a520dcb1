"""Ahead-of-time memory and compile report of the train step: does a config fit, how long it compiles.

    python -m decay_jax.cli.memory --config=configs/mae_vit_h14.py --devices=64 --fsdp=1,64 \
        --remat=none,full,dots
    python -m decay_jax.cli.memory --task=sit --preset=XL/2 --devices=8 --dtype=bfloat16
    python -m decay_jax.cli.memory --config=configs/mae_vit_b16.py --topology=v5p-64 --top=10

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

``--topology=SLICE`` (``v5p-64``, ``v5e-16``, ``v6e:4x4``; ``--num_slices`` for multi-slice) compiles
instead with the TPU compiler (libtpu, the ``[tpu]`` extra) for that slice, on this machine's CPU,
on the mesh the trainer builds there, and prints per chip: peak HBM and whether it fits, XLA's
cost analysis, the recount with loop bodies counted per trip, the roofline step time, MFU and the
compile time (``decay_jax.perf.tpu``; docs/tpu.md). ``--top=N`` adds where the bytes go: by op
category, by model part and the N instructions that move the most.

``--devices=N`` makes N fake CPU devices (no accelerator needed to size a pod); without it the
machine's own devices are used. On CPU the numbers are XLA's CPU schedule, a proxy for a GPU/TPU:
other backends fuse and schedule differently and add their own workspace (cuDNN, collectives).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import jax
from absl import flags
from ml_collections import config_flags

from decay_jax import paths
from decay_jax.cli import errors
from decay_jax.models import layers
from decay_jax.perf import memory, tpu
from decay_jax.train import config as config_lib
from decay_jax.train import setup, tasks

# ------------------------------------------------------------------------------------------------
# Command line.

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """Command-line flags, defined when the command runs (importing the module defines none)."""
  config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
  flags.DEFINE_enum("task", "mae", list(tasks.TASKS), "Without --config: the task's defaults.")
  flags.DEFINE_string("preset", None, "Override model.preset (e.g. H/14, XL/2).")
  flags.DEFINE_string("dtype", None, "Override model.dtype (float32, bfloat16).")
  flags.DEFINE_integer("devices", 0, "Fake CPU devices (0: this machine's devices).")
  flags.DEFINE_list("fsdp", None, "mesh.fsdp values to compare (default: the config's).")
  flags.DEFINE_list("remat", None, "Remat policies to compare: none, full, dots (default: the "
                    "config's).")
  flags.DEFINE_integer("batch", 0, "Global batch (0: the config's batch_size).")
  flags.DEFINE_integer("channels", 0, "Input channels (0: 3 for MAE, 4 for SiT).")
  flags.DEFINE_string("out", None, "Append every row as one JSON line to this file.")
  flags.DEFINE_string("topology", None, "Compile for this TPU slice with libtpu (v5p-64, "
                      "v5e-16, v6e:4x4, ...) instead of this machine's devices.")
  flags.DEFINE_integer("num_slices", 1, "With --topology: slices of a multi-slice job.")
  flags.DEFINE_integer("top", 0, "With --topology: also print where the bytes go (N largest).")
  flags.DEFINE_string("table", None, "Print the markdown table of the --topology rows stored in "
                      "this JSON-lines file (an --out of earlier runs); nothing compiled.")


def _int_list(field: str, values) -> list:
  try:
    return [int(v) for v in values]
  except ValueError:
    raise ValueError(f"--{field}={','.join(values)} is not allowed; give integers such as 1,8")


def main(argv):
  del argv
  if FLAGS.table:
    if not paths.exists(FLAGS.table):
      print(f"error: --table={FLAGS.table} does not exist; give a file written by --out",
            file=sys.stderr)
      return 2
    rows = [json.loads(line) for line in paths.read_text(FLAGS.table).splitlines() if line]
    print(tpu.markdown(rows, with_config=True))
    return 0
  if FLAGS.topology and FLAGS.devices:
    print("error: --devices is not allowed with --topology; the slice sets the chip count",
          file=sys.stderr)
    return 2
  if FLAGS.topology:  # the slice's devices are compile targets; never open this host's TPUs/GPUs
    jax.config.update("jax_platforms", "cpu")
  if FLAGS.devices:  # before anything touches the backend
    if FLAGS.devices < 1:
      print(f"error: --devices={FLAGS.devices} is not allowed; it must be >= 1", file=sys.stderr)
      return 2
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", FLAGS.devices)
  base = FLAGS.config
  if base is None:
    base = tasks.get(FLAGS.task).default_config()
  try:
    target = tpu.target(FLAGS.topology, FLAGS.num_slices) if FLAGS.topology else None
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
      mesh = tpu.mesh(c, target) if target else None
      setup.check_config(c, info=setup.data_info(c, FLAGS.channels), mesh=mesh,
                         batch=FLAGS.batch or None)
      configs.append(c)
  except ValueError as e:  # bad value: one line, nothing compiled
    print(f"error: {e}", file=sys.stderr)
    return 2
  if target:
    return _tpu_reports(configs, target)
  print(f"{configs[0].task} {configs[0].model.preset}: {len(configs)} compile(s) on "
        f"{jax.device_count()} {jax.devices()[0].device_kind} device(s)", flush=True)
  rows, t0 = [], time.perf_counter()
  for i, c in enumerate(configs):
    row = memory.report(c, FLAGS.batch or None, FLAGS.channels)
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
  print(memory.markdown(rows))
  return 0


def _config_name() -> str:
  """The config file's name (with its ``:ROW``) or the task's defaults."""
  if FLAGS.config is None:
    return f"{FLAGS.task} defaults"
  arg = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--config=")), "")
  return os.path.basename(arg) or os.path.basename(
      config_flags.get_config_filename(FLAGS["config"]))


def _tpu_reports(configs, target) -> int:
  """Each config compiled for the TPU ``target``: its report, then the table of all."""
  print(f"{configs[0].task} {configs[0].model.preset}: {len(configs)} compile(s) for "
        f"{target.name} ({target.topology} x {target.num_slices} slice(s), {target.chips} "
        f"{target.chip.device_kind} chips) with its compiler on this machine's CPU", flush=True)
  rows, t0 = [], time.perf_counter()
  for i, c in enumerate(configs):
    row = tpu.compile_report(c, target, FLAGS.batch or None, FLAGS.channels, FLAGS.top)
    row["config_file"] = _config_name()
    row["overrides"] = " ".join(a for a in sys.argv[1:] if a.startswith("--config."))
    rows.append(row)
    eta = (time.perf_counter() - t0) / (i + 1) * (len(configs) - i - 1)
    print(f"[{i + 1}/{len(configs)}] " + "\n".join(tpu.summary_lines(row))
          + (f"\n  ETA {eta:.0f} s" if i + 1 < len(configs) else ""), flush=True)
    if FLAGS.top:
      print(tpu.where_bytes_go(row))
    if FLAGS.out:
      paths.append_text(FLAGS.out, json.dumps(row) + "\n")
  print("\nper chip:")
  print(tpu.markdown(rows))
  return 0


def run():
  _define_flags()
  errors.run(main)


if __name__ == "__main__":
  run()
