"""The sizes of the model an official MAE or SiT state_dict holds, read off its tensors.

``infer_mae_fields`` / ``infer_sit_fields`` give the model's fields (head counts, which the shapes
do not show, are the official ones); ``layer_count`` (how many ``prefix.i`` layers a state_dict
holds) serves the U-ViT and VAE converters too.
"""

from __future__ import annotations

import math
from typing import Mapping

from decay_jax.io.rules import ConversionError, as_numpy


def layer_count(state_dict, prefix: str) -> int:
  """How many layers ``state_dict`` holds under ``prefix`` (``blocks.`` -> ``blocks.0.*``, ...): the
  highest index + 1."""
  idx = {int(k[len(prefix):].split(".")[0]) for k in state_dict if k.startswith(prefix)}
  return max(idx) + 1 if idx else 0


def infer_mae_fields(state_dict: Mapping) -> dict:
  """Architecture fields of an official decayed-MAE state_dict (sizes read off the tensors).

  Head counts are not visible in the shapes: the official ones are used for the official widths
  (768 -> 12, 1024/1280 -> 16, decoder 512 -> 16), otherwise 64-wide (32-wide decoder) heads.
  """
  try:
    w = as_numpy(state_dict["patch_embed.proj.weight"])
    dim, in_chans, p, _ = w.shape
    tokens = as_numpy(state_dict["pos_embed"]).shape[1] - 1
    dec_dim = as_numpy(state_dict["decoder_embed.weight"]).shape[0]
  except KeyError as e:
    raise ConversionError(f"not an official decayed-MAE state_dict: key {e} is missing") from None
  grid = int(round(math.sqrt(tokens)))
  depth = layer_count(state_dict, "blocks.")
  heads = {768: 12, 1024: 16, 1280: 16}.get(dim, max(1, dim // 64))
  return dict(img_size=grid * p, patch_size=p, in_chans=in_chans, dim=dim, depth=depth,
              num_heads=heads, decoder_dim=dec_dim,
              decoder_depth=layer_count(state_dict, "decoder_blocks."),
              decoder_num_heads=max(1, dec_dim // 32),
              mlp_ratio=as_numpy(state_dict["blocks.0.mlp.fc1.weight"]).shape[0] / dim)


def infer_sit_fields(state_dict: Mapping) -> dict:
  """Architecture fields of an official SiT state_dict."""
  try:
    w = as_numpy(state_dict["x_embedder.proj.weight"])
    dim, in_ch, p, _ = w.shape
    tokens = as_numpy(state_dict["pos_embed"]).shape[1]
    table = as_numpy(state_dict["y_embedder.embedding_table.weight"])
    out = as_numpy(state_dict["final_layer.linear.weight"]).shape[0] // (p * p)
  except KeyError as e:
    raise ConversionError(f"not an official SiT state_dict: key {e} is missing") from None
  depth = 2 * layer_count(state_dict, "enc_blocks.")
  heads = {1152: 16, 1024: 16, 768: 12, 384: 6}.get(dim, max(1, dim // 64))
  return dict(input_size=int(round(math.sqrt(tokens))) * p, patch_size=p, in_channels=in_ch,
              dim=dim, depth=depth, num_heads=heads, num_classes=table.shape[0] - 1,
              learn_sigma=(out == 2 * in_ch),
              mlp_ratio=as_numpy(state_dict["enc_blocks.0.mlp.fc1.weight"]).shape[0] / dim)
