"""DINOv2 (models/dinov2.py, io/convert_dinov2.py) against timm 1.0.31 and torch 2.x.

1. Bicubic resizing: ``torch_bicubic_matrix`` / ``resize_bicubic`` equal torch
   ``F.interpolate(mode='bicubic')`` with and without antialias, by size and by scale factor.
2. Position tables: 'timm' mode equals timm's ``resample_abs_pos_embed`` (what REPA applies to
   the hub model, 37x37 -> 16x16), 'dinov2' mode the hub's ``interpolate_pos_encoding`` call.
3. The network: timm's ``VisionTransformer`` built as ``vit_*_patch14_dinov2`` (LayerScale,
   ``dynamic_img_size``), tiny and with random weights, converted through the converter: the
   normalised cls and patch tokens agree to 1e-5 on its own grid and on resampled grids; the
   same for timm's register layout; and the params go back into timm strictly.
4. The presets S/B/L have the shapes of timm's models (built on the meta device: no memory).
5. The converter's one-line errors: missing key, mis-shaped tensor, unknown key; the command
   ``convert_external dinov2`` writes a params directory that ``checkpoint.load_params`` rebuilds.
6. ``repa_preprocess`` equals REPA's ``preprocess_raw_image`` for 'dinov2' (torch).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jax
import jax.numpy as jnp

import timm_import
import torch_reference as ref
from decay_jax.cli import convert_external as ce_cli
from decay_jax.io import convert_dinov2 as conv
from decay_jax.io.rules import ConversionError, abstract_params
from decay_jax.models import dinov2
from decay_jax.train import checkpoint
from parity import nhwc

timm = timm_import.import_timm()
from timm.layers import resample_abs_pos_embed  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

# Tiny: patch 14, width 128 with 64-wide heads (DINOv2's, so the head count is inferred), a 4x4
# stored grid (56 px), 2 blocks.
TINY = dict(img_size=56, patch_size=14, embed_dim=128, depth=2, num_heads=2, init_values=1e-5,
            num_classes=0, dynamic_img_size=True)


def timm_dinov2(seed=1, **kwargs):
  model = VisionTransformer(**dict(TINY, **kwargs))
  return ref.randomize_(model, seed=seed, scale=0.1).eval()


def images(shape, seed=2):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# 1. torch's bicubic


@pytest.mark.parametrize("antialias", [False, True])
@pytest.mark.parametrize("n_in,n_out", [(37, 16), (16, 37), (256, 224), (5, 3), (4, 4), (7, 2)])
def test_bicubic_matrix_equals_torch_interpolate(n_in, n_out, antialias):
  x = images((1, 2, n_in, n_in + 3))
  for size, factor in (((n_out, n_out + 1), None),
                       ((n_out, n_out), ((n_out + 0.1) / n_in, (n_out + 0.1) / (n_in + 3)))):
    kw = dict(scale_factor=factor) if factor else dict(size=size)
    with torch.no_grad():
      want = F.interpolate(torch.from_numpy(x), mode="bicubic", align_corners=False,
                           antialias=antialias, **kw).numpy()
    assert want.shape[2:] == size
    got = dinov2.resize_bicubic(nhwc(x), size, antialias, factor)
    np.testing.assert_allclose(np.asarray(got).transpose(0, 3, 1, 2), want, atol=1e-5, rtol=0)


def test_torch_bicubic_is_not_jax_image_resize():
  """Why the matrices: jax.image.resize's cubic (Keys a=-0.5, antialiased when shrinking) gives
  other numbers than torch's default bicubic (a=-0.75, no antialias)."""
  x = images((1, 1, 256, 256))
  with torch.no_grad():
    want = F.interpolate(torch.from_numpy(x), size=224, mode="bicubic").numpy()[0, 0]
  jax_cubic = np.asarray(jax.image.resize(jnp.asarray(x[0, 0]), (224, 224), "cubic"))
  assert np.abs(jax_cubic - want).max() > 0.05


# ------------------------------------------------------------------------------------------------
# 2. position tables


def test_pos_embed_timm_mode_equals_timm_resample_abs_pos_embed():
  table = images((1, 1 + 37 * 37, 32))
  for grid in ((16, 16), (16, 20), (37, 37)):
    with torch.no_grad():
      want = resample_abs_pos_embed(torch.from_numpy(table), list(grid), num_prefix_tokens=1)
    got = dinov2.resample_pos_embed(jnp.asarray(table), grid, "timm")
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5, rtol=0)


