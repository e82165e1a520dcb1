"""REPA (docs/repa.md): the converter against a transcription of REPA's SiT, the projection loss
by hand, the loss's gradients, and train steps through the real setup."""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_reference as ref
import torch_reference_repa as rref
from parity import nhwc
from testing_configs import load_config, override
from decay_jax import sharding as shd
from decay_jax.cli import convert as convert_cli
from decay_jax.io import convert_repa, rules
from decay_jax.models import dinov2
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib
from decay_jax.train import checkpoint, setup
from decay_jax.train import repa as repa_lib
from decay_jax.train.tasks.sit import SiTTask

ATOL = 1e-5
KW = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, encoder_depth=2, depth=4,
          num_heads=2, num_classes=10, z_dims=(16, 8), projector_dim=32)


@pytest.fixture(scope="module")
def repa_pair():
  tmodel = rref.SiT(**KW)
  ref_init = {k: v.clone() for k, v in tmodel.state_dict().items()}
  ref.randomize_(tmodel, seed=7, scale=0.1).eval()
  model, params, report = convert_repa.repa_from_torch(tmodel.state_dict(), KW["encoder_depth"],
                                                       num_heads=KW["num_heads"])
  rng = np.random.default_rng(3)
  x = rng.standard_normal((4, 4, 8, 8)).astype(np.float32)
  t = rng.random(4).astype(np.float32)
  y = rng.integers(0, 10, 4)
  fwd = jax.jit(lambda p, x, t, y, d: model.apply({"params": p}, x, t, y, force_drop_ids=d,
                                                  features=True))
  return dict(tmodel=tmodel, model=model, params=params, report=report, x=x, t=t, y=y, fwd=fwd,
              ref_init=ref_init)


def test_converted_repa_sit_matches_reference(repa_pair):
  """Outputs and projected features equal REPA's forward; our time t is REPA's 1 - t and our
  velocity (data - noise) is minus REPA's (noise - data)."""
  p = repa_pair
  m = p["model"]
  assert (m.residual_routing, m.alpha_min, m.learn_sigma, m.flow_convention) == (
      "plain", 1.0, False, "repa")
  assert (m.repa_depth, m.repa_dims, m.repa_hidden, m.dim, m.depth) == (2, (16, 8), 32, 64, 4)
  drop = np.array([0, 1, 0, 0])
  with torch.no_grad():
    want, want_zs = p["tmodel"](torch.from_numpy(p["x"]), torch.from_numpy(1.0 - p["t"]),
                                torch.from_numpy(p["y"]), force_drop_ids=torch.from_numpy(drop))
  got, zs = p["fwd"](p["params"], nhwc(p["x"]), p["t"], p["y"], jnp.asarray(drop))
  assert float(jnp.abs(got).max()) > 0.1
  np.testing.assert_allclose(np.asarray(got), -np.asarray(nhwc(want.numpy())), atol=ATOL, rtol=0)
  assert len(zs) == 2
  for z, wz in zip(zs, want_zs):
    assert z.shape == wz.shape and float(jnp.abs(z).max()) > 0.1
    np.testing.assert_allclose(np.asarray(z), wz.numpy(), atol=ATOL, rtol=0)
  assert set(p["report"].ignored) == {"pos_embed"}
  assert len(p["report"].loaded) == len(p["tmodel"].state_dict()) - 1


def test_flax_init_matches_repa_init_statistics(repa_pair):
  """Our init of the projectors and blocks follows REPA's (xavier / zero), by shape and scale."""
  m, init = repa_pair["model"], repa_pair["ref_init"]
  params = jax.jit(m.init)(jax.random.key(0), *sit_lib.init_args(m))["params"]
  w = np.asarray(params["projectors_0"]["fc0"]["kernel"])
  bound = np.sqrt(6.0 / (64 + 32))
  assert w.shape == (64, 32) and np.abs(w).max() <= bound and np.abs(w).max() > 0.8 * bound
  assert np.abs(init["projectors.0.0.weight"].numpy()).max() <= bound
  assert not np.any(np.asarray(params["trunk"]["enc_00"]["adaLN_modulation"]["kernel"]))
  assert not init["blocks.0.adaLN_modulation.1.weight"].any()


