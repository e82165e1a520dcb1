"""The official decayed-MAE and SiT layouts: their rule tables and conversions, both directions.

Supported sources (docs/official_code.md 1.2, 1.13, 4.2):
  * official decayed-MAE checkpoints (``.pth`` with ``model`` and ``args``; ``alpha_min`` comes from
    ``args.min_decay``); ViT-L/H checkpoints carry SkipLayers the forward never uses: they are
    reported and dropped, and re-created with the official init on the way back;
  * official SiT checkpoints (``model`` and ``ema``; ``alpha_min`` from ``args.min_sigma``);
  * upstream MAE ``mae_pretrain_vit_*.pth`` encoders, as an initialisation of the decayed encoder
    (the report lists what was loaded and what was left at its initial value);
  * the fine-tuning classifier under upstream MAE's ``models_vit`` (timm) names.

The other way, Flax params become what the official code loads (``mae_checkpoint``,
``sit_checkpoint``): ``{'model', 'args'}`` for MAE, ``{'model', 'ema', 'args'}`` for SiT, keys in
the official order, strict-loadable. ``no_official_layout`` says why a model the official code
cannot express (SiT routing, other shortcut forms or schedules) has no such file. The tables run on
the engine of ``io.rules``; the sizes of a checkpoint's model are read by ``io.sizes``.
"""

from __future__ import annotations

import collections
import math
from typing import Dict, List, Mapping, Optional, Tuple

import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from decay_jax.io.rules import (ConversionError, Report, Rule, abstract_params,
                                check_residual_form, check_table,
                                conv_rules, dense_rules, from_torch, norm_rules, to_torch,
                                vit_block_rules)
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib

# ------------------------------------------------------------------------------------------------
# Rule tables (in the official state_dict order)
# ------------------------------------------------------------------------------------------------


def mae_rules(model: mae_lib.MaskedAutoencoder) -> List[Rule]:
  rules = [Rule("cls_token", ("cls_token",)), Rule("decoder_cls_token", ("decoder_cls_token",))]
  rules += conv_rules("patch_embed.proj", ("patch_embed", "proj"))
  for i in range(model.num_skip_layers):
    rules += [Rule(f"skip.{i}.mask_token", (f"skip_{i}", "mask_token"))]
    rules += dense_rules(f"skip.{i}.fc.0", (f"skip_{i}", "fc0"))
    rules += dense_rules(f"skip.{i}.fc.2", (f"skip_{i}", "fc2"))
  for j in range(model.depth):
    rules += vit_block_rules(f"blocks.{j}", ("blocks",), j)
  rules += dense_rules("decoder_embed", ("decoder_embed",))
  for k in range(model.decoder_depth):
    rules += vit_block_rules(f"decoder_blocks.{k}", (f"decoder_blocks_{k}",), None)
  rules += norm_rules("decoder_norm", ("decoder_norm",))
  rules += dense_rules("decoder_pred", ("decoder_pred",))
  return rules


def vit_rules(model) -> List[Rule]:
  """The fine-tuning classifier (``models.vit.ViTClassifier``) under timm's / upstream MAE's
  ``models_vit`` names (global pooling: ``fc_norm``, no ``norm``)."""
  rules = [Rule("cls_token", ("cls_token",)), Rule("pos_embed", ("pos_embed",))]
  rules += conv_rules("patch_embed.proj", ("patch_embed", "proj"))
  for j in range(model.depth):
    rules += vit_block_rules(f"blocks.{j}", ("blocks",), j)
  rules += norm_rules("fc_norm", ("fc_norm",))
  rules += dense_rules("head", ("head",))
  return rules


def mae_unused_skip_keys(model: mae_lib.MaskedAutoencoder) -> List[str]:
  """Keys of the SkipLayers the official model builds but never uses (ViT-L/H)."""
  return [f"skip.{i}.{name}" for i in range(model.num_skip_layers, len(model.skip_ids))
          for name in ("mask_token", "fc.0.weight", "fc.0.bias", "fc.2.weight", "fc.2.bias")]


