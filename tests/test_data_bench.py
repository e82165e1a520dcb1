"""The input benchmark: decay_jax.data.bench (the synthetic folder, the arithmetic, the /proc
readings, the device consumer) and the command python -m decay_jax.cli.data_bench, which writes a
JPEG folder, times the stream with and without Grain workers (one count, or a sweep) and prints
numbers whose arithmetic holds (no timing is asserted)."""

from concurrent import futures
import io
import json
import math
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from PIL import Image

from decay_jax.data import bench
from decay_jax.models import flops
from decay_jax.train import tasks
from testing_configs import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBER = r"([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)"


def _run(*args):
  return subprocess.run([sys.executable, "-m", "decay_jax.cli.data_bench", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO))


def _printed(pattern, stdout):
  """The numbers the first line matching ``pattern`` (with NUMBER groups) prints, as floats."""
  m = re.search(pattern.replace("N", NUMBER), stdout)
  assert m, f"no line matches {pattern!r} in:\n{stdout}"
  values = [float(g) for g in m.groups()]
  assert all(math.isfinite(v) for v in values), m.group(0)
  return values


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("bench") / "jpeg")
  p = _run(f"--make_folder={directory}", "--images=40", "--size=32", "--classes=4")
  assert p.returncode == 0, p.stderr[-2000:]
  assert re.search(r"wrote 40 train \+ 4 val JPEG images of 32 x 32 px", p.stdout), p.stdout
  return directory


def test_make_folder_writes_jpeg_class_folders(folder):
  assert sorted(os.listdir(folder)) == ["train", "val"]
  assert sorted(os.listdir(os.path.join(folder, "train"))) == [f"class_{k:03d}" for k in range(4)]
  files = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(folder, "train"))
                 for f in fs)
  assert len(files) == 40
  with Image.open(files[0]) as image:
    assert image.format == "JPEG" and image.size == (32, 32) and image.mode == "RGB"
    pixels = np.asarray(image)
  assert pixels.std() > 10  # not a flat image: decoding costs what real content costs
  # The same (seed, index) gives the same image (the folder does not depend on the order).
  np.testing.assert_array_equal(bench.synthetic_image(0, 5, 32), bench.synthetic_image(0, 5, 32))


def test_synthetic_images_compress_like_photographs():
  """Smooth at large scales, textured at small ones: at 224 px and quality 90 a JPEG of 1-5 bits
  per pixel (photographs: about 2-4), neither a flat picture (<0.5) nor white noise (>8)."""
  sizes = []
  for i in range(3):
    out = io.BytesIO()
    Image.fromarray(bench.synthetic_image(1, i, 224)).save(out, "JPEG", quality=90)
    sizes.append(out.tell())
  bits_per_pixel = 8 * np.mean(sizes) / 224 ** 2
  assert 1 < bits_per_pixel < 5, bits_per_pixel


def test_step_time_and_need_arithmetic():
  assert bench.step_time(0.5, 1e9, 4096, 64, 459, 0.4) == (0.5, "given")
  seconds, how = bench.step_time(0.0, 65e9, 4096, 64, 459.0, 0.4)
  assert seconds == pytest.approx(65e9 * 4096 / (64 * 459e12 * 0.4), rel=1e-12)
  assert how.startswith("derived: 65.0 GFLOP/image x 4096 over 64 chips x 459 TFLOP/s x MFU 0.4")
  need = bench.model_need(4096, 0.5, 16, 256.0)
  assert need == {"needed_images_per_sec": 8192.0, "needed_images_per_sec_per_host": 512.0,
                  "host_cores_needed_all": 32.0, "host_cores_needed": 2.0}


