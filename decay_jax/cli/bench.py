"""Benchmark the train step of a config: compile seconds, images/s, model TFLOP/s, MFU, memory.

    python -m decay_jax.cli.bench --config=configs/mae_vit_b16.py --batch_per_device=64 --steps=20
    python -m decay_jax.cli.bench --config=configs/mae_vit_h14.py --compile_only --fake_devices=8
    python -m decay_jax.cli.bench --config=configs/mae_cpu_mnist.py --torch   # + PyTorch reference
    python -m decay_jax.cli.bench --task=sit --preset=XL/2 --compile_only --batch_per_device=32
    python -m decay_jax.cli.bench --config=configs/sit_xl2.py --compile_only --topology=v5p-8
    python -m decay_jax.cli.bench --from_trainer=WORKDIR      # a run's own timing beside the bench's
    python -m decay_jax.cli.bench --config=configs/mae_cpu_mnist.py --profile_steps=5,3

What is timed is the trainer's step: the same jitted, donated function
(``train.setup.build``), compiled the same way (lowered on the concrete state and batch) and
dispatched the same way (at most ``step.MAX_IN_FLIGHT`` steps ahead of the device). One warm-up
step, then ``--repeats`` windows of ``--steps`` steps; wall and CPU seconds (this process, all
threads) per step are printed as the median window and the fastest. Inputs are synthetic (the
model's shape, standard normal), so no dataset is needed and the input pipeline is not timed.

``--from_trainer=WORKDIR`` reads the run's ``metrics.jsonl`` (the trainer logs wall and CPU
seconds per step for every logging window), prints the median and fastest window (the first
window, which warms caches and the input pipeline, is left out), and then benchmarks the run's
own config (``WORKDIR/config.json``, or ``--config``) for the ratio of the two.

``--profile_steps=START,COUNT`` (or ``--config.profile_steps``) traces those timed steps into
``--profile_dir``; ``python -m decay_jax.cli.trace_table DIR`` tables the trace by op category.
With ``--compile_only`` nothing is allocated: the step is lowered and compiled on abstract inputs
and XLA's memory analysis is printed; with ``--topology=SLICE`` it is compiled by the TPU compiler
for that slice (libtpu, on this CPU) and the TPU report of ``decay_jax.perf.tpu`` is printed
(memory per chip, XLA's costs, loops per trip, the cost model's step time and MFU). ``--fake_devices=N`` makes N CPU devices to size pods on a
laptop. ``--torch`` times the PyTorch reference of the tests (fp32, same
batch, AdamW) on the same machine and prints the ratio.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

from decay_jax import paths
from decay_jax import sharding as shd
from decay_jax.cli import errors
from decay_jax.models import flops
from decay_jax.perf import memory, tpu, trace_table
from decay_jax.train import config as config_lib
from decay_jax.train import profiling, tasks, writers
from decay_jax.train import step as step_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_TASK = flags.DEFINE_enum("task", "mae", list(tasks.TASKS), "Without --config: the task's defaults.")
_PRESET = flags.DEFINE_string("preset", None, "Without --config: the model preset (e.g. XL/2).")
_DTYPE = flags.DEFINE_string("dtype", None, "Override model.dtype (float32, bfloat16).")
_REMAT = flags.DEFINE_string("remat", None, "Override model.remat_policy (none, full, dots, dots_context).")
_BATCH = flags.DEFINE_integer("batch_per_device", 0, "Per-device batch (0: the config's batch).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per repeat (after one warm-up step).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed windows of --steps steps; min and median.")
_COMPILE_ONLY = flags.DEFINE_bool("compile_only", False, "Only lower + compile on abstract inputs.")
_FAKE_DEVICES = flags.DEFINE_integer("fake_devices", 0, "Fake CPU devices (0: this machine's).")
_TOPOLOGY = flags.DEFINE_string("topology", None, "With --compile_only: compile for this TPU "
                                "slice with libtpu (v5p-8, v5e-16, v6e:4x4, ...).")
_NUM_SLICES = flags.DEFINE_integer("num_slices", 1, "With --topology: slices of a multi-slice job.")
_CHANNELS = flags.DEFINE_integer("channels", 0, "Input channels (0: 3 for MAE, 4 for SiT).")
_TORCH = flags.DEFINE_bool("torch", False, "Also time the PyTorch reference (CPU, fp32).")
_TORCH_PROFILE = flags.DEFINE_bool(
    "torch_profile", False, "With --torch: also profile --steps of the reference (torch.profiler) "
    "and print its ms per step in trace_table's categories, to set beside trace_table's of a "
    "--profile_steps trace of ours.")
_OUT = flags.DEFINE_string("out", None, "Append the result as one JSON line to this file.")
_FROM_TRAINER = flags.DEFINE_string(
    "from_trainer", None, "A run's workdir: its logged step times, then the bench of its config.")
_PROFILE_STEPS = flags.DEFINE_string(
    "profile_steps", None, "START,COUNT of the timed steps to trace (overrides the config's).")
_PROFILE_DIR = flags.DEFINE_string(
    "profile_dir", os.path.join(tempfile.gettempdir(), "decay_jax_bench_profile"),
    "Where --profile_steps writes its trace.")


def trainer_timing(workdir: str) -> dict:
  """Step times a run logged (``metrics.jsonl``): median and fastest window, first one left out.

  Runs from before the trainer logged ``step_seconds`` give it from ``examples_per_sec`` and the
  run's batch size (no CPU seconds then).
  """
  path = paths.join(workdir, writers.JSONL)
  if not paths.exists(path):
    raise ValueError(f"from_trainer={workdir!r} is not allowed; it has no {writers.JSONL} (not a "
                     "workdir of decay_jax.cli.train)")
  batch = tasks.run_config(workdir).batch_size
  rows = [r for r in writers.read_rows(workdir) if "examples_per_sec" in r]
  if len(rows) < 2:
    raise ValueError(f"from_trainer={workdir!r} is not allowed; it logged {len(rows)} timing "
                     "window(s), at least 2 are needed (the first warms up)")
  rows = rows[1:]
  wall = [r.get("step_seconds", batch / r["examples_per_sec"]) for r in rows]
  res = {"trainer_workdir": workdir, "trainer_windows": len(rows),
         "trainer_last_step": rows[-1]["step"],
         "trainer_step_seconds": round(float(np.median(wall)), 5),
         "trainer_step_seconds_min": round(min(wall), 5),
         "trainer_images_per_sec": round(batch / float(np.median(wall)), 1)}
  cpu = [r["step_cpu_seconds"] for r in rows if "step_cpu_seconds" in r]
  if cpu:
    res["trainer_step_cpu_seconds"] = round(float(np.median(cpu)), 5)
  return res


def time_steps(compiled, state, data, steps: int, repeats: int, profiler):
  """``(state, walls, cpus)``: seconds per step of each window of ``steps`` steps.

  Steps are dispatched as the trainer dispatches them (``step.bound_in_flight``); the bench's
  step numbers for ``profiler`` run from 0 over all windows.
  """
  walls, cpus, k = [], [], 0
  for _ in range(repeats):
    t, cpu, outputs = time.perf_counter(), time.process_time(), []
    for _ in range(steps):
      profiler.before(k)
      with jax.profiler.StepTraceAnnotation("train", step_num=k):
        state, m = compiled(state, data)
      profiler.after(k, m)
      outputs.append(m)
      step_lib.bound_in_flight(outputs)
      k += 1
    jax.block_until_ready(outputs[-1])
    walls.append((time.perf_counter() - t) / steps)
    cpus.append((time.process_time() - cpu) / steps)
  return state, walls, cpus


def torch_reference_seconds(config, model, batch: int, steps: int, profile: bool = False):
  """``(seconds per train step, ms per step by category or None)`` of the PyTorch reference
  (tests/torch_reference.py) on CPU; with ``profile``, ``steps`` more steps under torch.profiler
  (forward and backward; the optimizer's step timed apart) summed by
  ``trace_table.torch_summary``."""
  tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests")
  if not os.path.isfile(os.path.join(tests, "torch_reference.py")):
    raise ValueError("--torch is not allowed here; it needs a checkout of decay-jax (it runs "
                     "tests/torch_reference.py)")
  sys.path.insert(0, tests)
  import torch
  import torch_reference as ref

  torch.manual_seed(0)
  tm, loss_fn = ref.training_loss(config.task, model, batch)
  tm.train()
  opt = torch.optim.AdamW([p for p in tm.parameters() if p.requires_grad], lr=1e-4)

  def one():
    opt.zero_grad(set_to_none=True)
    loss_fn().backward()
    opt.step()

  one()
  t = time.perf_counter()
  for _ in range(steps):
    one()
  seconds = (time.perf_counter() - t) / steps
  if not profile:
    return seconds, None
  from torch.profiler import ProfilerActivity
  with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(steps):
      opt.zero_grad(set_to_none=True)
      loss_fn().backward()
  t = time.perf_counter()
  for _ in range(steps):
    opt.step()
  optimizer_ms = (time.perf_counter() - t) / steps * 1e3
  self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
  return seconds, trace_table.torch_summary(self_us, steps, optimizer_ms)


def main(argv):
  del argv
  if _TOPOLOGY.value and _COMPILE_ONLY.value:  # compile targets only: leave this host's devices
    jax.config.update("jax_platforms", "cpu")
  if _FAKE_DEVICES.value:  # before anything touches the backend
    if _FAKE_DEVICES.value < 1:
      print(f"error: --fake_devices={_FAKE_DEVICES.value} is not allowed; it must be >= 1",
            file=sys.stderr)
      return 2
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", _FAKE_DEVICES.value)
  config = _CONFIG.value
  try:  # bad value: one line, nothing compiled
    trained = trainer_timing(_FROM_TRAINER.value) if _FROM_TRAINER.value else {}
    if config is None and _FROM_TRAINER.value:
      config = tasks.run_config(_FROM_TRAINER.value)
    if config is None:
      config = tasks.get(_TASK.value).default_config()
    config_lib.override(config, **config_lib.model_overrides(
        preset=None if _CONFIG.value is not None or trained else _PRESET.value,
        dtype=_DTYPE.value, remat=_REMAT.value))
    if _PROFILE_STEPS.value is not None:
      config_lib.override(config, profile_steps=_PROFILE_STEPS.value)
    config_lib.validate(config)
    window = config_lib.parse_steps(config.profile_steps)
    if window and sum(window) > _STEPS.value * _REPEATS.value:
      raise ValueError(f"profile_steps={config.profile_steps!r} is not allowed; the bench times "
                       f"{_STEPS.value * _REPEATS.value} steps (--steps x --repeats), numbered from 0")
    if _TORCH.value and not tasks.get(config.task).torch_reference:
      raise ValueError(f"--torch is not allowed with task={config.task!r}; the PyTorch reference "
                       "times MAE and SiT pre-training")
    if _TOPOLOGY.value and not _COMPILE_ONLY.value:
      raise ValueError(f"--topology={_TOPOLOGY.value} is not allowed without --compile_only; "
                       "there is no TPU here to time the step on")
    target = tpu.target(_TOPOLOGY.value, _NUM_SLICES.value) if _TOPOLOGY.value else None
    mesh = (tpu.mesh(config, target) if target else
            shd.make_mesh(config.mesh.data, config.mesh.fsdp))
    batch = _BATCH.value * mesh.size if _BATCH.value else config.batch_size
    s = memory.build(config, batch, _CHANNELS.value, mesh)  # checks the config and the model
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if target:
    row = tpu.compile_report(config, target, batch, _CHANNELS.value)
    print("\n".join(tpu.summary_lines(row)))
    if _OUT.value:
      paths.append_text(_OUT.value, json.dumps(row) + "\n")
    return 0
  model, task = s.model, s.task
  a_state, a_batch = s.abstract_args()
  if _COMPILE_ONLY.value:  # abstract inputs: nothing allocated
    state, data = a_state, a_batch
  else:
    rng = np.random.default_rng(0)
    shape, dtype = a_batch["image"].shape, np.dtype(a_batch["image"].dtype)
    # The stream's dtype: uint8 pixels (normalised inside the step) or float32 latents.
    image = (rng.integers(0, 256, shape, np.uint8) if dtype == np.uint8
             else rng.standard_normal(shape, np.float32))
    local = {"image": image,
             "label": rng.integers(0, 10, batch).astype(np.int32)}
    data = shd.global_batch_from_local(local, mesh)
    state = s.init_state()
  # Lowered on the concrete state and batch, as the trainer does, unless --compile_only.
  t0 = time.perf_counter()
  lowered = s.train_step.lower(state, data)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  lower_seconds, compile_seconds = t1 - t0, time.perf_counter() - t1
  n_params = sum(int(np.prod(l.shape)) for l in jax.tree_util.tree_leaves(s.abstract["params"]))
  name = (os.path.basename(config_flags.get_config_filename(flags.FLAGS["config"]))
          if _CONFIG.value is not None else
          os.path.join(_FROM_TRAINER.value, "config.json") if trained else f"{config.task} defaults")
  res = {"config": name,
         "preset": config.model.preset,
         "alpha_min": model.alpha_min, "dtype": config.model.dtype, "remat": config.model.remat_policy,
         "attention": model.attention_impl or "auto", "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "devices": mesh.size, "device_kind": jax.devices()[0].device_kind,
         "mesh": dict(mesh.shape), "global_batch": batch, "accum_steps": config.accum_steps,
         "params": n_params, "model_gflops_per_example": task.train_flops_per_example() / 1e9,
         "lower_seconds": round(lower_seconds, 2),
         "compile_seconds": round(compile_seconds, 2), **memory.memory_report(compiled)}
  if hasattr(model, "residual_routing"):  # SiT: routing's parameters and FLOPs against plain
    res.update(flops.overhead(model))
  if not _COMPILE_ONLY.value:
    state, m = compiled(state, data)
    jax.block_until_ready(m)
    profiler = profiling.StepProfiler(window, _PROFILE_DIR.value, compiled.as_text)
    try:
      state, walls, cpus = time_steps(compiled, state, data, _STEPS.value, _REPEATS.value,
                                      profiler)
    finally:
      profiler.close()
    if profiler.run_dir:
      res["profile"] = profiler.run_dir
    # The median window is the figure; the min says how much a busy machine stretched it.
    sec = float(np.median(walls))
    res.update(step_seconds_min=round(min(walls), 5), repeats=_REPEATS.value, steps=_STEPS.value)
    # CPU seconds of this process (all threads) per step: on CPU, the work done, which a shared
    # machine inflates less than the wall clock.
    res["step_cpu_seconds"] = round(float(np.median(cpus)), 5)
    rates = s.rates(sec)
    res.update(step_seconds=round(sec, 5), images_per_sec=round(rates["examples_per_sec"], 1),
               images_per_sec_per_device=round(rates["examples_per_sec_per_device"], 1),
               model_tflops_per_sec_per_device=round(rates["model_tflops_per_sec_per_device"], 4))
    if "mfu" in rates:
      res["mfu"] = round(rates["mfu"], 4)
    res.update(trained)
    if trained:  # above 1: the bench's step is slower than the trainer's logged one
      res["bench_over_trainer"] = round(sec / trained["trainer_step_seconds"], 3)
    if _TORCH.value:
      tsec, ops = torch_reference_seconds(config, model, batch, _STEPS.value,
                                          _TORCH_PROFILE.value)
      res.update(torch_step_seconds=round(tsec, 5), torch_images_per_sec=round(batch / tsec, 1),
                 speedup_vs_torch=round(tsec / sec, 3))
      if ops is not None:
        res["torch_op_ms"] = {c: round(v, 2) for c, v in ops.items()}
  for k, v in res.items():
    print(f"{k:>32}: {v}")
  if _OUT.value:
    paths.append_text(_OUT.value, json.dumps(res) + "\n")
  return 0


def run():
  errors.run(main)


if __name__ == "__main__":
  run()
