"""Residual routing (decay_jax/models/routing.py): the operator's equations, mirror indexing, the
spec's parameter counts, one training step per variant, decay modes, the heat-map, the configs."""

import os
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.models import flops, routing, stack
from decay_jax.models import sit as sit_lib
from decay_jax.models.blocks import SiTBlock
from decay_jax.models.residual import Residual
from decay_jax.train import optim, setup
from decay_jax.train import config as config_lib
from decay_jax.train import step as step_lib
from decay_jax.train import tasks
from test_sit_train import tiny_sit_config
from testing_configs import REPO, load_config, override

RNG = np.random.default_rng(0)


def candidates(m, scales=None, shape=(2, 5, 16)):
  scales = scales or [1.0] * m
  return [jnp.asarray(s * RNG.standard_normal(shape), jnp.float32) for s in scales]


# ---- the operator ------------------------------------------------------------------------------

def test_zero_w_gives_uniform_weights():
  cands = candidates(5, [0.1, 1.0, 3.0, 10.0, 0.5])
  out, pi = routing.route(jnp.zeros(16), cands)
  np.testing.assert_array_equal(np.asarray(pi), np.full((5, 2, 5), 0.2, np.float32))
  np.testing.assert_allclose(out, sum(cands) / 5, rtol=1e-6, atol=1e-6)


def test_identical_candidates_give_the_identity():
  (u,) = candidates(1)
  w = jnp.asarray(RNG.standard_normal(16), jnp.float32)
  for m in (2, 3, 7):
    out, pi = routing.route(w, [u] * m)
    np.testing.assert_allclose(pi, np.full(pi.shape, 1 / m), rtol=1e-6)
    np.testing.assert_allclose(out, u, rtol=1e-6, atol=1e-6)


def test_scores_are_the_spec_equation_and_scale_invariant():
  cands = candidates(4)
  w = jnp.asarray(RNG.standard_normal(16), jnp.float32)
  _, pi = routing.route(w, cands)
  u = np.stack([np.asarray(c, np.float64) for c in cands])
  z = (u @ np.asarray(w, np.float64)) / np.sqrt((u ** 2).mean(-1) + routing.RMS_EPS)
  want = np.exp(z - z.max(0)) / np.exp(z - z.max(0)).sum(0)
  np.testing.assert_allclose(pi, want, rtol=2e-5)
  scaled = [c * s for c, s in zip(cands, (0.05, 3.0, 40.0, 7.0))]
  _, pi0 = routing.route(w, cands, eps=0.0)
  out_s, pi_s = routing.route(w, scaled, eps=0.0)
  np.testing.assert_allclose(pi_s, pi0, rtol=2e-5)  # RMSNorm: scores ignore the scale (up to eps)
  out, _ = routing.route(w, cands)
  assert float(jnp.abs(out_s - out).max()) > 0.1  # the values are mixed unnormalised


def test_w_gradient_at_zero_is_the_spec_formula():
  cands = candidates(3)
  g = jnp.asarray(RNG.standard_normal(cands[0].shape), jnp.float32)
  grad = jax.grad(lambda w: jnp.sum(g * routing.route(w, cands)[0]))(jnp.zeros(16))
  u = np.stack([np.asarray(c, np.float64) for c in cands])
  r = u / np.sqrt((u ** 2).mean(-1, keepdims=True) + routing.RMS_EPS)
  xt = u.mean(0)
  want = sum((1 / 3) * ((np.asarray(g) * (u[k] - xt)).sum(-1, keepdims=True) * r[k]).sum((0, 1))
             for k in range(3))
  np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-5)
  assert np.abs(want).max() > 0.1  # learning starts at w = 0 when candidates differ


@pytest.mark.parametrize("alpha,n", [(0.6, 2), (0.9, 5), (0.97, 3)])
def test_null_candidate_prior_keeps_alpha_of_the_mass(alpha, n):
  _, pi = routing.route(jnp.zeros(16), candidates(n), routing.null_logit(alpha, n))
  np.testing.assert_allclose(1 - pi[-1], alpha, rtol=1e-6)
  assert routing.null_logit(1.0, n) is None


