"""U-ViT as the trainer's third diffusion task: a real run of the CPU config (shrunk), its loss and
optimiser against U-ViT's recipe, then the sample and evaluate commands on the run (the
diffusion-feature probe); conditional training with label dropout; one-line errors."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.diffusion import vp
from decay_jax.evals import diffusion_probe
from decay_jax.train import config as config_lib
from decay_jax.train import optim, trainer
from decay_jax.train import setup
from testing_configs import load_config, override
from xla_env import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(**overrides):
  """The CPU config on 16-pixel digits: 16 patch tokens + time, 6 steps."""
  c = load_config("uvit_cpu_mnist")
  return override(c, **dict({
      "data.image_size": 16, "batch_size": 16, "num_train_steps": 6, "warmup_steps": 2,
      "log_every_steps": 2, "picture_every_steps": 6, "checkpoint.every_steps": 6,
      "checkpoint.async_save": False, "mesh.data": 1, "tensorboard": False,
      "sample.num_steps": 6, "sample.grid_size": 4,
      "evals.knn.max_train_examples": 512, "evals.knn.max_eval_examples": 256,
      "evals.layers.max_train_examples": 512, "evals.layers.max_eval_examples": 256,
      "evals.layers.probe_epochs": 2, "evals.layers.probe_batch_size": 64}, **overrides))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("uvit") / "run")
  results = trainer.train_and_evaluate(tiny(), workdir)
  return workdir, results


def test_training_runs_and_keeps_the_recipe(run):
  workdir, results = run
  assert results["step"] == 6 and np.isfinite(results["loss"])
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  losses = [r["loss"] for r in rows if "loss" in r]
  # eps-prediction starts near E[eps^2] = 1 (zero-initialised branches, small output init)
  assert 0.3 < losses[0] < 3.0
  lrs = [r["lr"] for r in rows if "lr" in r]
  # U-ViT's LambdaLR min(s / W, 1) with W = 2: lr 0, peak / 2, then the peak; each logged value
  # is the mean over the two steps since the last log
  peak = tiny().optim.lr
  assert lrs == pytest.approx([peak / 4, peak, peak], rel=1e-6)
  assert any(f.endswith(".png") for f in os.listdir(os.path.join(workdir, "pictures")))
  saved = json.load(open(os.path.join(workdir, "config.json")))
  assert saved["task"] == "uvit" and saved["model"]["alpha_min"] == 0.7


def test_loss_is_the_noise_prediction_error_at_the_drawn_times():
  # The task's loss equals U-ViT's LSimple computed by hand from the prepared draws.
  config = tiny()
  info, model, _ = setup.check_config(config)
  task = setup.make_task(config, model, info)
  params = jax.jit(lambda: model.init(jax.random.key(0), *task.init_inputs(1))["params"])()
  params = jax.tree_util.tree_map(  # live branches: zero-initialised kernels made random
      lambda p: p + 0.02 * jax.random.normal(jax.random.key(p.size), p.shape), params)
  x0 = jax.random.uniform(jax.random.key(1), (8, 16, 16, 1), minval=-1, maxval=1)
  batch = task.prepare({"image": x0, "label": jnp.arange(8)}, jax.random.key(2))
  loss, metrics = jax.jit(task.loss)(params, batch)
  t, eps = np.asarray(batch["t"], np.float64), np.asarray(batch["eps"], np.float64)
  assert ((0 <= t) & (t < 1)).all() and abs(eps.std() - 1) < 0.1
  ab = np.exp(-(0.1 * t + 9.95 * t ** 2))[:, None, None, None]  # spec 3.3
  x_t = np.sqrt(ab) * np.asarray(x0) + np.sqrt(1 - ab) * eps
  eps_hat = np.asarray(model.apply({"params": params}, jnp.asarray(x_t, jnp.float32),
                                   jnp.asarray(999 * t, jnp.float32)), np.float64)
  want = ((eps - eps_hat) ** 2).mean(axis=(1, 2, 3)).mean()
  assert float(loss) == pytest.approx(want, rel=1e-5)
  assert float(metrics["loss"]) == float(loss)


def test_optimiser_decays_every_parameter_as_torch_adamw():
  config = tiny()
  info, model, _ = setup.check_config(config)
  task = setup.make_task(config, model, info)
  tx, schedule = task.make_optimizer(config, 100, 10)
  peak = config.optim.lr
  assert [float(schedule(s)) for s in (0, 5, 10, 50)] == pytest.approx([0, peak / 2, peak, peak])
  # With a zero gradient AdamW's update is only the decay -lr * wd * p, on biases and norms too.
  params = {"bias": jnp.ones((3,)), "kernel": jnp.ones((2, 3))}
  state = tx.init(params)
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  for _ in range(6):
    updates, state = tx.update(zeros, state, params)
  for leaf in jax.tree_util.tree_leaves(updates):
    np.testing.assert_allclose(leaf, -peak / 2 * 0.03, rtol=1e-6)  # step 5: lr peak / 2, wd 0.03
  masked = optim.make_optimizer(config_lib.mae_config().optim, 256, 100, 10)[0]
  updates, _ = masked.update(zeros, masked.init(params), params)
  assert float(jnp.abs(updates["bias"]).max()) == 0.0  # MAE's groups: no decay on rank-1


def test_sample_command_on_the_run(run):
  workdir, _ = run
  out = os.path.join(workdir, "samples_cli")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2))
  for extra in (["--steps=6"], ["--mode=sde", "--method=euler", "--steps=4"]):
    proc = subprocess.run(
        [sys.executable, "-m", "decay_jax.cli.sample", f"--workdir={workdir}", "--num=6",
         "--batch_size=4", f"--out={out}", *extra], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(os.path.join(out, "samples.npz")) as d:
      assert d["arr_0"].shape == (6, 16, 16, 3) and d["arr_0"].dtype == np.uint8
      assert d["arr_0"].std() > 0
    info = json.load(open(os.path.join(out, "info.json")))
    assert info["sampler"]["mode"] == ("sde" if "--mode=sde" in extra else "dpm")
  proc = subprocess.run(
      [sys.executable, "-m", "decay_jax.cli.sample", f"--workdir={workdir}", "--cfg_channels=1"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1] == "error: --cfg_channels is not allowed for a uvit run"


def test_conditional_model_drops_labels_to_the_null_class_and_guides():
  config = tiny(**{"model.conditional": True, "diffusion.class_dropout_prob": 0.5,
                   "sample.cfg_scale": 0.4})
  info, model, _ = setup.check_config(config)
  task = setup.make_task(config, model, info)
  assert model.num_classes == 11 and task.null_label == 10 and task.num_labels == 10
  labels = jnp.arange(400) % 10
  batch = task.prepare({"image": jnp.zeros((400, 16, 16, 1)), "label": labels}, jax.random.key(3))
  dropped = np.asarray(batch["y"] == 10)
  assert 0.4 < dropped.mean() < 0.6
  np.testing.assert_array_equal(np.asarray(batch["y"])[~dropped], np.asarray(labels)[~dropped])
  params = jax.jit(lambda: model.init(jax.random.key(0), *task.init_inputs(1))["params"])()
  params = jax.tree_util.tree_map(
      lambda p: p + 0.05 * jax.random.normal(jax.random.key(p.size), p.shape), params)
  noise = jax.random.normal(jax.random.key(4), (2, 16, 16, 1))
  sample = jax.jit(lambda p, y: task.sample(p, noise, y, None))
  a, b = sample(params, jnp.array([1, 1])), sample(params, jnp.array([7, 7]))
  assert np.isfinite(np.asarray(a)).all() and float(jnp.abs(a - b).max()) > 1e-4  # labels matter


@pytest.mark.parametrize("overrides,match", [
    ({"diffusion.class_dropout_prob": 0.1},
     "diffusion.class_dropout_prob=0.1 is not allowed; an unconditional model"),
    ({"diffusion.schedule": "cosine"}, "diffusion.schedule='cosine' is not allowed"),
    ({"sample.method": "heun"}, "sample.method='heun' is not allowed"),
    ({"diffusion.schedule": "discrete", "sample.mode": "sde", "sample.method": "euler"},
     "sample.mode='sde' is not allowed; the Euler samplers need diffusion.schedule='vpsde'"),
    ({"model.skip_mode": "sum"}, "model.skip_mode='sum' is not allowed"),
])
def test_bad_settings_fail_in_one_line_before_compiling(overrides, match):
  with pytest.raises(ValueError, match=match):
    setup.check_config(tiny(**overrides))


def test_discrete_schedule_trains_on_integer_steps():
  config = tiny(**{"diffusion.schedule": "discrete", "sample.method": "pp"})
  info, model, _ = setup.check_config(config)
  task = setup.make_task(config, model, info)
  assert isinstance(task.schedule, vp.DiscreteVP)
  batch = task.prepare({"image": jnp.zeros((64, 16, 16, 1)), "label": jnp.zeros(64, jnp.int32)},
                       jax.random.key(0))
  n = np.asarray(batch["t"])
  assert n.dtype == np.int32 and n.min() >= 1 and n.max() <= 1000


def test_probe_features_are_the_noised_block_outputs_of_each_image():
  config = tiny()
  info, model, _ = setup.check_config(config)
  probe = diffusion_probe.probed(model, 0.1)
  params = jax.jit(lambda: model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 1)),
                                      jnp.zeros((1,)))["params"])()
  params = jax.tree_util.tree_map(
      lambda p: p + 0.05 * jax.random.normal(jax.random.key(p.size), p.shape), params)
  images = jax.random.uniform(jax.random.key(5), (5, 16, 16, 1), minval=-1, maxval=1)
  feats = jax.jit(lambda p, x: probe.apply({"params": p}, x, method=probe.features))
  out = feats(params, images)
  assert out.shape == (7, 5, 16, 128)  # 3 in + mid + 3 out blocks, 16 patch tokens, width 128
  # an image's features do not depend on its batch or position
  np.testing.assert_allclose(feats(params, images[::-1])[:, ::-1], out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(feats(params, images[2:3])[:, 0], out[:, 2], rtol=1e-5, atol=1e-5)
  # = the blocks of sqrt(ab) x + sqrt(1 - ab) eps at network time 99.9, time token dropped
  eps = jax.vmap(lambda k: jax.random.normal(k, (16, 16, 1)))(
      diffusion_probe.fingerprint_keys(images))
  assert abs(float(eps.std()) - 1) < 0.15 and float(jnp.abs(eps[0] - eps[1]).max()) > 0.5
  ab = np.exp(-(0.1 * 0.1 + 9.95 * 0.01))
  x_t = np.sqrt(ab) * images + np.sqrt(1 - ab) * eps
  want = model.apply({"params": params}, x_t, jnp.full((5,), 99.9), method=model.block_outputs)
  np.testing.assert_allclose(out, want[:, :, 1:], rtol=1e-5, atol=1e-5)
  # a discrete-schedule run is read at its step n = round(1000 t_p) = 100, network time 100
  discrete = diffusion_probe.probed(model, 0.1, schedule="discrete")
  got = jax.jit(lambda p, x: discrete.apply({"params": p}, x, method=discrete.features))(params,
                                                                                          images)
  ab = float(vp.DiscreteVP().alpha_bar(100))
  x_t = np.sqrt(ab) * images + np.sqrt(1 - ab) * eps
  want = model.apply({"params": params}, x_t, jnp.full((5,), 100.0), method=model.block_outputs)
  np.testing.assert_allclose(got, want[:, :, 1:], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="probe_t=1.5 is not allowed"):
    diffusion_probe.probed(model, 1.5)


def test_probe_of_uint8_pixels_equals_the_probe_of_host_normalised_images():
  """The evaluators hand the probe uint8 pixels, normalised inside its compiled function: the
  noise keys (from the pixels' float values) and the features are those of the float32 images
  the host used to normalise."""
  from decay_jax.data import pipeline
  from decay_jax.evals import features
  config = tiny()
  _, model, _ = setup.check_config(config)
  probe = diffusion_probe.probed(model, 0.1)
  params = jax.jit(lambda: model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 1)),
                                      jnp.zeros((1,)))["params"])()
  pixels = np.asarray(jax.random.randint(jax.random.key(6), (4, 16, 16, 1), 0, 256), np.uint8)
  host = pipeline.normalize_uint8(pixels, config.data.normalize)  # 'half': [-1, 1]
  apply = lambda p, x: probe.apply({"params": p}, x, method=probe.features)
  want = np.asarray(jax.jit(apply)(params, host))
  got = np.asarray(jax.jit(features.on_pixels(apply, config.data))(params, pixels))
  scale = float(np.abs(want).max())
  assert want.shape == (7, 4, 16, 128) and scale > 0.1
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * scale)
  keys = lambda x: jax.random.key_data(diffusion_probe.fingerprint_keys(x))
  np.testing.assert_array_equal(
      jax.jit(lambda x: keys(features.on_pixels(lambda _, y: y, config.data)(None, x)))(pixels),
      keys(jnp.asarray(host)))


def test_evaluate_command_probes_the_run(run):
  workdir, _ = run
  out = os.path.join(workdir, "evaluation")
  proc = subprocess.run(
      [sys.executable, "-m", "decay_jax.cli.evaluate", f"--workdir={workdir}", "--evals=knn,layers",
       f"--out={out}"], cwd=REPO, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2)))
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.load(open(os.path.join(out, "evaluation.json")))["models"][0]
  s = record["sections"]
  assert 0.1 < s["knn"]["top1"] <= 1.0 and s["knn"]["num_train"] == 512  # chance is 0.1
  lay = s["layers"]
  assert len(lay["knn_top1"]) == 7 and lay["knn"]["last"] == lay["knn_top1"][-1]
  chosen = lay["selected"]["knn"]  # the block picked on 10% of the training digits
  assert lay["num_heldout"] == 51 and chosen["test"] == lay["knn_top1"][chosen["block"]]
  assert record["model"]["alpha_min"] == 0.7 and len(record["model"]["alphas"]) == 7
  proc = subprocess.run(
      [sys.executable, "-m", "decay_jax.cli.evaluate", f"--workdir={workdir}", "--evals=rank",
       f"--out={out}"], cwd=REPO, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
      "is a U-ViT run: its evaluators are knn, linear and layers (--evals=knn,linear,layers)")
