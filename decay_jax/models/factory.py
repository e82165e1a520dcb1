"""Models from configs and from their saved fields: the one place that maps names to classes.

``build_model(config, info, builder)`` turns a training config's ``model`` section into a Flax
module through one of the builders below (``mae``, ``sit``, ``uvit``, ``finetune``), which each
task names as its ``model_builder`` (``train.tasks``); ``model_fields`` / ``model_from_fields``
round-trip a module through JSON (``model.json`` beside every params directory). The residual
spec (``residual.Residual``) is written as its flat fields (``alpha_min``, ``schedule_convention``,
...), as configs spell them; the decay schedule is rebuilt from them, it is never stored.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from decay_jax import validate
from decay_jax.models import dinov2 as dinov2_lib
from decay_jax.models import inception as inception_lib
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib
from decay_jax.models import uvit as uvit_lib
from decay_jax.models import vit as vit_lib
from decay_jax.models import vae as vae_lib
from decay_jax.models.residual import Residual

MODEL_CLASSES = {"MaskedAutoencoder": mae_lib.MaskedAutoencoder, "SiT": sit_lib.SiT,
                 "AutoencoderKL": vae_lib.AutoencoderKL,
                 "FIDInceptionV3": inception_lib.FIDInceptionV3,
                 "ViTClassifier": vit_lib.ViTClassifier, "UViT": uvit_lib.UViT,
                 "DINOv2": dinov2_lib.DINOv2}


def mae(config, info, preset, residual, m, pretrained):
  """A masked autoencoder of ``preset``."""
  del config, pretrained
  return mae_lib.mae(preset, img_size=info["image_size"], in_chans=info["channels"],
                     residual=residual, **m)


def sit(config, info, preset, residual, m, pretrained):
  """A SiT of ``preset``."""
  del config, pretrained
  return sit_lib.sit(preset, input_size=info["image_size"], in_channels=info["channels"],
                     residual=residual, **m)


def uvit(config, info, preset, residual, m, pretrained):
  """A U-ViT of ``preset`` with the data's classes, plus the null label when labels are dropped."""
  del pretrained
  classes = info["num_classes"] + (config.diffusion.class_dropout_prob > 0)
  num_classes = classes if m.pop("conditional") else -1
  return uvit_lib.uvit(preset, img_size=info["image_size"], in_chans=info["channels"],
                       num_classes=num_classes, residual=residual, **m)


def finetune(config, info, preset, residual, m, pretrained):
  """A ViT classifier over ``pretrained``'s encoder (its sizes and its residual spec object, with the config's
  fine-tuning ``drop_path``), else ``preset``'s."""
  del config
  run = dict(drop_path=residual.drop_path, dtype=m["dtype"], attention_impl=m["attention_impl"],
             remat_policy=m["remat_policy"], img_size=info["image_size"])
  if pretrained is None:
    return vit_lib.vit(preset, info["num_classes"], in_chans=info["channels"], residual=residual,
                       **run)
  return vit_lib.from_mae(pretrained, info["num_classes"], **run)


def build_model(config, info: dict, builder: Callable, pretrained=None):
  """The Flax model of a config; image size and channels come from the data (``info``).

  The config's flat residual fields (``model.alpha_min`` ...; the configs hold all of them, see
  ``train.config``) become one ``Residual``, passed to ``builder(config, info, preset, residual,
  other model fields, pretrained)``: one of this module's ``mae``, ``sit``, ``uvit``, ``finetune``
  (the task's ``model_builder``). Fine-tuning: the classifier over ``pretrained``
  (an MAE: its sizes and its ``residual``) with the data's classes, or over ``model.preset``'s
  encoder without one. The model checks its own fields; their errors name the field from the
  config root (``model.alpha_min=...``).
  """
  m = config.model.to_dict()
  preset = m.pop("preset")
  m["attention_impl"] = m["attention_impl"] or None
  # an MAE encoder (in_chans) or a SiT (in_channels)
  chans = getattr(pretrained, "in_chans", None) or getattr(pretrained, "in_channels", None)
  if pretrained is not None and chans != info["channels"]:
    raise validate.not_allowed("data.dataset", config.data.dataset,
                               f"it has {info['channels']} channels; the pre-trained "
                               f"{'encoder' if hasattr(pretrained, 'in_chans') else 'model'} "
                               f"takes {chans}")
  try:
    residual, m = Residual.from_fields(m)
    return builder(config, info, preset, residual, m, pretrained)
  except ValueError as e:
    raise validate.prefixed("model.", e) from None


def model_fields(model) -> dict:
  """The dataclass fields of a model as JSON-able values (dtype by name), the ``residual`` spec as
  its flat fields in its place (``alpha_min``, ``schedule_convention``, ...)."""
  out = {}
  for f in dataclasses.fields(model):
    if f.name in ("parent", "name"):
      continue
    v = getattr(model, f.name)
    if isinstance(v, Residual):
      out.update(v.fields())
    else:
      out[f.name] = jnp.dtype(v).name if f.name == "dtype" else v
  return out


def model_from_fields(kind: str, fields: dict):
  """The model of class name ``kind`` with ``fields`` (as written by ``model_fields``: flat
  residual fields; a nested ``residual`` dict is read too). Residual fields a file lacks take the
  class's defaults."""
  validate.check_choice("model class", kind, sorted(MODEL_CLASSES))
  cls = MODEL_CLASSES[kind]
  fields = dict(fields)
  if "dtype" in fields:
    fields["dtype"] = jnp.dtype(fields["dtype"])
  if fields.get("attention_impl") == "cudnn":  # trained on a GPU: here the choice is made again
    fields["attention_impl"] = None
  if "residual" in cls.__dataclass_fields__:
    residual, fields = Residual.from_fields(fields, cls.__dataclass_fields__["residual"].default)
    fields["residual"] = residual
  return cls(**fields)


def summary(model) -> dict:
  """The fields plus the decay schedule a model was built with (for reports)."""
  sc = model.shortcuts
  return dict(model_fields(model), alpha_eff=sc.alpha_eff, alphas=sc.alphas.tolist(),
              branch_scale=sc.branch_scale)
