"""Saving and loading parameters with orbax, together with the model's fields (``models.factory``).

A params directory holds ``params/`` (an orbax StandardCheckpointer tree) and ``model.json`` (the
model class, its fields and the digests of the arrays), so a converted checkpoint can be rebuilt
without knowing its preset. The decay schedule is rebuilt from ``alpha_min`` and friends: it is
never stored.

Every save records a digest of each array (``decay_jax.train.digest``: computed on the devices
that hold the array, a few bytes per array come back) and every read checks them: a training
checkpoint in its ``meta`` item, a params directory in ``model.json``. A checkpoint whose arrays
differ from their digests, or that cannot be read at all, is damaged: resuming moves it aside to
``workdir/damaged_checkpoints/`` and falls back to the newest intact one (``RunCheckpoints.
restore_newest``); the reading commands name it in one line. Checkpoints written before digests
existed load unverified, with one log line saying so.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging as std_logging
import os
import traceback
from typing import Any, List, Optional, Sequence, Tuple

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

import ml_collections

from decay_jax import paths
from decay_jax import sharding as shd
from decay_jax.models import factory
from decay_jax.train import digest, failures

class CheckpointError(ValueError):
  """A checkpoint, params directory or run record that is missing, unreadable or corrupt; the
  message is one line naming the argument (``workdir=...``, ``checkpoint=...``)."""


class DamagedCheckpoint(CheckpointError):
  """A checkpoint whose arrays differ from the digests recorded at save, or that cannot be read
  (a corrupt chunk, a missing file, broken metadata). ``step`` and ``reason`` name it."""

  def __init__(self, message: str, step: int, reason: str):
    super().__init__(message)
    self.step, self.reason = step, reason


_first_line = failures.first_line
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a save in progress (or one that failed)
_UNVERIFIED: set = set()  # the directories already reported as written before digests


def _note_unverified(where: str) -> None:
  """Logs once per directory that what is read there has no digests to check."""
  if where not in _UNVERIFIED:
    _UNVERIFIED.add(where)
    logging.warning("%s was written before checkpoints recorded digests: it loads unverified "
                    "(damage that still reads cannot be detected)", where)


def _mismatch(recorded: Any, tree: Any, where: str, subtree: bool = False) -> Optional[str]:
  """Why ``tree`` is not what was saved (None: it is, or there is nothing to check it with)."""
  if recorded is None:
    _note_unverified(where)
    return None
  if isinstance(recorded, dict) and recorded.get("format") not in (None, digest.FORMAT):
    _note_unverified(f"{where} (digest format {recorded.get('format')!r})")
    return None
  try:
    differ = digest.differences(recorded, tree, subtree)
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    return f"its digest record is unreadable: {_first_line(e, 80)}"
  if not differ:
    return None
  total = len(jax.tree_util.tree_leaves(tree))
  return (f"{len(differ)} of {total} arrays differ from the digests recorded at save, first "
          f"{differ[0]}")


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


PARAMS_DIR = "a params directory (params/ + model.json, as decay_jax.cli.convert writes)"


def save_params(directory: str, params: Any, model) -> None:
  """Writes ``directory/params`` (orbax) and ``directory/model.json``; ``directory`` may be a URI."""
  directory = paths.resolve(directory)
  directory.mkdir(parents=True, exist_ok=True)
  digests, _ = digest.compute(params)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(directory / "params", params, force=True)
  paths.write_json(directory / "model.json",
                   {"class": type(model).__name__, "fields": factory.model_fields(model),
                    "digests": digest.record(digests)})


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
  params = jax.tree_util.tree_map(jnp.asarray, params)
  reason = _mismatch(meta.get("digests"), params, f"{what}={directory!r}")
  if reason is not None:
    raise CheckpointError(f"{what}={directory!r} is damaged ({reason}); expected {PARAMS_DIR}")
  return model, params


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
  whatever mesh the caller gives), ``meta`` (JSON: step, examples seen, config, and the digests of
  every array of ``state``) and ``data`` (the input pipeline's iterator state, one file per
  process, through Grain's handler). Keeps the last ``keep`` plus every ``keep_every_steps``-th.
  Saves are asynchronous: training continues while the files are written; orbax commits a step
  atomically, so a crash never leaves a half-written checkpoint behind as the latest one.

  ``lease`` (``decay_jax.train.lease``): checked before every save, so that a run whose workdir
  was taken over stops before it writes. A save that fails because the disk or quota is full or
  the object store cannot be reached raises ``failures.StorageFullError`` /
  ``StoreUnreachableError`` with one line (the intact checkpoints, the partial save removed).
  """

  def __init__(self, workdir: str, keep: int = 3, keep_every_steps: int = 0,
               async_save: bool = True, lease=None):
    policies = [ocp.checkpoint_managers.LatestN(keep)]
    if keep_every_steps > 0:
      policies.append(ocp.checkpoint_managers.EveryNSteps(keep_every_steps))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        enable_async_checkpointing=async_save, create=True)
    self.root = paths.resolve(workdir)
    self.lease = lease
    self.failed = False
    self.manager = ocp.CheckpointManager(self.root / "checkpoints", options=options,
                                         item_names=("state", "meta", "data"))

  def latest_step(self):
    return self.manager.latest_step()

  # ----------------------------------------------------------------------------------------------
  # Saving.
  # ----------------------------------------------------------------------------------------------

  def save(self, step: int, state: Any, meta: dict, data: Optional[dict] = None) -> None:
    """Saves ``step`` with the digests of ``state``; ``data`` is this process's input-stream state
    (JSON), if any. A state with a non-finite floating-point array is not saved: that raises
    ``failures.Diverged``, so every checkpoint on disk is finite."""
    if self.lease is not None:
      self.lease.check()
    digests, finite = digest.compute(state)
    if not finite:
      self.wait()
      raise failures.Diverged(
          f"training diverged: the train state has non-finite values at step {step}, so it was "
          f"not saved; {self.describe()}; lower the learning rate (or use float32) and rerun")
    meta = dict(meta, digests=digest.record(digests))
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if data is not None:
      items["data"] = grain.checkpoint.CheckpointSave(item=_DataState(data))
    with self._writing(step):
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def wait(self) -> None:
    with self._writing(None):
      self.manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the saves in flight and closes; after a reported write failure, quietly."""
    if self.failed:
      with contextlib.suppress(Exception):
        self.manager.close()
      return
    with self._writing(None):
      self.manager.wait_until_finished()
    with self._writing(None):
      self.manager.close()

  def describe(self, steps: Optional[List[int]] = None) -> str:
    """``describe_steps`` of this run (``steps``: known without asking the store)."""
    return describe_steps(os.fspath(self.root) if steps is None else steps)

  def _partial_saves(self) -> List[Any]:
    try:
      return sorted(p for p in self.manager.directory.iterdir()
                    if _TMP_SUFFIX in p.name)
    except Exception:  # pylint: disable=broad-except
      return []

  def _remove_partial(self) -> str:
    """Removes the temporary directories of failed saves (``N.orbax-checkpoint-tmp*``); says so."""
    left = self._partial_saves()
    if not left:
      return "no partial save is left"
    removed, kept = [], []
    for p in left:
      try:
        p.rmtree()
        removed.append(p.name)
      except Exception:  # pylint: disable=broad-except
        kept.append(p.name)
    text = f"the partial save {', '.join(removed)} was removed" if removed else ""
    if kept:
      text += ("; " if text else "") + (f"{', '.join(kept)} is left (a rerun ignores it; delete it "
                                        "to free space)")
    return text

  @contextlib.contextmanager
  def _writing(self, step: Optional[int]):
    """Turns a save that failed for a full disk or an unreachable store into one line."""
    try:
      yield
    except failures.RunFailure:
      raise
    except Exception as e:  # pylint: disable=broad-except
      failure = self._write_failure(e, step)
      if failure is None:
        raise
      raise failure from None

  def _write_failure(self, e: BaseException, step: Optional[int]) -> Optional[failures.RunFailure]:
    full, away = failures.storage_full(e), failures.unreachable(e)
    if full is None and away is None:
      return None
    self.failed = True
    with contextlib.suppress(Exception):  # the other writes of that save, to their end
      self.manager.wait_until_finished()
    failed = sorted({int(p.name.split(".")[0]) for p in self._partial_saves()
                     if p.name.split(".")[0].isdigit()} | ({step} if step is not None else set()))
    which = (f"checkpoint {', '.join(map(str, failed))}" if failed else "a checkpoint")
    where = f"workdir={str(self.root)!r}"
    if full is not None:
      partial = self._remove_partial()
      return failures.StorageFullError(
          f"no space left in {where} (disk or quota full: {failures.full_detail(full)}) while "
          f"saving {which}; {self.describe()}; {partial}; free space or raise the quota, then "
          "rerun the same command")
    known = [s for s in self.manager.all_steps() if s not in failed]
    return failures.StoreUnreachableError(
        f"the object store of {where} cannot be reached while saving {which} "
        f"({_first_line(away, 100)}); {self.describe(sorted(known))}; check the network, the "
        "endpoint and the credentials, then rerun the same command")

  # ----------------------------------------------------------------------------------------------
  # Restoring.
  # ----------------------------------------------------------------------------------------------

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

  def _fits(self, step: int, abstract_state: Any) -> Optional[bool]:
    """Whether the arrays stored at ``step`` have the shapes and dtypes of ``abstract_state``
    (None: the stored metadata cannot be read, which is damage)."""
    absl_logger = logging.get_absl_logger()
    level = absl_logger.level
    absl_logger.setLevel(std_logging.ERROR)  # orbax warns of each missing file: the caller reports
    try:
      ckptr = ocp.StandardCheckpointer()
      stored = ckptr.metadata(self.manager.directory / str(step) / "state").item_metadata
      ckptr.close()
    except Exception:  # pylint: disable=broad-except
      return None
    finally:
      absl_logger.setLevel(level)
    if stored is None:
      return None
    shape = lambda a: (tuple(a.shape), str(np.dtype(a.dtype)))
    try:
      return (sorted(map(shape, jax.tree_util.tree_leaves(stored)))
              == sorted(map(shape, jax.tree_util.tree_leaves(abstract_state))))
    except Exception:  # pylint: disable=broad-except
      return None

  def restore(self, step: int, abstract_state: Any, shardings: Any) -> Tuple[Any, dict]:
    """Restores ``step`` with each array placed by ``shardings`` (any device count) and checks it
    against its digests. Raises ``DamagedCheckpoint`` if it differs or cannot be read, and
    ``CheckpointError`` if it holds another config's train state."""
    target = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
    where = f"workdir={str(self.root)!r}"
    try:
      out = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      detail = _first_line(e)
      _drop_pending_reads(e)
      if self._fits(step, abstract_state) is False:
        raise self._other_state(step, detail) from None
      raise _damaged(where, step, f"it cannot be read: {detail}") from None
    state, meta = out["state"], out["meta"]
    if not isinstance(meta, dict):
      raise _damaged(where, step, "its meta item is not a JSON object")
    reason = _mismatch(meta.get("digests"), state, f"{where} checkpoints/{step}")
    if reason is not None:
      if self._fits(step, abstract_state) is False:  # orbax cast the arrays to this config's
        raise self._other_state(step, "other dtypes")
      raise _damaged(where, step, reason)
    return state, meta

  def _other_state(self, step: int, detail: str) -> CheckpointError:
    return CheckpointError(
        f"workdir={str(self.root)!r} cannot be read ({detail}); expected checkpoints/{step} to "
        "hold this config's train state (its arrays have other shapes or dtypes): rerun with the "
        "run's own config (its config.json), or use a new workdir")

  def restore_newest(self, abstract_state: Any, shardings: Any) -> Optional[Tuple[int, Any, dict]]:
    """``(step, state, meta)`` of the newest intact checkpoint, or None if there is none at all.

    Damaged checkpoints (each logged in one line) are moved to ``workdir/damaged_checkpoints/``
    once an intact one is found, so that the run can save their steps again; if every checkpoint
    is damaged, nothing is moved and ``CheckpointError`` says so in one line. With several
    processes, a checkpoint counts as intact only if every process read it intact.
    """
    damaged: List[DamagedCheckpoint] = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        state, meta = self.restore(step, abstract_state, shardings)
        problem = None
      except DamagedCheckpoint as e:
        problem = e
      if not _all_processes(problem is None):
        problem = problem or _damaged(f"workdir={str(self.root)!r}", step,
                                      "another process could not read it intact")
      if problem is not None:
        logging.warning("%s", problem)
        damaged.append(problem)
        continue
      if damaged:
        moved = self._move_aside([d.step for d in damaged])
        logging.warning("resuming from step %d, the newest intact checkpoint; the damaged "
                        "checkpoint%s %s moved to %s", step, "s" if len(damaged) > 1 else "",
                        ", ".join(str(d.step) for d in damaged), moved)
      return step, state, meta
    if damaged:
      reasons = "; ".join(f"checkpoints/{d.step}: {d.reason}" for d in damaged)
      raise CheckpointError(
          f"workdir={str(self.root)!r} cannot be resumed: no intact checkpoint ({reasons}); move "
          "checkpoints/ aside to start afresh, or use a new workdir")
    return None

  def _move_aside(self, steps: List[int]) -> str:
    """Moves ``checkpoints/<step>`` to ``damaged_checkpoints/<step>[-n]`` (process 0; the others
    wait); returns where."""
    target = self.root / "damaged_checkpoints"
    if jax.process_index() == 0:
      for step in steps:
        src = self.manager.directory / str(step)
        dst, n = target / str(step), 1
        while dst.exists():
          dst, n = target / f"{step}-{n}", n + 1
        _move_tree(src, dst)
    _sync("decay_jax_damaged_checkpoints_moved")
    self.manager.reload()
    return os.fspath(target)


