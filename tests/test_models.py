"""Model properties: alpha_min = 1 is the standard network, official init, presets, errors, dtypes."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.models import schedules
from decay_jax.models import factory
from decay_jax.models import layers
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib
from decay_jax.models.residual import Residual


def mae_inputs(m, n=2, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((n, m.img_size, m.img_size, m.in_chans)), jnp.float32)
  return x, jnp.asarray(rng.random((n, m.num_patches)), jnp.float32)


def sit_inputs(m, n=3, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((n, m.input_size, m.input_size, m.in_channels)), jnp.float32)
  return x, jnp.asarray(rng.random(n), jnp.float32), jnp.asarray(rng.integers(0, m.num_classes, n))


def perturbed(params, scale=0.1, seed=1):
  """Non-zero weights everywhere (the official init zeroes the branch outputs)."""
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree_util.tree_unflatten(
      tree, [l + scale * jax.random.normal(k, l.shape) for l, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def micro_mae():
  m = mae_lib.mae("micro/4", residual=Residual(alpha_min=1.0))
  x, noise = mae_inputs(m)
  params = perturbed(jax.jit(m.init)(jax.random.key(0), x, noise)["params"])
  return m, params, x, noise


@pytest.fixture(scope="module")
def micro_sit():
  m = sit_lib.sit("micro/2", input_size=8, num_classes=10, residual=Residual(alpha_min=1.0))
  x, t, y = sit_inputs(m)
  params = perturbed(jax.jit(m.init)(jax.random.key(0), x, t, y)["params"])
  return m, params, (x, t, y)


def standard_add(residual, x, alpha, branch, norm=None, connections=None):
  """The plain residual update x + f(x), ignoring alpha (in place of ``Residual.add``, which
  ``models/stack.py`` calls for every sublayer; pre-norm, no hyper-connections)."""
  del residual, alpha, norm, connections
  return x + branch.astype(x.dtype)


# Op-by-op execution (disable_jit) so that XLA cannot fuse the two programs differently: the only
# difference left is the multiplication by alpha, and the outputs are compared bit for bit.
@jax.disable_jit()
def test_mae_alpha_min_one_is_exactly_the_standard_residual_network(micro_mae, monkeypatch):
  m, params, x, noise = micro_mae
  decayed = m.apply({"params": params}, x, noise)
  with monkeypatch.context() as mp:
    mp.setattr(Residual, "add", standard_add)
    standard = m.apply({"params": params}, x, noise)
  # The check can fail: with alpha_min < 1 the decayed model differs from the standard one.
  other = m.clone(residual=Residual(alpha_min=0.7)).apply({"params": params}, x, noise)
  chex.assert_trees_all_equal(decayed, standard)  # bit for bit
  assert float(jnp.abs(other["pred"] - standard["pred"]).max()) > 1e-3


@jax.disable_jit()
def test_sit_alpha_min_one_is_exactly_the_standard_residual_network(micro_sit, monkeypatch):
  m, params, args = micro_sit
  decayed = m.apply({"params": params}, *args)
  with monkeypatch.context() as mp:
    mp.setattr(Residual, "add", standard_add)
    standard = m.apply({"params": params}, *args)
  other = m.clone(residual=Residual(alpha_min=0.8)).apply({"params": params}, *args)
  chex.assert_trees_all_equal(decayed, standard)
  assert float(jnp.abs(other - standard).max()) > 1e-3


def test_mae_official_init():
  m = mae_lib.mae("micro/4", residual=Residual(alpha_min=0.6))
  x, noise = mae_inputs(m)
  params = jax.jit(m.init)(jax.random.key(0), x, noise)["params"]
  out, feats, tokens = jax.jit(lambda p: m.apply(
      {"params": p}, x, noise,
      method=lambda mod, im, n: (mod(im, n), mod.features(im), mod.embed(im))))(params)
  assert float(jnp.abs(out["pred"]).max()) == 0.0  # zero-init decoder_pred
  # Zero-init attn.proj / mlp.fc2: each encoder block is x -> a_attn * a_mlp * x.
  np.testing.assert_allclose(feats[-1][:, 1:], tokens * m.shortcuts.alpha_eff, rtol=1e-5, atol=1e-6)
  b = params["blocks"]
  for name in ("proj",):
    assert float(jnp.abs(b["attn"][name]["kernel"]).max()) == 0.0
  assert float(jnp.abs(b["mlp"]["fc2"]["kernel"]).max()) == 0.0
  assert float(jnp.abs(params["skip_0"]["fc2"]["kernel"]).max()) == 0.0
  bound = math.sqrt(6 / (m.dim + 3 * m.dim))  # qkv as one (D, 3D) matrix
  qkv = np.asarray(b["attn"]["qkv"]["kernel"])
  assert qkv.max() <= bound and qkv.max() > 0.9 * bound
  patch = np.asarray(params["patch_embed"]["proj"]["kernel"])
  pbound = math.sqrt(6 / (m.patch_size ** 2 * m.in_chans + m.dim))  # 2-D view of the conv
  assert patch.max() <= pbound and patch.max() > 0.9 * pbound
  bias = np.asarray(params["patch_embed"]["proj"]["bias"])
  assert 0 < np.abs(bias).max() <= 1 / math.sqrt(m.patch_size ** 2 * m.in_chans)  # torch default
  assert float(jnp.abs(b["attn"]["qkv"]["bias"]).max()) == 0.0


def test_sit_official_init_gives_zero_output():
  m = sit_lib.sit("micro/2", input_size=8, num_classes=10)
  x, t, y = sit_inputs(m)
  params = jax.jit(m.init)(jax.random.key(0), x, t, y)["params"]
  assert float(jnp.abs(m.apply({"params": params}, x, t, y)).max()) == 0.0
  assert float(jnp.abs(params["x_embedder"]["proj"]["bias"]).max()) == 0.0
  assert float(jnp.abs(params["enc_blocks"]["adaLN_modulation"]["kernel"]).max()) == 0.0
  assert float(jnp.abs(params["dec_blocks"]["skip"]["kernel"]).min()) >= 0.0
  assert float(jnp.abs(params["dec_blocks"]["skip"]["kernel"]).max()) > 0.0  # xavier, not zero


def count(tree):
  return sum(int(np.prod(l.shape)) for l in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("preset,expected", [
    ("B/16", 117_038_848),  # official trainable count (total minus the frozen pos embeds)
    # The official ViT-L/H build 4 / 8 SkipLayers the forward never uses; we do not.
    ("L/16", None), ("H/14", None),
])
def test_mae_preset_parameter_counts(preset, expected):
  m = mae_lib.mae(preset)
  x = jax.ShapeDtypeStruct((1, m.img_size, m.img_size, m.in_chans), jnp.float32)
  n = jax.ShapeDtypeStruct((1, m.num_patches), jnp.float32)
  got = count(jax.eval_shape(m.init, jax.random.key(0), x, n)["params"])
  D, d, L = m.dim, m.decoder_dim, m.depth
  block = lambda c: 12 * c * c + 13 * c  # qkv, proj, fc1, fc2 (+ biases) and two LNs
  skip = D + (D + d) * d + d + d * d + d
  formula = (D * m.patch_size ** 2 * 3 + D + D + d + L * block(D) + m.num_skip_layers * skip
             + d * d + d + m.decoder_depth * block(d) + 2 * d + d * m.patch_size ** 2 * 3
             + m.patch_size ** 2 * 3)
  assert got == formula
  if expected is not None:
    assert got == expected
  assert m.num_skip_layers == 6 if preset == "B/16" else 8


def test_sit_xl2_parameter_count():
  m = sit_lib.sit("XL/2")
  args = (jax.ShapeDtypeStruct((1, 32, 32, 4), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32),
          jax.ShapeDtypeStruct((1,), jnp.int32))
  got = count(jax.eval_shape(m.init, jax.random.key(0), *args)["params"])
  assert got == 693_725_216 - 256 * 1152  # official total minus the frozen pos_embed


@pytest.mark.parametrize("make,match", [
    (lambda: mae_lib.mae("B/16", residual=Residual(alpha_min=0.0)), r"alpha_min=0.0 is not allowed; it must be a number in \(0, 1\]"),
    (lambda: mae_lib.mae("B/16", img_size=100), "img_size=100 is not allowed; it must be a multiple of patch_size=16"),
    (lambda: mae_lib.mae("B/16", residual=Residual(shortcut_form="rezero")), "shortcut_form='rezero' is not allowed; choose one of 'decay'"),
    (lambda: mae_lib.mae("B/16", remat_policy="some"), "remat_policy='some' is not allowed; choose one of 'none', 'full', 'dots'"),
    (lambda: mae_lib.mae("B/16", attention_impl="flash"), "attention_impl='flash' is not allowed"),
    (lambda: mae_lib.mae("B/16", attention_impl="cudnn"), "attention_impl='cudnn' is not allowed with dtype=float32; cuDNN flash attention needs dtype bfloat16 or float16"),
    (lambda: sit_lib.sit("S/2", attention_impl="cudnn"), "attention_impl='cudnn' is not allowed with dtype=float32"),
    (lambda: mae_lib.mae("B/16", dtype=jnp.int8), "dtype='int8' is not allowed; choose one of 'float32', 'bfloat16', 'float16'"),
    (lambda: mae_lib.mae("B/17"), "preset='B/17' is not allowed; choose one of 'B/16', 'L/16', 'H/14'"),
    (lambda: mae_lib.mae("B/16", alpha=0.7), r"unknown MaskedAutoencoder field\(s\) \['alpha'\]"),
    (lambda: mae_lib.mae("B/16", mask_ratio=1.0), r"mask_ratio=1.0 is not allowed; it must be in \[0, 1\)"),
    (lambda: sit_lib.sit("XL/2", depth=27), "depth=27 is not allowed; SiT splits it"),
    (lambda: sit_lib.sit("XL/2", residual=Residual(schedule_convention="x")), "schedule_convention='x' is not allowed"),
    (lambda: sit_lib.sit("XL/3"), "preset='XL/3' is not allowed"),
])
def test_bad_fields_fail_at_construction(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_attention_none_chooses_cudnn_on_gpu_for_half_precision_and_shapes_it_takes(monkeypatch):
  resolve = layers.resolve_attention
  assert resolve("xla", jnp.bfloat16, 256, 72) == "xla"
  assert resolve(None, jnp.bfloat16, 256, 72) is None  # this machine is a CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert resolve(None, jnp.bfloat16, 256, 72) == "cudnn"  # SiT-XL/2
  assert resolve(None, jnp.float16, 50, 64) == "cudnn"  # MAE ViT-L/16's encoder
  assert resolve(None, jnp.bfloat16, 197, 64) == "cudnn"  # its decoder: padded to 198
  assert resolve(None, jnp.bfloat16, 256, 76) is None  # head dim not a multiple of 8
  assert resolve(None, jnp.bfloat16, 256, 160) is None  # head dim over 128
  assert resolve(None, jnp.float32, 256, 72) is None  # cuDNN has no float32 kernel
  assert resolve("cudnn", jnp.bfloat16, 197, 64) == "cudnn"  # an explicit choice stands
  # A model trained with cuDNN attention (model.json says so) is rebuilt choosing again.
  fields = factory.model_fields(mae_lib.mae("micro/4", dtype=jnp.bfloat16, attention_impl="cudnn"))
  assert fields["attention_impl"] == "cudnn"
  assert factory.model_from_fields("MaskedAutoencoder", fields).attention_impl is None
  fields["attention_impl"] = "xla"
  assert factory.model_from_fields("MaskedAutoencoder", fields).attention_impl == "xla"


def test_bfloat16_compute_keeps_float32_params_and_residual_stream():
  m32 = mae_lib.mae("micro/4", residual=Residual(alpha_min=0.6))
  m16 = m32.clone(dtype=jnp.bfloat16)
  x, noise = mae_inputs(m32)
  params = perturbed(jax.jit(m32.init)(jax.random.key(0), x, noise)["params"])
  assert all(l.dtype == jnp.float32 for l in jax.tree_util.tree_leaves(
      jax.jit(m16.init)(jax.random.key(0), x, noise)))
  o32 = jax.jit(m32.apply)({"params": params}, x, noise)
  o16 = jax.jit(m16.apply)({"params": params}, x, noise)
  assert o16["latent"].dtype == jnp.float32 and o16["loss"].dtype == jnp.float32
  np.testing.assert_allclose(float(o16["loss"]), float(o32["loss"]), rtol=0.05)
  assert float(jnp.abs(o16["pred"] - o32["pred"]).max()) > 0  # bf16 really was used
  s = sit_lib.sit("micro/2", input_size=8, num_classes=10, dtype=jnp.bfloat16)
  out = jax.jit(s.apply)(jax.jit(s.init)(jax.random.key(0), *sit_inputs(s)), *sit_inputs(s))
  assert out.dtype == jnp.float32


def test_learnable_alpha_is_a_trained_parameter():
  m = mae_lib.mae("micro/4", residual=Residual(alpha_min=0.6, shortcut_form="learnable"))
  x, noise = mae_inputs(m)
  init = jax.jit(m.init)(jax.random.key(0), x, noise)["params"]
  params = perturbed(init)
  np.testing.assert_array_equal(init["alpha"], schedules.decay_schedule(m.depth, 0.6).astype(np.float32))
  g = jax.jit(jax.grad(lambda p: m.apply({"params": p}, x, noise)["loss"]))(params)
  assert g["alpha"].shape == (m.depth, 2) and float(jnp.abs(g["alpha"]).min()) > 0
  fixed = mae_lib.mae("micro/4", residual=Residual(alpha_min=0.6))
  assert "alpha" not in jax.eval_shape(fixed.init, jax.random.key(0), x, noise)["params"]


def test_sqrt_half_forms_scale_identity_and_branch(monkeypatch):
  # Identity: at the official init every branch output is 0, so the final block output is the
  # embedded tokens times the product of all identity coefficients.
  for form, identity in (("sqrt_half_both", 0.5 ** 0.5), ("sqrt_half_f", 1.0)):
    m = mae_lib.mae("micro/4", residual=Residual(shortcut_form=form))
    x, noise = mae_inputs(m)
    params = jax.jit(m.init)(jax.random.key(0), x, noise)["params"]
    feats, tokens = jax.jit(lambda p, im: m.apply(
        {"params": p}, im, method=lambda mod, im: (mod.features(im), mod.embed(im))))(params, x)
    np.testing.assert_allclose(feats[-1][:, 1:], tokens * identity ** (2 * m.depth), rtol=1e-5,
                               atol=1e-6)
  # Branch: every update receives branch_scale sqrt(1/2) (a static Python float).
  scales = []

  original = Residual.branch

  def spy(residual, module, name, f):
    scales.append(residual.branch_scale)
    return original(residual, module, name, f)

  monkeypatch.setattr(Residual, "branch", spy)
  s = sit_lib.sit("micro/2", input_size=8, num_classes=10,
                  residual=Residual(shortcut_form="sqrt_half_f"))
  jax.eval_shape(s.init, jax.random.key(0), *sit_inputs(s))
  assert scales and set(scales) == {math.sqrt(0.5)}


def test_label_dropout_uses_the_null_class(micro_sit):
  m, params, (x, t, y) = micro_sit
  dropped = m.apply({"params": params}, x, t, y, force_drop_ids=jnp.ones_like(y))
  null = m.apply({"params": params}, x, t, jnp.full_like(y, m.num_classes))
  chex.assert_trees_all_close(dropped, null, atol=0)
  n = 4000
  yy = jnp.zeros((n,), jnp.int32)
  emb = m.apply({"params": params}, yy, True, method=m.embed_labels, rngs={"label_drop": jax.random.key(9)})
  null_row = params["y_embedder"]["embedding"][m.num_classes]
  frac = float(jnp.mean(jnp.all(emb == null_row, axis=-1)))
  assert abs(frac - 0.1) < 0.02  # class_dropout_prob = 0.1
