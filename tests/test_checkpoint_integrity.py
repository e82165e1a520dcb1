"""Checkpoints you can trust: every array's digest is recorded at save and checked at every read.

Damage at several places of a checkpoint (4 KB of zeros or one flipped bit in a data file, broken
array metadata, a missing data file or manifest, a broken meta JSON) is named in one log line and
resuming falls back to the newest intact checkpoint, moving the damaged one aside; the training
command resumed that way ends with the parameters of an uninterrupted run, bit for bit. The
reading commands' paths (``restore_run_params``: evaluate, sample, convert to-torch;
``load_params``: params directories) refuse damage in one line, and checkpoints written before
digests existed still load, with one log line.

The training commands of this module (and of test_runtime_failures.py) share one JAX compilation
cache under pytest's session directory: the first run compiles, the others load.
"""

import glob
import json
import logging
import os
import shutil
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from decay_jax import sharding as shd
from decay_jax.io import flax_params
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import digest, failures, setup
from decay_jax.validate import InputError
from decay_jax.train import tasks
from testing_configs import load_config, override, run_to_end
from xla_env import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
# The demo command made tiny: micro model, 16-px digits, a checkpoint every 2 steps (kept: 2, 4, 6).
OVERRIDES = {"model.preset": "micro/4", "data.image_size": 16, "batch_size": 16,
             "num_train_steps": STEPS, "mesh.data": 1, "tensorboard": False,
             "checkpoint.every_steps": 2, "checkpoint.async_save": True,
             "picture_every_steps": 0, "evals.knn.enabled": False, "evals.rank.enabled": False,
             "warmup_epochs": 0.0}


def command(workdir, **overrides):
  """The training command of ``OVERRIDES`` (plus ``overrides``) on ``workdir``."""
  fields = dict(OVERRIDES, **overrides)
  return [sys.executable, "-m", "decay_jax.cli.train", "--config=configs/mae_cpu_mnist.py",
          f"--workdir={workdir}", *(f"--config.{k}={str(v).lower() if isinstance(v, bool) else v}"
                                    for k, v in fields.items())]


