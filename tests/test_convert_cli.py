"""Converter command line, both directions: official .pth files -> Flax, Flax (a training run or a
params directory) -> official .pth files that the PyTorch reference loads strictly and that compute
the same outputs, the upstream-MAE encoder initialisation, and the converters' answer to bad input
(one line naming the argument, exit status 2, no traceback, a pickle holding code never run).

Most cases call ``main(argv)`` in this process (fast); two start ``python -m decay_jax.cli.convert``
as a user would. The converted models are the 'micro' ones: one small compilation per model.
"""

import argparse
import os
import pickle
import re
import shutil
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util

import torch_reference as ref
from decay_jax import paths, validate
from decay_jax.cli import convert
from decay_jax.cli import convert_external as ce_cli
from decay_jax.io import official, rules, torch_files
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib
from decay_jax.models.residual import Residual
from decay_jax.train import checkpoint
from parity import nhwc
from test_object_store import BUCKET, gcs  # noqa: F401  (the emulator fixture)
from testing_configs import load_config, override

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATOL = 1e-5  # float32 forward outputs, absolute (values are O(1))
MAE_KW = dict(img_size=16, patch_size=4, in_chans=3, embed_dim=32, depth=4, num_heads=2,
              decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2, norm_pix_loss=True,
              min_decay=0.7)
SIT_KW = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=4, num_heads=2,
              num_classes=10, min_sigma=0.8)
MARKER = "PWNED_BY_CONVERTER_TEST"


class _Evil:
  """Unpickling this calls os.system: what a malicious checkpoint does."""

  def __reduce__(self):
    return (os.system, (f"echo pwned > {MARKER}",))


def cli(*args, module="decay_jax.cli.convert"):
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                        timeout=180)


def random_params(model, init_args, seed):
  """Non-zero weights for every leaf (the official inits zero whole layers, which would make a
  comparison of outputs vacuous): normal x 0.1, LayerNorm scales around 1."""
  rng = np.random.default_rng(seed)
  flat = rules.abstract_params(model, *init_args)
  out = {p: rng.standard_normal(s.shape).astype(np.float32) * 0.1 + (p[-1] == "scale")
         for p, s in flat.items()}
  return traverse_util.unflatten_dict(out)


def write_run(workdir, config, states):
  """A training workdir as decay_jax.cli.train leaves it: config.json and orbax checkpoints."""
  paths.write_text(paths.join(workdir, "config.json"), config.to_json_best_effort(indent=1))
  ckpts = checkpoint.RunCheckpoints(workdir, async_save=False)
  for step, state in states.items():
    ckpts.save(step, dict(state, step=np.int32(step)), {"step": step})
  ckpts.close()


# ------------------------------------------------------------------------------------------------
# Fixtures: one MAE run, one SiT run, one SiT params directory (random weights, no training)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mae_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("mae_run")
  config = override(load_config("mae_cpu_mnist"), **{"model.preset": "micro/4",
                                                      "data.image_size": 16,
                                                      "model.alpha_min": 0.7})
  model = mae_lib.mae("micro/4", img_size=16, in_chans=1, residual=Residual(alpha_min=0.7),
                      norm_pix_loss=config.model.norm_pix_loss)
  init = official.mae_init_args(model)
  params = {2: random_params(model, init, 1), 5: random_params(model, init, 2)}
  write_run(str(root / "run"), config, {s: {"params": p} for s, p in params.items()})
  return dict(workdir=str(root / "run"), model=model, params=params, root=root)


@pytest.fixture(scope="module")
def sit_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("sit_run")
  config = override(load_config("sit_cpu_mnist"), **{"model.preset": "micro/2",
                                                      "data.image_size": 8,
                                                      "model.alpha_min": 0.8})
  model = sit_lib.sit("micro/2", input_size=8, in_channels=4, num_classes=10,
                      residual=Residual(alpha_min=0.8))
  init = sit_lib.init_args(model)
  params, ema = random_params(model, init, 3), random_params(model, init, 4)
  write_run(str(root / "run"), config, {4: {"params": params, "ema": ema}})
  return dict(workdir=str(root / "run"), model=model, params=params, ema=ema, root=root)


