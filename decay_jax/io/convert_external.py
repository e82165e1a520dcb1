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
``decay_jax.io.rules``). Output: an orbax params directory plus ``model.json``
(``checkpoint.load_params`` rebuilds the model). Files are read through ``etils.epath``
(``gs://`` works); torch files with the tensors-only unpickler (a pickle holding code is refused,
never run). Every bad input is one ``InputError`` line naming the argument.

The command is ``python -m decay_jax.cli.convert_external`` (``decay-jax-convert-external``).
"""

from __future__ import annotations

import re
from typing import Dict, List, Mapping, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax.io.inputs import bad_input, error_detail, input_file, read_head
from decay_jax.io.rules import (ConversionError, Report, Rule, abstract_params, as_numpy,
                                from_torch, to_torch)
from decay_jax.io.sizes import layer_count
from decay_jax.io.torch_files import is_safetensors, read_torch_file
from decay_jax.models import inception as inception_lib
from decay_jax.models import vae as vae_lib

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
  return abstract_params(model, jnp.zeros((1, f, f, model.in_channels)))


def inception_targets(model: inception_lib.FIDInceptionV3):
  return abstract_params(model, jnp.zeros((1, 75, 75, 3)))


def inception_rules(model: inception_lib.FIDInceptionV3) -> List[Rule]:
  return _rules(inception_targets(model), lambda part: part)


def modernise_vae_keys(state_dict: Mapping) -> Dict[str, np.ndarray]:
  """Old diffusers attention names and 1x1-conv attention weights -> today's Linear names."""
  out = {}
  for k, v in state_dict.items():
    parts = k.split(".")
    if len(parts) >= 2 and "attentions" in parts and parts[-2] in _LEGACY_ATTENTION:
      parts[-2] = _LEGACY_ATTENTION[parts[-2]]
      k = ".".join(parts)
    v = as_numpy(v)
    if "attentions" in k and k.endswith(".weight") and v.ndim == 4:
      v = v[:, :, 0, 0]
    out[k] = v
  return out


def infer_vae_fields(state_dict: Mapping) -> dict:
  """Architecture fields of a diffusers AutoencoderKL state_dict (groups/scale are not in it)."""
  sd = state_dict
  try:
    levels = layer_count(sd, "encoder.down_blocks.")
    widths = tuple(int(as_numpy(sd[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"])
                       .shape[0]) for i in range(levels))
    return dict(in_channels=int(as_numpy(sd["encoder.conv_in.weight"]).shape[1]),
                out_channels=int(as_numpy(sd["decoder.conv_out.weight"]).shape[0]),
                block_out_channels=widths,
                layers_per_block=layer_count(sd, "encoder.down_blocks.0.resnets."),
                latent_channels=int(as_numpy(sd["post_quant_conv.weight"]).shape[0]))
  except KeyError as e:
    raise ConversionError(f"not a diffusers AutoencoderKL state_dict: key {e} is missing") from None


def vae_from_torch(state_dict: Mapping, model: vae_lib.AutoencoderKL) -> Tuple[dict, Report]:
  """diffusers ``AutoencoderKL.state_dict()`` -> Flax params of ``model``."""
  sd = modernise_vae_keys(state_dict)
  return from_torch(sd, vae_rules(model), vae_targets(model))


def vae_to_torch(params: Mapping, model: vae_lib.AutoencoderKL):
  """Flax params -> diffusers state_dict (numpy), loadable with ``load_state_dict(strict=True)``."""
  return to_torch(params, vae_rules(model))


def inception_from_torch(state_dict: Mapping, model: inception_lib.FIDInceptionV3
                         ) -> Tuple[dict, Report]:
  """pytorch-fid FID-Inception state_dict -> Flax params (``num_batches_tracked`` ignored)."""
  ignore = {k: "BatchNorm step counter (unused in eval mode)" for k in state_dict
            if k.endswith("num_batches_tracked")}
  return from_torch(state_dict, inception_rules(model), inception_targets(model), ignore)


def inception_to_torch(params: Mapping, model: inception_lib.FIDInceptionV3):
  return to_torch(params, inception_rules(model))


def load_state_dict(path: str, arg: str = "--checkpoint",
                    expected: str = "a state_dict (.safetensors, or a torch .pth/.bin/.pt)"
                    ) -> Mapping:
  """A state_dict from a safetensors file or a torch ``.pth/.bin/.pt`` (local or a URI).

  The format is told by the file's first bytes, not its name; a file named ``.safetensors`` must be
  one. Torch files are read as ``torch_files.read_torch_file`` reads them (tensors only; a pickle
  that holds code is refused). Every failure is one ``InputError`` line naming ``arg``.
  """
  p = input_file(path, arg, expected)
  head = read_head(p, arg, path, expected)
  if is_safetensors(head):
    try:
      from safetensors.numpy import load  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise SystemExit("reading .safetensors needs: pip install safetensors==0.8.0") from None
    try:
      return load(p.read_bytes())
    except Exception as e:  # pylint: disable=broad-except  (SafetensorError and friends)
      raise bad_input(arg, path, f"cannot be read; it is a damaged safetensors file "
                      f"({error_detail(e)})", expected) from None
  if path.endswith(".safetensors"):
    raise bad_input(arg, path, "is not a safetensors file (its header is not one)",
                    expected)
  sd = read_torch_file(path, arg, expected)
  if isinstance(sd, Mapping):
    sd = sd.get("state_dict", sd)
  if not isinstance(sd, Mapping):
    raise bad_input(arg, path, f"holds a {type(sd).__name__}, not a state_dict", expected)
  return sd


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