def test_checkpoint_kinds_and_legacy_names(repa_pair):
  sd = {k: v.numpy() for k, v in repa_pair["tmodel"].state_dict().items()}
  ckpt = {"model": sd, "ema": sd, "opt": {}, "steps": 5,
          "args": argparse.Namespace(encoder_depth=2)}
  assert convert_repa.repa_state_dict(ckpt)[1].startswith("'ema'")
  assert convert_repa.encoder_depth_of(ckpt) == 2 and convert_repa.encoder_depth_of(sd) == 8
  assert convert_repa.repa_state_dict(sd)[0] is sd
  with pytest.raises(rules.ConversionError, match="bare state_dict"):
    convert_repa.repa_state_dict(sd, "model")
  legacy = {(f"decoder_blocks.{int(k.split('.')[1]) - 2}." + k.split(".", 2)[2]
             if k.startswith("blocks.") and int(k.split(".")[1]) >= 2 else k): v
            for k, v in sd.items()}
  assert any(k.startswith("decoder_blocks.") for k in legacy)
  assert convert_repa.rename_legacy(legacy, 2).keys() == sd.keys()
  with pytest.raises(rules.ConversionError, match="qk-norm"):
    convert_repa.repa_from_torch(dict(sd, **{"blocks.0.attn.q_norm.weight": np.ones(32)}), 2, 2)
  with pytest.raises(rules.ConversionError, match="no projectors"):
    convert_repa.repa_from_torch({k: v for k, v in sd.items()
                                  if not k.startswith("projectors.")}, 2, 2)


def test_convert_command_writes_a_params_directory(repa_pair, tmp_path, capsys):
  sd = {k: v.detach().clone() for k, v in repa_pair["tmodel"].state_dict().items()}
  path = tmp_path / "0000005.pt"
  torch.save({"model": sd, "ema": sd, "opt": {}, "steps": 5,
              "args": argparse.Namespace(encoder_depth=2)}, path)
  out = tmp_path / "params"
  assert convert_cli.main(["repa", "--checkpoint", str(path), "--out", str(out)]) == 0
  assert "aligned block (encoder_depth) 2" in capsys.readouterr().out
  model, params = checkpoint.load_params(str(out))
  assert (model.repa_depth, model.repa_dims, model.flow_convention) == (2, (16, 8), "repa")
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, repa_pair["params"])
  assert convert_cli.main(["repa", "--checkpoint", str(path), "--out", str(tmp_path / "o2"),
                           "--alpha-min", "0.8"]) == 2
  assert "no decay" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# The loss
# ------------------------------------------------------------------------------------------------

def test_projection_loss_by_hand():
  """Two tokens, one example: cos = 1 and cos = 0 -> -(1 + 0)/2; a second target averages in."""
  z = jnp.array([[[3.0, 0.0], [0.0, 2.0]]])
  y = jnp.array([[[1.0, 0.0], [5.0, 0.0]]])
  np.testing.assert_allclose(repa_lib.proj_loss_per_example([z], [y]), [-0.5], atol=1e-7)
  y2 = jnp.array([[[-1.0, 0.0], [0.0, 1.0]]])  # cos -1 and 1 -> 0
  np.testing.assert_allclose(repa_lib.proj_loss_per_example([z, z], [y, y2]), [-0.25], atol=1e-7)
  rng = np.random.default_rng(0)
  zs = [rng.standard_normal((3, 5, 4)).astype(np.float32) for _ in range(2)]
  ys = [rng.standard_normal((3, 5, 4)).astype(np.float32) for _ in range(2)]
  want = rref.proj_loss([torch.from_numpy(a) for a in ys], [torch.from_numpy(a) for a in zs])
  got = repa_lib.proj_loss_per_example([jnp.asarray(a) for a in zs], [jnp.asarray(a) for a in ys])
  np.testing.assert_allclose(float(got.mean()), float(want), atol=1e-6)


def tiny_task(proj_coeff=0.5, **fields):
  model = sit_lib.sit("micro/4", input_size=16, in_channels=1, num_classes=10, alpha_min=1.0,
                      residual_routing="plain", learn_sigma=False, **fields)
  cfg = argparse.Namespace(proj_coeff=proj_coeff, encoder="")
  return SiTTask(model, {}, None, cfg)


