"""Representation evaluators: effective rank of known matrices, linear probes (official, upstream
MAE with LARS, fast), per-block curves, branch ratios against a hand computation, feature cache."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.models import layers
from decay_jax.evals import branches, features, knn, layerwise, linear_probe as lp, rank
from decay_jax.models import mae
from decay_jax.models.residual import Residual

ONE_DEVICE = jax.devices()[:1]


# ----------------------------------------------------------------------------------------------
# Effective rank


@pytest.mark.parametrize("n", [1, 4, 7])
def test_identity_has_effective_rank_n(n):
  res = rank.effective_rank(np.eye(n, dtype=np.float32))
  assert res["rho"] == pytest.approx(math.log(n), abs=1e-6)
  assert res["erank"] == pytest.approx(n, rel=1e-6)


def test_rank_one_matrix_has_effective_rank_one():
  rng = np.random.default_rng(0)
  x = np.outer(rng.normal(size=40), rng.normal(size=24)).astype(np.float32)
  res = rank.effective_rank(x)
  # float32 SVD leaves ~1e-7 relative singular values in the tail: rho stays below 1e-4.
  assert res["erank"] == pytest.approx(1.0, abs=1e-4)


def test_known_spectrum_scale_and_rotation_invariance():
  # Singular values (3, 1): p = (3/4, 1/4), rho = -(3/4 log 3/4 + 1/4 log 1/4) = 0.562335.
  rho = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
  q, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(5, 5)))
  x = q[:, :2] @ np.diag([3.0, 1.0]) @ np.array([[1.0, 0, 0], [0, 1.0, 0]])  # (5, 3), rank 2
  for scale in (1.0, 1e-3, 250.0):
    res = rank.effective_rank((scale * x).astype(np.float32))
    assert res["rho"] == pytest.approx(rho, abs=1e-5)
    assert res["erank"] == pytest.approx(math.exp(rho), abs=1e-5)  # 1.754765


def test_batched_spectral_entropy_zero_and_centring():
  s = jnp.asarray([[1.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
  rho = np.asarray(rank.spectral_entropy(s))
  assert rho[0] == pytest.approx(math.log(2), abs=1e-7) and rho[1] == 0.0 and np.isnan(rho[2])
  # Identical rows: uncentred rank 1; centred it is the zero matrix (no spectrum).
  rows = np.tile(np.arange(1.0, 6.0, dtype=np.float32), (4, 1))
  assert rank.effective_rank(rows)["erank"] == pytest.approx(1.0, abs=1e-5)
  assert np.isnan(rank.effective_rank(rows, center=True)["erank"])
  # A stack of matrices: one value each, (2,).
  both = np.stack([np.eye(3, dtype=np.float32), np.diag([1.0, 0, 0]).astype(np.float32)])
  np.testing.assert_allclose(rank.effective_rank(both)["erank"], [3.0, 1.0], rtol=1e-6)


def test_rank_summary_averages_per_image_and_uses_pooled_matrix():
  token_rho = np.log(np.array([[2.0, 4.0], [4.0, 4.0]]))  # 2 images x 2 blocks
  pooled = np.zeros((3, 2, 3), np.float32)
  pooled[:, 0] = np.eye(3)  # block 0: identity rows -> 3
  pooled[:, 1] = [[1, 1, 0], [2, 2, 0], [3, 3, 0]]  # block 1: rank 1
  out = rank.summarize(token_rho, token_rho, pooled, num_tokens=5)
  np.testing.assert_allclose(out["tokens_erank"], [3.0, 4.0])  # mean of exp(rho)
  np.testing.assert_allclose(out["tokens_rho"], [np.log(8) / 2, np.log(4)])
  np.testing.assert_allclose(out["pooled_erank"], [3.0, 1.0], rtol=1e-5)
  # Centred: identity rows minus their mean have singular values (1, 1, 0) -> 2.
  np.testing.assert_allclose(out["pooled_erank_centred"][0], 2.0, rtol=1e-5)
  assert out["tokens_bound"] == 3 and out["pooled_bound"] == 3 and out["num_images"] == 3


# ----------------------------------------------------------------------------------------------
# Linear probes


def separable(n=300, d=6, num_classes=3, seed=0, noise_head=False):
  """Class c lives around 4 * e_c (margin >> noise); optional second head of pure noise."""
  rng = np.random.default_rng(seed)
  y = rng.integers(0, num_classes, n)
  x = 0.3 * rng.normal(size=(n, d)) + 4.0 * np.eye(d)[y]
  if noise_head:
    x = np.stack([x, rng.normal(size=(n, d))], axis=1)
  return x.astype(np.float32), y


def test_official_lr_table_is_the_released_schedule():
  table = lp.official_lr_table(200, 1e-2)
  assert table[0] == table[1] == 1e-2  # epoch 1 trains at the value set after epoch 0: cos(0)
  assert table[2] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi / 200)), rel=1e-12)
  assert table[199] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi * 198 / 200)), rel=1e-12)
  assert table.min() > 0  # never reaches 0


@pytest.mark.parametrize("probe", ["official", "fast", "mae"])
def test_probes_separate_separable_features_perfectly(probe):
  x, y = separable(seed=0, noise_head=True)
  qx, qy = separable(seed=1, noise_head=True)
  if probe == "official":
    res = lp.official_probe(x, y, qx, qy, 3, epochs=10, batch_size=32)
  elif probe == "fast":
    res = lp.fast_probe(x, y, qx, qy, 3, epochs=10, lr=1e-2, batch_size=32)
  else:
    # blr 51.2 at batch 32 is upstream's peak lr 6.4 (0.1 x 16384 / 256). LARS changes each weight
    # by ~lr x 0.001 / (1 - momentum) of its norm per step, so the tiny N(0, 0.01^2) head needs
    # the protocol's lr and a few hundred steps to grow out of its random start.
    res = lp.mae_probe(lp.epoch_batches(x, y, 32), qx, qy, 3, steps_per_epoch=300 // 32,
                       epochs=30, warmup_epochs=1, blr=51.2, batch_size=32)
    assert res["lr"] == pytest.approx(6.4)
  assert res["top1"][0] == 1.0  # the separable head
  assert res["top1"][1] < 0.6  # the noise head stays near chance (1/3)


def test_heads_train_independently():
  x, y = separable(seed=0, noise_head=True)
  qx, qy = separable(seed=1, noise_head=True)
  both = lp.official_probe(x, y, qx, qy, 3, epochs=2, batch_size=32, lr=1e-3)
  alone = lp.official_probe(x[:, 0], y, qx[:, 0], qy, 3, epochs=2, batch_size=32, lr=1e-3)
  assert both["top1"][0] == alone["top1"][0]


def test_standardised_official_probe_ignores_offset_and_scale():
  """official_std sees through a shared offset and a small spread; the released probe does not."""
  x, y = separable(seed=0)
  qx, qy = separable(seed=1)
  squash = lambda v: 0.05 * v + 30.0  # a large vector common to every image, little variation
  kw = dict(epochs=3, batch_size=32)
  plain = lp.official_probe(x, y, qx, qy, 3, standardize_features=True, **kw)
  squashed = lp.official_probe(squash(x), y, squash(qx), qy, 3, standardize_features=True, **kw)
  raw = lp.official_probe(squash(x), y, squash(qx), qy, 3, **kw)
  assert plain["top1"][0] == squashed["top1"][0] == 1.0
  np.testing.assert_allclose(squashed["final_loss"], plain["final_loss"], rtol=1e-3)
  assert raw["top1"][0] < 0.5 and raw["final_loss"] > 1.5 * plain["final_loss"]  # near chance


def test_probe_input_checks():
  x, y = separable()
  with pytest.raises(ValueError, match="batch_size=1000"):
    lp.official_probe(x, y, x, y, 3, epochs=1, batch_size=1000)
  with pytest.raises(ValueError, match="train_y has values"):
    lp.fast_probe(x, y + 5, x, y, 3)
  with pytest.raises(ValueError, match="epochs=0"):
    lp.official_probe(x, y, x, y, 3, epochs=0)


def torch_lars(p, grads, lrs, weight_decay=0.0, tc=0.001, momentum=0.9):
  """Upstream MAE util/lars.py, step by step in float64 numpy."""
  p, mu = {k: v.astype(np.float64) for k, v in p.items()}, {k: 0.0 for k in p}
  for g, lr in zip(grads, lrs):
    for k in p:
      dp = g[k].astype(np.float64)
      if p[k].ndim > 1:
        dp = dp + weight_decay * p[k]
        pn, un = np.linalg.norm(p[k]), np.linalg.norm(dp)
        dp = dp * (tc * pn / un if pn > 0 and un > 0 else 1.0)
      mu[k] = momentum * mu[k] + dp
      p[k] = p[k] - lr * mu[k]
  return p


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_lars_matches_upstream_torch_lars(weight_decay):
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=3).astype(np.float32)}
  grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(4)]
  lrs = [0.0, 2.0, 5.0, 1.0]  # warmup from 0, as upstream's first iteration
  tx = lp.lars(lambda count: jnp.asarray(lrs)[count], weight_decay=weight_decay)
  p, state = jax.tree_util.tree_map(jnp.asarray, params), None
  state = tx.init(p)
  for g in grads:
    updates, state = tx.update(jax.tree_util.tree_map(jnp.asarray, g), state, p)
    p = jax.tree_util.tree_map(lambda a, u: a + u, p, updates)
  want = torch_lars(params, grads, lrs, weight_decay)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), want[k], rtol=1e-5, atol=1e-6)


def test_warmup_cosine_and_batch_norm_statistics():
  sched = lp.warmup_cosine(6.4, steps_per_epoch=10, epochs=90, warmup_epochs=10)
  assert float(sched(0)) == 0.0
  assert float(sched(50)) == pytest.approx(3.2)  # half-way through warmup
  assert float(sched(100)) == pytest.approx(6.4)
  assert float(sched(500)) == pytest.approx(6.4 * 0.5 * (1 + math.cos(math.pi * 40 / 80)), rel=1e-5)
  x = jnp.asarray([[[1.0]], [[3.0]]])  # (B=2, H=1, D=1): mean 2, biased var 1, unbiased var 2
  stats = {"mean": jnp.zeros((1, 1)), "var": jnp.ones((1, 1))}
  xn, new = lp.batch_norm(x, stats, train=True)
  np.testing.assert_allclose(np.asarray(xn).ravel(), [-1 / math.sqrt(1 + 1e-6), 1 / math.sqrt(1 + 1e-6)])
  assert float(new["mean"][0, 0]) == pytest.approx(0.2) and float(new["var"][0, 0]) == pytest.approx(1.1)
  xe, _ = lp.batch_norm(x, new, train=False)
  np.testing.assert_allclose(np.asarray(xe).ravel(), (np.array([1.0, 3.0]) - 0.2) / math.sqrt(1.1 + 1e-6),
                             rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Per-block curves


def test_layer_curves_find_the_separable_block():
  x, y = separable(seed=0, noise_head=True)  # block 0: separable, block 1: noise
  qx, qy = separable(seed=1, noise_head=True)
  x, qx = x[:, ::-1], qx[:, ::-1]  # now block 1 is the separable one (and the last)
  out = layerwise.layer_curves(x, y, qx, qy, 3, k=5, probe_epochs=5, probe_lr=1e-2,
                               probe_batch_size=32, devices=ONE_DEVICE)
  assert out["knn_top1"][1] == 1.0 and out["linear_top1"][1] == 1.0
  assert out["knn_top1"][0] < 0.6 and out["linear_top1"][0] < 0.6
  assert out["knn"] == {"best_block": 1, "best": 1.0, "last": 1.0, "gap": 0.0}
  x2, qx2 = x[:, ::-1], qx[:, ::-1]  # separable block first: best 0, gap to the last block
  out = layerwise.layer_curves(x2, y, qx2, qy, 3, k=5, probe_epochs=5, probe_lr=1e-2,
                               probe_batch_size=32, devices=ONE_DEVICE)
  assert out["knn"]["best_block"] == 0 and out["knn"]["gap"] == pytest.approx(1.0 - out["knn_top1"][1])
  # The block chosen on a held-out quarter of the training set, without the test set.
  out = layerwise.layer_curves(x2, y, qx2, qy, 3, k=5, probe_epochs=5, probe_lr=1e-2,
                               probe_batch_size=32, heldout_fraction=0.25, devices=ONE_DEVICE)
  assert out["num_heldout"] == round(0.25 * len(y))
  for probe in ("knn", "linear"):
    chosen = out["selected"][probe]
    assert chosen["block"] == 0 and chosen["heldout"] > 0.9
    assert chosen["test"] == out[f"{probe}_top1"][0]


# ----------------------------------------------------------------------------------------------
# Features, cache, branch ratios (on the micro MAE)


@functools.lru_cache(maxsize=None)  # compiled once per setting; the arrays are never modified
def micro(alpha_min=0.6, perturb=True):
  """The micro MAE, 6 random images, and its params (perturbed: zero-initialised branch outputs
  would make every branch exactly 0)."""
  model = mae.mae("micro/4", residual=Residual(alpha_min=alpha_min))
  images = jax.random.normal(jax.random.key(0), (6, 16, 16, 3))
  params = jax.jit(model.init)(jax.random.key(1), images, jnp.zeros((6, 16)))["params"]
  if perturb:  # host noise: a jitted random draw per leaf compiles for seconds
    rng = np.random.default_rng(2)
    params = jax.tree_util.tree_map(
        lambda a: jnp.asarray(a + 0.05 * rng.normal(size=a.shape), jnp.float32), params)
  return model, params, np.asarray(images)


def test_feature_choices_and_pool_all():
  assert features.parse_choice("patch_mean_ln") == ("patch_mean", True)
  assert features.parse_choices("mean, cls_ln") == ("mean", "cls_ln")
  with pytest.raises(ValueError, match="'avg' is not one of"):
    features.parse_choices("mean,avg")
  tokens = jax.random.normal(jax.random.key(0), (3, 4, 5, 8))  # (L, N, T, D)
  out = np.asarray(features.pool_all(tokens, ("mean", "cls_ln")))
  assert out.shape == (4, 3, 2, 8)
  np.testing.assert_allclose(out[:, 2, 0], np.asarray(tokens[2].mean(axis=1)), rtol=1e-6)
  np.testing.assert_allclose(out[:, 1, 1], np.asarray(knn.pool_tokens(tokens[1], "cls", True)),
                             rtol=1e-6)


def test_feature_cache_one_pass_same_values():
  """The cache takes uint8 pixels and normalises them on device: its features equal those of the
  host-normalised float32 images (the former input path), from one forward pass."""
  from decay_jax import sharding as shd
  from decay_jax.data import pipeline
  model, params, _ = micro()
  images = np.asarray(jax.random.randint(jax.random.key(3), (6, 16, 16, 3), 0, 256), np.uint8)
  data_cfg = pipeline.default_data_config()
  data_cfg.normalize = "imagenet"
  host = pipeline.normalize_uint8(images, "imagenet")  # what load_eval_arrays used to return
  mesh = shd.make_mesh(1, 1)
  cache = features.FeatureCache(model, params, mesh, batch_size=4, data_cfg=data_cfg)
  cache.want(images, ("mean",), None)
  cache.want(images, ("cls_ln", "mean"), (-1,))
  calls = []
  original = features.extract
  features.extract = lambda *a, **k: calls.append(1) or original(*a, **k)
  try:
    all_blocks = cache.pooled(images, ("mean",), None)
    last = cache.pooled(images, ("cls_ln", "mean"), (-1,))
  finally:
    features.extract = original
  assert len(calls) == 1  # one forward for both requests
  direct = features.extract(features.pooled_fn(model, ("mean", "cls_ln")), params, host, mesh, 4)
  assert all_blocks.shape == (6, 4, 1, 32) and last.shape == (6, 1, 2, 32)
  scale = float(np.abs(direct).max())
  assert scale > 0.1  # not vacuous
  np.testing.assert_allclose(all_blocks[:, :, 0], direct[:, :, 0], rtol=0, atol=1e-6 * scale)
  np.testing.assert_allclose(last[:, 0, 0], direct[:, -1, 1], rtol=0, atol=1e-6 * scale)
  # on_pixels (every evaluator's feature function) is the same function of the pixels; a float
  # array (already normalised, or latents) passes through unchanged.
  on_pixels = features.on_pixels(features.pooled_fn(model, ("mean", "cls_ln")), data_cfg)
  np.testing.assert_allclose(features.extract(on_pixels, params, images, mesh, 4), direct,
                             rtol=0, atol=1e-6 * scale)
  np.testing.assert_array_equal(features.extract(on_pixels, params, host, mesh, 4), direct)


def test_branch_norms_match_a_hand_computation():
  model, params, images = micro(alpha_min=0.6)
  tokens, norms = jax.jit(lambda p, x: branches.features_and_norms(model, p, x))(params, images)
  plain = model.apply({"params": params}, images, method=model.features)
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(plain))  # sowing changes nothing
  alphas = model.shortcuts.alphas
  ln, attn = layers.layer_norm(), layers.Attention(model.num_heads)
  mlp = layers.Mlp(model.dim * 4, approximate_gelu=False)
  x = np.asarray(model.apply({"params": params}, images, method=lambda m, i: jnp.concatenate(
      [jnp.broadcast_to(m.cls_token + m.pos_embed()[None, :1], (i.shape[0], 1, m.dim)),
       m.embed(i)], axis=1)))
  tnorm = lambda a: np.linalg.norm(np.asarray(a), axis=-1).mean(axis=-1)  # (N,)
  for l in range(model.depth):
    p = jax.tree_util.tree_map(lambda a: a[l], params["blocks"])
    f = attn.apply({"params": p["attn"]}, ln.apply({"params": p["norm1"]}, x))
    np.testing.assert_allclose(norms[:, l, 0], np.stack([tnorm(f), tnorm(alphas[l, 0] * x)], -1),
                               rtol=1e-5)
    x = alphas[l, 0] * x + f
    f = mlp.apply({"params": p["mlp"]}, ln.apply({"params": p["norm2"]}, x))
    np.testing.assert_allclose(norms[:, l, 1], np.stack([tnorm(f), tnorm(alphas[l, 1] * x)], -1),
                               rtol=1e-5)
    x = alphas[l, 1] * x + f
    np.testing.assert_allclose(np.asarray(tokens[l]), x, rtol=1e-5, atol=1e-5)
  out = branches.summarize(np.asarray(norms), alphas)
  mean = np.asarray(norms, np.float64).mean(axis=0)
  np.testing.assert_allclose(out["ratio"], mean[..., 0] / mean[..., 1], rtol=1e-12)
  assert out["alpha_eff"] == pytest.approx(model.shortcuts.alpha_eff)
  assert len(out["ratio_flat"]) == 2 * model.depth


def test_branch_ratios_are_zero_at_init():
  """Zero-initialised branch outputs: every f(x) = 0 and x_l = (product of alphas) x_0."""
  model, params, images = micro(alpha_min=0.6, perturb=False)
  tokens, norms = branches.features_and_norms(model, params, images)
  out = branches.summarize(np.asarray(norms), model.shortcuts.alphas)
  assert np.all(np.asarray(out["branch_norm"]) == 0.0) and np.all(np.asarray(out["ratio"]) == 0)
  ident = np.asarray(out["identity_norm"]).reshape(-1)  # sublayer order k
  cum = np.cumprod(model.shortcuts.alphas.reshape(-1))
  # ||alpha_k x_k|| = alpha_k * prod_{j<k} alpha_j * ||x_0|| = cum_k * ||x_0||
  np.testing.assert_allclose(ident / ident[0], cum / cum[0], rtol=1e-5)
