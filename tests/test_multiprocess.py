"""Multi-host for real: two processes on localhost, 4 CPU devices each, joined by
``jax.distributed.initialize`` (gloo CPU collectives), run the real MAE and SiT trainers with
per-host input shards and write one orbax checkpoint together; one process with 8 devices then
restores it and continues. Losses and parameters must equal a single-process 8-device run.
The MAE run reads an image folder of PNG digits (each host its shard, through Grain workers) with
its parameters split over both hosts; a copy of its checkpoint is also resumed by the two
processes themselves, each restoring its own saved input state.

The same file is the worker: ``python tests/test_multiprocess.py --worker PID PORT ROOT``.
"""

import os
import json
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
from xla_env import xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
STOP = 3  # both runs stop (simulated preemption) and checkpoint after this step ...
TOTAL = 6  # ... and are resumed in one process up to this one
TIMEOUT_S = 600  # the whole two-process phase; measured ~60 s on 2 idle cores before the folder run
LOCAL_DEVICES = 4


def digit_folder(root: str) -> str:
  """``root/digits``: 64 + 20 PNG digits (``testing_configs.write_digit_folder``)."""
  from testing_configs import write_digit_folder
  return write_digit_folder(os.path.join(root, "digits"))


def configs(root: str):
  """Tiny MAE on an image folder read by two Grain worker processes per host, data 1 x fsdp 8
  (sharded parameters span both hosts, so the step, the picture and the checkpoint writes need
  cross-process collectives), and SiT (data 8, with an EMA)."""
  from test_sit_train import tiny_sit_config
  from test_train import tiny_config
  common = {"num_train_steps": TOTAL, "checkpoint.every_steps": 100,
            "checkpoint.async_save": True}
  folder = {"data.dataset": "imagefolder:" + digit_folder(root), "data.num_workers": 2,
            "data.num_threads": 1}
  return {"mae": tiny_config(**common, **folder, **{"mesh.data": 1, "mesh.fsdp": 8,
                                                    "picture_every_steps": STOP}),
          "sit": tiny_sit_config(**common, **{"mesh.data": -1})}


def train(name, workdir, root, stop=None):
  """The real trainer; with ``stop`` it is 'preempted' after that step (all hosts agree on it)."""
  from decay_jax.evals import registry
  from decay_jax.train import trainer
  original = trainer._Preemption.reached
  if stop is not None:  # the real multi-host sync point is still asked at every other step
    trainer._Preemption.reached = lambda self, step: step == stop or original(self, step)
  try:
    return trainer.train_and_evaluate(configs(root)[name], workdir, evaluators=registry.build)
  finally:
    trainer._Preemption.reached = original


def worker(pid: int, port: int, root: str) -> None:
  import jax
  from absl import logging as absl_logging
  from jax.experimental import multihost_utils
  absl_logging.set_verbosity(absl_logging.INFO)  # the trainer's resume line goes to the log
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                             initialization_timeout=120)
  assert jax.process_count() == 2 and jax.device_count() == 2 * LOCAL_DEVICES
  for name in ("mae", "sit"):
    t0 = time.monotonic()
    res = train(name, os.path.join(root, "two_process", name), root, stop=STOP)
    assert res["preempted"] and res["step"] == STOP, res
    print(f"process {pid}: {name} {STOP} steps in {time.monotonic() - t0:.1f} s "
          f"(compile {res['compile_seconds']:.1f} s)", flush=True)
  # The MAE run, copied at STOP, is resumed by both processes (each restores its own stream).
  if pid == 0:
    shutil.copytree(os.path.join(root, "two_process", "mae"),
                    os.path.join(root, "two_process", "mae_at_stop"))
  multihost_utils.sync_global_devices("copied")
  res = train("mae", os.path.join(root, "two_process", "mae"), root)
  assert not res["preempted"] and res["step"] == TOTAL, res
  jax.distributed.shutdown()


# ------------------------------------------------------------------------------------------------
# The test (runs in the pytest process, which has 8 fake CPU devices from conftest.py).


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_two_processes(root: str) -> float:
  """Starts both workers in their own process groups; kills both on failure or timeout."""
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(LOCAL_DEVICES))
  logs = [open(os.path.join(root, f"worker{i}.log"), "w") for i in range(2)]
  t0 = time.monotonic()
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(i),
                             str(port), root], cwd=REPO, env=env, stdout=logs[i],
                            stderr=subprocess.STDOUT, start_new_session=True) for i in range(2)]
  try:
    for p in procs:
      p.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - t0)))
      if p.returncode != 0:  # a dead peer leaves the other waiting in a collective: stop now
        break
  except subprocess.TimeoutExpired:
    pass
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for f in logs:
      f.close()
  codes = [p.returncode for p in procs]
  if codes != [0, 0]:
    tails = "".join(f"\n--- worker {i} (exit {c}) ---\n" + open(f.name).read()[-3000:]
                    for i, (c, f) in enumerate(zip(codes, logs)))
    raise AssertionError(f"two-process run failed or timed out after {TIMEOUT_S} s:{tails}")
  return time.monotonic() - t0


def logged_losses(workdir: str) -> dict:
  """``{step: loss}`` as the run logged it (``metrics.jsonl``, appended across resumes)."""
  return dict(writers.read_scalars(workdir, "loss"))


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
  sys.path[:0] = [REPO, HERE]
  worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
  sys.exit(0)

import chex  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

