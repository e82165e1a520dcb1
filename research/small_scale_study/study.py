"""The study's grid, its arms (train then evaluate), and the table and plots over finished arms.

The command is ``python -m research.small_scale_study.run`` (its docstring lists the grids and outputs). Arms are
dotted-field overrides of one base config; each trains with ``train.trainer`` in its own workdir
and is evaluated by ``evals.suite.evaluate_model``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Sequence

from absl import logging

from decay_jax import paths, plots
from decay_jax.data import pipeline
from decay_jax.evals import registry, suite
from decay_jax.models.schedules import UNSCHEDULED_FORMS
from decay_jax.train import tasks, trainer, writers
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import config as config_lib

ALPHAS = (0.6, 0.7, 0.8, 0.9, 1.0)
OFFICIAL_BLR = 1.5e-4  # docs/official_code.md 2.3: lr = blr * batch / 256
LAYER_FEATURES = ("mean", "mean_ln", "cls", "cls_ln")
GRID_NAMES = ("alpha", "lr", "controls", "long")
NOISE_POINTS = 3.0  # smallest difference of two arms' top-1 the study calls resolved


# ------------------------------------------------------------------------------------------------
# The grid


def _fmt(x: float) -> str:
  return f"{x:g}"


def arm(base, name_parts: Sequence[str], grid: str, **overrides) -> Dict[str, Any]:
  """One arm: a name, its grid and the dotted-field overrides of the base config."""
  epochs = overrides.get("num_epochs", base.num_epochs)
  lr = overrides.get("optim.lr", base.optim.lr)
  name = "_".join(list(name_parts) + [f"lr{_fmt(lr)}", f"e{_fmt(epochs)}"])
  return {"name": name, "grid": grid, "overrides": overrides}


def grid_arms(base, grids: Sequence[str], long_epochs: float) -> List[Dict[str, Any]]:
  """The arms of ``grids`` in order, each name once (an arm shared by two grids runs once)."""
  names = list(GRID_NAMES) if "all" in grids else list(grids)
  bad = [g for g in names if g not in GRID_NAMES]
  if bad or not names:
    raise ValueError(f"grid={','.join(grids)} is not allowed; choose from "
                     f"{', '.join(GRID_NAMES)} or all")
  official_lr = OFFICIAL_BLR * base.batch_size / 256
  out = []
  for g in names:
    if g == "alpha":
      out += [arm(base, [f"a{_fmt(a)}"], g, **{"model.alpha_min": a}) for a in ALPHAS]
    elif g == "lr":
      out += [arm(base, [f"a{_fmt(a)}"], g, **{"model.alpha_min": a, "optim.lr": official_lr})
              for a in ALPHAS]
    elif g == "controls":
      out += [arm(base, ["sqrt_half_both"], g, **{"model.shortcut_form": "sqrt_half_both",
                                                   "model.alpha_min": 1.0}),
              arm(base, ["attn_only", "a0.6"], g, **{"model.shortcut_form": "attn_only",
                                                      "model.alpha_min": 0.6}),
              arm(base, ["mlp_only", "a0.6"], g, **{"model.shortcut_form": "mlp_only",
                                                     "model.alpha_min": 0.6})]
    else:
      out += [arm(base, [f"a{_fmt(a)}"], g, **{"model.alpha_min": a, "num_epochs": long_epochs})
              for a in (0.6, 0.8, 1.0)]
  seen, unique = set(), []
  for a in out:
    if a["name"] not in seen:
      seen.add(a["name"])
      unique.append(a)
  return unique


def arm_config(base, a):
  cfg = base.copy_and_resolve_references()
  config_lib.override(cfg, **a["overrides"])
  # The rank pass runs once, in the evaluation below, instead of also at the end of training.
  cfg.evals.rank.enabled = False
  return cfg


# ------------------------------------------------------------------------------------------------
# One arm: train, then evaluate


def _record_path(workdir: str) -> str:
  return paths.join(workdir, "study_record.json")


def _arm_dirs(workdir: str):
  """Yields (name, directory) of every arm directory under the study ``workdir``, sorted."""
  root = paths.resolve(workdir)
  for child in sorted(root.iterdir(), key=lambda p: p.name) if root.is_dir() else ():
    if child.is_dir():
      yield child.name, str(child)


def _knn_curve(arm_dir: str, batch_size: int, num_train: int):
  """[(epoch, last-block KNN top-1)] logged during training of the arm in ``arm_dir``."""
  per_epoch = num_train / batch_size
  return [(s / per_epoch, v) for s, v in writers.read_scalars(arm_dir, "knn/top1")]


def _earlier_runs_seconds(arm_dir: str) -> float:
  """Seconds of training logged by earlier runs of a resumed arm (clu's ``uptime``, which restarts
  from zero in every run), so a record's training time covers the whole arm."""
  total, last = 0.0, 0.0
  for _, uptime in writers.read_scalars(arm_dir, "uptime"):
    if uptime < last:
      total += last
    last = uptime
  return total + last


