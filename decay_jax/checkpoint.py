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


# ------------------------------------------------------------------------------------------------
# Training checkpoints: the whole train state plus a JSON record, managed by orbax.
# ------------------------------------------------------------------------------------------------


class RunCheckpoints:
  """Checkpoints of a training run under ``workdir/checkpoints``.

  Each step directory holds ``state`` (params, optimiser state, step, rng key data; restored onto
  whatever mesh the caller gives) and ``meta`` (JSON: step, examples seen, config). Keeps the last
  ``keep`` plus every ``keep_every_steps``-th. Saves are asynchronous: training continues while the
  files are written; orbax commits a step atomically, so a crash never leaves a half-written
  checkpoint behind as the latest one.
  """

  def __init__(self, workdir: str, keep: int = 3, keep_every_steps: int = 0,
               async_save: bool = True):
    policies = [ocp.checkpoint_managers.LatestN(keep)]
    if keep_every_steps > 0:
      policies.append(ocp.checkpoint_managers.EveryNSteps(keep_every_steps))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints"),
                                         options=options, item_names=("state", "meta"))

  def latest_step(self):
    return self.manager.latest_step()

  def save(self, step: int, state: Any, meta: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)

  def restore(self, step: int, abstract_state: Any, shardings: Any) -> Tuple[Any, dict]:
    """Restores ``step`` with each array placed by ``shardings`` (any device count)."""
    target = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
