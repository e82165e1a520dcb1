"""``python -m decay_jax.evaluate``: an older name of ``python -m decay_jax.cli.evaluate``, the documented one.

Kept so that existing scripts keep working; its ``--help`` lists the command's flags.
"""

from absl import flags

from decay_jax.cli import evaluate
from decay_jax.cli.evaluate import run

flags.adopt_module_key_flags(evaluate)

if __name__ == "__main__":
  run()