class Preempted(Exception):
  """An arm's training stopped on SIGTERM after saving a checkpoint (the grid stops there)."""


def run_arm(a, cfg, workdir: str, mesh, reevaluate: bool = False) -> Dict[str, Any]:
  """Trains (or resumes) one arm and evaluates its final checkpoint; returns its record.

  A finished arm is kept as it is; with ``reevaluate`` its last checkpoint is evaluated again by
  the evaluators of ``cfg`` (for example after a probe was added) and only the record's evaluation
  is replaced: its training numbers (loss, time, KNN curve) stay.
  """
  total, num_train, record = _finished(cfg, workdir)
  path = _record_path(workdir)
  if record is not None:
    if not reevaluate:
      logging.info("arm %s: finished earlier, kept", a["name"])
      return record
    logging.info("arm %s: finished earlier, evaluating its checkpoint again", a["name"])
    return _write_record(path, dict(record, **_evaluate(a, cfg, workdir, mesh, total)))
  earlier = _earlier_runs_seconds(workdir)
  t0 = time.perf_counter()
  results = trainer.train_and_evaluate(cfg, workdir, evaluators=registry.build)
  if results.get("preempted"):
    raise Preempted(f"arm {a['name']} stopped by SIGTERM at step {results['step']} (checkpoint "
                    "saved); rerun the same command to resume")
  train_seconds = earlier + time.perf_counter() - t0
  evaluated = _evaluate(a, cfg, workdir, mesh, total)
  return _write_record(path, dict(
      name=a["name"], grid=a["grid"], overrides=a["overrides"], step=evaluated.pop("step"),
      alpha_min=cfg.model.alpha_min, shortcut_form=cfg.model.shortcut_form,
      lr=cfg.optim.lr, epochs=cfg.num_epochs, batch_size=cfg.batch_size,
      final_loss=results.get("loss"), train_seconds=train_seconds, **evaluated,
      knn_curve=_knn_curve(workdir, cfg.batch_size, num_train)))


def _finished(cfg, workdir: str):
  """``(total steps, training images, record)`` of one arm; record is None until it is finished."""
  num_train = pipeline.dataset_info(cfg.data)["num_train"]
  total, _ = config_lib.steps_for(cfg, num_train)
  path = _record_path(workdir)
  if not paths.exists(path):
    return total, num_train, None
  record = paths.read_json(path)
  return total, num_train, record if record.get("step") == total else None


def check_reevaluable(a, cfg, workdir: str) -> None:
  """Raises a one-line ValueError when ``a`` is finished but its final checkpoint is gone."""
  total, _, record = _finished(cfg, workdir)
  if record is None:
    return  # not finished: it trains first
  steps = ckpt_lib.checkpoint_steps(workdir)
  if total not in steps:
    raise ValueError(f"reevaluate=True is not allowed for arm {a['name']}: {workdir!r} has no "
                     f"final checkpoint (step {total}; it has {steps or 'none'})")