from decay_jax.train import writers  # noqa: E402
from test_train import restore_params  # noqa: E402

# float32 sums over 8 devices are reduced in another order by gloo than in one process.
LOSS_RTOL = 1e-6
PARAM_ATOL, PARAM_RTOL = 1e-6, 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Two processes train to STOP and checkpoint; this process (8 devices) resumes that checkpoint
  to TOTAL and runs the same TOTAL steps uninterrupted as the reference."""
  root = str(tmp_path_factory.mktemp("multiprocess"))
  digit_folder(root)  # before the workers start: both read it
  out = {"seconds": run_two_processes(root)}
  for name, config in configs(root).items():
    two, one = (os.path.join(root, k, name) for k in ("two_process", "one_process"))
    if name == "mae":  # resumed to TOTAL by the two processes already
      two = os.path.join(root, "two_process", "mae_at_stop")
    at_stop = restore_params(two, config)  # written by two processes, restored onto 8 devices
    losses_at_stop = logged_losses(two)
    res = train(name, two, root)
    assert not res["preempted"] and res["step"] == TOTAL
    assert train(name, one, root)["step"] == TOTAL
    out[name] = dict(two=two, at_stop=at_stop, losses_at_stop=losses_at_stop,
                     final={k: restore_params(d, config) for k, d in (("two", two), ("one", one))},
                     losses={k: logged_losses(d) for k, d in (("two", two), ("one", one))})
  mae_two = os.path.join(root, "two_process", "mae")
  out["mae_two_hosts"] = dict(final=restore_params(mae_two, configs(root)["mae"]),
                              losses=logged_losses(mae_two), workdir=mae_two,
                              at_stop=os.path.join(root, "two_process", "mae_at_stop"))
  return out


@pytest.mark.parametrize("name", ["mae", "sit"])
def test_two_processes_train_and_checkpoint_like_one(runs, name):
  r = runs[name]
  two, one = r["losses_at_stop"], r["losses"]["one"]
  assert sorted(two) == list(range(1, STOP + 1))
  np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(two)],
                             rtol=LOSS_RTOL)
  state, meta = r["at_stop"]
  assert meta["step"] == int(state["step"]) == STOP and meta["examples_seen"] == STOP * 16
  if name == "mae":  # drawn by both processes (the parameters are split over both), saved by one
    assert os.path.exists(os.path.join(r["two"], "pictures", f"step_{STOP:07d}.png"))


@pytest.mark.parametrize("name", ["mae", "sit"])
def test_two_process_checkpoint_continues_in_one_process(runs, name):
  r = runs[name]
  two, one = r["losses"]["two"], r["losses"]["one"]
  assert sorted(two) == sorted(one) == list(range(1, TOTAL + 1))
  np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(two)],
                             rtol=LOSS_RTOL)
  (s2, m2), (s1, _) = r["final"]["two"], r["final"]["one"]
  assert m2["step"] == int(s2["step"]) == TOTAL
  # Equal after 3 more AdamW steps: the restored parameters and moments were the right ones.
  keys = ("params", "opt_state", "ema") if name == "sit" else ("params", "opt_state")
  for k in keys:
    chex.assert_trees_all_close(s2[k], s1[k], atol=PARAM_ATOL, rtol=PARAM_RTOL)
  print(f"{name}: two-process phase {runs['seconds']:.0f} s; max loss rel. diff "
        f"{max(abs(two[s] / one[s] - 1) for s in two):.2e}; max param abs. diff " + str(max(
            float(np.abs(a - b).max()) for a, b in zip(jax.tree_util.tree_leaves(s2["params"]),
                                                       jax.tree_util.tree_leaves(s1["params"])))))
  moved = max(float(np.abs(a - b).max()) for a, b in zip(
      jax.tree_util.tree_leaves(s2["params"]), jax.tree_util.tree_leaves(r["at_stop"][0]["params"])))
  assert moved > 1e-4  # the steps after the resume changed the parameters


def test_each_host_saves_and_restores_its_own_input_state(runs):
  """The MAE run's checkpoint holds one Grain state per process (its own shard of the batch,
  next step STOP); resumed by both processes, each restored it and the run equals one process."""
  data = os.path.join(runs["mae_two_hosts"]["at_stop"], "checkpoints", str(STOP), "data")
  for p in range(2):
    with open(os.path.join(data, f"process_{p}-of-2.json")) as f:
      state = json.load(f)
    assert state["next_step"] == STOP and state["num_workers"] == 2
    assert state["layout"] == {"global_batch": 16, "process_index": p, "process_count": 2,
                               "start_step": 0}
    assert isinstance(state["grain"], dict) and state["grain"]
  r = runs["mae_two_hosts"]
  one = runs["mae"]["losses"]["one"]
  assert sorted(r["losses"]) == list(range(1, TOTAL + 1))
  np.testing.assert_allclose([r["losses"][s] for s in sorted(one)],
                             [one[s] for s in sorted(one)], rtol=LOSS_RTOL)
  (s2, _), (s1, _) = r["final"], runs["mae"]["final"]["one"]
  for k in ("params", "opt_state"):
    chex.assert_trees_all_close(s2[k], s1[k], atol=PARAM_ATOL, rtol=PARAM_RTOL)
  log = open(os.path.join(os.path.dirname(os.path.dirname(r["workdir"])), "worker1.log")).read()
  assert "restored from the checkpoint's input state" in log
