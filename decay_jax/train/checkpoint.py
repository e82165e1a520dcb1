"""Saving and loading parameters with orbax, together with the model's fields (``models.factory``).

A params directory holds ``params/`` (an orbax StandardCheckpointer tree) and ``model.json`` (the
model class and its fields), so a converted checkpoint can be rebuilt without knowing its preset.
The decay schedule is rebuilt from ``alpha_min`` and friends: it is never stored.
"""

from __future__ import annotations

import contextlib
import gc
import json
import traceback
from typing import Any, List, Optional, Tuple

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

import ml_collections

from decay_jax import paths
from decay_jax import sharding as shd
from decay_jax.models import factory
from decay_jax.train import config as config_lib

class CheckpointError(ValueError):
  """A checkpoint, params directory or run record that is missing, unreadable or corrupt; the
  message is one line naming the argument (``workdir=...``, ``checkpoint=...``)."""


def _first_line(e: BaseException) -> str:
  text = " ".join(str(e).split()).split(" See full TensorStore details")[0]
  if len(text) > 120:
    text = text[:117] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _drop_pending_reads(e: BaseException) -> None:
  """Frees what a failed orbax read left behind now rather than at some later collection: the
  tensorstore reads still pending in its frames are cancelled when freed (the reports they send
  into orbax's closed event loop are what ``logs.quiet_failed_reads`` silences in commands)."""
  traceback.clear_frames(e.__traceback__)
  e.__traceback__ = None
  gc.collect()


@contextlib.contextmanager
def _reading(what: str, path, expected: str):
  """Turns any failure of reading ``path`` (orbax, tensorstore, JSON, the file system: they raise
  many unrelated types) into one ``CheckpointError`` line."""
  try:
    yield
  except CheckpointError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    message = f"{what}={str(path)!r} cannot be read ({_first_line(e)}); expected {expected}"
    _drop_pending_reads(e)
    raise CheckpointError(message) from None


PARAMS_DIR = "a params directory (params/ + model.json, as decay_jax.io.convert writes)"


def save_params(directory: str, params: Any, model) -> None:
  """Writes ``directory/params`` (orbax) and ``directory/model.json``; ``directory`` may be a URI."""
  directory = paths.resolve(directory)
  directory.mkdir(parents=True, exist_ok=True)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(directory / "params", params, force=True)
  paths.write_json(directory / "model.json",
                   {"class": type(model).__name__, "fields": factory.model_fields(model)})


def load_params(directory: str, what: str = "checkpoint") -> Tuple[Any, Any]:
  """Returns ``(model, params)`` saved by ``save_params`` (params restored on the default device).

  ``what`` names the argument in errors (``checkpoint``, ``vae``, ``inception``, ``params``).
  """
  root = paths.resolve(directory)
  if not (root / "model.json").exists():
    raise CheckpointError(f"{what}={directory!r} is not allowed; it has no model.json (expected "
                          f"{PARAMS_DIR})")
  with _reading(what, directory, PARAMS_DIR):
    meta = paths.read_json(root / "model.json")
    model = factory.model_from_fields(meta["class"], meta["fields"])
    ckptr = ocp.StandardCheckpointer()
    params = ckptr.restore(root / "params")
  # Closed only on success: after a failed read, tensorstore reads still in flight complete into
  # the checkpointer's event loop, which prints a traceback for each if it is closed.
  ckptr.close()
  return model, jax.tree_util.tree_map(jnp.asarray, params)


# ------------------------------------------------------------------------------------------------
# Training checkpoints: the whole train state plus a JSON record, managed by orbax.
# ------------------------------------------------------------------------------------------------


class _DataState:
  """Hands a JSON state to Grain's orbax handler as the iterator it expects: saving takes the
  snapshot given (taken at the step boundary, before the next batch is read), restoring keeps
  what the file holds. Grain writes one ``process_<i>-of-<n>.json`` per process."""

  def __init__(self, state: Optional[dict] = None):
    self.state = state

  def get_state(self) -> bytes:
    return json.dumps(self.state).encode()

  def set_state(self, state: bytes) -> None:
    self.state = json.loads(state)

  def start_prefetch(self) -> None:
    pass


