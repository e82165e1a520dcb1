"""REPA's SiT checkpoints (sihyun-yu/REPA ``models/sit.py``, ``train.py``) -> Flax params
(docs/repa.md).

REPA's SiT is the plain SiT of Ma et al. (no long skips, no decay, no learned sigma) plus one
projector MLP per target encoder after block ``encoder_depth``. Here it is
``SiT(residual_routing='plain', alpha_min=1, learn_sigma=False, repa_depth=encoder_depth,
repa_dims=z_dims, repa_hidden=projector_dim, flow_convention='repa')``: the last field makes the
converted network answer in our transport's convention (t = 0 noise, velocity data - noise) while
its weights keep REPA's (t = 0 data, velocity noise - data).

Files: the release ``last.pt`` is the EMA state_dict alone; a training checkpoint is ``{'model',
'ema', 'opt', 'args', 'steps'}`` (``weights`` picks 'ema' by default, as REPA's ``generate.py``).
Keys: ``pos_embed`` (fixed sin-cos table, checked), ``x_embedder.proj.*``,
``t_embedder.mlp.{0,2}.*``, ``y_embedder.embedding_table.weight`` (``num_classes + 1`` rows), ``blocks.N.{attn.qkv, attn.proj,
mlp.fc1, mlp.fc2, adaLN_modulation.1}.*``, ``projectors.I.{0,2,4}.*``, ``final_layer.{linear,
adaLN_modulation.1}.*``. Legacy files (``decoder_blocks.N`` after the first ``encoder_depth``
blocks) are renamed as REPA's ``load_legacy_checkpoints`` does. ``encoder_depth`` is not in the
tensors: it comes from ``args.encoder_depth`` or the caller (REPA's default, and its release, 8).
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Tuple

from decay_jax.io.rules import (ConversionError, Report, Rule, abstract_params, as_numpy,
                                check_table, conv_rules, dense_rules, from_torch, vit_block_rules)
from decay_jax.io.sizes import layer_count
from decay_jax.models import sit as sit_lib
from decay_jax.models.residual import Residual

REPA_ENCODER_DEPTH = 8  # train.py / generate.py --encoder-depth default (the released SiT-XL/2)
HEADS = {1152: 16, 1024: 16, 768: 12, 384: 6}  # REPA's SiT_models (XL, L, B, S)


def repa_rules(model: sit_lib.SiT):
  """REPA's state_dict keys <-> the Flax leaves of ``model`` (a plain SiT with projectors)."""
  rules = conv_rules("x_embedder.proj", ("x_embedder", "proj"))
  rules += dense_rules("t_embedder.mlp.0", ("t_embedder", "mlp0"))
  rules += dense_rules("t_embedder.mlp.2", ("t_embedder", "mlp2"))
  rules += [Rule("y_embedder.embedding_table.weight", ("y_embedder", "embedding"))]
  half = model.depth // 2
  for b in range(model.depth):
    path = ("trunk", f"enc_{b:02d}" if b < half else f"dec_{b - half:02d}")
    rules += vit_block_rules(f"blocks.{b}", path, None, affine_norms=False)
    rules += dense_rules(f"blocks.{b}.adaLN_modulation.1", path + ("adaLN_modulation",))
  for i in range(len(model.repa_dims)):
    for j in (0, 2, 4):
      rules += dense_rules(f"projectors.{i}.{j}", (f"projectors_{i}", f"fc{j}"))
  rules += dense_rules("final_layer.linear", ("final_linear",))
  rules += dense_rules("final_layer.adaLN_modulation.1", ("final_adaLN",))
  return rules


def rename_legacy(state_dict: Mapping, encoder_depth: int) -> dict:
  """REPA's ``load_legacy_checkpoints``: ``decoder_blocks.N.*`` ->
  ``blocks.(N + encoder_depth).*``."""
  out = {}
  for key, value in state_dict.items():
    if key.startswith("decoder_blocks."):
      parts = key.split(".")
      key = ".".join(["blocks", str(int(parts[1]) + encoder_depth)] + parts[2:])
    out[key] = value
  return out