@pytest.fixture(scope="module")
def sit_params_dir(sit_run):
  directory = str(sit_run["root"] / "params")
  checkpoint.save_params(directory, sit_run["params"], sit_run["model"])
  return directory


def read_pth(path):
  """What the official loaders do: a plain ``torch.load`` (tensors only by default since 2.6)."""
  return torch.load(path, map_location="cpu")


# ------------------------------------------------------------------------------------------------
# to-torch: the written files load strictly into the reference and compute what Flax computes
# ------------------------------------------------------------------------------------------------


def test_mae_run_to_torch_matches_the_reference(mae_run, tmp_path):
  out = tmp_path / "mae.pth"
  assert convert.main(["to-torch", "--params", mae_run["workdir"], "--out", str(out)]) == 0
  ckpt = read_pth(out)
  assert set(ckpt) == {"model", "args"}
  args = ckpt["args"]
  assert args["min_decay"] == 0.7 and args["model"] == "custom" and args["num_heads"] == 2
  f, params = mae_run["model"], mae_run["params"][5]  # the newest step
  t = ref.MaskedAutoencoderViT(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=4,
                               num_heads=2, decoder_embed_dim=16, decoder_depth=3,
                               decoder_num_heads=2, norm_pix_loss=args["norm_pix_loss"],
                               min_decay=args["min_decay"]).eval()
  t.load_state_dict(ckpt["model"], strict=True)
  assert list(ckpt["model"]) == list(t.state_dict())  # the official key order
  rng = np.random.default_rng(0)
  imgs = rng.standard_normal((2, 1, 16, 16)).astype(np.float32)
  noise = rng.random((2, f.num_patches)).astype(np.float32)
  with torch.no_grad():
    loss, pred, _, latent = t(torch.from_numpy(imgs), 0.75, torch.from_numpy(noise))
    feat = t.forward_feat(torch.from_numpy(imgs))
  out_f, feats = jax.jit(lambda p, x, n: (f.apply({"params": p}, x, n),
                                          f.apply({"params": p}, x, method=f.features)))(
      params, nhwc(imgs), jnp.asarray(noise))
  assert float(jnp.abs(out_f["pred"]).max()) > 0.1  # random weights: not a vacuous comparison
  np.testing.assert_allclose(np.asarray(out_f["pred"]), pred.numpy(), atol=ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(out_f["latent"]), latent.numpy(), atol=ATOL, rtol=0)
  np.testing.assert_allclose(float(out_f["loss"]), float(loss), atol=ATOL, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(feats[-1]), feat.numpy(), atol=ATOL, rtol=0)

  # ... and from-torch of the written file gives back the same weights and architecture.
  assert convert.main(["mae", "--checkpoint", str(out), "--out", str(tmp_path / "back")]) == 0
  model, back = checkpoint.load_params(str(tmp_path / "back"))
  assert model.num_heads == f.num_heads and model.decoder_num_heads == f.decoder_num_heads
  assert (model.alpha_min, model.norm_pix_loss, model.in_chans) == (0.7, f.norm_pix_loss, 1)
  chex.assert_trees_all_equal(jax.device_get(back), params)


def test_mae_run_older_step(mae_run, tmp_path):
  out = tmp_path / "step2.pth"
  assert convert.main(["to-torch", "--params", mae_run["workdir"], "--step", "2",
                       "--out", str(out)]) == 0
  np.testing.assert_array_equal(read_pth(out)["model"]["decoder_pred.weight"].numpy(),
                                mae_run["params"][2]["decoder_pred"]["kernel"].T)


