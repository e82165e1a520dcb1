"""Branch ratios of decayed residual updates: how much each sublayer adds relative to its shortcut.

Each encoder sublayer ``k`` computes ``x <- alpha_k x + f_k(x)`` (``k = 2l`` the attention and
``k = 2l + 1`` the MLP of block ``l``). Its branch ratio is

    r_k = E ||f_k(x)|| / E ||alpha_k x||

where ``||.||`` is the L2 norm of one token over channels and ``E`` the mean over all tokens (cls
included) of all evaluated images, on the unmasked encoder; ``f_k`` includes the branch scale of the
``sqrt_half`` ablations. The ratio of means (not the mean of per-token ratios) keeps tokens with a
tiny shortcut from dominating. With ``alpha_min = 1`` the denominator is the plain ``||x||``.

The norms are sown by ``decay_jax.models.blocks.MAEBlock`` only when ``'intermediates'`` is
mutable, so measuring them never changes the training program.
"""

from __future__ import annotations

from typing import Dict, Tuple

import jax.numpy as jnp
import numpy as np


def features_and_norms(model, params, images) -> Tuple[jnp.ndarray, jnp.ndarray]:
  """One unmasked encoder pass returning block outputs and per-image sublayer norms.

  Args:
    model: a ``MaskedAutoencoder``.
    params: its parameters.
    images: (N, H, W, C).

  Returns:
    ``tokens (L, N, T, D)`` (as ``model.features``) and ``norms (N, L, 2, 2)`` float32 where
    ``norms[n, l, s] = (mean_t ||f(x)_t||, mean_t ||alpha x_t||)`` for sublayer ``s`` (0 attention,
    1 MLP) of block ``l``.
  """
  tokens, state = model.apply({"params": params}, images, method=model.features,
                              mutable=["intermediates"])
  sown = state["intermediates"]["blocks"]
  # sow stores a tuple of one value; the scan stacked it to (L, N, 2).
  norms = jnp.stack([sown["attn_norms"][0], sown["mlp_norms"][0]], axis=2)  # (L, N, 2, 2)
  return tokens, norms.transpose(1, 0, 2, 3)


def model_alphas(model, params) -> np.ndarray:
  """The identity coefficients in use, ``(L, 2)`` float64 (trained values for 'learnable')."""
  if model.shortcuts.learnable and "alpha" in params:
    return np.asarray(params["alpha"], np.float64)
  return np.asarray(model.shortcuts.alphas, np.float64)


def summarize(norms: np.ndarray, alphas: np.ndarray, branch_scale: float = 1.0) -> Dict[str, object]:
  """Branch ratios per sublayer from per-image norms.

  Args:
    norms: (N, L, 2, 2) from :func:`features_and_norms` (any number of images N).
    alphas: (L, 2) identity coefficients.
    branch_scale: the factor on f (recorded; already inside the norms).

  Returns:
    JSON-able dict: ``ratio``, ``branch_norm``, ``identity_norm`` and ``alpha``, each a list of L
    ``[attention, mlp]`` pairs; ``ratio_flat`` (2L values in sublayer order ``k``); ``alpha_eff``
    (the product of all 2L coefficients), ``branch_scale`` and ``num_images``.
  """
  norms = np.asarray(norms, np.float64)
  mean = norms.mean(axis=0)  # (L, 2, 2): mean token norms over images
  ratio = mean[..., 0] / mean[..., 1]
  alphas = np.asarray(alphas, np.float64)
  return {
      "ratio": ratio.tolist(),
      "ratio_flat": ratio.reshape(-1).tolist(),
      "branch_norm": mean[..., 0].tolist(),
      "identity_norm": mean[..., 1].tolist(),
      "alpha": alphas.tolist(),
      "alpha_eff": float(np.prod(alphas)),
      "branch_scale": float(branch_scale),
      "num_images": int(norms.shape[0]),
  }
