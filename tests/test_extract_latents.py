"""Latent extraction (ADM crop, flips, sampled latents, shards, resume) and the whole generation
pipeline on a small image folder: extract -> train the CPU latent SiT -> sample + VAE decode -> FID.

The VAE and the Inception carry random weights here (no downloads); real use converts
sd-vae-ft-ema and pytorch-fid's Inception weights with ``decay_jax.cli.convert_external``.
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from PIL import Image

import torch_reference_external as ref
from decay_jax.train import checkpoint
from decay_jax.cli import convert_external as ce_cli
from decay_jax.cli import fid
from decay_jax.data import pipeline
from decay_jax.evals import generation as gen
from decay_jax.cli import extract_latents as ex
from decay_jax.data import augment
from decay_jax.evals import registry
from decay_jax.train import trainer
from testing_configs import REPO, load_config, override

NUM_IMAGES, SHARD = 12, 5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """12 coloured digits, 72x64 (not square: the crop matters), in 3 class folders, plus a VAE."""
  root = tmp_path_factory.mktemp("gen")
  digits = np.load(os.path.join(REPO, "decay_jax", "data", "embedded", "mnist_10k.npz"))
  rng = np.random.default_rng(0)
  for i in range(NUM_IMAGES):
    g = np.asarray(Image.fromarray(digits["x_train"][i, :, :, 0]).resize((72, 64),
                                                                          Image.BILINEAR))
    rgb = (g[..., None] * rng.uniform(0.3, 1.0, 3) + rng.uniform(0, 40, 3)).astype(np.uint8)
    d = root / "images" / f"class_{i % 3}"
    d.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb).save(d / f"{i:03d}.png")
  assert ce_cli.main(["random-vae", "--out", str(root / "vae"), "--channels", "8,16,16,16",
                  "--groups", "4", "--layers", "1"]) == 0
  return root


def extract(folder, out, *extra):
  return ex.main([f"--images={folder / 'images'}", f"--vae={folder / 'vae'}", f"--out={out}",
                  "--image_size=64", f"--shard_size={SHARD}", "--batch_size=4", *extra])


def test_center_crop_is_adm():
  im = Image.fromarray(np.random.default_rng(1).integers(0, 255, (100, 150, 3), np.uint8))
  # short side 100 >= 2 * 32: one BOX halving to 75x50, BICUBIC to 48x32, crop columns 8..40
  want = np.asarray(im.resize((75, 50), Image.BOX).resize((48, 32), Image.BICUBIC))[:, 8:40]
  np.testing.assert_array_equal(augment.center_crop_arr(im, 32), want)
  assert augment.center_crop_arr(im, 64).shape == (64, 64, 3)
  # data.eval_resize='adm' is the same crop of a uint8 array (what a reference from a dataset
  # split gets: decay_jax.cli.fid --samples=dataset:NAME), grey images per plane.
  np.testing.assert_array_equal(augment.eval_resize_one(np.asarray(im), 32, "adm"), want)
  grey = np.asarray(im)[..., :1]
  np.testing.assert_array_equal(augment.eval_resize_one(grey, 32, "adm")[..., 0],
                                augment.center_crop_arr(Image.fromarray(grey[..., 0]), 32))


def test_extraction_round_trip_and_resume(folder, tmp_path, capsys):
  out = tmp_path / "latents"
  assert extract(folder, out) == 0
  files, labels, classes = ex.list_labelled_images(str(folder / "images"))
  assert classes == ["class_0", "class_1", "class_2"] and len(files) == NUM_IMAGES
  shards = sorted(os.listdir(out))
  assert shards == ["meta.json"] + [f"train_{k}_{i:05d}.npy" for k in ("labels", "latents")
                                    for i in range(3)]
  z = np.concatenate([np.load(out / f"train_latents_{i:05d}.npy") for i in range(3)])
  y = np.concatenate([np.load(out / f"train_labels_{i:05d}.npy") for i in range(3)])
  assert z.shape == (NUM_IMAGES, 2, 8, 8, 4) and z.dtype == np.float16
  np.testing.assert_array_equal(y, labels)
  meta = json.loads((out / "meta.json").read_text())
  assert meta["scale"] == 0.18215 and meta["latent_shape"] == [2, 8, 8, 4]

  # The stored latent is the sampled, scaled latent of the ADM crop (and of its flip), with noise
  # seeded by (seed, image index, version).
  vae, params = checkpoint.load_params(str(folder / "vae"))
  for i in (0, 11):
    img = ex.load_cropped(files[i], 64)
    for v, x in enumerate((img, img[:, ::-1])):
      noise = jax.random.normal(jax.random.fold_in(jax.random.fold_in(jax.random.key(0), i), v),
                                (8, 8, 4))
      want = vae.apply({"params": params}, jnp.asarray(x[None], jnp.float32) / 127.5 - 1.0,
                       noise[None], method=vae.sample_latent)[0]
      np.testing.assert_allclose(z[i, v].astype(np.float32), np.asarray(want),
                                 atol=2e-3 * float(jnp.abs(want).max()), rtol=0)
  assert not np.allclose(z[:, 0], z[:, 1])

  # The trainer reads the shards as they are.
  c = pipeline.default_data_config()
  c.dataset, c.image_size, c.eval_split = f"latents:{out}", 8, "train"
  assert pipeline.dataset_info(c) == {"num_train": NUM_IMAGES, "num_classes": 3, "channels": 4,
                                      "image_size": 8}

  # Resume: a missing shard is redone, bit for bit; finished ones are skipped.
  os.remove(out / "train_latents_00001.npy")
  capsys.readouterr()
  assert extract(folder, out) == 0
  assert "3 shards, 2 already done" in capsys.readouterr().out
  np.testing.assert_array_equal(np.load(out / "train_latents_00001.npy"), z[SHARD:2 * SHARD])
  assert extract(folder, out, "--seed=1") == 2
  assert "holds latents made with other settings (seed: 0 != 1)" in capsys.readouterr().err


def test_pipeline_extract_train_sample_fid(folder, tmp_path):
  """Latents with REPA's targets stored beside them (a tiny MAE as the encoder: 4x4 tokens of the
  64 px crop, as the SiT's 4x4 latent tokens), a REPA SiT trained on them, sampled, scored."""
  from decay_jax.data import latents as latents_lib
  from decay_jax.models import mae as mae_lib
  from decay_jax.train import repa as repa_lib
  latents, work = tmp_path / "latents", tmp_path / "run"
  enc = mae_lib.MaskedAutoencoder(img_size=64, patch_size=16, in_chans=3, dim=8, depth=2,
                                  num_heads=1, decoder_dim=8, decoder_depth=1, decoder_num_heads=1)
  enc_params = enc.init({"params": jax.random.key(4), "masking": jax.random.key(5)},
                        jnp.zeros((1, 64, 64, 3)))["params"]
  checkpoint.save_params(str(tmp_path / "enc"), enc_params, enc)
  assert extract(folder, latents, f"--repa_encoder={tmp_path / 'enc'}") == 0
  targets = np.concatenate([np.load(latents / f"train_repa_target_0_{i:05d}.npy")
                            for i in range(3)])
  assert targets.shape == (NUM_IMAGES, 2, 16, 8) and targets.dtype == np.float16
  files, _, _ = ex.list_labelled_images(str(folder / "images"))
  img = ex.load_cropped(files[5], 64)
  want = repa_lib.encoder_for(enc).tokens(enc_params, np.stack([img, img[:, ::-1]]))
  np.testing.assert_allclose(targets[5].astype(np.float32), np.asarray(want), rtol=2e-3,
                             atol=2e-3)
  # The source gives each drawn latent the targets of its own version (original or flip).
  records = latents_lib.LatentRecords(str(latents), "train")
  example = latents_lib.LatentTrainExample(records, SimpleNamespace(position=lambda j: j), 0,
                                           True, lambda p: p)
  for j in range(4):
    got = example(j)
    z = np.load(latents / "train_latents_00000.npy")[j].astype(np.float32)
    version = int(np.argmin([np.abs(z[v] - got["image"]).max() for v in (0, 1)]))
    np.testing.assert_array_equal(got["repa_target_0"], targets[j, version].astype(np.float32))
  c = override(load_config("sit_cpu_latents"), **{
      "data.dataset": f"latents:{latents}", "model.preset": "micro/2", "batch_size": 8,
      "num_train_steps": 3, "log_every_steps": 1, "picture_every_steps": 0,
      "checkpoint.every_steps": 100, "checkpoint.async_save": False, "mesh.data": 1,
      "model.repa_depth": 2, "model.repa_dims": (8,), "model.repa_hidden": 16})
  res = trainer.train_and_evaluate(c, str(work), evaluators=registry.build)
  assert res["step"] == 3 and np.isfinite(res["loss"]) and -1 <= res["loss_proj"] <= 1

  p = subprocess.run([sys.executable, "-m", "decay_jax.cli.sample", f"--workdir={work}", "--num=6",
                      "--batch_size=4", "--steps=3", "--method=euler", f"--vae={folder / 'vae'}",
                      f"--out={tmp_path / 'samples'}"], cwd=REPO, capture_output=True, text=True,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  samples = np.load(tmp_path / "samples" / "samples.npz")["arr_0"]
  z = np.load(tmp_path / "samples" / "latents.npz")["latents"]
  assert samples.shape == (6, 64, 64, 3) and samples.dtype == np.uint8 and z.shape == (6, 8, 8, 4)
  vae, params = checkpoint.load_params(str(folder / "vae"))
  decoded = vae.apply({"params": params}, jnp.asarray(z[:2]) / vae.scaling_factor,
                      method=vae.decode)
  assert np.abs(gen.to_uint8_official(decoded).astype(int) - samples[:2]).max() <= 1

  tmodel = ref.randomize_inception_(ref.FIDInception(), seed=1)
  torch.save(tmodel.state_dict(), tmp_path / "pt_inception.pth")
  assert ce_cli.main(["inception", "--checkpoint", str(tmp_path / "pt_inception.pth"),
                  "--out", str(tmp_path / "inception")]) == 0
  ref_stats, result = tmp_path / "ref.npz", tmp_path / "fid.json"
  common = [f"--inception={tmp_path / 'inception'}", "--batch_size=8"]
  assert fid.main([f"--samples={folder / 'images'}", f"--save_stats={ref_stats}", *common]) == 0
  assert fid.main([f"--samples={tmp_path / 'samples' / 'samples.npz'}", f"--ref={ref_stats}",
                   f"--out={result}", *common]) == 0
  r = json.loads(result.read_text())
  assert r["num_samples"] == 6 and np.isfinite(r["fid"]) and r["fid"] > 0
  assert r["inception_score"] >= 1.0
