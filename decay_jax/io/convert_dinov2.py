"""DINOv2 state_dicts -> Flax params of ``models.dinov2.DINOv2`` (and back).

Sources (the user supplies the file; nothing is downloaded):
  * the torch.hub checkpoints ``dinov2_vit{s,b,l}14[_reg4]_pretrain.pth`` (facebookresearch/dinov2):
    ``cls_token``, ``pos_embed (1, 1+37*37, D)``, ``register_tokens``, ``mask_token`` (the
    masked-modelling token, unused by feature extraction: reported and dropped),
    ``patch_embed.proj``, ``blocks.j.*`` (``ls1.gamma``, ``ls2.gamma``), ``norm``;
  * timm's ``vit_*_patch14_dinov2`` state_dicts (``.safetensors`` of the timm hub, or
    ``model.state_dict()``): the same names without ``mask_token``; timm's register models keep
    ``reg_token`` and a ``pos_embed`` without the cls row, and fold that row into ``cls_token``
    (timm ``_convert_dinov2``): they are put back in the hub's layout (``cls_token`` as is, a zero
    cls row), which gives the same forward.

Sizes are read off the tensors (``infer_dinov2_fields``); the head count is not in them: DINOv2's
heads are 64 wide (384/6, 768/12, 1024/16). Unknown, missing and mis-shaped tensors raise a
one-line ``ConversionError`` naming the key (the engine of ``decay_jax.io.rules``).
"""

from __future__ import annotations

import collections
from typing import Dict, List, Mapping, Tuple

import jax.numpy as jnp
import numpy as np

from decay_jax.io.rules import (ConversionError, Report, Rule, abstract_params, as_numpy,
                                conv_rules, dense_rules, from_torch, norm_rules, to_torch)
from decay_jax.io.sizes import layer_count
from decay_jax.models import dinov2 as dinov2_lib

HEAD_WIDTH = 64  # every DINOv2 ViT: dim / num_heads
IGNORED = {"mask_token": "DINOv2's masked-modelling token (iBOT); feature extraction never uses it"}


def dinov2_rules(model: dinov2_lib.DINOv2) -> List[Rule]:
  """One rule per tensor, in the hub's state_dict order."""
  rules = [Rule("cls_token", ("cls_token",)), Rule("pos_embed", ("pos_embed",))]
  if model.num_register_tokens:
    rules.append(Rule("register_tokens", ("register_tokens",)))
  rules += conv_rules("patch_embed.proj", ("patch_embed", "proj"))
  for j in range(model.depth):
    pre, at = f"blocks.{j}", ("blocks",)
    for k, branch in ((1, ("attn.qkv", "attn.proj")), (2, ("mlp.fc1", "mlp.fc2"))):
      rules += norm_rules(f"{pre}.norm{k}", at + (f"norm{k}",), j)
      for name in branch:
        rules += dense_rules(f"{pre}.{name}", at + tuple(name.split(".")), j)
      rules.append(Rule(f"{pre}.ls{k}.gamma", at + (f"ls{k}", "gamma"), j))
  return rules + norm_rules("norm", ("norm",))


def dinov2_targets(model: dinov2_lib.DINOv2):
  side = model.pos_grid * model.patch_size
  return abstract_params(model, jnp.zeros((1, side, side, model.in_chans)))


def hub_layout(state_dict: Mapping) -> Dict[str, np.ndarray]:
  """A timm register-model state_dict (``reg_token``, ``pos_embed`` without a cls row) in the
  hub's layout; other state_dicts unchanged (as numpy)."""
  sd = {k: as_numpy(v) for k, v in state_dict.items()}
  if "reg_token" in sd:
    sd["register_tokens"] = sd.pop("reg_token")
    if "pos_embed" in sd:
      pos = sd["pos_embed"]
      sd["pos_embed"] = np.concatenate([np.zeros_like(pos[:, :1]), pos], axis=1)
  return sd


def infer_dinov2_fields(state_dict: Mapping) -> dict:
  """Architecture fields of a DINOv2 state_dict (hub layout): patch size, width, depth, MLP ratio,
  position grid, registers; heads ``dim / 64``."""
  sd = state_dict
  try:
    dim, in_chans, p, _ = as_numpy(sd["patch_embed.proj.weight"]).shape
    rows = as_numpy(sd["pos_embed"]).shape[1] - 1
    hidden = as_numpy(sd["blocks.0.mlp.fc1.weight"]).shape[0]
  except KeyError as e:
    raise ConversionError(f"not a DINOv2 state_dict: key {e} is missing") from None
  except ValueError as e:
    raise ConversionError(f"not a DINOv2 state_dict: patch_embed.proj.weight is not a 4-D conv "
                          f"weight ({e})") from None
  grid = int(round(np.sqrt(rows)))
  if grid * grid != rows:
    raise ConversionError(f"pos_embed: {rows} patch rows is not a square grid")
  if dim % HEAD_WIDTH:
    raise ConversionError(f"patch_embed.proj.weight: width {dim} is not a multiple of DINOv2's "
                          f"head width {HEAD_WIDTH}")
  regs = as_numpy(sd["register_tokens"]).shape[1] if "register_tokens" in sd else 0
  return dict(patch_size=int(p), dim=int(dim), depth=layer_count(sd, "blocks."),
              num_heads=int(dim) // HEAD_WIDTH, mlp_ratio=hidden / dim, in_chans=int(in_chans),
              pos_grid=grid, num_register_tokens=int(regs))


def dinov2_from_torch(state_dict: Mapping, model: dinov2_lib.DINOv2) -> Tuple[dict, Report]:
  """A hub or timm DINOv2 state_dict -> Flax params of ``model``; every tensor but ``mask_token``
  must match."""
  sd = hub_layout(state_dict)
  ignore = {k: why for k, why in IGNORED.items() if k in sd}
  return from_torch(sd, dinov2_rules(model), dinov2_targets(model), ignore)


def dinov2_to_torch(params: Mapping, model: dinov2_lib.DINOv2) -> "collections.OrderedDict":
  """Flax params -> the hub's state_dict (numpy) without ``mask_token``."""
  return to_torch(params, dinov2_rules(model))


def dinov2_from_state_dict(state_dict: Mapping, **overrides) -> Tuple[dinov2_lib.DINOv2, dict,
                                                                      Report]:
  """``(model, params, report)``: the model of the state_dict's sizes (``overrides``: other
  fields, e.g. ``pos_interpolation``, ``dtype``) and its converted params."""
  sd = hub_layout(state_dict)
  model = dinov2_lib.DINOv2(**dict(infer_dinov2_fields(sd), **overrides))
  params, report = dinov2_from_torch(sd, model)
  return model, params, report
