"""Saving and loading parameters with orbax, together with the model's fields.

A params directory holds ``params/`` (an orbax StandardCheckpointer tree) and ``model.json`` (the
model class and its fields), so a converted checkpoint can be rebuilt without knowing its preset.
The decay schedule is rebuilt from ``alpha_min`` and friends: it is never stored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Tuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib

MODEL_CLASSES = {"MaskedAutoencoder": mae_lib.MaskedAutoencoder, "SiT": sit_lib.SiT}


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
  if kind not in MODEL_CLASSES:
    raise ValueError(f"model class {kind!r} is not allowed; choose one of {sorted(MODEL_CLASSES)}")
  fields = dict(fields)
  if "dtype" in fields:
    fields["dtype"] = jnp.dtype(fields["dtype"])
  return MODEL_CLASSES[kind](**fields)


def save_params(directory: str, params: Any, model) -> None:
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(directory, "params"), params, force=True)
  with open(os.path.join(directory, "model.json"), "w") as f:
    json.dump({"class": type(model).__name__, "fields": model_fields(model)}, f, indent=1)


def load_params(directory: str) -> Tuple[Any, Any]:
  """Returns ``(model, params)`` saved by ``save_params`` (params restored on the default device)."""
  directory = os.path.abspath(directory)
  with open(os.path.join(directory, "model.json")) as f:
    meta = json.load(f)
  model = model_from_fields(meta["class"], meta["fields"])
  with ocp.StandardCheckpointer() as ckptr:
    params = ckptr.restore(os.path.join(directory, "params"))
  return model, jax.tree_util.tree_map(jnp.asarray, params)
