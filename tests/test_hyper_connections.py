"""Hyper-connections (models/hyper.py, docs/residual_forms.md): ``n`` residual streams per token.

By hand on depth-2 MAE, SiT and U-ViT models with random weights (static and dynamic); the initial
connections (``n = 1`` is the plain model exactly; ``n = 4`` keeps the streams equal); parameter
counts; one-line refusals; train steps of MAE, SiT and U-ViT move the connections. The helpers are
those of test_residual_forms.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.io import convert_uvit, official
from decay_jax.io.rules import ConversionError
from decay_jax.models import flops, hyper
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib
from decay_jax.models import uvit as uvit_lib
from decay_jax.models import vit as vit_lib
from decay_jax.models.residual import Residual
from decay_jax.train import optim, setup
from test_residual_forms import _attn, _dense, _ln, _mlp, _random, _sit_trunk, _train_steps
from test_sit_train import tiny_sit_config
from test_train import tiny_config
from test_uvit_train import tiny as tiny_uvit_config


# ----- hyper-connections (models/hyper.py) --------------------------------------------------------
def _hyper_sublayer(H, w, l, s, f, decay):
  """One sublayer by hand on ``H (N, T, n, C)``: ``h = A_m^T H``, ``H <- decay A_r^T H + beta f(h)``,
  with ``[A_m | A_r] += s_a tanh(LN(H) W_a)`` and ``beta += s_b tanh(LN(H) w_b)`` when dynamic."""
  w = {k: np.asarray(v, np.float64)[l, s] for k, v in w.items()}
  alpha = np.broadcast_to(w["static_alpha"], H.shape[:-1] + w["static_alpha"].shape[-1:])
  beta = np.broadcast_to(w["static_beta"], H.shape[:-1])
  if "dynamic_alpha" in w:
    normed = _ln(H)
    alpha = alpha + w["dynamic_alpha_scale"] * np.tanh(normed @ w["dynamic_alpha"])
    beta = beta + w["dynamic_beta_scale"] * np.tanh(normed @ w["dynamic_beta"])
  h = (alpha[..., 0, None] * H).sum(-2)
  out = f(h)
  mixed = np.einsum("ntsc,ntsr->ntrc", H, alpha[..., 1:])
  return decay * mixed + beta[..., None] * out[:, :, None, :]


def _hyper_weights(params, prefix="hyper_"):
  return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


def _hyper_block(p, l, H, alpha, w, wl, heads=2, mod=None, eps=1e-6):
  """A pre-norm block by hand on the streams (``wl``: the block's index in ``w``)."""
  blk = jax.tree_util.tree_map(lambda v: np.asarray(v, np.float64)[l], p)
  for s, name in enumerate(("attn", "mlp")):
    def f(h, s=s):
      h = _ln(h, blk.get(f"norm{s + 1}"), eps)
      if mod is not None:
        shift, scale, gate = mod[3 * s: 3 * s + 3]
        h = h * (1 + scale[:, None]) + shift[:, None]
      out = _attn(h, blk["attn"], heads) if s == 0 else _mlp(h, blk["mlp"], tanh=mod is not None)
      return out if mod is None else gate[:, None] * out
    H = _hyper_sublayer(H, w, wl, s, f, alpha[s])
  return H


HYPER = ("static", "dynamic")


@pytest.mark.parametrize("form", HYPER)
def test_mae_hyper_connections_by_hand_on_a_depth_2_model(form):
  spec = Residual(alpha_min=0.6, hyper_connections=form, hyper_rate=3)
  model = mae_lib.mae("micro/4", depth=2, in_chans=1, residual=spec)
  x = jax.random.normal(jax.random.key(0), (3, 16, 16, 1))
  params = _random(model.init(jax.random.key(2), x, jnp.zeros((3, 16)))["params"])
  feats, cls = model.apply({"params": params}, x, method=lambda m, im: (m.embed(im), m.cls_token
                                                                         + m.pos_embed()[None, :1]))
  tokens = np.concatenate([np.broadcast_to(cls, (3, 1, 32)), feats], 1).astype(np.float64)
  outs = model.apply({"params": params}, x, method=lambda m, im: m.run_encoder(m.embed(im)))
  H = np.repeat(tokens[:, :, None], 3, axis=2)  # the embedding repeated n times
  w = _hyper_weights(params)
  for l in range(2):
    H = _hyper_block(params["blocks"], l, H, model.shortcuts.alphas[l], w, l)
    np.testing.assert_allclose(outs[l], H.sum(2), rtol=1e-4, atol=1e-4)  # a block's output: sum


@pytest.mark.parametrize("form", HYPER)
def test_sit_hyper_connections_by_hand_on_a_depth_2_model(form):
  spec = Residual(alpha_min=0.7, hyper_connections=form, hyper_rate=2)
  model = sit_lib.sit("micro/2", depth=2, input_size=8, in_channels=4, num_classes=10,
                      learn_sigma=False, residual=spec)
  x = jax.random.normal(jax.random.key(0), (3, 8, 8, 4))
  t, y = jnp.array([0.1, 0.5, 0.9]), jnp.array([1, 2, 3])
  params = _random(model.init(jax.random.key(2), x, t, y)["params"])
  tokens, cond, _, enc_out, out = model.apply({"params": params}, x, t, y, method=_sit_trunk)
  c = np.asarray(cond, np.float64)
  c = c / (1 + np.exp(-c))
  H = np.repeat(np.asarray(tokens, np.float64)[:, :, None], 2, axis=2)
  w = _hyper_weights(params)
  for l, stack in enumerate(("enc_blocks", "dec_blocks")):
    p = jax.tree_util.tree_map(lambda v: np.asarray(v, np.float64), params[stack])
    if l == 1:  # the long skip reads the encoder block's sum and adds to every stream
      H = H + _dense(np.asarray(enc_out[0], np.float64),
                     jax.tree_util.tree_map(lambda v: v[0], p["skip"]))[:, :, None]
    mod = np.split(_dense(c, jax.tree_util.tree_map(lambda v: v[0], p["adaLN_modulation"])), 6,
                   axis=-1)
    H = _hyper_block(p, 0, H, model.shortcuts.alphas[l], w, l, mod=mod)
    if l == 0:
      np.testing.assert_allclose(enc_out[0], H.sum(2), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(out, H, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", HYPER)
def test_uvit_hyper_connections_by_hand_on_a_depth_2_model(form):
  """In-block, mid-block, out-block (U-ViT LN eps 1e-5, no qkv bias); the out-block's long skip
  replaces every stream as U-ViT replaces its one, beside the mean of the in-block's streams:
  ``H_i <- W [H_i ; s / n] + b``; the connections' sublayer index runs in -> mid -> out."""
  n = 3
  model = uvit_lib.UViT(img_size=8, patch_size=4, in_chans=1, dim=8, depth=2, num_heads=2,
                        residual=Residual(alpha_min=0.6, hyper_connections=form, hyper_rate=n))
  x, t = jax.random.normal(jax.random.key(0), (3, 8, 8, 1)), jnp.array([0.1, 0.5, 0.9])
  params = _random(model.init(jax.random.key(2), x, t)["params"])
  tokens = model.apply({"params": params}, x, t, method=lambda m, x, t: m.embed(x, t))
  final, in_outs, mid, out_outs = model.apply(
      {"params": params}, x, t, method=lambda m, x, t: m.run_blocks(m.embed(x, t)))
  p = jax.tree_util.tree_map(lambda v: np.asarray(v, np.float64), params)
  w, a = _hyper_weights(params), model.shortcuts.alphas  # (3, 2, ...): in0, mid, out0
  H = np.repeat(np.asarray(tokens, np.float64)[:, :, None], n, axis=2)
  H = _hyper_block(p["in_blocks"], 0, H, a[0], w, 0, eps=1e-5)
  s = H.sum(2)
  np.testing.assert_allclose(in_outs[0], s, rtol=1e-4, atol=1e-4)
  mid_p = jax.tree_util.tree_map(lambda v: v[None], p["mid_block"])
  H = _hyper_block(mid_p, 0, H, a[1], w, 1, eps=1e-5)
  np.testing.assert_allclose(mid, H.sum(2), rtol=1e-4, atol=1e-4)
  skip = jax.tree_util.tree_map(lambda v: v[0], p["out_blocks"]["skip_linear"])
  H = _dense(np.concatenate([H, np.broadcast_to(s[:, :, None] / n, H.shape)], -1), skip)
  H = _hyper_block(p["out_blocks"], 0, H, a[2], w, 2, eps=1e-5)
  np.testing.assert_allclose(out_outs[0], H.sum(2), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(final, H.sum(2), rtol=1e-4, atol=1e-4)
  init = model.init(jax.random.key(2), x, t)["params"]["hyper_static_alpha"]
  assert init.shape == (3, 2, n, 1 + n)  # out0's MLP is sublayer 5: A_m at stream 5 mod 3
  np.testing.assert_array_equal(init[2, 1, :, 0], np.eye(n)[5 % n])
  # FLOPs (models/flops.py): W_x on each of the n streams, W_s once: (n + 1) D^2 per skip token
  s2 = uvit_lib.uvit("S/2")
  s2_hc = uvit_lib.uvit("S/2", residual=Residual(hyper_connections=form))  # n = 4
  extra = 2 * s2.half * (s2.extras + s2.num_patches) * 512 ** 2 * (4 + 1 - 2)
  assert flops.uvit_forward_flops(s2_hc) - flops.uvit_forward_flops(s2) == extra


def _without_hyper(params):
  return {k: v for k, v in params.items() if not k.startswith("hyper_")}


@pytest.mark.parametrize("form", HYPER)
def test_hyper_connections_at_init_equal_the_plain_model(form):
  """With the initial connections: ``n = 1`` is the plain (decayed) pre-norm model exactly; with
  ``n = 4`` the streams stay equal, each the plain stream, so the MAE encoder's block outputs are
  4 times the plain model's (SiT's long skips read that sum, so SiT only at ``n = 1``)."""
  x = jax.random.normal(jax.random.key(0), (3, 16, 16, 1))
  for n in (1, 4):
    hc = mae_lib.mae("micro/4", depth=2, in_chans=1,
                     residual=Residual(alpha_min=0.6, hyper_connections=form, hyper_rate=n))
    plain = mae_lib.mae("micro/4", depth=2, in_chans=1, residual=Residual(alpha_min=0.6))
    params = model_params = hc.init(jax.random.key(2), x, jnp.zeros((3, 16)))["params"]
    # random branch weights (the zero-initialised ones too), the connections at their init
    params = dict(_random(_without_hyper(model_params)), **_hyper_weights(model_params, ""))
    run = lambda m, p: m.apply({"params": p}, x, method=lambda m, im: m.run_encoder(m.embed(im)))
    np.testing.assert_allclose(run(hc, params), n * run(plain, _without_hyper(params)),
                               rtol=1e-5, atol=1e-5 * n)
  sx = jax.random.normal(jax.random.key(0), (3, 8, 8, 4))
  t, y = jnp.array([0.1, 0.5, 0.9]), jnp.array([1, 2, 3])
  kw = dict(depth=2, input_size=8, in_channels=4, num_classes=10)
  hc = sit_lib.sit("micro/2", residual=Residual(hyper_connections=form, hyper_rate=1), **kw)
  plain = sit_lib.sit("micro/2", **kw)
  init = hc.init(jax.random.key(2), sx, t, y)["params"]
  params = dict(_random(_without_hyper(init)), **_hyper_weights(init, ""))
  np.testing.assert_allclose(hc.apply({"params": params}, sx, t, y),
                             plain.apply({"params": _without_hyper(params)}, sx, t, y),
                             rtol=1e-5, atol=1e-5)
  # U-ViT's long skip reads the mean of the streams, so at n = 4 too every stream stays the plain
  # one: every block output (in, mid, out, and the final stream) is 4 times the plain model's
  ux = jax.random.normal(jax.random.key(0), (3, 8, 8, 1))
  kw = dict(img_size=8, patch_size=4, in_chans=1, dim=8, depth=4, num_heads=2)
  plain = uvit_lib.UViT(residual=Residual(alpha_min=0.6), **kw)
  blocks = lambda m, x, t: m.run_blocks(m.embed(x, t))  # noqa: E731
  for n in (1, 4):
    hc = uvit_lib.UViT(residual=Residual(alpha_min=0.6, hyper_connections=form, hyper_rate=n),
                       **kw)
    init = hc.init(jax.random.key(2), ux, t)["params"]
    params = dict(_random(_without_hyper(init)), **_hyper_weights(init, ""))
    got = hc.apply({"params": params}, ux, t, method=blocks)
    want = plain.apply({"params": _without_hyper(params)}, ux, t, method=blocks)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, n * w, rtol=1e-5, atol=1e-6 * n)
    if n == 1:  # the output too (at n = 4 the final norm's eps sees a 4 times larger stream)
      np.testing.assert_allclose(hc.apply({"params": params}, ux, t),
                                 plain.apply({"params": _without_hyper(params)}, ux, t),
                                 rtol=1e-5, atol=1e-5)


def test_hyper_connection_initial_values_and_parameter_counts():
  model = mae_lib.mae("micro/4", depth=3, residual=Residual(hyper_connections="dynamic"))
  params = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), jnp.zeros((1, 16)))["params"]
  w = _hyper_weights(params)
  a = np.asarray(w["static_alpha"])  # (depth, 2, n, 1+n): [A_m | A_r] per sublayer
  assert a.shape == (3, 2, 4, 5)
  for l in range(3):
    for s in range(2):  # A_m one-hot at stream (2 l + s) mod n, A_r = I, beta = 1
      np.testing.assert_array_equal(a[l, s, :, 0], np.eye(4)[(2 * l + s) % 4])
      np.testing.assert_array_equal(a[l, s, :, 1:], np.eye(4))
  np.testing.assert_array_equal(w["static_beta"], np.ones((3, 2, 4)))
  assert np.all(np.asarray(w["dynamic_alpha"]) == 0) and np.all(np.asarray(w["dynamic_beta"]) == 0)
  np.testing.assert_allclose(w["dynamic_alpha_scale"], np.full((3, 2), 0.01))
  np.testing.assert_allclose(w["dynamic_beta_scale"], np.full((3, 2), 0.01))
  # per sublayer: n (1+n) + n static; + C (1+n) + C + 2 dynamic (C = 32)
  count = sum(int(np.size(v)) for v in w.values())
  assert count == 3 * 2 * hyper.extra_params(32, 4, True) == 3 * 2 * (24 + 32 * 6 + 2)
  static = mae_lib.mae("micro/4", depth=3, residual=Residual(hyper_connections="static"))
  sp = static.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), jnp.zeros((1, 16)))["params"]
  assert sum(int(np.size(v)) for v in _hyper_weights(sp).values()) == 3 * 2 * (4 * 5 + 4)
  # weight decay: the dynamic projections only (the static connections and scales are structure)
  mask = optim.weight_decay_mask(params)
  assert {k: v for k, v in mask.items() if k.startswith("hyper_")} == {
      "hyper_static_alpha": False, "hyper_static_beta": False, "hyper_dynamic_alpha": True,
      "hyper_dynamic_alpha_scale": False, "hyper_dynamic_beta": True,
      "hyper_dynamic_beta_scale": False}


