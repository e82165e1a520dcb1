"""The U-ViT converter: U-ViT's state_dict keys <-> ``models.uvit.UViT`` parameters, both ways
(docs/uvit.md 1.6), a rule table on the engine of ``decay_jax.io.rules``; no command yet."""

from __future__ import annotations

import collections
from typing import List, Mapping, Tuple

import jax.numpy as jnp

from decay_jax.io.rules import (ConversionError, Report, Rule, abstract_params, as_numpy,
                                check_residual_form,
                                conv_rules, dense_rules, from_torch, norm_rules, to_torch,
                                vit_block_rules)
from decay_jax.io.sizes import layer_count
from decay_jax.models import uvit as uvit_lib

# U-ViT's released widths -> their head counts (configs/*.py); heads are not visible in the shapes.
UVIT_HEADS = {512: 8, 768: 12, 1024: 16, 1152: 16}


def uvit_rules(model: uvit_lib.UViT) -> List[Rule]:
  """U-ViT's ``libs/uvit.py`` state_dict in its own order (docs/uvit.md 1.6): ``pos_embed`` (the model's
  own parameter comes first), ``patch_embed.proj``, ``time_embed.{0,2}`` (``mlp_time_embed``),
  ``label_emb`` (conditional), ``in_blocks.i``, ``mid_block``, ``out_blocks.j`` (+ ``skip_linear``),
  ``norm``, ``decoder_pred``, ``final_layer`` (``conv``). 11 keys per in/mid block (``attn.qkv``
  has no bias unless ``qkv_bias``), 13 per out-block."""
  def block(prefix, path, layer):
    return [r for r in vit_block_rules(prefix, path, layer)
            if model.qkv_bias or not r.torch_key.endswith("attn.qkv.bias")]

  rules = [Rule("pos_embed", ("pos_embed",))]
  rules += conv_rules("patch_embed.proj", ("patch_embed",))
  if model.mlp_time_embed:
    rules += dense_rules("time_embed.0", ("time_embed_0",))
    rules += dense_rules("time_embed.2", ("time_embed_2",))
  if model.conditional:
    rules += [Rule("label_emb.weight", ("label_emb", "embedding"))]
  for i in range(model.half):
    rules += block(f"in_blocks.{i}", ("in_blocks",), i)
  rules += block("mid_block", ("mid_block",), None)
  for j in range(model.half):
    rules += block(f"out_blocks.{j}", ("out_blocks",), j)
    if model.skip_mode != "none":
      rules += dense_rules(f"out_blocks.{j}.skip_linear", ("out_blocks", "skip_linear"), j)
  rules += norm_rules("norm", ("norm",)) + dense_rules("decoder_pred", ("decoder_pred",))
  if model.conv:
    rules += conv_rules("final_layer", ("final_layer",))
  return rules


def _uvit_init_args(model: uvit_lib.UViT):
  y = jnp.zeros((1,), jnp.int32) if model.conditional else None
  return jnp.zeros((1, model.img_size, model.img_size, model.in_chans)), jnp.zeros((1,)), y


def uvit_from_torch(state_dict: Mapping, model: uvit_lib.UViT) -> Tuple[dict, Report]:
  """U-ViT state_dict (``nnet.pth`` / ``nnet_ema.pth`` or a released ``.pth``) -> Flax params of
  ``model``. Every key must match; the decay schedule is the model's (not in the state_dict)."""
  check_residual_form(model, "U-ViT")
  targets = abstract_params(model, *_uvit_init_args(model))
  targets.pop(("alpha",), None)
  params, report = from_torch(state_dict, uvit_rules(model), targets)
  if model.shortcuts.learnable:
    params["alpha"] = jnp.asarray(model.shortcuts.alphas, jnp.float32)
    report.left_at_init.append("alpha (learnable ablation, initialised from the schedule)")
  return params, report


def uvit_to_torch(params: Mapping, model: uvit_lib.UViT) -> "collections.OrderedDict":
  """Flax params -> U-ViT state_dict (numpy), keys in U-ViT's order. With ``skip_mode='add'`` the
  keys are U-ViT's but ``skip_linear`` is (D, D), which only the test reference's option loads."""
  check_residual_form(model, "U-ViT")
  if model.shortcuts.learnable:
    raise ConversionError("shortcut_form='learnable' has no counterpart in U-ViT")
  return to_torch(params, uvit_rules(model))


def infer_uvit_fields(state_dict: Mapping) -> dict:
  """Architecture fields of a U-ViT state_dict (sizes read off the tensors; heads from
  ``UVIT_HEADS``, otherwise 64-wide heads). ``skip_mode`` 'add' is not told apart from 'concat'
  by the keys, only by the ``skip_linear`` shape."""
  try:
    dim, in_chans, p, _ = as_numpy(state_dict["patch_embed.proj.weight"]).shape
    tokens = as_numpy(state_dict["pos_embed"]).shape[1]
    hidden = as_numpy(state_dict["mid_block.mlp.fc1.weight"]).shape[0]
  except KeyError as e:
    raise ConversionError(f"not a U-ViT state_dict: key {e} is missing") from None
  table = state_dict.get("label_emb.weight")
  num_classes = -1 if table is None else as_numpy(table).shape[0]
  grid = int(round((tokens - (2 if num_classes > 0 else 1)) ** 0.5))
  skip = state_dict.get("out_blocks.0.skip_linear.weight")
  skip_mode = "none"
  if skip is not None:
    skip_mode = "concat" if as_numpy(skip).shape[1] == 2 * dim else "add"
  return dict(img_size=grid * p, patch_size=p, in_chans=in_chans, dim=dim,
              depth=2 * layer_count(state_dict, "in_blocks."),
              num_heads=UVIT_HEADS.get(dim, max(1, dim // 64)), mlp_ratio=hidden / dim,
              qkv_bias="mid_block.attn.qkv.bias" in state_dict,
              mlp_time_embed="time_embed.0.weight" in state_dict, num_classes=num_classes,
              conv="final_layer.weight" in state_dict, skip_mode=skip_mode)

