"""One training loop for MAE and SiT: ``train_and_evaluate(config, workdir)``.

The loop is the same from one CPU to a multi-host pod: a ``(data, fsdp)`` mesh, parameters born
sharded, per-host input shards assembled into global arrays, one jitted step. MAE and SiT differ
only by their task object (``decay_jax.train.tasks``). Resuming is automatic: if ``workdir`` holds a
checkpoint, training continues from it, with the same masks, noise and data order as an
uninterrupted run (in-memory datasets) because every random draw is keyed by the step.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Dict, Optional

import jax
import numpy as np
from absl import logging
from PIL import Image

from decay_jax import logs, paths
from decay_jax import sharding as shd
from decay_jax.data import on_device
from decay_jax.data import pipeline
from decay_jax.train import evaluation, profiling, progress, setup, tasks, writers
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import config as config_lib
from decay_jax.train import failures
from decay_jax.train import lease as lease_lib
from decay_jax.train import step as step_lib


# Batches on the devices ahead of the step: one is enough to hide a copy behind a step; the second
# absorbs the variation of the host's batch time (big_vision prefetches 2 as well).
DEVICE_PREFETCH = 2


class NonFiniteLossError(failures.Diverged):
  """Training produced a NaN/Inf loss or gradient; the checkpoints on disk (all finite: a state
  with a non-finite value is never saved) are kept. One line (``str()``), exit status 3."""


class _Preemption:
  """SIGTERM sets a flag; the loop saves a checkpoint at the next step boundary and stops (the
  command then exits with ``failures.PREEMPTED``, 143). Installed for the loop only: before it
  (startup, restore, compilation) the command's handler (``failures.raise_on_sigterm``) stops the
  run at once, as there is nothing new to save; it is put back when the loop and its last saves
  are done.

  With several processes, JAX's preemption sync point makes all hosts stop at the same step.
  """

  def __init__(self):
    failures.stop_if_terminated()  # a SIGTERM of the startup whose exception Python dropped
    self.flag = False
    self._previous = None
    if jax.process_count() == 1:
      try:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
      except ValueError:  # not the main thread (e.g. some test runners): no handler
        self._previous = None

  def _handle(self, signum, frame):
    logging.warning("SIGTERM received: saving a checkpoint at the next step boundary")
    self.flag = True

  def reached(self, step: int) -> bool:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      return self.flag or multihost_utils.reached_preemption_sync_point(step)
    return self.flag

  def restore(self):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _save_picture(workdir: str, step: int, picture: np.ndarray, writer, name: str) -> str:
  path = paths.join(workdir, "pictures", f"step_{step:07d}.png")
  scale = max(1, 384 // picture.shape[0])  # small images (28-px digits) are enlarged to be seen
  paths.save_png(path, Image.fromarray(picture).resize(
      (picture.shape[1] * scale, picture.shape[0] * scale), Image.Resampling.NEAREST))
  writer.write_images(step, {name: picture[None]})
  return path


def _check_finite(history, step: int, ckpts) -> None:
  """Raises if any logged loss or gradient norm since the last check is not finite."""
  for i, m in history:
    if not (np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])):
      ckpts.wait()
      last = ckpts.latest_step()
      newest = ("no checkpoint saved yet (a rerun starts afresh)" if last is None else
                f"the newest checkpoint is step {last}, finite (a rerun resumes from it)")
      raise NonFiniteLossError(
          f"training diverged: non-finite loss/gradient at step {i} (loss={m['loss']}, "
          f"grad_norm={m['grad_norm']}); {newest}; lower the learning rate (or use float32) and "
          "rerun")


def train_and_evaluate(config, workdir: str,
                       evaluators: Optional[evaluation.MakeEvaluators] = None) -> Dict[str, Any]:
  """Trains (or resumes) the configured model in ``workdir``; returns the final metrics.

  ``evaluators``: ``(config, model, mesh) -> {name: evaluator}`` run during training (e.g.
  ``decay_jax.evals.registry.build``, which ``decay_jax.cli.train`` passes); ``None`` runs none.
  """
  # ---------------------------------------------------------------------------------------------
  # Validate everything before compiling anything.
  # ---------------------------------------------------------------------------------------------
  config_lib.validate(config)
  task_cls = tasks.get(config.task)
  task_cls.check_config(config)
  start_from = task_cls.load_start(config, shd.make_mesh(config.mesh.data, config.mesh.fsdp))
  s = setup.build(config, pretrained_model=start_from[0] if start_from else None)
  model, task, mesh = s.model, s.task, s.mesh
  total_steps, warmup_steps = s.total_steps, s.warmup_steps
  evaluators = evaluation.make(config, model, mesh, evaluators, task)
  workdir = str(paths.resolve(workdir))  # local: absolute; gs://...: unchanged
  is_main = jax.process_index() == 0
  if is_main:
    paths.write_text(paths.join(workdir, "config.json"), config.to_json_best_effort(indent=1))

  writer = writers.make_writer(workdir, is_main, config.tensorboard)
  logging.info("devices: %d (%s), processes: %d, mesh %s", jax.device_count(),
               jax.devices()[0].device_kind, jax.process_count(), dict(mesh.shape))
  if (hint := logs.cpu_malloc_hint(jax.default_backend())) is not None:
    logging.info("%s", hint)
  logging.info("model: %s, alpha_min=%s, alpha_eff=%.4g; %d steps (%d warmup), batch %d",
               type(model).__name__, model.alpha_min, model.shortcuts.alpha_eff, total_steps,
               warmup_steps, config.batch_size)

  # ---------------------------------------------------------------------------------------------
  # Train state (born sharded), checkpoints.
  # ---------------------------------------------------------------------------------------------
  use_ema = s.use_ema
  run_lease = lease_lib.acquire(workdir)  # one run per workdir: a second one stops here
  ckpts = None
  try:
    ckpts = ckpt_lib.RunCheckpoints(workdir, config.checkpoint.keep,
                                    config.checkpoint.keep_every_steps,
                                    config.checkpoint.async_save, lease=run_lease)
    # The newest checkpoint that matches its digests; damaged ones are named and moved aside.
    resumed = ckpts.restore_newest(s.abstract, s.shardings)
  except BaseException:
    if ckpts is not None:
      ckpts.failed = True  # close quietly: the error on its way is the one to report
      ckpts.close()
    run_lease.release()
    raise
  data_state = None
  if resumed is not None:
    start, state, meta = resumed
    data_state = ckpts.restore_data(start)
    logging.info("resumed from step %d (%d examples seen)", start, meta["examples_seen"])
  else:
    start, meta = 0, {}
    state = s.init_state()
    if start_from is not None:
      state["params"] = jax.device_put(task.start_params(state["params"], start_from),
                                       s.shardings["params"])
      if use_ema:  # the EMA starts as a copy of the started parameters, as from a random init
        state["ema"] = step_lib.copy_params(state["params"], s.shardings["ema"])

  # ---------------------------------------------------------------------------------------------
  # Input and the compiled step.
  # ---------------------------------------------------------------------------------------------
  # uint8 batches, put on the devices DEVICE_PREFETCH steps ahead of the step that takes them.
  batches = on_device.DevicePrefetch(
      pipeline.make_train_iterator(config.data, config.batch_size, config.seed, start_step=start,
                                   process_index=jax.process_index(),
                                   process_count=jax.process_count(), state=data_state, mesh=mesh),
      lambda local: shd.global_batch_from_local(local, mesh), DEVICE_PREFETCH)
  if start:
    logging.info("input stream at step %d: %s", start, "restored from the checkpoint's input state"
                 if batches.restored else "started at that step (the same batches)")
  t0 = time.perf_counter()
  first = next(batches)
  compiled = s.train_step.lower(state, first).compile()
  compile_seconds = time.perf_counter() - t0
  logging.info("train step compiled in %.1f s", compile_seconds)
  profiler = profiling.StepProfiler(config_lib.parse_steps(config.profile_steps),
                                    paths.join(workdir, "profile"), compiled.as_text)

  # ---------------------------------------------------------------------------------------------
  # Train loop.
  # ---------------------------------------------------------------------------------------------
  report = progress.ReportProgress(num_train_steps=total_steps, writer=writer)
  preemption = _Preemption()
  fixed_pictures = evaluators.picture_batch()
  history, preempted = [], False
  results = {"compile_seconds": compile_seconds, "step": start, "loss": meta.get("loss"),
             **meta.get("losses", {})}
  evaluated = False
  window_start, window_cpu, window_steps = time.perf_counter(), time.process_time(), 0
  step, batch = start, first
  try:
    while step < total_steps:
      profiler.before(step)
      with jax.profiler.StepTraceAnnotation("train", step_num=step):
        state, metrics = compiled(state, batch)
      profiler.after(step, metrics)
      step += 1
      window_steps += 1
      history.append((step, metrics))
      step_lib.bound_in_flight([m for _, m in history])
      report(step)
      last = step == total_steps
      preempted = preemption.reached(step) and not last
      if step % config.log_every_steps == 0 or last or preempted:
        fetched = [(i, jax.device_get(m)) for i, m in history]
        history = []
        _check_finite(fetched, step, ckpts)
        elapsed = time.perf_counter() - window_start
        scalars = {k: float(np.mean([m[k] for _, m in fetched])) for k in fetched[-1][1]}
        # Wall and CPU seconds (this process, all threads) per step of the window: what
        # `decay_jax.cli.bench --from_trainer` reads to compare with its own timing.
        scalars["step_seconds"] = elapsed / window_steps
        scalars["step_cpu_seconds"] = (time.process_time() - window_cpu) / window_steps
        scalars.update(s.rates(scalars["step_seconds"]))
        writer.write_scalars(step, scalars)
        # The final window's mean of every loss term (loss; loss_v, loss_proj with SiT).
        results.update(step=step, **{k: v for k, v in scalars.items() if k.startswith("loss")
                                     and "/" not in k})
        window_start, window_cpu, window_steps = time.perf_counter(), time.process_time(), 0
      if config.picture_every_steps and (step % config.picture_every_steps == 0 or last):
        if fixed_pictures is not None or not task.picture_needs_batch:
          shown = state["ema"] if use_ema else state["params"]  # SiT samples with the EMA
          # Every process runs the picture program (FSDP parameters may span hosts); one saves it.
          picture = task.picture(shown, fixed_pictures, jax.random.key(config.seed),
                                 live=state["params"])
          if is_main:
            _save_picture(workdir, step, picture, writer, task.picture_name)
      save_every = config.checkpoint.every_steps
      if (save_every and step % save_every == 0) or last or preempted:
        if history:
          fetched = [(i, jax.device_get(m)) for i, m in history]
          _check_finite(fetched, step, ckpts)
        ckpts.save(step, state, {"step": step, "examples_seen": step * config.batch_size,
                                 "seed": config.seed, "task": config.task,
                                 "loss": results["loss"],
                                 "losses": {k: v for k, v in results.items()
                                            if k.startswith("loss_")}},
                   data=batches.get_state())
      if evaluators.due(step, last):
        with report.timed("eval"):
          ev = evaluators.run(state["params"], step, last, state["ema"] if use_ema else None)
        writer.write_scalars(step, ev)
        results.update(ev)
        evaluated = last
      if preempted:
        logging.warning("stopped at step %d after SIGTERM, its checkpoint saved; rerun the same "
                        "command to resume (the command exits with status %d)", step,
                        failures.PREEMPTED)
        break
      if not last:
        with jax.profiler.TraceAnnotation("input"):  # the host's share, named in a profile
          batch = next(batches)
    if start >= total_steps and not evaluated:  # resumed a finished run: report its evaluations
      ev = evaluators.run(state["params"], step, True, state["ema"] if use_ema else None)
      writer.write_scalars(step, ev)
      results.update(ev)
  finally:
    profiler.close()
    batches.close()
    try:
      ckpts.close()  # the saves in flight end before SIGTERM goes back to the command's handler
      writer.flush()
    finally:
      preemption.restore()
      run_lease.release()
  results["preempted"] = preempted
  if is_main:
    results.update(task_cls.final_results(workdir))
    paths.write_json(paths.join(workdir, "results.json"), results)
  return results
