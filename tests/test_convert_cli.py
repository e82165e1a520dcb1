"""Converter command line on .pth files, and the upstream-MAE encoder initialisation."""

import argparse
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_reference as ref
from decay_jax.train import checkpoint
from decay_jax.io import convert
from decay_jax.models import mae as mae_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAE_KW = dict(img_size=16, patch_size=4, in_chans=3, embed_dim=32, depth=4, num_heads=2,
              decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2, norm_pix_loss=True,
              min_decay=0.7)


def cli(*args):
  return subprocess.run([sys.executable, "-m", "decay_jax.io.convert", *args], cwd=REPO,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                        timeout=180)


def test_mae_checkpoint_file_round_trip(tmp_path):
  t = ref.randomize_(ref.MaskedAutoencoderViT(**MAE_KW), seed=0, scale=0.1)
  args = argparse.Namespace(min_decay=0.7, norm_pix_loss=True, model="custom")
  path = tmp_path / "checkpoint-799.pth"
  torch.save({"model": t.state_dict(), "optimizer": {}, "epoch": 799, "args": args}, path)
  p = cli("mae", "--checkpoint", str(path), "--out", str(tmp_path / "flax"))
  assert p.returncode == 0, p.stderr
  assert "loaded" in p.stdout and "pos_embed: fixed sin-cos table" in p.stdout
  model, params = checkpoint.load_params(str(tmp_path / "flax"))
  assert isinstance(model, mae_lib.MaskedAutoencoder) and model.alpha_min == 0.7
  assert (model.dim, model.depth, model.decoder_depth, model.img_size) == (32, 4, 2, 16)
  back = convert.mae_to_torch(params, model)
  for k, v in t.state_dict().items():
    if "pos_embed" not in k:
      np.testing.assert_array_equal(back[k], v.numpy(), err_msg=k)


def test_sit_checkpoint_file_takes_ema_weights(tmp_path):
  kw = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=4, num_heads=2,
            num_classes=10, min_sigma=0.8)
  model_sd = ref.randomize_(ref.SiT(**kw), seed=1).state_dict()
  ema_sd = ref.randomize_(ref.SiT(**kw), seed=2).state_dict()
  path = tmp_path / "0400000.pt"
  torch.save({"model": model_sd, "ema": ema_sd, "opt": {}, "args": argparse.Namespace(min_sigma=0.8)},
             path)
  assert cli("sit", "--checkpoint", str(path), "--out", str(tmp_path / "ema")).returncode == 0
  model, params = checkpoint.load_params(str(tmp_path / "ema"))
  np.testing.assert_array_equal(np.asarray(params["final_linear"]["kernel"]).T,
                                ema_sd["final_layer.linear.weight"].numpy())
  assert model.alpha_min == 0.8 and model.num_classes == 10 and model.learn_sigma


def test_missing_args_is_a_clear_error(tmp_path):
  t = ref.MaskedAutoencoderViT(**MAE_KW)
  path = tmp_path / "bare.pth"
  torch.save({"model": t.state_dict()}, path)
  p = cli("mae", "--checkpoint", str(path), "--out", str(tmp_path / "x"))
  assert p.returncode == 2
  assert p.stderr.strip().splitlines()[-1].startswith("error: the checkpoint has no args.min_decay")


def test_upstream_encoder_initialisation():
  """Upstream mae_pretrain_vit_*.pth: cls, patch_embed, blocks and a final norm (no decoder)."""
  t = ref.randomize_(ref.MaskedAutoencoderViT(**MAE_KW), seed=3, scale=0.1)
  sd = {k: v for k, v in t.state_dict().items()
        if k.startswith(("cls_token", "pos_embed", "patch_embed", "blocks."))}
  sd["norm.weight"], sd["norm.bias"] = torch.ones(32), torch.zeros(32)
  model = mae_lib.MaskedAutoencoder(img_size=16, patch_size=4, dim=32, depth=4, num_heads=2,
                                    decoder_dim=16, decoder_depth=2, decoder_num_heads=2,
                                    alpha_min=0.6)
  init = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), jnp.zeros((1, 16)))
  params, report = convert.mae_from_upstream_encoder(sd, model, init["params"])
  assert set(report.ignored) == {"norm.weight", "norm.bias", "pos_embed"}
  assert len(report.loaded) == len(sd) - 3
  assert "decoder_pred/kernel" in report.left_at_init and "skip_0/mask_token" in report.left_at_init
  assert not any(p.startswith("blocks/") for p in report.left_at_init)
  np.testing.assert_array_equal(np.asarray(params["blocks"]["attn"]["qkv"]["kernel"][2]).T,
                                sd["blocks.2.attn.qkv.weight"].numpy())
  chex.assert_trees_all_equal(params["decoder_blocks_0"], init["params"]["decoder_blocks_0"])
  with pytest.raises(convert.ConversionError, match="unknown key.*head.weight"):
    convert.mae_from_upstream_encoder(dict(sd, **{"head.weight": torch.zeros(3, 3)}), model,
                                      init["params"])
