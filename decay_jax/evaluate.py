"""Evaluate the frozen encoder of trained or converted MAE checkpoints and write a report.

    python -m decay_jax.evaluate --workdir=DIR[,DIR2,...] [--evals=knn,linear,layers,rank]
    python -m decay_jax.evaluate --checkpoint=PARAMS_DIR --config=configs/mae_vit_b16.py \\
        --config.data.data_dir=$TFDS_DIR --config.evals.linear.protocols=official,mae

``--workdir`` is a training run of ``decay_jax.main`` / ``decay_jax.compare`` (its newest checkpoint,
or ``--step``); ``--checkpoint`` a params directory written by ``python -m decay_jax.convert`` (the
official PyTorch weights). Both flags take comma-separated lists and may be combined: every model
gets its own table and the plots overlay them. Data and evaluator settings come from ``--config``
(with ``--config.evals.<name>.<field>=...`` overrides) when given, otherwise from the run's saved
``config.json`` (evaluator fields it lacks take the defaults of ``mae_config()``); ``--checkpoint``
needs ``--config``. The evaluators are the ones training runs (``decay_jax.evals.runner``):

  ``knn``     weighted KNN of the last block (k 20, T 0.07, cosine; our protocol)
  ``linear``  linear probes of the last block: ``official`` and/or ``mae`` protocols, one head per
              feature choice (cls / patch mean / mean of all tokens, with or without LayerNorm)
  ``layers``  KNN and a fast linear probe on every block (curves; best block against last block)
  ``rank``    effective rank per block (spectral entropy rho, exp(rho)) and branch ratios
              ``||f(x)|| / ||alpha x||`` per sublayer

Writes ``OUT/evaluation.json``, ``OUT/report.md`` and the PNG plots; ``--out`` defaults to
``DIR/evaluation`` for a single model and is required for several.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, Optional

from absl import app, flags, logging
from ml_collections import config_flags

EVALS = ("knn", "linear", "layers", "rank")
WEIGHTS = ("params", "ema")

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file whose data and evals sections are used (optional with --workdir).",
    lock_config=True)
_WORKDIR = flags.DEFINE_list("workdir", [], "Training workdirs (their newest checkpoint).")
_CHECKPOINT = flags.DEFINE_list("checkpoint", [], "Converted params dirs (decay_jax.convert).")
_NAMES = flags.DEFINE_list("names", [], "Labels of the models (default: directory names).")
_EVALS = flags.DEFINE_list("evals", list(EVALS), "Evaluators to run: " + ", ".join(EVALS))
_OUT = flags.DEFINE_string("out", None, "Output directory (default DIR/evaluation for one model).")
_STEP = flags.DEFINE_integer("step", -1, "Checkpoint step of --workdir runs (-1: the newest).")
_WEIGHTS = flags.DEFINE_enum("weights", "params", list(WEIGHTS),
                             "Which weights of a training checkpoint: params or their EMA.")
_FSDP = flags.DEFINE_integer("fsdp", 1, "Devices that split each parameter (mesh fsdp axis).")


# ------------------------------------------------------------------------------------------------
# Configs and checkpoints


def run_config(workdir: str):
  """The MAE config a run was trained with (see ``checkpoint.run_config``)."""
  from decay_jax import checkpoint
  return checkpoint.run_config(workdir, task="mae")


def restore_run_params(workdir: str, mesh, step: int = -1, weights: str = "params"):
  from decay_jax import checkpoint
  return checkpoint.restore_run_params(workdir, mesh, step, weights)


def run_model(config, params):
  """The model of a run's config; channels from the checkpoint's patch-embedding kernel."""
  from decay_jax.train import config as config_lib
  channels = int(params["patch_embed"]["proj"]["kernel"].shape[2])
  return config_lib.build_model(config, {"image_size": config.data.image_size,
                                         "channels": channels})


def model_summary(model) -> Dict[str, Any]:
  from decay_jax import checkpoint as ckpt_lib
  sc = model.shortcuts
  return dict(ckpt_lib.model_fields(model), alpha_eff=sc.alpha_eff, alphas=sc.alphas.tolist(),
              branch_scale=sc.branch_scale)


# ------------------------------------------------------------------------------------------------
# Evaluation


def _check_data(model, data_cfg, label: str) -> None:
  from decay_jax.data import pipeline
  info = pipeline.dataset_info(data_cfg)
  if info["image_size"] != model.img_size or info["channels"] != model.in_chans:
    raise ValueError(f"data.image_size={info['image_size']} with {info['channels']} channels is not "
                     f"allowed for {label}; its model takes {model.img_size} px, "
                     f"{model.in_chans} channels")


def evaluate_model(name: str, model, params, data_cfg, evals_cfg, names, mesh,
                   source: Dict[str, Any]) -> Dict[str, Any]:
  """Runs the evaluators ``names`` on one model; returns its JSON record."""
  import ml_collections
  from decay_jax.evals import features, runner
  from decay_jax.train import tasks
  config = ml_collections.ConfigDict({"task": "mae", "data": data_cfg.to_dict(),
                                      "evals": evals_cfg.to_dict()})
  record = {"name": name, "source": source, "model": model_summary(model),
            "data": data_cfg.to_dict(), "sections": {}, "seconds": {}, "settings": {}}
  built = runner.build(config, tasks.MAETask(model), mesh, names)  # checks every name first
  # One encoder pass per image set for all evaluators (they pool different blocks and tokens).
  batch = max(int(config.evals[k].batch_size) for k in built)
  cache = features.FeatureCache(model, params, mesh, batch)
  for evaluator in built.values():
    if hasattr(evaluator, "requests"):
      for request in evaluator.requests():
        cache.want(*request)
      evaluator.cache = cache
  for key, evaluator in built.items():
    t0 = time.perf_counter()
    logging.info("[%s] %s ...", name, key)
    sections = evaluator.evaluate(params)
    record["seconds"][key] = time.perf_counter() - t0
    record["sections"].update(sections)
    record["settings"][key] = config.evals[key].to_dict()
    logging.info("[%s] %s done in %.1f s", name, key, record["seconds"][key])
  return record


def _models(mesh):
  """Yields ``(name, model, params, data_cfg, evals_cfg, source)`` for every requested model."""
  import jax
  from decay_jax import checkpoint as ckpt_lib
  from decay_jax import sharding as shd
  given = _CONFIG.value
  paths = [("workdir", p) for p in _WORKDIR.value] + [("checkpoint", p) for p in _CHECKPOINT.value]
  labels = _NAMES.value or [os.path.basename(os.path.normpath(p)) for _, p in paths]
  for (kind, path), label in zip(paths, labels):
    path = os.path.abspath(path)
    if kind == "workdir":
      run_cfg = run_config(path)
      params, step = restore_run_params(path, mesh, _STEP.value, _WEIGHTS.value)
      model = run_model(run_cfg, params)
      source = {"workdir": path, "step": step, "weights": _WEIGHTS.value}
      data_cfg, evals_cfg = (given.data, given.evals) if given else (run_cfg.data, run_cfg.evals)
    else:
      model, params = ckpt_lib.load_params(path)
      params = jax.device_put(params, shd.param_shardings(params, mesh))
      source = {"checkpoint": path}
      data_cfg, evals_cfg = given.data, given.evals
    _check_data(model, data_cfg, f"{kind}={path!r}")
    yield label, model, params, data_cfg, evals_cfg, source


def _check_flags() -> Optional[str]:
  """One line for the first bad flag, or None."""
  from decay_jax.evals import runner
  paths = _WORKDIR.value + _CHECKPOINT.value
  if not paths:
    return "give --workdir=DIR or --checkpoint=PATH (comma-separated lists allowed)"
  if _CHECKPOINT.value and _CONFIG.value is None:
    return ("--checkpoint needs --config=FILE for its data and evaluator settings "
            "(e.g. configs/mae_vit_b16.py)")
  if _NAMES.value and len(_NAMES.value) != len(paths):
    return f"--names has {len(_NAMES.value)} labels for {len(paths)} models"
  if len(set(_NAMES.value)) != len(_NAMES.value):
    return f"--names={_NAMES.value} must be distinct"
  bad = [e for e in _EVALS.value if e not in runner.MAE_EVALUATORS]
  if bad or not _EVALS.value:
    return f"--evals={_EVALS.value} is not allowed; choose from {', '.join(runner.MAE_EVALUATORS)}"
  if _OUT.value is None and len(paths) > 1:
    return "--out=DIR is required with several models"
  if _CONFIG.value is not None and _CONFIG.value.task != "mae":
    return f"--config task={_CONFIG.value.task!r} is not allowed; the evaluators need 'mae'"
  return None


def main(argv):
  del argv
  from decay_jax import logs
  logs.quiet_libraries()
  error = _check_flags()
  if error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  import jax
  from decay_jax import sharding as shd
  from decay_jax.evals import report
  paths = _WORKDIR.value + _CHECKPOINT.value
  out = os.path.abspath(_OUT.value or os.path.join(paths[0], "evaluation"))
  names = list(dict.fromkeys(_EVALS.value))
  records = []
  t0 = time.perf_counter()
  try:
    mesh = shd.make_mesh(-1, _FSDP.value)
    for label, model, params, data_cfg, evals_cfg, source in _models(mesh):
      records.append(evaluate_model(label, model, params, data_cfg, evals_cfg, names, mesh,
                                    source))
  except ValueError as e:  # bad paths or settings: one line, no traceback
    print(f"error: {e}", file=sys.stderr)
    return 2
  if jax.process_index() == 0:
    command = "python -m decay_jax.evaluate " + " ".join(sys.argv[1:])
    files = report.write(out, records, command=command,
                         device=f"{jax.device_count()} x {jax.devices()[0].device_kind}",
                         seconds=time.perf_counter() - t0)
    print(report.summary_table(records))
    print(f"\nreport: {files['report']}")
  return 0


if __name__ == "__main__":
  app.run(main)
