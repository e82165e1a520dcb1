"""Weighted k-nearest-neighbour classification of frozen features.

The released code of the paper we reproduce (arXiv 2404.10947) has no KNN evaluation at all, only
linear probing and fine-tuning. The protocol here is therefore our documented choice: the weighted
KNN of DINO (Caron et al. 2021, ``eval_knn.py``), the de-facto standard for frozen features:

1. L2-normalise train and query features; similarity is the cosine ``s = q . t``.
2. Take the ``k`` most similar training examples of each query (default ``k = 20``).
3. Weight each neighbour by ``exp(s / T)`` (default ``T = 0.07``) and sum the weights per class:
   ``scores[c] = sum_{j in top-k, y_j = c} exp(s_j / T)``.
4. Predict the arg-max class (ties: the lowest class index).

Top-5 accuracy counts a query as correct when its label is among the 5 highest-scoring classes
*that received a neighbour* (score > 0), as DINO does by ranking only the ``min(5, k)`` voted
classes: classes with no neighbour never count as a hit.

``scores`` are the raw sums of the formula above, in float32. Because ``s <= 1``, they overflow to
``inf`` only for ``T < 1 / 88.7 ~ 0.0113``, far below any temperature used in practice.

Features come from :func:`pool_tokens`; ``mode="mean"`` (mean over all tokens, cls included) is the
feature of the official linear probe.

Devices: ``train_feats`` is split along ``N_train`` over a one-axis mesh (``'data'``) of the given
devices (default: all local devices). Each device takes the top-k of its shard; the global top-k is
the top-k of the concatenated per-shard top-k's, which is exact because every global top-k
neighbour is in the top-k of its own shard. With one device this is the plain single-device path.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from decay_jax import validate
from decay_jax.validate import check_choice

POOL_MODES = ("mean", "cls", "patch_mean")
AXIS = "data"
_NORM_EPS = 1e-12  # as torch.nn.functional.normalize: a zero feature stays zero instead of NaN


# ----------------------------------------------------------------------------------------------
# Pooling


def pool_tokens(tokens, mode: str = "mean", layernorm: bool = False, eps: float = 1e-6):
  """Pools encoder tokens into one feature vector per example.

  Args:
    tokens: (N, T, D) array (numpy or jax), the cls token at index 0.
    mode: ``'mean'``: mean over all T tokens, cls included (the official linear probe's feature);
      ``'cls'``: token 0; ``'patch_mean'``: mean over tokens ``1:`` (needs T >= 2).
    layernorm: apply a parameter-free LayerNorm over D after pooling.
    eps: LayerNorm epsilon (added to the biased variance).

  Returns:
    (N, D) float32 jax array.

  Raises:
    ValueError: bad ``mode`` or a ``tokens`` array of the wrong shape.
  """
  check_choice("mode", mode, POOL_MODES)
  tokens = jnp.asarray(tokens, jnp.float32)
  if tokens.ndim != 3:
    raise ValueError(f"tokens has shape {tokens.shape}; it must be (N, T, D)")
  if mode == "patch_mean" and tokens.shape[1] < 2:
    raise ValueError(f"tokens has T={tokens.shape[1]}; mode='patch_mean' needs T >= 2")
  if mode == "mean":
    pooled = tokens.mean(axis=1)
  elif mode == "cls":
    pooled = tokens[:, 0]
  else:
    pooled = tokens[:, 1:].mean(axis=1)
  return _layer_norm(pooled, eps) if layernorm else pooled


def _layer_norm(x, eps: float):
  """Parameter-free LayerNorm over the last axis: (N, D) -> (N, D)."""
  mean = x.mean(axis=-1, keepdims=True)
  var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps)


# ----------------------------------------------------------------------------------------------
# Input checks (each raises a one-line ValueError naming the field)


def _features(field: str, x) -> jax.Array:
  """(N, D) float32 jax array with N, D >= 1."""
  x = jnp.asarray(x, jnp.float32)
  if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
    raise ValueError(f"{field} has shape {x.shape}; it must be (N, D) with N, D >= 1")
  return x


def _labels(field: str, y, n: int, num_classes: int) -> np.ndarray:
  """(n,) int32 host array with values in [0, num_classes)."""
  y = np.asarray(y)
  if y.shape != (n,) or not np.issubdtype(y.dtype, np.integer):
    raise ValueError(f"{field} has shape {y.shape} and dtype {y.dtype}; it must be ({n},) integers")
  if y.min() < 0 or y.max() >= num_classes:
    raise ValueError(f"{field} has values in [{y.min()}, {y.max()}]; they must lie in "
                     f"[0, num_classes={num_classes})")
  return y.astype(np.int32)


# ----------------------------------------------------------------------------------------------
# Core


def _l2_normalise(x):
  """(..., D) -> (..., D) with unit rows (zero rows stay zero)."""
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), _NORM_EPS ** 2))


def _shard_top_k(train, labels, queries, *, k: int):
  """Top-k of one shard of the training set.

  Args:
    train: (n, D) unit-norm training features of this shard.
    labels: (n,) int32 labels, -1 on padding rows.
    queries: (C, D) unit-norm queries.
    k: neighbours kept per shard (<= n).

  Returns:
    (sims (C, k) float32 sorted descending, labels (C, k) int32).
  """
  # HIGHEST: accelerators would otherwise round float32 matmul inputs (bf16/tf32) and reorder
  # near-tied neighbours.
  sims = jnp.einsum("cd,nd->cn", queries, train, precision=jax.lax.Precision.HIGHEST)
  sims = jnp.where(labels[None, :] >= 0, sims, -jnp.inf)  # padding rows are never neighbours
  sims, idx = jax.lax.top_k(sims, k)
  return sims, labels[idx]


@functools.partial(jax.jit, static_argnames=("k", "num_classes", "mesh"))
def _knn_chunks(train, labels, queries, temperature, *, k: int, num_classes: int, mesh: Mesh):
  """Weighted KNN of all query chunks in one compiled program.

  Args:
    train: (N_pad, D) float32 training features, N_pad a multiple of mesh.size, split over AXIS.
    labels: (N_pad,) int32 training labels, -1 on padding rows, split over AXIS.
    queries: (num_chunks, chunk, D) float32 queries, replicated.
    temperature: () float32.
    k: neighbours per query (<= number of real training rows).
    num_classes: number of classes C.
    mesh: one-axis mesh (AXIS) the training set is split over.

  Returns:
    (pred (num_chunks, chunk) int32, scores (num_chunks, chunk, C) float32).
  """
  train = _l2_normalise(train)
  # Every global top-k neighbour is in its shard's top-min(k, n_local), so merging is exact.
  k_local = min(k, train.shape[0] // mesh.size)
  shard_top_k = jax.shard_map(functools.partial(_shard_top_k, k=k_local), mesh=mesh,
                              in_specs=(P(AXIS), P(AXIS), P()),
                              out_specs=(P(None, AXIS), P(None, AXIS)))

  def one_chunk(q):
    sims, labs = shard_top_k(train, labels, _l2_normalise(q))  # (chunk, mesh.size * k_local)
    sims, pos = jax.lax.top_k(sims, k)
    labs = jnp.take_along_axis(labs, pos, axis=1)
    weights = jnp.exp(sims / temperature)
    scores = jnp.sum(jax.nn.one_hot(labs, num_classes, dtype=jnp.float32) * weights[..., None],
                     axis=1)
    return jnp.argmax(scores, axis=-1).astype(jnp.int32), scores

  # lax.map runs the chunks sequentially, so only one (chunk, N_pad) similarity block is live.
  return jax.lax.map(one_chunk, queries)


def _mesh(devices: Sequence[jax.Device] | None) -> Mesh:
  devices = jax.local_devices() if devices is None else list(devices)
  if not devices:
    raise ValueError("devices=[] is not allowed; give at least one device or None")
  return Mesh(np.asarray(devices), (AXIS,))


def knn_predict(train_feats, train_labels, query_feats, num_classes: int, k: int = 20,
                temperature: float = 0.07, chunk: int = 1024, *,
                devices: Sequence[jax.Device] | None = None):
  """Weighted KNN predictions (DINO protocol, see the module docstring).

  Args:
    train_feats: (N_train, D) features (numpy or jax); L2-normalised here.
    train_labels: (N_train,) integer labels in [0, num_classes).
    query_feats: (Q, D) features; L2-normalised here.
    num_classes: number of classes C >= 1.
    k: neighbours per query, 1 <= k <= N_train.
    temperature: T > 0 of the neighbour weights exp(sim / T).
    chunk: queries per step; memory per device is about chunk x N_train / len(devices) floats.
      The last chunk is padded, so all steps share one compiled program.
    devices: devices to split the training set over along N_train (default: all local devices).

  Returns:
    (pred (Q,) int32 jax array, scores (Q, C) float32 jax array).

  Raises:
    ValueError: one line naming the bad field.
  """
  train = _features("train_feats", train_feats)
  query = _features("query_feats", query_feats)
  if query.shape[1] != train.shape[1]:
    raise ValueError(f"query_feats has D={query.shape[1]}; it must match train_feats D="
                     f"{train.shape[1]}")
  num_classes = validate.check_int("num_classes", num_classes, 1)
  n_train, n_query = train.shape[0], query.shape[0]
  labels = _labels("train_labels", train_labels, n_train, num_classes)
  k = validate.check_int("k", k, 1, n_train)
  temperature = validate.check_range("temperature", temperature, 0.0, low_open=True)
  chunk = min(validate.check_int("chunk", chunk, 1), n_query)  # never pad a small query set up to chunk
  mesh = _mesh(devices)

  # Pad N_train to a multiple of the device count; label -1 marks rows that are never neighbours.
  n_pad = -n_train % mesh.size
  train = jnp.pad(train, ((0, n_pad), (0, 0)))
  labels = np.pad(labels, (0, n_pad), constant_values=-1)
  split = NamedSharding(mesh, P(AXIS))
  train, labels = jax.device_put(train, split), jax.device_put(labels, split)

  num_chunks = -(-n_query // chunk)
  query = jnp.pad(query, ((0, num_chunks * chunk - n_query), (0, 0)))
  query = jax.device_put(query.reshape(num_chunks, chunk, -1), NamedSharding(mesh, P()))

  pred, scores = _knn_chunks(train, labels, query, jnp.float32(temperature), k=k,
                             num_classes=num_classes, mesh=mesh)
  return pred.reshape(-1)[:n_query], scores.reshape(-1, num_classes)[:n_query]


def knn_accuracy(train_feats, train_labels, query_feats, query_labels, num_classes: int,
                 k: int = 20, temperature: float = 0.07, chunk: int = 1024, *,
                 devices: Sequence[jax.Device] | None = None) -> dict:
  """Weighted KNN accuracy of labelled queries.

  Args:
    train_feats, train_labels, query_feats, num_classes, k, temperature, chunk, devices: as in
      :func:`knn_predict`.
    query_labels: (Q,) integer labels in [0, num_classes).

  Returns:
    ``{'top1': float in [0, 1], 'top5': float (only if num_classes >= 5), 'num_train': int,
    'num_query': int, 'k': k, 'temperature': T}``. Top-5 counts only classes that received a
    neighbour (see the module docstring).

  Raises:
    ValueError: one line naming the bad field.
  """
  num_classes = validate.check_int("num_classes", num_classes, 1)
  query_feats = _features("query_feats", query_feats)
  # Checked before the search so that a bad label fails fast, not after minutes of compute.
  labels = jnp.asarray(_labels("query_labels", query_labels, query_feats.shape[0], num_classes))
  pred, scores = knn_predict(train_feats, train_labels, query_feats, num_classes, k, temperature,
                             chunk, devices=devices)
  n_query = pred.shape[0]
  result = {"top1": int(jnp.sum(pred == labels)) / n_query}  # exact fraction, not a float32 mean
  if num_classes >= 5:
    top_scores, top_classes = jax.lax.top_k(scores, 5)
    hit = jnp.any((top_classes == labels[:, None]) & (top_scores > 0), axis=1)
    result["top5"] = int(jnp.sum(hit)) / n_query
  result.update(num_train=int(np.shape(train_feats)[0]), num_query=n_query, k=k,
                temperature=float(temperature))
  return result
