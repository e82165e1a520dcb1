"""SiT parity: the Flax model with converted weights equals the PyTorch reference (float32)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_reference as ref
from parity import assert_grads_match, nhwc
from decay_jax.io import official, rules, sizes
from decay_jax.models import sit as sit_lib
from decay_jax.models.residual import Residual

ATOL = 1e-5  # outputs, absolute (values are O(1))
GRAD_RTOL = 1e-4  # gradients, relative to the largest entry of each tensor

CASES = {
    "learn_sigma": dict(input_size=8, patch_size=2, in_channels=4, hidden_size=48, depth=4,
                        num_heads=3, num_classes=10, learn_sigma=True, min_sigma=0.8),
    "pixels_p4": dict(input_size=16, patch_size=4, in_channels=1, hidden_size=32, depth=6,
                      num_heads=2, num_classes=7, learn_sigma=False, min_sigma=0.5),
}


def flax_model(kw):
  return sit_lib.SiT(input_size=kw["input_size"], patch_size=kw["patch_size"],
                     in_channels=kw["in_channels"], dim=kw["hidden_size"], depth=kw["depth"],
                     num_heads=kw["num_heads"], num_classes=kw["num_classes"],
                     learn_sigma=kw["learn_sigma"], residual=Residual(alpha_min=kw["min_sigma"]))


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request):
  kw = CASES[request.param]
  tmodel = ref.randomize_(ref.SiT(**kw), seed=4, scale=0.1).eval()
  fmodel = flax_model(kw)
  params, report = official.sit_from_torch(tmodel.state_dict(), fmodel)
  rng = np.random.default_rng(5)
  n, c, s = 4, kw["in_channels"], kw["input_size"]
  x = rng.standard_normal((n, c, s, s)).astype(np.float32)
  t = rng.random(n).astype(np.float32)
  y = rng.integers(0, kw["num_classes"], n)
  fwd = jax.jit(lambda p, x, t, y, d: fmodel.apply({"params": p}, x, t, y, force_drop_ids=d))
  return dict(kw=kw, tmodel=tmodel, fmodel=fmodel, params=params, report=report, x=x, t=t, y=y,
              fwd=fwd)


def test_forward_matches(pair):
  t = pair["tmodel"]
  drop = np.array([0, 1, 0, 1])
  with torch.no_grad():
    want = t(torch.from_numpy(pair["x"]), torch.from_numpy(pair["t"]),
             torch.from_numpy(pair["y"]), force_drop_ids=torch.from_numpy(drop)).numpy()
  got = pair["fwd"](pair["params"], nhwc(pair["x"]), pair["t"], pair["y"], jnp.asarray(drop))
  assert got.shape == nhwc(want).shape
  assert float(jnp.abs(got).max()) > 0.1
  np.testing.assert_allclose(np.asarray(got), np.asarray(nhwc(want)), atol=ATOL, rtol=0)


def test_gradients_match(pair):
  t, f = pair["tmodel"], pair["fmodel"]
  target = np.random.default_rng(6).standard_normal(pair["x"].shape).astype(np.float32)
  t.zero_grad()
  out = t(torch.from_numpy(pair["x"]), torch.from_numpy(pair["t"]), torch.from_numpy(pair["y"]))
  ((out - torch.from_numpy(target)) ** 2).mean().backward()
  tgrads = {k: p.grad.numpy() for k, p in t.named_parameters() if p.grad is not None}

  def loss(p):
    o = f.apply({"params": p}, nhwc(pair["x"]), pair["t"], pair["y"])
    return ((o - nhwc(target)) ** 2).mean()

  g = jax.jit(jax.grad(loss))(pair["params"])
  half = f.depth // 2
  checks = {
      "x_embedder.proj.weight": g["x_embedder"]["proj"]["kernel"].transpose(3, 2, 0, 1),
      "t_embedder.mlp.0.weight": g["t_embedder"]["mlp0"]["kernel"].T,
      "y_embedder.embedding_table.weight": g["y_embedder"]["embedding"],
      "enc_blocks.0.attn.qkv.weight": g["enc_blocks"]["attn"]["qkv"]["kernel"][0].T,
      "enc_blocks.1.adaLN_modulation.1.weight": g["enc_blocks"]["adaLN_modulation"]["kernel"][1].T,
      f"dec_blocks.{half - 1}.mlp.fc2.weight": g["dec_blocks"]["mlp"]["fc2"]["kernel"][half - 1].T,
      "dec_blocks.0.skip.weight": g["dec_blocks"]["skip"]["kernel"][0].T,
      "final_layer.linear.weight": g["final_linear"]["kernel"].T,
  }
  assert_grads_match(checks, tgrads, GRAD_RTOL)


def test_round_trips(pair):
  t, f = pair["tmodel"], pair["fmodel"]
  sd = {k: v.numpy() for k, v in t.state_dict().items()}
  assert set(pair["report"].ignored) == {"pos_embed"}
  assert len(pair["report"].loaded) == len(sd) - 1
  back = official.sit_to_torch(pair["params"], f)
  assert set(back) == set(sd)
  for k in sd:
    np.testing.assert_allclose(back[k], sd[k], atol=1e-6 if k == "pos_embed" else 0, rtol=0,
                               err_msg=k)
  fresh = ref.SiT(**pair["kw"])
  fresh.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in back.items()}, strict=True)
  params = jax.tree_util.tree_map(lambda a: a + 1e-3, pair["params"])
  again, _ = official.sit_from_torch(official.sit_to_torch(params, f), f)
  chex.assert_trees_all_equal(again, params)


def test_architecture_is_inferred_from_the_state_dict(pair):
  fields = sizes.infer_sit_fields(pair["tmodel"].state_dict())
  kw = pair["kw"]
  assert fields == dict(input_size=kw["input_size"], patch_size=kw["patch_size"],
                        in_channels=kw["in_channels"], dim=kw["hidden_size"], depth=kw["depth"],
                        num_heads=fields["num_heads"], num_classes=kw["num_classes"],
                        learn_sigma=kw["learn_sigma"], mlp_ratio=4.0)


def test_missing_and_misshaped_keys_are_errors(pair):
  f = pair["fmodel"]
  sd = {k: v.numpy() for k, v in pair["tmodel"].state_dict().items()}
  with pytest.raises(rules.ConversionError, match="missing key.*dec_blocks.0.skip.weight"):
    official.sit_from_torch({k: v for k, v in sd.items() if k != "dec_blocks.0.skip.weight"}, f)
  with pytest.raises(rules.ConversionError, match="y_embedder.embedding_table.weight: shape"):
    official.sit_from_torch(dict(sd, **{"y_embedder.embedding_table.weight": np.zeros((3, 3))}), f)
