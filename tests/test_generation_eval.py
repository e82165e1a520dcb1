"""The periodic generation evaluation (``decay_jax.evals.generation_eval``): a run through the
trainer logs every metric at the expected steps, its numbers equal ``cli.sample --sampler=eval`` +
``cli.fid`` on the same samples (same seed), and bad config values are one-line errors.

The FID Inception is a stand-in with the same outputs at a few dimensions (a subclass, so the
type checks pass): the real graph compiles for about a minute on CPU and its 2048-d Frechet
distance costs ~9 s on one core; its maths are tested in test_generation_metrics.py and
test_inception_fid.py. One training run (tiny SiT, 4 steps) serves the first two tests.
"""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.cli import fid
from decay_jax.evals import generation_eval, registry
from decay_jax.evals.generation_eval import GenerationEvaluator
from decay_jax.models import inception as inception_lib
from decay_jax.train import checkpoint, trainer, writers
from decay_jax.train.tasks.sit import SiTTask
from decay_jax.train.tasks.uvit import UViTTask
from test_sit_train import tiny_sit_config
from testing_configs import REPO, load_config, override
from xla_env import xla_flags

METRICS = generation_eval.METRICS
NUM, CHUNK, FEATURE_BATCH = 12, 4, 8


class TinyInception(inception_lib.FIDInceptionV3):
  """The FID Inception's outputs (pool, spatial, logits) from one strided conv: 16, 128 and 10
  dims on 16-pixel images."""

  @nn.compact
  def __call__(self, images):
    x = jnp.tanh(nn.Conv(8, (3, 3), strides=(2, 2))(2.0 * images.astype(jnp.float32) - 1.0))
    pool = nn.Dense(16)(x.mean(axis=(1, 2)))
    return {"pool": pool, "spatial": x[..., :2].reshape(x.shape[0], -1),
            "logits": nn.Dense(10)(pool)}


TINY = TinyInception()
TINY_PARAMS = TINY.init(jax.random.key(3), jnp.zeros((1, 16, 16, 3)))["params"]


def inputs(root):
  """A reference batch (ADM layout: arr_0 only, 24 images) and an Inception directory."""
  ref = os.path.join(root, "ref.npz")
  np.savez(ref, arr_0=np.random.default_rng(5).integers(0, 256, (24, 16, 16, 3), np.uint8))
  inception = os.path.join(root, "inception")
  os.makedirs(inception, exist_ok=True)
  with open(os.path.join(inception, "model.json"), "w") as f:
    f.write("{}")  # read by the stand-in loader below, never by checkpoint.load_params
  return ref, inception


def tiny_config(root, **overrides):
  """test_sit_train's tiny SiT (micro/4 on 16-pixel digits, one device), 4 steps, evaluated at
  steps 2 and 4."""
  c = tiny_sit_config(num_train_steps=4, log_every_steps=2)
  ref, inception = inputs(root)
  c.evals.generation.update(enabled=True, every_steps=2, num_samples=NUM, batch_size=CHUNK,
                            inception_batch_size=FEATURE_BATCH, ref=ref, inception=inception)
  c.evals.generation.sample.update(mode="sde", method="euler", num_steps=3)  # CFG 2.0 kept
  return override(c, **overrides)


