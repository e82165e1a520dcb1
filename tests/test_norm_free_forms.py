"""Norm-free residual forms (models/residual.py, docs/residual_forms.md).

SkipInit (De & Smith 2020): ``norm_position='none'``, ``branch_gain='rezero'``:
``x <- alpha_s x + a_s f_s(x)``, no norm in the block, one trained scalar ``a_s`` per branch
starting at 0. ReZero as its paper and code have it (Bachlechner et al. 2020,
``RZTXEncoderLayer``): ``norm_position='none'``, ``branch_gain='rezero_block'``: the same with one
scalar ``a`` per block, shared by its two branches.

Checked by hand (numpy float64 from the parameters) on depth-2 MAE and SiT stacks with random
weights and gains; at init the stack is the identity times the alphas (the gains are 0) and yet
the gains have a gradient (the branches start at their random init); the config reaches the
model and trains; what cannot hold the form refuses it in one line.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.io import official
from decay_jax.io.rules import ConversionError
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib
from decay_jax.models.residual import Residual
from decay_jax.train import setup
from test_residual_forms import _attn, _dense, _mlp, _random, _sit_trunk, _train_steps
from test_sit_train import tiny_sit_config

FORMS = {"skipinit": dict(norm_position="none", branch_gain="rezero"),
         "rezero": dict(norm_position="none", branch_gain="rezero_block")}
SIT = dict(depth=2, input_size=8, in_channels=4, num_classes=10, learn_sigma=False)


def _gains(blk, form):
  """The two branch gains of one block's parameters ``blk`` (ReZero: its one gain twice)."""
  if form == "rezero":
    assert not {"gain_attn", "gain_mlp"} & set(blk)
    return blk["gain"], blk["gain"]
  return blk["gain_attn"], blk["gain_mlp"]


def _block(p, l, x, alpha, form, mod=None):
  """Block ``l`` by hand: ``x <- alpha_s x + g_s f_s(x)`` (SiT: ``f_s`` modulated and gated)."""
  blk = jax.tree_util.tree_map(lambda v: np.asarray(v, np.float64)[l], p)
  for s, (g, name) in enumerate(zip(_gains(blk, form), ("attn", "mlp"))):
    h = x
    if mod is not None:
      shift, scale, gate = mod[3 * s: 3 * s + 3]
      h = h * (1 + scale[:, None]) + shift[:, None]
    f = _attn(h, blk["attn"], 2) if s == 0 else _mlp(h, blk["mlp"], tanh=mod is not None)
    if mod is not None:
      f = gate[:, None] * f
    x = alpha[s] * x + g * f
  return x


def _mae(form, alpha_min=0.6):
  return mae_lib.mae("micro/4", depth=2, in_chans=1, residual=Residual(alpha_min=alpha_min,
                                                                      **FORMS[form]))


def _encoder(model, params, x):
  """``(stream entering the blocks, every block's output)`` of the MAE encoder on ``x``."""
  def run(m, im):
    feats = m.embed(im)
    cls = jnp.broadcast_to(m.cls_token + m.pos_embed()[None, :1], (im.shape[0], 1, m.dim))
    return jnp.concatenate([cls, feats], 1), m.run_encoder(feats)
  return model.apply({"params": params}, x, method=run)


