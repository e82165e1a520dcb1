"""Train MAE or SiT with decayed identity shortcuts (``decay-jax-train`` or ``python -m decay_jax.cli.train``).

    python -m decay_jax.cli.train --config=configs/mae_vit_b16.py --workdir=DIR \
        --config.model.alpha_min=0.7 --config.batch_size=8192

Every config field can be overridden on the command line; the config is locked, so a misspelt
field is an error. Rerunning the same command resumes from the newest checkpoint in ``--workdir``.
On several hosts set ``DECAY_JAX_DISTRIBUTED=1`` (the launch/ scripts do) so that
``jax.distributed.initialize()`` runs first. The evaluators of ``config.evals``
(``decay_jax.evals.registry``: representation evaluators; for SiT and U-ViT the generation metrics
of ``evals.generation`` when enabled) run during training; their inputs are checked first.

The run holds ``--workdir`` (``workdir/lease.json``) before it writes anything there, so a second
run on the same workdir stops at once. Every runtime failure ends in one line and an exit status of
its own (``decay_jax.train.failures``): 3 diverged, 73 workdir held by another run, 74 disk or quota
full, 75 object store unreachable, 143 stopped by SIGTERM (preempted; rerunning resumes).
"""

import os
import sys

import jax
from absl import flags, logging
from ml_collections import config_flags

from decay_jax import logs
from decay_jax.cli import errors
from decay_jax.evals import registry
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import failures, lease, setup, tasks, trainer
from decay_jax.validate import InputError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file in configs/.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and pictures.")


def train_and_evaluate(config, workdir: str):
  """``trainer.train_and_evaluate`` with the representation evaluators of ``config.evals``."""
  return trainer.train_and_evaluate(config, workdir, evaluators=registry.build)


def main(argv):
  del argv
  logs.quiet_libraries()
  if os.environ.get("DECAY_JAX_DISTRIBUTED") == "1":
    jax.distributed.initialize()  # JAX's own SIGTERM notifier syncs the hosts' preemption
  else:
    failures.raise_on_sigterm()  # until the train loop: stop at once (nothing new to save)
  try:
    setup.check_config(_CONFIG.value)
    # the evaluators' inputs (reference batch, Inception)
    registry.check_config(_CONFIG.value, tasks.get(_CONFIG.value.task))
  except ValueError as e:  # bad config: one line, no traceback, nothing compiled
    print(f"error: {e}", file=sys.stderr)
    return 2
  workdir = _WORKDIR.value
  try:
    with lease.acquire(workdir):  # before anything is written there
      results = train_and_evaluate(_CONFIG.value, workdir)
  except failures.Terminated:
    raise failures.Stopped(
        "stopped by SIGTERM outside the train loop (startup, restore, compilation, or after the "
        f"last step), with nothing new to save; {ckpt_lib.describe_steps(workdir)}") from None
  except (failures.RunFailure, ckpt_lib.CheckpointError, InputError):
    raise
  except Exception as e:  # pylint: disable=broad-except
    failure = failures.from_exception(e, workdir, (
        None if failures.unreachable(e) else ckpt_lib.describe_steps(workdir)))
    if failure is None:
      raise
    raise failure from None
  logging.info("results: %s", logs.compact_results(results))
  return failures.PREEMPTED if results.get("preempted") else 0


def run():
  flags.mark_flags_as_required(["config", "workdir"])
  errors.run(main)


if __name__ == "__main__":
  run()
