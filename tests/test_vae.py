"""SD VAE parity: the Flax AutoencoderKL with converted weights equals diffusers' (float32).

The reference is diffusers' own ``AutoencoderKL`` built from a config with random weights (no
download): a small config with the sd-vae-ft-ema structure (3 levels, attention mid-blocks, width
changes) for the numbers, and the full sd-vae-ft-ema config for the key/shape mapping.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL

from parity import nhwc
from decay_jax.train import checkpoint
from decay_jax.cli import convert_external as ce_cli
from decay_jax.io import convert_external as ce
from decay_jax.io.rules import ConversionError, to_flax_layout
from decay_jax.models import vae as vae_lib

ATOL = 2e-5  # encoder moments and decoded pixels, absolute (values are O(1)); measured ~5e-6
TINY = dict(block_out_channels=(16, 32, 32), layers_per_block=2, norm_num_groups=8)


def diffusers_vae(block_out_channels, layers_per_block, norm_num_groups, seed=0, noise=0.05):
  n = len(block_out_channels)
  torch.manual_seed(seed)
  m = AutoencoderKL(block_out_channels=block_out_channels, layers_per_block=layers_per_block,
                    norm_num_groups=norm_num_groups, down_block_types=("DownEncoderBlock2D",) * n,
                    up_block_types=("UpDecoderBlock2D",) * n, latent_channels=4,
                    scaling_factor=0.18215).eval()
  if noise:  # diffusers zero-initialises nothing here, but perturb every tensor (biases too)
    with torch.no_grad():
      for p in m.parameters():
        p.add_(noise * torch.randn_like(p))
  return m


@pytest.fixture(scope="module")
def pair():
  tmodel = diffusers_vae(**TINY)
  sd = tmodel.state_dict()
  fmodel = vae_lib.AutoencoderKL(**ce.infer_vae_fields(sd), norm_num_groups=8)
  params, report = ce.vae_from_torch(sd, fmodel)
  x = np.random.default_rng(0).uniform(-1, 1, (2, 3, 32, 32)).astype(np.float32)
  return dict(tmodel=tmodel, sd=sd, fmodel=fmodel, params=params, report=report, x=x)


def test_encode_sample_decode_match_diffusers(pair):
  t, f, p = pair["tmodel"], pair["fmodel"], pair["params"]
  with torch.no_grad():
    post = t.encode(torch.from_numpy(pair["x"])).latent_dist
    sample = post.sample(generator=torch.Generator().manual_seed(3))
    noise = torch.randn(post.mean.shape, generator=torch.Generator().manual_seed(3))
    decoded = t.decode(sample).sample
  x = nhwc(pair["x"])
  mean, logvar = jax.jit(lambda p, x: f.apply({"params": p}, x, method=f.encode))(p, x)
  z = jax.jit(lambda p, x, n: f.apply({"params": p}, x, n, method=f.sample_latent))(
      p, x, nhwc(noise.numpy()))
  out = jax.jit(lambda p, z: f.apply({"params": p}, z / f.scaling_factor, method=f.decode))(p, z)
  assert mean.shape == (2, 8, 8, 4) and out.shape == (2, 32, 32, 3)
  assert float(jnp.abs(out).max()) > 0.1 and float(jnp.abs(logvar).max()) > 0.1
  for got, want in ((mean, post.mean), (logvar, post.logvar), (z, sample * 0.18215),
                    (out, decoded)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(nhwc(want.numpy())), atol=ATOL, rtol=0)


def test_round_trip_to_diffusers_keys(pair):
  back = ce.vae_to_torch(pair["params"], pair["fmodel"])
  assert set(back) == set(pair["sd"])
  for k, v in pair["sd"].items():
    np.testing.assert_array_equal(back[k], v.numpy(), err_msg=k)
  fresh = diffusers_vae(**TINY, noise=0)
  fresh.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in back.items()}, strict=True)
  assert len(pair["report"].loaded) == len(pair["sd"]) and not pair["report"].ignored


def test_legacy_attention_names_and_cli(pair, tmp_path):
  from safetensors.numpy import save_file
  legacy = {}
  for k, v in pair["sd"].items():
    for new, old in (("to_q", "query"), ("to_k", "key"), ("to_v", "value"),
                     ("to_out.0", "proj_attn")):
      k = k.replace(f"attentions.0.{new}.", f"attentions.0.{old}.")
    legacy[k] = v.numpy()
  assert any(".query." in k for k in legacy)
  save_file(legacy, str(tmp_path / "diffusion_pytorch_model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps({"norm_num_groups": 8,
                                                    "scaling_factor": 0.18215}))
  assert ce_cli.main(["vae", "--checkpoint", str(tmp_path / "diffusion_pytorch_model.safetensors"),
                  "--config", str(tmp_path / "config.json"), "--out", str(tmp_path / "out")]) == 0
  model, params = checkpoint.load_params(str(tmp_path / "out"))
  assert model == pair["fmodel"]
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, pair["params"])


def test_full_sd_vae_ft_ema_config_maps_every_key():
  tmodel = diffusers_vae(**{k: vae_lib.SD_VAE_FT_EMA[k] for k in TINY}, noise=0)
  sd = tmodel.state_dict()
  fields = ce.infer_vae_fields(sd)
  model = vae_lib.AutoencoderKL(**fields, norm_num_groups=32)
  assert model == vae_lib.AutoencoderKL(**vae_lib.SD_VAE_FT_EMA)
  targets = ce.vae_targets(model)
  rules = ce.vae_rules(model)
  assert {r.torch_key for r in rules} == set(sd)  # every key mapped, none left over
  for r in rules:
    want = tuple(to_flax_layout(np.empty(tuple(sd[r.torch_key].shape)), r.layout).shape)
    assert want == targets[r.path].shape, r.torch_key
  n = sum(int(np.prod(t.shape)) for t in targets.values())
  assert n == sum(p.numel() for p in tmodel.parameters()) == 83_653_863


def test_errors_name_the_key(pair):
  sd = {k: v.numpy() for k, v in pair["sd"].items()}
  f = pair["fmodel"]
  with pytest.raises(ConversionError, match="missing key.*quant_conv.weight"):
    ce.vae_from_torch({k: v for k, v in sd.items() if k != "quant_conv.weight"}, f)
  with pytest.raises(ConversionError, match="decoder.conv_out.bias: shape"):
    ce.vae_from_torch(dict(sd, **{"decoder.conv_out.bias": np.zeros(5)}), f)
  bad = vae_lib.AutoencoderKL(block_out_channels=(12, 32), norm_num_groups=8)
  with pytest.raises(ValueError, match=r"block_out_channels=\(12, 32\) is not allowed"):
    bad.init(jax.random.key(0), jnp.zeros((1, 2, 2, 3)))
