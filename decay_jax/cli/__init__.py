"""The commands (``decay-jax-train``, ``-evaluate``, ``-sample``, ...): thin layers over the library.

A command is the start of a process, so this is where its environment is set: jax's CPU SVD/eigh
are LAPACK calls into scipy's OpenBLAS, which by default starts one thread per core for every
small matrix and fights XLA's own thread pool (the rank evaluator's 65 x 192 SVDs ran 35x slower on
2 cores). One BLAS thread suits the small per-image matrices we factorise; our matmuls run in XLA.
Set OPENBLAS_NUM_THREADS yourself to choose otherwise. Importing ``decay_jax`` itself changes
nothing.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
