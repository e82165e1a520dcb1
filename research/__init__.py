"""Research projects built on decay-jax, beside the library (not part of the installed package)."""
