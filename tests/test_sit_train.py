"""SiT training end to end: a real step on tfds mock data, EMA exactness, resume with the EMA,
device-count invariance, classifier-free guidance at scale 1, and the sample command."""

import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import tensorflow_datasets as tfds

from decay_jax.train import checkpoint
from decay_jax.diffusion import samplers
from decay_jax.train import config as config_lib
from decay_jax.train import optim, step as step_lib, trainer
from decay_jax.train import setup
from testing_configs import load_config, override

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_sit_config(**overrides):
  c = load_config("sit_cpu_mnist")
  c.model.preset = "micro/4"
  c.data.image_size = 16
  c.batch_size = 16
  c.num_train_steps = 6
  c.log_every_steps = 1
  c.picture_every_steps = 0
  c.checkpoint.every_steps = 100
  c.checkpoint.async_save = False
  c.ema_decay = 0.9
  c.mesh.data = 1
  c.sample.num_steps = 4
  c.sample.grid_size = 4
  return override(c, **overrides)


def restore_state(workdir, config):
  info, model, mesh = setup.check_config(config)
  task = setup.make_task(config, model, info)
  total, warm = config_lib.steps_for(config, info["num_train"])
  tx, _ = optim.make_optimizer(config.optim, config.batch_size, total, warm)
  abstract = step_lib.abstract_state(task, tx, config.seed, True)
  ck = checkpoint.RunCheckpoints(workdir)
  state, _ = ck.restore(ck.latest_step(), abstract, step_lib.state_shardings(abstract, tx, mesh))
  ck.close()
  return jax.device_get(state)


def test_one_real_step_on_tfds_mock_data_with_sample_grid(tmp_path):
  c = tiny_sit_config(**{"data.dataset": "mnist", "num_train_steps": 1,
                         "picture_every_steps": 1, "checkpoint.every_steps": 1})
  with tfds.testing.mock_data(num_examples=32):
    res = trainer.train_and_evaluate(c, str(tmp_path))
  assert res["step"] == 1 and np.isfinite(res["loss"]) and res["loss"] > 0.5
  assert res["loss_v"] == res["loss"]  # the flow loss alone (no REPA term here)
  assert os.path.exists(tmp_path / "pictures" / "step_0000001.png")
  # A finished run called again returns the loss terms its last checkpoint recorded.
  with tfds.testing.mock_data(num_examples=32):
    again = trainer.train_and_evaluate(c, str(tmp_path))
  assert (again["step"], again["loss"], again["loss_v"]) == (1, res["loss"], res["loss_v"])
  state = restore_state(str(tmp_path), c)
  assert "ema" in state and state["step"] == 1


def test_ema_update_is_exact():
  c = tiny_sit_config()
  info, model, mesh = setup.check_config(c)
  task = setup.make_task(c, model, info)
  tx, sched = optim.make_optimizer(c.optim, c.batch_size, 10, 0)
  state = step_lib.init_state(task, tx, 0, ema=True)
  chex.assert_trees_all_equal(state["ema"], state["params"])  # an exact copy at step 0
  rng = np.random.default_rng(0)
  batch = {"image": jnp.asarray(rng.standard_normal((16, 16, 16, 1)), jnp.float32),
           "label": jnp.asarray(rng.integers(0, 10, 16), jnp.int32)}
  step = jax.jit(step_lib.make_train_step(task, tx, sched, 1, 0.9))
  s1, _ = step(state, batch)
  s2, _ = step(s1, batch)
  p0, p1, p2 = (jax.device_get(s["params"]) for s in (state, s1, s2))
  want = jax.tree_util.tree_map(lambda a, b, c: (a * 0.9 + b * 0.1) * 0.9 + c * 0.1, p0, p1, p2)
  chex.assert_trees_all_close(jax.device_get(s2["ema"]), want, atol=0, rtol=1e-6)
  assert any(float(jnp.abs(a - b).max()) > 0 for a, b in zip(
      jax.tree_util.tree_leaves(s2["ema"]), jax.tree_util.tree_leaves(s2["params"])))


def test_resume_with_ema_equals_uninterrupted(tmp_path, monkeypatch):
  c = tiny_sit_config()
  trainer.train_and_evaluate(c, str(tmp_path / "straight"))
  original = trainer._Preemption.reached
  monkeypatch.setattr(trainer._Preemption, "reached", lambda self, step: step == 2)
  assert trainer.train_and_evaluate(c, str(tmp_path / "resumed"))["preempted"]
  monkeypatch.setattr(trainer._Preemption, "reached", original)
  trainer.train_and_evaluate(c, str(tmp_path / "resumed"))
  chex.assert_trees_all_equal(restore_state(str(tmp_path / "resumed"), c),
                              restore_state(str(tmp_path / "straight"), c))


def test_eight_devices_equal_one(tmp_path):
  one = tiny_sit_config(num_train_steps=3)
  many = tiny_sit_config(num_train_steps=3, **{"mesh.data": 8})
  r1 = trainer.train_and_evaluate(one, str(tmp_path / "one"))
  r8 = trainer.train_and_evaluate(many, str(tmp_path / "many"))
  np.testing.assert_allclose(r8["loss"], r1["loss"], rtol=1e-5)
  a, b = restore_state(str(tmp_path / "one"), one), restore_state(str(tmp_path / "many"), one)
  chex.assert_trees_all_close(b["ema"], a["ema"], atol=2e-6, rtol=1e-5)


def test_guidance_scale_one_is_the_conditional_model():
  c = tiny_sit_config()
  info, model, _ = setup.check_config(c)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((4, 16, 16, 1)), jnp.float32)
  t = jnp.asarray(rng.random(4), jnp.float32)
  y = jnp.asarray([0, 3, 5, 9])
  params = jax.jit(model.init)(jax.random.key(0), x, t, y)["params"]
  params = jax.tree_util.tree_map(lambda p: p + 0.05, params)
  fn = lambda x, t, y: model.apply({"params": params}, x, t, y)
  guided = jax.jit(lambda s: samplers.cfg_model_fn(fn, s, model.num_classes, channels=None)(x, t, y))
  # Same math as the conditional model; the doubled batch is another XLA program: 1e-5 relative.
  np.testing.assert_allclose(np.asarray(guided(jnp.float32(1.0))), np.asarray(fn(x, t, y)),
                             rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(guided(jnp.float32(3.0)) - fn(x, t, y)).max()) > 1e-4


def test_sample_command(tmp_path):
  c = tiny_sit_config(num_train_steps=2)
  trainer.train_and_evaluate(c, str(tmp_path))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  outs = []
  for batch in ("8", "16"):
    out = tmp_path / f"s{batch}"
    p = subprocess.run([sys.executable, "-m", "decay_jax.cli.sample", f"--workdir={tmp_path}",
                        "--num=12", f"--batch_size={batch}", "--steps=3", "--method=euler",
                        f"--out={out}"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    d = np.load(out / "samples.npz")
    assert d["arr_0"].shape == (12, 16, 16, 3) and d["arr_0"].dtype == np.uint8
    assert os.path.getsize(out / "grid.png") > 1000
    outs.append(d["arr_0"])
  np.testing.assert_array_equal(outs[0], outs[1])  # per-example seeds: batch size does not matter
  p = subprocess.run([sys.executable, "-m", "decay_jax.cli.sample", f"--workdir={tmp_path}",
                      "--method=rk4"], cwd=REPO, env=env, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 2 and "method='rk4' is not allowed" in p.stderr
