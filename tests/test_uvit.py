"""U-ViT: parity with the PyTorch transcription of baofff/U-ViT (float32), the decay schedule,
the init, parameter counts of the released presets and the state_dict converter
(docs/uvit.md)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_reference as ref
import torch_reference_uvit as uref
from parity import assert_grads_match, nhwc
from decay_jax.io import convert_uvit as convert
from decay_jax.io.rules import ConversionError
from decay_jax.models import factory, stack
from decay_jax.models import uvit as uvit_lib
from decay_jax.models.residual import Residual
from decay_jax.models.sit import timestep_frequencies

ATOL = 1e-5  # outputs, absolute (values are O(1))
GRAD_RTOL = 1e-4  # gradients, relative to the largest entry of each tensor
SMALL = dict(img_size=8, patch_size=2, in_chans=3, dim=32, depth=4, num_heads=2)  # 2 in, mid, 2 out

# name -> UViT fields on top of SMALL. Together: alpha 1 and decayed (both conventions),
# unconditional and conditional, conv on and off, and the options (time MLP, qkv bias, additive
# skip).
CASES = {
    "original_uncond_conv": dict(mode="uvit_original"),
    "decayed_cond_noconv_time_mlp": dict(residual=Residual(alpha_min=0.6), num_classes=7,
                                         conv=False, mlp_time_embed=True),
    "decayed_block_uncond_add_skip": dict(
        residual=Residual(alpha_min=0.5, schedule_convention="block"), skip_mode="add",
        qkv_bias=True),
}


def hand_alphas(m) -> list:
  """The identity coefficients per block (in -> mid -> out), computed here from docs/uvit.md 4.2."""
  blocks = 2 * (m.depth // 2) + 1
  if m.mode == "uvit_original":
    return [(1.0, 1.0)] * blocks
  alpha_min = m.residual.alpha_min
  if m.residual.schedule_convention == "sublayer":
    s = 2 * blocks
    a = [1.0 - k * (1.0 - alpha_min) / (s - 1) for k in range(s)]
    return list(zip(a[0::2], a[1::2]))
  return [(1.0 - (1.0 - alpha_min) * l / blocks, 1.0) for l in range(1, blocks + 1)]


def torch_model(m):
  """The reference U-ViT with the fields of the Flax model ``m``."""
  return uref.UViT(img_size=m.img_size, patch_size=m.patch_size, in_chans=m.in_chans,
                   embed_dim=m.dim, depth=m.depth, num_heads=m.num_heads, mlp_ratio=m.mlp_ratio,
                   qkv_bias=m.qkv_bias, mlp_time_embed=m.mlp_time_embed,
                   num_classes=m.num_classes, conv=m.conv, skip=m.skip_mode != "none",
                   skip_mode=m.skip_mode, alphas=hand_alphas(m))


def torch_forward(t, x, time, y):
  """The reference's output; ``x`` a numpy array or a tensor (to take its gradient)."""
  x = x if isinstance(x, torch.Tensor) else torch.from_numpy(x)
  return t(x, torch.from_numpy(time), None if y is None else torch.from_numpy(y))


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request):
  fmodel = uvit_lib.UViT(**SMALL, **CASES[request.param])
  tmodel = ref.randomize_(torch_model(fmodel), seed=3, scale=0.1).eval()
  sd = {k: v.numpy() for k, v in tmodel.state_dict().items()}
  params, report = convert.uvit_from_torch(tmodel.state_dict(), fmodel)
  rng = np.random.default_rng(4)
  n, c, s = 3, fmodel.in_chans, fmodel.img_size
  x = rng.standard_normal((n, c, s, s)).astype(np.float32)
  t = (999 * rng.random(n)).astype(np.float32)  # U-ViT's network time 999 t
  y = rng.integers(0, fmodel.num_classes, n) if fmodel.conditional else None
  target = rng.standard_normal(x.shape).astype(np.float32)

  def loss(p, x):
    out = fmodel.apply({"params": p}, x, t, y)
    return ((out - nhwc(target)) ** 2).mean(), out

  # One program per case: the output, and the gradients w.r.t. the params and the input.
  step = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
  fwd = lambda p, x: step(p, x)[1]
  return dict(fmodel=fmodel, tmodel=tmodel, sd=sd, params=params, report=report, x=x, t=t, y=y,
              target=target, step=step, fwd=fwd)


