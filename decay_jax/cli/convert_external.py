"""Convert external networks to Flax: the SD VAE, FID Inception and DINOv2 (REPA's encoder).

``decay_jax.io.convert_external`` and ``convert_dinov2`` hold the conversion; nothing is downloaded.

    python -m decay_jax.cli.convert_external vae --checkpoint diffusion_pytorch_model.safetensors \
        --config config.json --out /data/sd_vae_ft_ema
    python -m decay_jax.cli.convert_external inception \
        --checkpoint pt_inception-2015-12-05-6726825d.pth --out /data/fid_inception
    python -m decay_jax.cli.convert_external dinov2 --checkpoint dinov2_vitb14_pretrain.pth \
        --out /data/dinov2_vitb14
    python -m decay_jax.cli.convert_external random-vae --out /tmp/vae --channels 32,64,64,64 --groups 8

``vae``: diffusers ``AutoencoderKL`` weights and, optionally, its ``config.json`` (for
``norm_num_groups`` and ``scaling_factor``; defaults 32 and 0.18215); ``inception``: pytorch-fid's
``pt_inception-2015-12-05-6726825d.pth``; ``dinov2``: the hub's ``dinov2_vit*14*_pretrain.pth`` or
timm's ``vit_*_patch14_dinov2`` weights (sizes read off the tensors; ``--pos-interpolation``
docs/dinov2.md); ``random-vae`` / ``random-inception``: random weights of
the same layouts, for trying the pipeline (the numbers they produce mean nothing). Output: an orbax
params directory plus ``model.json``. Every bad input is one line naming the argument, exit
status 2.
"""

from __future__ import annotations

import json
import sys
from typing import Optional, Sequence

from decay_jax import logs, validate
from decay_jax.io import convert_dinov2
from decay_jax.io import convert_external as ext
from decay_jax.io.inputs import OUT_DIR, bad_input, check_out_dir, error_detail, input_file
from decay_jax.io.rules import ConversionError, Report
from decay_jax.models import inception as inception_lib
from decay_jax.models import vae as vae_lib
from decay_jax.train import checkpoint
from decay_jax.validate import InputError

EXPECTED = {
    "vae": "diffusers AutoencoderKL weights (diffusion_pytorch_model.safetensors or .bin)",
    "inception": "pytorch-fid's FID Inception weights (pt_inception-2015-12-05-6726825d.pth)",
    "dinov2": ("DINOv2 weights (the hub's dinov2_vitb14_pretrain.pth or timm's "
               "vit_base_patch14_dinov2 .safetensors)"),
}
CONFIG_EXPECTED = ("diffusers' config.json of the VAE (a JSON object with norm_num_groups, "
                   "scaling_factor)")


def _vae_overrides(config_path: Optional[str], groups: Optional[int], scale: Optional[float]):
  """``norm_num_groups`` and ``scaling_factor`` from the flags, else ``config.json``, else SD's."""
  cfg = {}
  if config_path:
    p = input_file(config_path, "--config", CONFIG_EXPECTED)
    try:
      cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
      raise bad_input("--config", config_path, f"is not JSON ({error_detail(e)})",
                      CONFIG_EXPECTED) from None
    except Exception as e:  # pylint: disable=broad-except  (not text, unreadable)
      detail = error_detail(e)
      raise bad_input("--config", config_path, f"cannot be read ({detail})",
                      CONFIG_EXPECTED) from None
    if not isinstance(cfg, dict):
      raise bad_input("--config", config_path, f"holds a JSON {type(cfg).__name__}, not an "
                      "object", CONFIG_EXPECTED)
  out = {}
  for key, flag, value, cast, default in (("norm_num_groups", "--groups", groups, int, 32),
                                          ("scaling_factor", "--scale", scale, float, 0.18215)):
    if value is not None:
      out[key] = value
      continue
    try:
      out[key] = cast(cfg.get(key, default))
    except (TypeError, ValueError):
      kind = "an integer" if cast is int else "a number"
      raise bad_input("--config", config_path, f"its {key}={cfg[key]!r} is not {kind} "
                      f"(or pass {flag})", CONFIG_EXPECTED) from None
  return out


