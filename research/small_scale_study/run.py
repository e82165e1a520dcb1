"""A grid of short MAE pretrainings, each evaluated per block, summarised in one table and plots.

    python -m research.small_scale_study.run --config=research/small_scale_study/config.py --workdir=DIR --grid=alpha,controls
    python -m research.small_scale_study.run --config=research/small_scale_study/config.py --workdir=DIR --list
    python -m research.small_scale_study.run --config=research/small_scale_study/config.py --workdir=DIR --report_only
    python -m research.small_scale_study.run --config=research/small_scale_study/config.py --workdir=DIR --reevaluate

Every arm is the config with a few fields overridden (``research/small_scale_study/study.py``); it trains in
``DIR/<arm>`` with ``decay_jax.cli.train``'s trainer (same data order, seed and augmentation for every
arm; resumable: rerun the same command after an interruption) and is then evaluated once by the
evaluators of ``decay_jax.cli.evaluate``: KNN and linear probes of the last block (``evals.knn``,
``evals.linear``: one head per feature choice), KNN and the fast linear probe of every block for
the feature choices mean, mean+LN, cls and cls+LN (``evals.layers``), and the rank pass. The KNN of
the last block logged during training (``evals.knn.every_steps``, read back from
``metrics.jsonl``) gives the curve over epochs.

Writes ``DIR/<arm>/study_record.json`` per arm and, over all finished arms of the workdir (and of
``--archive``, a directory such as ``research/small_scale_study/records`` that keeps every finished record),
``DIR/study.md`` (the table, budget and timings, every arm minus the baseline trained alike, then
every block's KNN and fast linear top-1 per arm and feature), ``DIR/study.json`` and the plots
``DIR/accuracy_vs_layer.png`` (one panel per feature choice), ``DIR/accuracy_vs_alpha.png`` and
``DIR/knn_vs_epochs.png``.

Grids (``--grid``, comma-separated; ``all`` is every grid):
  ``alpha``     alpha_min in {0.6, 0.7, 0.8, 0.9, 1.0} at the config's learning rate
  ``lr``        the same alpha_min values at the official rule lr = 1.5e-4 x batch / 256
  ``controls``  the paper's controls at alpha_min 0.6 (where they have one): both branches scaled
                by sqrt(1/2); the decay on the attention identity only; on the MLP identity only
  ``long``      alpha_min {0.6, 0.8, 1.0} for ``--long_epochs`` epochs (default 100)
"""

import sys
import time

from absl import flags, logging
from ml_collections import config_flags

from decay_jax import logs, paths
from decay_jax import sharding as shd
from decay_jax.cli import errors
from decay_jax.train import setup
from research.small_scale_study import study as study_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Base config of every arm.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (one sub-directory per arm).")
_GRID = flags.DEFINE_list("grid", ["alpha"],
                          "Grids to run: " + ", ".join(study_lib.GRID_NAMES) + ", all.")
_ONLY = flags.DEFINE_list("only", [], "Run only these arms (names as printed by --list).")
_LIST = flags.DEFINE_bool("list", False, "Print the arms of --grid and exit.")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False,
                                 "Only rebuild the table and plots from finished arms.")
_LONG_EPOCHS = flags.DEFINE_float("long_epochs", 100.0, "Epochs of the 'long' grid.")
_REEVALUATE = flags.DEFINE_bool(
    "reevaluate", False, "Evaluate finished arms again from their final checkpoint with the "
    "config's evaluators (for example after a probe was added), keeping their training record.")
_ARCHIVE = flags.DEFINE_string(
    "archive", "", "Directory that keeps a copy of every finished arm's record (for example "
    "research/small_scale_study/records in the repository); its arms join the table and plots even when their "
    "workdir is gone.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logs.quiet_libraries()
  base = _CONFIG.value
  workdir = str(paths.resolve(_WORKDIR.value))
  try:
    arms = study_lib.grid_arms(base, _GRID.value, _LONG_EPOCHS.value)
    unknown = [n for n in _ONLY.value if n not in {a["name"] for a in arms}]
    if unknown:
      raise ValueError(f"only={','.join(unknown)} is not allowed; the arms of grid="
                       f"{','.join(_GRID.value)} are {', '.join(a['name'] for a in arms)}")
    if _ONLY.value:
      arms = [a for a in arms if a["name"] in _ONLY.value]
    configs = [study_lib.arm_config(base, a) for a in arms]
    for cfg in configs:
      setup.check_config(cfg)
    if _REEVALUATE.value and not _REPORT_ONLY.value and not _LIST.value:
      for a, cfg in zip(arms, configs):
        study_lib.check_reevaluable(a, cfg, paths.join(workdir, a["name"]))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if _LIST.value:
    for a in arms:
      print(f"{a['name']:<40} {a['grid']:<9} {a['overrides']}")
    return 0
  if not _REPORT_ONLY.value:
    mesh = shd.make_mesh(-1, 1)
    t_start, done_seconds = time.perf_counter(), []
    for i, (a, cfg) in enumerate(zip(arms, configs)):
      eta = ""
      if done_seconds:
        per_arm = sum(done_seconds) / len(done_seconds)
        eta = f", ETA of the remaining arms {(len(arms) - i) * per_arm / 60:.0f} min"
      logging.info("=== arm %d/%d: %s -> %s%s", i + 1, len(arms), a["name"], workdir, eta)
      t0 = time.perf_counter()
      try:
        record = study_lib.run_arm(a, cfg, paths.join(workdir, a["name"]), mesh,
                                   reevaluate=_REEVALUATE.value)
      except study_lib.Preempted as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 143  # 128 + SIGTERM, as a process killed by it
      if record.get("train_seconds") and time.perf_counter() - t0 > 60:
        done_seconds.append(time.perf_counter() - t0)
    logging.info("grid done in %.1f min", (time.perf_counter() - t_start) / 60)
  if _ARCHIVE.value:
    written = study_lib.archive_records(workdir, _ARCHIVE.value)
    logging.info("archived %d record(s) in %s: %s", len(written), _ARCHIVE.value,
                 ", ".join(written) or "none new")
  records = study_lib.finished_records(workdir, _ARCHIVE.value)
  if not records:
    print(f"error: workdir={workdir!r} has no finished arm yet", file=sys.stderr)
    return 2
  text = study_lib.write_summary(workdir, records, study_lib.budget(base),
                                study_lib.unfinished_curves(workdir))
  print("\n" + text)
  print(f"table and plots in {workdir}")
  return 0


if __name__ == "__main__":
  errors.run(main)