# ---- mirror indexing and candidate sets ----------------------------------------------------------

@pytest.mark.parametrize("depth", [12, 28])
def test_mirror_indexing(depth):
  half = depth // 2
  assert [routing.mirror_source(j, half) for j in range(1, half + 1)] == list(range(half, 0, -1))
  # the official SiT's long skips (enc_outs[::-1]): decoder j (0-based) gets encoder block
  # K-1-j, whose output is x_{K-j}
  assert [routing.mirror_source(j + 1, half) for j in range(half)] == [half - j for j in range(half)]
  plans = {v: routing.block_sources(v, depth) for v in routing.VARIANTS}
  assert plans["mirror"][:half] == [None] * half
  assert plans["mirror"][half:] == [(i,) for i in range(half, 0, -1)]
  assert plans["fused_mirror"][half:] == plans["mirror"][half:]
  assert plans["fused_mirror"][:half] == [tuple(range(i)) for i in range(1, half + 1)]
  assert plans["fused_all"][half:] == [tuple(range(half + 1))] * half
  assert plans["fused_first"][half:] == [(0,)] * half and plans["fused_last"][half:] == [(half,)] * half
  assert all(p is None for v in ("none", "plain", "static_skip") for p in plans[v])
  with pytest.raises(ValueError, match=f"decoder block j=0 is not allowed; it must be in 1..{half}"):
    routing.mirror_source(0, half)


# ---- the block and the model -------------------------------------------------------------------

def test_unrouted_block_equals_the_official_sit_block():
  x = jnp.asarray(RNG.standard_normal((2, 9, 32)), jnp.float32)
  c = jnp.asarray(RNG.standard_normal((2, 32)), jnp.float32)
  alpha = jnp.asarray([0.9, 0.8], jnp.float32)
  ref = SiTBlock(2)
  state = stack.BlockInputs(alpha)
  params = jax.jit(ref.init)(jax.random.key(0), x, state, c)["params"]
  params = jax.tree_util.tree_map(lambda p: p + 0.1 * jnp.ones_like(p), params)  # gates != 0
  want, _ = jax.jit(ref.apply)({"params": params}, x, state, c)
  got = jax.jit(routing.RoutedSiTBlock(2).apply)({"params": params}, x, alpha, c)
  np.testing.assert_array_equal(got, want)


SPEC_S2 = {"mirror": 4608, "fused_mirror": 9216, "fused_all": 9216, "fused_first": 9216,
           "fused_last": 9216, "attnres": 9600, "static_skip": 1_771_776, "none": 887_040}
SPEC_XL2 = {"mirror": 32_256, "fused_mirror": 64_512, "attnres": 65_664, "static_skip": 37_175_040}


def test_parameter_counts_and_flops_of_the_spec():
  for v, n in SPEC_XL2.items():  # spec section 7 (XL/2: D 28, d 1152)
    assert routing.extra_params(v, 28, 1152) == n
  for v, n in SPEC_S2.items():  # measured on the abstract SiT-S/2 against the plain one
    m = sit_lib.sit("S/2", residual=Residual(alpha_min=1.0), residual_routing=v)
    res = flops.overhead(m)
    assert res["routing_params"] == n == routing.extra_params(v, 12, 384), v
    assert res["routing_flops_pct"] < (30 if v in ("none", "static_skip") else 1.1), v
    if v == "mirror":  # 12 operators, 2 candidates, 2 MACs each per token and channel, 3x forward
      assert res["routing_gflops_per_example"] == round(3 * 2 * 12 * 2 * 2 * 256 * 384 / 1e9, 4)
  assert res["plain_params"] == 32_865_056  # spec 7: 32.87M (SiT-S/2 without long skips)
  # the default model's FLOPs are unchanged (docs/performance.md: 740.3 GFLOP per SiT-XL/2 training image)
  assert 3 * flops.sit_forward_flops(sit_lib.sit("XL/2")) / 1e9 == pytest.approx(740.2666, abs=1e-3)


