"""Residual forms with trained branch gains (models/residual.py, docs/residual_forms.md):
LayerScale ``x + diag(lambda) f(x)`` and ReZero ``x + a f(x)``.

The formula is checked by hand on depth-2 models: a gain on a branch whose last layer is linear
equals that layer with its kernel columns and bias scaled by the gain, so the gained model must
compute what the plain model computes with ``attn.proj`` and ``mlp.fc2`` rescaled. Then: the
initial values (CaiT's rule, ReZero's 0), four train steps of MAE and SiT with each form (the
gains move; ReZero's too, because its branches do not also start at zero), and the converters'
one-line refusal.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.io import official
from decay_jax.io.rules import ConversionError
from decay_jax.models import mae as mae_lib
from decay_jax.models import residual
from decay_jax.models import sit as sit_lib
from decay_jax.models.residual import Residual
from decay_jax.train import setup
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


@pytest.mark.parametrize("gain", GAINS)
@pytest.mark.parametrize("task", ["mae", "sit"])
def test_train_steps_move_the_gains(task, gain):
  config = (tiny_config if task == "mae" else tiny_sit_config)(
      **{"model.branch_gain": gain, "model.alpha_min": 0.7})
  s = setup.build(config)
  state = s.init_state()
  stack = "blocks" if task == "mae" else "enc_blocks"
  before = np.array(state["params"][stack]["gain_attn"])  # a copy: the step donates the state
  rng = np.random.default_rng(0)
  shape = (config.batch_size,) + s.task.image_shape()
  batch = {"image": rng.integers(0, 256, shape).astype(np.uint8)
           if s.abstract_batch()["image"].dtype == jnp.uint8
           else rng.standard_normal(shape).astype(np.float32),
           "label": rng.integers(0, 10, config.batch_size).astype(np.int32)}
  losses = []
  # Four steps: MAE's zero-initialised head passes no gradient to the encoder at step 1, and its
  # zero attn.proj (kept with LayerScale) none to the gain at step 2.
  for _ in range(4):
    state, metrics = s.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)), losses
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