def test_pos_embed_dinov2_mode_equals_the_hubs_interpolate_pos_encoding():
  """The hub's call: ``scale_factor=((h + 0.1)/M, (w + 0.1)/M)``, bicubic, antialias False."""
  m = 37
  table = images((1, 1 + m * m, 32))
  for h, w in ((16, 16), (16, 20), (40, 40)):
    patches = torch.from_numpy(table[:, 1:]).reshape(1, m, m, 32).permute(0, 3, 1, 2)
    with torch.no_grad():
      out = F.interpolate(patches, mode="bicubic", antialias=False,
                          scale_factor=((h + 0.1) / m, (w + 0.1) / m))
    assert out.shape[-2:] == (h, w)
    want = np.concatenate([table[:, :1], out.permute(0, 2, 3, 1).reshape(1, -1, 32).numpy()], 1)
    got = dinov2.resample_pos_embed(jnp.asarray(table), (h, w), "dinov2")
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
  # The two modes are different resamplings (the hub's is not antialiased when shrinking).
  gap = np.abs(np.asarray(dinov2.resample_pos_embed(jnp.asarray(table), (16, 16), "timm"))
               - np.asarray(dinov2.resample_pos_embed(jnp.asarray(table), (16, 16), "dinov2")))
  assert gap.max() > 0.1


# ------------------------------------------------------------------------------------------------
# 3. the network against timm


@pytest.fixture(scope="module")
def tiny():
  """(timm model, its state_dict, our model, converted params, report)."""
  tm = timm_dinov2()
  state = tm.state_dict()
  model, params, report = conv.dinov2_from_state_dict(state)
  return tm, state, model, params, report


def test_tiny_dinov2_equals_timm_on_its_grid_and_resampled_grids(tiny):
  tm, state, model, params, report = tiny
  assert (model.dim, model.depth, model.num_heads, model.pos_grid, model.patch_size) == (
      128, 2, 2, 4, 14)
  assert len(report.loaded) == len(state) and not report.left_at_init and not report.ignored
  assert list(state) == [r.torch_key for r in conv.dinov2_rules(model)]  # timm's order
  apply = jax.jit(model.apply)
  for shape in ((2, 3, 56, 56), (2, 3, 28, 42), (1, 3, 70, 70)):  # 4x4 (stored), 2x3, 5x5
    x = images(shape)
    with torch.no_grad():
      want = tm.forward_features(torch.from_numpy(x)).numpy()
    out = apply({"params": params}, nhwc(x))
    t = (shape[2] // 14) * (shape[3] // 14)
    assert out["x_norm_patchtokens"].shape == (shape[0], t, 128)
    assert out["x_norm_clstoken"].shape == (shape[0], 128) and out["x_norm_regtokens"].shape[1] == 0
    assert np.std(want) > 0.1
    np.testing.assert_allclose(np.asarray(out["x_norm_clstoken"]), want[:, 0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out["x_norm_patchtokens"]), want[:, 1:], atol=1e-5,
                               rtol=0)
  # And back: strictly loadable into another timm model, which then gives the same tokens.
  back = timm_dinov2(seed=9)
  back.load_state_dict({k: torch.from_numpy(np.array(v))
                        for k, v in conv.dinov2_to_torch(params, model).items()}, strict=True)
  x = torch.from_numpy(images((1, 3, 56, 56)))
  with torch.no_grad():
    np.testing.assert_array_equal(back.forward_features(x).numpy(), tm.forward_features(x).numpy())


def test_hub_checkpoint_layout_drops_only_mask_token(tiny):
  _, state, model, params, _ = tiny
  hub = dict(state, mask_token=torch.zeros(1, 128))
  got, report = conv.dinov2_from_torch(hub, model)
  assert list(report.ignored) == ["mask_token"] and len(report.loaded) == len(state)
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, params)


def test_register_model_in_timms_layout_equals_timm():
  tm = timm_dinov2(seed=3, reg_tokens=4, no_embed_class=True)
  state = tm.state_dict()
  assert "reg_token" in state and state["pos_embed"].shape[1] == 16  # timm's layout
  model, params, _ = conv.dinov2_from_state_dict(state)
  assert model.num_register_tokens == 4 and model.pos_grid == 4
  x = images((2, 3, 42, 28))
  with torch.no_grad():
    want = tm.forward_features(torch.from_numpy(x)).numpy()
  out = jax.jit(model.apply)({"params": params}, nhwc(x))
  for key, ref_part in (("x_norm_clstoken", want[:, 0]), ("x_norm_regtokens", want[:, 1:5]),
                        ("x_norm_patchtokens", want[:, 5:])):
    np.testing.assert_allclose(np.asarray(out[key]), ref_part, atol=1e-5, rtol=0, err_msg=key)


# ------------------------------------------------------------------------------------------------
# 4. presets


@pytest.mark.parametrize("preset,timm_name", [("dinov2_vits14", "vit_small_patch14_dinov2"),
                                              ("dinov2_vitb14", "vit_base_patch14_dinov2"),
                                              ("dinov2_vitl14", "vit_large_patch14_dinov2")])
