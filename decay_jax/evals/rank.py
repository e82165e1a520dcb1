"""Effective rank of representations: the spectral entropy rho and Roy & Vetterli's exp(rho).

For a real matrix ``X`` with singular values ``s_1 .. s_r`` (``r = min(rows, cols)``)::

    p_i = s_i / sum_j s_j,      rho(X) = - sum_i p_i log p_i   (0 log 0 = 0),      erank(X) = exp(rho)

``rho`` is the spectral entropy used by the paper (arXiv 2404.10947) and ``exp(rho)`` the effective
rank of Roy & Vetterli (EUSIPCO 2007): it lies in ``[1, r]``, is ``n`` for the ``n x n`` identity and
``1`` for any rank-1 matrix. A zero matrix has no spectrum; it gives NaN.

Which matrix (both are reported by the evaluators, per encoder block):
  * ``tokens``: per image, the ``(T, D)`` matrix of one block's raw output tokens (cls included, no
    LayerNorm). ``rho`` and ``exp(rho)`` are computed per image, then averaged over images
    (``mean rho`` and ``mean exp(rho)``). Bounded by ``min(T, D)``.
  * ``pooled``: the ``(N, D)`` matrix whose rows are the pooled features of ``N`` images (the
    pooling of the evaluator, by default the mean of all tokens). Bounded by ``min(N, D)``.

Centring: the headline numbers are uncentred, as Roy & Vetterli define the rank of the matrix as
given (the identity has ``exp(rho) = n``; a shared mean direction counts as one direction). The
evaluators also report the centred numbers (``_centred``: column means subtracted first, i.e. the
image's mean token, or the mean feature over images), which measure only the variation; a strong
common component lowers the uncentred rank but not the centred one.

Singular values come from a float32 SVD of the matrix itself, never from the eigenvalues of its
Gram matrix: the square root of a rounded zero eigenvalue is ``~sqrt(eps) s_max`` and hundreds of
those would inflate ``rho``; the SVD's error is ``~eps s_max``.
"""

from __future__ import annotations

from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np


def spectral_entropy(s, axis: int = -1):
  """``rho = -sum p log p`` with ``p = s / sum(s)`` along ``axis``; NaN where ``sum(s) = 0``.

  Args:
    s: non-negative singular values, any shape.
    axis: the spectrum axis.

  Returns:
    ``s`` without ``axis``, float32.
  """
  s = jnp.asarray(s, jnp.float32)
  total = jnp.sum(s, axis=axis, keepdims=True)
  p = s / jnp.where(total > 0, total, 1.0)
  plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
  rho = -jnp.sum(plogp, axis=axis)
  return jnp.where(jnp.squeeze(total, axis) > 0, rho, jnp.nan)


def singular_values(x, center: bool = False):
  """Singular values of the last two axes of ``x (..., M, D)``: ``(..., min(M, D))`` float32."""
  x = jnp.asarray(x, jnp.float32)
  if center:
    x = x - x.mean(axis=-2, keepdims=True)
  return jnp.linalg.svd(x, compute_uv=False)


def entropy_rank(x, center: bool = False):
  """``rho`` of every matrix in ``x (..., M, D)``: ``(...)`` float32 (see the module docstring)."""
  return spectral_entropy(singular_values(x, center))


def effective_rank(x, center: bool = False) -> Dict[str, np.ndarray]:
  """Spectral entropy and Roy-Vetterli effective rank of the matrices ``x (..., M, D)``.

  Returns:
    ``{'rho': (...), 'erank': exp(rho) (...)}`` as numpy float64 (scalars for one matrix).
  """
  rho = np.asarray(jax.jit(entropy_rank, static_argnums=1)(x, center), np.float64)
  return {"rho": rho, "erank": np.exp(rho)}


def summarize(token_rho: np.ndarray, token_rho_centred: np.ndarray, pooled: np.ndarray,
              num_tokens: int) -> Dict[str, object]:
  """Per-block rank statistics of the rank evaluator, uncentred and centred.

  Args:
    token_rho: (N, L) ``rho`` of each image's uncentred ``(T, D)`` token matrix at L blocks.
    token_rho_centred: (N, L) the same after subtracting the image's mean token.
    pooled: (N, L, D) pooled features.
    num_tokens: T, the tokens per image (for the bound ``min(T, D)``).

  Returns:
    JSON-able dict of lists over blocks: ``tokens_rho``, ``tokens_erank`` (means over images of
    ``rho`` and ``exp(rho)``), ``pooled_rho``, ``pooled_erank`` (of the ``(N, D)`` matrix), the
    same with a ``_centred`` suffix, plus ``num_images``, ``tokens_bound = min(T, D)`` and
    ``pooled_bound = min(N, D)``.
  """
  n, _, d = pooled.shape
  out: Dict[str, object] = {}
  for suffix, rho, center in (("", token_rho, False), ("_centred", token_rho_centred, True)):
    rho = np.asarray(rho, np.float64)
    stats = effective_rank(np.swapaxes(np.asarray(pooled, np.float32), 0, 1), center)
    out.update({f"tokens_rho{suffix}": rho.mean(axis=0).tolist(),
                f"tokens_erank{suffix}": np.exp(rho).mean(axis=0).tolist(),
                f"pooled_rho{suffix}": stats["rho"].tolist(),
                f"pooled_erank{suffix}": stats["erank"].tolist()})
  out.update(num_images=int(n), tokens_bound=int(min(num_tokens, d)), pooled_bound=int(min(n, d)))
  return out
