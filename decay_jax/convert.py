"""``python -m decay_jax.convert``: the converter's short name (``decay_jax.io.convert``)."""

from decay_jax.io.convert import run

if __name__ == "__main__":
  run()
