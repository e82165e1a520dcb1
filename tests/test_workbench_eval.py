"""The evaluation workbench: CKA against numpy transcriptions of both formulas, post-training
ablations of a model's residual update, and `python -m decay_jax.cli.evaluate` with --evals=cka,
--evals=routing and --ablate on tiny trained MAE and routed SiT runs (trained once per module)."""

import json
import os
import runpy
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.evals import ablation, cka, registry
from decay_jax.models import mae as mae_lib
from decay_jax.train import trainer
from testing_configs import shrink_lines
from xla_env import xla_flags

REPO = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
CONFIGS = os.path.join(REPO, "configs")

SHRINK = "\n  c.batch_size = 16" + shrink_lines(2)
MAE_CONFIG = '''
import runpy

def get_config():
  c = runpy.run_path({base!r})["get_config"]()
  c.model.preset = "micro/4"''' + SHRINK + '''
  c.evals.rank.enabled = False
  c.evals.knn.enabled = False
  c.evals.linear.enabled = False
  c.evals.layers.update(enabled=False, max_train_examples=128, max_eval_examples=64, batch_size=64,
                        probe_epochs=1, probe_batch_size=64)
  return c
'''
SIT_CONFIG = '''
import runpy

def get_config():
  c = runpy.run_path({base!r})["get_config"]("mirror_decay")
  c.model.preset = "micro/4"''' + SHRINK + '''
  return c
'''


# ------------------------------------------------------------------------------------------------
# CKA against plain numpy


def np_linear_cka(x, y):
  """Kornblith et al. 2019 written out: column-centre, ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)."""
  x = x - x.mean(0)
  y = y - y.mean(0)
  norm = lambda a: np.sqrt(np.sum(a ** 2))
  return np.sum((y.T @ x) ** 2) / (norm(x.T @ x) * norm(y.T @ y))


def np_hsic1(k, l):
  """Song et al. 2012's unbiased HSIC with explicit sums."""
  n = len(k)
  kt, lt = k.copy(), l.copy()
  for i in range(n):
    kt[i, i] = lt[i, i] = 0.0
  trace = sum(kt[i, j] * lt[j, i] for i in range(n) for j in range(n))
  middle = kt.sum() * lt.sum() / ((n - 1) * (n - 2))
  last = sum(kt[i, j] * lt[j, m] for i in range(n) for j in range(n) for m in range(n))
  return (trace + middle - 2.0 / (n - 2) * last) / (n * (n - 3))


def np_minibatch_cka(xs, ys):
  kl = sum(np_hsic1(x @ x.T, y @ y.T) for x, y in zip(xs, ys))
  kk = sum(np_hsic1(x @ x.T, x @ x.T) for x in xs)
  ll = sum(np_hsic1(y @ y.T, y @ y.T) for y in ys)
  return kl / np.sqrt(kk * ll)


def test_cka_matches_numpy_and_its_invariances():
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(40, 6)), rng.normal(size=(40, 9)) + 0.3
  y[:, :3] += 2 * x[:, :3]
  assert cka.linear_cka(x, y) == pytest.approx(np_linear_cka(x, y), rel=1e-12)
  q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
  for other in (x @ q, 3.7 * x, 0.01 * x @ q + 5.0):  # orthogonal, isotropic scaling, translation
    assert cka.linear_cka(x, other) == pytest.approx(1.0, abs=1e-12)
  assert cka.linear_cka(x, y) < 0.99
  # Unbiased HSIC and minibatch CKA: the formula, and the U-centred kernels the evaluator uses.
  k, l = x[:8] @ x[:8].T, y[:8] @ y[:8].T
  assert cka.hsic_unbiased(k, l) == pytest.approx(np_hsic1(k, l), rel=1e-10)
  assert np.sum(cka.u_centre(k) * cka.u_centre(l)) == pytest.approx(np_hsic1(k, l), rel=1e-10)
  xs, ys = np.split(x, 5), np.split(y, 5)
  expect = np_minibatch_cka(xs, ys)
  assert cka.minibatch_cka(xs, ys) == pytest.approx(expect, rel=1e-10)
  grams = lambda parts: np.stack([[cka.u_centre(p @ p.T)] for p in parts])  # (batches, 1, n, n)
  assert cka.cka_matrix(grams(xs), grams(ys))[0, 0] == pytest.approx(expect, rel=1e-10)
  assert cka.minibatch_cka(xs, [3.7 * v @ q for v in xs]) == pytest.approx(1.0, abs=1e-12)
  # On the devices in float32, as the evaluator runs it.
  dev = cka.u_centre(jnp.asarray(np.stack([k, l]), jnp.float32))
  assert float(jnp.sum(dev[0] * dev[1])) == pytest.approx(np_hsic1(k, l), rel=1e-4)


