"""Converters for the external networks of the generation pipeline: the SD VAE and FID Inception.

The user supplies the weight files (nothing is downloaded):
  * ``vae``: diffusers ``AutoencoderKL`` weights, e.g. stabilityai/sd-vae-ft-ema's
    ``diffusion_pytorch_model.safetensors`` (or ``.bin``) and, optionally, its ``config.json``
    (for ``norm_num_groups`` and ``scaling_factor``; defaults 32 and 0.18215). The architecture is
    read off the tensors. Old diffusers attention names (``query/key/value/proj_attn``) are accepted.
  * ``inception``: pytorch-fid's ``pt_inception-2015-12-05-6726825d.pth`` (the FID Inception).
  * ``random-vae`` / ``random-inception``: random weights of the same layouts, for trying the
    pipeline without the real files (the numbers they produce mean nothing).

The tables map every Flax leaf to one torch key (same names, ``name_i`` <-> ``name.i``); unknown,
missing and mis-shaped tensors raise ``ConversionError`` naming the key (the engine of
``decay_jax.io.convert``). Output: an orbax params directory plus ``model.json``
(``checkpoint.load_params`` rebuilds the model). Files and ``--config`` are read through
``etils.epath`` (``gs://`` works); torch files with the tensors-only unpickler (a pickle holding
code is refused, never run). Every bad input is one line naming the argument, exit status 2.

    python -m decay_jax.io.convert_external vae --checkpoint diffusion_pytorch_model.safetensors \
        --config config.json --out /data/sd_vae_ft_ema
    python -m decay_jax.io.convert_external inception \
        --checkpoint pt_inception-2015-12-05-6726825d.pth --out /data/fid_inception
    python -m decay_jax.io.convert_external random-vae --out /tmp/vae --channels 32,64,64,64 --groups 8
"""

from __future__ import annotations

import json
import re
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import logs, validate
from decay_jax.io import convert
from decay_jax.io.convert import ConversionError, Report, Rule
from decay_jax.models import inception as inception_lib
from decay_jax.models import vae as vae_lib
from decay_jax.train import checkpoint

_INDEXED = re.compile(r"^(down_blocks|up_blocks|resnets|attentions|downsamplers|upsamplers|"
                      r"to_out)_(\d+)$")
_LEGACY_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}
_BN_LEAVES = {"scale": "weight", "bias": "bias", "mean": "running_mean", "var": "running_var"}


def _rules(targets: Mapping[Tuple[str, ...], jax.ShapeDtypeStruct], module_name) -> List[Rule]:
  """One rule per Flax leaf: ``module_name(part)`` renames path parts, leaves become torch names."""
  rules = []
  for path, leaf in targets.items():
    *mods, name = path
    prefix = ".".join(module_name(m) for m in mods)
    if mods and mods[-1] == "bn":
      rules.append(Rule(f"{prefix}.{_BN_LEAVES[name]}", path))
    elif name == "kernel":
      rules.append(Rule(f"{prefix}.weight", path, None, "conv" if len(leaf.shape) == 4 else "linear"))
    else:
      rules.append(Rule(f"{prefix}.{'weight' if name == 'scale' else name}", path))
  return rules


def _vae_name(part: str) -> str:
  m = _INDEXED.match(part)
  return f"{m.group(1)}.{m.group(2)}" if m else part


def vae_rules(model: vae_lib.AutoencoderKL) -> List[Rule]:
  return _rules(vae_targets(model), _vae_name)


def vae_targets(model: vae_lib.AutoencoderKL):
  f = model.downsample_factor
  return convert.abstract_params(model, jnp.zeros((1, f, f, model.in_channels)))


def inception_targets(model: inception_lib.FIDInceptionV3):
  return convert.abstract_params(model, jnp.zeros((1, 75, 75, 3)))


def inception_rules(model: inception_lib.FIDInceptionV3) -> List[Rule]:
  return _rules(inception_targets(model), lambda part: part)


def _modernise_vae_keys(state_dict: Mapping) -> Dict[str, np.ndarray]:
  """Old diffusers attention names and 1x1-conv attention weights -> today's Linear names."""
  out = {}
  for k, v in state_dict.items():
    parts = k.split(".")
    if len(parts) >= 2 and "attentions" in parts and parts[-2] in _LEGACY_ATTENTION:
      parts[-2] = _LEGACY_ATTENTION[parts[-2]]
      k = ".".join(parts)
    v = convert.as_numpy(v)
    if "attentions" in k and k.endswith(".weight") and v.ndim == 4:
      v = v[:, :, 0, 0]
    out[k] = v
  return out