class RunCheckpoints:
  """Checkpoints of a training run under ``workdir/checkpoints``.

  Each step directory holds ``state`` (params, optimiser state, step, rng key data; restored onto
  whatever mesh the caller gives), ``meta`` (JSON: step, examples seen, config) and ``data`` (the
  input pipeline's iterator state, one file per process, through Grain's handler). Keeps the last
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
    self.manager = ocp.CheckpointManager(paths.resolve(workdir) / "checkpoints",
                                         options=options, item_names=("state", "meta", "data"))

  def latest_step(self):
    return self.manager.latest_step()

  def save(self, step: int, state: Any, meta: dict, data: Optional[dict] = None) -> None:
    """Saves ``step``; ``data`` is this process's input-stream state (JSON), if any."""
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if data is not None:
      items["data"] = grain.checkpoint.CheckpointSave(item=_DataState(data))
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore_data(self, step: int) -> Optional[dict]:
    """This process's input-stream state saved at ``step``, or None where there is none (an older
    run, another process count, an unreadable file): the stream then restarts at ``step``,
    which gives the same batches."""
    if not (self.manager.directory / str(step) / "data").exists():
      return None
    try:
      out = self.manager.restore(step, args=ocp.args.Composite(
          data=grain.checkpoint.CheckpointRestore(item=_DataState())))
    except Exception:  # pylint: disable=broad-except  (any failure: restart the stream instead)
      return None
    return out["data"].state

  def restore(self, step: int, abstract_state: Any, shardings: Any) -> Tuple[Any, dict]:
    """Restores ``step`` with each array placed by ``shardings`` (any device count)."""
    target = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
    with _reading("workdir", self.manager.directory.parent,
                  f"checkpoints/{step} to hold this config's train state; move it aside to resume "
                  "from the step before, or use a new workdir"):
      out = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


# ------------------------------------------------------------------------------------------------
# Reading a finished (or running) training workdir: its config and one set of weights.
# ------------------------------------------------------------------------------------------------


def _overlay(base, saved: dict) -> None:
  """Writes the values of a saved (JSON) config into ``base``, recursing into sections."""
  for key, value in saved.items():
    current = base.get(key) if key in base else None
    if isinstance(value, dict) and hasattr(current, "items"):
      _overlay(current, value)
      continue
    if isinstance(value, list) and isinstance(current, tuple):
      value = tuple(value)
    try:
      base[key] = value
    except TypeError:  # the saved type differs from today's default: the saved value wins
      del base[key]
      base[key] = value


def run_config(workdir: str, task: Optional[str] = None):
  """The config a run was trained with (``workdir/config.json``) over today's task defaults.

  Fields added to the code after the run take today's defaults. ``task`` (a task name or a tuple
  of them) rejects runs of other tasks with a one-line error.
  """
  path = paths.resolve(workdir) / "config.json"
  if not path.exists():
    raise CheckpointError(f"workdir={workdir!r} is not allowed; it has no config.json (not a run "
                          "of decay_jax.main or decay_jax.cli.compare)")
  with _reading("workdir", workdir, "a run's config.json (JSON written by decay_jax.main)"):
    saved = paths.read_json(path)
  wanted = (task,) if isinstance(task, str) else task
  if wanted is not None and saved.get("task") not in wanted:
    raise ValueError(f"workdir={workdir!r} is not allowed; its task is {saved.get('task')!r}, "
                     f"this command needs {' or '.join(repr(t) for t in wanted)}")
  defaults = {"mae": config_lib.mae_config, "finetune": config_lib.finetune_config,
              "uvit": config_lib.uvit_config}
  base = defaults.get(saved.get("task"), config_lib.sit_config)()
  _overlay(base, saved)
  return ml_collections.ConfigDict(base.to_dict())


def checkpoint_steps(workdir: str) -> List[int]:
  """Committed checkpoint steps of a run (orbax writes temporary names until a step is done)."""
  # orbax's own test of a finished step: on local disk a step is renamed into place when done, on
  # an object store it is written in place and marked by a commit file at the end.
  return sorted(ocp.utils.checkpoint_steps(paths.resolve(workdir) / "checkpoints"))


def restore_run_params(workdir: str, mesh, step: int = -1, weights: str = "params"):
  """``(weights, step)`` of a training checkpoint (``params`` or ``ema``), placed on ``mesh``.

  Only that subtree is read (orbax partial restore), so the optimiser state is never needed.
  """
  steps = checkpoint_steps(workdir)
  if not steps:
    raise CheckpointError(f"workdir={workdir!r} is not allowed; it has no checkpoint in "
                          "checkpoints/ (expected a run of decay_jax.main)")
  step = steps[-1] if step < 0 else step
  if step not in steps:
    raise ValueError(f"step={step} is not allowed; {workdir!r} has steps {steps}")
  path = paths.resolve(workdir) / "checkpoints" / str(step) / "state"
  expected = f"an orbax train state with {weights!r} (a checkpoint of decay_jax.main)"
  with _reading("workdir", workdir, expected):
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(path).item_metadata
  ckptr.close()  # only on success (see load_params)
  if meta is None:
    raise CheckpointError(f"workdir={workdir!r} cannot be read (checkpoints/{step}/state has no "
                          f"metadata); expected {expected}")
  if weights not in meta:
    raise ValueError(f"weights={weights!r} is not allowed; the checkpoint holds "
                     f"{sorted(meta.keys())}")
  abstract = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                    dict(meta[weights]))
  shardings = shd.param_shardings(abstract, mesh)
  target = {weights: jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)}
  with _reading("workdir", workdir, expected):
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    out = ckptr.restore(path, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
  return out[weights], step
