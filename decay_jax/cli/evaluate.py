"""Evaluate the frozen encoder of trained or converted MAE checkpoints and write a report.

    python -m decay_jax.cli.evaluate --workdir=DIR[,DIR2,...] [--evals=knn,linear,layers,rank]
    python -m decay_jax.cli.evaluate --checkpoint=PARAMS_DIR --config=configs/mae_vit_b16.py \\
        --config.data.data_dir=$TFDS_DIR --config.evals.linear.protocols=official,mae

``--workdir`` is a training run of ``decay_jax.cli.train`` / ``decay_jax.cli.compare`` (its newest checkpoint,
or ``--step``), an MAE or a U-ViT (whose representation is probed at noise level ``--probe_t``,
``decay_jax.evals.diffusion_probe``; its evaluators are knn, linear and layers); ``--checkpoint`` a params directory written by ``python -m decay_jax.cli.convert`` (the
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
  ``finetune`` end-to-end fine-tuning (docs/finetune.md) with ``--finetune_config=FILE`` (and its
              ``--finetune_config.<field>=...`` overrides), initialised from each model; top-1 and
              top-5 of the last evaluation and the best top-1, beside KNN and the linear probes.
              The fine-tuning runs live in ``OUT/finetune/<name>``; a rerun resumes them.

The workbench (``decay_jax.evals.workbench``, docs/workbench.md) adds:

  ``cka``     minibatch CKA maps between the blocks of each model (``--cka_images``,
              ``--cka_batch``, ``--cka_feature``) and, with several models, between their blocks
  ``segmentation`` unsupervised segmentation by deep spectral methods (docs/segmentation.md):
              mIoU on ``--seg_data`` (a folder of images/ and masks/, or ``synthetic``), with
              ``--seg_block``, ``--seg_eigs``, ``--seg_segments``, ``--seg_clusters``, ...
  ``routing`` routing weights of a routed SiT run per bin of time (``--routing_bins``,
              ``--routing_images``)
  ``--ablate=alphas_one,alpha_min=0.8,no_identity=3,no_branch=5`` every entry one more model
              ``NAME[entry]``: the same parameters with changed coefficients or a removed branch

SiT runs are read at noise level ``--probe_t`` (``decay_jax.evals.sit_probe``); their default
evaluators are cka (and routing when routed).

Writes ``OUT/evaluation.json``, ``OUT/report.md`` and the PNG plots; ``--out`` defaults to
``DIR/evaluation`` for a single model and is required for several.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

from absl import flags
from absl import logging
from ml_collections import config_flags

from decay_jax import logs, paths
from decay_jax import sharding as shd
from decay_jax.cli import errors
from decay_jax.evals import cka, registry, report, routing_maps, suite, workbench
from decay_jax.evals.segmentation import DEFAULTS as SEG
from decay_jax.evals.segmentation import FEATURES as SEG_FEATURES
from decay_jax.evals.segmentation import SEGMENT_FEATURES as SEG_SEGMENT_FEATURES
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import tasks, trainer
from decay_jax.train.tasks.finetune import FinetuneTask

EVALS = tuple(registry.EVALUATORS) + ("finetune",) + workbench.EVALS
WEIGHTS = ("params", "ema")

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file whose data and evals sections are used (optional with --workdir).",
    lock_config=True)
_FINETUNE_CONFIG = config_flags.DEFINE_config_file(
    "finetune_config", None, "Fine-tuning config (task 'finetune') of the finetune entry; its "
    "init_from is set to each model.", lock_config=True)
_WORKDIR = flags.DEFINE_list("workdir", [], "Training workdirs (their newest checkpoint).")
_CHECKPOINT = flags.DEFINE_list("checkpoint", [], "Converted params dirs (decay_jax.cli.convert).")
_NAMES = flags.DEFINE_list("names", [], "Labels of the models (default: directory names).")
_PROBE_T = flags.DEFINE_float("probe_t", 0.01, "U-ViT and SiT runs: the noise level t_p of the "
                              "diffusion-feature probe (decay_jax.evals.diffusion_probe; SiT: "
                              "time 1 - t_p, decay_jax.evals.sit_probe).")
_EVALS = flags.DEFINE_list("evals", list(registry.EVALUATORS),
                           "Evaluators to run: " + ", ".join(EVALS) + " (finetune is added by "
                           "--finetune_config)")
_OUT = flags.DEFINE_string("out", None, "Output directory (default DIR/evaluation for one model).")
_STEP = flags.DEFINE_integer("step", -1, "Checkpoint step of --workdir runs (-1: the newest).")
_WEIGHTS = flags.DEFINE_enum("weights", "params", list(WEIGHTS),
                             "Which weights of a training checkpoint: params or their EMA.")
_FSDP = flags.DEFINE_integer("fsdp", 1, "Devices that split each parameter (mesh fsdp axis).")
_ABLATE = flags.DEFINE_list("ablate", [], "Post-training ablations, each one more model NAME[entry]:"
                            " alphas_one, alpha_min=V, shape=S, convention=C, no_identity=B, "
                            "no_branch=B, several joined by '+' (decay_jax.evals.ablation).")


def _settings_flags(prefix: str, label: str, defaults: dict, rows, rename=None) -> dict:
  """``{key: flag}``: one flag ``--PREFIX_KEY`` per row ``(key, kind, help)`` of an evaluator's
  settings, its default from ``defaults[key]``; ``kind`` is an absl flag type or a tuple of
  choices (an enum)."""
  out = {}
  for key, kind, text in rows:
    name, text = f"{prefix}_{(rename or {}).get(key, key)}", f"{label}: {text}."
    if isinstance(kind, tuple):
      out[key] = flags.DEFINE_enum(name, defaults[key], list(kind), text)
    else:
      out[key] = getattr(flags, f"DEFINE_{kind}")(name, defaults[key], text)
  return out


_CKA = _settings_flags("cka", "cka", cka.DEFAULTS, (
    ("images", "integer", "evaluation images (a multiple of --cka_batch)"),
    ("batch", "integer", "minibatch of the unbiased HSIC (>= 4)"),
    ("feature", tuple(cka.FEATURES), "'tokens' (all tokens of an image flattened) or a pooled "
     "feature choice")))
_ROUTING = _settings_flags("routing", "routing", routing_maps.DEFAULTS, (
    ("bins", "integer", "equal bins of SiT time t in [0, 1], one panel each"),
    ("images", "integer", "evaluation images per bin")))
_SEG = _settings_flags("seg", "segmentation", SEG, (  # decay_jax.evals.segmentation
    ("data", "string", "'synthetic' or a folder with images/NAME.jpg|png and masks/NAME.png"),
    ("images", "integer", "images (folder: the first N sorted names, 0 all)"),
    ("block", "integer", "block whose patch features are used (negative from the end)"),
    ("feature", tuple(SEG_FEATURES), "the block's output 'tokens' or its attention 'keys'"),
    ("eigs", "integer", "eigenvectors K of the Laplacian"),
    ("segments", "integer", "KMeans segments per image"),
    ("segment_feature", tuple(SEG_SEGMENT_FEATURES), "a segment's feature: the 'mean' of its "
     "patch features, or the reference's cls token of its box's 'crop'"),
    ("erode", "integer", "crop: erosions of the segment before its box"),
    ("dilate", "integer", "crop: dilations of the segment before its box"),
    ("clusters", "integer", "segment clusters over the set (0: classes, less the background)"),
    ("classes", "integer", "classes of the masks (0: synthetic 4, folder max label + 1)"),
    ("ignore", "integer", "the ignored mask label"),
    ("lam", "float", "weight lambda of the colour KNN affinity"),
    ("background", "bool", "the segment touching the border most is background"),
    ("seed", "integer", "KMeans and synthetic-set seed")), rename={"lam": "lambda"})


def _models(mesh):
  """Yields ``(name, model, params, data_cfg, evals_cfg, source, run_cfg)`` for every requested
  model (``run_cfg`` None for a converted checkpoint)."""
  import jax
  given = _CONFIG.value
  given_paths = ([("workdir", p) for p in _WORKDIR.value]
                 + [("checkpoint", p) for p in _CHECKPOINT.value])
  labels = _NAMES.value or [paths.resolve(p).name for _, p in given_paths]
  for (kind, path), label in zip(given_paths, labels):
    path = str(paths.resolve(path))
    if kind == "workdir":
      run_cfg = tasks.run_config(path, [n for n, t in tasks.TASKS.items() if t.probed])
      params, step = ckpt_lib.restore_run_params(path, mesh, _STEP.value, _WEIGHTS.value)
      model = workbench.run_model(run_cfg, params, _PROBE_T.value)
      source = {"workdir": path, "step": step, "weights": _WEIGHTS.value}
      data_cfg, evals_cfg = (given.data, given.evals) if given else (run_cfg.data, run_cfg.evals)
    else:
      run_cfg = None
      model, params = ckpt_lib.load_params(path, "checkpoint")
      model = workbench.checkpoint_model(model, _PROBE_T.value)
      params = jax.device_put(params, shd.param_shardings(params, mesh))
      source = {"checkpoint": path}
      data_cfg, evals_cfg = given.data, given.evals
    suite.check_data(model, data_cfg, f"{kind}={path!r}")
    yield label, model, params, data_cfg, evals_cfg, source, run_cfg


def _finetune(record: dict, source: dict, workdir: str) -> None:
  """Fine-tunes from the model of ``source`` into ``workdir`` with ``--finetune_config``; adds the
  ``finetune`` section (top-1 / top-5 of the last evaluation, best top-1, steps) to ``record``."""
  config = _FINETUNE_CONFIG.value.copy_and_resolve_references()
  config.init_from = source.get("workdir") or source["checkpoint"]
  t0 = time.perf_counter()
  logging.info("[%s] finetune into %s ...", record["name"], workdir)
  results = trainer.train_and_evaluate(config, workdir, evaluators=registry.build)
  if "accuracy/top1" not in results:
    raise ValueError("--finetune_config has evals.accuracy disabled; the finetune entry reports "
                     "its accuracy")
  record["sections"]["finetune"] = {
      "top1": results["accuracy/top1"], "top5": results["accuracy/top5"],
      "top1_best": results.get("accuracy/top1_best", results["accuracy/top1"]),
      "steps": int(results["step"]), "batch_size": config.batch_size,
      "eval_split": config.evals.accuracy.eval_split}
  record["settings"]["finetune"] = {"workdir": workdir, "config": config.to_dict()}
  record["seconds"]["finetune"] = time.perf_counter() - t0


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
  bad = [e for e in _EVALS.value if e not in EVALS]
  if bad or not _EVALS.value:
    return f"--evals={_EVALS.value} is not allowed; choose from {', '.join(EVALS)}"
  finetune = _FINETUNE_CONFIG.value
  if "finetune" in _EVALS.value and finetune is None:
    return "--evals=finetune needs --finetune_config=FILE (e.g. configs/finetune_cpu_mnist.py)"
  if finetune is not None and finetune.get("task") != FinetuneTask.name:
    return (f"--finetune_config task={finetune.get('task')!r} is not allowed; it must be "
            f"{FinetuneTask.name!r}")
  if _OUT.value is None and len(given_paths) > 1:
    return "--out=DIR is required with several models"
  if _CONFIG.value is not None:  # it must hold the sections of the representation evaluators
    missing = [e for e in _EVALS.value if e in registry.EVALUATORS
               and e not in _CONFIG.value.get("evals", {})]
    if missing:
      return (f"--config task={_CONFIG.value.task!r} is not allowed; it has no config.evals "
              f"section for {', '.join(missing)} (use an MAE config, e.g. configs/mae_cpu_mnist.py)")
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
  names = list(dict.fromkeys(_EVALS.value + (["finetune"] if _FINETUNE_CONFIG.value else [])))
  records = []
  t0 = time.perf_counter()
  try:
    mesh = shd.make_mesh(-1, _FSDP.value)
    value = lambda prefix, table: {f"{prefix}{k}": f.value for k, f in table.items()}
    bench = workbench.Workbench(**value("cka_", _CKA), **value("routing_", _ROUTING),
                                ablate=_ABLATE.value, seg=value("", _SEG))
    for label, model, params, data_cfg, evals_cfg, source, run_cfg in _models(mesh):
      where = f"{next(iter(source))}={next(iter(source.values()))!r}"
      here = [n for n in workbench.applicable(model, names, _EVALS.present, where)
              if n != "finetune"]
      for name, m, p, info in bench.variants(label, model, params):
        record = bench.evaluate(name, m, p, data_cfg, evals_cfg, here, mesh, source, run_cfg, info)
        if "finetune" in names and info is None:
          _finetune(record, source, paths.join(out, "finetune", label))
        records.append(record)
  except ValueError as e:  # bad paths or settings: one line, no traceback
    print(f"error: {e}", file=sys.stderr)
    return 2
  if jax.process_index() == 0:
    command = "python -m decay_jax.cli.evaluate " + " ".join(sys.argv[1:])
    appendix, extra = bench.finish(out, records)
    files = report.write(out, records, command=command,
                         device=f"{jax.device_count()} x {jax.devices()[0].device_kind}",
                         seconds=time.perf_counter() - t0, appendix=appendix, extra=extra)
    print(report.summary_table(records))
    print(f"\nreport: {files['report']}")
  return 0


def run():
  errors.run(main)


if __name__ == "__main__":
  run()