@pytest.mark.parametrize("workers", [0, 1])
def test_bench_prints_consistent_numbers(folder, tmp_path, workers):
  out = str(tmp_path / "res.jsonl")
  p = _run("--config=configs/mae_cpu_mnist.py", f"--config.data.dataset=imagefolder:{folder}",
           "--config.data.normalize=imagenet", "--config.data.image_size=32",
           f"--config.data.num_workers={workers}", "--batch_size=8", "--steps=2", "--repeats=2",
           "--warmup=1", "--target_step_time=0.5", "--global_batch=64", "--hosts=2",
           f"--out={out}")
  assert p.returncode == 0, p.stderr[-3000:]
  median, low, per_cpu = _printed(r"input pipeline: N images/s median \(min N\) over 2 x 2 "
                                  r"batches of 8, N images per CPU-second", p.stdout)
  assert 0 < low <= median and per_cpu > 0
  cores_used = max(workers, 1)
  per_core, used = _printed(r"per core used: N images/s \(N = max\(workers, 1\) cores", p.stdout)
  assert used == cores_used and per_core == pytest.approx(median / cores_used, abs=0.06)
  cpu, wall, own, in_workers, run_cpu, _, run_self, run_children = _printed(
      r"CPU seconds: N in N s timed \(this process N, workers N\); whole run N in N s "
      r"\(getrusage: self N, exited children N\)", p.stdout)
  assert cpu == pytest.approx(own + in_workers, rel=0.01) and wall > 0 and cpu > 0
  assert run_cpu == pytest.approx(run_self + run_children, rel=0.01)
  # getrusage counts a worker once it has exited (the stream is closed before it is read).
  assert (run_children > 0) == (workers > 0) and (in_workers == 0 or workers > 0)
  # 64 images every 0.5 s over 2 hosts: 64 images/s per host, at the measured per-core rate.
  need, per_host, in_all = _printed(r"model need: N images/s per host \(64 images every 0.5 s "
                                    r"over 2 hosts; step time given\): N host cores per host, "
                                    r"N in all", p.stdout)
  assert need == 64.0
  assert per_host == pytest.approx(64.0 / per_cpu, rel=0.01)
  assert in_all == pytest.approx(2 * per_host, rel=0.01)
  # The training process's own CPU per image and the ceiling it sets; its and each worker's RSS.
  ms, share, ceiling = _printed(r"training process: N ms CPU per image \(N% of the CPU\), at most "
                                r"N images/s into one training process", p.stdout)
  assert 0 < ms and 0 < share <= 100 and ceiling == pytest.approx(1000 / ms, rel=0.01, abs=1)
  assert ms == pytest.approx(1000 * own / 32, rel=0.02, abs=0.001)  # 2 x 2 batches of 8
  assert "taken by jax.device_put + block_until_ready (cpu)" in p.stdout
  (self_rss,) = _printed(r"resident memory: training process N MB", p.stdout)
  assert self_rss > 0
  if workers:
    rss = _printed(r"each worker N MB \(pids N;", p.stdout)[0]
    assert rss > 0
  else:
    assert "no workers" in p.stdout
  res = [json.loads(line) for line in open(out)][-1]
  assert res["batch"] == 8 and res["num_workers"] == workers
  assert len(res["worker_rss_mb"]) == workers and all(x > 0 for x in res["worker_rss_mb"])
  assert res["batch_shape"] == [8, 32, 32, 3]
  assert len(res["windows_images_per_sec"]) == 2
  assert res["images_per_sec_median"] == pytest.approx(median, abs=0.06)
  assert res["step_time_s"] == 0.5 and res["needed_images_per_sec_per_host"] == 64.0
  assert res["needed_images_per_sec"] == 128.0
  assert res["host_cores_needed"] == pytest.approx(64.0 / res["images_per_cpu_sec"])
  assert res["host_cores_needed_all"] == pytest.approx(128.0 / res["images_per_cpu_sec"])