TRAINED = routing.VARIANTS[1:]
DECAY_CYCLE = dict(zip(TRAINED, routing.DECAY_MODES * 2))  # every decay mode trains too
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # halves XLA:CPU compile time of a step


def abstract_task(variant):
  c = tiny_sit_config(**{"model.residual_routing": variant,
                         "model.routing_decay": DECAY_CYCLE.get(variant, "after"),
                         "model.alpha_min": 1.0 if variant == "attnres" else 0.8})
  info, model, _ = setup.check_config(c)
  task = setup.make_task(c, model, info)
  tx, sched = optim.make_optimizer(c.optim, c.batch_size, 10, 0)
  return c, task, tx, sched, jax.eval_shape(lambda: step_lib.init_state(task, tx, 0))


def count(tree) -> int:
  return sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(tree))


@pytest.fixture(scope="module")
def plain_micro_params():
  return count(abstract_task("plain")[-1]["params"])


@pytest.mark.parametrize("variant", TRAINED)
def test_each_variant_trains_one_step(variant, plain_micro_params):
  c, task, tx, sched, abstract = abstract_task(variant)
  model = task.model
  assert count(abstract["params"]) == (
      plain_micro_params + routing.extra_params(variant, model.depth, model.dim))
  # random parameters (no init program to compile): open adaLN-Zero gates, so candidates differ
  params = jax.tree_util.tree_map(
      lambda p: jnp.asarray(0.05 * RNG.standard_normal(p.shape), jnp.float32), abstract["params"])
  state = dict(abstract, params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
               rng=jax.random.key_data(jax.random.key(0)))
  batch = {"image": jnp.asarray(RNG.standard_normal((16, 16, 16, 1)), jnp.float32),
           "label": jnp.asarray(RNG.integers(0, 10, 16), jnp.int32)}
  step = jax.jit(step_lib.make_train_step(task, tx, sched, 1, 0.0)).lower(state, batch).compile(
      compiler_options=FAST_COMPILE)
  new, metrics = step(state, batch)
  assert np.isfinite(float(metrics["loss"])) and float(metrics["loss"]) > 0.1
  flat = jax.tree_util.tree_flatten_with_path(new["params"])[0]
  old = {k: np.asarray(p) for k, p in jax.tree_util.tree_flatten_with_path(params)[0]}
  routes = [k for k, _ in flat if "route_" in jax.tree_util.keystr(k)]
  assert len(routes) == len(routing.candidate_counts(variant, model.depth))
  # sublayers whose candidates are all the same tensor (spec 4, edge cases) route exactly the
  # identity, so their w gets no gradient: encoder block 1's attention (x = x_0), decoder block 1's
  # attention when it reads x_K (x = x_K) unless decay made the copies differ (alpha x or a null
  # candidate), AttnRes's first sublayer (one candidate, v_0)
  idle = {"block_00"} if variant == "attnres" else {"enc_00"} if variant.startswith("fused") else set()
  if variant in ("mirror", "fused_mirror", "fused_last") and model.routing_decay in ("after", "encoder"):
    idle.add("dec_00")
  for k, p in flat:
    name = jax.tree_util.keystr(k)
    moved = np.abs(np.asarray(p) - old[k]).max() > 0
    assert moved != any(f"['{b}']['route_attn']" in name for b in idle), name


