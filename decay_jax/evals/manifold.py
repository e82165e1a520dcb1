"""k-nearest-neighbour manifold metrics of generated images, on device, in row and column blocks.

* **Improved precision and recall** (Kynkaenniemi et al. 2019) exactly as ADM's evaluator computes
  them (guided-diffusion ``evaluations/evaluator.py``: ``Evaluator.compute_prec_recall``,
  ``ManifoldEstimator``, ``DistanceBlock``, ``_batch_pairwise_distances``):

  - distances are *squared* Euclidean, ``max(|u|^2 - 2 u.v + |v|^2, 0)``;
  - ``DistanceBlock`` first computes a block in float16 and keeps it (cast to float32) when every
    entry is finite, else recomputes that block in float32: ``half=True`` (the default) does the
    same, block by block, with ADM's blocks of 10,000 rows and 10,000 columns
    (``row_batch_size``, ``col_batch_size``); ``half=False`` is the float32 definition;
  - the radius of a point is the distance to its k-th nearest neighbour with k = 3
    (``nhood_sizes=(3,)``): column k of the partition of its row of distances, the row holding
    the point itself at distance 0, so the k-th neighbour *other than itself*;
  - ``clamp_to_percentile=None``: no radius is pruned (``eps=1e-5`` only enters the realism
    score, which is not reported);
  - membership is ``distance <= radius`` (``DistanceBlock``'s ``less_thans``); precision is the
    share of samples inside at least one reference ball (reference radii from the reference
    batch), recall the share of references inside at least one sample ball (sample radii from the
    samples): ``evaluate_pr(ref, radii_ref, samples, radii_samples)`` returns them in that order.

* **Density and coverage** (Naeem et al. 2020) as the ``prdc`` package computes them
  (``prdc/prdc.py``: ``compute_prdc``, ``compute_nearest_neighbour_distances``,
  ``get_kth_value``): Euclidean distances, the radius of a reference point is the (k+1)-th
  smallest distance of its row (itself included, so its k-th neighbour), k = 5 (the README's
  example), membership strict ``<``; density = mean over samples of the number of reference balls
  holding the sample, divided by k; coverage = share of references whose ball holds at least one
  sample. Here squared float32 distances are compared (the same order as their square roots).

Neither metric ever holds the ``N x M`` distance matrix: blocks of ``batch`` rows by ``batch``
columns are computed with ``jnp`` on the default device and reduced there (running k smallest per
row for the radii; any / count per row and column for the memberships).
"""

from __future__ import annotations

import functools
from typing import Dict, Iterator, Tuple

import jax
import jax.numpy as jnp
import numpy as np

PR_K = 3          # ADM ManifoldEstimator(nhood_sizes=(3,))
DC_K = 5          # prdc README: compute_prdc(..., nearest_k=5)
BATCH = 10_000    # ADM ManifoldEstimator(row_batch_size=10000, col_batch_size=10000)


def _blocks(n: int, batch: int) -> Iterator[Tuple[int, int]]:
  for start in range(0, n, batch):
    yield start, min(n, start + batch)


def _sq_dists(u, v):
  """ADM's ``_batch_pairwise_distances``: ``max(|u|^2 - 2 u v^T + |v|^2, 0)`` in u's dtype."""
  nu = jnp.sum(jnp.square(u), axis=1)[:, None]
  nv = jnp.sum(jnp.square(v), axis=1)[None, :]
  uv = jnp.matmul(u, v.T, precision=jax.lax.Precision.HIGHEST)  # no TF32 on GPUs
  return jnp.maximum(nu - 2 * uv + nv, 0)


@functools.partial(jax.jit, static_argnames=("half",))
def sq_distances(u, v, half: bool = False):
  """Squared distances ``(len(u), len(v))`` float32; ``half``: ADM's ``DistanceBlock`` (float16,
  float32 where a float16 entry is not finite, decided for the whole block)."""
  u32, v32 = u.astype(jnp.float32), v.astype(jnp.float32)
  if not half:
    return _sq_dists(u32, v32)
  d16 = _sq_dists(u32.astype(jnp.float16), v32.astype(jnp.float16))
  return jax.lax.cond(jnp.all(jnp.isfinite(d16)), lambda: d16.astype(jnp.float32),
                      lambda: _sq_dists(u32, v32))


@functools.partial(jax.jit, static_argnames=("m",))
def _smallest(best, d, m: int):
  """The ``m`` smallest of each row of ``[best | d]``, ascending."""
  cand = d if best is None else jnp.concatenate([best, d], axis=1)
  return -jax.lax.top_k(-cand, min(m, cand.shape[1]))[0]