def test_sit_run_to_torch_matches_the_reference(sit_run, tmp_path):
  out = tmp_path / "0000004.pt"
  assert convert.main(["to-torch", "--params", sit_run["workdir"], "--out", str(out)]) == 0
  ckpt = read_pth(out)
  assert set(ckpt) == {"model", "ema", "args"}
  assert ckpt["args"]["min_sigma"] == 0.8 and ckpt["args"]["image_size"] == 64
  f = sit_run["model"]
  t = ref.SiT(**SIT_KW).eval()
  t.load_state_dict(ckpt["ema"], strict=True)  # what the official sampler (find_model) takes
  np.testing.assert_array_equal(ckpt["model"]["final_layer.linear.weight"].numpy(),
                                sit_run["params"]["final_linear"]["kernel"].T)
  rng = np.random.default_rng(1)
  x = rng.standard_normal((3, 4, 8, 8)).astype(np.float32)
  tt = rng.random(3).astype(np.float32)
  y = np.array([0, 7, 10])  # 10: the null (CFG) class
  with torch.no_grad():
    want = t(torch.from_numpy(x), torch.from_numpy(tt), torch.from_numpy(y)).numpy()
  got = jax.jit(lambda p, x, t, y: f.apply({"params": p}, x, t, y))(
      sit_run["ema"], nhwc(x), jnp.asarray(tt), jnp.asarray(y))
  assert np.abs(want).max() > 0.1
  np.testing.assert_allclose(np.asarray(got), want.transpose(0, 2, 3, 1), atol=ATOL, rtol=0)

  # from-torch of the written file: the EMA by default, the params with --weights model.
  for weights, tree in (("ema", sit_run["ema"]), ("model", sit_run["params"])):
    back_dir = str(tmp_path / weights)
    assert convert.main(["sit", "--checkpoint", str(out), "--out", back_dir,
                         "--weights", weights]) == 0
    model, back = checkpoint.load_params(back_dir)
    assert model.num_heads == 2 and model.alpha_min == 0.8 and model.num_classes == 10
    chex.assert_trees_all_equal(jax.device_get(back), tree)


def test_sit_params_dir_to_torch(sit_run, sit_params_dir, tmp_path, capsys):
  out = tmp_path / "sit.pth"
  assert convert.main(["to-torch", "--params", sit_params_dir, "--out", str(out)]) == 0
  assert "no EMA weights, so ema = model" in capsys.readouterr().out
  ckpt = read_pth(out)
  t = ref.SiT(**SIT_KW)
  t.load_state_dict(ckpt["model"], strict=True)
  for k, v in ckpt["model"].items():
    np.testing.assert_array_equal(ckpt["ema"][k].numpy(), v.numpy(), err_msg=k)


def test_console_module_end_to_end(mae_run, tmp_path):
  """``python -m decay_jax.cli.convert to-torch`` as a user runs it (the console script's run())."""
  out = tmp_path / "sub" / "checkpoint-5.pth"  # the parent is created
  p = cli("to-torch", "--params", mae_run["workdir"], "--out", str(out))
  assert p.returncode == 0, p.stderr
  assert f"training workdir {mae_run['workdir']}, step 5" in p.stdout
  assert "wrote" in p.stdout and "Traceback" not in p.stderr
  sd = read_pth(out)["model"]
  assert len(sd) == len(ref.MaskedAutoencoderViT(**dict(MAE_KW, in_chans=1, decoder_depth=3))
                        .state_dict())


def test_gcs_paths_both_ways(gcs, mae_run, bad):
  """``gs://`` in and out (etils.epath and orbax against the emulator of test_object_store)."""
  pth, flax_dir = f"gs://{BUCKET}/convert/mae.pth", f"gs://{BUCKET}/convert/flax"
  assert convert.main(["to-torch", "--params", mae_run["workdir"], "--out", pth]) == 0
  assert convert.main(["mae", "--checkpoint", pth, "--out", flax_dir]) == 0
  model, back = checkpoint.load_params(flax_dir)
  assert model.num_heads == 2
  chex.assert_trees_all_equal(jax.device_get(back), mae_run["params"][5])
  evil = f"gs://{BUCKET}/convert/evil.pth"
  paths.write_bytes(evil, open(bad["evil_pth"], "rb").read())
  with pytest.raises(validate.InputError, match=re.escape(f"--checkpoint {evil}: {NOT_LOADED}")):
    torch_files.read_torch_file(evil)
  with pytest.raises(validate.InputError, match="no such file"):
    torch_files.read_torch_file(f"gs://{BUCKET}/convert/nope.pth")


