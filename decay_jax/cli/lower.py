"""Lower a config's train step (or SiT sampler) to StableHLO for TPU/GPU slices this machine lacks.

    python -m decay_jax.cli.lower --config=configs/mae_vit_h14.py --platforms=tpu,cuda --devices=8
    python -m decay_jax.cli.lower --config=configs/sit_xl2.py --program=sample --out=/tmp/s.mlir
    python -m decay_jax.cli.lower --config=configs/sit_s2_routing.py:mirror --config.mesh.fsdp=8

The program is the trainer's jitted train step (``decay_jax.perf.export.train_program``: the
config's dtype, remat, accum_steps, EMA, optimiser and mesh, FSDP state shardings, donated state)
or the sample command's sampler (``--program=sample``, ``config.sample``), exported with
``jax.export`` over an abstract ``(data, fsdp)`` mesh of ``--devices`` devices: no accelerator,
no fake devices, no dataset. Prints one line per platform: lowering seconds, StableHLO size and
the mesh. ``--out=FILE.mlir`` writes the StableHLO text (with several platforms, one file each:
``FILE.tpu.mlir``, ``FILE.cuda.mlir``). Bad input prints one ``error:`` line and exits 2.
"""

import os
import sys

from absl import flags
from ml_collections import config_flags

from decay_jax import logs, paths
from decay_jax.cli import errors
from decay_jax.perf import export

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file in configs/.",
                                          lock_config=True)
_PLATFORMS = flags.DEFINE_list("platforms", ["tpu", "cuda"],
                               f"Platforms to lower for: {', '.join(export.PLATFORMS)}.")
_DEVICES = flags.DEFINE_integer("devices", 64, "Devices of the target slice (the mesh's size).")
_PROGRAM = flags.DEFINE_enum("program", "train_step", ["train_step", "sample"],
                             "The train step, or the SiT sampler of config.sample.")
_OUT = flags.DEFINE_string("out", None, "Write the StableHLO text here (FILE.mlir).")


def out_paths(out: str, platforms) -> dict:
  """``{platform: path}``: ``out`` itself for one platform, else ``stem.PLATFORM.ext`` each."""
  if len(platforms) == 1:
    return {platforms[0]: out}
  stem, ext = os.path.splitext(out)
  return {p: f"{stem}.{p}{ext or '.mlir'}" for p in platforms}


def main(argv):
  del argv
  logs.quiet_libraries()
  try:
    if _CONFIG.value is None:
      raise ValueError("--config is required")
    platforms = export.check_platforms(_PLATFORMS.value, "--platforms")
    program = export.program_for(_CONFIG.value, _DEVICES.value, _PROGRAM.value, "--devices")
  except ValueError as e:  # bad input: one line, nothing lowered
    print(f"error: {e}", file=sys.stderr)
    return 2
  outs = out_paths(_OUT.value, platforms) if _OUT.value else {}
  for platform in platforms:  # one at a time, so that each line appears when it is ready
    row, = export.lower(program, (platform,))
    line = export.summary(row, program.name)
    if row["platform"] in outs:
      paths.write_text(outs[row["platform"]], row["text"])  # local or gs://
      line += f", wrote {outs[row['platform']]}"
    print(line, flush=True)
  return 0


def run():
  errors.run(main)


if __name__ == "__main__":
  run()