def test_bench_derives_the_step_time_from_model_flops(folder, tmp_path):
  out = str(tmp_path / "res.jsonl")
  p = _run("--config=configs/mae_cpu_mnist.py", f"--config.data.dataset=imagefolder:{folder}",
           "--config.data.image_size=28", "--batch_size=8", "--steps=1", "--repeats=1",
           "--warmup=0", "--global_batch=1024", "--chips=8", "--hosts=1", "--peak_tflops=100",
           "--mfu=0.5", f"--out={out}")
  assert p.returncode == 0, p.stderr[-3000:]
  res = json.loads(open(out).read().splitlines()[-1])
  # The demo model's train FLOPs at 28 x 28 x 3: 3 x the forward of models/flops.py.
  model = tasks.build_model(load_config("mae_cpu_mnist"), {"image_size": 28, "channels": 3})
  assert res["model_gflops_per_image"] * 1e9 == pytest.approx(3 * flops.mae_forward_flops(model))
  expected = res["model_gflops_per_image"] * 1e9 * 1024 / (8 * 100e12 * 0.5)
  assert res["step_time_s"] == pytest.approx(expected, rel=1e-9)
  assert res["needed_images_per_sec_per_host"] == pytest.approx(1024 / expected)
  assert "step time derived: " in p.stdout and "over 8 chips x 100 TFLOP/s x MFU 0.5" in p.stdout


def _table(stdout):
  """The sweep table's rows: {column: cell} (the header line starts with '| workers |')."""
  lines = stdout.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith("| workers |"))
  cells = lambda l: [c.strip() for c in l.strip().strip("|").split("|")]
  head, rows = cells(lines[start]), []
  for line in lines[start + 2:]:
    if not line.startswith("|"):
      break
    rows.append(dict(zip(head, cells(line))))
  return rows


def test_sweep_gives_one_row_per_worker_count(folder, tmp_path):
  """--workers=0,2: a fresh stream per count, one table row each, with the training process's CPU
  per image (positive, finite), its RSS, and one RSS per worker (none for 0 workers); --json
  writes all of it."""
  out = str(tmp_path / "sweep.json")
  p = _run("--config=configs/mae_cpu_mnist.py", f"--config.data.dataset=imagefolder:{folder}",
           "--config.data.image_size=32", "--config.data.num_workers=1", "--workers=0,2",
           "--batch_size=8", "--steps=2", "--repeats=2", "--warmup=1", "--target_step_time=0.5",
           f"--json={out}")
  assert p.returncode == 0, p.stderr[-3000:]
  rows = _table(p.stdout)
  assert [r["workers"] for r in rows] == ["0", "2"]
  for row in rows:
    ms = float(row["train. process ms CPU/image"])
    assert 0 < ms < float("inf")
    assert float(row["its ceiling images/s"]) == pytest.approx(1000 / ms, rel=0.01, abs=1)
    assert float(row["train. process RSS MB"]) > 0
    assert float(row["images per CPU-s"]) > 0
  assert rows[0]["RSS MB per worker"] == "-"
  worker_rss = [float(x) for x in rows[1]["RSS MB per worker"].split(",")]
  assert len(worker_rss) == 2 and all(x > 0 for x in worker_rss)
  doc = json.load(open(out))
  assert doc["workers"] == [0, 2] and doc["batch"] == 8 and doc["host"]["cpus"] == os.cpu_count()
  assert [r["num_workers"] for r in doc["runs"]] == [0, 2]
  zero, two = doc["runs"]
  assert zero["worker_rss_mb"] == [] and zero["worker_pids"] == []
  assert len(two["worker_rss_mb"]) == 2 and all(x > 0 for x in two["worker_rss_mb"])
  assert len(set(two["worker_pids"])) == 2 and len(two["worker_libraries"]) == 2
  for r in doc["runs"]:
    assert math.isfinite(r["self_cpu_ms_per_image"]) and r["self_cpu_ms_per_image"] > 0
    assert r["self_cpu_ms_per_image"] == pytest.approx(1000 * r["timed_cpu_self_s"] / 32)
    assert r["self_rss_mb"] > 0 and r["batch_shape"] == [8, 32, 32, 3]
  assert two["timed_cpu_workers_s"] >= 0 and zero["timed_cpu_workers_s"] == 0