# ------------------------------------------------------------------------------------------------
# from-torch (official files in)
# ------------------------------------------------------------------------------------------------


def test_mae_checkpoint_file_round_trip(tmp_path, capsys):
  t = ref.randomize_(ref.MaskedAutoencoderViT(**MAE_KW), seed=0, scale=0.1)
  args = argparse.Namespace(min_decay=0.7, norm_pix_loss=True, model="custom")
  path = tmp_path / "checkpoint-799.pth"
  torch.save({"model": t.state_dict(), "optimizer": {}, "epoch": 799, "args": args}, path)
  assert convert.main(["mae", "--checkpoint", str(path), "--out", str(tmp_path / "flax")]) == 0
  stdout = capsys.readouterr().out
  assert "loaded" in stdout and "pos_embed: fixed sin-cos table" in stdout
  model, params = checkpoint.load_params(str(tmp_path / "flax"))
  assert isinstance(model, mae_lib.MaskedAutoencoder) and model.alpha_min == 0.7
  assert (model.dim, model.depth, model.decoder_depth, model.img_size) == (32, 4, 2, 16)
  back = official.mae_to_torch(params, model)
  for k, v in t.state_dict().items():
    if "pos_embed" not in k:
      np.testing.assert_array_equal(back[k], v.numpy(), err_msg=k)


def test_sit_checkpoint_file_takes_ema_weights(tmp_path):
  model_sd = ref.randomize_(ref.SiT(**SIT_KW), seed=1).state_dict()
  ema_sd = ref.randomize_(ref.SiT(**SIT_KW), seed=2).state_dict()
  path = tmp_path / "0400000.pt"
  torch.save({"model": model_sd, "ema": ema_sd, "opt": {},
              "args": argparse.Namespace(min_sigma=0.8)}, path)
  assert convert.main(["sit", "--checkpoint", str(path), "--out", str(tmp_path / "ema")]) == 0
  model, params = checkpoint.load_params(str(tmp_path / "ema"))
  np.testing.assert_array_equal(np.asarray(params["final_linear"]["kernel"]).T,
                                ema_sd["final_layer.linear.weight"].numpy())
  assert model.alpha_min == 0.8 and model.num_classes == 10 and model.learn_sigma


def test_upstream_encoder_initialisation():
  """Upstream mae_pretrain_vit_*.pth: cls, patch_embed, blocks and a final norm (no decoder)."""
  t = ref.randomize_(ref.MaskedAutoencoderViT(**MAE_KW), seed=3, scale=0.1)
  sd = {k: v for k, v in t.state_dict().items()
        if k.startswith(("cls_token", "pos_embed", "patch_embed", "blocks."))}
  sd["norm.weight"], sd["norm.bias"] = torch.ones(32), torch.zeros(32)
  model = mae_lib.MaskedAutoencoder(img_size=16, patch_size=4, dim=32, depth=4, num_heads=2,
                                    decoder_dim=16, decoder_depth=2, decoder_num_heads=2,
                                    residual=Residual(alpha_min=0.6))
  init = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), jnp.zeros((1, 16)))
  params, report = official.mae_from_upstream_encoder(sd, model, init["params"])
  assert set(report.ignored) == {"norm.weight", "norm.bias", "pos_embed"}
  assert len(report.loaded) == len(sd) - 3
  assert "decoder_pred/kernel" in report.left_at_init and "skip_0/mask_token" in report.left_at_init
  assert not any(p.startswith("blocks/") for p in report.left_at_init)
  np.testing.assert_array_equal(np.asarray(params["blocks"]["attn"]["qkv"]["kernel"][2]).T,
                                sd["blocks.2.attn.qkv.weight"].numpy())
  chex.assert_trees_all_equal(params["decoder_blocks_0"], init["params"]["decoder_blocks_0"])
  with pytest.raises(rules.ConversionError, match="unknown key.*head.weight"):
    official.mae_from_upstream_encoder(dict(sd, **{"head.weight": torch.zeros(3, 3)}), model,
                                       init["params"])


