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
(``checkpoint.load_params`` rebuilds the model).

    python -m decay_jax.io.convert_external vae --checkpoint diffusion_pytorch_model.safetensors \
        --config config.json --out /data/sd_vae_ft_ema
    python -m decay_jax.io.convert_external inception \
        --checkpoint pt_inception-2015-12-05-6726825d.pth --out /data/fid_inception
    python -m decay_jax.io.convert_external random-vae --out /tmp/vae --channels 32,64,64,64 --groups 8
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

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


def load_state_dict(path: str) -> Mapping:
  """A ``.safetensors`` file (needs the ``safetensors`` package) or a torch ``.pth/.bin/.pt``."""
  if path.endswith(".safetensors"):
    try:
      from safetensors.numpy import load_file
    except ImportError:
      raise SystemExit("reading .safetensors needs: pip install safetensors==0.8.0") from None
    return load_file(path)
  sd = convert.load_torch_checkpoint(path)
  return sd.get("state_dict", sd) if isinstance(sd, Mapping) else sd


def _vae_overrides(config_path: Optional[str], groups: Optional[int], scale: Optional[float]):
  cfg = {}
  if config_path:
    with open(config_path) as f:
      cfg = json.load(f)
  return dict(norm_num_groups=int(groups or cfg.get("norm_num_groups", 32)),
              scaling_factor=float(scale or cfg.get("scaling_factor", 0.18215)))


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


def main(argv: Optional[Sequence[str]] = None) -> int:

  p = argparse.ArgumentParser(prog="python -m decay_jax.io.convert_external",
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
    if a.kind in ("vae", "inception") and not a.checkpoint:
      raise ConversionError(f"{a.kind} needs --checkpoint (the weights file)")
    if a.kind == "vae":
      sd = _modernise_vae_keys(load_state_dict(a.checkpoint))
      model = vae_lib.AutoencoderKL(**infer_vae_fields(sd),
                                    **_vae_overrides(a.config, a.groups, a.scale))
      params, report = vae_from_torch(sd, model)
    elif a.kind == "inception":
      model = inception_lib.FIDInceptionV3()
      params, report = inception_from_torch(load_state_dict(a.checkpoint), model)
    elif a.kind == "random-vae":
      try:
        channels = [int(c) for c in a.channels.split(",")]
      except ValueError:
        raise ConversionError(f"channels={a.channels!r} is not allowed; give integers like "
                              "128,256,512,512") from None
      model, params = random_vae(channels, a.groups or 32, a.layers, seed=a.seed,
                                 scale=a.scale or 0.18215)
      report = Report()
    else:
      model, params = random_inception(a.seed)
      report = Report()
  except (ConversionError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(report.summary() if report.loaded else f"random weights (seed {a.seed}): for pipeline "
        "tests only; metrics and latents made with them mean nothing")
  checkpoint.save_params(a.out, params, model)
  print(f"wrote {a.out} ({type(model).__name__})")
  return 0


def run():
  sys.exit(main())


if __name__ == "__main__":
  run()