@pytest.fixture(scope="module")
def tiny():
  task = tiny_task(repa_depth=2, repa_dims=(8,), repa_hidden=16)
  params = task.model.init(jax.random.key(0), *task.init_inputs(2))["params"]
  params = jax.tree_util.tree_map(  # adaLN and final layer away from zero, so every path matters
      lambda a: a + 0.05 * jax.random.normal(jax.random.key(a.size), a.shape), params)
  rng = np.random.default_rng(1)
  batch = {"image": jnp.asarray(rng.standard_normal((4, 16, 16, 1)), jnp.float32),
           "label": jnp.asarray(rng.integers(0, 10, 4), jnp.int32),
           "repa_target_0": jnp.asarray(rng.standard_normal((4, 16, 8)), jnp.float32)}
  prepared = jax.jit(task.prepare)(batch, jax.random.key(2))
  return task, params, prepared


def test_proj_coeff_zero_is_the_plain_sit_loss(tiny):
  task, params, batch = tiny
  plain = tiny_task(0.0)
  base = {k: v for k, v in params.items() if not k.startswith("projectors")}
  loss0, m0 = tiny_task(0.0, repa_depth=2, repa_dims=(8,), repa_hidden=16).loss(params, batch)
  loss_plain, _ = plain.loss(base, batch)
  np.testing.assert_allclose(float(loss0), float(loss_plain), rtol=1e-6)
  loss, m = task.loss(params, batch)
  np.testing.assert_allclose(float(loss), float(m["loss_v"] + 0.5 * m["loss_proj"]), rtol=1e-6)
  np.testing.assert_allclose(float(m0["loss_v"]), float(m["loss_v"]), rtol=1e-6)
  assert -1.0 <= float(m["loss_proj"]) <= 1.0


def test_gradients_of_the_projection_loss_stop_at_the_aligned_block(tiny):
  task, params, batch = tiny
  metric = lambda name: jax.jit(jax.grad(lambda p: task.loss(p, batch)[1][name]))(params)
  g_proj, g_v = metric("loss_proj"), metric("loss_v")
  norm = lambda tree: float(sum(jnp.abs(a).sum() for a in jax.tree_util.tree_leaves(tree)))
  for name in ("projectors_0", "x_embedder", "t_embedder", "y_embedder"):
    assert norm(g_proj[name]) > 0, name
  assert norm(g_proj["trunk"]["enc_00"]) > 0 and norm(g_proj["trunk"]["enc_01"]) > 0
  for name in ("dec_00", "dec_01"):
    assert norm(g_proj["trunk"][name]) == 0, name
  assert norm(g_proj["final_linear"]) == 0 and norm(g_proj["final_adaLN"]) == 0
  assert norm(g_v["projectors_0"]) == 0 and norm(g_v["trunk"]["dec_01"]) > 0


def test_routed_trunks_give_the_aligned_block_under_remat():
  """Every routed trunk returns the stream after block repa_depth (its ``capture``), the same with
  rematerialisation as without; the projection differs between the aligned blocks 1 and 3."""
  make = lambda **f: sit_lib.sit("micro/4", input_size=16, in_channels=1, num_classes=10,
                                 residual_routing="mirror", repa_dims=(8,), repa_hidden=16, **f)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, 16, 1)), jnp.float32)
  t, y = jnp.array([0.3, 0.8]), jnp.array([1, 2], jnp.int32)
  params = make(repa_depth=3).init(jax.random.key(0), x, t, y)["params"]
  params = jax.tree_util.tree_map(  # adaLN gates away from zero, so the blocks change the stream
      lambda a: a + 0.05 * jax.random.normal(jax.random.key(a.size), a.shape), params)
  run = lambda m: m.apply({"params": params}, x, t, y, features=True)
  (out, (z,)), (out_r, (z_r,)) = run(make(repa_depth=3)), run(make(repa_depth=3,
                                                                     remat_policy="full"))
  np.testing.assert_allclose(out_r, out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(z_r, z, rtol=1e-5, atol=1e-6)
  _, (z1,) = run(make(repa_depth=1))
  assert z.shape == z1.shape == (2, 16, 8) and float(jnp.abs(z - z1).max()) > 1e-3


# ------------------------------------------------------------------------------------------------
# Train steps through the real setup, and one-line errors
# ------------------------------------------------------------------------------------------------

def repa_config(**overrides):
  c = load_config("sit_cpu_mnist")
  return override(c, **{"model.preset": "micro/4", "data.image_size": 16, "batch_size": 8,
                        "num_train_steps": 4, "mesh.data": 1, "ema_decay": 0.9,
                        "model.alpha_min": 1.0, "model.residual_routing": "plain",
                        "model.repa_depth": 2, "model.repa_dims": (8,), "model.repa_hidden": 16,
                        **overrides})


def test_train_steps_with_a_frozen_encoder(tmp_path):
  """Targets on the fly: a tiny MAE's patch tokens of the batch's images; its weights are the
  state's ``frozen`` entry and stay as loaded."""
  enc = mae_lib.MaskedAutoencoder(img_size=16, patch_size=4, in_chans=1, dim=8, depth=2,
                                  num_heads=1, decoder_dim=8, decoder_depth=1, decoder_num_heads=1)
  enc_params = enc.init({"params": jax.random.key(1), "masking": jax.random.key(2)},
                        jnp.zeros((1, 16, 16, 1)))["params"]
  checkpoint.save_params(str(tmp_path / "enc"), enc_params, enc)
  s = setup.build(repa_config(**{"repa.encoder": str(tmp_path / "enc"),
                                 "repa.encoder_normalize": "half"}))
  state = s.init_state()
  assert sorted(state) == ["ema", "frozen", "opt_state", "params", "rng", "step"]
  rng = np.random.default_rng(0)
  batch = jax.device_put({"image": rng.integers(0, 255, (8, 16, 16, 1)).astype(np.uint8),
                          "label": rng.integers(0, 10, 8).astype(np.int32)},
                         shd.batch_sharding(s.mesh))
  losses = []
  for _ in range(2):
    state, m = s.train_step(state, batch)
    losses.append((float(m["loss_v"]), float(m["loss_proj"])))
    np.testing.assert_allclose(float(m["loss"]), losses[-1][0] + 0.5 * losses[-1][1], rtol=1e-5)
  assert all(np.isfinite(losses).ravel()) and -1 < losses[0][1] < 1
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(state["frozen"]),
                         jax.device_get(enc_params))
  enc_tokens = repa_lib.encoder_for(enc, "half").tokens(enc_params, jnp.zeros((8, 16, 16, 1)))
  assert enc_tokens.shape == (8, 16, 8)  # the MAE's last block, class token dropped