def test_hyper_connection_refusals_are_one_line():
  for kwargs, match in [
      (dict(hyper_connections="yes"), "hyper_connections='yes' is not allowed; choose one of"),
      (dict(hyper_connections="static", hyper_rate=0), "hyper_rate=0 is not allowed"),
      (dict(hyper_connections="static", branch_gain="rezero"),
       "branch_gain='rezero' is not allowed; hyper-connections take no branch gains"),
      (dict(hyper_connections="dynamic", norm_position="deepnorm"),
       "norm_position='deepnorm' is not allowed; hyper-connections are pre-norm")]:
    with pytest.raises(ValueError, match=match) as err:
      Residual(**kwargs)
    assert "\n" not in str(err.value)
  spec = Residual(hyper_connections="static")
  with pytest.raises(ValueError, match="hyper_connections='static' is not allowed with "
                                       "residual_routing='mirror'") as err:
    sit_lib.sit("micro/2", residual=spec, residual_routing="mirror")
  assert "\n" not in str(err.value)
  with pytest.raises(ConversionError, match="hyper_connections='static' has no counterpart") as e:
    official.mae_to_torch({}, mae_lib.mae("micro/4", residual=spec))
  assert "\n" not in str(e.value)
  with pytest.raises(ConversionError, match="hyper_connections='static' has no counterpart in "
                                            "U-ViT") as e:
    convert_uvit.uvit_from_torch({}, uvit_lib.uvit("tiny/4", residual=spec))
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("form", HYPER)
def test_the_fine_tuning_vit_carries_the_maes_hyper_connections(form):
  """A classifier from an MAE with hyper-connections takes its ``hyper_*`` weights and computes
  ``head(fc_norm(mean of the last block's patch tokens))`` of the MAE's own (reduced) features;
  the weights get the layer ids of their blocks and the MAE's weight-decay rule."""
  from decay_jax.train import finetune_optim
  spec = Residual(alpha_min=0.7, hyper_connections=form, hyper_rate=3)
  mae = mae_lib.MaskedAutoencoder(img_size=8, patch_size=4, in_chans=1, dim=8, depth=2,
                                  num_heads=2, decoder_dim=8, decoder_depth=1, decoder_num_heads=1,
                                  residual=spec)
  x = jax.random.normal(jax.random.key(3), (2, 8, 8, 1))
  mae_params = mae.init({"params": jax.random.key(0), "masking": jax.random.key(1)}, x)["params"]
  mae_params = jax.tree_util.tree_map(  # move every weight off its start (dynamic ones are 0)
      lambda p: p + 0.05 * jax.random.normal(jax.random.key(p.size), p.shape), mae_params)
  vit = vit_lib.from_mae(mae, num_classes=3, drop_path=0.0)
  params = vit_lib.init_from_mae(vit.init(jax.random.key(2), x)["params"], mae, mae_params)
  hyper_names = sorted(n for n in mae_params if n.startswith("hyper_"))
  assert hyper_names and hyper_names == sorted(n for n in params if n.startswith("hyper_"))
  for n in hyper_names:
    np.testing.assert_array_equal(params[n], mae_params[n])
  feats = mae.apply({"params": mae_params}, x, method=mae.features)[-1]
  pooled = feats[:, 1:].mean(axis=1)
  mu, var = pooled.mean(-1, keepdims=True), pooled.var(-1, keepdims=True)
  ln = params["fc_norm"]
  normed = (pooled - mu) / jnp.sqrt(var + 1e-6) * ln["scale"] + ln["bias"]
  want = normed @ params["head"]["kernel"] + params["head"]["bias"]
  np.testing.assert_allclose(vit.apply({"params": params}, x), want, rtol=1e-5, atol=1e-6)
  ids = finetune_optim.layer_ids(params, 2)
  assert all(list(ids[n]) == [1, 2] for n in hyper_names)
  mask = finetune_optim.weight_decay_mask(params)
  assert not mask["hyper_static_alpha"] and not mask["hyper_static_beta"]
  if form == "dynamic":
    assert mask["hyper_dynamic_alpha"] and mask["hyper_dynamic_beta"]


@pytest.mark.parametrize("task", ["mae", "sit", "uvit"])
def test_train_steps_move_the_hyper_connections(task, form="dynamic"):
  """Dynamic (its static part is the static form's parameters): four steps move them (the
  official MAE's zero-initialised output layers keep the encoder's branches, and so beta's
  gradient, at 0 for the first three)."""
  make = {"mae": tiny_config, "sit": tiny_sit_config, "uvit": tiny_uvit_config}[task]
  config = make(**{"model.hyper_connections": form, "model.alpha_min": 0.7})
  s = setup.build(config)
  state = s.init_state()
  before = jax.tree_util.tree_map(np.array, _hyper_weights(state["params"]))
  state = _train_steps(s, config, state, 4)
  after = _hyper_weights(state["params"])
  assert set(after) == set(before)
  for k in ("static_alpha", "static_beta"):
    assert np.abs(np.asarray(after[k]) - before[k]).max() > 0, (task, form, k)