def test_proc_readings_find_children_and_their_memory():
  """worker_pids finds this process's children (the resource tracker aside), memory_mb reads
  their RSS, loaded_libraries what they have mapped."""
  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
  try:
    deadline = time.time() + 10
    while child.pid not in bench.worker_pids() and time.time() < deadline:
      time.sleep(0.05)
    assert child.pid in bench.worker_pids() and child.pid in bench.descendants()
    own, theirs = bench.memory_mb(), bench.memory_mb(child.pid)
    assert own["rss"] > 0 and theirs["rss"] > 0 and theirs["anon"] <= theirs["rss"]
    assert "jaxlib" in bench.loaded_libraries(os.getpid())  # this process imported jax
    assert bench.loaded_libraries(child.pid) == []
  finally:
    child.kill()
    child.wait()
  assert bench.memory_mb(child.pid) is None and child.pid not in bench.worker_pids()


def test_device_consumer_reads_every_batch():
  """device_put copies a batch, or, where the CPU backend aliases it instead (JAX 0.10 does for a
  64-byte aligned array), the consumer copies it into its own buffer: either way every page is
  read."""
  consumer = bench.DeviceConsumer()
  raw = np.full(4 * 8 * 8 * 3 + 64, 7, np.uint8)
  offset = (-raw.ctypes.data) % 64
  for start in (offset, offset + 1):  # aligned, then not
    image = raw[start:start + 4 * 8 * 8 * 3].reshape(4, 8, 8, 3)
    aliased = consumer.aliased
    consumer({"image": image})
    if consumer.aliased > aliased:
      np.testing.assert_array_equal(consumer._buffer, image)  # pylint: disable=protected-access
  assert consumer.batches == 2 and consumer.aliased <= 2
  assert consumer.describe().startswith(f"jax.device_put + block_until_ready "
                                        f"({jax.devices()[0].platform})")
  assert ("aliased the host array" in consumer.describe()) == (consumer.aliased > 0)


@pytest.fixture(scope="module")
def broken_folder(tmp_path_factory):
  root = tmp_path_factory.mktemp("broken")
  for k in range(2):
    os.makedirs(root / "train" / f"c{k}")
    Image.new("RGB", (8, 8), (k, 0, 0)).save(root / "train" / f"c{k}" / "a.jpg")
  (root / "train" / "c1" / "b.jpg").write_bytes(b"not a jpeg")
  return str(root)


BAD = [
    (["--config=configs/mae_cpu_mnist.py", "--steps=0", "--mfu=0.5"], "--steps=0 is not allowed"),
    (["--config=configs/mae_cpu_mnist.py", "--mfu=1.5"], "--mfu=1.5 is not allowed"),
    (["--config=configs/mae_cpu_mnist.py", "--config.data.dataset=imagefolder:/no/such/dir"],
     "the directory '/no/such/dir' does not exist"),
    (["--config=configs/mae_cpu_mnist.py", "--config.data.dataset=imagefolder:BROKEN",
      "--batch_size=3", "--steps=1", "--repeats=1"], "b.jpg' cannot be read"),
    (["--make_folder=/tmp/x", "--images=2", "--classes=3"], "--classes=3 is not allowed"),
    (["--make_folder=FOLDER"], "already has files"),
    (["--config=configs/mae_cpu_mnist.py", "--workers=0,x"], "--workers=0,x is not allowed"),
    (["--config=configs/mae_cpu_mnist.py", "--workers=1,-1"], "--workers=1,-1 is not allowed"),
]


def test_bad_input_gives_one_line(folder, broken_folder):
  """Each bad input: exit status 2, one error line, no traceback (the commands run concurrently)."""
  with futures.ThreadPoolExecutor(len(BAD)) as pool:
    runs = list(pool.map(lambda a: _run(*[x.replace("BROKEN", broken_folder)
                                          .replace("FOLDER", folder) for x in a[0]]), BAD))
  for (args, phrase), p in zip(BAD, runs):
    errors = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and phrase in errors[0], (args, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, args
