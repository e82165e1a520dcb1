"""The compare command: a grid over config fields, seeds, intervals and the verdict."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from decay_jax.evals import intervals
from decay_jax.train import grid
from testing_configs import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_summary_equals_the_one_sample_t_interval():
  x = [0.41, 0.45, 0.39, 0.47]
  s = intervals.summary(x)
  ci = stats.ttest_1samp(x, 0.0).confidence_interval(0.95)
  assert s["n"] == 4 and s["mean"] == pytest.approx(np.mean(x))
  assert s["sd"] == pytest.approx(np.std(x, ddof=1))
  assert (s["lo"], s["hi"]) == pytest.approx((ci.low, ci.high))
  # by hand: t_{0.975,3} = 3.182446
  assert s["hi"] - s["mean"] == pytest.approx(3.182446 * np.std(x, ddof=1) / 2, rel=1e-6)
  assert intervals.summary([0.5]) == {"n": 1, "mean": 0.5, "sd": None, "lo": None, "hi": None}


def test_difference_equals_welch_and_says_what_it_separates():
  a, b = [0.44, 0.46, 0.45], [0.35, 0.40, 0.37]
  d = intervals.difference(a, b)
  ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
  assert d["diff"] == pytest.approx(np.mean(a) - np.mean(b))
  assert (d["lo"], d["hi"]) == pytest.approx((ci.low, ci.high))
  assert d["separated"] is True
  close = intervals.difference([0.40, 0.46, 0.43], [0.41, 0.39, 0.45])
  assert close["lo"] < 0 < close["hi"] and close["separated"] is False
  assert intervals.difference([0.4], [0.3, 0.2])["separated"] is None
  assert intervals.difference([0.4, 0.4], [0.3, 0.3]) == {
      "diff": pytest.approx(0.1), "lo": pytest.approx(0.1), "hi": pytest.approx(0.1),
      "separated": True}


def test_grid_is_the_product_of_the_fields_with_typed_values():
  base = load_config("mae_cpu_mnist")
  arms = grid.parse(base, ["model.alpha_min=0.6,1", "model.branch_gain=none,layerscale"])
  assert [a.overrides for a in arms] == [
      (("model.alpha_min", 0.6), ("model.branch_gain", "none")),
      (("model.alpha_min", 0.6), ("model.branch_gain", "layerscale")),
      (("model.alpha_min", 1.0), ("model.branch_gain", "none")),
      (("model.alpha_min", 1.0), ("model.branch_gain", "layerscale"))]
  assert arms[1].name == "alpha_min=0.6, branch_gain=layerscale"
  assert arms[1].dirname(0, 0) == "alpha_0.6_branch_gain_layerscale"
  assert arms[2].dirname(2, 0) == "alpha_1_branch_gain_none_seed2"
  cfg = arms[1].config(base, 7)
  assert (cfg.model.alpha_min, cfg.model.branch_gain, cfg.seed) == (0.6, "layerscale", 7)
  assert base.model.branch_gain == "none" and base.seed == 0  # the base is unchanged
  assert grid.parse(base, ["tensorboard=false"])[0].overrides == (("tensorboard", False),)
  assert grid.seeds(base, 3) == [0, 1, 2]


def test_arms_listed_one_by_one():
  base = load_config("mae_cpu_mnist")
  arms = grid.parse_arms(base, ["model.alpha_min=0.6", "model.alpha_min=1+model.branch_gain=rezero",
                                "model.alpha_min=1+model.shortcut_form=sqrt_half_both"])
  assert [a.dirname(0, 0) for a in arms] == [
      "alpha_0.6", "alpha_1_branch_gain_rezero", "alpha_1_shortcut_form_sqrt_half_both"]
  assert arms[1].name == "alpha_min=1, branch_gain=rezero"
  for spec, phrase in [("model.alpha_min=0.6,1", "write FIELD=V joined by '+'"),
                       ("model.alpha_min=1+model.alpha_min=0.5", "model.alpha_min is given twice"),
                       ("model.nope=1", "the config has no such field")]:
    with pytest.raises(ValueError) as e:
      grid.parse_arms(base, [spec])
    assert phrase in str(e.value)
  with pytest.raises(ValueError, match="the same arm is given twice"):
    grid.parse_arms(base, ["model.alpha_min=0.6", "model.alpha_min=0.60"])


@pytest.mark.parametrize("spec, phrase", [
    ("model.alpha_min", "write FIELD=V1,V2"),
    ("model.alpha=0.6", "grid='model.alpha' is not allowed; the config has no such field"),
    ("model.alpha_min=0.6,x", "model.alpha_min takes a float"),
    ("batch_size=8,8", "a value is repeated"),
    ("data.crop_scale=0.5", "cannot be varied from the command line"),
])
def test_bad_grids_are_one_line(spec, phrase):
  with pytest.raises(ValueError, match=None) as e:
    grid.parse(load_config("mae_cpu_mnist"), [spec])
  assert phrase in str(e.value) and "\n" not in str(e.value)


TINY = ["--config.model.preset=micro/4", "--config.data.image_size=16", "--config.batch_size=16",
        "--config.num_train_steps=2", "--config.warmup_epochs=0.0", "--config.mesh.data=1",
        "--config.tensorboard=false", "--config.checkpoint.every_steps=2",
        "--config.checkpoint.async_save=false", "--config.picture_every_steps=2",
        "--config.evals.rank.enabled=false", "--config.evals.knn.max_train_examples=256",
        "--config.evals.knn.max_eval_examples=128", "--config.data.num_workers=0"]


def test_two_arms_two_seeds_print_means_intervals_and_the_verdict(tmp_path):
  workdir = tmp_path / "cmp"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  proc = subprocess.run(
      [sys.executable, "-m", "decay_jax.cli.compare", "--config=configs/mae_cpu_mnist.py",
       f"--workdir={workdir}", "--grid=model.alpha_min=0.6,1.0", "--seeds=2", *TINY],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert sorted(os.listdir(workdir)) == [
      "alpha_0.6", "alpha_0.6_seed1", "alpha_1", "alpha_1_seed1", "comparison.json",
      "comparison.md", "reconstructions.png"]
  report = json.loads((workdir / "comparison.json").read_text())
  assert report["seeds"] == [0, 1] and [a["name"] for a in report["arms"]] == [
      "alpha_min=0.6", "alpha_min=1"]
  for arm in report["arms"]:
    assert [r["seed"] for r in arm["runs"]] == [0, 1]
    for key in ("loss", "knn/top1", "knn/top5"):
      values = [r[key] for r in arm["runs"]]
      assert arm["summary"][key] == pytest.approx(intervals.summary(values))
    # the two seeds are different runs (initialisation, order and augmentation)
    assert arm["runs"][0]["loss"] != arm["runs"][1]["loss"]
  # each run trained its arm's config (after 2 steps the arms' losses are still equal: the
  # official MAE's zero-initialised output layers keep the encoder out of the loss at first)
  for name, alpha, seed in [("alpha_0.6", 0.6, 0), ("alpha_0.6_seed1", 0.6, 1), ("alpha_1", 1.0, 0),
                            ("alpha_1_seed1", 1.0, 1)]:
    saved = json.loads((workdir / name / "config.json").read_text())
    assert (saved["model"]["alpha_min"], saved["seed"]) == (alpha, seed)
  a, b = report["arms"]
  d = [x for x in report["differences"] if x["metric"] == "knn/top1"][0]
  expected = intervals.difference([r["knn/top1"] for r in a["runs"]],
                                  [r["knn/top1"] for r in b["runs"]])
  assert d == dict(expected, metric="knn/top1", a="alpha_min=0.6", b="alpha_min=1")
  s = a["summary"]["knn/top1"]
  cell = f"{100 * s['mean']:.2f}% ± {100 * (s['hi'] - s['mean']):.2f} (sd {100 * s['sd']:.2f})"
  assert cell in proc.stdout
  verdict = ("separated" if expected["separated"] else "not separated")
  assert f"- KNN top-1, alpha_min=0.6 vs alpha_min=1: {100 * expected['diff']:+.4g} points" in (
      proc.stdout)
  assert verdict in proc.stdout and "2 seeds per arm (0, 1)" in proc.stdout
  assert (workdir / "comparison.md").read_text().strip() in proc.stdout


def test_alphas_and_grid_together_are_one_line(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "decay_jax.cli.compare", "--config=configs/mae_cpu_mnist.py",
       f"--workdir={tmp_path}", "--alphas=0.6", "--grid=model.alpha_min=0.5,1"],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO),
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
      "error: --alphas and --grid were given; choose one way to name the arms "
      "(--alphas=A,B is --grid=model.alpha_min=A,B)"]