def sit_rules(model: sit_lib.SiT) -> List[Rule]:
  rules = conv_rules("x_embedder.proj", ("x_embedder", "proj"))
  rules += dense_rules("t_embedder.mlp.0", ("t_embedder", "mlp0"))
  rules += dense_rules("t_embedder.mlp.2", ("t_embedder", "mlp2"))
  rules += [Rule("y_embedder.embedding_table.weight", ("y_embedder", "embedding"))]
  for part in ("enc_blocks", "dec_blocks"):
    for i in range(model.depth // 2):
      rules += vit_block_rules(f"{part}.{i}", (part,), i, affine_norms=False)
      rules += dense_rules(f"{part}.{i}.adaLN_modulation.1", (part, "adaLN_modulation"), i)
      if part == "dec_blocks":
        rules += dense_rules(f"{part}.{i}.skip", (part, "skip"), i)
  rules += dense_rules("final_layer.linear", ("final_linear",))
  rules += dense_rules("final_layer.adaLN_modulation.1", ("final_adaLN",))
  return rules


# ------------------------------------------------------------------------------------------------
# Model-level API
# ------------------------------------------------------------------------------------------------


def mae_init_args(model: mae_lib.MaskedAutoencoder):
  """Example inputs of ``model.init`` (images, masking noise): batch 1, zeros."""
  return (jnp.zeros((1, model.img_size, model.img_size, model.in_chans)),
          jnp.zeros((1, model.num_patches)))


def mae_from_torch(state_dict: Mapping, model: mae_lib.MaskedAutoencoder) -> Tuple[dict, Report]:
  """Official decayed-MAE ``model`` state_dict -> Flax params of ``model``.

  ``model`` must carry the checkpoint's ``alpha_min`` (it is not in the state_dict).
  """
  check_residual_form(model, "the official model")
  check_table(state_dict, "pos_embed", model.pos_embed())
  check_table(state_dict, "decoder_pos_embed", model.decoder_pos_embed())
  ignore = {"pos_embed": "fixed sin-cos table (a module constant here; checked)",
            "decoder_pos_embed": "fixed sin-cos table (a module constant here; checked)"}
  ignore.update({k: "SkipLayer the official forward never uses" for k in mae_unused_skip_keys(model)})
  targets = abstract_params(model, *mae_init_args(model))
  targets.pop(("alpha",), None)
  params, report = from_torch(state_dict, mae_rules(model), targets, ignore)
  if model.shortcuts.learnable:
    params["alpha"] = jnp.asarray(model.shortcuts.alphas, jnp.float32)
    report.left_at_init.append("alpha (learnable ablation, initialised from the schedule)")
  return params, report


def vit_from_torch(state_dict: Mapping, model) -> Tuple[dict, Report]:
  """A fine-tuning classifier's state_dict (upstream ``models_vit`` names, global pooling) ->
  Flax params of ``model`` (``models.vit.ViTClassifier``); every key must match."""
  check_residual_form(model, "the official model")
  init_args = (jnp.zeros((1, model.img_size, model.img_size, model.in_chans)),)
  return from_torch(state_dict, vit_rules(model), abstract_params(model, *init_args))


def official_unused_skip_init(model: mae_lib.MaskedAutoencoder, seed: int = 0) -> Dict[str, np.ndarray]:
  """Official-init values for the SkipLayers the official ViT-L/H build but never use.

  Their values cannot change any output; they exist so the official code can load the file.
  """
  rng = np.random.default_rng(seed)
  d, enc = model.decoder_dim, model.dim
  bound = math.sqrt(6.0 / (enc + d + d))
  out = {}
  for i in range(model.num_skip_layers, len(model.skip_ids)):
    out[f"skip.{i}.mask_token"] = (0.02 * rng.standard_normal((1, 1, enc))).astype(np.float32)
    out[f"skip.{i}.fc.0.weight"] = rng.uniform(-bound, bound, (d, enc + d)).astype(np.float32)
    out[f"skip.{i}.fc.0.bias"] = np.zeros((d,), np.float32)
    out[f"skip.{i}.fc.2.weight"] = np.zeros((d, d), np.float32)
    out[f"skip.{i}.fc.2.bias"] = np.zeros((d,), np.float32)
  return out


def mae_to_torch(params: Mapping, model: mae_lib.MaskedAutoencoder) -> "collections.OrderedDict":
  """Flax params -> official decayed-MAE state_dict (numpy), keys in the official order.

  Includes the fixed tables ``pos_embed`` / ``decoder_pos_embed`` and, for ViT-L/H, official-init
  values for the unused SkipLayers, so ``load_state_dict(strict=True)`` works on the official model.
  """
  check_residual_form(model, "the official model")
  params = {k: v for k, v in params.items() if k != "alpha"}
  if model.shortcuts.learnable:
    raise ConversionError("shortcut_form='learnable' has no counterpart in the official model")
  body = to_torch(params, mae_rules(model))
  unused = official_unused_skip_init(model)
  sd = collections.OrderedDict()
  sd["cls_token"] = body.pop("cls_token")
  sd["pos_embed"] = model.pos_embed()[None]
  sd["decoder_cls_token"] = body.pop("decoder_cls_token")
  sd["decoder_pos_embed"] = model.decoder_pos_embed()[None]
  for k, v in body.items():
    sd[k] = v
    if k == f"skip.{model.num_skip_layers - 1}.fc.2.bias":
      sd.update(unused)
  return sd


def sit_from_torch(state_dict: Mapping, model: sit_lib.SiT) -> Tuple[dict, Report]:
  """Official SiT ``model`` or ``ema`` state_dict -> Flax params of ``model``."""
  check_residual_form(model, "the official model")
  check_table(state_dict, "pos_embed", model.pos_embed())
  targets = abstract_params(model, *sit_lib.init_args(model))
  targets.pop(("alpha",), None)
  params, report = from_torch(state_dict, sit_rules(model), targets,
                              {"pos_embed": "fixed sin-cos table (a module constant here; checked)"})
  if model.shortcuts.learnable:
    params["alpha"] = jnp.asarray(model.shortcuts.alphas, jnp.float32)
    report.left_at_init.append("alpha (learnable ablation, initialised from the schedule)")
  return params, report


def sit_to_torch(params: Mapping, model: sit_lib.SiT) -> "collections.OrderedDict":
  """Flax params -> official SiT state_dict (numpy) including the fixed ``pos_embed``."""
  check_residual_form(model, "the official model")
  if model.shortcuts.learnable:
    raise ConversionError("shortcut_form='learnable' has no counterpart in the official model")
  sd = collections.OrderedDict(pos_embed=model.pos_embed()[None])
  sd.update(to_torch(params, sit_rules(model)))
  return sd


def mae_from_upstream_encoder(state_dict: Mapping, model: mae_lib.MaskedAutoencoder,
                              init_params: Mapping) -> Tuple[dict, Report]:
  """Upstream MAE (``mae_pretrain_vit_*.pth``) encoder -> initialisation of the decayed MAE.

  Loads ``cls_token``, ``patch_embed`` and all encoder ``blocks``; every other leaf keeps its value
  from ``init_params`` (the report lists them). The upstream final ``norm`` and any upstream decoder
  keys (``mask_token``, ``decoder_*``) have no place in the decayed model and are reported as ignored.
  """
  check_table(state_dict, "pos_embed", model.pos_embed())
  rules = [Rule("cls_token", ("cls_token",))]
  rules += conv_rules("patch_embed.proj", ("patch_embed", "proj"))
  for j in range(model.depth):
    rules += vit_block_rules(f"blocks.{j}", ("blocks",), j)
  targets = abstract_params(model, *mae_init_args(model))
  ignore = {k: "upstream key with no counterpart in the decayed encoder"
            for k in state_dict if k.startswith(("norm.", "mask_token", "decoder_"))}
  ignore["pos_embed"] = "fixed sin-cos table (a module constant here; checked)"
  return from_torch(state_dict, rules, targets, ignore,
                    base=traverse_util.flatten_dict(dict(init_params)))


# ------------------------------------------------------------------------------------------------
# The official files' contents (to-torch)
# ------------------------------------------------------------------------------------------------

# Official factory names (docs/official_code.md 1.1, 4.1) of our presets.
OFFICIAL_MAE = {"B/16": "mae_vit_base_patch16", "L/16": "mae_vit_large_patch16",
                "H/14": "mae_vit_huge_patch14"}
OFFICIAL_SIT = {f"{size}/{p}": f"SiT-{size}/{p}"
                for size in ("XL", "L", "B", "S") for p in (2, 4, 8)}


def official_name(model) -> str:
  """The official factory name of ``model``'s architecture, or 'custom'."""
  if isinstance(model, mae_lib.MaskedAutoencoder):
    presets, names = mae_lib.MAE_PRESETS, OFFICIAL_MAE
  else:
    presets, names = sit_lib.SIT_PRESETS, OFFICIAL_SIT
  for preset, name in names.items():
    if model.mlp_ratio == 4.0 and all(getattr(model, k) == v for k, v in presets[preset].items()):
      return name
  return "custom"


def no_official_layout(model) -> Optional[str]:
  """Why ``model`` has no official state_dict layout, or ``None`` when it has one.

  The official files store tensors and ``min_decay`` / ``min_sigma`` only, and the official code
  rebuilds the rest: the linear per-sublayer schedule, the decayed identity shortcut and (SiT) the
  plain Linear long skips. A model that differs in any of these would load into the official code
  as a different function, or not at all.
  """
  name = type(model).__name__
  if not isinstance(model, (mae_lib.MaskedAutoencoder, sit_lib.SiT)):
    return f"{name} has no official state_dict layout (to-torch writes the official MAE and SiT)"
  checks = [("shortcut_form", "decay", "the official code has only the decayed identity shortcut"),
            ("schedule_convention", "sublayer", "the official schedule is per sublayer"),
            ("schedule_shape", "linear", "the official schedule is linear")]
  if isinstance(model, sit_lib.SiT):
    checks.insert(0, ("residual_routing", "none", "the official SiT has no routing parameters; its "
                      "decoder blocks add Linear long skips"))
  for field, official, why in checks:
    value = getattr(model, field)
    if value != official:
      return f"{name} with {field}={value!r} has no official state_dict layout ({why})"
  if isinstance(model, mae_lib.MaskedAutoencoder) and model.depth % 2:
    return (f"{name} with depth={model.depth} has no official state_dict layout (the official "
            "skip_id pairs the encoder blocks, so the depth is even)")
  if isinstance(model, sit_lib.SiT) and model.class_dropout_prob <= 0:
    return (f"{name} with class_dropout_prob=0 has no official state_dict layout (the official "
            "label table always holds the null class)")
  return None


def mae_checkpoint(params: Mapping, model: mae_lib.MaskedAutoencoder) -> dict:
  """The official MAE file's contents: ``{'model': state_dict, 'args': {...}}`` (numpy).

  ``args`` is a plain dict (official files hold an argparse Namespace, which ``torch.load``'s
  default ``weights_only=True`` refuses); the official loader reads only ``model``. Besides the
  official ``min_decay``, ``norm_pix_loss``, ``mask_ratio``, ``input_size`` and ``model`` it holds
  the head counts, which the tensors do not show.
  """
  args = dict(model=official_name(model), input_size=model.img_size,
              mask_ratio=float(model.mask_ratio), norm_pix_loss=bool(model.norm_pix_loss),
              min_decay=float(model.alpha_min), num_heads=model.num_heads,
              decoder_num_heads=model.decoder_num_heads)
  return {"model": mae_to_torch(params, model), "args": args}


def sit_checkpoint(params: Mapping, model: sit_lib.SiT, ema: Optional[Mapping] = None) -> dict:
  """The official SiT file's contents: ``{'model', 'ema', 'args'}`` (numpy state_dicts).

  Sampling (upstream ``find_model``) takes ``ema``; without EMA weights ``ema`` holds ``params``
  too. ``args``: ``model``, ``num_classes``, ``min_sigma``, ``learn_sigma``, ``num_heads``, and the
  official ``image_size`` (pixels, 8 x the latent side) for 4-channel latent models.
  """
  sd = sit_to_torch(params, model)
  args = dict(model=official_name(model), num_classes=model.num_classes,
              min_sigma=float(model.alpha_min), learn_sigma=bool(model.learn_sigma),
              num_heads=model.num_heads)
  if model.in_channels == 4:
    args["image_size"] = 8 * model.input_size
  return {"model": sd, "ema": sit_to_torch(ema, model) if ema is not None else sd, "args": args}
