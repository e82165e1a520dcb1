"""``python -m decay_jax.main``: an older name of ``python -m decay_jax.cli.train``, the documented one.

Kept so that existing scripts keep working; its ``--help`` lists the command's flags.
"""

from absl import flags

from decay_jax.cli import train
from decay_jax.cli.train import run

flags.adopt_module_key_flags(train)

if __name__ == "__main__":
  run()
