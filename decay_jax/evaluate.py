"""``python -m decay_jax.evaluate``: the short name of ``decay_jax.cli.evaluate``."""

from decay_jax.cli.evaluate import run

if __name__ == "__main__":
  run()