# ------------------------------------------------------------------------------------------------
# Bad input: one line naming the argument, exit status 2, no traceback, no pickle ever run
# ------------------------------------------------------------------------------------------------


def _garble(directory, pattern):
  for path in sorted(directory.glob(pattern)):
    if path.is_file():
      path.write_bytes(b"\x00 not a checkpoint \x00" * 4)


@pytest.fixture(scope="module")
def bad(tmp_path_factory, mae_run, sit_params_dir):
  """Broken and foreign inputs of every kind, by name (placeholders of the CASES table)."""
  root = tmp_path_factory.mktemp("bad")
  good = ref.MaskedAutoencoderViT(**MAE_KW).state_dict()
  torch.save({"model": good, "args": argparse.Namespace(min_decay=0.7)}, root / "mae.pth")
  torch.save({"model": good}, root / "no_args.pth")
  data = (root / "mae.pth").read_bytes()
  (root / "truncated.pth").write_bytes(data[: len(data) // 2])
  (root / "random.pth").write_bytes(np.random.default_rng(0).bytes(4096))
  (root / "empty.pth").write_bytes(b"")
  torch.save({"model": {"w": torch.zeros(2)}, "x": _Evil()}, root / "evil.pth")  # torch's zip
  with open(root / "evil_raw.pth", "wb") as f:
    pickle.dump(_Evil(), f, protocol=2)  # a bare pickle, as legacy .pth/.bin files are
  from safetensors.numpy import save_file
  save_file({"w": np.zeros(3, np.float32)}, str(root / "weights.safetensors"))
  shutil.copy(root / "weights.safetensors", root / "safetensors.pth")
  st = (root / "weights.safetensors").read_bytes()
  (root / "truncated.safetensors").write_bytes(st[: len(st) - 6])
  shutil.copy(root / "mae.pth", root / "zip.safetensors")
  torch.save({"model": {"foo.weight": torch.zeros(2)}, "args": {"min_decay": 0.7}},
             root / "foreign_model.pth")
  torch.save({"foo.weight": torch.zeros(2)}, root / "foreign_sd.pth")
  torch.save(torch.zeros(3), root / "tensor.pth")
  (root / "dir.pth").mkdir()
  (root / "bad.json").write_text("{not json")
  (root / "list.json").write_text("[32]")
  (root / "groups.json").write_text('{"norm_num_groups": "many"}')
  (root / "empty_dir").mkdir()
  (root / "file").write_text("x")
  out = {k: str(root / k) for k in ("mae.pth", "no_args.pth", "truncated.pth", "random.pth",
                                     "empty.pth", "evil.pth", "evil_raw.pth", "safetensors.pth",
                                     "truncated.safetensors", "zip.safetensors",
                                     "foreign_model.pth", "foreign_sd.pth", "tensor.pth",
                                     "dir.pth", "bad.json", "list.json", "groups.json",
                                     "empty_dir", "file")}
  out = {k.replace(".", "_"): v for k, v in out.items()}
  out["root"], out["run"], out["params"] = str(root), mae_run["workdir"], sit_params_dir
  for name, pattern in (("bad_arrays", "checkpoints/5/state/ocdbt.process_0/d/*"),
                        ("bad_config", "config.json")):
    shutil.copytree(mae_run["workdir"], root / name)
    _garble(root / name, pattern)
    out[name] = str(root / name)
  (root / "no_ckpt").mkdir()
  shutil.copy(os.path.join(mae_run["workdir"], "config.json"), root / "no_ckpt")
  out["no_ckpt"] = str(root / "no_ckpt")
  for name, pattern in (("bad_params", "params/d/*"), ("bad_model_json", "model.json")):
    shutil.copytree(sit_params_dir, root / name)
    _garble(root / name, pattern)
    out[name] = str(root / name)
  routed = sit_lib.sit("micro/2", input_size=8, in_channels=4, num_classes=10,
                       residual_routing="mirror")
  zeros = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), traverse_util.unflatten_dict(
      rules.abstract_params(routed, *sit_lib.init_args(routed))))
  checkpoint.save_params(str(root / "routed"), zeros, routed)
  out["routed"] = str(root / "routed")
  return out


