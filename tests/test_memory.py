"""The ahead-of-time memory report: its byte accounting matches XLA's, FSDP divides the state,
remat lowers the temporaries, bad values fail in one line before compiling."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from decay_jax import sharding as shd
from decay_jax.perf import memory
from test_train import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def compiled():
  """Tiny MAE on the 8 test devices: replicated without remat, and FSDP 8 with full remat."""
  out = {}
  for fsdp, remat in ((1, "none"), (8, "full")):
    c = tiny_config(batch_size=64, **{"mesh.data": -1, "mesh.fsdp": fsdp,
                                      "model.remat_policy": remat})
    out[fsdp] = memory.compile_train_step(c)
  return out


def test_state_and_image_shards_are_exactly_xla_arguments(compiled):
  for c in compiled.values():
    m = c["compiled"].memory_analysis()
    # MAE never reads the labels, so XLA drops that argument; the rest matches to the byte.
    ours = memory.shard_bytes(c["a_state"]) + memory.shard_bytes(c["a_batch"]["image"])
    assert m.argument_size_in_bytes == ours
    assert m.alias_size_in_bytes > 0  # the donated state is updated in place


def test_fsdp_divides_the_sharded_parameters_and_remat_lowers_temporaries(compiled):
  rep, fsdp = compiled[1], compiled[8]
  full = memory.shard_bytes(rep["a_state"]["params"])
  split = memory.shard_bytes(fsdp["a_state"]["params"])
  # Only fc1/fc2 kernels of the micro model reach FSDP_MIN_SIZE: they shrink 8x, the rest stays.
  big = sum(int(np.prod(a.shape)) * 4 for a in jax.tree_util.tree_leaves(rep["a_state"]["params"])
            if np.prod(a.shape) >= shd.FSDP_MIN_SIZE)
  assert big > 0 and split == full - big + big // 8
  temp = {k: c["compiled"].memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
  assert temp[8] < temp[1], temp


def test_report_row_and_fits():
  row = {"devices": 8, "remat": "dots", "peak_estimate_gib": 70.0}
  line = memory.markdown([row]).splitlines()[2]
  assert line.startswith("| 8 | ") and line.endswith(" | 141 |")  # 70 GiB = 75.2 GB > 72 GB
  assert memory.fits(66.0, 80) and not memory.fits(68.0, 80)  # 90% of 80e9 bytes = 67.1 GiB


def test_command_line_rejects_bad_values_in_one_line():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for args, line in ((["--fsdp=3"], "error: mesh.fsdp=3 is not allowed; it must divide the "
                                    "device count 8"),
                     (["--remat=some"], "error: --remat=some is not allowed; choose from none, "
                                        "full, dots, dots_context"),
                     # the task checks the batch given, not its config's (fine-tuning's groups)
                     (["--task=finetune", "--batch=16"], "error: mixup.group=32 is not allowed; "
                                                         "it must divide batch_size = 16"),
                     (["--task=vit"], "error: flag --task=vit: value should be one of "
                                      "<finetune|mae|sit|uvit>")):
    p = subprocess.run([sys.executable, "-m", "decay_jax.cli.memory", "--task=sit",
                        "--preset=micro/4", "--devices=8"] + args, cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == line, p.stderr


def test_bench_rejects_bad_model_flags_in_one_line():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for args, line in ((["--remat=some"], "error: model.remat_policy='some' is not allowed; "
                                        "choose one of 'none', 'full', 'dots'"),
                     (["--dtype=float8"], "error: model.dtype='float8' is not allowed")):
    p = subprocess.run([sys.executable, "-m", "decay_jax.cli.bench", "--task=sit",
                        "--preset=micro/4", "--compile_only"] + args, cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith(line), p.stderr