def test_forward_matches(pair):
  with torch.no_grad():
    want = torch_forward(pair["tmodel"], pair["x"], pair["t"], pair["y"]).numpy()
  got = pair["fwd"](pair["params"], nhwc(pair["x"]))
  assert got.shape == nhwc(want).shape
  assert float(jnp.abs(got).max()) > 0.1
  np.testing.assert_allclose(np.asarray(got), np.asarray(nhwc(want)), atol=ATOL, rtol=0)


def test_gradients_match(pair):
  """Every parameter's gradient and the input gradient of a squared-error loss."""
  t, f = pair["tmodel"], pair["fmodel"]
  x = torch.from_numpy(pair["x"]).requires_grad_(True)
  t.zero_grad()
  out = torch_forward(t, x, pair["t"], pair["y"])
  ((out - torch.from_numpy(pair["target"])) ** 2).mean().backward()
  tgrads = {k: p.grad.numpy() for k, p in t.named_parameters()}
  tgrads["x"] = x.grad.numpy().transpose(0, 2, 3, 1)

  (gp, gx), _ = pair["step"](pair["params"], nhwc(pair["x"]))
  checks = dict(convert.uvit_to_torch(gp, f), x=gx)
  assert set(checks) == set(tgrads)
  assert_grads_match(checks, tgrads, GRAD_RTOL)


def test_round_trips(pair):
  """state_dict -> Flax -> state_dict is exact and in U-ViT's key order; Flax params converted to a
  state_dict give the reference the Flax output."""
  f, sd = pair["fmodel"], pair["sd"]
  assert pair["report"].loaded == list(sd) and not pair["report"].ignored
  back = convert.uvit_to_torch(pair["params"], f)
  assert list(back) == list(sd)
  for k in sd:
    np.testing.assert_array_equal(back[k], sd[k], err_msg=k)
  params = jax.tree_util.tree_map(lambda a: a + 1e-2, pair["params"])
  fresh = torch_model(f)
  fresh.load_state_dict({k: torch.from_numpy(np.array(v))
                         for k, v in convert.uvit_to_torch(params, f).items()}, strict=True)
  with torch.no_grad():
    want = torch_forward(fresh.eval(), pair["x"], pair["t"], pair["y"]).numpy()
  np.testing.assert_allclose(np.asarray(pair["fwd"](params, nhwc(pair["x"]))), nhwc(want),
                             atol=ATOL, rtol=0)
  again, _ = convert.uvit_from_torch(convert.uvit_to_torch(params, f), f)
  chex.assert_trees_all_equal(again, params)


def test_architecture_is_inferred_from_the_state_dict(pair):
  f = pair["fmodel"]
  got = convert.infer_uvit_fields(pair["sd"])
  fields = ("img_size", "patch_size", "in_chans", "dim", "depth", "mlp_ratio", "qkv_bias",
            "mlp_time_embed", "conv", "skip_mode")
  assert {k: got[k] for k in fields} == {k: getattr(f, k) for k in fields}
  assert got["num_classes"] == (f.num_classes if f.conditional else -1)


def test_model_json_round_trip(pair):
  f = pair["fmodel"]
  assert factory.model_from_fields("UViT", factory.model_fields(f)) == f
  np.testing.assert_allclose(factory.summary(f)["alphas"], hand_alphas(f), rtol=0, atol=1e-15)


# ------------------------------------------------------------------------------------------------
# The schedule
# ------------------------------------------------------------------------------------------------


