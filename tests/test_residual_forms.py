"""Residual forms with trained branch gains (models/residual.py, docs/residual_forms.md):
LayerScale ``x + diag(lambda) f(x)`` and ReZero ``x + a f(x)``.

The formula is checked by hand on depth-2 models: a gain on a branch whose last layer is linear
equals that layer with its kernel columns and bias scaled by the gain, so the gained model must
compute what the plain model computes with ``attn.proj`` and ``mlp.fc2`` rescaled. Then: the
initial values (CaiT's rule, ReZero's 0), four train steps of MAE and SiT with each form (the
gains move; ReZero's too, because its branches do not also start at zero), and the converters'
one-line refusal.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from decay_jax.io import convert_uvit, official
from decay_jax.io.rules import ConversionError
from decay_jax.models import mae as mae_lib
from decay_jax.models import residual
from decay_jax.models import sit as sit_lib
from decay_jax.models import uvit as uvit_lib
from decay_jax.models import vit as vit_lib
from decay_jax.models.residual import Residual
from decay_jax.train import setup
from decay_jax.train.tasks.uvit import UViTTask
from ml_collections import ConfigDict
from test_sit_train import tiny_sit_config
from test_train import tiny_config

GAINS = ("layerscale", "rezero")


def _scaled_branches(params, stacks, gained_params, rng):
  """``params`` of the plain model with every block's ``attn.proj`` and ``mlp.fc2`` scaled by the
  gains of ``gained_params`` (set to random values in place first); returns both trees."""
  gained_params = jax.tree_util.tree_map(np.asarray, gained_params)
  plain = jax.tree_util.tree_map(np.array, params)
  for stack in stacks:
    blocks, out = gained_params[stack], plain[stack]
    for name, last in (("attn", "proj"), ("mlp", "fc2")):
      g = rng.uniform(0.3, 1.7, blocks[f"gain_{name}"].shape).astype(np.float32)
      blocks[f"gain_{name}"] = g
      # (depth, C) per channel (LayerScale) or (depth,) per block (ReZero); kernels (depth, in, C)
      gk, gb = (g[:, None, :], g) if g.ndim == 2 else (g[:, None, None], g[:, None])
      out[name][last]["kernel"] = out[name][last]["kernel"] * gk
      out[name][last]["bias"] = out[name][last]["bias"] * gb
  return plain, gained_params


def _copy_shared(src, dst):
  """``dst`` with every leaf of ``src`` that ``dst`` also has (everything but the gains)."""
  if isinstance(dst, dict):
    return {k: _copy_shared(src[k], v) if k in src else v for k, v in dst.items()}
  return np.asarray(src)


@pytest.mark.parametrize("gain", GAINS)
def test_mae_gains_equal_rescaled_branch_outputs_on_a_depth_2_model(gain):
  plain_model = mae_lib.mae("micro/4", depth=2, in_chans=1, residual=Residual(alpha_min=0.6))
  model = mae_lib.mae("micro/4", depth=2, in_chans=1,
                      residual=Residual(alpha_min=0.6, branch_gain=gain))
  x = jax.random.normal(jax.random.key(0), (3, 16, 16, 1))
  noise = jax.random.uniform(jax.random.key(1), (3, model.num_patches))
  params = model.init(jax.random.key(2), x, noise)["params"]
  assert params["blocks"]["gain_attn"].shape == ((2, 32) if gain == "layerscale" else (2,))
  # the official init zeroes attn.proj, mlp.fc2 and the prediction head: random weights instead
  rng = np.random.default_rng(1)
  params = jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape).astype(np.float32) * 0.2,
                                  params)
  plain_params = _copy_shared(params, jax.tree_util.tree_map(
      np.asarray, plain_model.init(jax.random.key(2), x, noise)["params"]))
  plain_params, params = _scaled_branches(plain_params, ["blocks"], params,
                                          np.random.default_rng(0))
  out = model.apply({"params": params}, x, noise)
  ref = plain_model.apply({"params": plain_params}, x, noise)
  np.testing.assert_allclose(out["pred"], ref["pred"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["loss"], ref["loss"], rtol=1e-5)
  # and the gains matter: the same weights without them compute something else
  plain_again = plain_model.apply({"params": _copy_shared(params, plain_params)}, x, noise)
  assert not np.allclose(plain_again["pred"], out["pred"], atol=1e-4)


@pytest.mark.parametrize("gain", GAINS)
def test_sit_gains_equal_rescaled_branch_outputs_on_a_depth_2_model(gain):
  kw = dict(input_size=8, in_channels=4, num_classes=10, learn_sigma=False)
  plain_model = sit_lib.sit("micro/2", depth=2, residual=Residual(alpha_min=0.7), **kw)
  model = sit_lib.sit("micro/2", depth=2, residual=Residual(alpha_min=0.7, branch_gain=gain),
                      **kw)
  x = jax.random.normal(jax.random.key(0), (3, 8, 8, 4))
  t, y = jnp.array([0.1, 0.5, 0.9]), jnp.array([1, 2, 3])
  params = model.init(jax.random.key(2), x, t, y)["params"]
  # adaLN-Zero gates are 0 at init; random weights everywhere so that every branch counts
  rng = np.random.default_rng(1)
  params = jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape).astype(np.float32) * 0.2,
                                  params)
  plain_params = _copy_shared(params, jax.tree_util.tree_map(
      np.asarray, plain_model.init(jax.random.key(2), x, t, y)["params"]))
  plain_params, params = _scaled_branches(plain_params, ["enc_blocks", "dec_blocks"], params, rng)
  out = model.apply({"params": params}, x, t, y)
  ref = plain_model.apply({"params": plain_params}, x, t, y)
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
  assert not np.allclose(plain_model.apply({"params": _copy_shared(params, plain_params)}, x, t, y),
                         out, atol=1e-3)


def test_initial_gains_follow_cait_and_rezero():
  assert [residual.cait_init(d) for d in (2, 12, 18, 19, 24, 28, 32)] == [
      0.1, 0.1, 0.1, 1e-5, 1e-5, 1e-6, 1e-6]
  assert Residual(branch_gain="layerscale").at_depth(28).gain_init == 1e-6
  assert Residual(branch_gain="layerscale", gain_init=0.5).at_depth(28).gain_init == 0.5
  assert Residual(branch_gain="rezero").at_depth(12).gain_init == 0.0
  assert Residual().at_depth(12) == Residual()
  x = jnp.zeros((1, 16, 16, 1))
  noise = jnp.zeros((1, 16))
  for gain, want in (("layerscale", 0.1), ("rezero", 0.0)):
    model = mae_lib.mae("micro/4", in_chans=1, residual=Residual(branch_gain=gain))
    p = model.init(jax.random.key(0), x, noise)["params"]["blocks"]
    np.testing.assert_array_equal(p["gain_mlp"], np.full(p["gain_mlp"].shape, want, np.float32))
    # ReZero starts its branches at a random init (its gain is the zero); LayerScale keeps the
    # official MAE's zero-initialised attn.proj
    assert (np.abs(p["attn"]["proj"]["kernel"]).max() > 0) == (gain == "rezero")
  for bad, msg in ((dict(branch_gain="scale"), "branch_gain='scale' is not allowed"),
                   (dict(gain_init=-0.5), "gain_init=-0.5 is not allowed")):
    with pytest.raises(ValueError, match=msg):
      Residual(**bad)
  with pytest.raises(ValueError, match="branch_gain='layerscale' is not allowed with "
                                       "residual_routing='fused_mirror'"):
    sit_lib.sit("micro/2", residual_routing="fused_mirror",
                residual=Residual(branch_gain="layerscale"))


def _train_steps(s, config, state, steps):
  """``steps`` train steps of ``s`` on one batch; the losses must stay finite. Returns the state."""
  batch, losses = _batch(s, config), []
  for _ in range(steps):
    state, metrics = s.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)), losses
  return state


def _batch(s, config):
  """A batch of the task's input dtype: random images and labels."""
  rng = np.random.default_rng(0)
  shape = (config.batch_size,) + s.task.image_shape()
  return {"image": rng.integers(0, 256, shape).astype(np.uint8)
          if s.abstract_batch()["image"].dtype == jnp.uint8
          else rng.standard_normal(shape).astype(np.float32),
          "label": rng.integers(0, 10, config.batch_size).astype(np.int32)}


