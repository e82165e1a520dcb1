"""Evaluate the frozen encoder of trained or converted MAE checkpoints and write a report.

    python -m decay_jax.cli.evaluate --workdir=DIR[,DIR2,...] [--evals=knn,linear,layers,rank]
    python -m decay_jax.cli.evaluate --checkpoint=PARAMS_DIR --config=configs/mae_vit_b16.py \\
        --config.data.data_dir=$TFDS_DIR --config.evals.linear.protocols=official,mae

``--workdir`` is a training run of ``decay_jax.main`` / ``decay_jax.cli.compare`` (its newest checkpoint,
or ``--step``); ``--checkpoint`` a params directory written by ``python -m decay_jax.io.convert`` (the
official PyTorch weights). Both flags take comma-separated lists and may be combined: every model
gets its own table and the plots overlay them. Data and evaluator settings come from ``--config``
(with ``--config.evals.<name>.<field>=...`` overrides) when given, otherwise from the run's saved
``config.json`` (evaluator fields it lacks take the defaults of ``mae_config()``); ``--checkpoint``
needs ``--config``. The evaluators are the ones training runs (``decay_jax.evals.registry``):

  ``knn``     weighted KNN of the last block (k 20, T 0.07, cosine; our protocol)
  ``linear``  linear probes of the last block: ``official``, ``official_std`` (the same on
              standardised features) and/or ``mae`` protocols, one head per feature choice (cls /
              patch mean / mean of all tokens, with or without LayerNorm)
  ``layers``  KNN and a fast linear probe on every block (curves; best block against last block)
  ``rank``    effective rank per block (spectral entropy rho, exp(rho)) and branch ratios
              ``||f(x)|| / ||alpha x||`` per sublayer

Writes ``OUT/evaluation.json``, ``OUT/report.md`` and the PNG plots; ``--out`` defaults to
``DIR/evaluation`` for a single model and is required for several.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

from absl import flags
from ml_collections import config_flags

from decay_jax import logs, paths
from decay_jax import sharding as shd
from decay_jax.cli import errors
from decay_jax.evals import registry, report, suite
from decay_jax.train import checkpoint as ckpt_lib

EVALS = tuple(registry.EVALUATORS)
WEIGHTS = ("params", "ema")

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file whose data and evals sections are used (optional with --workdir).",
    lock_config=True)
_WORKDIR = flags.DEFINE_list("workdir", [], "Training workdirs (their newest checkpoint).")
_CHECKPOINT = flags.DEFINE_list("checkpoint", [], "Converted params dirs (decay_jax.io.convert).")
_NAMES = flags.DEFINE_list("names", [], "Labels of the models (default: directory names).")
_EVALS = flags.DEFINE_list("evals", list(EVALS), "Evaluators to run: " + ", ".join(EVALS))
_OUT = flags.DEFINE_string("out", None, "Output directory (default DIR/evaluation for one model).")
_STEP = flags.DEFINE_integer("step", -1, "Checkpoint step of --workdir runs (-1: the newest).")
_WEIGHTS = flags.DEFINE_enum("weights", "params", list(WEIGHTS),
                             "Which weights of a training checkpoint: params or their EMA.")
_FSDP = flags.DEFINE_integer("fsdp", 1, "Devices that split each parameter (mesh fsdp axis).")


def _models(mesh):
  """Yields ``(name, model, params, data_cfg, evals_cfg, source)`` for every requested model."""
  import jax
  given = _CONFIG.value
  given_paths = ([("workdir", p) for p in _WORKDIR.value]
                 + [("checkpoint", p) for p in _CHECKPOINT.value])
  labels = _NAMES.value or [paths.resolve(p).name for _, p in given_paths]
  for (kind, path), label in zip(given_paths, labels):
    path = str(paths.resolve(path))
    if kind == "workdir":
      run_cfg = ckpt_lib.run_config(path, task="mae")
      params, step = ckpt_lib.restore_run_params(path, mesh, _STEP.value, _WEIGHTS.value)
      model = suite.run_model(run_cfg, params)
      source = {"workdir": path, "step": step, "weights": _WEIGHTS.value}
      data_cfg, evals_cfg = (given.data, given.evals) if given else (run_cfg.data, run_cfg.evals)
    else:
      model, params = ckpt_lib.load_params(path, "checkpoint")
      params = jax.device_put(params, shd.param_shardings(params, mesh))
      source = {"checkpoint": path}
      data_cfg, evals_cfg = given.data, given.evals
    suite.check_data(model, data_cfg, f"{kind}={path!r}")
    yield label, model, params, data_cfg, evals_cfg, source


def _check_flags() -> Optional[str]:
  """One line for the first bad flag, or None."""
  given_paths = _WORKDIR.value + _CHECKPOINT.value
  if not given_paths:
    return "give --workdir=DIR or --checkpoint=PATH (comma-separated lists allowed)"
  if _CHECKPOINT.value and _CONFIG.value is None:
    return ("--checkpoint needs --config=FILE for its data and evaluator settings "
            "(e.g. configs/mae_vit_b16.py)")
  if _NAMES.value and len(_NAMES.value) != len(given_paths):
    return f"--names has {len(_NAMES.value)} labels for {len(given_paths)} models"
  if len(set(_NAMES.value)) != len(_NAMES.value):
    return f"--names={_NAMES.value} must be distinct"
  bad = [e for e in _EVALS.value if e not in registry.EVALUATORS]
  if bad or not _EVALS.value:
    return f"--evals={_EVALS.value} is not allowed; choose from {', '.join(registry.EVALUATORS)}"
  if _OUT.value is None and len(given_paths) > 1:
    return "--out=DIR is required with several models"
  if _CONFIG.value is not None and _CONFIG.value.task != "mae":
    return f"--config task={_CONFIG.value.task!r} is not allowed; the evaluators need 'mae'"
  return None


def main(argv):
  del argv
  logs.quiet_libraries()
  error = _check_flags()
  if error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  import jax
  first = (_WORKDIR.value + _CHECKPOINT.value)[0]
  out = str(paths.resolve(_OUT.value or paths.join(first, "evaluation")))
  names = list(dict.fromkeys(_EVALS.value))
  records = []
  t0 = time.perf_counter()
  try:
    mesh = shd.make_mesh(-1, _FSDP.value)
    for label, model, params, data_cfg, evals_cfg, source in _models(mesh):
      records.append(suite.evaluate_model(label, model, params, data_cfg, evals_cfg, names, mesh,
                                    source))
  except ValueError as e:  # bad paths or settings: one line, no traceback
    print(f"error: {e}", file=sys.stderr)
    return 2
  if jax.process_index() == 0:
    command = "python -m decay_jax.cli.evaluate " + " ".join(sys.argv[1:])
    files = report.write(out, records, command=command,
                         device=f"{jax.device_count()} x {jax.devices()[0].device_kind}",
                         seconds=time.perf_counter() - t0)
    print(report.summary_table(records))
    print(f"\nreport: {files['report']}")
  return 0


def run():
  errors.run(main)


if __name__ == "__main__":
  run()
