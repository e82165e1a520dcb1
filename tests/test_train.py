"""End-to-end training: a real step on tfds mock data, loss falls, device-count invariance,
resume equivalence after a simulated preemption, non-finite stop, config validation."""

import glob
import importlib.util
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from decay_jax import sharding as shd
from decay_jax.data import augment, pipeline
from decay_jax.evals import registry
from decay_jax.train import failures, optim, trainer
from decay_jax.train import setup
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import config as config_lib
from decay_jax.train import step as step_lib
from decay_jax.train import tasks
from testing_configs import load_config, override

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**overrides):
  """The CPU config shrunk to the 'micro' model on 16-pixel digits: seconds per run."""
  c = load_config("mae_cpu_mnist")
  c.model.preset = "micro/4"
  c.data.image_size = 16
  c.batch_size = 16
  c.num_train_steps = 6
  c.warmup_epochs = 0.0
  c.log_every_steps = 1
  c.picture_every_steps = 0
  c.checkpoint.every_steps = 3
  c.checkpoint.async_save = False
  c.evals.knn.enabled = False
  c.evals.rank.enabled = False  # covered by tests/test_evaluate.py
  c.mesh.data = 1
  return override(c, **overrides)


def restore_params(workdir, config):
  info, model, mesh = setup.check_config(config)
  task = setup.make_task(config, model, info)
  total, warm = config_lib.steps_for(config, info["num_train"])
  tx, _ = optim.make_optimizer(config.optim, config.batch_size, total, warm)
  abstract = step_lib.abstract_state(task, tx, config.seed, config.ema_decay > 0)
  shardings = step_lib.state_shardings(abstract, tx, mesh)
  ck = ckpt_lib.RunCheckpoints(workdir)
  state, meta = ck.restore(ck.latest_step(), abstract, shardings)
  ck.close()
  return jax.device_get(state), meta


def test_one_real_step_on_tfds_mock_data(tmp_path):
  c = tiny_config(**{"data.dataset": "cifar10", "data.normalize": "imagenet",
                     "data.eval_split": "test", "num_train_steps": 1, "picture_every_steps": 1,
                     "evals.knn.enabled": True, "evals.knn.max_train_examples": 32,
                     "evals.knn.max_eval_examples": 16, "evals.knn.batch_size": 16})
  with tfds.testing.mock_data(num_examples=64):
    res = trainer.train_and_evaluate(c, str(tmp_path), evaluators=registry.build)
  assert res["step"] == 1 and np.isfinite(res["loss"]) and res["loss"] > 0
  assert 0.0 <= res["knn/top1"] <= 1.0
  assert os.path.exists(tmp_path / "pictures" / "step_0000001.png")
  assert os.path.isdir(tmp_path / "checkpoints" / "1")
  assert glob.glob(str(tmp_path / "events.out.tfevents.*"))


def test_loss_falls_on_embedded_data(tmp_path):
  # Plain pixel loss: with norm-pix, MNIST's blank patches have no target and the curve is noisy.
  c = tiny_config(num_train_steps=40, log_every_steps=1, batch_size=32,
                  **{"checkpoint.every_steps": 40, "model.norm_pix_loss": False})
  trainer.train_and_evaluate(c, str(tmp_path), evaluators=registry.build)
  from tensorboard.backend.event_processing import event_accumulator
  ev = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
  ev.Reload()
  loss = [float(tf_tensor_value(e)) for e in ev.Tensors("loss")]
  assert len(loss) == 40
  # Zero-initialised predictions start at the second moment of the masked pixels (mostly -1).
  assert loss[0] > 0.5, loss
  assert np.mean(loss[-10:]) < 0.7 * loss[0], loss  # measured: 0.83 -> 0.52


def tf_tensor_value(event):
  import tensorflow as tf
  return tf.make_ndarray(event.tensor_proto)


@pytest.mark.parametrize("data,fsdp", [(8, 1), (4, 2)])
def test_device_count_does_not_change_training(tmp_path, data, fsdp):
  one = tiny_config(num_train_steps=3, **{"checkpoint.every_steps": 3})
  many = tiny_config(num_train_steps=3, **{"checkpoint.every_steps": 3, "mesh.data": data,
                                           "mesh.fsdp": fsdp})
  r1 = trainer.train_and_evaluate(one, str(tmp_path / "one"), evaluators=registry.build)
  r8 = trainer.train_and_evaluate(many, str(tmp_path / "many"), evaluators=registry.build)
  # float32 sums are reduced in a different order across devices: agree to ~1e-6 relative.
  np.testing.assert_allclose(r8["loss"], r1["loss"], rtol=1e-5)
  p1, _ = restore_params(str(tmp_path / "one"), one)
  p8, _ = restore_params(str(tmp_path / "many"), one)  # restored onto 1 device
  chex.assert_trees_all_close(p8["params"], p1["params"], atol=2e-6, rtol=1e-5)


