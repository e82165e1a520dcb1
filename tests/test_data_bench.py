"""The input benchmark command: it writes a JPEG folder, times the stream with and without Grain
workers and prints numbers whose arithmetic holds (no timing is asserted)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
  p = subprocess.run([sys.executable, "-m", "decay_jax.cli.data_bench", *args], cwd=REPO,
                     capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO))
  return p


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("bench") / "jpeg")
  p = _run(f"--make_folder={directory}", "--images=24", "--size=40", "--classes=3")
  assert p.returncode == 0, p.stderr[-2000:]
  return directory


def test_make_folder_writes_jpeg_class_folders(folder):
  assert sorted(os.listdir(folder)) == ["train", "val"]
  assert sorted(os.listdir(os.path.join(folder, "train"))) == [f"class_{k:03d}" for k in range(3)]
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(folder, "train")) for f in fs]
  assert len(files) == 24
  with Image.open(files[0]) as image:
    assert image.format == "JPEG" and image.size == (40, 40) and image.mode == "RGB"
    pixels = np.asarray(image)
  assert pixels.std() > 10  # not a flat image: decoding costs what real content costs


@pytest.mark.parametrize("workers", [0, 1])
def test_bench_prints_consistent_numbers(folder, tmp_path, workers):
  out = str(tmp_path / "res.jsonl")
  p = _run("--config=configs/mae_cpu_mnist.py", f"--config.data.dataset=imagefolder:{folder}",
           "--config.data.eval_split=val", "--config.data.normalize=imagenet",
           "--config.data.image_size=32", f"--config.data.num_workers={workers}",
           "--batch_size=16", "--steps=4", "--repeats=2", "--warmup=1",
           "--target_step_time=0.5", "--global_batch=64", "--hosts=2", f"--out={out}")
  assert p.returncode == 0, p.stderr[-3000:]
  res = [json.loads(line) for line in open(out)][-1]
  assert res["batch"] == 16 and res["num_workers"] == workers
  assert len(res["windows_images_per_sec"]) == 2
  assert 0 < res["images_per_sec_min"] <= res["images_per_sec_median"] < float("inf")
  assert 0 < res["images_per_cpu_sec"] < float("inf")
  # 64 images every 0.5 s over 2 hosts: 64 images/s per host, at the measured per-core rate.
  assert res["step_time_s"] == 0.5 and res["needed_images_per_sec_per_host"] == 64.0
  assert res["host_cores_needed"] == pytest.approx(64.0 / res["images_per_cpu_sec"])
  printed = re.search(r"input pipeline: ([\d.]+) images/s median", p.stdout)
  assert printed and float(printed.group(1)) == pytest.approx(res["images_per_sec_median"],
                                                              abs=0.06)
  assert "model need: 64.0 images/s per host" in p.stdout


def test_bench_derives_the_step_time_from_model_flops(folder, tmp_path):
  out = str(tmp_path / "res.jsonl")
  p = _run("--config=configs/mae_cpu_mnist.py", f"--config.data.dataset=imagefolder:{folder}",
           "--config.data.eval_split=val", "--config.data.image_size=28", "--batch_size=8",
           "--steps=1", "--repeats=1", "--warmup=0", "--global_batch=1024", "--chips=8",
           "--hosts=1", "--peak_tflops=100", "--mfu=0.5", f"--out={out}")
  assert p.returncode == 0, p.stderr[-3000:]
  res = json.loads(open(out).read().splitlines()[-1])
  expected = res["model_gflops_per_image"] * 1e9 * 1024 / (8 * 100e12 * 0.5)
  assert res["model_gflops_per_image"] > 0
  assert res["step_time_s"] == pytest.approx(expected, rel=1e-9)
  assert res["needed_images_per_sec_per_host"] == pytest.approx(1024 / expected)


@pytest.mark.parametrize("args,phrase", [
    (["--config=configs/mae_cpu_mnist.py", "--steps=0"], "--steps=0 is not allowed"),
    (["--config=configs/mae_cpu_mnist.py", "--config.data.dataset=imagefolder:/no/such/dir"],
     "the directory '/no/such/dir' does not exist"),
    (["--make_folder=/tmp/x", "--images=0"], "--images=0 is not allowed"),
])
def test_bad_input_gives_one_line(args, phrase):
  p = _run(*args)
  errors = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert p.returncode == 2 and len(errors) == 1 and phrase in errors[0], p.stderr[-2000:]
  assert "Traceback" not in p.stderr
