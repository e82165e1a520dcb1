"""The study command: its grid, two tiny arms trained and evaluated end to end, the table and plots,
resuming a finished arm without retraining, and one-line errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from decay_jax import sharding as shd
from research.small_scale_study import study

from testing_configs import REPO, load_config, override


def tiny_base(npz_path: str):
  """The study config shrunk to the micro model on 16-pixel images, 160 to train, 64 to test."""
  c = load_config("research/small_scale_study/config.py")
  override(c, **{
      "model.preset": "micro/4", "data.dataset": f"npz:{npz_path}", "data.image_size": 16,
      "data.train_split": "train[:160]", "data.eval_split": "train[160:]", "batch_size": 16,
      "num_epochs": 0.5, "warmup_epochs": 0.0, "log_every_steps": 1, "picture_every_steps": 0,
      "checkpoint.every_steps": 5, "checkpoint.async_save": False, "mesh.data": 1,
      "evals.knn.every_steps": 2, "evals.knn.train_split": "train[:160]",
      "evals.knn.eval_split": "train[160:]", "evals.knn.batch_size": 64,
      "evals.linear.train_split": "train[:160]", "evals.linear.eval_split": "train[160:]",
      "evals.linear.batch_size": 64, "evals.layers.train_split": "train[:160]",
      "evals.layers.eval_split": "train[160:]", "evals.layers.batch_size": 64,
      "evals.layers.probe_epochs": 2, "evals.layers.probe_batch_size": 32,
      "evals.rank.split": "train[160:]", "evals.rank.num_images": 32,
      "evals.rank.batch_size": 32})
  c.evals.linear.official.update(epochs=2, batch_size=32)
  return c


@pytest.fixture(scope="module")
def studied(tmp_path_factory):
  root = tmp_path_factory.mktemp("study")
  rng = np.random.default_rng(0)
  labels = np.arange(224) % 4
  # Four classes told apart by brightness, plus noise: a feature-free task the probes can learn.
  x = np.clip(rng.normal(40 + 50 * labels[:, None, None, None], 25, (224, 16, 16, 3)), 0, 255)
  npz = str(root / "tiny.npz")
  np.savez(npz, x_train=x.astype(np.uint8), y_train=labels.astype(np.int64))
  base = tiny_base(npz)
  arms = [a for a in study.grid_arms(base, ["alpha"], 100.0)
          if a["overrides"]["model.alpha_min"] in (0.6, 1.0)]
  mesh = shd.make_mesh(1, 1)
  workdir = str(root / "grid")
  records = [study.run_arm(a, study.arm_config(base, a), os.path.join(workdir, a["name"]), mesh)
             for a in arms]
  return base, arms, workdir, records, mesh


def test_grid_names_and_overrides():
  base = load_config("research/small_scale_study/config.py")
  arms = study.grid_arms(base, ["all"], 100.0)
  names = [a["name"] for a in arms]
  assert len(names) == len(set(names)) == 5 + 5 + 3 + 3
  assert names[:5] == [f"a{a}_lr0.001_e30" for a in ("0.6", "0.7", "0.8", "0.9", "1")]
  official = [a for a in arms if a["grid"] == "lr"]
  assert {a["overrides"]["optim.lr"] for a in official} == {1.5e-4 * 128 / 256}
  long = [a for a in arms if a["grid"] == "long"]
  assert [a["name"] for a in long] == ["a0.6_lr0.001_e100", "a0.8_lr0.001_e100", "a1_lr0.001_e100"]
  cfg = study.arm_config(base, [a for a in arms if a["name"].startswith("mlp_only")][0])
  assert (cfg.model.shortcut_form, cfg.model.alpha_min) == ("mlp_only", 0.6)
  assert base.model.shortcut_form == "decay"  # the base config is not modified
  with pytest.raises(ValueError, match="grid=bogus is not allowed; choose from alpha, lr"):
    study.grid_arms(base, ["bogus"], 100.0)
  with pytest.raises(ValueError, match="has no field 'model.nope'"):
    override(base.copy_and_resolve_references(), **{"model.nope": 1})


def test_controls_without_a_schedule_print_no_alpha_min(studied):
  records = studied[3]
  control = dict(records[0], name="sqrt_half_both_x", shortcut_form="sqrt_half_both", alpha_min=1.0)
  decayed = dict(records[0], shortcut_form="attn_only", alpha_min=0.6)
  tail = f", lr {control['lr']:g}, {control['epochs']:g} ep"
  assert study._arm_label(control) == "sqrt_half_both" + tail
  assert study._arm_label(decayed) == "attn_only a0.6" + tail
  control_row, decayed_row = [[c.strip() for c in line.split("|")]
                               for line in study.table([control, decayed]).splitlines()[-2:]]
  assert control_row[1:4] == ["sqrt_half_both_x", "-", "sqrt_half_both"]
  assert decayed_row[2:4] == ["0.6", "attn_only"]


def test_arms_are_trained_and_evaluated(studied):
  _, arms, workdir, records, _ = studied
  assert [r["name"] for r in records] == [a["name"] for a in arms]
  assert [r["alpha_min"] for r in records] == [0.6, 1.0]
  for r in records:
    assert r["step"] == 5 and np.isfinite(r["final_loss"])
    # KNN logged at steps 2 and 4 and at the last step 5, as epochs (10 steps per epoch).
    assert [e for e, _ in r["knn_curve"]] == [0.2, 0.4, 0.5]
    assert all(0.0 <= v <= 1.0 for _, v in r["knn_curve"])
    # The final in-training KNN is the evaluation's KNN: the same evaluator, the same weights.
    assert r["knn_curve"][-1][1] == r["evaluation"]["sections"]["knn"]["top1"]
    for feature in study.LAYER_FEATURES:
      lay = r["layers_by_feature"][feature]
      assert lay["feature"] == feature and len(lay["knn_top1"]) == 4  # micro/4: 4 blocks
      assert lay["knn"]["best"] == max(lay["knn_top1"])
    probes = r["evaluation"]["sections"]["linear"]["official"]["results"]
    assert set(probes) == {"mean", "mean_ln", "cls", "cls_ln", "patch_mean", "patch_mean_ln"}
    standardised = r["evaluation"]["sections"]["linear"]["official_std"]["results"]
    assert set(standardised) == set(probes)
    assert all(0.0 <= v["top1"] <= 1.0 for v in standardised.values())
    assert len(r["evaluation"]["sections"]["rank"]["tokens_erank"]) == 4
  # Each arm's model carries its own schedule (alpha_min 1 is the standard residual network).
  assert records[0]["evaluation"]["model"]["alpha_min"] == 0.6
  assert 0.1 < records[0]["evaluation"]["model"]["alpha_eff"] < 0.2  # micro/4: 0.150
  assert records[1]["evaluation"]["model"]["alpha_eff"] == 1.0


def test_table_plots_and_resume(studied):
  base, arms, workdir, records, mesh = studied
  text = study.write_summary(workdir, study.finished_records(workdir), study.budget(base))
  rows = [line for line in text.splitlines() if line.startswith(("| a0.6_", "| a1_"))
          and "| decay |" in line]
  assert len(rows) == 2
  r = records[0]
  knn = 100 * r["evaluation"]["sections"]["knn"]["top1"]
  probe = 100 * r["evaluation"]["sections"]["linear"]["official"]["results"]["cls_ln"]["top1"]
  std = 100 * r["evaluation"]["sections"]["linear"]["official_std"]["results"]["mean"]["top1"]
  assert f"| {knn:.2f} |" in rows[0] and f"| {probe:.2f} | {std:.2f} |" in rows[0]
  # Per-block table: 2 arms x 4 features x (KNN, linear) rows, one cell per block of micro/4.
  lay = r["layers_by_feature"]["cls_ln"]
  block_rows = [line for line in text.splitlines() if line.startswith("| a0.6_")
                and "| cls_ln | linear |" in line]
  assert len(block_rows) == 1 and block_rows[0].endswith(
      " | ".join(f"{100 * v:.2f}" for v in lay["linear_top1"])
      + f" | {100 * lay['linear']['best']:.2f} ({lay['linear']['best_block'] + 1}) |")
  assert sum(" | KNN | " in line or " | linear | " in line for line in text.splitlines()) == 16
  for png in ("accuracy_vs_layer.png", "accuracy_vs_alpha.png", "knn_vs_epochs.png"):
    with open(os.path.join(workdir, png), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  with open(os.path.join(workdir, "study.json")) as f:
    assert [s["knn_last"] for s in json.load(f)] == [
        x["evaluation"]["sections"]["knn"]["top1"] for x in records]
  # A finished arm is kept as it is: no training, no evaluation.
  path = os.path.join(workdir, arms[0]["name"], "study_record.json")
  before = os.stat(path).st_mtime_ns
  again = study.run_arm(arms[0], study.arm_config(base, arms[0]),
                        os.path.join(workdir, arms[0]["name"]), mesh)
  assert again == json.loads(json.dumps(records[0])) and os.stat(path).st_mtime_ns == before


def test_bad_grid_is_one_line(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "research.small_scale_study.run", "--config=research/small_scale_study/config.py",
       f"--workdir={tmp_path}", "--grid=alpha", "--only=a0.5_lr0.001_e30", "--list"],
      cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ,
                                                                      JAX_PLATFORMS="cpu"))
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1].startswith(
      "error: only=a0.5_lr0.001_e30 is not allowed; the arms of grid=alpha are a0.6_lr0.001_e30")


def test_unfinished_arm_shows_its_curve_so_far(studied, tmp_path):
  _, arms, workdir, records, _ = studied
  import shutil
  done = os.path.join(workdir, arms[1]["name"])
  for name in (arms[0]["name"], "a1_running"):  # one finished arm, one without a record yet
    os.makedirs(tmp_path / name)
    for f in ("config.json", "metrics.jsonl"):
      shutil.copy(os.path.join(workdir, arms[0]["name"] if name != "a1_running" else done, f),
                  tmp_path / name / f)
  shutil.copy(os.path.join(workdir, arms[0]["name"], "study_record.json"),
              tmp_path / arms[0]["name"])
  unfinished = study.unfinished_curves(str(tmp_path))
  assert [u["name"] for u in unfinished] == ["a1_running"]
  assert unfinished[0]["alpha_min"] == 1.0 and unfinished[0]["knn_curve"] == records[1]["knn_curve"]
  text = study.write_summary(str(tmp_path), study.finished_records(str(tmp_path)), "budget",
                             unfinished)
  last = records[1]["knn_curve"][-1]
  assert (f"Unfinished: a1_running (epoch {last[0]:.1f}, KNN {100 * last[1]:.2f}; of 0.5 epochs)."
          in text)
  with open(tmp_path / "knn_vs_epochs.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_resumed_arm_counts_the_training_time_of_every_run(tmp_path):
  # clu's uptime restarts at zero in each run; a run stopped at step 30 and resumed there.
  rows = [(10, 50.0), (20, 100.0), (30, 151.0), (40, 40.0), (50, 90.0)]
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for step, uptime in rows:
      f.write(json.dumps({"step": step, "uptime": uptime}) + "\n")
      f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
  assert study._earlier_runs_seconds(str(tmp_path)) == 151.0 + 90.0
  assert study._earlier_runs_seconds(str(tmp_path / "missing")) == 0.0


def test_archive_keeps_finished_arms_when_the_workdir_is_gone(studied, tmp_path):
  _, arms, workdir, records, _ = studied
  archive = str(tmp_path / "records")
  assert study.archive_records(workdir, archive) == [a["name"] for a in arms]
  assert study.archive_records(workdir, archive) == []  # unchanged records are not rewritten
  expected = json.loads(json.dumps(records))
  gone = str(tmp_path / "new_workdir")  # a fresh machine: no arm directories at all
  assert study.finished_records(gone) == []
  assert study.finished_records(gone, archive) == expected
  # An arm finished in the workdir wins over its archived copy.
  stale = dict(expected[0], final_loss=9.0)
  with open(os.path.join(archive, f"{arms[0]['name']}.json"), "w") as f:
    json.dump(stale, f)
  assert study.finished_records(workdir, archive) == expected
  assert study.finished_records(gone, archive)[0]["final_loss"] == 9.0
  # An archived record with fewer feature choices still joins the table and plots.
  partial = dict(expected[1], name="a1_partial")
  partial["layers_by_feature"] = {k: partial["layers_by_feature"][k] for k in ("mean", "cls")}
  with open(os.path.join(archive, "a1_partial.json"), "w") as f:
    json.dump(partial, f)
  os.makedirs(gone)
  text = study.write_summary(gone, study.finished_records(gone, archive), "budget")
  assert sum(line.startswith("| a1_partial |") for line in text.splitlines()) == 1 + 4
  # The decayed arm: its row, its row against the baseline, 4 features x (KNN, linear) block rows.
  assert sum(line.startswith(f"| {arms[0]['name']} |") for line in text.splitlines()) == 1 + 1 + 8
  with open(os.path.join(gone, "accuracy_vs_layer.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_difference_table_subtracts_the_baseline_trained_alike(studied):
  _, _, _, records, _ = studied
  decayed, base = records
  assert study.baseline_of(decayed, records) is base
  assert study.baseline_of(dict(decayed, lr=0.5), records) is None  # no baseline at that lr
  rows = study.difference_table(records).splitlines()
  assert len(rows) == 3  # header, rule, one decayed arm (the baseline has no row)
  cells = [c.strip() for c in rows[2].strip("|").split("|")]
  assert cells[:2] == [decayed["name"], base["name"]]
  knn = lambda r: r["evaluation"]["sections"]["knn"]["top1"]
  assert cells[2] == f"{100 * (knn(decayed) - knn(base)):+.2f}"
  cls_ln = lambda r: r["evaluation"]["sections"]["linear"]["official"]["results"]["cls_ln"]["top1"]
  assert cells[7] == f"{100 * (cls_ln(decayed) - cls_ln(base)):+.2f}"
  mean_knn = lambda r: r["layers_by_feature"]["mean"]["knn_top1"]
  ahead = [i + 1 for i, (x, y) in enumerate(zip(mean_knn(decayed), mean_knn(base)))
           if 100 * (x - y) > study.NOISE_POINTS]
  std = lambda r: r["evaluation"]["sections"]["linear"]["official_std"]["results"]["mean"]["top1"]
  assert cells[10] == f"{100 * (std(decayed) - std(base)):+.2f}"
  assert cells[11].split(" / ")[0] == (study._blocks(ahead))
  assert study._blocks([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10" and study._blocks([]) == "-"


def test_reevaluate_replaces_only_the_evaluation(studied, tmp_path):
  import shutil
  base, arms, workdir, records, mesh = studied
  arm_dir = str(tmp_path / arms[0]["name"])
  shutil.copytree(os.path.join(workdir, arms[0]["name"]), arm_dir)
  record_path = os.path.join(arm_dir, "study_record.json")
  old = json.loads(json.dumps(records[0]))
  # A record evaluated before the standardised probe existed.
  del old["evaluation"]["sections"]["linear"]["official_std"]
  with open(record_path, "w") as f:
    json.dump(dict(old, eval_seconds=-1.0), f)
  cfg = study.arm_config(base, arms[0])
  kept = study.run_arm(arms[0], cfg, arm_dir, mesh)  # without the flag: kept as it is
  assert "official_std" not in kept["evaluation"]["sections"]["linear"]
  again = study.run_arm(arms[0], cfg, arm_dir, mesh, reevaluate=True)
  for key in ("final_loss", "train_seconds", "knn_curve", "step", "name", "lr"):
    assert again[key] == old[key]
  assert again["eval_seconds"] > 0
  lin = again["evaluation"]["sections"]["linear"]
  ref = records[0]["evaluation"]["sections"]["linear"]
  for protocol in ("official", "official_std"):  # same checkpoint, same probes: same numbers
    assert lin[protocol]["results"]["mean"]["top1"] == pytest.approx(
        ref[protocol]["results"]["mean"]["top1"], abs=1e-9)
  with open(record_path) as f:
    assert json.load(f)["evaluation"]["sections"]["linear"].keys() == lin.keys()
  # Its final checkpoint gone: a one-line error before any work.
  shutil.rmtree(os.path.join(arm_dir, "checkpoints"))
  with pytest.raises(ValueError, match="reevaluate=True is not allowed for arm a0.6_.*no final"):
    study.check_reevaluable(arms[0], cfg, arm_dir)
  study.check_reevaluable(arms[0], cfg, str(tmp_path / "never_trained"))  # trains first: fine