def test_decay_modes_agree_at_alpha_one_and_differ_below():
  x = jnp.asarray(RNG.standard_normal((2, 8, 8, 4)), jnp.float32)
  t, y = jnp.asarray([0.2, 0.7]), jnp.asarray([1, 3])
  models = {(am, mode): sit_lib.sit("micro/2", input_size=8, num_classes=10,
                                    residual=Residual(alpha_min=am),
                                    residual_routing="fused_mirror", routing_decay=mode)
            for am in (1.0, 0.6) for mode in routing.DECAY_MODES}
  p = jax.jit(models[1.0, "after"].init)(jax.random.key(0), x, t, y)["params"]
  keys = iter(jax.random.split(jax.random.key(2), 1000))
  p = jax.tree_util.tree_map(lambda a: a + 0.1 * jax.random.normal(next(keys), a.shape), p)
  # one program for all eight models (one compilation)
  fn = jax.jit(lambda p: {k: m.apply({"params": p}, x, t, y) for k, m in models.items()})
  outs = jax.device_get(fn.lower(p).compile(compiler_options=FAST_COMPILE)(p))
  for mode in routing.DECAY_MODES[1:]:
    np.testing.assert_array_equal(outs[1.0, mode], outs[1.0, "after"])
    assert np.abs(outs[0.6, mode] - outs[0.6, "after"]).max() > 1e-3, mode
  assert np.abs(outs[0.6, "after"] - outs[1.0, "after"]).max() > 1e-3


def test_sample_picture_has_the_routing_heatmap():
  c = tiny_sit_config(**{"model.residual_routing": "mirror", "sample.num_steps": 2})
  info, model, _ = setup.check_config(c)
  task = setup.make_task(c, model, info)
  params = jax.jit(model.init)(jax.random.key(0), *task.init_inputs(2))["params"]
  pic = task.picture(params, None, jax.random.key(0))  # what the trainer saves every few steps
  assert pic.dtype == np.uint8 and pic.shape[1] > 2.5 * pic.shape[0] > 500  # samples | 3 panels
  rows = routing.routing_weights(model, params, jnp.zeros((2, 16, 16, 1)), jnp.full((2,), 0.5),
                                 jnp.zeros((2,), jnp.int32))
  assert [r[0] for r in rows] == ["dec1 attn", "dec1 mlp", "dec2 attn", "dec2 mlp"]
  assert [r[1] for r in rows][::2] == [["x", "x2"], ["x", "x1"]]
  for _, _, w in rows:
    np.testing.assert_allclose(w, [0.5, 0.5], rtol=1e-6)  # w = 0 at init


# ---- configs ------------------------------------------------------------------------------------

ROWS = list(runpy.run_path(os.path.join(REPO, "configs", "sit_s2_routing.py"))["ROWS"])


@pytest.mark.parametrize("row", ROWS)
def test_every_ablation_row_loads_validates_and_builds(row):
  info = {"image_size": 32, "channels": 4, "num_train": 1_281_167}
  for name in ("sit_s2_routing", "sit_cpu_mnist_routing"):
    c = load_config(name, row)
    config_lib.validate(c)
    model = tasks.build_model(c, dict(info, image_size=c.data.image_size))
    for k, v in c.model.items():
      if k != "preset":
        assert getattr(model, k) == (v or None if k == "attention_impl" else v), k
  assert c.data.dataset == "embedded_mnist" and c.model.preset == "mnist/4"


@pytest.mark.parametrize("overrides,match", [
    ({"model.residual_routing": "mirorr"}, "model.residual_routing='mirorr' is not allowed; choose one of 'none', 'plain'"),
    ({"model.routing_decay": "before"}, "model.routing_decay='before' is not allowed; choose one of 'after'"),
    ({"model.residual_routing": "attnres", "model.alpha_min": 0.8},
     "residual_routing='attnres' has no identity shortcut to decay; it needs alpha_min=1"),
])
def test_bad_routing_configs_fail_before_compiling(overrides, match):
  with pytest.raises(ValueError, match=match):
    setup.check_config(override(load_config("sit_cpu_mnist_routing"), **overrides))
  with pytest.raises(ValueError, match="row='nope' is not allowed; choose one of 'baseline'"):
    load_config("sit_s2_routing", "nope")
