"""How fast the host input pipeline runs, and how many host cores a model needs.

    python -m decay_jax.cli.data_bench --make_folder=/tmp/jpeg224 --images=2000 --size=224
    python -m decay_jax.cli.data_bench --config=configs/mae_vit_b16.py \\
        --config.data.dataset=imagefolder:/tmp/jpeg224 --config.data.eval_split=val --batch_size=64 \\
        --config.data.num_workers=2 --chips=64 --global_batch=4096 --hosts=16

Times the config's training stream alone (``decay_jax.data.pipeline.make_train_iterator``, this
process's share of the batch; no model, no accelerator): ``--warmup`` batches are discarded (the
workers start), then ``--repeats`` windows of ``--steps`` batches each are timed. Prints images/s
(min and median over the windows), the CPU seconds the pipeline used (this process and its Grain
workers, from /proc) and images per CPU-second, i.e. what one host core delivers.

The model's need: ``--target_step_time`` seconds per step, or a step time derived from the
config's model FLOPs per image (``model.flops``, 2 x multiply-adds), ``--global_batch`` over
``--chips`` chips of ``--peak_tflops`` at ``--mfu``; the images/s each of ``--hosts`` hosts must
deliver then, and the cores that takes at the measured images per CPU-second.

``--make_folder=DIR`` writes a synthetic JPEG image folder (``DIR/train/<class>/<i>.jpg`` and
``DIR/val/...``; smooth gradients with noise, quality 90, so decoding costs what photographs cost)
to measure on.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
from absl import flags
from ml_collections import config_flags
from PIL import Image

from decay_jax import logs
from decay_jax.cli import errors
from decay_jax.data import pipeline
from decay_jax.models import factory
from decay_jax.train import config as config_lib
from decay_jax.train import trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_BATCH = flags.DEFINE_integer("batch_size", 0, "Batch to time (0: the config's batch_size).")
_STEPS = flags.DEFINE_integer("steps", 10, "Batches per timed window.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Batches read before timing.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed windows.")
_TARGET = flags.DEFINE_float("target_step_time", 0.0,
                             "Accelerator seconds per step (0: derived from model FLOPs).")
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch", 0, "Global batch of the target run "
                                     "(0: the config's batch_size).")
_CHIPS = flags.DEFINE_integer("chips", 64, "Chips of the target run.")
_HOSTS = flags.DEFINE_integer("hosts", 16, "Hosts of the target run (each feeds its chips).")
_PEAK = flags.DEFINE_float("peak_tflops", 459.0, "Dense bf16 TFLOP/s per chip (TPU v5p: 459, "
                           "H100/H200: 989).")
_MFU = flags.DEFINE_float("mfu", 0.4, "Model FLOPs utilisation assumed for the derived step time.")
_MAKE = flags.DEFINE_string("make_folder", None, "Write a synthetic JPEG image folder here.")
_IMAGES = flags.DEFINE_integer("images", 2000, "--make_folder: training images (val: a tenth).")
_SIZE = flags.DEFINE_integer("size", 224, "--make_folder: image side in pixels.")
_CLASSES = flags.DEFINE_integer("classes", 10, "--make_folder: class folders.")
_OUT = flags.DEFINE_string("out", None, "Append the result as one JSON line to this file.")


# ------------------------------------------------------------------------------------------------
# A synthetic JPEG folder.


def synthetic_image(rng: np.random.Generator, size: int) -> np.ndarray:
  """uint8 (size, size, 3): a smooth colour gradient with a few discs and mild noise."""
  yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
  a, b, c = rng.uniform(0, 1, (3, 3))
  image = 255 * np.clip(a[None, None] * xx[..., None] + b[None, None] * yy[..., None]
                        + 0.3 * c[None, None], 0, 1)
  for _ in range(4):
    cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.25)
    disc = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
    image[disc] = rng.uniform(0, 255, 3)
  image += rng.normal(0, 8, image.shape)
  return np.clip(image, 0, 255).astype(np.uint8)


def make_folder(directory: str, images: int, size: int, classes: int) -> None:
  """``directory/{train,val}/class_<k>/<i>.jpg`` (JPEG quality 90), ``images`` for train."""
  rng = np.random.default_rng(0)
  t0 = time.perf_counter()
  for split, count in (("train", images), ("val", max(classes, images // 10))):
    for i in range(count):
      folder = os.path.join(directory, split, f"class_{i % classes:03d}")
      os.makedirs(folder, exist_ok=True)
      Image.fromarray(synthetic_image(rng, size)).save(os.path.join(folder, f"{i:07d}.jpg"),
                                                       quality=90)
      if (i + 1) % 500 == 0:
        print(f"{split}: {i + 1}/{count} images ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
  print(f"wrote {images} + {max(classes, images // 10)} JPEG images of {size} px to {directory}")


# ------------------------------------------------------------------------------------------------
# CPU time of this process and its children.


def _children(pid: int):
  out = []
  try:
    for tid in os.listdir(f"/proc/{pid}/task"):
      with open(f"/proc/{pid}/task/{tid}/children") as f:
        out += [int(c) for c in f.read().split()]
  except OSError:
    pass
  return out


def _ticks(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime
  except OSError:
    return 0


def cpu_seconds() -> float:
  """CPU seconds of this process and every live descendant (Linux /proc; NaN elsewhere)."""
  if not os.path.isdir("/proc/self/task"):
    return float("nan")
  todo, total = [os.getpid()], 0
  while todo:
    pid = todo.pop()
    total += _ticks(pid)
    todo += _children(pid)
  return total / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------------
# The benchmark.


def time_stream(config, batch: int, steps: int, warmup: int, repeats: int) -> dict:
  """Images/s and images per CPU-second of the config's training stream."""
  stream = pipeline.make_train_iterator(config.data, batch, config.seed)
  try:
    for _ in range(warmup):
      next(stream)
    rates, cpu_total = [], 0.0
    for r in range(repeats):
      cpu0, t0 = cpu_seconds(), time.perf_counter()
      for _ in range(steps):
        next(stream)
      wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
      rates.append(steps * batch / wall)
      cpu_total += cpu
      print(f"window {r + 1}/{repeats}: {rates[-1]:.1f} images/s, {cpu / wall:.2f} cores busy",
            file=sys.stderr, flush=True)
  finally:
    stream.close()
  # Over all windows together: /proc counts CPU time in clock ticks (10 ms).
  per_cpu = repeats * steps * batch / cpu_total if cpu_total > 0 else float("nan")
  return {"images_per_sec_min": min(rates), "images_per_sec_median": statistics.median(rates),
          "images_per_cpu_sec": per_cpu,
          "windows_images_per_sec": [round(x, 1) for x in rates]}