def test_schedule_of_a_two_in_one_mid_two_out_model():
  """Sublayers in0.attn, in0.mlp, in1.attn, ..., out1.mlp: alpha_k = 1 - 0.05 k (alpha_min .55)."""
  m = uvit_lib.UViT(**SMALL, residual=Residual(alpha_min=0.55))
  assert m.num_blocks == 5
  want = [[1.0, 0.95], [0.9, 0.85], [0.8, 0.75], [0.7, 0.65], [0.6, 0.55]]
  np.testing.assert_allclose(m.shortcuts.alphas, want, rtol=0, atol=1e-15)
  assert m.shortcuts.alphas[0, 0] == 1.0 and m.shortcuts.alphas[-1, -1] == 0.55
  block = uvit_lib.UViT(**SMALL, residual=Residual(alpha_min=0.55, schedule_convention="block")
                        ).shortcuts.alphas
  np.testing.assert_allclose(block, [[0.91, 1], [0.82, 1], [0.73, 1], [0.64, 1], [0.55, 1]],
                             rtol=0, atol=1e-15)
  original = uvit_lib.UViT(**SMALL, residual=Residual(alpha_min=0.55),
                           mode="uvit_original").shortcuts.alphas
  np.testing.assert_array_equal(original, np.ones((5, 2)))


def test_schedule_tables_of_the_spec():
  """Spec 4.2 (U-ViT-S, alpha_min 0.7) and 7 (tiny), and the alpha_eff table of 4.2."""
  s = uvit_lib.uvit("S/2", residual=Residual(alpha_min=0.7)).shortcuts
  attn = [1.0, .976, .952, .928, .904, .880, .856, .832, .808, .784, .760, .736, .712]
  np.testing.assert_allclose(s.alphas[:, 0], attn, atol=1e-12)
  np.testing.assert_allclose(s.alphas[:, 1], np.array(attn) - 0.012, atol=1e-12)
  assert s.alpha_eff == pytest.approx(1.26e-2, rel=5e-3)
  tiny = uvit_lib.uvit("tiny/4", residual=Residual(alpha_min=0.7)).shortcuts.alphas
  np.testing.assert_allclose(tiny[:, 0], [1, .953846, .907692, .861538, .815385, .769231,
                                          .723077], atol=1e-6)
  np.testing.assert_allclose(tiny[:, 1], tiny[:, 0] - .023077, atol=1e-6)
  h = uvit_lib.uvit("H/2", residual=Residual(alpha_min=0.7, schedule_convention="block")
                    ).shortcuts
  assert h.alphas.shape == (29, 2) and h.alpha_eff == pytest.approx(6.45e-3, rel=5e-3)


# ------------------------------------------------------------------------------------------------
# Init, wiring at init, embeddings
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def initialised():
  m = uvit_lib.UViT(img_size=16, patch_size=4, in_chans=3, dim=64, depth=4, num_heads=2,
                    num_classes=10, residual=Residual(alpha_min=0.6))
  x = jax.random.normal(jax.random.key(1), (2, 16, 16, 3))
  t, y = jnp.array([3.0, 500.0]), jnp.array([1, 9])

  @jax.jit
  def run(key):  # one program: the init, the tokens and every block's output
    p = m.init(key, x, t, y)["params"]
    return (p, m.apply({"params": p}, x, t, y, method=m.embed),
            m.apply({"params": p}, x, t, y, method=m.block_outputs))

  params, tokens, outs = run(jax.random.key(0))
  return dict(m=m, params=params, x=x, t=t, y=y, tokens=tokens, outs=outs)