@pytest.mark.parametrize("form", FORMS)
def test_mae_blocks_by_hand_have_no_norms(form):
  model = _mae(form)
  x = jax.random.normal(jax.random.key(0), (3, 16, 16, 1))
  params = model.init(jax.random.key(2), x, jnp.zeros((3, 16)))["params"]
  assert not {"norm1", "norm2"} & set(params["blocks"]), sorted(params["blocks"])
  params = _random(params)  # random weights and gains: every branch counts
  tokens, outs = _encoder(model, params, x)
  h = np.asarray(tokens, np.float64)
  for l in range(2):
    h = _block(params["blocks"], l, h, model.shortcuts.alphas[l], form)
    np.testing.assert_allclose(outs[l], h, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", FORMS)
def test_sit_encoder_blocks_by_hand(form):
  model = sit_lib.sit("micro/2", residual=Residual(alpha_min=0.7, **FORMS[form]), **SIT)
  x = jax.random.normal(jax.random.key(0), (3, 8, 8, 4))
  t, y = jnp.array([0.1, 0.5, 0.9]), jnp.array([1, 2, 3])
  params = _random(model.init(jax.random.key(2), x, t, y)["params"])
  tokens, cond, enc_out, _, _ = model.apply({"params": params}, x, t, y, method=_sit_trunk)
  c = np.asarray(cond, np.float64)
  p = params["enc_blocks"]
  mod = np.split(_dense(c / (1 + np.exp(-c)), jax.tree_util.tree_map(
      lambda v: np.asarray(v, np.float64)[0], p["adaLN_modulation"])), 6, axis=-1)
  want = _block(p, 0, np.asarray(tokens, np.float64), model.shortcuts.alphas[0], form, mod)
  np.testing.assert_allclose(enc_out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", FORMS)
def test_at_init_the_stack_is_the_identity_and_the_gains_learn(form):
  model = _mae(form)
  x = jax.random.normal(jax.random.key(0), (3, 16, 16, 1))
  noise = jax.random.uniform(jax.random.key(1), (3, 16))
  params = model.init(jax.random.key(2), x, noise)["params"]
  for g in _gains(params["blocks"], form):
    np.testing.assert_array_equal(g, np.zeros_like(g))
  # the branches start at their random init (a zero branch would leave the zero gain without a
  # gradient), so the identity at init comes from the gains alone
  assert np.abs(params["blocks"]["attn"]["proj"]["kernel"]).max() > 0
  tokens, outs = _encoder(model, params, x)
  a = model.shortcuts.alphas
  np.testing.assert_allclose(outs[0], a[0, 0] * a[0, 1] * tokens, rtol=1e-6)
  np.testing.assert_allclose(outs[1], a[1, 0] * a[1, 1] * outs[0], rtol=1e-6)
  # MAE's zero-initialised head and skip layers pass no gradient at init: random weights
  # everywhere but the zero gains
  blocks = dict(_random(params)["blocks"], **{k: v for k, v in params["blocks"].items()
                                              if k.startswith("gain")})
  params = dict(_random(params), blocks=blocks)
  grads = jax.grad(lambda p: model.apply({"params": p}, x, noise)["loss"])(params)
  for g in _gains(grads["blocks"], form):
    assert np.all(np.abs(np.asarray(g)) > 0), g


@pytest.mark.parametrize("form", FORMS)
def test_the_config_trains_the_gains(form):
  config = tiny_sit_config(**{f"model.{k}": v for k, v in FORMS[form].items()})
  s = setup.build(config)
  state = s.init_state()
  before = [np.array(g) for g in _gains(state["params"]["enc_blocks"], form)]
  state = _train_steps(s, config, state, 2)  # SiT's zero final layer: the trunk learns at step 2
  after = _gains(state["params"]["enc_blocks"], form)
  assert all(np.abs(np.asarray(b) - a).max() > 0 for a, b in zip(before, after))


@pytest.mark.parametrize("form", FORMS)
def test_what_cannot_hold_the_form_refuses_it_in_one_line(form):
  with pytest.raises(ConversionError, match="has no counterpart in the official model"):
    official.mae_from_torch({}, _mae(form))
  no_norm = mae_lib.mae("micro/4", in_chans=1, residual=Residual(norm_position="none"))
  with pytest.raises(ConversionError, match="norm_position='none' has no counterpart in the "
                                            "official model"):
    official.mae_from_torch({}, no_norm)
  with pytest.raises(ValueError, match="norm_position='none' is not allowed; hyper-connections "
                                       "are pre-norm"):
    Residual(hyper_connections="static", **dict(FORMS[form], branch_gain="none"))
  with pytest.raises(ValueError, match="not allowed with residual_routing='fused_mirror'"):
    sit_lib.sit("micro/2", residual_routing="fused_mirror", residual=Residual(**FORMS[form]))
