"""decay-jax: decayed identity shortcuts (arXiv 2404.10947) for MAE and SiT in JAX/Flax."""

import os

# jax's CPU SVD/eigh are LAPACK calls into scipy's OpenBLAS, which by default starts one thread per
# core for every small matrix and fights XLA's own thread pool: the rank evaluator's 65 x 192 SVDs
# ran 35x slower (38 s against 1.1 s for 500 on 2 cores). One BLAS thread is right for the small
# per-image matrices we factorise; our matmuls run in XLA, not in OpenBLAS. Set the variable
# yourself (before the first import of numpy) to choose otherwise.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