C, E = "decay_jax.cli.convert", "decay_jax.cli.convert_external"
NOT_LOADED = "contains code or objects other than tensors (posix.system); it was not loaded"
# name: (entry point, argv with {placeholders} of `bad`, the argument and value the line names,
# a phrase of the line). The line is `error: ARG VALUE: problem; expected WHAT`.
CASES = {
    "mae/missing": (C, ["mae", "--checkpoint", "{root}/nope.pth"], "--checkpoint {root}/nope.pth",
                    "no such file; expected an official decayed-MAE checkpoint"),
    "mae/directory": (C, ["mae", "--checkpoint", "{dir_pth}"], "--checkpoint {dir_pth}",
                      "is a directory, not a file"),
    "mae/truncated_zip": (C, ["mae", "--checkpoint", "{truncated_pth}"],
                          "--checkpoint {truncated_pth}",
                          "cannot be read; it is a damaged or truncated zip archive"),
    "mae/random_bytes": (C, ["mae", "--checkpoint", "{random_pth}"], "--checkpoint {random_pth}",
                         "cannot be read; it is not a PyTorch checkpoint"),
    "mae/empty": (C, ["mae", "--checkpoint", "{empty_pth}"], "--checkpoint {empty_pth}",
                  "is empty"),
    "mae/malicious_pickle": (C, ["mae", "--checkpoint", "{evil_pth}"], "--checkpoint {evil_pth}",
                             NOT_LOADED),
    "mae/safetensors": (C, ["mae", "--checkpoint", "{safetensors_pth}"],
                        "--checkpoint {safetensors_pth}",
                        "is a safetensors file, not a PyTorch .pth"),
    "mae/foreign_keys": (C, ["mae", "--checkpoint", "{foreign_model_pth}"],
                         "--checkpoint {foreign_model_pth}",
                         "not an official decayed-MAE state_dict: key 'patch_embed.proj.weight' is "
                         "missing"),
    "mae/bare_state_dict": (C, ["mae", "--checkpoint", "{foreign_sd_pth}"],
                            "--checkpoint {foreign_sd_pth}", "has no 'model' entry (it holds "
                            "'foo.weight')"),
    "mae/no_args": (C, ["mae", "--checkpoint", "{no_args_pth}"], "--checkpoint {no_args_pth}",
                    "the checkpoint has no args.min_decay; pass --alpha-min (the official default "
                    "is 1.0; README run 0.7)"),
    "mae/a_tensor": (C, ["mae", "--checkpoint", "{tensor_pth}"], "--checkpoint {tensor_pth}",
                     "holds a Tensor, not a dict of state_dicts"),
    "mae/out_is_a_file": (C, ["mae", "--checkpoint", "{mae_pth}", "--out", "{file}"],
                          "--out {file}", "is a file; expected a directory for the Flax params"),
    "sit/malicious_raw_pickle": (C, ["sit", "--checkpoint", "{evil_raw_pth}"],
                                 "--checkpoint {evil_raw_pth}", NOT_LOADED),
    "sit/truncated_zip": (C, ["sit", "--checkpoint", "{truncated_pth}"],
                          "--checkpoint {truncated_pth}", "damaged or truncated zip archive"),
    "sit/an_mae_file": (C, ["sit", "--checkpoint", "{mae_pth}", "--weights", "model"],
                        "--checkpoint {mae_pth}",
                        "not an official SiT state_dict: key 'x_embedder.proj.weight' is missing"),
    "sit/no_ema": (C, ["sit", "--checkpoint", "{mae_pth}"], "--checkpoint {mae_pth}",
                   "has no 'ema' entry (it holds 'model', 'args'); pass --weights model"),
    "mae-upstream/malicious_pickle": (C, ["mae-upstream", "--checkpoint", "{evil_pth}",
                                          "--alpha-min", "0.6", "--preset", "micro/4"],
                                      "--checkpoint {evil_pth}", NOT_LOADED),
    "mae-upstream/no_alpha_min": (C, ["mae-upstream", "--checkpoint", "{mae_pth}"], "--alpha-min",
                                  "mae-upstream needs it"),
    "to-torch/missing": (C, ["to-torch", "--params", "{root}/nowhere"], "--params {root}/nowhere",
                         "no such directory; expected a training workdir"),
    "to-torch/a_file": (C, ["to-torch", "--params", "{mae_pth}"], "--params {mae_pth}",
                        "is a file, not a directory"),
    "to-torch/empty_dir": (C, ["to-torch", "--params", "{empty_dir}"], "--params {empty_dir}",
                           "has neither model.json nor config.json"),
    "to-torch/corrupt_params": (C, ["to-torch", "--params", "{bad_params}"],
                                "--params {bad_params}", "cannot be read ("),
    "to-torch/corrupt_model_json": (C, ["to-torch", "--params", "{bad_model_json}"],
                                    "--params {bad_model_json}", "cannot be read (JSONDecodeError"),
    "to-torch/corrupt_checkpoint": (C, ["to-torch", "--params", "{bad_arrays}"],
                                    "--params {bad_arrays}", "cannot be read ("),
    "to-torch/corrupt_config_json": (C, ["to-torch", "--params", "{bad_config}"],
                                     "--params {bad_config}", "cannot be read (JSONDecodeError"),
    "to-torch/no_checkpoint": (C, ["to-torch", "--params", "{no_ckpt}"], "--params {no_ckpt}",
                               "is a training workdir with no finished checkpoint"),
    "to-torch/missing_step": (C, ["to-torch", "--params", "{run}", "--step", "3"], "--step 3",
                              "has checkpoints at steps [2, 5]"),
    "to-torch/no_ema": (C, ["to-torch", "--params", "{run}", "--weights", "ema"], "--weights ema",
                        "holds no EMA weights"),
    "to-torch/routing": (C, ["to-torch", "--params", "{routed}"], "--params {routed}",
                         "SiT with residual_routing='mirror' has no official state_dict layout"),
    "to-torch/out_is_a_directory": (C, ["to-torch", "--params", "{run}", "--out", "{empty_dir}"],
                                    "--out {empty_dir}", "is a directory"),
    "vae/missing": (E, ["vae", "--checkpoint", "{root}/nope.safetensors"],
                    "--checkpoint {root}/nope.safetensors",
                    "no such file; expected diffusers AutoencoderKL weights"),
    "vae/malicious_pickle": (E, ["vae", "--checkpoint", "{evil_pth}"], "--checkpoint {evil_pth}",
                             NOT_LOADED),
    "vae/truncated_safetensors": (E, ["vae", "--checkpoint", "{truncated_safetensors}"],
                                  "--checkpoint {truncated_safetensors}",
                                  "cannot be read; it is a damaged safetensors file"),
    "vae/zip_named_safetensors": (E, ["vae", "--checkpoint", "{zip_safetensors}"],
                                  "--checkpoint {zip_safetensors}", "is not a safetensors file"),
    "vae/foreign_keys": (E, ["vae", "--checkpoint", "{safetensors_pth}"],
                         "--checkpoint {safetensors_pth}",
                         "not a diffusers AutoencoderKL state_dict: key 'encoder.conv_in.weight'"),
    "vae/config_missing": (E, ["vae", "--checkpoint", "{safetensors_pth}", "--config",
                               "{root}/config.json"], "--config {root}/config.json",
                           "no such file; expected diffusers' config.json"),
    "vae/config_not_json": (E, ["vae", "--checkpoint", "{safetensors_pth}", "--config",
                                "{bad_json}"],
                            "--config {bad_json}", "is not JSON (JSONDecodeError"),
    "vae/config_a_list": (E, ["vae", "--checkpoint", "{safetensors_pth}", "--config",
                              "{list_json}"],
                          "--config {list_json}", "holds a JSON list, not an object"),
    "vae/config_bad_value": (E, ["vae", "--checkpoint", "{safetensors_pth}", "--config",
                                 "{groups_json}"], "--config {groups_json}",
                             "its norm_num_groups='many' is not an integer (or pass --groups)"),
    "inception/random_bytes": (E, ["inception", "--checkpoint", "{random_pth}"],
                               "--checkpoint {random_pth}", "not a PyTorch checkpoint"),
    "inception/malicious_raw_pickle": (E, ["inception", "--checkpoint", "{evil_raw_pth}"],
                                       "--checkpoint {evil_raw_pth}", NOT_LOADED),
    "inception/directory": (E, ["inception", "--checkpoint", "{dir_pth}"], "--checkpoint {dir_pth}",
                            "is a directory, not a file; expected pytorch-fid's FID Inception"),
    "inception/foreign_keys": (E, ["inception", "--checkpoint", "{foreign_sd_pth}"],
                               "--checkpoint {foreign_sd_pth}",
                               "unknown key(s) in the state_dict: ['foo.weight']"),
    "inception/a_tensor": (E, ["inception", "--checkpoint", "{tensor_pth}"],
                           "--checkpoint {tensor_pth}", "holds a Tensor, not a state_dict"),
}


