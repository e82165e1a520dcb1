"""``python -m decay_jax.convert``: the converter's short name (``decay_jax.cli.convert``)."""

from decay_jax.cli.convert import run

if __name__ == "__main__":
  run()