def _damaged(where: str, step: int, reason: str) -> DamagedCheckpoint:
  return DamagedCheckpoint(f"{where} checkpoints/{step} is damaged ({reason})", step, reason)


def _all_processes(ok: bool) -> bool:
  """Whether ``ok`` holds on every process (the value itself with one process)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _move_tree(src, dst) -> None:
  """Moves a directory: a rename on local disk, a copy and delete on an object store."""
  dst.parent.mkdir(parents=True, exist_ok=True)
  if not paths.is_uri(src):
    os.rename(os.fspath(src), os.fspath(dst))
    return
  for f in paths.list_files(src):
    rel = os.fspath(f)[len(os.fspath(src)):].lstrip("/")
    (dst / rel).parent.mkdir(parents=True, exist_ok=True)
    (dst / rel).write_bytes(paths.resolve(f).read_bytes())
  src.rmtree()


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


def run_config(workdir: str, tasks: Sequence[Any]):
  """The config a run was trained with (``workdir/config.json``) over today's defaults of its task.

  ``tasks``: the task classes the run may be of (``train.tasks``: ``name``, ``default_config()``);
  a run of another task is a one-line error naming them. Fields added to the code after the run
  take today's defaults. (``train.tasks.run_config`` asks by task name.)
  """
  path = paths.resolve(workdir) / "config.json"
  if not path.exists():
    raise CheckpointError(f"workdir={workdir!r} is not allowed; it has no config.json (not a run "
                          "of decay_jax.cli.train or decay_jax.cli.compare)")
  with _reading("workdir", workdir, "a run's config.json (JSON written by decay_jax.cli.train)"):
    saved = paths.read_json(path)
  by_name = {t.name: t for t in tasks}
  if saved.get("task") not in by_name:
    raise ValueError(f"workdir={workdir!r} is not allowed; its task is {saved.get('task')!r}, "
                     f"this command needs {' or '.join(repr(t) for t in by_name)}")
  base = by_name[saved["task"]].default_config()
  _overlay(base, saved)
  return ml_collections.ConfigDict(base.to_dict())


def describe_steps(workdir_or_steps) -> str:
  """``intact checkpoints: 10, 20 (a rerun resumes from step 20)`` or ``no checkpoint saved yet
  (a rerun starts afresh)``, of a workdir (listed) or of the steps given. "Intact": committed by
  orbax; the digests are checked when a rerun restores one."""
  steps = workdir_or_steps
  if isinstance(steps, str):
    try:
      steps = checkpoint_steps(steps)
    except Exception:  # pylint: disable=broad-except  (the store itself failed)
      return "the checkpoints saved before are kept"
  if not steps:
    return "no checkpoint saved yet (a rerun starts afresh)"
  return (f"intact checkpoints: {', '.join(map(str, steps))} (a rerun resumes from step "
          f"{steps[-1]})")


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
                          "checkpoints/ (expected a run of decay_jax.cli.train)")
  step = steps[-1] if step < 0 else step
  if step not in steps:
    raise ValueError(f"step={step} is not allowed; {workdir!r} has steps {steps}")
  path = paths.resolve(workdir) / "checkpoints" / str(step) / "state"
  expected = f"an orbax train state with {weights!r} (a checkpoint of decay_jax.cli.train)"
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
  where = f"workdir={workdir!r}"
  try:
    # A checkpoint without a meta item predates it: nothing to verify with (noted once).
    meta = (paths.read_json(path.parent / "meta" / "metadata")
            if (path.parent / "meta").exists() else {})
  except Exception as e:  # pylint: disable=broad-except
    meta = e
  reason = (f"its meta item cannot be read: {_first_line(meta, 80)}"
            if isinstance(meta, Exception) else "its meta item is not a JSON object"
            if not isinstance(meta, dict) else
            _mismatch(meta.get("digests"), {weights: out[weights]}, f"{where} checkpoints/{step}",
                      subtree=True))
  if reason is not None:
    others = [s for s in steps if s != step]
    raise _damaged(where, step, reason + (f"; its other checkpoints: steps {others} (--step)"
                                          if others else ""))
  return out[weights], step
