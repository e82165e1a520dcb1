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
from decay_jax.models import factory, flops
from decay_jax.models import vit
from decay_jax.train import evaluation, finetune_optim, optim, pretrained, profiling, progress
from decay_jax.train import tasks, writers
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import config as config_lib
from decay_jax.train import step as step_lib


# Batches on the devices ahead of the step: one is enough to hide a copy behind a step; the second
# absorbs the variation of the host's batch time (big_vision prefetches 2 as well).
DEVICE_PREFETCH = 2


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN/Inf loss or gradient; the last good checkpoint is kept."""


def make_task(config, model, info):
  mean, std = pipeline.normalization(config.data, info["channels"])
  if config.task == "mae":
    return tasks.MAETask(model, mean=mean, std=std)
  if config.task == "finetune":
    return tasks.FinetuneTask(model, config.mixup, mean=mean, std=std)
  if config.task == "uvit":
    return tasks.UViTTask(model, config.diffusion, config.sample, mean=mean, std=std)
  return tasks.SiTTask(model, config.transport.to_dict(), config.sample, mean=mean, std=std)


def make_optimizer(config, task, total_steps: int, warmup_steps: int):
  """``(optax transformation, lr schedule)`` of a config: pre-training's AdamW, or fine-tuning's
  layer-wise lr decay over the classifier's parameter names (``finetune_optim``)."""
  if config.task == "finetune":
    model = task.model
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *task.init_inputs(1))["params"])
    return finetune_optim.from_config(config.optim, config.batch_size, total_steps, warmup_steps,
                                      shapes, model.depth)
  return optim.make_optimizer(config.optim, config.batch_size, total_steps, warmup_steps)


def jit_train_step(config, task, tx, schedule, shardings, mesh):
  """The jitted, donated train step of ``config`` that the trainer runs (and ``cli.bench`` times)."""
  return step_lib.jit_train_step(
      step_lib.make_train_step(task, tx, schedule, config.accum_steps, config.ema_decay),
      shardings, mesh)


class _Preemption:
  """SIGTERM sets a flag; the loop saves a checkpoint at the next step boundary and stops.

  With several processes, JAX's preemption sync point makes all hosts stop at the same step.
  """

  def __init__(self):
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
      raise NonFiniteLossError(
          f"non-finite loss/gradient at step {i} (loss={m['loss']}, grad_norm={m['grad_norm']}); "
          f"stopping. The last good checkpoint is step {last} in the workdir's checkpoints/; "
          "lower the learning rate or use float32 and resume from it.")


def check_config(config, pretrained_model=None):
  """Every check that needs no compilation; raises a one-line ValueError. Returns the pieces.

  ``pretrained_model``: the MAE a fine-tuning run starts from (``pretrained.load``).
  """
  config_lib.validate(config)
  info = pipeline.dataset_info(config.data)
  model = factory.build_model(config, info, pretrained_model)
  mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp)
  shd.check_batch(config.batch_size, mesh, config.accum_steps)
  return info, model, mesh


