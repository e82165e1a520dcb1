"""Measuring the host input pipeline: a synthetic JPEG folder, the timed stream, the host cores.

The command is ``python -m decay_jax.cli.data_bench`` (docs/data.md, "Host throughput"); this
module holds what it measures with:

``make_folder`` writes ``DIR/train/<class>/<i>.jpg`` and ``DIR/val/...``: luminance noise at seven
scales (about 1/f, as photographs), slow colour variation, three hard-edged ellipses and mild pixel
noise, JPEG quality 90, so decoding costs about what a photograph of that size costs.

``time_stream`` times the training stream the trainer builds (``pipeline.make_train_iterator``:
read, decode, crop, flip, batch, normalise to float32) for this process alone, with no model:
warm-up batches are dropped (the Grain workers start), then windows of batches are timed. It
counts the CPU seconds of the windows (this process's threads, ``time.process_time``; the worker
processes, from /proc) and of the whole run (``getrusage``: self and exited children, i.e. the
workers once the stream is closed).

``step_time`` and ``model_need`` turn a step time (given, or derived from model FLOPs at an assumed
peak and MFU) into the images/s a run consumes and the host cores that takes at the measured images
per CPU-second.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import ml_collections
import numpy as np
from PIL import Image
from PIL import ImageDraw

from decay_jax.data import pipeline

JPEG_QUALITY = 90
# (grid cells across the image, amplitude in grey levels): the luminance scales of synthetic_image.
_LUMINANCE_SCALES = ((2, 45), (4, 35), (8, 25), (16, 18), (32, 14), (64, 10), (128, 7))
_COLOUR_SCALES = ((2, 30), (4, 20), (8, 10))


def _stderr(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# A synthetic JPEG image folder.


def _smooth_field(rng: np.random.Generator, cells: int, size: int, channels: int) -> np.ndarray:
  """float32 (size, size, channels): standard normal values on a (cells + 1)^2 grid, bicubic."""
  grid = rng.standard_normal((cells + 1, cells + 1, channels)).astype(np.float32)
  return np.stack([np.asarray(Image.fromarray(grid[..., c], "F").resize(
      (size, size), Image.Resampling.BICUBIC)) for c in range(channels)], -1)


def synthetic_image(seed: int, index: int, size: int) -> np.ndarray:
  """uint8 (size, size, 3), a function of ``(seed, index)`` (see the module docstring)."""
  rng = np.random.default_rng([seed, index])
  image = sum(a * _smooth_field(rng, c, size, 1) for c, a in _LUMINANCE_SCALES)
  image = image + sum(a * _smooth_field(rng, c, size, 3) for c, a in _COLOUR_SCALES)
  image += rng.uniform(70, 180, 3).astype(np.float32)
  mask = Image.new("L", (size, size))
  draw = ImageDraw.Draw(mask)
  for k in range(1, 4):
    x0, y0 = rng.uniform(-0.2, 0.9, 2) * size
    width = rng.uniform(0.15, 0.5) * size
    draw.ellipse([x0, y0, x0 + width, y0 + width * rng.uniform(0.5, 1.5)], fill=k)
  shapes = np.asarray(mask)
  for k in range(1, 4):
    image[shapes == k] += rng.normal(0, 50, 3).astype(np.float32)
  image += rng.normal(0, 3, image.shape).astype(np.float32)
  return np.clip(image, 0, 255).astype(np.uint8)


def make_folder(directory: str, images: int, size: int, classes: int, seed: int = 0,
                log: Callable[[str], None] = _stderr) -> Dict[str, float]:
  """Writes ``directory/{train,val}/class_<k>/<i>.jpg`` (``images`` train images, a tenth of that
  but at least one per class for val; image ``i`` in class ``i % classes``).

  Returns ``{'train': n, 'val': n, 'mean_bytes': mean file size}``.
  """
  counts = {"train": images, "val": max(classes, images // 10)}
  total_bytes, done, t0 = 0, 0, time.perf_counter()
  for s, (split, count) in enumerate(counts.items()):
    for i in range(count):
      folder = os.path.join(directory, split, f"class_{i % classes:03d}")
      os.makedirs(folder, exist_ok=True)
      path = os.path.join(folder, f"{i:07d}.jpg")
      Image.fromarray(synthetic_image(seed + s, i, size)).save(path, quality=JPEG_QUALITY)
      total_bytes += os.path.getsize(path)
      done += 1
      if done % 500 == 0:
        log(f"make_folder: {done}/{sum(counts.values())} images ({time.perf_counter() - t0:.0f} s)")
  return dict(counts, mean_bytes=total_bytes / sum(counts.values()))


# ------------------------------------------------------------------------------------------------
# CPU time.


def _proc_table() -> Dict[int, Tuple[int, int]]:
  """pid -> (parent pid, utime + stime in clock ticks) of every process /proc shows."""
  table = {}
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:  # it exited meanwhile
      continue
    table[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
  return table


def worker_cpu_seconds() -> float:
  """CPU seconds (user + system) so far of this process's live descendants, i.e. Grain's worker
  processes (from /proc, in clock ticks, 10 ms on Linux; NaN without /proc)."""
  if not os.path.isfile("/proc/self/stat"):
    return float("nan")
  table = _proc_table()
  below: Dict[int, List[int]] = {}
  for pid, (ppid, _) in table.items():
    below.setdefault(ppid, []).append(pid)
  todo, ticks = list(below.get(os.getpid(), [])), 0
  while todo:
    pid = todo.pop()
    ticks += table[pid][1]
    todo += below.get(pid, [])
  return ticks / os.sysconf("SC_CLK_TCK")


def rusage_seconds() -> Dict[str, float]:
  """``{'self', 'children'}``: CPU seconds of this process and of its exited, reaped children."""
  own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
  return {"self": own.ru_utime + own.ru_stime, "children": kids.ru_utime + kids.ru_stime}


# ------------------------------------------------------------------------------------------------
# The measurement.


def time_stream(data_cfg: ml_collections.ConfigDict, batch: int, seed: int, steps: int,
                warmup: int, repeats: int, log: Callable[[str], None] = _stderr) -> dict:
  """Times ``pipeline.make_train_iterator(data_cfg, batch, seed)`` (one process).

  Returns ``windows_images_per_sec`` and their median and min, ``cores_used`` (``max(num_workers,
  1)``) and ``images_per_sec_per_core_used`` (median / cores used), the windows' wall and CPU
  seconds (``timed_wall_s``, ``timed_cpu_self_s``, ``timed_cpu_workers_s``) and
  ``images_per_cpu_sec`` (images of all windows / their CPU seconds), the whole run's
  (``run_wall_s``, ``run_cpu_self_s``, ``run_cpu_children_s``, from getrusage) and the batch
  shape. Bad config values raise ValueError before a worker starts; a record that cannot be read
  raises ``loader.InputError``.
  """
  run0, t_start = rusage_seconds(), time.perf_counter()
  stream = pipeline.make_train_iterator(data_cfg, batch, seed)
  rates, walls, own, workers, shape = [], [], [], [], None
  try:
    for _ in range(warmup):
      shape = next(stream)["image"].shape
    log(f"warm-up: {warmup} batches in {time.perf_counter() - t_start:.1f} s")
    for r in range(repeats):
      workers0 = worker_cpu_seconds()
      own0, t0 = time.process_time(), time.perf_counter()  # process_time: all our threads
      for _ in range(steps):
        shape = next(stream)["image"].shape
      walls.append(time.perf_counter() - t0)
      own.append(time.process_time() - own0)
      workers.append(worker_cpu_seconds() - workers0)
      rates.append(steps * batch / walls[-1])
      log(f"window {r + 1}/{repeats}: {rates[-1]:.1f} images/s, "
          f"{(own[-1] + workers[-1]) / walls[-1]:.2f} cores busy")
  finally:
    stream.close()
  run1 = rusage_seconds()
  cpu = sum(own) + sum(workers)
  cores_used = max(int(data_cfg.num_workers), 1)
  return {
      "batch_shape": list(shape),
      "windows_images_per_sec": rates,
      "images_per_sec_median": statistics.median(rates),
      "images_per_sec_min": min(rates),
      "cores_used": cores_used,
      "images_per_sec_per_core_used": statistics.median(rates) / cores_used,
      "timed_wall_s": sum(walls),
      "timed_cpu_self_s": sum(own),
      "timed_cpu_workers_s": sum(workers),
      "images_per_cpu_sec": repeats * steps * batch / cpu if cpu > 0 else float("nan"),
      "run_wall_s": time.perf_counter() - t_start,
      "run_cpu_self_s": run1["self"] - run0["self"],
      "run_cpu_children_s": run1["children"] - run0["children"],
  }


def step_time(target_step_time: float, flops_per_image: Optional[float], global_batch: int,
              chips: int, peak_tflops: float, mfu: float) -> Tuple[float, str]:
  """``(seconds per step, how it was obtained)``: ``target_step_time`` if positive, else
  ``flops_per_image x global_batch / (chips x peak_tflops 1e12 x mfu)``."""
  if target_step_time > 0:
    return float(target_step_time), "given"
  seconds = flops_per_image * global_batch / (chips * peak_tflops * 1e12 * mfu)
  return seconds, (f"derived: {flops_per_image / 1e9:.1f} GFLOP/image x {global_batch} over "
                   f"{chips} chips x {peak_tflops:g} TFLOP/s x MFU {mfu:g}")


def model_need(global_batch: int, seconds: float, hosts: int, images_per_cpu_sec: float) -> dict:
  """What a run of ``global_batch`` images every ``seconds`` over ``hosts`` hosts consumes, and
  the host cores that takes at ``images_per_cpu_sec`` (one core busy for a second)."""
  need = global_batch / seconds
  per_core = images_per_cpu_sec if images_per_cpu_sec > 0 else float("nan")
  return {"needed_images_per_sec": need, "needed_images_per_sec_per_host": need / hosts,
          "host_cores_needed_all": need / per_core, "host_cores_needed": need / hosts / per_core}
