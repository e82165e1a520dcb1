"""End to end: train a tiny MAE (rank and branch ratios logged during training), convert-style save
of the same weights, then `python -m decay_jax.cli.evaluate` on both (fine-tuning included): JSON,
Markdown report, plots."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from decay_jax import sharding as shd
from decay_jax.evals import registry, suite
from decay_jax.train import trainer
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import tasks
from testing_configs import shrink_lines
from xla_env import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Shrinks a CPU config to 4 steps on 16-pixel digits, one device, synchronous checkpoints.
SHRINK = shrink_lines(4)

# A config file for both training and evaluation: the demo config shrunk to the micro model on
# 16-pixel digits, 512 training and 256 test images, every evaluator a few steps long.
CONFIG = '''
import runpy

def get_config():
  c = runpy.run_path({demo!r})["get_config"]()
  c.model.preset = "micro/4"
  c.batch_size = 16''' + SHRINK + '''
  c.evals.knn.update(max_train_examples=512, max_eval_examples=256, batch_size=128)
  c.evals.rank.update(every_steps=2, num_images=64, batch_size=32)
  c.evals.linear.update(protocols="official,mae", features="mean,cls_ln", max_train_examples=512,
                        max_eval_examples=256, batch_size=128)
  c.evals.linear.official.update(epochs=2, batch_size=64)
  c.evals.linear.mae.update(epochs=2, warmup_epochs=1.0, batch_size=128, blr=6.4)
  c.evals.layers.update(max_train_examples=512, max_eval_examples=256, batch_size=128,
                        probe_epochs=2, probe_batch_size=64)
  return c
'''

# The fine-tuning entry: the CPU fine-tuning config at the same size, 4 steps, evaluated twice.
FINETUNE_CONFIG = '''
import runpy

def get_config():
  c = runpy.run_path({demo!r})["get_config"]()
  c.batch_size = 32''' + SHRINK + '''
  c.evals.accuracy.update(every_steps=2, max_eval_examples=200)
  return c
'''


def load_config(path):
  import runpy
  return runpy.run_path(path)["get_config"]()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  root = tmp_path_factory.mktemp("evaluate")
  cfg_path = root / "tiny_eval.py"
  cfg_path.write_text(CONFIG.format(demo=os.path.join(REPO, "configs", "mae_cpu_mnist.py")))
  workdir = str(root / "run")
  res = trainer.train_and_evaluate(load_config(str(cfg_path)), workdir, evaluators=registry.build)
  return root, str(cfg_path), workdir, res


def test_rank_and_branch_ratios_are_logged_during_training(trained):
  _, _, _, res = trained
  depth = 4  # micro/4
  for b in range(depth):
    assert res[f"rank/tokens_erank/block_{b:02d}"] >= 1.0
    assert 1.0 <= res[f"rank/pooled_erank/block_{b:02d}"] <= 32  # min(64 images, 32 channels)
    assert res[f"branches/ratio_attn/block_{b:02d}"] > 0
  assert res["rank/tokens_erank/block_00"] <= 17  # min(17 tokens, 32 channels)
  assert "knn/top1" in res


def test_report_on_run_and_converted_checkpoint(trained):
  root, cfg_path, workdir, res = trained
  mesh = shd.make_mesh(1, 1)
  params, step = ckpt_lib.restore_run_params(workdir, mesh)
  assert step == 4
  model = suite.run_model(tasks.run_config(workdir, "mae"), params)
  converted = str(root / "converted")
  ckpt_lib.save_params(converted, params, model)  # what `python -m decay_jax.cli.convert` writes
  out = str(root / "report")
  ft_path = root / "tiny_finetune.py"
  ft_path.write_text(FINETUNE_CONFIG.format(
      demo=os.path.join(REPO, "configs", "finetune_cpu_mnist.py")))
  env = dict(os.environ, XLA_FLAGS=xla_flags(2), JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "decay_jax.cli.evaluate", f"--workdir={workdir}",
       f"--checkpoint={converted}", "--names=run,converted", f"--config={cfg_path}", f"--out={out}",
       f"--finetune_config={ft_path}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(os.path.join(out, "evaluation.json")) as f:
    report = json.load(f)
  run, conv = report["models"]
  assert run["source"]["step"] == 4 and conv["source"]["checkpoint"] == converted
  assert run["model"]["alpha_min"] == 0.6 and run["model"]["alpha_eff"] == pytest.approx(
      model.shortcuts.alpha_eff)
  s = run["sections"]
  # The evaluator of the report is the one of training: the same KNN number.
  assert s["knn"]["top1"] == res["knn/top1"] and s["knn"]["num_train"] == 512
  for protocol in ("official", "mae"):
    for choice in ("mean", "cls_ln"):
      assert 0.0 <= s["linear"][protocol]["results"][choice]["top1"] <= 1.0
  assert len(s["layers"]["knn_top1"]) == 4 and len(s["layers"]["linear_top1"]) == 4
  assert s["layers"]["knn"]["last"] == s["layers"]["knn_top1"][-1]
  assert len(s["rank"]["tokens_erank"]) == 4 and len(s["branches"]["ratio_flat"]) == 8
  np.testing.assert_allclose(s["rank"]["tokens_erank"],
                             [res[f"rank/tokens_erank/block_{b:02d}"] for b in range(4)], rtol=1e-6)
  # Fine-tuned from the run's workdir, and from the params dir: a real run each, evaluated twice.
  ft = s["finetune"]
  assert ft["steps"] == 4 and ft["batch_size"] == 32
  assert 0.0 <= ft["top1"] <= ft["top5"] <= 1.0 and ft["top1"] <= ft["top1_best"] <= 1.0
  with open(os.path.join(out, "finetune", "run", "results.json")) as f:
    assert json.load(f)["accuracy/top1"] == ft["top1"]
  assert run["settings"]["finetune"]["config"]["init_from"] == workdir
  assert conv["settings"]["finetune"]["config"]["init_from"] == converted
  # Same weights through the converted-checkpoint path: exactly the same numbers.
  assert conv["sections"] == s
  with open(os.path.join(out, "report.md")) as f:
    md = f.read()
  assert f"| {100 * ft['top1']:.2f}% ({100 * ft['top1_best']:.2f}%) |" in proc.stdout
  for text in ("## run", "## converted", "### Per block", "### Linear probes", "| official | mean |",
               "### Fine-tuning (end to end)",
               "(accuracy_vs_block.png)", "(rank_vs_block.png)", "(branch_ratio_vs_sublayer.png)"):
    assert text in md
  for png in ("accuracy_vs_block.png", "rank_vs_block.png", "branch_ratio_vs_sublayer.png"):
    with open(os.path.join(out, png), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bad_flags_fail_with_one_line(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "decay_jax.cli.evaluate", f"--checkpoint={tmp_path}"],
                        cwd=REPO, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  # One line, last (TensorFlow, imported with the trainer, may log its start-up lines first).
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: --checkpoint needs --config=FILE for its data and evaluator settings (e.g. "
      "configs/mae_vit_b16.py)")
  proc = subprocess.run([sys.executable, "-m", "decay_jax.cli.evaluate", f"--workdir={tmp_path}",
                         "--evals=knn,finetune"], cwd=REPO, capture_output=True, text=True,
                        timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: --evals=finetune needs --finetune_config=FILE (e.g. configs/finetune_cpu_mnist.py)")
  with pytest.raises(ValueError, match="has no config.json"):
    tasks.run_config(str(tmp_path), "mae")