def _check_line(case, stderr, named, phrase, cwd):
  lines = [l for l in stderr.splitlines() if l.strip()]
  assert len(lines) == 1, (case, lines)
  line = lines[0]
  assert line.startswith(f"error: {named}: "), (case, line)
  assert phrase in line, (case, line)
  assert "Traceback" not in stderr and "weights_only" not in stderr, (case, stderr)
  assert not os.path.exists(os.path.join(cwd, MARKER)), case  # no pickle was ever run
  assert not os.path.exists(os.path.join(REPO, MARKER)), case


# After a failed orbax read, tensorstore reads still in flight are cancelled in this process (an
# unraisable-exception or never-awaited warning); the command itself ends its process instead
# (run(), checked by test_bad_input_in_a_real_process).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line(bad, case, capfd, monkeypatch):
  module, argv, named, phrase = CASES[case]
  argv = [a.format(**bad) for a in argv]
  if "--out" not in argv:
    argv += ["--out", os.path.join(bad["root"], "out", case.replace("/", "_"))]
  monkeypatch.chdir(bad["root"])  # where `echo pwned > MARKER` would write
  main = convert.main if module == C else ce_cli.main
  assert main(argv) == 2, case
  captured = capfd.readouterr()
  assert captured.out == "", (case, captured.out)  # nothing reported as done
  _check_line(case, captured.err, named.format(**bad), phrase, bad["root"])
  assert not os.path.exists(os.path.join(bad["root"], "out", case.replace("/", "_")))


def test_bad_input_in_a_real_process(bad, tmp_path):
  """As the user sees it: the console module, a corrupt orbax checkpoint (whose reads still in
  flight must not print tracebacks at exit), and a malicious pickle."""
  for args, named in (
      (["to-torch", "--params", bad["bad_arrays"]], f"--params {bad['bad_arrays']}"),
      (["mae", "--checkpoint", bad["evil_pth"]], f"--checkpoint {bad['evil_pth']}")):
    p = cli(*args, "--out", str(tmp_path / "x"))
    assert p.returncode == 2, p.stderr
    _check_line(args[0], p.stderr, named, "", REPO)
    assert p.stdout == ""