def command_env(cache_dir, **extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
             JAX_COMPILATION_CACHE_DIR=str(cache_dir),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  env["XLA_FLAGS"] = xla_flags()  # one device, as a user's CPU run
  env.update(extra)
  return env


def jit_cache(tmp_path_factory):
  """The JAX compilation cache the training commands of these modules share (one per session)."""
  path = tmp_path_factory.getbasetemp() / "jit_cache_of_training_commands"
  path.mkdir(exist_ok=True)
  return path


def tiny_config():
  return override(load_config("mae_cpu_mnist"), **OVERRIDES)


@pytest.fixture(scope="module")
def spec():
  """The tiny run's abstract train state and its shardings on one device (nothing compiled)."""
  s = setup.build(tiny_config(), mesh=shd.make_mesh(1, 1))
  return s.abstract, s.shardings


def final_state(workdir, spec, step=STEPS):
  ck = ckpt_lib.RunCheckpoints(workdir, async_save=False)
  state, meta = ck.restore(step, *spec)
  ck.close()
  return jax.device_get(state), meta


@pytest.fixture(scope="module")
def straight(tmp_path_factory, spec):
  """An uninterrupted run of the command: checkpoints 2, 4 and 6 and its final state."""
  workdir = str(tmp_path_factory.mktemp("integrity") / "straight")
  p = run_to_end(command(workdir), REPO, command_env(jit_cache(tmp_path_factory)))
  assert p.returncode == 0, p.stderr[-3000:]
  assert ckpt_lib.checkpoint_steps(workdir) == [2, 4, 6]
  return {"workdir": workdir, "state": final_state(workdir, spec),
          "states": {step: final_state(workdir, spec, step)[0] for step in (2, 4)}}


def copy_without_last(straight, tmp_path, name="run"):
  """The straight run as it was before its last checkpoint (2 and 4)."""
  workdir = str(tmp_path / name)
  shutil.copytree(straight["workdir"], workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", str(STEPS)))
  return workdir


def largest_data_file(step_dir):
  files = glob.glob(os.path.join(step_dir, "state", "ocdbt.process_0", "d", "*"))
  return max(files, key=os.path.getsize)


def outcome(read):
  """``intact``, ``differs`` (read, but the digests differ) or ``unreadable``, of ``read()``."""
  try:
    read()
  except ckpt_lib.CheckpointError as e:
    return "unreadable" if "cannot be read" in str(e) else "differs"
  return "intact"


def overwrite_until(path, data, read, wanted):
  """Writes ``data`` (bytes, or a function of the one byte there) into ``path`` at the middle, else
  a little further out, until ``read()`` gives an outcome in ``wanted``; returns the outcome. A data
  file interleaves compressed chunks (zstd, no checksum: most flipped bits decode to other
  numbers, some break the frame) with index nodes, and where each array lands depends on the order
  of the asynchronous writes, so a fixed offset can miss the data."""
  size = os.path.getsize(path)
  length = 1 if callable(data) else len(data)
  for fraction in (0.5, 0.4, 0.6, 0.3, 0.7, 0.2, 0.8, 0.1, 0.9):
    at = int(size * fraction) - length // 2
    with open(path, "r+b") as f:
      f.seek(at)
      before = f.read(length)
      f.seek(at)
      f.write(data(before) if callable(data) else data)
    result = outcome(read)
    if result in wanted:
      return result
    with open(path, "r+b") as f:
      f.seek(at)
      f.write(before)
  raise AssertionError(f"no offset of {path} gave {wanted}")


def damage(workdir, step, kind, spec):
  """Damages checkpoint ``step`` of ``workdir`` as a disk, a copy or a person might."""
  step_dir = os.path.join(workdir, "checkpoints", str(step))
  def read():
    ck = ckpt_lib.RunCheckpoints(workdir, async_save=False)
    try:
      ck.restore(step, *spec)
    finally:
      ck.close()
  if kind == "zeros_in_data":  # the issue's: 4 KB of zeros in the middle of the largest data file
    overwrite_until(largest_data_file(step_dir), b"\0" * 4096, read, ("differs", "unreadable"))
  elif kind == "bit_in_data":  # one bit that still reads: only the digest sees it
    overwrite_until(largest_data_file(step_dir), lambda b: bytes([b[0] ^ 0x10]), read,
                    ("differs",))
  elif kind == "broken_array_metadata":
    with open(os.path.join(step_dir, "state", "_METADATA"), "w") as f:
      f.write('{"tree_metadata": {')
  elif kind == "missing_data_file":
    os.remove(largest_data_file(step_dir))
  elif kind == "missing_manifest":
    os.remove(os.path.join(step_dir, "state", "manifest.ocdbt"))
  elif kind == "broken_meta_json":
    with open(os.path.join(step_dir, "meta", "metadata"), "w") as f:
      f.write('{"step": 4, "examples_se')
  else:
    raise ValueError(kind)


def test_digests_are_exact_on_any_sharding_and_see_one_bit():
  x = jax.random.normal(jax.random.key(0), (16, 24))
  tree = {"w": x, "half": x.astype(jnp.bfloat16), "i": jnp.arange(5, dtype=jnp.int32),
          "key": jax.random.key_data(jax.random.key(1)), "flag": jnp.array([True, False]),
          "scalar": jnp.float32(3.0), "bytes": jnp.arange(7, dtype=jnp.uint8),
          "wide": jnp.arange(3, dtype=jnp.uint32)}
  one, finite = digest.compute(tree)
  assert finite and len(one) == len(tree)
  mesh = shd.make_mesh(4, 2)  # 8 devices (tests/conftest.py), sharded two ways
  spread = dict(tree, w=jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", "fsdp"))),
                half=jax.device_put(tree["half"], NamedSharding(mesh, PartitionSpec(None, "fsdp"))))
  assert digest.compute(spread)[0] == one  # the same on any sharding
  # The arithmetic, in numpy: sums of the uint32 words, plain and weighted by 2i+1, mod 2^32.
  words = np.asarray(x).view(np.uint32).ravel().astype(np.uint64)
  i = np.arange(words.size, dtype=np.uint64)
  assert one["['w']"] == [int((words * (2 * i + 1)).sum() % 2**32), int(words.sum() % 2**32)]
  flipped = np.asarray(x).copy()
  flipped.view(np.uint32)[3, 5] ^= 1 << 7
  assert digest.differences(digest.record(one), dict(tree, w=jnp.asarray(flipped))) == ["['w']"]
  swapped = np.asarray(x).copy()
  swapped[0, 0], swapped[0, 1] = swapped[0, 1], swapped[0, 0]
  assert digest.differences(digest.record(one), dict(tree, w=jnp.asarray(swapped))) == ["['w']"]
  assert not digest.compute({"w": jnp.array([1.0, jnp.inf])})[1]


@pytest.mark.parametrize("kind", ["zeros_in_data", "bit_in_data", "broken_array_metadata",
                                  "missing_data_file", "missing_manifest", "broken_meta_json"])
def test_damage_is_named_and_resume_falls_back_to_the_intact_checkpoint(straight, spec, tmp_path,
                                                                       kind, caplog):
  workdir = copy_without_last(straight, tmp_path)
  damage(workdir, 4, kind, spec)
  ck = ckpt_lib.RunCheckpoints(workdir, async_save=False)
  with caplog.at_level(logging.WARNING):
    step, state, meta = ck.restore_newest(*spec)
  ck.close()
  assert step == meta["step"] == 2
  named = [r.getMessage() for r in caplog.records
           if r.getMessage().startswith(f"workdir={workdir!r} checkpoints/4 is damaged (")]
  assert len(named) == 1, [r.getMessage() for r in caplog.records]
  assert "\n" not in named[0]
  if kind == "bit_in_data":  # reads without an error: only the digest sees it
    assert "arrays differ from the digests recorded at save, first [" in named[0], named[0]
  assert any(r.getMessage().startswith("resuming from step 2, the newest intact checkpoint; the "
                                       "damaged checkpoint 4 moved to ") for r in caplog.records)
  # Moved aside, so that the run can save step 4 again; checkpoint 2 is what the run saved.
  assert ckpt_lib.checkpoint_steps(workdir) == [2]
  assert os.path.isdir(os.path.join(workdir, "damaged_checkpoints", "4", "state"))
  chex.assert_trees_all_equal(jax.device_get(state), straight["states"][2])


def test_command_resumes_from_the_intact_checkpoint_and_ends_as_uninterrupted(
    straight, spec, tmp_path, tmp_path_factory):
  # The case: 4 KB of zeros in the largest data file of the newest checkpoint, rerun.
  workdir = copy_without_last(straight, tmp_path)
  damage(workdir, 4, "zeros_in_data", spec)
  p = run_to_end(command(workdir), REPO, command_env(jit_cache(tmp_path_factory)))
  assert p.returncode == 0, p.stderr[-3000:]
  assert f"workdir={workdir!r} checkpoints/4 is damaged (" in p.stderr
  assert "resuming from step 2, the newest intact checkpoint" in p.stderr
  assert "resumed from step 2 (32 examples seen)" in p.stderr
  assert "Traceback" not in p.stderr
  state, meta = final_state(workdir, spec)
  assert meta["step"] == STEPS
  chex.assert_trees_all_equal(state, straight["state"][0])  # bit for bit
  assert not os.path.exists(os.path.join(workdir, "lease.json"))


def test_no_intact_checkpoint_stops_with_one_line_and_moves_nothing(straight, spec, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(straight["workdir"], workdir)
  for step, kind in ((2, "missing_manifest"), (4, "bit_in_data"), (6, "broken_meta_json")):
    damage(workdir, step, kind, spec)
  ck = ckpt_lib.RunCheckpoints(workdir, async_save=False)
  with pytest.raises(ckpt_lib.CheckpointError) as e:
    ck.restore_newest(*spec)
  ck.close()
  text = str(e.value)
  assert text.startswith(f"workdir={workdir!r} cannot be resumed: no intact checkpoint "
                         "(checkpoints/6: it cannot be read: "), text
  assert "; checkpoints/4: 1 of " in text and "; checkpoints/2: it cannot be read" in text
  assert text.endswith("move checkpoints/ aside to start afresh, or use a new workdir")
  assert "\n" not in text
  assert ckpt_lib.checkpoint_steps(workdir) == [2, 4, 6]
  assert not os.path.exists(os.path.join(workdir, "damaged_checkpoints"))


def _edit_recorded_digest(workdir, step, leaf):
  """Changes the digest recorded for ``leaf`` at ``step``: the same as damage of that array that
  still reads (which the data-file tests above produce for whichever array the bytes hold)."""
  path = os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  meta["digests"]["arrays"][leaf][0] ^= 1
  with open(path, "w") as f:
    json.dump(meta, f)


def test_reading_commands_refuse_a_damaged_checkpoint(straight, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(straight["workdir"], workdir)
  leaf = "['params']['cls_token']"
  _edit_recorded_digest(workdir, STEPS, leaf)
  mesh = shd.make_mesh(1, 1)
  # decay-jax-evaluate and -sample read through restore_run_params ...
  with pytest.raises(ckpt_lib.CheckpointError) as e:
    ckpt_lib.restore_run_params(workdir, mesh)
  assert str(e.value) == (
      f"workdir={workdir!r} checkpoints/{STEPS} is damaged (1 of "
      f"{len(jax.tree_util.tree_leaves(straight['state'][0]['params']))} arrays differ from the "
      f"digests recorded at save, first {leaf}; its other checkpoints: steps [2, 4] (--step))")
  params, step = ckpt_lib.restore_run_params(workdir, mesh, step=4)  # an intact one still reads
  assert step == 4
  # ... and decay-jax-convert to-torch through flax_params.read_params: one line on --params.
  with pytest.raises(InputError, match=rf"--params {workdir}: checkpoints/{STEPS} is damaged "):
    flax_params.read_params(workdir)


def test_params_directories_record_and_check_digests(straight, tmp_path, caplog):
  params, _ = ckpt_lib.restore_run_params(straight["workdir"], shd.make_mesh(1, 1))
  model = tasks.build_model(tiny_config(), {"image_size": 16, "channels": 1,
                                              "num_train": 10000, "num_classes": 10})
  directory = str(tmp_path / "params")
  ckpt_lib.save_params(directory, jax.device_get(params), model)
  with open(os.path.join(directory, "model.json")) as f:
    assert json.load(f)["digests"]["format"] == digest.FORMAT
  _, back = ckpt_lib.load_params(directory)
  chex.assert_trees_all_equal(jax.device_get(back), jax.device_get(params))
  damaged = str(tmp_path / "damaged")
  shutil.copytree(directory, damaged)
  data = max(glob.glob(os.path.join(damaged, "params", "ocdbt.process_0", "d", "*")),
             key=os.path.getsize)
  # One bit of one array: it reads, the digest differs.
  overwrite_until(data, lambda b: bytes([b[0] ^ 0x01]), lambda: ckpt_lib.load_params(damaged),
                  ("differs",))
  with pytest.raises(ckpt_lib.CheckpointError) as e:
    ckpt_lib.load_params(damaged, "vae")
  assert str(e.value).startswith(f"vae={damaged!r} is damaged (1 of "), str(e.value)
  # Written before digests: loads, and says once that it cannot be verified.
  old = str(tmp_path / "old")
  shutil.copytree(directory, old)
  with open(os.path.join(old, "model.json")) as f:
    meta = json.load(f)
  del meta["digests"]
  with open(os.path.join(old, "model.json"), "w") as f:
    json.dump(meta, f)
  with caplog.at_level(logging.WARNING):
    ckpt_lib.load_params(old)
    ckpt_lib.load_params(old)
  notes = [r for r in caplog.records if "written before checkpoints recorded digests" in
           r.getMessage()]
  assert len(notes) == 1 and notes[0].getMessage().startswith(f"checkpoint={old!r} was written")


def test_checkpoints_without_digests_still_load_with_one_line(straight, spec, tmp_path, caplog):
  workdir = str(tmp_path / "old")
  shutil.copytree(straight["workdir"], workdir)
  for step in (2, 4, 6):  # as a run before this change wrote them
    path = os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")
    with open(path) as f:
      meta = json.load(f)
    del meta["digests"]
    with open(path, "w") as f:
      json.dump(meta, f)
  ck = ckpt_lib.RunCheckpoints(workdir, async_save=False)
  with caplog.at_level(logging.WARNING):
    step, state, _ = ck.restore_newest(*spec)
    ckpt_lib.restore_run_params(workdir, shd.make_mesh(1, 1))
  ck.close()
  assert step == STEPS
  chex.assert_trees_all_equal(jax.device_get(state), straight["state"][0])
  notes = [r.getMessage() for r in caplog.records
           if "written before checkpoints recorded digests: it loads unverified" in r.getMessage()]
  assert len(notes) == 1, notes  # once, however many reads


def test_a_non_finite_state_is_never_saved(tmp_path):
  ck = ckpt_lib.RunCheckpoints(str(tmp_path), async_save=False)
  ck.save(1, {"w": np.ones(3, np.float32)}, {"step": 1})
  with pytest.raises(failures.Diverged, match=r"^training diverged: the train state has non-finite "
                     r"values at step 2, so it was not saved; intact checkpoints: 1 \(a rerun "
                     r"resumes from step 1\); lower the learning rate"):
    ck.save(2, {"w": np.array([1.0, np.nan, 0.0], np.float32)}, {"step": 2})
  ck.close()
  assert ckpt_lib.checkpoint_steps(str(tmp_path)) == [1]