def _read_model(a):
  """``(model, params, report)`` of the kind on the command line."""
  if a.kind in ("vae", "inception", "dinov2"):
    expected = EXPECTED[a.kind]
    if not a.checkpoint:
      raise bad_input("--checkpoint", None, f"{a.kind} needs the weights file", expected)
    overrides = _vae_overrides(a.config, a.groups, a.scale) if a.kind == "vae" else None
    sd = ext.load_state_dict(a.checkpoint, "--checkpoint", expected)
    try:
      if a.kind == "vae":
        sd = ext.modernise_vae_keys(sd)
        model = vae_lib.AutoencoderKL(**ext.infer_vae_fields(sd), **overrides)
        params, report = ext.vae_from_torch(sd, model)
      elif a.kind == "dinov2":
        model, params, report = convert_dinov2.dinov2_from_state_dict(
            sd, pos_interpolation=a.pos_interpolation)
      else:
        model = inception_lib.FIDInceptionV3()
        params, report = ext.inception_from_torch(sd, model)
    except (ConversionError, KeyError, TypeError, IndexError, AttributeError) as e:
      detail = (str(e) if isinstance(e, ConversionError)
                else f"its tensors cannot be read ({error_detail(e)})")
      raise bad_input("--checkpoint", a.checkpoint, detail, expected) from None
    except ValueError as e:  # the model refuses fields read off the file or the config
      raise bad_input("--checkpoint", a.checkpoint, f"its tensors and settings do not make "
                      f"a valid model ({e})", expected) from None
    return model, params, report
  if a.kind == "random-vae":
    try:
      channels = [int(c) for c in a.channels.split(",")]
    except ValueError:
      raise bad_input("--channels", a.channels, "is not a list of integers",
                      "block widths like 128,256,512,512") from None
    try:
      model, params = ext.random_vae(channels, a.groups or 32, a.layers, seed=a.seed,
                                 scale=a.scale or 0.18215)
    except ValueError as e:  # the model's own check names the field it refuses
      arg, value = ("--groups", a.groups) if "norm_num_groups" in str(e) else ("--channels",
                                                                                a.channels)
      raise bad_input(arg, value, str(e)) from None
    return model, params, Report()
  model, params = ext.random_inception(a.seed)
  return model, params, Report()


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command line; returns the exit status (2: bad input, one line on stderr)."""
  p = validate.ArgumentParser(prog="python -m decay_jax.cli.convert_external",
                              description=__doc__.split("\n")[0])
  p.add_argument("kind", choices=("vae", "inception", "dinov2", "random-vae", "random-inception"))
  p.add_argument("--checkpoint", help="vae: diffusers .safetensors/.bin; inception, dinov2: the "
                 ".pth (dinov2: or timm's .safetensors)")
  p.add_argument("--out", required=True, help="directory for the Flax params (orbax) + model.json")
  p.add_argument("--config", help="vae: diffusers config.json (norm_num_groups, scaling_factor)")
  p.add_argument("--groups", type=int, default=None, help="vae: GroupNorm groups (default 32)")
  p.add_argument("--scale", type=float, default=None, help="vae: latent scale (default 0.18215)")
  p.add_argument("--pos-interpolation", default="timm", choices=("timm", "dinov2"),
                 help="dinov2: resampling of the position table (timm's, as REPA; or the hub's)")
  p.add_argument("--channels", default="128,256,512,512", help="random-vae: block widths")
  p.add_argument("--layers", type=int, default=2, help="random-vae: resnets per level")
  p.add_argument("--seed", type=int, default=0, help="random-*: init seed")
  a = p.parse_args(argv)
  try:
    check_out_dir(a.out)
    model, params, report = _read_model(a)
    print(report.summary() if report.loaded else f"random weights (seed {a.seed}): for pipeline "
          "tests only; metrics and latents made with them mean nothing")
    try:
      checkpoint.save_params(a.out, params, model)
    except Exception as e:  # pylint: disable=broad-except  (file systems and object stores)
      raise bad_input("--out", a.out, f"cannot be written ({error_detail(e)})",
                      OUT_DIR) from None
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {a.out} ({type(model).__name__})")
  return 0


def run():
  logs.run_command(main)


if __name__ == "__main__":
  run()
