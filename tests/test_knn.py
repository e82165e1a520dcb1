"""Weighted KNN (DINO protocol): hand-made cases, formula vs numpy, pooling, input checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.evals import knn

ONE_DEVICE = jax.devices()[:1]


def circle(degrees, norms=None):
  """(N,) angles in degrees -> (N, 2) points; optional norms show the features get normalised."""
  rad = np.deg2rad(np.asarray(degrees, np.float64))
  pts = np.stack([np.cos(rad), np.sin(rad)], axis=1)
  return (pts if norms is None else pts * np.asarray(norms)[:, None]).astype(np.float32)


def numpy_knn(train, labels, query, num_classes, k, temperature):
  """The DINO formula in float64: (Q, C) scores."""
  t = train / np.linalg.norm(train, axis=1, keepdims=True)
  q = query / np.linalg.norm(query, axis=1, keepdims=True)
  sims = q.astype(np.float64) @ t.astype(np.float64).T
  idx = np.argsort(-sims, axis=1, kind="stable")[:, :k]
  weights = np.exp(np.take_along_axis(sims, idx, axis=1) / temperature)
  scores = np.zeros((len(q), num_classes))
  np.add.at(scores, (np.arange(len(q))[:, None], labels[idx]), weights)
  return scores


def random_problem(seed=0, n_train=203, n_query=30, dim=16, num_classes=7):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(n_train, dim)).astype(np.float32), rng.integers(0, num_classes, n_train),
          rng.normal(size=(n_query, dim)).astype(np.float32), rng.integers(0, num_classes, n_query))


# Three clusters of three points at 0, 120 and 240 degrees, plus a mislabelled class-0 point at 235
# degrees inside the class-2 cluster. Norms vary: only directions may matter.
TRAIN_DEG = [-10, 0, 10, 110, 120, 130, 230, 240, 250, 235]
TRAIN_Y = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 0])
TRAIN_NORM = [1.0, 2.0, 0.5, 3.0, 1.0, 1.5, 1.0, 0.3, 2.5, 1.0]
# 5 -> class-0 cluster. 118 -> class 1. 236: nearest is the outlier (1 deg, class 0), then 240 (4)
# and 230 (6), both class 2: k=1 is wrong, k=3 right (exp((cos 4 - cos 1)/0.07) + exp((cos 6 -
# cos 1)/0.07) = 0.968 + 0.927 > 1). 75 labelled 0 is deliberately misclassified: its three nearest
# points (110, 120, 130 degrees) are class 1, the nearest class-0 point is 65 degrees away.
QUERY_DEG = [5, 118, 236, 75]
QUERY_Y = np.array([0, 1, 2, 0])


@pytest.mark.parametrize("k, expected_pred, expected_top1", [(1, [0, 1, 0, 1], 0.5),
                                                              (3, [0, 1, 2, 1], 0.75)])
def test_hand_made_circle(k, expected_pred, expected_top1):
  train, query = circle(TRAIN_DEG, TRAIN_NORM), circle(QUERY_DEG, [2.0, 0.5, 1.0, 4.0])
  pred, scores = knn.knn_predict(train, TRAIN_Y, query, num_classes=3, k=k)
  assert pred.dtype == jnp.int32 and scores.dtype == jnp.float32 and scores.shape == (4, 3)
  np.testing.assert_array_equal(pred, expected_pred)
  result = knn.knn_accuracy(train, TRAIN_Y, query, QUERY_Y, num_classes=3, k=k)
  assert result == {"top1": expected_top1, "num_train": 10, "num_query": 4, "k": k,
                    "temperature": 0.07}


def test_weighting_beats_majority_vote():
  # Query at 0 degrees; one class-0 neighbour at 0 (sim 1), two class-1 neighbours at +-60 degrees
  # (sim 0.5). Majority vote says 1; exp(1/T) = 1.6e6 outweighs 2 exp(0.5/T) = 2.5e3, so the
  # weighted vote says 0.
  train, labels, query = circle([0, 60, -60]), np.array([0, 1, 1]), circle([0])
  pred, scores = knn.knn_predict(train, labels, query, num_classes=2, k=3)
  assert int(pred[0]) == 0
  np.testing.assert_allclose(scores[0], [math.exp(1 / 0.07), 2 * math.exp(0.5 / 0.07)], rtol=1e-5)
  # A huge temperature flattens the weights towards a plain majority vote.
  pred, _ = knn.knn_predict(train, labels, query, num_classes=2, k=3, temperature=1e3)
  assert int(pred[0]) == 1


@pytest.mark.parametrize("chunk", [7, 10, 1024])  # 7 does not divide Q=30, 10 does; 1024 > Q
@pytest.mark.parametrize("devices", [None, ONE_DEVICE], ids=["all_devices", "one_device"])
def test_scores_match_numpy(chunk, devices, k=20):
  train, labels, query, _ = random_problem()
  pred, scores = knn.knn_predict(train, labels, query, 7, k=k, chunk=chunk, devices=devices)
  expected = numpy_knn(train, labels, query, 7, k, 0.07)
  assert scores.shape == (30, 7) and pred.shape == (30,)
  np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=0)
  np.testing.assert_array_equal(pred, expected.argmax(axis=1))


@pytest.mark.parametrize("k", [40, 203])  # 40 > 26 rows per shard over 8 devices; 203 = N_train
def test_sharded_merge_is_exact(k):
  # N_train = 203 is not a multiple of 8: padding rows must never be picked as neighbours.
  assert len(jax.devices()) == 8, "tests/conftest.py should provide 8 CPU devices"
  train, labels, query, _ = random_problem(seed=1)
  expected = numpy_knn(train, labels, query, 7, k, 0.5)
  for devices in (None, ONE_DEVICE):
    pred, scores = knn.knn_predict(jnp.asarray(train), jnp.asarray(labels), jnp.asarray(query), 7,
                                   k=k, temperature=0.5, chunk=8, devices=devices)
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=0)
    np.testing.assert_array_equal(pred, expected.argmax(axis=1))


def test_last_chunk_is_padded_not_recompiled():
  # Q = 30 in chunks of 7 is 4 full chunks and a ragged one: a single compiled program.
  train, labels, query, _ = random_problem(seed=4, dim=12)
  before = knn._knn_chunks._cache_size()
  knn.knn_predict(train, labels, query, 7, k=3, chunk=7, devices=ONE_DEVICE)
  assert knn._knn_chunks._cache_size() == before + 1


def test_accuracy_matches_numpy_top1_top5():
  train, labels, query, query_labels = random_problem(seed=2, num_classes=10)
  result = knn.knn_accuracy(train, labels, query, query_labels, 10, k=10, chunk=8,
                            devices=ONE_DEVICE)
  scores = numpy_knn(train, labels, query, 10, 10, 0.07)
  top5 = np.argsort(-scores, axis=1, kind="stable")[:, :5]
  voted = np.take_along_axis(scores, top5, axis=1) > 0
  assert result["top1"] == np.mean(scores.argmax(axis=1) == query_labels)
  assert result["top5"] == np.mean(np.any((top5 == query_labels[:, None]) & voted, axis=1))
  assert result["num_train"] == 203 and result["num_query"] == 30
  # k=1 votes for one class only: classes without a neighbour never count, so top5 == top1.
  result = knn.knn_accuracy(train, labels, query, query_labels, 10, k=1, devices=ONE_DEVICE)
  assert result["top5"] == result["top1"]


@pytest.mark.parametrize("mode", ["mean", "cls", "patch_mean"])
@pytest.mark.parametrize("layernorm", [False, True])
def test_pool_tokens(mode, layernorm):
  tokens = np.random.default_rng(3).normal(2.0, 3.0, size=(4, 5, 8)).astype(np.float32)
  expected = {"mean": tokens.mean(1), "cls": tokens[:, 0],
              "patch_mean": tokens[:, 1:].mean(1)}[mode]
  if layernorm:
    mu, var = expected.mean(-1, keepdims=True), expected.var(-1, keepdims=True)
    expected = (expected - mu) / np.sqrt(var + 1e-6)
  out = knn.pool_tokens(jnp.asarray(tokens), mode=mode, layernorm=layernorm)
  assert out.shape == (4, 8) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_pool_tokens_bad_mode():
  with pytest.raises(ValueError) as err:
    knn.pool_tokens(np.zeros((2, 3, 4)), mode="max")
  message = str(err.value)
  assert "\n" not in message and "mode" in message
  assert all(repr(m) in message for m in knn.POOL_MODES)


def _good_args():
  train, labels, query, query_labels = random_problem(n_train=20, n_query=4, dim=4, num_classes=3)
  return dict(train_feats=train, train_labels=labels, query_feats=query, query_labels=query_labels,
              num_classes=3, k=5, temperature=0.07, chunk=2)


@pytest.mark.parametrize("field, value", [
    ("k", 0), ("k", 21), ("k", 2.0), ("temperature", 0.0), ("temperature", -1.0),
    ("temperature", float("inf")), ("chunk", 0), ("num_classes", 0),
    ("query_feats", np.zeros((4, 5), np.float32)), ("query_feats", np.zeros(4, np.float32)),
    ("train_feats", np.zeros((20, 4, 1), np.float32)),
    ("train_labels", np.full(20, 3)), ("train_labels", np.full(20, -1)),
    ("train_labels", np.zeros(19, int)), ("train_labels", np.zeros(20, np.float32)),
    ("query_labels", np.full(4, 3)), ("query_labels", np.zeros(5, int)),
])
def test_bad_inputs_name_the_field(field, value):
  args = _good_args()
  args[field] = value
  with pytest.raises(ValueError) as err:
    knn.knn_accuracy(**args)
  message = str(err.value)
  assert "\n" not in message and message.startswith(field), message
  if field != "query_labels":
    del args["query_labels"]
    with pytest.raises(ValueError, match=f"^{field}"):
      knn.knn_predict(**args)
