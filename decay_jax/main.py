"""``python -m decay_jax.main``: the training command, kept under its first name (see ``decay_jax.cli.train``)."""

from decay_jax.cli.train import run

if __name__ == "__main__":
  run()