def test_init_follows_uvit(initialised):
  """Spec 2.1: Linears N(0, .02^2) with bias 0, LN 1/0, label table N(0, 1), convs U(+-1/sqrt(fan
  in)); decayed mode (2.2) zeroes attn.proj and mlp.fc2 kernels, and only those."""
  p = initialised["params"]
  for w in (p["in_blocks"]["attn"]["qkv"]["kernel"], p["mid_block"]["mlp"]["fc1"]["kernel"],
            p["out_blocks"]["skip_linear"]["kernel"], p["decoder_pred"]["kernel"], p["pos_embed"]):
    assert float(jnp.std(w)) == pytest.approx(0.02, rel=0.15)
  assert "bias" not in p["mid_block"]["attn"]["qkv"]
  for b in (p["mid_block"]["mlp"]["fc1"]["bias"], p["out_blocks"]["skip_linear"]["bias"],
            p["norm"]["bias"]):
    assert not jnp.any(b)
  assert jnp.all(p["norm"]["scale"] == 1) and jnp.all(p["in_blocks"]["norm2"]["scale"] == 1)
  assert float(jnp.std(p["label_emb"]["embedding"])) == pytest.approx(1.0, rel=0.15)
  for leaf, fan_in in ((p["patch_embed"], 48), (p["final_layer"], 27)):
    for w in leaf.values():
      assert float(jnp.abs(w).max()) <= fan_in ** -0.5
      assert float(jnp.abs(w).max()) > 0.8 * fan_in ** -0.5
  for part in ("in_blocks", "mid_block", "out_blocks"):
    assert not jnp.any(p[part]["attn"]["proj"]["kernel"])
    assert not jnp.any(p[part]["mlp"]["fc2"]["kernel"])
  assert uvit_lib.UViT(**SMALL, mode="uvit_original").zero_init is False
  block = uvit_lib.UViTBlock(num_heads=2, zero_init=False)
  pb = jax.jit(block.init)(jax.random.key(0), jnp.zeros((1, 4, 256)),
                      stack.BlockInputs(jnp.ones(2)))["params"]
  for w in (pb["attn"]["proj"]["kernel"], pb["mlp"]["fc2"]["kernel"]):
    assert float(jnp.std(w)) == pytest.approx(0.02, rel=0.05)


def test_zero_init_blocks_scale_the_stream_and_skips_mirror(initialised):
  """Spec 7 test 4: at init an in/mid block maps x to alpha_{2b} alpha_{2b+1} x; out-block j maps
  x to alpha alpha (W_s [x; in-block K-1-j output] + b_s)."""
  m, p, outs = initialised["m"], initialised["params"], initialised["outs"]
  a = m.shortcuts.alphas
  k = m.half
  assert outs.shape == (5, 2, 2 + 16, 64)
  prev = initialised["tokens"]
  for b in range(k + 1):
    np.testing.assert_allclose(outs[b], a[b, 0] * a[b, 1] * prev, rtol=1e-6, atol=1e-7)
    prev = outs[b]
  w, bias = p["out_blocks"]["skip_linear"]["kernel"], p["out_blocks"]["skip_linear"]["bias"]
  for j in range(k):
    want = jnp.concatenate([prev, outs[k - 1 - j]], axis=-1) @ w[j] + bias[j]
    b = k + 1 + j
    np.testing.assert_allclose(outs[b], a[b, 0] * a[b, 1] * want, rtol=1e-5, atol=1e-6)
    prev = outs[b]


def test_tokens_and_time_embedding(initialised):
  """Token order [label, time, patches]; the time token is the cos-first sinusoid of width D."""
  p = initialised["params"]
  tokens = initialised["tokens"] - p["pos_embed"]
  np.testing.assert_allclose(tokens[:, 0], p["label_emb"]["embedding"][initialised["y"]],
                             rtol=0, atol=1e-6)
  np.testing.assert_allclose(tokens[:, 1], timestep_frequencies(initialised["t"], 64), atol=1e-6)
  np.testing.assert_array_equal(timestep_frequencies(jnp.zeros((1,)), 8),
                                [[1, 1, 1, 1, 0, 0, 0, 0]])
  want = np.exp(-np.log(10000.0) * np.arange(4) / 4)
  np.testing.assert_allclose(timestep_frequencies(jnp.ones((1,)), 8)[0],
                             np.concatenate([np.cos(want), np.sin(want)]), atol=1e-6)
  np.testing.assert_allclose(uref.timestep_embedding(torch.ones(1), 8)[0].numpy(),
                             np.concatenate([np.cos(want), np.sin(want)]), atol=1e-6)


def test_remat_does_not_change_the_output(initialised):
  m, p = initialised["m"], initialised["params"]
  args = (initialised["x"], initialised["t"], initialised["y"])
  want = jax.jit(lambda p: m.apply({"params": p}, *args))(p)
  remat = m.clone(remat_policy="dots")
  got = jax.jit(lambda p: remat.apply({"params": p}, *args))(p)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Presets, parameter and key counts
# ------------------------------------------------------------------------------------------------

