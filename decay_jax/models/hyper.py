"""Hyper-connections (Zhu et al. 2024, arXiv 2409.19606): ``n`` residual streams per token.

The stream ``x (N, T, C)`` becomes ``H (N, T, n, C)`` (``expand``: the embedding repeated ``n``
times); sublayer ``k`` (attention or MLP of a block, ``k = 2 l + s`` over the model) reads
``h = A_m^T H`` (``read``: one weighted sum of the streams), and writes
``H <- alpha_k A_r^T H + beta f(h)`` (``write``: ``beta (n,)`` spreads the branch output over the
streams, ``A_r (n, n)`` mixes them, ``alpha_k`` is the decay schedule's coefficient of the
sublayer). ``reduce`` sums the streams (the model's output, and every block output that skips,
features and probes read).

Static (``'static'``): learnable ``A_m, A_r, beta``, initialised as the paper and
``lucidrains/hyper-connections`` do: ``A_m`` one-hot at stream ``k mod n``, ``A_r = I``,
``beta = 1``. Dynamic (``'dynamic'``): per token and stream, ``[A_m | A_r] + s_a tanh(LN(H) W_a)``
and ``beta + s_b tanh(LN(H) w_b)``, with ``W_a (C, 1+n)``, ``w_b (C,)`` initialised to 0 and the
learnable scales ``s_a, s_b`` to 0.01 (LN without affine parameters; see docs/residual_forms.md).

The parameters of all sublayers are created by the model (``weights``), stacked ``(depth, 2, ...)``
like the decay coefficients, and scanned into the blocks.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

FORMS = ("none", "static", "dynamic")
DYNAMIC_SCALE = 0.01  # lucidrains: dynamic_alpha_scale, dynamic_beta_scale = ones(()) * 1e-2


def static_init(depth: int, rate: int):
  """``(static_alpha (depth, 2, n, 1+n), static_beta (depth, 2, n))``: column 0 the one-hot
  ``A_m`` at stream ``(2 l + s) mod n``, columns 1.. ``A_r = I``, ``beta = 1``."""
  k = np.arange(2 * depth).reshape(depth, 2)
  a_m = np.eye(rate, dtype=np.float32)[k % rate]  # (depth, 2, n)
  a_r = np.broadcast_to(np.eye(rate, dtype=np.float32), (depth, 2, rate, rate))
  static_alpha = np.concatenate([a_m[..., None], a_r], axis=-1)
  return static_alpha, np.ones((depth, 2, rate), np.float32)


def weights(module, depth: int, dim: int, rate: int, dynamic: bool) -> dict:
  """Creates the parameters ``hyper_*`` of ``module`` (a model, from its ``setup``)."""
  static_alpha, static_beta = static_init(depth, rate)
  out = {"static_alpha": module.param("hyper_static_alpha", lambda _: jnp.asarray(static_alpha)),
         "static_beta": module.param("hyper_static_beta", lambda _: jnp.asarray(static_beta))}
  if dynamic:
    zeros = lambda shape: (lambda _: jnp.zeros(shape, jnp.float32))  # noqa: E731
    scale = lambda _: jnp.full((depth, 2), DYNAMIC_SCALE, jnp.float32)  # noqa: E731
    out.update(
        dynamic_alpha=module.param("hyper_dynamic_alpha", zeros((depth, 2, dim, 1 + rate))),
        dynamic_alpha_scale=module.param("hyper_dynamic_alpha_scale", scale),
        dynamic_beta=module.param("hyper_dynamic_beta", zeros((depth, 2, dim))),
        dynamic_beta_scale=module.param("hyper_dynamic_beta_scale", scale))
  return out


def sublayer(w: dict, s: int) -> dict:
  """The weights of sublayer ``s`` (0 attention, 1 MLP) of a block's ``(2, ...)`` weights."""
  return {name: v[s] for name, v in w.items()}


def expand(x, rate: int):
  """``(N, T, C) -> (N, T, n, C)``: the stream repeated ``n`` times."""
  return jnp.repeat(x[..., None, :], rate, axis=-2)


def reduce(h):
  """``(N, T, n, C) -> (N, T, C)``: the sum of the streams."""
  return h.sum(axis=-2)


def _layer_norm(h, eps: float = 1e-6):
  mean = h.mean(axis=-1, keepdims=True)
  var = ((h - mean) ** 2).mean(axis=-1, keepdims=True)
  return (h - mean) / jnp.sqrt(var + eps)


def connections(h, w: dict):
  """``(alpha (N, T, n, 1+n) or (n, 1+n), beta (N, T, n) or (n,))`` of one sublayer on ``H``."""
  alpha, beta = w["static_alpha"], w["static_beta"]
  if "dynamic_alpha" in w:
    normed = _layer_norm(h)
    alpha = alpha + w["dynamic_alpha_scale"] * jnp.tanh(normed @ w["dynamic_alpha"])
    beta = beta + w["dynamic_beta_scale"] * jnp.tanh(normed @ w["dynamic_beta"])
  return alpha, beta


def read(h, w: dict):
  """``(A_m^T H (N, T, C), (alpha, beta))``: the branch's input and the sublayer's connections."""
  alpha, beta = connections(h, w)
  return jnp.einsum("...sc,...s->...c", h, alpha[..., 0]), (alpha, beta)


def write(h, decay, branch, conn):
  """``decay * A_r^T H + beta f`` for ``H (N, T, n, C)`` and the branch ``f (N, T, C)``."""
  alpha, beta = conn
  mixed = jnp.einsum("...sc,...st->...tc", h, alpha[..., 1:])
  return decay * mixed + beta[..., None] * branch.astype(h.dtype)[..., None, :]


def extra_params(dim: int, rate: int, dynamic: bool) -> int:
  """Parameters one sublayer adds: ``n (1+n) + n`` static, ``+ C (1+n) + C + 2`` dynamic."""
  return rate * (1 + rate) + rate + (dim * (2 + rate) + 2 if dynamic else 0)