def test_presets_have_timms_shapes(preset, timm_name):
  with torch.device("meta"):
    tm = timm.create_model(timm_name, pretrained=False)
  assert tm.patch_embed.grid_size == (37, 37) and tm.blocks[0].ls1.gamma.shape[0] == tm.embed_dim
  state = {k: v.shape for k, v in tm.state_dict().items()}
  model = dinov2.dinov2(preset)
  targets = conv.dinov2_targets(model)
  rules = conv.dinov2_rules(model)
  assert [r.torch_key for r in rules] == list(state)
  for r in rules:
    shape = targets[r.path].shape[1:] if r.layer is not None else targets[r.path].shape
    flax_shape = tuple(reversed(shape)) if r.layout == "linear" else shape
    if r.layout == "conv":
      flax_shape = (shape[3], shape[2], shape[0], shape[1])
    assert flax_shape == tuple(state[r.torch_key]), r.torch_key
  assert model.num_heads == tm.blocks[0].attn.num_heads
  params = sum(int(np.prod(v.shape)) for v in abstract_params(
      model, jnp.zeros((1, 224, 224, 3))).values())
  assert params == sum(int(np.prod(s)) for s in state.values())


# ------------------------------------------------------------------------------------------------
# 5. converter errors


def one_line_error(state, model):
  with pytest.raises(ConversionError) as e:
    conv.dinov2_from_torch(state, model)
  assert "\n" not in str(e.value)
  return str(e.value)


def test_converter_errors_are_one_line(tiny):
  _, state, model, _, _ = tiny
  missing = {k: v for k, v in state.items() if k != "blocks.1.ls2.gamma"}
  assert one_line_error(missing, model) == (
      "missing key(s) in the state_dict: ['blocks.1.ls2.gamma'] (1 in all)")
  wrong = dict(state, **{"blocks.0.attn.qkv.weight": torch.zeros(384, 64)})
  assert one_line_error(wrong, model) == (
      "blocks.0.attn.qkv.weight: shape (384, 64) does not match the model, which expects "
      "(384, 128)")
  unknown = dict(state, **{"head.weight": torch.zeros(10, 128)})
  assert "unknown key(s) in the state_dict: ['head.weight']" in one_line_error(unknown, model)
  with pytest.raises(ConversionError, match="key 'patch_embed.proj.weight' is missing"):
    conv.dinov2_from_state_dict({"cls_token": torch.zeros(1, 1, 128)})


def test_command_writes_a_params_directory_load_params_rebuilds(tiny, tmp_path, capsys):
  _, state, model, params, _ = tiny
  torch.save(dict(state, mask_token=torch.zeros(1, 128)), tmp_path / "dinov2_tiny_pretrain.pth")
  argv = ["dinov2", "--checkpoint", str(tmp_path / "dinov2_tiny_pretrain.pth")]
  assert ce_cli.main(argv + ["--out", str(tmp_path / "out"), "--pos-interpolation",
                             "dinov2"]) == 0
  assert "mask_token: DINOv2's masked-modelling token" in capsys.readouterr().out
  loaded, got = checkpoint.load_params(str(tmp_path / "out"))
  assert loaded == model.clone(pos_interpolation="dinov2")
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, params)
  torch.save({k: v for k, v in state.items() if k != "norm.bias"}, tmp_path / "cut.pth")
  assert ce_cli.main(["dinov2", "--checkpoint", str(tmp_path / "cut.pth"), "--out",
                      str(tmp_path / "out2")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "missing key(s) in the state_dict: ['norm.bias']" in err


def test_bad_fields_are_one_line():
  with pytest.raises(ValueError, match="pos_interpolation='bilinear' is not allowed"):
    dinov2.DINOv2(pos_interpolation="bilinear")
  with pytest.raises(ValueError, match="dim=100 is not allowed"):
    dinov2.DINOv2(dim=100, num_heads=3)


# ------------------------------------------------------------------------------------------------
# 6. REPA's preprocessing


IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406])[:, None, None]
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225])[:, None, None]


def repa_reference(x_uint8_nchw, resolution):
  """REPA train.py ``preprocess_raw_image(x, 'dinov2')``: /255, Normalize, then bicubic to
  ``224 * (resolution // 256)`` (torchvision's Normalize is ``(x - mean) / std`` per channel)."""
  x = x_uint8_nchw / 255.
  x = (x - IMAGENET_MEAN) / IMAGENET_STD
  return torch.nn.functional.interpolate(x, 224 * (resolution // 256), mode="bicubic")


@pytest.mark.parametrize("resolution", [256, 512])
def test_repa_preprocess_equals_repas(resolution):
  x = np.random.default_rng(4).integers(0, 256, (2, 3, resolution, resolution), dtype=np.uint8)
  want = repa_reference(torch.from_numpy(x).float(), resolution).numpy()
  size = dinov2.repa_size(resolution)
  got = jax.jit(dinov2.repa_preprocess, static_argnums=1)(jnp.asarray(x.transpose(0, 2, 3, 1)),
                                                         size)
  assert got.shape == (2, size, size, 3) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got).transpose(0, 3, 1, 2), want, atol=1e-5, rtol=0)
