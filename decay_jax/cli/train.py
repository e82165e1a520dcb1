"""Train MAE or SiT with decayed identity shortcuts (``decay-jax-train`` or ``python -m decay_jax.main``).

    python -m decay_jax.main --config=configs/mae_vit_b16.py --workdir=DIR \
        --config.model.alpha_min=0.7 --config.batch_size=8192

Every config field can be overridden on the command line; the config is locked, so a misspelt
field is an error. Rerunning the same command resumes from the newest checkpoint in ``--workdir``.
On several hosts set ``DECAY_JAX_DISTRIBUTED=1`` (the launch/ scripts do) so that
``jax.distributed.initialize()`` runs first. The representation evaluators of ``config.evals``
(``decay_jax.evals.registry``) run during training.
"""

import os
import sys

import jax
from absl import flags, logging
from ml_collections import config_flags

from decay_jax import logs
from decay_jax.cli import errors
from decay_jax.evals import registry
from decay_jax.train import trainer

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
    jax.distributed.initialize()
  try:
    trainer.check_config(_CONFIG.value)
  except ValueError as e:  # bad config: one line, no traceback, nothing compiled
    print(f"error: {e}", file=sys.stderr)
    return 2
  results = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  logging.info("results: %s", logs.compact_results(results))
  return 0


def run():
  flags.mark_flags_as_required(["config", "workdir"])
  errors.run(main)


if __name__ == "__main__":
  run()