def _evaluate(a, cfg, workdir: str, mesh, total: int) -> Dict[str, Any]:
  """The evaluation fields of an arm's record, from its last checkpoint (which must be final)."""
  params, step = ckpt_lib.restore_run_params(workdir, mesh)
  if step != total:
    raise ValueError(f"workdir={workdir!r} is not allowed; its last checkpoint is step {step}, "
                     f"not the final step {total}")
  model = suite.run_model(cfg, params)
  t0 = time.perf_counter()
  ev = suite.evaluate_model(a["name"], model, params, cfg.data, cfg.evals,
                            ["knn", "linear", "layers", "rank"], mesh, {"workdir": workdir},
                            layer_features=[f for f in LAYER_FEATURES
                                            if f != cfg.evals.layers.feature])
  layers = {cfg.evals.layers.feature: ev["sections"]["layers"],
            **ev["sections"].pop("layers_by_feature", {})}
  return dict(step=step, eval_seconds=time.perf_counter() - t0, evaluation=ev,
              layers_by_feature=layers)


def _write_record(path: str, record: Dict[str, Any]) -> Dict[str, Any]:
  paths.write_json(path, record)
  return record


# ------------------------------------------------------------------------------------------------
# Table and plots


def _pct(x) -> str:
  return "-" if x is None else f"{100 * x:.2f}"


def _probe(record, feature: str, protocol: str = "official"):
  """Top-1 of a linear probe on the last block for one feature choice (or None: not measured)."""
  res = record["evaluation"]["sections"].get("linear", {}).get(protocol, {}).get("results", {})
  return res.get(feature, {}).get("top1")


def _alpha_text(r) -> str:
  """alpha_min as the table prints it: '-' for the controls that have no schedule."""
  return "-" if r["shortcut_form"] in UNSCHEDULED_FORMS else f"{r['alpha_min']:g}"


def _arm_label(r) -> str:
  if r["shortcut_form"] in UNSCHEDULED_FORMS:
    head = r["shortcut_form"]
  else:
    form = "" if r["shortcut_form"] == "decay" else f"{r['shortcut_form']} "
    head = f"{form}a{r['alpha_min']:g}"
  return f"{head}, lr {r['lr']:g}, {r['epochs']:g} ep"


def table(records: Sequence[Dict[str, Any]]) -> str:
  lines = [
      "| arm | alpha_min | form | lr | epochs | final loss | KNN last | KNN best (block) | "
      "probe mean | probe mean+LN | probe cls | probe cls+LN | probe mean, std. | "
      "fast linear best (block) / last | train | eval |",
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in records:
    lay = r["layers_by_feature"]["mean"]
    knn_last = r["evaluation"]["sections"]["knn"]["top1"]
    lines.append(
        f"| {r['name']} | {_alpha_text(r)} | {r['shortcut_form']} | {r['lr']:g} | "
        f"{r['epochs']:g} | {r['final_loss']:.4f} | {_pct(knn_last)} | "
        f"{_pct(lay['knn']['best'])} ({lay['knn']['best_block'] + 1}) | "
        + " | ".join(_pct(_probe(r, f)) for f in ("mean", "mean_ln", "cls", "cls_ln"))
        + f" | {_pct(_probe(r, 'mean', 'official_std'))}"
        + f" | {_pct(lay['linear']['best'])} ({lay['linear']['best_block'] + 1}) / "
        f"{_pct(lay['linear']['last'])} | {r['train_seconds'] / 60:.1f} min | "
        f"{r['eval_seconds'] / 60:.1f} min |")
  return "\n".join(lines)


def _blocks(numbers: Sequence[int]) -> str:
  """1-based block numbers as compact ranges: [1, 2, 3, 7] -> '1-3, 7'; none -> '-'."""
  runs: List[List[int]] = []
  for b in numbers:
    if runs and b == runs[-1][-1] + 1:
      runs[-1].append(b)
    else:
      runs.append([b])
  return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs) or "-"