def train_and_evaluate(config, workdir: str,
                       evaluators: Optional[evaluation.MakeEvaluators] = None) -> Dict[str, Any]:
  """Trains (or resumes) the configured model in ``workdir``; returns the final metrics.

  ``evaluators``: ``(config, model, mesh) -> {name: evaluator}`` run during training (e.g.
  ``decay_jax.evals.registry.build``, which ``decay_jax.cli.train`` passes); ``None`` runs none.
  """
  # ---------------------------------------------------------------------------------------------
  # Validate everything before compiling anything.
  # ---------------------------------------------------------------------------------------------
  start_from = None  # fine-tuning: (pre-trained MAE, its parameters)
  if config.task == "finetune" and config.init_from:
    config_lib.validate(config)
    start_from = pretrained.load(config.init_from,
                                 shd.make_mesh(config.mesh.data, config.mesh.fsdp))
  info, model, mesh = check_config(config, start_from[0] if start_from else None)
  task = make_task(config, model, info)
  total_steps, warmup_steps = config_lib.steps_for(config, info["num_train"])
  evaluators = evaluation.make(config, model, mesh, evaluators)
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
  # Optimiser, train state (born sharded), checkpoints.
  # ---------------------------------------------------------------------------------------------
  tx, schedule = make_optimizer(config, task, total_steps, warmup_steps)
  use_ema = config.ema_decay > 0
  abstract = step_lib.abstract_state(task, tx, config.seed, use_ema)
  shardings = step_lib.state_shardings(abstract, tx, mesh)
  ckpts = ckpt_lib.RunCheckpoints(workdir, config.checkpoint.keep,
                                  config.checkpoint.keep_every_steps, config.checkpoint.async_save)
  start = ckpts.latest_step()
  data_state = None
  if start is not None:
    state, meta = ckpts.restore(start, abstract, shardings)
    data_state = ckpts.restore_data(start)
    logging.info("resumed from step %d (%d examples seen)", start, meta["examples_seen"])
  else:
    start, meta = 0, {}
    state = jax.jit(lambda: step_lib.init_state(task, tx, config.seed, use_ema),
                    out_shardings=shardings)()
    if start_from is not None:  # the encoder of pre-training; fc_norm and head stay fresh
      params = vit.init_from_mae(state["params"], *start_from)
      state["params"] = jax.device_put(params, shardings["params"])
      logging.info("initialised from %s: patch_embed, cls_token, pos_embed and %d blocks "
                   "(alpha_min %s); fc_norm and head fresh", config.init_from, model.depth,
                   model.alpha_min)

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
    logging.info("input stream at step %d: %s", start, "restored from the checkpoint's Grain state"
                 if batches.restored else "started at that step (the same batches)")
  train_step = jit_train_step(config, task, tx, schedule, shardings, mesh)
  t0 = time.perf_counter()
  first = next(batches)
  compiled = train_step.lower(state, first).compile()
  compile_seconds = time.perf_counter() - t0
  logging.info("train step compiled in %.1f s", compile_seconds)
  profiler = profiling.StepProfiler(profiling.parse_steps(config.profile_steps),
                                    paths.join(workdir, "profile"), compiled.as_text)

  # ---------------------------------------------------------------------------------------------
  # Train loop.
  # ---------------------------------------------------------------------------------------------
  flops_per_step = task.train_flops_per_example() * config.batch_size
  peak = flops.peak_flops_per_device(config.get("peak_tflops_per_device", 0.0))
  report = progress.ReportProgress(num_train_steps=total_steps, writer=writer)
  preemption = _Preemption()
  fixed_pictures = evaluators.picture_batch()
  history, preempted = [], False
  results = {"compile_seconds": compile_seconds, "step": start, "loss": meta.get("loss")}
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
        per_sec = window_steps * config.batch_size / elapsed
        # Wall and CPU seconds (this process, all threads) per step of the window: what
        # `decay_jax.cli.bench --from_trainer` reads to compare with its own timing.
        scalars["step_seconds"] = elapsed / window_steps
        scalars["step_cpu_seconds"] = (time.process_time() - window_cpu) / window_steps
        scalars["examples_per_sec"] = per_sec
        scalars["examples_per_sec_per_device"] = per_sec / jax.device_count()
        scalars["model_tflops_per_sec_per_device"] = (
            window_steps * flops_per_step / elapsed / jax.device_count() / 1e12)
        if peak:
          scalars["mfu"] = scalars["model_tflops_per_sec_per_device"] * 1e12 / peak
        writer.write_scalars(step, scalars)
        results.update(step=step, loss=scalars["loss"])
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
                                 "loss": results["loss"]}, data=batches.get_state())
      if evaluators.due(step, last):
        with report.timed("eval"):
          ev = evaluators.run(state["params"], step, last)
        writer.write_scalars(step, ev)
        results.update(ev)
        evaluated = last
      if preempted:
        logging.warning("stopped at step %d after SIGTERM; rerun the same command to resume", step)
        break
      if not last:
        with jax.profiler.TraceAnnotation("input"):  # the host's share, named in a profile
          batch = next(batches)
    if start >= total_steps and not evaluated:  # resumed a finished run: report its evaluations
      ev = evaluators.run(state["params"], step, True)
      writer.write_scalars(step, ev)
      results.update(ev)
  finally:
    profiler.close()
    preemption.restore()
    batches.close()
    ckpts.close()
    writer.flush()
  results["preempted"] = preempted
  if config.task == "finetune" and is_main:  # upstream logs the best epoch beside the last
    curve = writers.read_scalars(workdir, "accuracy/top1")
    if curve:
      results["accuracy/top1_best"] = max(v for _, v in curve)
  if is_main:
    paths.write_json(paths.join(workdir, "results.json"), results)
  return results