def infer_vae_fields(state_dict: Mapping) -> dict:
  """Architecture fields of a diffusers AutoencoderKL state_dict (groups/scale are not in it)."""
  sd = state_dict
  try:
    levels = convert._count(sd, "encoder.down_blocks.")
    widths = tuple(int(convert.as_numpy(sd[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"])
                       .shape[0]) for i in range(levels))
    return dict(in_channels=int(convert.as_numpy(sd["encoder.conv_in.weight"]).shape[1]),
                out_channels=int(convert.as_numpy(sd["decoder.conv_out.weight"]).shape[0]),
                block_out_channels=widths,
                layers_per_block=convert._count(sd, "encoder.down_blocks.0.resnets."),
                latent_channels=int(convert.as_numpy(sd["post_quant_conv.weight"]).shape[0]))
  except KeyError as e:
    raise ConversionError(f"not a diffusers AutoencoderKL state_dict: key {e} is missing") from None


def vae_from_torch(state_dict: Mapping, model: vae_lib.AutoencoderKL) -> Tuple[dict, Report]:
  """diffusers ``AutoencoderKL.state_dict()`` -> Flax params of ``model``."""
  sd = _modernise_vae_keys(state_dict)
  return convert.from_torch(sd, vae_rules(model), vae_targets(model))


def vae_to_torch(params: Mapping, model: vae_lib.AutoencoderKL):
  """Flax params -> diffusers state_dict (numpy), loadable with ``load_state_dict(strict=True)``."""
  return convert.to_torch(params, vae_rules(model))


def inception_from_torch(state_dict: Mapping, model: inception_lib.FIDInceptionV3
                         ) -> Tuple[dict, Report]:
  """pytorch-fid FID-Inception state_dict -> Flax params (``num_batches_tracked`` ignored)."""
  ignore = {k: "BatchNorm step counter (unused in eval mode)" for k in state_dict
            if k.endswith("num_batches_tracked")}
  return convert.from_torch(state_dict, inception_rules(model), inception_targets(model), ignore)


def inception_to_torch(params: Mapping, model: inception_lib.FIDInceptionV3):
  return convert.to_torch(params, inception_rules(model))


EXPECTED = {
    "vae": "diffusers AutoencoderKL weights (diffusion_pytorch_model.safetensors or .bin)",
    "inception": "pytorch-fid's FID Inception weights (pt_inception-2015-12-05-6726825d.pth)",
}
CONFIG_EXPECTED = ("diffusers' config.json of the VAE (a JSON object with norm_num_groups, "
                   "scaling_factor)")


def load_state_dict(path: str, arg: str = "--checkpoint",
                    expected: str = "a state_dict (.safetensors, or a torch .pth/.bin/.pt)"
                    ) -> Mapping:
  """A state_dict from a safetensors file or a torch ``.pth/.bin/.pt`` (local or a URI).

  The format is told by the file's first bytes, not its name; a file named ``.safetensors`` must be
  one. Torch files are read as ``convert.read_torch_file`` reads them (tensors only; a pickle that
  holds code is refused). Every failure is one ``convert.InputError`` line naming ``arg``.
  """
  p = convert.input_file(path, arg, expected)
  head = convert.read_head(p, arg, path, expected)
  if convert.is_safetensors(head):
    try:
      from safetensors.numpy import load  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise SystemExit("reading .safetensors needs: pip install safetensors==0.8.0") from None
    try:
      return load(p.read_bytes())
    except Exception as e:  # pylint: disable=broad-except  (SafetensorError and friends)
      raise convert.bad_input(arg, path, f"cannot be read; it is a damaged safetensors file "
                              f"({convert.error_detail(e)})", expected) from None
  if path.endswith(".safetensors"):
    raise convert.bad_input(arg, path, "is not a safetensors file (its header is not one)",
                            expected)
  sd = convert.read_torch_file(path, arg, expected)
  if isinstance(sd, Mapping):
    sd = sd.get("state_dict", sd)
  if not isinstance(sd, Mapping):
    raise convert.bad_input(arg, path, f"holds a {type(sd).__name__}, not a state_dict", expected)
  return sd


def _vae_overrides(config_path: Optional[str], groups: Optional[int], scale: Optional[float]):
  """``norm_num_groups`` and ``scaling_factor`` from the flags, else ``config.json``, else SD's."""
  cfg = {}
  if config_path:
    p = convert.input_file(config_path, "--config", CONFIG_EXPECTED)
    try:
      cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
      raise convert.bad_input("--config", config_path, f"is not JSON ({convert.error_detail(e)})",
                              CONFIG_EXPECTED) from None
    except Exception as e:  # pylint: disable=broad-except  (not text, unreadable)
      detail = convert.error_detail(e)
      raise convert.bad_input("--config", config_path, f"cannot be read ({detail})",
                              CONFIG_EXPECTED) from None
    if not isinstance(cfg, dict):
      raise convert.bad_input("--config", config_path, f"holds a JSON {type(cfg).__name__}, not an "
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
      raise convert.bad_input("--config", config_path, f"its {key}={cfg[key]!r} is not {kind} "
                              f"(or pass {flag})", CONFIG_EXPECTED) from None
  return out


def random_params(targets: Mapping[Tuple[str, ...], jax.ShapeDtypeStruct], seed: int,
                  gain: float) -> dict:
  """Random weights for abstract ``targets``: kernels normal with variance ``gain / fan_in``,
  norm scales and variances 1, biases and means 0 (numpy: no init program to compile)."""
  from flax import traverse_util
  rng = np.random.default_rng(seed)
  out = {}
  for path, leaf in targets.items():
    if path[-1] == "kernel":
      fan_in = int(np.prod(leaf.shape[:-1]))
      out[path] = rng.standard_normal(leaf.shape) * np.sqrt(gain / fan_in)
    elif path[-1] in ("scale", "var"):
      out[path] = np.ones(leaf.shape)
    else:
      out[path] = np.zeros(leaf.shape)
  return traverse_util.unflatten_dict({p: jnp.asarray(v, jnp.float32) for p, v in out.items()})


def random_vae(channels: Sequence[int], groups: int, layers_per_block: int = 2,
               latent_channels: int = 4, seed: int = 0, scale: float = 0.18215):
  """``(model, params)``: a VAE of the sd-vae layout with random weights (for pipeline tests)."""
  model = vae_lib.AutoencoderKL(block_out_channels=tuple(channels), norm_num_groups=groups,
                                layers_per_block=layers_per_block, latent_channels=latent_channels,
                                scaling_factor=scale)
  return model, random_params(vae_targets(model), seed, gain=1.0)


def random_inception(seed: int = 0):
  """``(model, params)``: the FID Inception with He-normal random weights (pipeline tests)."""
  model = inception_lib.FIDInceptionV3()
  return model, random_params(inception_targets(model), seed, gain=2.0)


def _read_model(a):
  """``(model, params, report)`` of the kind on the command line."""
  if a.kind in ("vae", "inception"):
    expected = EXPECTED[a.kind]
    if not a.checkpoint:
      raise convert.bad_input("--checkpoint", None, f"{a.kind} needs the weights file", expected)
    overrides = _vae_overrides(a.config, a.groups, a.scale) if a.kind == "vae" else None
    sd = load_state_dict(a.checkpoint, "--checkpoint", expected)
    try:
      if a.kind == "vae":
        sd = _modernise_vae_keys(sd)
        model = vae_lib.AutoencoderKL(**infer_vae_fields(sd), **overrides)
        params, report = vae_from_torch(sd, model)
      else:
        model = inception_lib.FIDInceptionV3()
        params, report = inception_from_torch(sd, model)
    except (ConversionError, KeyError, TypeError, IndexError, AttributeError) as e:
      detail = (str(e) if isinstance(e, ConversionError)
                else f"its tensors cannot be read ({convert.error_detail(e)})")
      raise convert.bad_input("--checkpoint", a.checkpoint, detail, expected) from None
    except ValueError as e:  # the model refuses fields read off the file or the config
      raise convert.bad_input("--checkpoint", a.checkpoint, f"its tensors and settings do not make "
                              f"a valid model ({e})", expected) from None
    return model, params, report
  if a.kind == "random-vae":
    try:
      channels = [int(c) for c in a.channels.split(",")]
    except ValueError:
      raise convert.bad_input("--channels", a.channels, "is not a list of integers",
                              "block widths like 128,256,512,512") from None
    try:
      model, params = random_vae(channels, a.groups or 32, a.layers, seed=a.seed,
                                 scale=a.scale or 0.18215)
    except ValueError as e:  # the model's own check names the field it refuses
      arg, value = ("--groups", a.groups) if "norm_num_groups" in str(e) else ("--channels",
                                                                                a.channels)
      raise convert.bad_input(arg, value, str(e)) from None
    return model, params, Report()
  model, params = random_inception(a.seed)
  return model, params, Report()


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command line; returns the exit status (2: bad input, one line on stderr)."""
  p = validate.ArgumentParser(prog="python -m decay_jax.io.convert_external",
                              description=__doc__.split("\n")[0])
  p.add_argument("kind", choices=("vae", "inception", "random-vae", "random-inception"))
  p.add_argument("--checkpoint", help="vae: diffusers .safetensors/.bin; inception: the .pth")
  p.add_argument("--out", required=True, help="directory for the Flax params (orbax) + model.json")
  p.add_argument("--config", help="vae: diffusers config.json (norm_num_groups, scaling_factor)")
  p.add_argument("--groups", type=int, default=None, help="vae: GroupNorm groups (default 32)")
  p.add_argument("--scale", type=float, default=None, help="vae: latent scale (default 0.18215)")
  p.add_argument("--channels", default="128,256,512,512", help="random-vae: block widths")
  p.add_argument("--layers", type=int, default=2, help="random-vae: resnets per level")
  p.add_argument("--seed", type=int, default=0, help="random-*: init seed")
  a = p.parse_args(argv)
  try:
    convert.check_out_dir(a.out)
    model, params, report = _read_model(a)
    print(report.summary() if report.loaded else f"random weights (seed {a.seed}): for pipeline "
          "tests only; metrics and latents made with them mean nothing")
    try:
      checkpoint.save_params(a.out, params, model)
    except Exception as e:  # pylint: disable=broad-except  (file systems and object stores)
      raise convert.bad_input("--out", a.out, f"cannot be written ({convert.error_detail(e)})",
                              convert.OUT_DIR) from None
  except convert.InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {a.out} ({type(model).__name__})")
  return 0


def run():
  logs.run_command(main)


if __name__ == "__main__":
  run()
