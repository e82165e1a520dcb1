"""Centred kernel alignment (CKA) between the blocks of one model and between two models.

**Linear CKA** (Kornblith et al. 2019, "Similarity of neural network representations revisited"):
for ``X (n, p)`` and ``Y (n, q)``, the features of the same ``n`` examples, each column-centred,

    CKA(X, Y) = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)

(``linear_cka``). It is invariant to orthogonal transforms and isotropic scaling of either side,
not to arbitrary invertible linear maps, and needs all ``n`` examples at once.

**Minibatch CKA** (Nguyen, Raghu & Kornblith 2021, "Do wide and deep networks learn the same
things?"): over minibatches ``i`` of ``n`` examples, with linear kernels ``K_i = X_i X_i^T`` and
``L_i = Y_i Y_i^T``,

    CKA = sum_i HSIC_1(K_i, L_i) / sqrt(sum_i HSIC_1(K_i, K_i) sum_i HSIC_1(L_i, L_i))

with the unbiased HSIC estimator of Song et al. 2012 (``hsic_unbiased``; ``n >= 4``): with
``K~, L~`` the kernels with zeroed diagonals,

    HSIC_1(K, L) = [tr(K~ L~) + (1^T K~ 1)(1^T L~ 1) / ((n-1)(n-2)) - 2/(n-2) 1^T K~ L~ 1]
                   / (n(n-3))

Its expectation does not depend on ``n``, so the accumulated value converges to the population
CKA however the data is split, which makes it usable on more examples than fit one Gram matrix.
The released code (google-research, ``do_wide_and_deep_networks_learn_the_same_things/
efficient_CKA.py``, class ``MinibatchCKA``; read for this module) computes the same estimator
another way, which this module follows for speed (``u_centre``): it zeroes the Gram diagonal,
takes column sums over ``n - 2``, subtracts from them their total over ``2(n - 1)``, subtracts
these means from rows and columns, zeroes the diagonal again, and sums products of the flattened
matrices over minibatches (the "U-centring" of Szekely & Rizzo 2014, which the file cites). The
dot product of two U-centred Gram matrices is ``n(n-3) HSIC_1``; the released code leaves out that
constant (it cancels in the ratio when all minibatches have the same size); here it is kept, so
``u_centre`` and ``hsic_unbiased`` agree (tests/test_workbench_eval.py checks both against numpy).

**The maps** (``decay_jax.cli.evaluate --evals=cka``): every block's output on the first
``images`` evaluation images (a whole number of minibatches of ``batch``), one linear kernel per
block and minibatch. ``feature='tokens'`` (default) flattens the ``T x D`` tokens of an image into
one vector, as the released code does for convolutional maps (``tf.reshape(x, (n, -1))``); a
feature choice of ``evals.features`` (``'mean'``, ``'cls_ln'``, ...) pools the tokens first. The
U-centred kernels of every model stay in host memory (``blocks x batches x batch^2`` float32), so
maps between two models are computed afterwards from the same minibatches of the same images.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import jax.numpy as jnp
import numpy as np

from decay_jax import validate
from decay_jax.evals import features

TOKENS = "tokens"
FEATURES = (TOKENS,) + features.FEATURE_CHOICES
DEFAULTS = {"images": 1024, "batch": 256, "feature": TOKENS}


# ------------------------------------------------------------------------------------------------
# The estimators


def linear_cka(x, y) -> float:
  """Linear CKA of ``x (n, p)`` and ``y (n, q)`` (Kornblith et al. 2019), float64."""
  x = np.asarray(x, np.float64).reshape(len(x), -1)
  y = np.asarray(y, np.float64).reshape(len(y), -1)
  x, y = x - x.mean(axis=0), y - y.mean(axis=0)
  cross = np.linalg.norm(y.T @ x) ** 2
  return float(cross / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))


def hsic_unbiased(k, l) -> float:
  """The unbiased HSIC estimator of Song et al. 2012 for ``n x n`` kernels ``k, l`` (n >= 4)."""
  k, l = np.array(k, np.float64), np.array(l, np.float64)
  n = k.shape[0]
  if n < 4:
    raise ValueError(f"a minibatch of {n} examples is not allowed; unbiased HSIC needs n >= 4")
  np.fill_diagonal(k, 0.0)
  np.fill_diagonal(l, 0.0)
  one = np.ones(n)
  value = (np.trace(k @ l) + (one @ k @ one) * (one @ l @ one) / ((n - 1) * (n - 2))
           - 2.0 / (n - 2) * (one @ k @ l @ one))
  return float(value / (n * (n - 3)))


def u_centre(grams):
  """U-centred Gram matrices ``(..., n, n)`` scaled so that ``sum(a * b) = HSIC_1``.

  The released code's preprocessing (module docstring), divided by ``sqrt(n(n-3))``; works on
  numpy and jax arrays (the evaluator runs it on the devices)."""
  n = grams.shape[-1]
  if n < 4:
    raise ValueError(f"a minibatch of {n} examples is not allowed; unbiased HSIC needs n >= 4")
  xp = jnp if isinstance(grams, jnp.ndarray) else np
  off = 1.0 - xp.eye(n, dtype=grams.dtype)
  g = grams * off
  means = g.sum(axis=-2) / (n - 2)
  means = means - means.sum(axis=-1, keepdims=True) / (2 * (n - 1))
  g = (g - means[..., :, None] - means[..., None, :]) * off
  return g / np.sqrt(n * (n - 3))


def minibatch_cka(xs: Sequence, ys: Sequence) -> float:
  """Minibatch CKA of paired minibatches ``xs[i] (n, p)``, ``ys[i] (n, q)`` with linear kernels."""
  kl = kk = ll = 0.0
  for x, y in zip(xs, ys):
    x = np.asarray(x, np.float64).reshape(len(x), -1)
    y = np.asarray(y, np.float64).reshape(len(y), -1)
    k, l = x @ x.T, y @ y.T
    kl += hsic_unbiased(k, l)
    kk += hsic_unbiased(k, k)
    ll += hsic_unbiased(l, l)
  return float(kl / np.sqrt(kk * ll))


def cka_matrix(grams_a: np.ndarray, grams_b: np.ndarray) -> np.ndarray:
  """``(La, Lb)`` minibatch CKA from U-centred kernels ``(batches, L, n, n)`` of two models (or one
  model twice) over the same minibatches."""
  a = np.asarray(grams_a, np.float64).reshape(grams_a.shape[0], grams_a.shape[1], -1)
  b = np.asarray(grams_b, np.float64).reshape(grams_b.shape[0], grams_b.shape[1], -1)
  cross = np.einsum("bip,bjp->ij", a, b)
  norm_a = np.sqrt(np.einsum("bip,bip->i", a, a))
  norm_b = np.sqrt(np.einsum("bjp,bjp->j", b, b))
  return cross / norm_a[:, None] / norm_b[None, :]


# ------------------------------------------------------------------------------------------------
# Kernels of a model's blocks


def check_settings(images: int, batch: int, feature: str) -> None:
  """One-line errors for the CKA flags."""
  validate.check_int("cka_batch", batch, 4)
  validate.check_int("cka_images", images, batch)
  if images % batch:
    raise validate.not_allowed("cka_images", images, f"it must be a multiple of cka_batch={batch}")
  validate.check_choice("cka_feature", feature, FEATURES)


def gram_fn(model, feature: str = TOKENS):
  """``fn(params, images (n, H, W, C)) -> (n, L, n)``: row ``i`` of every block's U-centred linear
  kernel over the minibatch (so ``features.extract`` can gather it by example)."""
  validate.check_choice("cka_feature", feature, FEATURES)

  def fn(params, images):
    tokens = model.apply({"params": params}, images, method=model.features)  # (L, n, T, D)
    if feature == TOKENS:
      x = tokens.reshape(tokens.shape[0], tokens.shape[1], -1).astype(jnp.float32)
    else:
      x = features.pool_all(tokens, (feature,))[:, :, 0].transpose(1, 0, 2)  # (L, n, D)
    grams = jnp.einsum("lnf,lmf->lnm", x, x, preferred_element_type=jnp.float32)
    return u_centre(grams).transpose(1, 0, 2)

  return fn


def block_kernels(model, params, images: np.ndarray, mesh, data_cfg, batch: int,
                  feature: str = TOKENS) -> np.ndarray:
  """``(batches, L, n, n)`` float32 U-centred kernels of every block on consecutive minibatches of
  ``images`` (their count a multiple of ``batch``; ``batch`` a multiple of the device count)."""
  n = images.shape[0]
  if n % batch or batch % mesh.size:
    raise ValueError(f"cka_images={n} is not allowed; it must be a multiple of cka_batch={batch}, "
                     f"itself a multiple of the {mesh.size} devices")
  fn = features.on_pixels(gram_fn(model, feature), data_cfg)
  rows = features.extract(fn, params, images, mesh, batch)  # (N, L, n)
  return rows.reshape(n // batch, batch, rows.shape[1], batch).transpose(0, 2, 1, 3)


def section(kernels: np.ndarray, feature: str, labels: Sequence[str]) -> Dict[str, object]:
  """The JSON section of one model: the block-by-block map and its settings."""
  return {"matrix": cka_matrix(kernels, kernels).tolist(), "blocks": list(labels),
          "feature": feature, "num_images": int(kernels.shape[0] * kernels.shape[2]),
          "batch": int(kernels.shape[2]), "estimator": "minibatch, unbiased HSIC, linear kernel"}


def between(name_a: str, kernels_a: np.ndarray, name_b: str,
            kernels_b: np.ndarray) -> Dict[str, object]:
  """The JSON entry of the map between two models' blocks (rows: ``name_a``)."""
  return {"a": name_a, "b": name_b, "matrix": cka_matrix(kernels_a, kernels_b).tolist()}


def block_labels(model) -> List[str]:
  """Names of the blocks ``model.features`` returns (0-based, like the per-block curves)."""
  return [str(i) for i in range(features.num_blocks(model))]