# ------------------------------------------------------------------------------------------------
# Ablations of a model


def _mae(**kw):
  model = mae_lib.mae("micro/4", img_size=16, in_chans=1, **kw)
  params = jax.jit(lambda k: model.init(k, jnp.zeros((1, 16, 16, 1)), method=model.features))(
      jax.random.key(0))["params"]  # the encoder's parameters
  return model, jax.tree_util.tree_map(  # non-zero branches (the official init zeroes them)
      lambda p: p + 0.05 * jax.random.normal(jax.random.key(2), p.shape), params)


def test_ablations_change_the_update_and_keep_the_params():
  model, params = _mae(alpha_min=0.6)
  images = jax.random.normal(jax.random.key(3), (2, 16, 16, 1))
  feats = lambda m, p: np.asarray(jax.jit(lambda q: m.apply({"params": q}, images,
                                                            method=m.features))(p))
  base = feats(model, params)
  (n1, m1, p1, i1), (n2, m2, p2, i2), (n3, m3, p3, i3), (n4, m4, p4, _) = ablation.variants(
      "run", model, params,
      ["alphas_one", "no_identity=1", "no_branch=-2", "alpha_min=1+shape=cosine"])
  assert [n1, n2, n3, n4] == ["run[alphas=1]", "run[no_identity=1]", "run[no_branch=-2]",
                              "run[alpha_min=1+shape=cosine]"]
  assert p1 is params and p2 is params and np.all(np.asarray(m1.shortcuts.alphas) == 1.0)
  assert i2["alphas"][1] == [0.0, 0.0] and i2["alphas"][2] == model.shortcuts.alphas[2].tolist()
  # alphas all 1 is exactly the standard model; alpha_min=1 (any shape) too.
  np.testing.assert_array_equal(feats(m1, p1), feats(*_mae(alpha_min=1.0)[:1], params))
  assert np.all(np.asarray(m4.shortcuts.alphas) == 1.0) and p4 is params
  assert m4.residual.alpha_min == 1.0 and m4.residual.schedule_shape == "cosine"
  # Block 1 without its identity: its output no longer contains its input linearly.
  out2 = feats(m2, p2)
  np.testing.assert_array_equal(out2[0], base[0])
  assert not np.allclose(out2[1], base[1])
  # Block 2 (= -2) without branches: x <- a_mlp (a_attn x), the same params elsewhere.
  out3 = feats(m3, p3)
  a = model.shortcuts.alphas[2]
  np.testing.assert_allclose(out3[2], a[0] * a[1] * base[1], rtol=1e-6)
  np.testing.assert_array_equal(out3[1], base[1])
  assert i3["no_branch"] == [2] and m3 is model
  assert float(jnp.abs(p3["blocks"]["mlp"]["fc2"]["kernel"][2]).max()) == 0.0
  assert float(jnp.abs(p3["blocks"]["mlp"]["fc2"]["kernel"][1]).max()) > 0.0
  # A learnable model keeps its definition; its parameter alpha is replaced.
  lmodel = mae_lib.mae("micro/4", img_size=16, in_chans=1, alpha_min=0.6,
                       shortcut_form="learnable")
  lparams = dict(params, alpha=jnp.asarray(lmodel.shortcuts.alphas, jnp.float32))
  (_, lm, lp, li), = ablation.variants("l", lmodel, lparams, "no_identity=0")
  assert lm is lmodel and np.asarray(lp["alpha"])[0].tolist() == [0.0, 0.0]
  np.testing.assert_allclose(np.asarray(lp["alpha"])[1:], np.asarray(lparams["alpha"])[1:])
  for bad, text in (("no_identity=4", "has 4 blocks"), ("alpha_min=0", "alpha_min=0"),
                    ("shape=square", "schedule_shape"), ("wings", "alphas_one")):
    with pytest.raises(ValueError, match=text):
      ablation.variants("run", model, params, bad)


# ------------------------------------------------------------------------------------------------
# End to end


def _train(root, name, text, base):
  path = root / f"{name}.py"
  path.write_text(text.format(base=os.path.join(CONFIGS, base)))
  workdir = str(root / name)
  trainer.train_and_evaluate(runpy.run_path(str(path))["get_config"](), workdir,
                             evaluators=registry.build)
  return str(path), workdir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("workbench")
  return (root, _train(root, "mae", MAE_CONFIG, "mae_cpu_mnist.py"),
          _train(root, "sit", SIT_CONFIG, "sit_cpu_mnist_routing.py"))