def test_resume_after_preemption_equals_uninterrupted(tmp_path, monkeypatch):
  c = tiny_config(num_train_steps=6, **{"checkpoint.every_steps": 100})
  trainer.train_and_evaluate(c, str(tmp_path / "straight"), evaluators=registry.build)
  original = trainer._Preemption.reached
  monkeypatch.setattr(trainer._Preemption, "reached", lambda self, step: step == 3)
  res = trainer.train_and_evaluate(c, str(tmp_path / "resumed"), evaluators=registry.build)
  assert res["preempted"] and res["step"] == 3
  monkeypatch.setattr(trainer._Preemption, "reached", original)
  res = trainer.train_and_evaluate(c, str(tmp_path / "resumed"), evaluators=registry.build)
  assert not res["preempted"] and res["step"] == 6
  a, meta_a = restore_params(str(tmp_path / "straight"), c)
  b, meta_b = restore_params(str(tmp_path / "resumed"), c)
  assert meta_a["examples_seen"] == meta_b["examples_seen"] == 6 * 16
  chex.assert_trees_all_equal(b, a)  # bit for bit: same masks, data order and augmentation


def test_non_finite_loss_stops_with_the_last_good_checkpoint(tmp_path):
  c = tiny_config(num_train_steps=30, **{"optim.lr": 1e12, "checkpoint.every_steps": 1})
  with pytest.raises(failures.Diverged) as e:
    trainer.train_and_evaluate(c, str(tmp_path), evaluators=registry.build)
  state, meta = restore_params(str(tmp_path), c)
  assert all(np.isfinite(l).all() for l in jax.tree_util.tree_leaves(state["params"]))
  assert meta["step"] >= 1
  # One line naming the step and the newest checkpoint, which is finite (a non-finite state is
  # never saved: the loss, the gradient or the saved state's digest pass stops first).
  text = str(e.value)
  assert "\n" not in text and text.startswith("training diverged: "), text
  assert (f"non-finite loss/gradient at step {meta['step'] + 1} " in text
          or f"non-finite values at step {meta['step'] + 1}, so it was not saved" in text), text
  assert (f"the newest checkpoint is step {meta['step']}, finite (a rerun resumes from it)" in text
          or "intact checkpoints: " in text), text
  assert e.value.status == 3


def config_files():
  return sorted(glob.glob(os.path.join(REPO, "configs", "*.py"))
                + glob.glob(os.path.join(REPO, "research", "*", "config.py")))