def infer_repa_fields(state_dict: Mapping, encoder_depth: int,
                      num_heads: Optional[int] = None) -> dict:
  """The ``SiT`` fields of a REPA state_dict (sizes read off the tensors; heads from REPA's
  presets by width unless given)."""
  try:
    dim, in_ch, p, _ = as_numpy(state_dict["x_embedder.proj.weight"]).shape
    tokens = as_numpy(state_dict["pos_embed"]).shape[1]
    table = as_numpy(state_dict["y_embedder.embedding_table.weight"]).shape[0]
    out = as_numpy(state_dict["final_layer.linear.weight"]).shape[0] // (p * p)
    hidden = as_numpy(state_dict["blocks.0.mlp.fc1.weight"]).shape[0]
  except KeyError as e:
    raise ConversionError(f"not a REPA SiT state_dict: key {e} is missing") from None
  if any(".q_norm." in k or ".k_norm." in k for k in state_dict):
    raise ConversionError("the state_dict was trained with --qk-norm (attn.q_norm / k_norm), "
                          "which our SiT blocks do not have")
  if out != in_ch:
    raise ConversionError(f"final_layer.linear has {out} output channels per pixel for "
                          f"{in_ch} input channels; REPA's SiT predicts the velocity only")
  projectors = layer_count(state_dict, "projectors.")
  dims = tuple(int(as_numpy(state_dict[f"projectors.{i}.4.weight"]).shape[0])
               for i in range(projectors))
  depth = layer_count(state_dict, "blocks.")
  if not dims:
    raise ConversionError("the state_dict has no projectors (projectors.0.*); it is not a REPA SiT")
  return dict(input_size=int(round(math.sqrt(tokens))) * p, patch_size=p, in_channels=in_ch,
              dim=dim, depth=depth, num_heads=num_heads or HEADS.get(dim, max(1, dim // 64)),
              num_classes=table - 1, mlp_ratio=hidden / dim, repa_depth=encoder_depth,
              repa_dims=dims,
              repa_hidden=int(as_numpy(state_dict["projectors.0.0.weight"]).shape[0]))


def repa_model(fields: dict) -> sit_lib.SiT:
  """Our SiT of REPA's architecture with ``fields`` (``infer_repa_fields``)."""
  return sit_lib.SiT(**fields, learn_sigma=False, residual=Residual(alpha_min=1.0),
                     residual_routing="plain", flow_convention="repa")


def repa_from_torch(state_dict: Mapping, encoder_depth: int = REPA_ENCODER_DEPTH,
                    num_heads: Optional[int] = None) -> Tuple[sit_lib.SiT, dict, Report]:
  """REPA's SiT state_dict (the EMA of ``last.pt`` or a checkpoint's 'ema'/'model') ->
  ``(model, Flax params, report)``; every key must match."""
  sd = rename_legacy(state_dict, encoder_depth)
  model = repa_model(infer_repa_fields(sd, encoder_depth, num_heads))
  check_table(sd, "pos_embed", model.pos_embed())
  targets = abstract_params(model, *sit_lib.init_args(model))
  ignore = {"pos_embed": "fixed sin-cos table (a module constant here; checked)"}
  params, report = from_torch(sd, repa_rules(model), targets, ignore)
  return model, params, report


def repa_state_dict(ckpt, weights: Optional[str] = None) -> Tuple[Mapping, str]:
  """The state_dict of a REPA file and what it was: a training checkpoint's ``weights`` entry
  (default 'ema') or the release's bare EMA state_dict (``weights`` must then be unset or 'ema')."""
  if not isinstance(ckpt, Mapping):
    raise ConversionError(f"the file holds a {type(ckpt).__name__}, not a state_dict")
  if "model" in ckpt or "ema" in ckpt:
    entry = weights or "ema"
    if entry not in ckpt:
      raise ConversionError(f"the checkpoint has no {entry!r} entry")
    return ckpt[entry], f"{entry!r} of a training checkpoint"
  if weights == "model":
    raise ConversionError("the file is a bare state_dict (REPA's release last.pt holds the EMA "
                          "weights only); leave --weights out")
  return ckpt, "a bare state_dict (REPA's release: EMA weights)"


def encoder_depth_of(ckpt, override: Optional[int] = None) -> int:
  """``override``, else the checkpoint's ``args.encoder_depth``, else REPA's default 8."""
  if override is not None:
    return int(override)
  args = ckpt.get("args") if isinstance(ckpt, Mapping) else None
  value = args.get("encoder_depth") if isinstance(args, Mapping) else getattr(
      args, "encoder_depth", None)
  return REPA_ENCODER_DEPTH if value is None else int(value)
