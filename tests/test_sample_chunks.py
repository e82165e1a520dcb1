"""Sampling at scale (decay_jax/evals/sampling.py, decay_jax.cli.sample): a run killed by SIGKILL
after its first chunk resumes to the same images as an uninterrupted run; damaged chunks are named
and drawn again; another sampling's chunks are refused; the final .npz is ADM's layout and reads
back in decay_jax.cli.fid's reader."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from decay_jax.evals import generation, sampling
from decay_jax.train import trainer
from test_sit_train import tiny_sit_config
from xla_env import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ("--num=12", "--batch_size=4", "--mode=sde", "--method=euler", "--steps=3", "--grid=8")


def command(workdir, out, *extra):
  return [sys.executable, "-m", "decay_jax.cli.sample", f"--workdir={workdir}", f"--out={out}",
          *ARGS, *extra]


def env(devices, **extra):
  return dict(os.environ, JAX_PLATFORMS="cpu", **extra,
              XLA_FLAGS=xla_flags(devices))


def run_sample(workdir, out, *extra, devices=1):
  p = subprocess.run(command(workdir, out, *extra), cwd=REPO, capture_output=True, text=True,
                     env=env(devices), timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  return p.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A SiT run trained 2 steps; its 12 samples uninterrupted on 1 device, and killed after chunk 0
  on 4 devices and resumed on 2."""
  root = tmp_path_factory.mktemp("chunks")
  work = root / "run"
  trainer.train_and_evaluate(tiny_sit_config(num_train_steps=2), str(work))
  straight, resumed = root / "straight", root / "resumed"
  run_sample(work, straight)
  slow = env(4, **{sampling.SLEEP_ENV: "120"})  # a pause after each chunk: kill between two
  proc = subprocess.Popen(command(work, resumed), cwd=REPO, env=slow, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  first = resumed / "chunks" / "chunk_000000.npz"
  deadline = time.time() + 240
  while not first.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert first.exists() and proc.returncode == -signal.SIGKILL
  left = sorted(os.listdir(resumed / "chunks"))
  assert left == ["chunk_000000.npz", "manifest.json"], left
  (resumed / "chunks" / ".chunk_000001.npz.tmp").write_bytes(b"half a chunk")  # a killed write
  log = run_sample(work, resumed, "--keep_chunks", devices=2)
  return work, straight, resumed, log


def test_killed_run_resumes_to_the_same_images(runs):
  _, straight, resumed, log = runs
  assert "3 chunks of 4" in log and "1 chunks already there, 2 to draw" in log
  with np.load(straight / "samples.npz") as a, np.load(resumed / "samples.npz") as b:
    assert a["arr_0"].shape == (12, 16, 16, 3) and a["arr_0"].dtype == np.uint8
    assert a["arr_0"].std() > 0
    np.testing.assert_array_equal(b["arr_0"], a["arr_0"])
    np.testing.assert_array_equal(b["arr_1"], a["arr_1"])  # ADM: labels of conditional models
    np.testing.assert_array_equal(a["labels"], a["arr_1"])
    assert a["arr_1"].dtype == np.int32 and 0 <= a["arr_1"].min() and a["arr_1"].max() < 10
  assert not (straight / "chunks").exists()  # removed once the .npz is written
  assert sorted(os.listdir(resumed / "chunks")) == [
      "chunk_000000.npz", "chunk_000001.npz", "chunk_000002.npz", "manifest.json"]
  # cli/fid's reader takes it: images as arr_0, no statistics
  path = str(resumed / "samples.npz")
  assert generation.read_batch(path) == ({}, True)
  np.testing.assert_array_equal(generation.load_images(path), np.load(path)["arr_0"])
  assert os.path.getsize(resumed / "grid.png") > 500


def test_damaged_chunks_are_named_and_drawn_again(runs, tmp_path):
  work, straight, resumed, _ = runs
  out = tmp_path / "damaged"
  shutil.copytree(resumed / "chunks", out / "chunks")
  one, two = out / "chunks" / "chunk_000001.npz", out / "chunks" / "chunk_000002.npz"
  one.write_bytes(one.read_bytes()[:1000])  # cut short
  with np.load(two) as d:
    np.savez(two, images=d["images"][:, :8], labels=d["labels"], latents=d["labels"],
             index=d["index"])  # wrong shape
  log = run_sample(work, out)
  assert f"chunk {one} is damaged (unreadable" in log
  assert f"chunk {two} is damaged (images is uint8 (4, 8, 16, 3), not uint8 (4, 16, 16, 3))" in log
  assert "1 chunks already there, 2 to draw" in log
  with np.load(straight / "samples.npz") as a, np.load(out / "samples.npz") as b:
    np.testing.assert_array_equal(b["arr_0"], a["arr_0"])


def _arrays(i):
  rng = np.random.default_rng(i)
  return {"images": rng.integers(0, 256, (4, 2, 2, 3), dtype=np.uint8),
          "labels": rng.integers(0, 5, 4).astype(np.int32)}


EXPECT = sampling.expected(4, {"images": ((2, 2, 3), "uint8"), "labels": ((), "int32")})


def test_a_flipped_byte_fails_the_crc(tmp_path):
  path = str(tmp_path / "chunk_000003.npz")
  sampling.write_chunk(path, dict(_arrays(3), index=np.int64(3)))
  assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
  got = sampling.read_chunk(path, 3, EXPECT)
  np.testing.assert_array_equal(got["images"], _arrays(3)["images"])
  with pytest.raises(sampling.ChunkError, match="its index is 3, not 4"):
    sampling.read_chunk(path, 4, EXPECT)
  raw = bytearray(open(path, "rb").read())
  at = raw.index(_arrays(3)["images"].tobytes())  # inside the stored images member
  raw[at + 5] ^= 1
  open(path, "wb").write(bytes(raw))
  with pytest.raises(sampling.ChunkError, match="unreadable.*CRC"):
    sampling.read_chunk(path, 3, EXPECT)


def test_chunks_of_another_sampling_are_refused_and_assembly_streams(tmp_path):
  out = str(tmp_path)
  logs = []
  counts = sampling.sample(out, {"seed": 0}, 10, 4, _arrays, EXPECT, logs.append)
  assert counts == {"chunks": 3, "reused": 0, "drawn": 3}
  assert sampling.sample(out, {"seed": 0}, 10, 4, _arrays, EXPECT, logs.append)["reused"] == 3
  with pytest.raises(ValueError, match=r"holds chunks of another sampling \(seed: 0 != 1\)"):
    sampling.sample(out, {"seed": 1}, 10, 4, _arrays, EXPECT, logs.append)
  kept = sampling.assemble(out, 10, 4, EXPECT, {"samples.npz": [("arr_0", "images"),
                                                                ("arr_1", "labels")]}, keep=6)
  want = {k: np.concatenate([_arrays(i)[k] for i in range(3)])[:10] for k in ("images", "labels")}
  with np.load(tmp_path / "samples.npz") as d:
    assert sorted(d.keys()) == ["arr_0", "arr_1"]
    np.testing.assert_array_equal(d["arr_0"], want["images"])
    np.testing.assert_array_equal(d["arr_1"], want["labels"])
  np.testing.assert_array_equal(kept["images"], want["images"][:6])