@pytest.mark.parametrize("path", config_files(), ids=os.path.basename)
def test_every_config_builds_and_initialises_abstractly(path):
  spec = importlib.util.spec_from_file_location("cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  assert mod.__doc__ and "Command" in mod.__doc__ and "Expected" in mod.__doc__
  config_lib.validate(c)
  channels = 1 if "mnist" in path else 4 if c.data.dataset.startswith("latents:") else 3
  info = {"image_size": c.data.image_size, "channels": channels, "num_train": 1_281_167,
          "num_classes": 10 if "mnist" in path else 1000}
  model = tasks.build_model(c, info)
  mesh = shd.make_mesh(c.mesh.data, c.mesh.fsdp)
  shd.check_batch(c.batch_size, mesh, c.accum_steps)
  task = setup.make_task(c, model, info)
  total, warm = config_lib.steps_for(c, info["num_train"])
  tx, sched = task.make_optimizer(c, total, warm)
  abstract = step_lib.abstract_state(task, tx, c.seed, c.ema_decay > 0)
  step_lib.state_shardings(abstract, tx, mesh)
  n = sum(int(np.prod(l.shape)) for l in jax.tree_util.tree_leaves(abstract["params"]))
  assert n > 0 and float(sched(warm)) == pytest.approx(optim.peak_lr(c.optim, c.batch_size))


@pytest.mark.parametrize("overrides,match", [
    ({"data.image_size": 18}, "data.image_size=18 is not allowed; it must be a multiple of the patch size 4"),
    ({"model.mask_ratio": 1.0}, r"model.mask_ratio=1.0 is not allowed; it must be in \[0, 1\)"),
    ({"model.alpha_min": 1.2}, r"model.alpha_min=1.2 is not allowed; it must be a number in \(0, 1\]"),
    ({"batch_size": 12, "mesh.data": 8}, "batch_size=12 is not allowed; it must be divisible by the device count 8"),
    ({"data.dataset": "no_such_dataset"}, "dataset='no_such_dataset'"),
    ({"model.dtype": "float64"}, "model.dtype='float64' is not allowed"),
    ({"mesh.fsdp": 3}, "mesh.fsdp=3 is not allowed"),
])
def test_bad_configs_fail_before_compiling(overrides, match):
  with pytest.raises(ValueError, match=match):
    setup.check_config(tiny_config(**overrides))


def test_command_line_reports_bad_override_in_one_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "decay_jax.cli.train", "--config=configs/mae_cpu_mnist.py",
         f"--workdir={tmp_path}", "--config.model.alpha_min=1.5"]
  p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert p.returncode == 2
  assert p.stderr.strip().splitlines()[-1] == (
      "error: model.alpha_min=1.5 is not allowed; it must be a number in (0, 1]")
  typo = cmd[:-1] + ["--config.model.alpha_mn=0.5"]
  p = subprocess.run(typo, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert p.returncode != 0 and "alpha_mn" in p.stderr
  assert not os.path.exists(tmp_path / "checkpoints")


def test_weight_decay_mask_and_lr_schedule():
  from decay_jax.models import mae as mae_lib
  m = mae_lib.mae("micro/4")
  shapes = jax.eval_shape(m.init, jax.random.key(0), jnp.zeros((1, 16, 16, 3)), jnp.zeros((1, 16)))
  mask = optim.weight_decay_mask(shapes["params"])
  assert mask["cls_token"] and mask["decoder_cls_token"] and mask["skip_0"]["mask_token"]
  assert mask["blocks"]["attn"]["qkv"]["kernel"] and not mask["blocks"]["attn"]["qkv"]["bias"]
  assert not mask["blocks"]["norm1"]["scale"]  # (depth, C) stacked LayerNorm scale: rank 1
  assert not mask["decoder_norm"]["scale"] and mask["patch_embed"]["proj"]["kernel"]
  c = config_lib.mae_config()
  sched = optim.lr_schedule(c.optim, 8192, total_steps=1000, warmup_steps=100)
  peak = 1.5e-4 * 8192 / 256
  assert float(sched(0)) == 0.0
  assert float(sched(50)) == pytest.approx(peak * 0.5)
  assert float(sched(100)) == pytest.approx(peak)
  assert float(sched(550)) == pytest.approx(peak * 0.5, rel=1e-5)
  assert float(sched(1000)) == pytest.approx(0.0, abs=1e-9)


def test_fsdp_rule():
  assert shd.fsdp_spec((768, 2304), 4) == jax.sharding.PartitionSpec(None, "fsdp")
  assert shd.fsdp_spec((12, 768, 3072), 8) == jax.sharding.PartitionSpec(None, None, "fsdp")
  assert shd.fsdp_spec((768,), 8) == jax.sharding.PartitionSpec()  # too small
  assert shd.fsdp_spec((1000, 1001), 8) == jax.sharding.PartitionSpec("fsdp", None)


def test_uint8_step_equals_the_step_on_host_normalised_images():
  # uint8 on the wire: the step normalises on the device; its numbers stay those of the old path,
  # which shipped host-normalised float32 (augment.normalize_uint8), to 1e-6.
  config = tiny_config()
  config.data.normalize = "half"
  info, model, mesh = setup.check_config(config)
  task = setup.make_task(config, model, info)
  tx, schedule = task.make_optimizer(config, 10, 2)
  step = jax.jit(step_lib.make_train_step(task, tx, schedule))
  state = step_lib.init_state(task, tx, config.seed)
  pixels = next(pipeline.make_train_iterator(config.data, config.batch_size, config.seed))
  assert pixels["image"].dtype == np.uint8
  host = dict(pixels, image=augment.normalize_uint8(pixels["image"], "half"))
  new_u8, m_u8 = step(state, pixels)
  new_f32, m_f32 = step(state, host)
  assert abs(float(m_u8["loss"])) > 1e-3
  for key in ("loss", "grad_norm", "update_norm"):
    np.testing.assert_allclose(float(m_u8[key]), float(m_f32[key]), rtol=1e-6, atol=0)
  chex.assert_trees_all_close(new_u8["params"], new_f32["params"], atol=1e-6, rtol=0)