def stand_in_loader(real):
  def load(directory, what="checkpoint"):
    if what == "inception":
      return TINY, TINY_PARAMS
    return real(directory, what)
  return load


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 4-step run evaluating at steps 2 and 4; the images each evaluation drew."""
  root = tmp_path_factory.mktemp("gen_eval")
  drawn = []
  real_draw = GenerationEvaluator.draw

  def draw(self, params):
    out = real_draw(self, params)
    drawn.append(out[0])
    return out

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(checkpoint, "load_params", stand_in_loader(checkpoint.load_params))
    mp.setattr(GenerationEvaluator, "draw", draw)
    workdir = str(root / "run")
    results = trainer.train_and_evaluate(tiny_config(str(root)), workdir,
                                         evaluators=registry.build)
  return dict(root=root, workdir=workdir, results=results, drawn=drawn)


def logged_rows(workdir):
  """The rows of metrics.jsonl that hold the generation metrics."""
  with open(os.path.join(workdir, writers.JSONL)) as f:
    return [r for r in map(json.loads, f) if "generation/fid" in r]


def test_trainer_logs_every_metric_at_the_expected_steps(run):
  logged = {r["step"]: r for r in logged_rows(run["workdir"])}
  assert sorted(logged) == [2, 4]
  for step, r in logged.items():
    for key in METRICS:
      assert np.isfinite(r[f"generation/{key}"]), (step, key)
    assert 0 <= r["generation/precision"] <= 1 and 0 <= r["generation/coverage"] <= 1
  assert run["results"]["generation/fid"] == logged[4]["generation/fid"]
  assert len(run["drawn"]) == 2 and run["drawn"][0].shape == (NUM, 16, 16, 3)
  assert run["drawn"][0].dtype == np.uint8
  assert not np.array_equal(run["drawn"][0], run["drawn"][1])  # two steps' weights, one seed


def test_numbers_equal_the_sample_and_fid_commands(run, monkeypatch, capsys):
  # The standalone path: `cli.sample --sampler=eval` on the final checkpoint (its EMA weights, on
  # 4 devices where training used 1), then `cli.fid` on its samples.npz.
  out = run["root"] / "samples"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4))
  p = subprocess.run([sys.executable, "-m", "decay_jax.cli.sample", f"--workdir={run['workdir']}",
                      f"--num={NUM}", "--sampler=eval", f"--out={out}", "--grid=0"], cwd=REPO,
                     env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  with np.load(out / "samples.npz") as f:
    np.testing.assert_array_equal(f["arr_0"], run["drawn"][-1])
  monkeypatch.setattr(fid, "_load_inception", lambda directory: (TINY, TINY_PARAMS))
  cfg = tiny_config(str(run["root"])).evals.generation
  metrics = run["root"] / "metrics.json"
  assert fid.main([f"--samples={out / 'samples.npz'}", f"--ref={cfg.ref}",
                   f"--inception={cfg.inception}", f"--batch_size={FEATURE_BATCH}",
                   f"--out={metrics}"]) == 0
  standalone = json.loads(metrics.read_text())
  last = logged_rows(run["workdir"])[-1]
  for key in METRICS:
    assert last[f"generation/{key}"] == pytest.approx(standalone[key], rel=1e-9, abs=1e-12), key
  assert standalone["num_samples"] == NUM and standalone["num_ref"] == 24


@pytest.mark.parametrize("overrides, message", [
    ({"evals.generation.ref": ""}, "evals.generation.ref is required when evals.generation"),
    ({"evals.generation.ref": "/nonexistent/ref.npz"},
     "evals.generation.ref='/nonexistent/ref.npz' is not allowed; no such file or folder"),
    ({"evals.generation.inception": ""}, "evals.generation.inception is required"),
    ({"evals.generation.num_samples": 5}, "evals.generation.num_samples=5 is not allowed"),
    ({"evals.generation.every_steps": -1}, "evals.generation.every_steps=-1 is not allowed"),
    ({"evals.generation.weights": "ema", "ema_decay": 0.0},
     "evals.generation.weights='ema' is not allowed; the run keeps no EMA"),
    ({"evals.generation.weights": "last"}, "evals.generation.weights='last' is not allowed"),
    ({"evals.generation.sample.method": "rk4"},
     "evals.generation.sample.method='rk4' is not allowed"),
    ({"evals.generation.sample.num_steps": 1},
     "evals.generation.sample.num_steps=1 is not allowed"),
    ({"evals.generation.vae": "/tmp"}, "evals.generation.vae='/tmp' is not allowed; the run "
                                       "trains on pixels"),
    ({"data.dataset": "latents:/tmp/none"}, "evals.generation.vae is required"),
])
def test_bad_config_values_are_one_line_errors(tmp_path, overrides, message):
  c = tiny_config(str(tmp_path), **overrides)
  with pytest.raises(ValueError) as e:
    registry.check_config(c, SiTTask)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_reference_and_inception_and_uvit_guidance(tmp_path):
  c = tiny_config(str(tmp_path))
  np.savez(tmp_path / "bad.npz", mu=np.zeros(4))
  with pytest.raises(ValueError, match=r"^evals.generation.ref: .*bad.npz: has mu but no sigma"):
    registry.check_config(override(c, **{"evals.generation.ref": str(tmp_path / "bad.npz")}),
                          SiTTask)
  c = tiny_config(str(tmp_path))
  os.remove(os.path.join(c.evals.generation.inception, "model.json"))
  with pytest.raises(ValueError, match="inception=.* is not allowed; it has no model.json"):
    registry.check_config(c, SiTTask)
  u = load_config("uvit_cpu_mnist")
  ref, inception = inputs(str(tmp_path))
  u.evals.generation.update(enabled=True, ref=ref, inception=inception)
  registry.check_config(u, UViTTask)  # the defaults pass
  u.evals.generation.sample.cfg_scale = 0.4
  with pytest.raises(ValueError, match="cfg_scale=0.4 is not allowed; the model is trained "
                                       "without label dropout"):
    registry.check_config(u, UViTTask)


def test_train_command_stops_before_training_in_one_line(tmp_path):
  p = subprocess.run([sys.executable, "-m", "decay_jax.cli.train",
                      "--config=configs/sit_cpu_mnist.py", f"--workdir={tmp_path / 'w'}",
                      "--config.evals.generation.enabled=True"], cwd=REPO,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 2
  assert p.stderr.strip().splitlines()[-1].startswith(
      "error: evals.generation.ref is required when evals.generation.enabled"), p.stderr[-1000:]
  assert not os.path.exists(tmp_path / "w" / "checkpoints")