@pytest.mark.parametrize("gain", GAINS)
@pytest.mark.parametrize("task", ["mae", "sit"])
def test_train_steps_move_the_gains(task, gain):
  config = (tiny_config if task == "mae" else tiny_sit_config)(
      **{"model.branch_gain": gain, "model.alpha_min": 0.7})
  s = setup.build(config)
  state = s.init_state()
  stack = "blocks" if task == "mae" else "enc_blocks"
  before = np.array(state["params"][stack]["gain_attn"])  # a copy: the step donates the state
  # Four steps: MAE's zero-initialised head passes no gradient to the encoder at step 1, and its
  # zero attn.proj (kept with LayerScale) none to the gain at step 2.
  state = _train_steps(s, config, state, 4)
  after = np.asarray(state["params"][stack]["gain_attn"])
  assert np.abs(after - before).max() > 0, (task, gain)


def test_the_official_layout_refuses_branch_gains_in_one_line():
  model = mae_lib.mae("micro/4", in_chans=1, residual=Residual(branch_gain="layerscale"))
  params = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 1)), jnp.zeros((1, 16)))["params"]
  with pytest.raises(ConversionError, match="branch_gain='layerscale' has no counterpart in the "
                                            "official model"):
    official.mae_to_torch(params, model)
  with pytest.raises(ConversionError, match="branch_gain='rezero' has no counterpart"):
    official.sit_from_torch({}, sit_lib.sit("micro/2", residual=Residual(branch_gain="rezero")))