SPEC_COUNTS = {"S/2": 44_255_328, "S/4": 44_292_228, "M/4": 130_940_292, "L/4": 286_827_652,
               "L/2": 286_763_172, "H/2": 500_832_016, "tiny/4": 1_505_028}


def param_count(m) -> int:
  x = jnp.zeros((1, m.img_size, m.img_size, m.in_chans))
  y = jnp.zeros((1,), jnp.int32) if m.conditional else None
  shapes = jax.eval_shape(m.init, jax.random.key(0), x, jnp.zeros((1,)), y)
  return sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(shapes["params"]))


def formula_count(m) -> int:
  """Spec 3.1's closed form."""
  d, c, p, k = m.dim, m.in_chans, m.patch_size, m.half
  return ((2 * k + 1) * (12 * d * d + 10 * d) + k * (2 * d * d + d) + (c * p * p * d + d)
          + (m.extras + m.num_patches) * d + max(m.num_classes, 0) * d + 2 * d
          + (d * p * p * c + p * p * c) + m.conv * (9 * c * c + c)
          + m.mlp_time_embed * (8 * d * d + 5 * d))


@pytest.mark.parametrize("preset", sorted(SPEC_COUNTS))
def test_preset_parameter_counts(preset):
  m = uvit_lib.uvit(preset)
  assert param_count(m) == formula_count(m) == SPEC_COUNTS[preset]


def test_variant_counts_and_state_dict_keys():
  """docs/uvit.md 7 variants; docs/uvit.md 1.6 key counts (11 per in/mid block, 13 per out-block)."""
  assert param_count(uvit_lib.uvit("tiny/4", num_classes=11)) == 1_506_564
  assert param_count(uvit_lib.uvit("tiny/4", img_size=28, in_chans=1)) == 1_494_810
  keys = {"S/2": 164, "L/2": 261, "H/2": 355, "tiny/4": 92}
  for preset, n in keys.items():
    assert len(convert.uvit_rules(uvit_lib.uvit(preset))) == n, preset
  assert len(convert.uvit_rules(uvit_lib.uvit("S/2", num_classes=10))) == 165
  tiny = uvit_lib.uvit("tiny/4")
  reference = uref.UViT(img_size=32, patch_size=4, in_chans=3, embed_dim=128, depth=6, num_heads=4)
  assert [r.torch_key for r in convert.uvit_rules(tiny)] == list(reference.state_dict())
  assert sum(p.numel() for p in reference.parameters()) == SPEC_COUNTS["tiny/4"]


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(depth=5), "depth=5 is not allowed"),
    (dict(skip_mode="sum"), "skip_mode='sum' is not allowed"),
    (dict(mode="uvit"), "mode='uvit' is not allowed"),
    (dict(num_classes=-2), "num_classes=-2 is not allowed"),
    (dict(dim=30, num_heads=4), "dim=30 is not allowed"),
])
def test_bad_fields_are_one_line_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    uvit_lib.UViT(**dict(SMALL, **kwargs))


def test_labels_must_match_num_classes():
  m = uvit_lib.UViT(**SMALL)
  with pytest.raises(ValueError, match="num_classes=-1"):
    jax.eval_shape(m.init, jax.random.key(0), jnp.zeros((1, 8, 8, 3)), jnp.zeros((1,)),
                   jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match=r"x of shape \(1, 4, 4, 3\)"):
    jax.eval_shape(m.init, jax.random.key(0), jnp.zeros((1, 4, 4, 3)), jnp.zeros((1,)))


def test_converter_names_missing_and_misshaped_keys():
  m = uvit_lib.UViT(**SMALL, num_classes=3)
  sd = {k: v.numpy() for k, v in torch_model(m).state_dict().items()}
  with pytest.raises(ConversionError, match="missing key.*out_blocks.1.skip_linear.weight"):
    convert.uvit_from_torch({k: v for k, v in sd.items()
                             if k != "out_blocks.1.skip_linear.weight"}, m)
  with pytest.raises(ConversionError, match="label_emb.weight: shape"):
    convert.uvit_from_torch(dict(sd, **{"label_emb.weight": np.zeros((4, 32))}), m)
