"""Measuring the host input pipeline: a synthetic JPEG folder, the timed stream, the host cores.

The command is ``python -m decay_jax.cli.data_bench`` (docs/data.md, "Host throughput"); this
module holds what it measures with:

``make_folder`` writes ``DIR/train/<class>/<i>.jpg`` and ``DIR/val/...``: luminance noise at seven
scales (about 1/f, as photographs), slow colour variation, three hard-edged ellipses and mild pixel
noise, JPEG quality 90, so decoding costs about what a photograph of that size costs.

``time_stream`` times the training stream the trainer builds (``pipeline.make_train_iterator``:
read, decode, crop, flip, batch, and whatever the stream does in the training process) for this
process alone, with no model; each batch is taken as the trainer takes it, copied to the default
JAX device (``DeviceConsumer``), so the training process pays for reading every page of it.
Warm-up batches are dropped (the Grain workers start), then windows of batches are timed. It
counts the CPU seconds of the windows (this process's threads, ``time.process_time``, also per
image: the ceiling one training process sets; the worker processes, from /proc) and of the whole
run (``getrusage``: self and exited children, i.e. the workers once the stream is closed), and
samples the resident memory of this process and of each worker after every timed batch (/proc
``status``; the workers are this process's children, found through /proc).

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

from decay_jax import sharding as shd
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
# Processes: CPU time, resident memory, the libraries a worker has loaded.


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


def _children(pid: int) -> Optional[List[int]]:
  """Direct children of ``pid`` from /proc/<pid>/task/*/children (None where the kernel has no
  such file)."""
  try:
    tasks = os.listdir(f"/proc/{pid}/task")
  except OSError:
    return []
  found: List[int] = []
  for task in tasks:
    try:
      with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
        found += [int(x) for x in f.read().split()]
    except FileNotFoundError:
      if not os.path.exists(f"/proc/{pid}/task/{task}"):
        continue  # the thread ended meanwhile
      return None
    except OSError:
      continue
  return found


def descendants(pid: Optional[int] = None) -> List[int]:
  """The live descendants of ``pid`` (default: this process), sorted."""
  root = os.getpid() if pid is None else pid
  todo, found = [root], []
  while todo:
    kids = _children(todo.pop())
    if kids is None:  # no children files: the whole process table
      table = _proc_table()
      below: Dict[int, List[int]] = {}
      for p, (ppid, _) in table.items():
        below.setdefault(ppid, []).append(p)
      todo, found = [root], []
      while todo:
        kids = below.get(todo.pop(), [])
        found += kids
        todo += kids
      return sorted(found)
    found += kids
    todo += kids
  return sorted(found)


def _cpu_ticks(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
  except OSError:  # it exited meanwhile
    return 0
  return int(fields[11]) + int(fields[12])


def worker_cpu_seconds() -> float:
  """CPU seconds (user + system) so far of this process's live descendants, i.e. Grain's worker
  processes (from /proc, in clock ticks, 10 ms on Linux; NaN without /proc)."""
  if not os.path.isfile("/proc/self/stat"):
    return float("nan")
  return sum(_cpu_ticks(p) for p in descendants()) / os.sysconf("SC_CLK_TCK")


def worker_pids() -> List[int]:
  """This process's input workers: its descendants but multiprocessing's resource tracker (Grain
  starts its workers with the spawn method, as children of the training process), sorted."""
  found = []
  for pid in descendants():
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
    except OSError:
      continue
    if b"resource_tracker" not in cmdline:
      found.append(pid)
  return found


def memory_mb(pid: Optional[int] = None) -> Optional[Dict[str, float]]:
  """``{'rss', 'hwm', 'anon', 'file', 'shmem'}`` in MB (1e6 bytes) from /proc/<pid>/status: VmRSS,
  its peak VmHWM and its anonymous, file-backed and shared-memory parts; None if it has exited."""
  keys = {b"VmRSS:": "rss", b"VmHWM:": "hwm", b"RssAnon:": "anon", b"RssFile:": "file",
          b"RssShmem:": "shmem"}
  try:
    with open(f"/proc/{'self' if pid is None else pid}/status", "rb") as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  out = {}
  for line in lines:
    parts = line.split()
    if parts and parts[0] in keys:
      out[keys[parts[0]]] = int(parts[1]) * 1024 / 1e6  # kB (KiB)
  return out or None


# Shared libraries that show which heavy Python packages a process has imported.
HEAVY_LIBRARIES = {"jaxlib": "/jaxlib/", "tensorflow": "/tensorflow/",
                   "tensorstore": "/tensorstore/", "torch": "/torch/lib/"}


def loaded_libraries(pid: int) -> Optional[List[str]]:
  """Which of ``HEAVY_LIBRARIES`` process ``pid`` has mapped (i.e. imported: jaxlib for jax, flax
  and optax; tensorstore for orbax; tensorflow for TensorFlow and clu), from /proc/<pid>/maps;
  None if it cannot be read."""
  try:
    with open(f"/proc/{pid}/maps", "r", encoding="utf-8", errors="replace") as f:
      maps = f.read()
  except OSError:
    return None
  return [name for name, part in HEAVY_LIBRARIES.items() if part in maps]


def rusage_seconds() -> Dict[str, float]:
  """``{'self', 'children'}``: CPU seconds of this process and of its exited, reaped children."""
  own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
  return {"self": own.ru_utime + own.ru_stime, "children": kids.ru_utime + kids.ru_stime}


class MemorySampler:
  """The peak resident memory of this process and of each worker over the samples taken."""

  def __init__(self):
    self.self_peak: Dict[str, float] = {}
    self.workers: List[int] = []
    self.worker_peak: Dict[int, Dict[str, float]] = {}

  def find_workers(self) -> None:
    self.workers = worker_pids()

  def sample(self) -> None:
    for pid, peak in [(None, self.self_peak)] + [
        (p, self.worker_peak.setdefault(p, {})) for p in self.workers]:
      now = memory_mb(pid)
      for key, value in (now or {}).items():
        if key != "hwm":
          peak[key] = max(peak.get(key, 0.0), value)


# ------------------------------------------------------------------------------------------------
# The measurement.


class DeviceConsumer:
  """Takes each batch as the trainer does: ``jax.device_put(batch['image'])`` and waits for it, so
  every page of the batch is read once. Where the copy would not happen (JAX's CPU backend aliases
  a suitably aligned host array instead of copying it), the image is copied with ``np.copyto``
  into a buffer allocated once, which reads every page as the copy would have."""

  def __init__(self):
    import jax  # pylint: disable=g-import-not-at-top  (not in the workers, which import this)
    self._jax = jax
    self.platform = jax.devices()[0].platform
    self.batches, self.aliased = 0, 0
    self._buffer: Optional[np.ndarray] = None

  def __call__(self, batch: Dict[str, np.ndarray]) -> None:
    image = batch["image"]
    on_device = self._jax.device_put(image)
    on_device.block_until_ready()
    self.batches += 1
    if (isinstance(image, np.ndarray)
        and on_device.unsafe_buffer_pointer() == image.__array_interface__["data"][0]):
      self.aliased += 1
      if self._buffer is None or self._buffer.shape != image.shape or (
          self._buffer.dtype != image.dtype):
        self._buffer = np.empty_like(image)
      np.copyto(self._buffer, image)
    del on_device

  def describe(self) -> str:
    text = f"jax.device_put + block_until_ready ({self.platform})"
    if self.aliased:
      text += (f"; {self.aliased} of {self.batches} batches aliased the host array, "
               "copied with np.copyto instead")
    return text


def time_stream(data_cfg: ml_collections.ConfigDict, batch: int, seed: int, steps: int,
                warmup: int, repeats: int, log: Callable[[str], None] = _stderr,
                consume: bool = True) -> dict:
  """Times ``pipeline.make_train_iterator(data_cfg, batch, seed)`` (one process).

  Each batch is taken as the trainer takes it (``DeviceConsumer``: to the default JAX device)
  unless ``consume`` is False.

  Returns ``windows_images_per_sec`` and their median and min, ``cores_used`` (``max(num_workers,
  1)``) and ``images_per_sec_per_core_used`` (median / cores used), the windows' wall and CPU
  seconds (``timed_wall_s``, ``timed_cpu_self_s``, ``timed_cpu_workers_s``) and
  ``images_per_cpu_sec`` (images of all windows / their CPU seconds); the training process's CPU
  milliseconds per image (``self_cpu_ms_per_image``: ``timed_cpu_self_s`` over the images timed)
  and the ceiling that implies (``self_images_per_sec_ceiling`` = 1000 / that); resident memory
  in MB sampled after each timed batch, its maximum: ``self_rss_mb`` (``self_memory_mb``: RSS and
  its anonymous, file and shared-memory parts; ``self_rss_mb_before``: before the stream opened)
  and per worker ``worker_rss_mb``, ``worker_memory_mb``, ``worker_pids``, with
  ``worker_libraries`` (``loaded_libraries`` of each); the whole run's (``run_wall_s``,
  ``run_cpu_self_s``, ``run_cpu_children_s``, from getrusage), the batch shape and dtype, the
  consumer and the load average before and after. Bad config values raise ValueError before a
  worker starts; a record that cannot be read raises ``validate.InputError``.
  """
  consumer = DeviceConsumer() if consume else None
  before = memory_mb() or {}
  load_before = os.getloadavg()
  run0, t_start = rusage_seconds(), time.perf_counter()
  # A mesh of every device, as the trainer's: the device-resident stream (data.on_device) needs one.
  stream = pipeline.make_train_iterator(data_cfg, batch, seed, mesh=shd.make_mesh())
  rates, walls, own, workers, shape, dtype = [], [], [], [], None, None
  memory = MemorySampler()
  num_workers = int(data_cfg.num_workers)
  libraries: Dict[int, Optional[List[str]]] = {}
  try:
    for _ in range(warmup):
      out = next(stream)
      if consumer is not None:
        consumer(out)
      shape, dtype = out["image"].shape, out["image"].dtype
      del out
    log(f"warm-up: {warmup} batches in {time.perf_counter() - t_start:.1f} s")
    for r in range(repeats):
      memory.find_workers()
      workers0 = worker_cpu_seconds()
      own0, t0, sampling = time.process_time(), time.perf_counter(), 0.0
      for _ in range(steps):
        out = next(stream)
        if consumer is not None:
          consumer(out)
        shape, dtype = out["image"].shape, out["image"].dtype
        del out
        s0 = time.process_time()  # the sampling is not the training process's work: not counted
        if num_workers and len(memory.workers) < num_workers:
          memory.find_workers()  # they start with the first batch when there is no warm-up
        memory.sample()
        sampling += time.process_time() - s0
      walls.append(time.perf_counter() - t0)
      own.append(time.process_time() - own0 - sampling)
      workers.append(worker_cpu_seconds() - workers0)
      rates.append(steps * batch / walls[-1])
      log(f"window {r + 1}/{repeats}: {rates[-1]:.1f} images/s, "
          f"{(own[-1] + workers[-1]) / walls[-1]:.2f} cores busy")
    libraries = {pid: loaded_libraries(pid) for pid in memory.workers}
  finally:
    stream.close()
  run1 = rusage_seconds()
  cpu = sum(own) + sum(workers)
  cores_used = max(num_workers, 1)
  images = repeats * steps * batch
  self_ms = 1000 * sum(own) / images
  pids = sorted(memory.worker_peak)
  return {
      "batch_shape": list(shape),
      "batch_dtype": str(dtype),
      "consumer": consumer.describe() if consumer is not None else "none",
      "windows_images_per_sec": rates,
      "images_per_sec_median": statistics.median(rates),
      "images_per_sec_min": min(rates),
      "cores_used": cores_used,
      "images_per_sec_per_core_used": statistics.median(rates) / cores_used,
      "timed_wall_s": sum(walls),
      "timed_cpu_self_s": sum(own),
      "timed_cpu_workers_s": sum(workers),
      "images_per_cpu_sec": images / cpu if cpu > 0 else float("nan"),
      "self_cpu_ms_per_image": self_ms,
      "self_images_per_sec_ceiling": 1000 / self_ms if self_ms > 0 else float("nan"),
      "self_cpu_share": sum(own) / cpu if cpu > 0 else float("nan"),
      "self_rss_mb": memory.self_peak.get("rss", float("nan")),
      "self_rss_mb_before": before.get("rss", float("nan")),
      "self_memory_mb": memory.self_peak,
      "worker_pids": pids,
      "worker_rss_mb": [memory.worker_peak[p].get("rss", float("nan")) for p in pids],
      "worker_memory_mb": [memory.worker_peak[p] for p in pids],
      "worker_libraries": [libraries.get(p) for p in pids],
      "run_wall_s": time.perf_counter() - t_start,
      "run_cpu_self_s": run1["self"] - run0["self"],
      "run_cpu_children_s": run1["children"] - run0["children"],
      "load_average_before": list(load_before),
      "load_average_after": list(os.getloadavg()),
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