# ----- DeepNorm and post-norm (norm_position), stochastic depth (drop_path) -----------------------
# The hand computation: a numpy float64 forward of the blocks from their parameters and the
# formulas of docs/residual_forms.md, against the model's block outputs.

def _ln(x, p=None, eps=1e-6):
  """LayerNorm over the last axis (biased variance); affine with ``p`` (scale, bias)."""
  y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
  return y if p is None else y * p["scale"] + p["bias"]


def _dense(x, p):
  return x @ p["kernel"] + p.get("bias", 0.0)


def _attn(x, p, heads):
  n, t, c = x.shape
  qkv = _dense(x, p["qkv"]).reshape(n, t, 3, heads, c // heads)
  q, k, v = (np.moveaxis(qkv[:, :, i], 2, 1) for i in range(3))  # (N, H, T, c/H)
  z = q @ np.swapaxes(k, -1, -2) / np.sqrt(c // heads)
  w = np.exp(z - z.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return _dense(np.moveaxis(w @ v, 1, 2).reshape(n, t, c), p["proj"])


def _mlp(x, p, tanh):
  h = _dense(x, p["fc1"])
  if tanh:
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
  else:
    h = 0.5 * h * (1 + scipy.special.erf(h / np.sqrt(2)))
  return _dense(h, p["fc2"])


def _block(p, l, x, alpha, form, depth, keep=(1.0, 1.0), heads=2, mod=None):
  """One block by hand: sublayer ``s`` is ``x <- alpha_s x + k_s f_s(LN_s x)`` ('pre') or
  ``x <- LN_s(a alpha_s x + k_s f_s(x))`` (a = 1 'post', (2N)^(1/4) 'deepnorm'), with ``k_s (N,)``
  the drop-path factors; ``mod``: SiT's adaLN chunks (shift, scale, gate) per sublayer."""
  a = (2.0 * depth) ** 0.25 if form == "deepnorm" else 1.0
  blk = jax.tree_util.tree_map(lambda v: np.asarray(v, np.float64)[l], p)
  for s, name in enumerate(("attn", "mlp")):
    norm = blk.get(f"norm{s + 1}")  # SiT's norms have no parameters
    h = _ln(x, norm) if form == "pre" else x
    if mod is not None:
      shift, scale, gate = mod[3 * s: 3 * s + 3]
      h = h * (1 + scale[:, None]) + shift[:, None]
    f = _attn(h, blk["attn"], heads) if s == 0 else _mlp(h, blk["mlp"], tanh=mod is not None)
    if mod is not None:
      f = gate[:, None] * f
    f = np.asarray(keep[s])[:, None, None] * f
    x = alpha[s] * x + f if form == "pre" else _ln(a * alpha[s] * x + f, norm)
  return x


def _random(params, scale=0.2, seed=1):
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(
      lambda a: rng.standard_normal(a.shape).astype(np.float32) * scale, params)


def _sit_trunk(m, x, t, y):
  """A SiT's trunk by parts (``method=`` of ``apply``): ``(tokens, cond, encoder stream, encoder
  skips, decoder stream)``, the streams expanded where the form has hyper-connections."""
  tokens = m.x_embedder(x) + m.pos_embed()[None]
  cond = m.t_embedder(t) + m.embed_labels(y, False)
  h, enc = m.enc_blocks(m.residual.expand(tokens), m.block_inputs(0), cond)
  out, _ = m.dec_blocks(h, m.block_inputs(1, None, enc[::-1]), cond)
  return tokens, cond, h, enc, out


def _keep(rate, u):
  """timm's drop-path factor per example: floor(1 - rate + u) / (1 - rate)."""
  return np.floor(1 - rate + u) / (1 - rate)


FORMS = ("post", "deepnorm")


@pytest.mark.parametrize("form,drop", [("post", 0.0), ("deepnorm", 0.0), ("pre", 0.6),
                                       ("deepnorm", 0.6)])
def test_mae_norm_position_and_drop_path_by_hand_on_a_depth_2_model(form, drop):
  spec = Residual(alpha_min=0.6, norm_position=form, drop_path=drop)
  model = mae_lib.mae("micro/4", depth=2, in_chans=1, residual=spec)
  x = jax.random.normal(jax.random.key(0), (3, 16, 16, 1))
  params = _random(model.init(jax.random.key(2), x, jnp.zeros((3, 16)))["params"])
  u = np.array(jax.random.uniform(jax.random.key(3), (2, 3, 2)))  # (depth, N, 2)
  u[1, :, 0] = [0.1, 0.9, 0.5]  # block 1 (rate 0.6): drop, keep, drop its attention branch
  feats, cls = model.apply({"params": params}, x, method=lambda m, im: (m.embed(im), m.cls_token
                                                                         + m.pos_embed()[None, :1]))
  tokens = np.concatenate([np.broadcast_to(cls, (3, 1, 32)), feats], 1).astype(np.float64)
  outs = model.apply({"params": params}, x, u if drop else None,
                     method=lambda m, im, uu: m.run_encoder(m.embed(im), uu))
  alphas = model.shortcuts.alphas
  rates = (0.0, drop)
  for l in range(2):
    keep = [_keep(rates[l], u[l, :, s]) if drop else np.ones(3) for s in range(2)]
    tokens = _block(params["blocks"], l, tokens, alphas[l], form, 2, keep)
    np.testing.assert_allclose(outs[l], tokens, rtol=1e-4, atol=1e-4)
  if drop:  # the draws above drop block 1's attention branch for examples 0 and 2 only
    assert [float(_keep(0.6, v)) for v in u[1, :, 0]] == [0.0, 2.5, 0.0]
    # evaluation (no draws) drops nothing, and equals the same model without drop path
    plain = mae_lib.mae("micro/4", depth=2, in_chans=1,
                        residual=Residual(alpha_min=0.6, norm_position=form))
    run = lambda m: m.apply({"params": params}, x, method=lambda m, im: m.run_encoder(m.embed(im)))
    np.testing.assert_array_equal(run(model), run(plain))


@pytest.mark.parametrize("form,drop", [("deepnorm", 0.0), ("pre", 0.6), ("deepnorm", 0.6)])
def test_sit_norm_position_and_drop_path_by_hand_on_a_depth_2_model(form, drop):
  spec = Residual(alpha_min=0.7, norm_position=form, drop_path=drop)
  model = sit_lib.sit("micro/2", depth=2, input_size=8, in_channels=4, num_classes=10,
                      learn_sigma=False, residual=spec)
  x = jax.random.normal(jax.random.key(0), (3, 8, 8, 4))
  t, y = jnp.array([0.1, 0.5, 0.9]), jnp.array([1, 2, 3])
  params = _random(model.init(jax.random.key(2), x, t, y)["params"])
  u = np.array(jax.random.uniform(jax.random.key(3), (2, 3, 2)))
  u[1, :, 1] = [0.2, 0.8, 0.3]  # decoder block (rate 0.6): drop, keep, drop its MLP branch

  def trunk(m, x, t, y, uu):
    tokens = m.x_embedder(x) + m.pos_embed()[None]
    cond = m.t_embedder(t) + m.embed_labels(y, False)
    h, enc = m.enc_blocks(tokens, m.block_inputs(0, uu), cond)
    out, _ = m.dec_blocks(h, m.block_inputs(1, uu, enc[::-1]), cond)
    return tokens, cond, h, out

  tokens, cond, enc_out, out = model.apply({"params": params}, x, t, y, u if drop else None,
                                           method=trunk)
  silu = lambda v: v / (1 + np.exp(-v))
  c = silu(np.asarray(cond, np.float64))
  h = np.asarray(tokens, np.float64)
  alphas, rates = model.shortcuts.alphas, (0.0, drop)
  for l, stack in enumerate(("enc_blocks", "dec_blocks")):
    p = params[stack]
    if l == 1:  # the decoder block first adds the long skip's Linear of the encoder output
      h = h + _dense(np.asarray(enc_out, np.float64),
                     jax.tree_util.tree_map(lambda v: np.asarray(v, np.float64)[0], p["skip"]))
    mod = np.split(_dense(c, jax.tree_util.tree_map(lambda v: np.asarray(v, np.float64)[0],
                                                    p["adaLN_modulation"])), 6, axis=-1)
    keep = [_keep(rates[l], u[l, :, s]) if drop else np.ones(3) for s in range(2)]
    h = _block(p, 0, h, alphas[l], form, 2, keep, mod=mod)
    if l == 0:
      np.testing.assert_allclose(enc_out, h, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(out, h, rtol=1e-4, atol=1e-4)
  if drop:  # the full model drops nothing without the draws (evaluation, sampling)
    plain = sit_lib.sit("micro/2", depth=2, input_size=8, in_channels=4, num_classes=10,
                        learn_sigma=False, residual=dataclasses.replace(spec, drop_path=0.0))
    np.testing.assert_array_equal(model.apply({"params": params}, x, t, y),
                                  plain.apply({"params": params}, x, t, y))
    assert not np.allclose(model.apply({"params": params}, x, t, y, drop_u=u),
                           plain.apply({"params": params}, x, t, y), atol=1e-4)


def test_deepnorm_constants_and_init():
  # (2N)^(1/4) and (8N)^(-1/4) (torchscale Encoder, encoder-only), at the paper sizes' N
  assert residual.deepnorm_constants(2) == pytest.approx((2 ** 0.5, 0.5))  # 4^(1/4), 16^(-1/4)
  a, b = residual.deepnorm_constants(12)
  assert a == pytest.approx(24 ** 0.25) and a == pytest.approx(2.2134, abs=1e-4)
  assert b == pytest.approx(96 ** -0.25) and b == pytest.approx(0.31947, abs=1e-5)
  assert Residual(norm_position="deepnorm").at_depth(28).deepnorm_gains == pytest.approx(
      (56 ** 0.25, 224 ** -0.25))
  assert Residual(norm_position="post").at_depth(28).deepnorm_gains == (1.0, 1.0)
  assert Residual(norm_position="post").at_depth(28) == Residual(norm_position="post")
  with pytest.raises(ValueError, match="needs the model's depth"):
    Residual(norm_position="deepnorm").deepnorm_gains  # pylint: disable=expression-not-assigned
  # The init: beta times the blocks' init on fc1, fc2, attn.proj and the value third of qkv only;
  # attn.proj and mlp.fc2 start random (as with ReZero, whose blocks draw the same numbers).
  x, noise = jnp.zeros((1, 16, 16, 1)), jnp.zeros((1, 16))
  init = lambda spec: jax.tree_util.tree_map(np.asarray, mae_lib.mae(
      "micro/4", in_chans=1, residual=spec).init(jax.random.key(0), x, noise)["params"]["blocks"])
  deep, ref = init(Residual(norm_position="deepnorm")), init(Residual(branch_gain="rezero"))
  beta = residual.deepnorm_constants(4)[1]
  qkv, qkv_ref = deep["attn"]["qkv"]["kernel"], ref["attn"]["qkv"]["kernel"]  # (depth, C, 3C)
  np.testing.assert_array_equal(qkv[..., :64], qkv_ref[..., :64])  # q and k: Xavier, gain 1
  np.testing.assert_allclose(qkv[..., 64:], beta * qkv_ref[..., 64:], rtol=1e-6)
  for layer in (("attn", "proj"), ("mlp", "fc1"), ("mlp", "fc2")):
    got, want = deep[layer[0]][layer[1]]["kernel"], ref[layer[0]][layer[1]]["kernel"]
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, beta * want, rtol=1e-6, err_msg=str(layer))
  np.testing.assert_array_equal(deep["norm1"]["scale"], 1.0)  # the same LayerNorm parameters
  # SiT: adaLN starts random (a zero gate would void the init); U-ViT: no zero-initialised branch
  sit = sit_lib.sit("micro/2", input_size=8, num_classes=10, residual=Residual(
      alpha_min=0.8, norm_position="deepnorm"))
  p = sit.init(jax.random.key(0), jnp.zeros((1, 8, 8, 4)), jnp.zeros((1,)),
               jnp.zeros((1,), jnp.int32))["params"]
  assert np.abs(p["enc_blocks"]["adaLN_modulation"]["kernel"]).max() > 0
  assert not uvit_lib.uvit("tiny/4", residual=Residual(norm_position="deepnorm")).zero_init
  assert uvit_lib.uvit("tiny/4", residual=Residual(norm_position="post")).zero_init


def test_norm_position_and_drop_path_refusals_are_one_line():
  for bad, msg in ((dict(norm_position="postnorm"), "norm_position='postnorm' is not allowed"),
                   (dict(drop_path=-0.1), "drop_path=-0.1 is not allowed")):
    with pytest.raises(ValueError, match=msg):
      Residual(**bad)
  for spec, msg in ((Residual(norm_position="deepnorm"), "norm_position='deepnorm' is not "
                     "allowed with residual_routing='fused_mirror'; routed blocks are pre-norm"),
                    (Residual(drop_path=0.1), "drop_path=0.1 is not allowed with "
                     "residual_routing='fused_mirror'")):
    with pytest.raises(ValueError, match=msg):
      sit_lib.sit("micro/2", residual_routing="fused_mirror", residual=spec)
  model = mae_lib.mae("micro/4", in_chans=1, residual=Residual(norm_position="deepnorm"))
  with pytest.raises(ConversionError, match="norm_position='deepnorm' has no counterpart in the "
                                            r"official model \(its blocks are pre-norm\)"):
    official.mae_from_torch({}, model)
  with pytest.raises(ConversionError, match="norm_position='post' has no counterpart in U-ViT"):
    convert_uvit.uvit_from_torch({}, uvit_lib.uvit("tiny/4", residual=Residual(
        norm_position="post")))
  # stochastic depth is training-only: the official layout holds such a model
  sit = sit_lib.sit("micro/2", residual=Residual(drop_path=0.2))
  params = sit.init(jax.random.key(0), *sit_lib.init_args(sit))["params"]
  assert "enc_blocks.0.attn.qkv.weight" in official.sit_to_torch(params, sit)


def test_the_finetuning_vit_reads_the_spec_of_its_mae():
  mae = mae_lib.mae("micro/4", in_chans=1, residual=Residual(alpha_min=0.7,
                                                             norm_position="deepnorm",
                                                             drop_path=0.05))
  model = vit_lib.from_mae(mae, num_classes=10, drop_path=0.2)
  assert model.residual == dataclasses.replace(mae.residual, drop_path=0.2)
  assert model.drop_path == 0.2 and model.norm_position == "deepnorm"
  np.testing.assert_allclose(vit_lib.drop_path_rates(4, 0.2), [0, 0.2 / 3, 0.4 / 3, 0.2],
                             rtol=1e-6)
  x = jax.random.normal(jax.random.key(1), (2, 16, 16, 1))
  params = model.init(jax.random.key(0), x)["params"]
  mae_params = mae.init(jax.random.key(0), x, jnp.zeros((2, 16)))["params"]
  params = vit_lib.init_from_mae(params, mae, mae_params)
  # the classifier's blocks compute the MAE's encoder (unmasked): post-norm with DeepNorm's alpha
  feats = mae.apply({"params": mae_params}, x, method=mae.features)  # (depth, N, T, C)
  _, outs = model.apply({"params": params}, x, capture_intermediates=True,
                        mutable=["intermediates"])[1]["intermediates"]["blocks"]["__call__"][0]
  np.testing.assert_allclose(outs, feats, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("field,value", [("norm_position", "deepnorm"), ("drop_path", 0.5)])
@pytest.mark.parametrize("task", ["mae", "sit"])
def test_train_steps_with_deepnorm_and_drop_path(task, field, value):
  make = tiny_config if task == "mae" else tiny_sit_config
  config = make(**{f"model.{field}": value, "model.alpha_min": 0.7})
  s = setup.build(config)
  state = s.init_state()
  stack = "blocks" if task == "mae" else "enc_blocks"
  before = np.array(state["params"][stack]["attn"]["qkv"]["kernel"])
  batch = _batch(s, config)
  # The draws of a step: drop path adds drop_u (N, depth, 2) from the step's RNG and leaves the
  # task's other draws as they were; the same RNG gives the same draws.
  images = {"image": jnp.asarray(batch["image"], jnp.float32), "label": batch["label"]}
  rng = jax.random.key(5)
  prepared = s.task.prepare(images, rng)
  plain = setup.build(make(**{"model.alpha_min": 0.7})).task.prepare(images, rng)
  assert set(prepared) - set(plain) == ({"drop_u"} if field == "drop_path" else set())
  for k in plain:
    np.testing.assert_array_equal(prepared[k], plain[k], err_msg=k)
  if field == "drop_path":
    assert prepared["drop_u"].shape == (config.batch_size, s.task.model.depth, 2)
    np.testing.assert_array_equal(prepared["drop_u"], s.task.prepare(images, rng)["drop_u"])
    # and the loss reads them: random weights, with and without the draws
    params = _random(state["params"])
    without = {k: v for k, v in prepared.items() if k != "drop_u"}
    assert float(s.task.loss(params, prepared)[0]) != float(s.task.loss(params, without)[0])
  losses = []
  for _ in range(4):
    state, metrics = s.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)), losses
  after = np.asarray(state["params"][stack]["attn"]["qkv"]["kernel"])
  assert np.abs(after - before).max() > 0, (task, field)


def test_uvit_drop_path_drops_whole_branches_from_the_tasks_draws():
  model = uvit_lib.uvit("tiny/4", residual=Residual(alpha_min=0.7, drop_path=0.5))
  task = UViTTask(model, ConfigDict(dict(schedule="vpsde", class_dropout_prob=0.0)))
  x = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
  prepared = task.prepare({"image": x, "label": jnp.zeros((2,), jnp.int32)}, jax.random.key(1))
  assert prepared["drop_u"].shape == (2, model.num_blocks, 2)
  params = _random(model.init(jax.random.key(2), x, jnp.zeros((2,)))["params"], scale=0.05)
  assert np.isfinite(float(task.loss(params, prepared)[0]))
  # u = 0 drops every branch of a block with a positive rate (all but block 0): in-block 1 only
  # scales its input by its two coefficients; u -> 1 keeps them all, like evaluation at rate 0.
  run = lambda u: model.apply({"params": params}, x, jnp.full((2,), 0.3), None, u,
                              method=lambda m, x, t, y, u: m.run_blocks(m.embed(x, t, y), u))
  _, in_outs, _, _ = run(jnp.zeros((model.num_blocks, 2, 2)))
  a = model.shortcuts.alphas
  np.testing.assert_allclose(in_outs[1], a[1, 0] * a[1, 1] * in_outs[0], rtol=1e-6, atol=1e-6)
  _, kept, _, _ = run(jnp.full((model.num_blocks, 2, 2), 0.9999))
  _, evaluated, _, _ = run(None)
  np.testing.assert_allclose(kept[0], evaluated[0], rtol=1e-6)  # block 0's rate is 0
  assert not np.allclose(kept[1], evaluated[1])  # kept branches are scaled by 1 / (1 - rate)