def _evaluate(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2))
  return subprocess.run([sys.executable, "-m", "decay_jax.cli.evaluate", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


def test_ablations_and_cka_from_evaluate(runs):
  root, (_, mae_run), _ = runs
  out = str(root / "mae_report")
  proc = _evaluate(f"--workdir={mae_run}", "--names=a", "--evals=layers,cka",
                   "--ablate=alphas_one,no_branch=1", "--cka_images=64", "--cka_batch=32",
                   f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.load(open(os.path.join(out, "evaluation.json")))
  names = [r["name"] for r in report["models"]]
  assert names == ["a", "a[alphas=1]", "a[no_branch=1]"]
  a, ones, nob = report["models"][:3]
  assert ones["ablation"] == dict(ones["ablation"], of="a", entry="alphas=1", no_branch=[])
  assert ones["model"]["alpha_eff"] == 1.0 and a["model"]["alpha_eff"] < 1.0
  assert len(ones["sections"]["layers"]["knn_top1"]) == 4 and nob["ablation"]["no_branch"] == [1]
  within = np.asarray(a["sections"]["cka"]["matrix"])
  assert within.shape == (4, 4) and a["sections"]["cka"]["num_images"] == 64
  np.testing.assert_allclose(np.diag(within), 1.0, atol=1e-5)
  np.testing.assert_allclose(within, within.T, atol=1e-6)
  pairs = {(p["a"], p["b"]): np.asarray(p["matrix"]) for p in report["cka_between"]}
  assert set(pairs) == {("a", "a[alphas=1]"), ("a", "a[no_branch=1]"),
                        ("a[alphas=1]", "a[no_branch=1]")}
  # Without block 1's branches, block 1's output is a multiple of block 0's: CKA 1 with it.
  alphas = np.asarray(a["model"]["alphas"])
  assert pairs[("a", "a[no_branch=1]")][0, 0] == pytest.approx(1.0, abs=1e-5)
  assert pairs[("a", "a[no_branch=1]")][0, 1] == pytest.approx(1.0, abs=1e-4) and alphas[1].all()
  assert np.all(np.abs(pairs[("a", "a[alphas=1]")]) <= 1.0 + 1e-5)
  md = open(os.path.join(out, "report.md")).read()
  for text in ("## Post-training ablations", "| a[alphas=1] | alphas=1 |", "(ablation_a.png)",
               "## CKA between blocks", "(cka_within.png)", "## CKA between models",
               "(cka_between.png)", "## a[no_branch=1]"):
    assert text in md, text
  for png in ("ablation_a.png", "cka_within.png", "cka_between.png", "accuracy_vs_block.png"):
    assert open(os.path.join(out, png), "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_routing_maps_and_sit_cka_from_evaluate(runs):
  root, _, (_, sit_run) = runs
  out = str(root / "sit_report")
  proc = _evaluate(f"--workdir={sit_run},{sit_run}", "--names=sit,again", "--routing_bins=2",
                   "--routing_images=32",
                   "--cka_images=32", "--cka_batch=16", "--cka_feature=mean", "--probe_t=0.3",
                   f"--out={out}")  # a SiT run's default evaluators: cka and routing
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.load(open(os.path.join(out, "evaluation.json")))
  rec, again = report["models"]
  assert again["sections"] == rec["sections"]
  (pair,) = report["cka_between"]  # two --workdir: CKA between their blocks
  assert (pair["a"], pair["b"]) == ("sit", "again")
  np.testing.assert_allclose(pair["matrix"], rec["sections"]["cka"]["matrix"], atol=1e-5)
  assert set(rec["sections"]) == {"cka", "routing"}
  assert np.asarray(rec["sections"]["cka"]["matrix"]).shape == (4, 4)  # micro: 4 blocks
  rt = rec["sections"]["routing"]
  assert [b["t"] for b in rt["bins"]] == [[0.0, 0.5], [0.5, 1.0]] and rt["variant"] == "mirror"
  for b in rt["bins"]:  # mirror: 2 decoder blocks x 2 sublayers, candidates (x, x_i)
    assert [r["sublayer"] for r in b["rows"]] == ["dec1 attn", "dec1 mlp", "dec2 attn", "dec2 mlp"]
    for r in b["rows"]:
      assert len(r["weights"]) == 2 and sum(r["weights"]) == pytest.approx(1.0, abs=1e-5)
  assert open(os.path.join(out, "routing_sit.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  assert "## Routing weights: sit" in open(os.path.join(out, "report.md")).read()


def test_bad_workbench_flags_fail_with_one_line(runs):
  _, (_, mae_run), _ = runs
  with pytest.raises(ValueError, match="cka_images=50 is not allowed; it must be a multiple"):
    cka.check_settings(50, 32, "tokens")
  for args, text in ((["--ablate=wings"], "--ablate entry 'wings' is not allowed"),
                     (["--evals=routing"], "--evals=routing is not allowed")):
    proc = _evaluate(f"--workdir={mae_run}", *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("error: ") and text in lines[-1], lines
