"""``python -m decay_jax.sample``: the short name of ``decay_jax.cli.sample``."""

from decay_jax.cli.sample import run

if __name__ == "__main__":
  run()
