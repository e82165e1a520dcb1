"""``python -m decay_jax.sample``: an older name of ``python -m decay_jax.cli.sample``, the documented one.

Kept so that existing scripts keep working; its ``--help`` lists the command's flags.
"""

from absl import flags

from decay_jax.cli import sample
from decay_jax.cli.sample import run

flags.adopt_module_key_flags(sample)

if __name__ == "__main__":
  run()
