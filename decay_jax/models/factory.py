"""Models from configs and from their saved fields: the one place that maps names to classes.

``build_model(config, info)`` turns a training config's ``model`` section into a Flax module;
``model_fields`` / ``model_from_fields`` round-trip a module through JSON (``model.json`` beside
every params directory). The decay schedule is rebuilt from ``alpha_min`` and friends; it is never
stored.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from decay_jax import validate
from decay_jax.models import inception as inception_lib
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib
from decay_jax.models import uvit as uvit_lib
from decay_jax.models import vit as vit_lib
from decay_jax.models import vae as vae_lib

MODEL_CLASSES = {"MaskedAutoencoder": mae_lib.MaskedAutoencoder, "SiT": sit_lib.SiT,
                 "AutoencoderKL": vae_lib.AutoencoderKL,
                 "FIDInceptionV3": inception_lib.FIDInceptionV3,
                 "ViTClassifier": vit_lib.ViTClassifier, "UViT": uvit_lib.UViT}
TASKS = ("mae", "sit", "finetune", "uvit")


def build_model(config, info: dict, pretrained=None):
  """The Flax model of a config; image size and channels come from the data (``info``).

  Fine-tuning: the classifier over ``pretrained`` (an MAE: its sizes and decay schedule) with the
  data's classes, or over ``model.preset``'s encoder without one. The model checks its own fields;
  their errors name the field from the config root (``model.alpha_min=...``).
  """
  validate.check_choice("task", config.task, TASKS)
  m = config.model.to_dict()
  preset = m.pop("preset")
  m["attention_impl"] = m["attention_impl"] or None
  if pretrained is not None and pretrained.in_chans != info["channels"]:
    raise validate.not_allowed("data.dataset", config.data.dataset,
                               f"it has {info['channels']} channels; the pre-trained encoder "
                               f"takes {pretrained.in_chans}")
  try:
    if config.task == "finetune":
      run = dict(drop_path=m["drop_path"], dtype=m["dtype"], attention_impl=m["attention_impl"],
                 remat_policy=m["remat_policy"], img_size=info["image_size"])
      if pretrained is None:
        decay = {k: m[k] for k in ("alpha_min", "schedule_convention", "schedule_shape",
                                   "shortcut_form")}
        return vit_lib.vit(preset, info["num_classes"], in_chans=info["channels"], **decay, **run)
      return vit_lib.from_mae(pretrained, info["num_classes"], **run)
    if config.task == "mae":
      m.update(img_size=info["image_size"], in_chans=info["channels"])
      return mae_lib.mae(preset, **m)
    if config.task == "uvit":  # the data's classes, plus the null label when labels are dropped
      classes = info["num_classes"] + (config.diffusion.class_dropout_prob > 0)
      m.update(img_size=info["image_size"], in_chans=info["channels"],
               num_classes=classes if m.pop("conditional") else -1)
      return uvit_lib.uvit(preset, **m)
    m.update(input_size=info["image_size"], in_channels=info["channels"])
    return sit_lib.sit(preset, **m)
  except ValueError as e:
    raise validate.prefixed("model.", e) from None


def model_fields(model) -> dict:
  """The dataclass fields of a model as JSON-able values (dtype by name)."""
  out = {}
  for f in dataclasses.fields(model):
    if f.name in ("parent", "name"):
      continue
    v = getattr(model, f.name)
    out[f.name] = jnp.dtype(v).name if f.name == "dtype" else v
  return out


def model_from_fields(kind: str, fields: dict):
  """The model of class name ``kind`` with ``fields`` (as written by ``model_fields``)."""
  validate.check_choice("model class", kind, sorted(MODEL_CLASSES))
  fields = dict(fields)
  if "dtype" in fields:
    fields["dtype"] = jnp.dtype(fields["dtype"])
  if fields.get("attention_impl") == "cudnn":  # trained on a GPU: here the choice is made again
    fields["attention_impl"] = None
  return MODEL_CLASSES[kind](**fields)


def summary(model) -> dict:
  """The fields plus the decay schedule a model was built with (for reports)."""
  sc = model.shortcuts
  return dict(model_fields(model), alpha_eff=sc.alpha_eff, alphas=sc.alphas.tolist(),
              branch_scale=sc.branch_scale)