@pytest.mark.parametrize("overrides,match", [
    ({"model.repa_depth": 5}, r"repa_depth=5 is not allowed; it must be an integer in \[0, 4\]"),
    ({"model.repa_dims": ()}, "repa_dims=.* non-empty tuple"),
    ({"model.residual_routing": "attnres"}, "'attnres' has no block stream"),
    ({"model.residual_routing": "none", "model.repa_depth": 3}, "must be <= depth/2 = 2"),
    ({"model.flow_convention": "edm"}, "flow_convention='edm' is not allowed"),
    ({"repa.proj_coeff": -1.0}, "repa.proj_coeff=-1.0 is not allowed"),
    ({"repa.encoder": "/x", "model.repa_dims": (8, 4)}, "one encoder"),
])
def test_bad_values_are_one_line_errors(overrides, match):
  with pytest.raises(ValueError, match=match) as e:
    setup.check_config(repa_config(**overrides), info={"image_size": 16, "channels": 1,
                                                       "num_train": 64, "num_classes": 10})
  assert "\n" not in str(e.value)


def test_missing_targets_are_a_one_line_error(tiny):
  task = tiny[0]
  batch = {"image": jnp.zeros((2, 16, 16, 1)), "label": jnp.zeros((2,), jnp.int32)}
  with pytest.raises(ValueError, match="needs targets: set repa.encoder"):
    task.prepare(batch, jax.random.key(0))
  with pytest.raises(ValueError, match=r"target 0 has shape \(2, 16, 4\)"):
    task.prepare(dict(batch, repa_target_0=jnp.zeros((2, 16, 4))), jax.random.key(0))


def test_dinov2_plugs_in_through_its_repa_preprocess():
  """A DINOv2 (decay_jax/models/dinov2.py) is an encoder as it is: uint8 pixels -> 224x224 ->
  x_norm_patchtokens, 16 x 16 tokens (SiT-XL/2's grid on 256 px images)."""
  module = dinov2.DINOv2(dim=8, depth=1, num_heads=1, pos_grid=16)
  enc = repa_lib.encoder_for(module)
  assert enc.preprocess is dinov2.repa_preprocess
  pixels = jnp.asarray(np.random.default_rng(0).integers(0, 255, (2, 64, 64, 3)), jnp.uint8)
  params = jax.jit(module.init)(jax.random.key(0), enc.preprocess(pixels))["params"]
  assert jax.jit(enc.tokens)(params, pixels).shape == (2, 256, 8)
