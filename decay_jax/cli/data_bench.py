"""How fast the host input pipeline runs, what it costs the training process, and how many host
cores a model needs.

    python -m decay_jax.cli.data_bench --make_folder=/tmp/jpeg224 --images=2000 --size=224
    python -m decay_jax.cli.data_bench --config=configs/mae_vit_b16.py \\
        --config.data.dataset=imagefolder:/tmp/jpeg224 --batch_size=64 \\
        --config.data.num_threads=1 --workers=0,1,2 --chips=64 --global_batch=4096 --hosts=16 \\
        --json=/tmp/bench.json

Times the config's training stream alone (``decay_jax.data.pipeline.make_train_iterator`` with
``config.seed``, this process's share of ``--batch_size``; no model), once per worker count of
``--workers`` (a fresh stream with ``data.num_workers`` set to it; without the flag, the config's
count): ``--warmup`` batches are dropped (the workers start), then ``--repeats`` windows of
``--steps`` batches are timed (``decay_jax.data.bench``). Each batch is taken as the trainer takes
it: ``jax.device_put`` of its images, waited for (a copy into a buffer where the CPU backend would
alias the host array instead), so the training process reads every page once.

For each worker count it prints images/s (median and min over the windows), images/s per core used
(``max(num_workers, 1)``), the CPU seconds of the windows (this process and its Grain workers) and
images per CPU-second, i.e. what one host core delivers; the training process's own CPU time per
image (``time.process_time`` over the windows: everything the process does per image, including
the copy to the device) and the ceiling that sets (1000 / that images/s: what one training process
can take in however many workers feed it); the resident memory (VmRSS, the maximum over samples
taken after every timed batch) of the training process and of each worker (its children in
/proc), and which heavy libraries (jaxlib, tensorflow, tensorstore, torch) each worker has loaded;
the CPU seconds of the whole run as ``getrusage`` counts them (self + exited children). Then one
table, a row per worker count.

The model's need: ``--global_batch`` images (0: the config's ``batch_size``) every
``--target_step_time`` seconds, or every ``F x global_batch / (chips x peak x MFU)`` seconds with
``F`` the config's model train FLOPs per image (``model.flops``, as the trainer's MFU counts them)
and ``--chips``, ``--peak_tflops``, ``--mfu`` assumptions that the output repeats; the images/s
each of ``--hosts`` hosts must deliver, and the host cores that takes at the measured images per
CPU-second.

``--out=FILE`` appends each worker count's result as one JSON line; ``--json=FILE`` writes the
whole measurement (the command, the settings and every row) as one JSON document.

``--make_folder=DIR`` writes a synthetic JPEG image folder (``DIR/train/<class>/<i>.jpg`` and
``DIR/val/...``, quality 90, natural-looking content; ``decay_jax.data.bench.make_folder``) to
measure on.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from typing import List, Optional

from absl import flags
from ml_collections import config_flags

from decay_jax import logs
from decay_jax.cli import errors
from decay_jax.data import bench
from decay_jax.data import config as data_config
from decay_jax.train import config as config_lib
from decay_jax.train import tasks

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_BATCH = flags.DEFINE_integer("batch_size", 0, "Batch to time (0: the config's batch_size).")
_STEPS = flags.DEFINE_integer("steps", 10, "Batches per timed window.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Batches read and dropped before timing.")
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
_OUT = flags.DEFINE_string("out", None, "Append each result as one JSON line to this file.")
_JSON = flags.DEFINE_string("json", None, "Write the whole measurement as one JSON document here.")
_WORKERS = flags.DEFINE_string("workers", None, "Worker counts to time, comma-separated (e.g. "
                               "0,1,2): a fresh stream each (default: the config's num_workers).")


def train_flops_per_image(config, batch_shape) -> float:
  """The config's model train FLOPs per example at the stream's image size and channels (the
  trainer's task object)."""
  info = {"image_size": int(batch_shape[-2]), "channels": int(batch_shape[-1])}
  model = tasks.build_model(config, info)
  return float(tasks.from_config(config, model, info).train_flops_per_example())


def _bad_flag() -> str:
  """The first bad flag value as a message ('' when all are good)."""
  if _MAKE.value:
    checks = (("images", _IMAGES.value, 1), ("size", _SIZE.value, 8),
              ("classes", _CLASSES.value, 1))
  else:
    checks = (("steps", _STEPS.value, 1), ("repeats", _REPEATS.value, 1),
              ("warmup", _WARMUP.value, 0), ("batch_size", _BATCH.value, 0),
              ("global_batch", _GLOBAL_BATCH.value, 0), ("chips", _CHIPS.value, 1),
              ("hosts", _HOSTS.value, 1))
  for name, value, low in checks:
    if value < low:
      return f"--{name}={value} is not allowed; it must be >= {low}"
  if _MAKE.value:
    return "" if _CLASSES.value <= _IMAGES.value else (
        f"--classes={_CLASSES.value} is not allowed; it must be at most --images="
        f"{_IMAGES.value} (every class folder needs an image)")
  if _WORKERS.value is not None and _worker_counts() is None:
    return (f"--workers={_WORKERS.value} is not allowed; it must be worker counts >= 0 separated "
            "by commas (e.g. 0,1,2)")
  for name, value, good, want in (
      ("target_step_time", _TARGET.value, _TARGET.value >= 0, ">= 0 (0: derived)"),
      ("peak_tflops", _PEAK.value, _PEAK.value > 0, "> 0"),
      ("mfu", _MFU.value, 0 < _MFU.value <= 1, "in (0, 1]")):
    if not good or value != value or value == float("inf"):
      return f"--{name}={value:g} is not allowed; it must be {want}"
  return ""


def _worker_counts() -> Optional[List[int]]:
  """``--workers`` as a list of counts (None if it is malformed)."""
  try:
    counts = [int(x) for x in _WORKERS.value.split(",")]
  except ValueError:
    return None
  return counts if counts and min(counts) >= 0 else None


def _host() -> dict:
  """The machine and library versions a measurement ran with."""
  cpu = ""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
  except OSError:
    pass
  versions = {}
  for package in ("grain", "pillow", "numpy", "jax", "jaxlib"):
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      versions[package] = None
  return {"cpus": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
          "versions": versions}


def _make_folder() -> int:
  directory = os.path.abspath(_MAKE.value)
  for split in ("train", "val"):
    path = os.path.join(directory, split)
    if os.path.isdir(path) and os.listdir(path):
      print(f"error: --make_folder={_MAKE.value} is not allowed; {path!r} already has files "
            "(choose a new or empty directory)", file=sys.stderr)
      return 2
  try:
    made = bench.make_folder(directory, _IMAGES.value, _SIZE.value, _CLASSES.value)
  except OSError as e:
    print(f"error: --make_folder={_MAKE.value} cannot be written ({type(e).__name__}: "
          f"{e.strerror or e})", file=sys.stderr)
    return 2
  print(f"wrote {made['train']} train + {made['val']} val JPEG images of {_SIZE.value} x "
        f"{_SIZE.value} px (quality {bench.JPEG_QUALITY}, {made['mean_bytes'] / 1e3:.1f} kB on "
        f"average, {_CLASSES.value} classes) to {directory}")
  return 0


def main(argv):
  del argv
  logs.quiet_libraries()
  bad = _bad_flag()
  if bad:
    print(f"error: {bad}", file=sys.stderr)
    return 2
  if _MAKE.value:
    return _make_folder()
  config = _CONFIG.value
  if config is None:
    print("error: --config is required (or --make_folder=DIR)", file=sys.stderr)
    return 2
  batch = _BATCH.value or config.batch_size
  counts = _worker_counts() if _WORKERS.value is not None else [int(config.data.num_workers)]
  global_batch = _GLOBAL_BATCH.value or config.batch_size
  runs, seconds, source, flops_per_image = [], None, None, None
  try:  # a bad config, folder or split, or an image that cannot be read: one line
    config_lib.validate(config)
    data_config.check_fields(config.data)
    for workers in counts:
      data = config.data.copy_and_resolve_references()
      data.num_workers = workers
      res = {"dataset": data.dataset, "batch": batch, "image_size": data.image_size,
             "num_workers": data.num_workers, "num_threads": data.num_threads,
             "prefetch": data.prefetch, "host_cpus": os.cpu_count(), "steps": _STEPS.value,
             "warmup": _WARMUP.value, "repeats": _REPEATS.value}
      res.update(bench.time_stream(data, batch, config.seed, _STEPS.value, _WARMUP.value,
                                   _REPEATS.value))
      if flops_per_image is None:
        flops_per_image = train_flops_per_image(config, res["batch_shape"])
        seconds, source = bench.step_time(_TARGET.value, flops_per_image, global_batch,
                                          _CHIPS.value, _PEAK.value, _MFU.value)
      res.update(global_batch=global_batch, step_time_s=seconds, step_time_source=source,
                 model_gflops_per_image=flops_per_image / 1e9, chips=_CHIPS.value,
                 hosts=_HOSTS.value)
      res.update(bench.model_need(global_batch, seconds, _HOSTS.value, res["images_per_cpu_sec"]))
      if runs:
        print()
      _report(res)
      sys.stdout.flush()
      runs.append(res)
      if _OUT.value:
        with open(_OUT.value, "a", encoding="utf-8") as f:
          f.write(json.dumps(res) + "\n")
  except ValueError as e:
    print(f"error: {errors.one_line(e)}", file=sys.stderr)
    return 2
  print()
  print(_table(runs))
  if _JSON.value:
    document = {"argv": sys.argv, "host": _host(), "dataset": config.data.dataset,
                "batch": batch, "workers": counts, "runs": runs}
    with open(_JSON.value, "w", encoding="utf-8") as f:
      json.dump(document, f, indent=1)
      f.write("\n")
  return 0


def _number(x: float) -> str:
  """One decimal from 10 on, else three significant digits."""
  return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def _report(r: dict) -> None:
  cpu = r["timed_cpu_self_s"] + r["timed_cpu_workers_s"]
  print(f"input pipeline: {r['images_per_sec_median']:.1f} images/s median "
        f"(min {r['images_per_sec_min']:.1f}) over {len(r['windows_images_per_sec'])} x "
        f"{_STEPS.value} batches of {r['batch']}, {r['images_per_cpu_sec']:.1f} images per "
        f"CPU-second ({r['num_workers']} workers, {r['num_threads']} threads)")
  print(f"per core used: {r['images_per_sec_per_core_used']:.1f} images/s "
        f"({r['cores_used']} = max(workers, 1) cores; {r['host_cpus']} CPUs on this host)")
  print(f"CPU seconds: {cpu:.3g} in {r['timed_wall_s']:.3g} s timed (this process "
        f"{r['timed_cpu_self_s']:.3g}, workers {r['timed_cpu_workers_s']:.3g}); whole run "
        f"{r['run_cpu_self_s'] + r['run_cpu_children_s']:.3g} in {r['run_wall_s']:.3g} s "
        f"(getrusage: self {r['run_cpu_self_s']:.3g}, exited children "
        f"{r['run_cpu_children_s']:.3g})")
  print(f"model need: {r['needed_images_per_sec_per_host']:.1f} images/s per host "
        f"({r['global_batch']} images every {r['step_time_s']:.4g} s over {r['hosts']} "
        f"hosts; step time {r['step_time_source']}): "
        f"{_number(r['host_cores_needed'])} host cores per host, "
        f"{_number(r['host_cores_needed_all'])} in all")
  print(f"training process: {r['self_cpu_ms_per_image']:.3f} ms CPU per image "
        f"({100 * r['self_cpu_share']:.0f}% of the CPU), at most "
        f"{r['self_images_per_sec_ceiling']:.0f} images/s into one training process; batches "
        f"{r['batch_dtype']} {tuple(r['batch_shape'])}, taken by {r['consumer']}")
  if r["worker_pids"]:
    loaded = r["worker_libraries"]
    if all(libs == [] for libs in loaded):
      libraries = "none of " + ", ".join(bench.HEAVY_LIBRARIES)
    else:
      libraries = "; ".join("?" if libs is None else ", ".join(libs) or "none" for libs in loaded)
    workers = (f"each worker {_mb(r['worker_rss_mb'])} MB (pids "
               f"{', '.join(map(str, r['worker_pids']))}; heavy libraries loaded: {libraries})")
  else:
    workers = "no workers"
  print(f"resident memory: training process {r['self_rss_mb']:.0f} MB ("
        f"{r['self_rss_mb_before']:.0f} before the stream opened), {workers}")


def _mb(values) -> str:
  return ", ".join(f"{v:.0f}" for v in values) if values else "-"


def _table(runs: List[dict]) -> str:
  """One row per worker count, columns padded to line up (a Markdown table)."""
  head = ["workers", "images/s median (min)", "images per CPU-s", "train. process ms CPU/image",
          "its ceiling images/s", "train. process CPU share", "train. process RSS MB",
          "RSS MB per worker", "host cores per host"]
  rows = [[str(r["num_workers"]),
           f"{r['images_per_sec_median']:.1f} ({r['images_per_sec_min']:.1f})",
           f"{r['images_per_cpu_sec']:.1f}", f"{r['self_cpu_ms_per_image']:.3f}",
           f"{r['self_images_per_sec_ceiling']:.0f}", f"{100 * r['self_cpu_share']:.0f}%",
           f"{r['self_rss_mb']:.0f}", _mb(r["worker_rss_mb"]), _number(r["host_cores_needed"])]
          for r in runs]
  widths = [max(len(row[i]) for row in [head] + rows) for i in range(len(head))]
  line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"
  r = runs[0]
  return "\n".join(
      [f"sweep: {r['dataset']}, batches of {r['batch']} {r['batch_dtype']} "
       f"{tuple(r['batch_shape'][1:])}, {r['num_threads']} threads, prefetch {r['prefetch']}, "
       f"{r['repeats']} x {r['steps']} batches timed after {r['warmup']}; RSS: max over the "
       f"timed windows; host cores per host: for the model need above",
       line(head), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
      + [line(row) for row in rows])


def run():
  errors.run(main)


if __name__ == "__main__":
  run()
