"""The four ``routing_decay`` modes of SiT residual routing against a hand computation (issue 36.7).

For every routed variant that can decay (mirror and the fused ones; attnres has no identity to
decay) and every mode, a depth-2 SiT (encoder block 1, decoder block 1, K = 1) with alpha_min = 0.6
and random parameters (adaLN gates, routing ``w`` and all) runs once with its intermediates
captured. Its trunk is then recomputed in numpy (float64) from the trunk input ``x_0``, the gated
sublayer outputs ``g * f(.)`` the model computed, the routing ``w`` and the formula of the mode as
written in decay_jax/models/routing.py (module docstring) and docs/routing.md (spec 10), and must
match the trunk output to 1e-5. The same branch outputs pushed through any other mode's formula
must not match, and the four modes' models must differ from each other.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.models import routing
from decay_jax.models import sit as sit_lib
from decay_jax.models.residual import Residual

ALPHA_MIN = 0.6
# The sublayer schedule of depth 2: alpha_k = 1 - k (1 - 0.6) / 3 for sublayers k = 0..3 (enc attn,
# enc mlp, dec attn, dec mlp). The first coefficient of that schedule is always exactly 1.
ALPHAS = np.array([[1.0, 13 / 15], [11 / 15, 0.6]])
# Depth 2, K = 1: the sources x_i each block routes over besides the stream x (both sublayers), or
# None where the block routes nothing. x_0 = patch + position embedding, x_1 = encoder output; the
# mirror of decoder block j = 1 is x_{K-j+1} = x_1.
SOURCES = {
    "mirror": (None, (1,)),
    "fused_mirror": ((0,), (1,)),
    "fused_all": ((0,), (0, 1)),
    "fused_first": ((0,), (0,)),
    "fused_last": ((0,), (1,)),
}
MODES = ("after", "current", "encoder", "null")
BLOCKS = ("enc_00", "dec_00")
SUBLAYERS = ("attn", "mlp")
RMS_EPS = 1e-6
TOL = 1e-5


def test_the_cases_cover_every_decaying_variant_and_mode():
  assert MODES == routing.DECAY_MODES
  assert set(SOURCES) == set(routing.ROUTED) - {"attnres"}
  for v, plan in SOURCES.items():
    assert tuple(routing.block_sources(v, 2)) == plan
  np.testing.assert_allclose(make_model("mirror", "after").shortcuts.alphas, ALPHAS, rtol=1e-15)


def hand_route(w, cands, null=None):
  """``x~ = sum_k pi_k u_k``, ``pi = softmax_k(w^T u_k / sqrt(mean(u_k^2) + eps))``, with a zero
  candidate of fixed logit ``null`` appended when given; returns ``(x~, pi (|U|(+1), N, T))``."""
  z = [(u @ w) / np.sqrt(np.mean(u ** 2, axis=-1) + RMS_EPS) for u in cands]
  if null is not None:
    z.append(np.full_like(z[0], null))
  z = np.stack(z)
  e = np.exp(z - z.max(axis=0))
  pi = e / e.sum(axis=0)
  return sum(p[..., None] * u for p, u in zip(pi, cands)), pi  # the zero candidate adds nothing


def hand_trunk(variant, mode, cap):
  """The trunk output by the documented update of ``mode``, and each routed sublayer's weights
  averaged over tokens ``(N, |U|(+1))`` in model order."""
  x = cap["x0"]
  xs, weights = [x], []
  for b, (block, srcs) in enumerate(zip(BLOCKS, SOURCES[variant])):
    decoder = b == 1
    for i, sub in enumerate(SUBLAYERS):
      a, f = ALPHAS[b, i], cap["branch"][block, sub]
      if srcs is None:  # a sublayer that routes nothing: x <- a x + f(x) in every mode
        x = a * x + f
        continue
      sources, w = [xs[k] for k in srcs], cap["w"][block, sub]
      if mode == "after":  # x~ = R(x, sources); x <- a x~ + f(x~)
        xt, pi = hand_route(w, [x, *sources])
        x = a * xt + f
      elif mode == "current":  # x~ = R(a x, sources); x <- x~ + f(x~)
        xt, pi = hand_route(w, [a * x, *sources])
        x = xt + f
      elif mode == "encoder":  # encoder as 'after'; decoder: x <- 1 * x~ + f(x~)
        xt, pi = hand_route(w, [x, *sources])
        x = (1.0 if decoder else a) * xt + f
      else:  # null: U + [0] with fixed logit log(|U| (1 - a) / a) (no zero at a = 1); x <- x~ + f(x~)
        n = 1 + len(sources)
        xt, pi = hand_route(w, [x, *sources], math.log(n * (1 - a) / a) if a < 1 else None)
        x = xt + f
      weights.append(pi.mean(axis=-1).T)
    if not decoder:
      xs.append(x)
  return x, weights


def make_model(variant, mode):
  return sit_lib.sit("micro/2", depth=2, input_size=8, num_classes=10,
                     residual=Residual(alpha_min=ALPHA_MIN), residual_routing=variant,
                     routing_decay=mode)


@functools.lru_cache(maxsize=None)
def run_variant(variant):
  """One compiled program for the four modes of ``variant`` with shared random parameters: per mode
  the captured trunk input, gated branch outputs, routing ``w``, sown weights and trunk output."""
  rng = np.random.default_rng(36)
  x = jnp.asarray(rng.standard_normal((2, 8, 8, 4)), jnp.float32)
  t, y = jnp.asarray([0.3, 0.8], jnp.float32), jnp.asarray([2, 7], jnp.int32)
  models = {mode: make_model(variant, mode) for mode in MODES}
  abstract = jax.eval_shape(models["after"].init, jax.random.key(0), x, t, y)["params"]
  # every parameter random, zero-initialised adaLN (gates) and routing w included, so every branch
  # is live: kernels N(0, 1/fan_in) (activations stay O(1)), biases, embeddings and w N(0, 0.3^2)
  def draw(path, p):
    std = 1 / math.sqrt(np.prod(p.shape[:-1])) if path[-1].key == "kernel" else 0.3
    return jnp.asarray(std * rng.standard_normal(p.shape), jnp.float32)

  params = jax.tree_util.tree_map_with_path(draw, abstract)
  fn = jax.jit(lambda p: {
      mode: m.apply({"params": p}, x, t, y, capture_intermediates=True,
                    mutable=["intermediates"])[1]["intermediates"] for mode, m in models.items()})
  inter = jax.device_get(fn(params))
  params = jax.device_get(params)
  dim, caps = models["after"].dim, {}
  for mode, m in models.items():
    assert m.shortcuts.branch_scale == 1.0 and not m.shortcuts.learnable
    trunk = inter[mode]["trunk"]
    cap = {"x0": np.float64(inter[mode]["x_embedder"]["__call__"][0]) + m.pos_embed()[None],
           "out": np.float64(trunk["__call__"][0]), "branch": {}, "w": {}, "sown": []}
    for b, block in enumerate(BLOCKS):
      mod = np.float64(trunk[block]["adaLN_modulation"]["__call__"][0]).reshape(-1, 6, dim)
      for i, sub in enumerate(SUBLAYERS):  # g_i * f_i(mod(LN(x~))), gate = adaLN chunk 3 i + 2
        f = np.float64(trunk[block][sub]["__call__"][0])
        cap["branch"][block, sub] = mod[:, None, 3 * i + 2] * f
        if SOURCES[variant][b] is not None:
          cap["w"][block, sub] = np.float64(params["trunk"][block][f"route_{sub}"])
          cap["sown"].append(np.float64(trunk[block][f"route_{sub}"][0]))
    caps[mode] = cap
  return caps


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", list(SOURCES))
def test_decay_mode_is_its_formula(variant, mode):
  caps = run_variant(variant)
  cap = caps[mode]
  scale = np.abs(cap["out"]).max()
  assert 0.5 < scale < 100  # a live, finite trunk
  for f in cap["branch"].values():
    assert np.abs(f).max() > 0.05  # every gated branch contributes
  got, weights = hand_trunk(variant, mode, cap)
  np.testing.assert_allclose(got, cap["out"], rtol=TOL, atol=TOL)
  # the routing weights the model sows (mean over tokens, null column last) are the hand ones
  assert len(weights) == len(cap["sown"])
  for want, sown in zip(weights, cap["sown"]):
    np.testing.assert_allclose(sown, want, rtol=TOL, atol=TOL)
  assert any(np.abs(p - 1 / p.shape[-1]).max() > 0.05 for p in weights)  # not uniform: w is live
  for other in MODES:
    if other == mode:
      continue
    # the same branch outputs through another mode's coefficients do not give this output ...
    wrong, _ = hand_trunk(variant, other, cap)
    assert np.abs(wrong - cap["out"]).max() > 100 * TOL * scale, other
    # ... and the other mode's model, with the same parameters, computes something else
    assert np.abs(caps[other]["out"] - cap["out"]).max() > 100 * TOL * scale, other


@pytest.mark.parametrize("variant", ["plain", "static_skip"])
def test_variants_that_route_nothing_decay_alike_in_every_mode(variant):
  # Sublayers that route nothing keep alpha x + f(x) whatever routing_decay says ('encoder' used
  # to set the decoder's coefficients of these variants to 1 as well).
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((2, 8, 8, 4)), jnp.float32)
  t, y = jnp.asarray([0.3, 0.8], jnp.float32), jnp.asarray([2, 7], jnp.int32)
  models = {mode: make_model(variant, mode) for mode in MODES}
  abstract = jax.eval_shape(models["after"].init, jax.random.key(0), x, t, y)["params"]
  params = jax.tree_util.tree_map(
      lambda p: jnp.asarray(0.3 * rng.standard_normal(p.shape), jnp.float32), abstract)
  outs = jax.jit(lambda p: {mode: m.apply({"params": p}, x, t, y)
                            for mode, m in models.items()})(params)
  assert float(jnp.abs(outs["after"]).max()) > 0.1
  for mode in MODES[1:]:
    np.testing.assert_array_equal(np.asarray(outs[mode]), np.asarray(outs["after"]), err_msg=mode)
  # ... and still decay: alpha_min 1 computes something else
  plain = sit_lib.sit("micro/2", depth=2, input_size=8, num_classes=10,
                      residual=Residual(alpha_min=1.0), residual_routing=variant)
  assert float(jnp.abs(plain.apply({"params": params}, x, t, y) - outs["after"]).max()) > 1e-3