def _is_baseline(r) -> bool:
  """Whether ``r`` is a standard residual arm (alpha_min 1, plain shortcuts)."""
  return r["shortcut_form"] == "decay" and r["alpha_min"] == 1.0


def baseline_of(r, records):
  """The standard residual arm trained like ``r`` (same lr and epochs), or None."""
  for b in records:
    if (_is_baseline(b) and b["lr"] == r["lr"] and b["epochs"] == r["epochs"]
        and b["name"] != r["name"]):
      return b
  return None


def difference_table(records: Sequence[Dict[str, Any]]) -> str:
  """Every other arm minus its baseline (``baseline_of``), in points of top-1.

  A difference under ``NOISE_POINTS`` is not resolved by one seed on 2,000 images (the binomial
  95% interval of one accuracy near 40% is +-2.2 points); the last column lists the blocks where
  the arm is ahead of the baseline by more than that, with the token mean and with the cls token.
  """
  lines = [
      "| arm | minus | KNN last | KNN best | probe mean | probe mean+LN | probe cls | "
      "probe cls+LN | cls KNN best | fast linear best | probe mean, std. | blocks ahead by > "
      f"{NOISE_POINTS:g} (mean KNN / cls KNN) |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
  def cells(r):
    lay = r["layers_by_feature"]
    return ([r["evaluation"]["sections"]["knn"]["top1"], lay["mean"]["knn"]["best"]]
            + [_probe(r, f) for f in ("mean", "mean_ln", "cls", "cls_ln")]
            + [lay["cls"]["knn"]["best"] if "cls" in lay else None, lay["mean"]["linear"]["best"],
               _probe(r, "mean", "official_std")])
  for r in records:
    b = baseline_of(r, records)
    if b is None or _is_baseline(r):
      continue
    diffs = ["-" if x is None or y is None else f"{100 * (x - y):+.2f}"
             for x, y in zip(cells(r), cells(b))]
    ahead = []
    for feature in ("mean", "cls"):
      mine = r["layers_by_feature"].get(feature, {}).get("knn_top1", [])
      base = b["layers_by_feature"].get(feature, {}).get("knn_top1", [])
      ahead.append(_blocks([i + 1 for i, (x, y) in enumerate(zip(mine, base))
                            if 100 * (x - y) > NOISE_POINTS]))
    lines.append(f"| {r['name']} | {b['name']} | " + " | ".join(diffs)
                 + f" | {' / '.join(ahead)} |")
  return "\n".join(lines)


def layer_table(records: Sequence[Dict[str, Any]]) -> str:
  """Top-1 of every block for every arm, feature choice and probe (KNN; fast linear probe)."""
  depth = max(len(r["layers_by_feature"]["mean"]["knn_top1"]) for r in records)
  lines = ["| arm | feature | probe | " + " | ".join(str(b) for b in range(1, depth + 1))
           + " | best (block) |", "|---|---|---|" + "---:|" * (depth + 1)]
  for r in records:
    for feature, lay in r["layers_by_feature"].items():
      for probe, key in (("KNN", "knn"), ("linear", "linear")):
        cells = [_pct(v) for v in lay[f"{key}_top1"]] + ["-"] * (depth - len(lay[f"{key}_top1"]))
        best = f"{_pct(lay[key]['best'])} ({lay[key]['best_block'] + 1})"
        lines.append(f"| {r['name']} | {feature} | {probe} | " + " | ".join(cells)
                     + f" | {best} |")
  return "\n".join(lines)


def _groups(records):
  """Records grouped by (lr, epochs): the arms whose curves differ only in the shortcuts."""
  out: Dict[tuple, list] = {}
  for r in records:
    out.setdefault((r["lr"], r["epochs"]), []).append(r)
  return out


def plot_layers(records, path: str) -> None:
  """One row per (lr, epochs) group, one column per feature choice; KNN solid, linear dashed."""
  import numpy as np
  groups = _groups(records)
  features = list(dict.fromkeys(f for r in records for f in r["layers_by_feature"]))
  size = (4.6 * len(features), 3.8 * len(groups))
  with plots.figure(path, len(groups), len(features), size=size, dpi=110) as (_, axes):
    for row, ((lr, epochs), rs) in enumerate(sorted(groups.items())):
      for col, feature in enumerate(features):
        ax = axes[row, col]
        if not any(feature in r["layers_by_feature"] for r in rs):
          ax.text(0.5, 0.5, "not recorded for these arms", ha="center", transform=ax.transAxes)
        for i, r in enumerate(rs):
          lay = r["layers_by_feature"].get(feature)
          if lay is None:  # an archived record may carry fewer feature choices
            continue
          xs = range(1, len(lay["knn_top1"]) + 1)
          ax.plot(xs, 100 * np.asarray(lay["knn_top1"]), marker="o", ms=3, color=f"C{i}",
                  label=_arm_label(r))
          ax.plot(xs, 100 * np.asarray(lay["linear_top1"]), ls="--", color=f"C{i}")
        plots.style(ax, f"{feature}: KNN (solid), fast linear (dashed); lr {lr:g}, "
                    f"{epochs:g} ep", "block", "top-1 (%)",
                    legend=6 if col == 0 else None, title_size=9)


def plot_alpha(records, path: str) -> None:
  decay = [r for r in records if r["shortcut_form"] == "decay"]
  metrics = (("KNN, last block", lambda r: r["evaluation"]["sections"]["knn"]["top1"]),
             ("KNN, best block", lambda r: r["layers_by_feature"]["mean"]["knn"]["best"]),
             ("linear probe (official), mean", lambda r: _probe(r, "mean")),
             ("linear probe (official), cls", lambda r: _probe(r, "cls")))
  with plots.figure(path, 1, len(metrics), size=(5 * len(metrics), 4), dpi=110) as (_, axes):
    for ax, (title, get) in zip(axes[0], metrics):
      for (lr, epochs), rs in sorted(_groups(decay).items()):
        rs = sorted(rs, key=lambda r: r["alpha_min"])
        vals = [get(r) for r in rs]
        if any(v is None for v in vals):
          continue
        ax.plot([r["alpha_min"] for r in rs], [100 * v for v in vals], marker="o",
                label=f"lr {lr:g}, {epochs:g} ep")
      plots.style(ax, title, "alpha_min (1 = standard residual)", "top-1 (%)", legend=8)


def plot_epochs(records, path: str, unfinished: Sequence[Dict[str, Any]] = ()) -> None:
  """KNN of the last block over training, one panel per lr; unfinished arms dashed."""
  groups = _groups(list(records) + list(unfinished))
  with plots.figure(path, 1, len(groups), size=(6 * len(groups), 4), dpi=110) as (_, axes):
    for ax, ((lr, _), rs) in zip(axes[0], sorted(groups.items())):
      for r in rs:
        if r["knn_curve"]:
          xs, ys = zip(*r["knn_curve"])
          label = _arm_label(r) + (f" (unfinished, epoch {xs[-1]:.0f})" if r.get("unfinished")
                                   else "")
          ax.plot(xs, [100 * y for y in ys], marker=".", ls="--" if r.get("unfinished") else "-",
                  label=label)
      plots.style(ax, f"KNN top-1 of the last block during training; lr {lr:g}", "epoch",
                  "top-1 (%)", legend=7)


def write_summary(workdir: str, records: Sequence[Dict[str, Any]], budget: str,
                  unfinished: Sequence[Dict[str, Any]] = ()) -> str:
  """study.md / study.json / the three plots over the finished ``records``.

  ``unfinished`` arms (``unfinished_curves``: still training or interrupted) add their KNN curve
  so far to knn_vs_epochs.png and one line each to study.md.
  """
  lines = [budget, "", table(records), "", "Against the baseline trained alike (points of top-1):",
           "", difference_table(records), "", "Per block (1-based):", "", layer_table(records), ""]
  for r in unfinished:
    last = (f"epoch {r['knn_curve'][-1][0]:.1f}, KNN {_pct(r['knn_curve'][-1][1])}"
            if r["knn_curve"] else "no KNN logged yet")
    lines.append(f"Unfinished: {r['name']} ({last}; of {r['epochs']:g} epochs).")
  text = "\n".join(lines)
  paths.write_text(paths.join(workdir, "study.md"), text)
  paths.write_json(paths.join(workdir, "study.json"), [
      {k: v for k, v in r.items() if k != "evaluation"}
      | {"knn_last": r["evaluation"]["sections"]["knn"]["top1"]} for r in records])
  plot_layers(records, paths.join(workdir, "accuracy_vs_layer.png"))
  plot_alpha(records, paths.join(workdir, "accuracy_vs_alpha.png"))
  plot_epochs(records, paths.join(workdir, "knn_vs_epochs.png"), unfinished)
  return text


def unfinished_curves(workdir: str) -> List[Dict[str, Any]]:
  """Arms started but not finished (no record yet): their settings and KNN curve so far.

  Lets ``--report_only`` show a grid in progress; the table lists finished arms only.
  """
  out = []
  for name, arm_dir in _arm_dirs(workdir):
    if (paths.exists(_record_path(arm_dir))
        or not paths.exists(paths.join(arm_dir, "config.json"))):
      continue
    cfg = tasks.run_config(arm_dir)
    curve = _knn_curve(arm_dir, cfg.batch_size, pipeline.dataset_info(cfg.data)["num_train"])
    out.append(dict(name=name, alpha_min=cfg.model.alpha_min, shortcut_form=cfg.model.shortcut_form,
                    lr=cfg.optim.lr, epochs=cfg.num_epochs, knn_curve=curve, unfinished=True))
  return out


def finished_records(workdir: str, archive: str = "") -> List[Dict[str, Any]]:
  """The records of every finished arm under the study ``workdir``, sorted by arm name.

  With an ``archive`` directory (``archive_records``), its records of arms that the workdir lacks
  are included too, so arms trained in a workdir that is gone stay in the table and plots.
  """
  found: Dict[str, Dict[str, Any]] = {}
  if archive and paths.resolve(archive).is_dir():
    for path in paths.list_files(archive, (".json",)):
      record = paths.read_json(path)
      found[record["name"]] = record
  for _, record in _workdir_records(workdir):
    found[record["name"]] = record
  return [found[name] for name in sorted(found)]


def _workdir_records(workdir: str):
  """Yields (arm directory name, record) of every finished arm under the study ``workdir``."""
  for name, arm_dir in _arm_dirs(workdir):
    path = _record_path(arm_dir)
    if paths.exists(path):
      yield name, paths.read_json(path)


def archive_records(workdir: str, archive: str) -> List[str]:
  """Copies the record of every finished arm in ``workdir`` to ``archive/<arm>.json``.

  A record is a few tens of kB of numbers (no weights), so the archive can live in the repository
  (``research/small_scale_study/records``) and outlive the workdir, whose checkpoints are gigabytes. Returns the
  names written; a record already archived with the same content is left alone.
  """
  written = []
  for name, record in _workdir_records(workdir):
    text = json.dumps(record, indent=1) + "\n"
    target = paths.join(archive, f"{name}.json")
    if paths.exists(target) and paths.read_text(target) == text:
      continue
    paths.write_text(target, text)
    written.append(name)
  return written


def budget(base) -> str:
  return (f"Every arm: {base.model.preset} MAE, batch {base.batch_size}, warmup "
          f"{base.warmup_epochs:g} epochs, data {base.data.dataset} ({base.data.train_split} to "
          f"train, {base.data.eval_split} to evaluate), seed {base.seed}; arms differ only in the "
          "fields in their names. Probes: KNN k 20 T 0.07 on the mean of all tokens; linear probe "
          "of the official protocol on the last block per feature (\"probe mean, std.\": the same "
          "probe on the token mean standardised per dimension, official_std; '-' where not "
          "measured); fast linear probe per block. Block numbers are 1-based.")
