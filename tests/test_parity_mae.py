"""MAE parity: the Flax model with converted weights equals the PyTorch reference (float32).

Random non-zero weights (not the zero-heavy official init) go through ``official.mae_from_torch``;
both models see the same images and the same masking noise. Tolerances are stated per assertion.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_reference as ref
from parity import assert_grads_match, nhwc
from decay_jax.io import official, rules, sizes
from decay_jax.models import mae as mae_lib
from decay_jax.models.residual import Residual

ATOL = 1e-5  # forward outputs, absolute (values are O(1))
GRAD_RTOL = 1e-4  # gradients, relative to the largest entry of each tensor

# (official constructor kwargs, Flax fields). 'deep' has more skip outputs than decoder blocks,
# like ViT-L/H: its unused SkipLayer must be reported, dropped, and re-created on the way back.
CASES = {
    "base_like": dict(img_size=32, patch_size=4, in_chans=3, embed_dim=48, depth=4, num_heads=3,
                      decoder_embed_dim=24, decoder_depth=3, decoder_num_heads=2,
                      norm_pix_loss=True, min_decay=0.7),
    "deep": dict(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=6, num_heads=2,
                 decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2,
                 norm_pix_loss=False, min_decay=0.6),
}


def flax_model(kw):
  return mae_lib.MaskedAutoencoder(
      img_size=kw["img_size"], patch_size=kw["patch_size"], in_chans=kw["in_chans"],
      dim=kw["embed_dim"], depth=kw["depth"], num_heads=kw["num_heads"],
      decoder_dim=kw["decoder_embed_dim"], decoder_depth=kw["decoder_depth"],
      decoder_num_heads=kw["decoder_num_heads"], norm_pix_loss=kw["norm_pix_loss"],
      residual=Residual(alpha_min=kw["min_decay"]))


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request):
  kw = CASES[request.param]
  torch.manual_seed(0)
  tmodel = ref.randomize_(ref.MaskedAutoencoderViT(**kw), seed=1, scale=0.1).eval()
  fmodel = flax_model(kw)
  params, report = official.mae_from_torch(tmodel.state_dict(), fmodel)
  rng = np.random.default_rng(2)
  imgs = rng.standard_normal((3, kw["in_chans"], kw["img_size"], kw["img_size"])).astype(np.float32)
  noise = rng.random((3, fmodel.num_patches)).astype(np.float32)
  return dict(kw=kw, tmodel=tmodel, fmodel=fmodel, params=params, report=report, imgs=imgs,
              noise=noise, name=request.param)


def test_forward_matches(pair):
  t, f = pair["tmodel"], pair["fmodel"]
  with torch.no_grad():
    loss, pred, mask, latent = t(torch.from_numpy(pair["imgs"]), 0.75, torch.from_numpy(pair["noise"]))
    feat = t.forward_feat(torch.from_numpy(pair["imgs"]))
  out = jax.jit(lambda p, x, n: f.apply({"params": p}, x, n))(
      pair["params"], nhwc(pair["imgs"]), jnp.asarray(pair["noise"]))
  np.testing.assert_array_equal(np.asarray(out["mask"]), mask.numpy())
  assert float(jnp.abs(out["pred"]).max()) > 0.1  # random weights: predictions are not trivial
  np.testing.assert_allclose(np.asarray(out["pred"]), pred.numpy(), atol=ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(out["latent"]), latent.numpy(), atol=ATOL, rtol=0)
  np.testing.assert_allclose(float(out["loss"]), float(loss), atol=ATOL, rtol=1e-6)
  feats = jax.jit(lambda p, x: f.apply({"params": p}, x, method=f.features))(
      pair["params"], nhwc(pair["imgs"]))
  assert feats.shape == (f.depth,) + tuple(feat.shape)
  np.testing.assert_allclose(np.asarray(feats[-1]), feat.numpy(), atol=ATOL, rtol=0)


def test_gradients_match(pair):
  t, f = pair["tmodel"], pair["fmodel"]
  t.zero_grad()
  loss, *_ = t(torch.from_numpy(pair["imgs"]), 0.75, torch.from_numpy(pair["noise"]))
  loss.backward()
  tgrads = {k: p.grad.numpy() for k, p in t.named_parameters() if p.grad is not None}
  grads = jax.jit(jax.grad(lambda p: f.apply({"params": p}, nhwc(pair["imgs"]),
                                     jnp.asarray(pair["noise"]))["loss"]))(pair["params"])
  last = f.depth - 1
  checks = {
      "cls_token": grads["cls_token"],
      "patch_embed.proj.weight": grads["patch_embed"]["proj"]["kernel"].transpose(3, 2, 0, 1),
      "blocks.0.attn.qkv.weight": grads["blocks"]["attn"]["qkv"]["kernel"][0].T,
      f"blocks.{last}.mlp.fc2.weight": grads["blocks"]["mlp"]["fc2"]["kernel"][last].T,
      "blocks.1.norm1.weight": grads["blocks"]["norm1"]["scale"][1],
      "skip.0.mask_token": grads["skip_0"]["mask_token"],
      "skip.0.fc.0.weight": grads["skip_0"]["fc0"]["kernel"].T,
      "decoder_cls_token": grads["decoder_cls_token"],
      "decoder_pred.weight": grads["decoder_pred"]["kernel"].T,
  }
  assert_grads_match(checks, tgrads, GRAD_RTOL)


def test_conversion_report_and_round_trip(pair):
  t, f = pair["tmodel"], pair["fmodel"]
  sd = {k: v.numpy() for k, v in t.state_dict().items()}
  unused = official.mae_unused_skip_keys(f)
  if pair["name"] == "deep":
    assert unused == [f"skip.2.{n}" for n in ("mask_token", "fc.0.weight", "fc.0.bias",
                                               "fc.2.weight", "fc.2.bias")]
  else:
    assert unused == []
  assert set(pair["report"].ignored) == {"pos_embed", "decoder_pos_embed", *unused}
  assert len(pair["report"].loaded) == len(sd) - 2 - len(unused)
  back = official.mae_to_torch(pair["params"], f)
  assert list(back) == list(sd)  # official keys, official order
  for k in sd:
    if k in unused:
      continue
    if "pos_embed" in k:
      np.testing.assert_allclose(back[k], sd[k], atol=1e-6, rtol=0, err_msg=k)
    else:
      np.testing.assert_array_equal(back[k], sd[k], err_msg=k)
  # The official model loads the converted dict strictly.
  fresh = ref.MaskedAutoencoderViT(**pair["kw"])
  fresh.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in back.items()}, strict=True)


def test_flax_torch_flax_is_exact(pair):
  f = pair["fmodel"]
  params = jax.jit(f.init)(jax.random.key(3), jnp.zeros((1, f.img_size, f.img_size, f.in_chans)),
                  jnp.zeros((1, f.num_patches)))["params"]
  params = jax.tree_util.tree_map(lambda a: a + 0.01 * jnp.arange(a.size).reshape(a.shape) / a.size,
                                  params)
  again, _ = official.mae_from_torch(official.mae_to_torch(params, f), f)
  chex.assert_trees_all_equal(again, params)


def test_conversion_errors(pair):
  f = pair["fmodel"]
  sd = {k: v.numpy() for k, v in pair["tmodel"].state_dict().items()}
  bad = dict(sd, **{"blocks.0.attn.typo.weight": np.zeros(3)})
  with pytest.raises(rules.ConversionError, match="unknown key.*blocks.0.attn.typo.weight"):
    official.mae_from_torch(bad, f)
  missing = {k: v for k, v in sd.items() if k != "decoder_pred.bias"}
  with pytest.raises(rules.ConversionError, match="missing key.*decoder_pred.bias"):
    official.mae_from_torch(missing, f)
  shaped = dict(sd, **{"blocks.1.mlp.fc1.weight": np.zeros((5, 5), np.float32)})
  with pytest.raises(rules.ConversionError, match=r"blocks.1.mlp.fc1.weight: shape \(5, 5\)"):
    official.mae_from_torch(shaped, f)
  wrong_grid = dict(sd, pos_embed=np.zeros((1, 5, f.dim), np.float32))
  with pytest.raises(rules.ConversionError, match="pos_embed: shape"):
    official.mae_from_torch(wrong_grid, f)


def test_architecture_is_inferred_from_the_state_dict(pair):
  fields = sizes.infer_mae_fields(pair["tmodel"].state_dict())
  kw = pair["kw"]
  assert fields["img_size"] == kw["img_size"] and fields["patch_size"] == kw["patch_size"]
  assert fields["dim"] == kw["embed_dim"] and fields["depth"] == kw["depth"]
  assert fields["decoder_dim"] == kw["decoder_embed_dim"]
  assert fields["decoder_depth"] == kw["decoder_depth"] and fields["mlp_ratio"] == 4.0