def check_features(what: str, feats, k: int) -> np.ndarray:
  """2-D float features with more than ``k`` rows (a k-th neighbour other than self)."""
  feats = np.asarray(feats)
  if feats.ndim != 2 or not np.issubdtype(feats.dtype, np.floating):
    raise ValueError(f"{what} features of shape {feats.shape} and dtype {feats.dtype} are not "
                     f"allowed; need float (N, D)")
  if len(feats) <= k:
    raise ValueError(f"{what}: {len(feats)} images are not allowed; the k = {k} nearest-neighbour "
                     f"metrics need at least {k + 1}")
  return feats


def _check_pair(ref, samples, k):
  ref, samples = check_features("reference", ref, k), check_features("sample", samples, k)
  if ref.shape[1] != samples.shape[1]:
    raise ValueError(f"reference features have {ref.shape[1]} dims and sample features "
                     f"{samples.shape[1]}; compute both with the same network layer")
  return jnp.asarray(ref, jnp.float32), jnp.asarray(samples, jnp.float32)


def knn_radii(feats, k: int, half: bool = False, batch: int = BATCH) -> np.ndarray:
  """Squared distance of each row to its k-th nearest other row (``(N,)`` float32)."""
  feats = jnp.asarray(feats, jnp.float32)
  n = feats.shape[0]
  if n <= k:
    raise ValueError(f"{n} feature rows are not allowed; a k = {k} radius needs at least {k + 1}")
  radii = []
  for r0, r1 in _blocks(n, batch):
    best = None
    for c0, c1 in _blocks(n, batch):
      best = _smallest(best, sq_distances(feats[r0:r1], feats[c0:c1], half), k + 1)
    radii.append(best[:, k])  # column 0 is the point itself
  return np.asarray(jnp.concatenate(radii))


@jax.jit
def _pr_block(d, r_ref, r_samples):
  return jnp.any(d <= r_samples[None, :], axis=1), jnp.any(d <= r_ref[:, None], axis=0)


def precision_recall(ref, samples, k: int = PR_K, half: bool = True, batch: int = BATCH
                     ) -> Dict[str, float]:
  """``{'precision', 'recall'}`` of ``samples (M, D)`` against ``ref (N, D)``: ADM's
  ``Evaluator.compute_prec_recall(ref, samples)`` (see the module docstring)."""
  ref, samples = _check_pair(ref, samples, k)
  r_ref = jnp.asarray(knn_radii(ref, k, half, batch))
  r_samples = jnp.asarray(knn_radii(samples, k, half, batch))
  ref_in = jnp.zeros(ref.shape[0], bool)
  samples_in = jnp.zeros(samples.shape[0], bool)
  for r0, r1 in _blocks(ref.shape[0], batch):
    for c0, c1 in _blocks(samples.shape[0], batch):
      d = sq_distances(ref[r0:r1], samples[c0:c1], half)
      a, b = _pr_block(d, r_ref[r0:r1], r_samples[c0:c1])
      ref_in = ref_in.at[r0:r1].set(ref_in[r0:r1] | a)
      samples_in = samples_in.at[c0:c1].set(samples_in[c0:c1] | b)
  return {"precision": float(np.mean(np.asarray(samples_in, np.float64))),
          "recall": float(np.mean(np.asarray(ref_in, np.float64)))}


@jax.jit
def _dc_block(d, r_ref):
  inside = d < r_ref[:, None]
  return jnp.sum(inside, axis=0, dtype=jnp.int32), jnp.any(inside, axis=1)


def density_coverage(ref, samples, k: int = DC_K, batch: int = BATCH) -> Dict[str, float]:
  """``{'density', 'coverage'}`` of ``samples (M, D)`` against ``ref (N, D)``: ``prdc``'s
  ``compute_prdc(ref, samples, k)`` (see the module docstring)."""
  ref, samples = _check_pair(ref, samples, k)
  r_ref = jnp.asarray(knn_radii(ref, k, False, batch))
  counts = jnp.zeros(samples.shape[0], jnp.int32)
  covered = jnp.zeros(ref.shape[0], bool)
  for r0, r1 in _blocks(ref.shape[0], batch):
    for c0, c1 in _blocks(samples.shape[0], batch):
      n_in, any_in = _dc_block(sq_distances(ref[r0:r1], samples[c0:c1]), r_ref[r0:r1])
      counts = counts.at[c0:c1].add(n_in)
      covered = covered.at[r0:r1].set(covered[r0:r1] | any_in)
  return {"density": float(np.mean(np.asarray(counts, np.float64)) / k),
          "coverage": float(np.mean(np.asarray(covered, np.float64)))}