def model_need(config, info, per_cpu: float) -> dict:
  """The images/s the target run needs per host, and the host cores that takes."""
  global_batch = _GLOBAL_BATCH.value or config.batch_size
  model = factory.build_model(config, info)
  flops_per_image = trainer.make_task(config, model, info).train_flops_per_example()
  if _TARGET.value > 0:
    step_time, source = _TARGET.value, "given"
  else:
    step_time = flops_per_image * global_batch / (_CHIPS.value * _PEAK.value * 1e12 * _MFU.value)
    source = (f"derived: {flops_per_image / 1e9:.1f} GFLOP/image x {global_batch} over "
              f"{_CHIPS.value} chips x {_PEAK.value:g} TFLOP/s x MFU {_MFU.value:g}")
  per_host = global_batch / step_time / _HOSTS.value
  return {"global_batch": global_batch, "step_time_s": step_time, "step_time_source": source,
          "model_gflops_per_image": flops_per_image / 1e9, "hosts": _HOSTS.value,
          "chips": _CHIPS.value, "needed_images_per_sec_per_host": per_host,
          "host_cores_needed": per_host / per_cpu if per_cpu > 0 else float("nan")}


def main(argv):
  del argv
  logs.quiet_libraries()
  if _MAKE.value:
    for name, value in (("images", _IMAGES.value), ("size", _SIZE.value),
                        ("classes", _CLASSES.value)):
      if value < 1:
        print(f"error: --{name}={value} is not allowed; it must be >= 1", file=sys.stderr)
        return 2
    make_folder(_MAKE.value, _IMAGES.value, _SIZE.value, _CLASSES.value)
    return 0
  config = _CONFIG.value
  if config is None:
    print("error: --config is required (or --make_folder=DIR)", file=sys.stderr)
    return 2
  for name, value in (("steps", _STEPS.value), ("repeats", _REPEATS.value),
                      ("chips", _CHIPS.value), ("hosts", _HOSTS.value)):
    if value < 1:
      print(f"error: --{name}={value} is not allowed; it must be >= 1", file=sys.stderr)
      return 2
  batch = _BATCH.value or config.batch_size
  try:
    config_lib.validate(config)
    info = pipeline.dataset_info(config.data)
    pipeline.make_train_iterator(config.data, batch, config.seed).close()  # splits, channels
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  res = {"dataset": config.data.dataset, "batch": batch, "image_size": config.data.image_size,
         "num_workers": config.data.num_workers, "num_threads": config.data.num_threads,
         "host_cpus": os.cpu_count()}
  res.update(time_stream(config, batch, _STEPS.value, _WARMUP.value, _REPEATS.value))
  res.update(model_need(config, info, res["images_per_cpu_sec"]))
  print(f"input pipeline: {res['images_per_sec_median']:.1f} images/s median "
        f"(min {res['images_per_sec_min']:.1f}) over {_REPEATS.value} x {_STEPS.value} batches of "
        f"{batch}, {res['images_per_cpu_sec']:.1f} images per CPU-second "
        f"({config.data.num_workers} workers, {config.data.num_threads} threads)")
  print(f"model need: {res['needed_images_per_sec_per_host']:.1f} images/s per host "
        f"({res['global_batch']} images every {res['step_time_s']:.3f} s over {res['hosts']} "
        f"hosts; step time {res['step_time_source']}): "
        f"{res['host_cores_needed']:.1f} host cores per host")
  if _OUT.value:
    with open(_OUT.value, "a", encoding="utf-8") as f:
      f.write(json.dumps(res) + "\n")
  return 0


def run():
  errors.run(main)


if __name__ == "__main__":
  run()
