"""One run per workdir: ``workdir/lease.json`` (``decay_jax.train.lease``).

A live lease stops a second run with one line naming the holder (the training command: exit 73,
nothing written); a stale one (an old heartbeat, or a holder on this machine whose process is
gone or whose pid was reused) is taken over with a log line; the heartbeat advances; a run whose
lease was taken over stops before its next checkpoint; the lease is released at the end, on
exceptions too, and a nested hold (the command, then the trainer) leaves releasing to the first.
Two real runs started on one workdir at once are in test_runtime_failures.py.
"""

import json
import logging
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import failures, lease
from testing_configs import run_to_end

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(workdir):
  with open(os.path.join(workdir, lease.NAME)) as f:
    return json.load(f)


def write(workdir, record):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, lease.NAME), "w") as f:
    json.dump(record, f)


@pytest.fixture(scope="module")
def other_process():
  """A live process that is not this one (the holder of a lease in these tests)."""
  proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
  yield proc.pid
  proc.kill()
  proc.wait()


def record_of(pid, heartbeat_age=0.0, **fields):
  """A lease record as a run on this machine with ``pid`` writes it."""
  now = time.time()
  return dict(lease._machine(), pid=pid, pid_start=lease._process_start(pid),
              started=now - 3600, heartbeat=now - heartbeat_age, heartbeat_s=5.0, stale_s=60.0,
              token="x" * 32, command="python -m decay_jax.cli.train ...", **fields)


def test_acquire_writes_the_holder_beats_and_releases(tmp_path):
  workdir = str(tmp_path / "run")
  held = lease.acquire(workdir, heartbeat_s=0.1)
  record = read(workdir)
  assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
  assert record["heartbeat_s"] == 0.1 and record["stale_s"] == lease.STALE_S
  first = record["heartbeat"]
  time.sleep(0.5)
  assert read(workdir)["heartbeat"] > first  # the daemon thread beats
  nested = lease.acquire(workdir)  # the trainer inside the command: no second claim
  nested.release()
  assert read(workdir)["token"] == record["token"]  # still held: the first holder releases
  held.release()
  assert not os.path.exists(os.path.join(workdir, lease.NAME))
  held.release()  # twice: nothing happens


def test_released_on_an_exception(tmp_path):
  workdir = str(tmp_path / "run")
  with pytest.raises(RuntimeError):
    with lease.acquire(workdir):
      raise RuntimeError("boom")
  assert not os.path.exists(os.path.join(workdir, lease.NAME))


def test_a_live_lease_stops_a_second_run_naming_the_holder(tmp_path, other_process):
  workdir = str(tmp_path / "run")
  write(workdir, record_of(other_process, heartbeat_age=2.0))
  with pytest.raises(failures.WorkdirBusyError) as e:
    lease.acquire(workdir)
  started = lease._since(read(workdir)["started"])
  assert str(e.value) == (
      f"workdir={os.path.abspath(workdir)!r} is in use by another run (host "
      f"{socket.gethostname()}, pid {other_process}, since {started}, heartbeat 2 s ago; "
      "lease.json); wait for it to end or stop it, or use another --workdir (a lease whose "
      "heartbeat is 60 s old, or whose process on this machine is gone, is taken over)")
  assert e.value.status == 73
  assert read(workdir)["pid"] == other_process  # untouched


@pytest.mark.parametrize("case", ["old_heartbeat_elsewhere", "dead_pid_here", "reused_pid_here",
                                  "unreadable"])
def test_a_stale_lease_is_taken_over_with_a_log_line(tmp_path, other_process, case, caplog):
  workdir = str(tmp_path / "run")
  if case == "old_heartbeat_elsewhere":  # another machine: only the heartbeat tells
    record = dict(record_of(other_process, heartbeat_age=3600.0), host="elsewhere", boot_id="b")
    reason = "its heartbeat is 3600 s old"
  elif case == "dead_pid_here":  # this machine, process gone (killed): at once, however fresh
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = dict(record_of(other_process), pid=dead.pid, pid_start=None)
    reason = f"its process {dead.pid} on this machine is gone"
  elif case == "reused_pid_here":  # a live pid that another process got after the holder died
    record = dict(record_of(other_process), pid_start="1")
    reason = f"its process {other_process} on this machine is gone"
  else:
    record = None
    reason = "the lease file is unreadable"
  if record is None:
    os.makedirs(workdir)
    with open(os.path.join(workdir, lease.NAME), "w") as f:
      f.write('{"host": "half a fi')
  else:
    write(workdir, record)
  with caplog.at_level(logging.WARNING):
    held = lease.acquire(workdir)
  try:
    assert read(workdir)["pid"] == os.getpid()
    lines = [r.getMessage() for r in caplog.records if "taking over the lease" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        f"taking over the lease of workdir {os.path.abspath(workdir)} from a run that is gone (")
    assert lines[0].endswith(f"): {reason}"), lines[0]
  finally:
    held.release()


def test_a_run_whose_lease_was_taken_over_stops_before_its_next_checkpoint(tmp_path,
                                                                          other_process):
  workdir = str(tmp_path / "run")
  held = lease.acquire(workdir, heartbeat_s=0.05)
  ck = ckpt_lib.RunCheckpoints(workdir, async_save=False, lease=held)
  ck.save(1, {"w": np.ones(2, np.float32)}, {"step": 1})
  write(workdir, record_of(other_process))  # another run took it over (our heartbeat stalled)
  deadline = time.time() + 10
  while held.lost is None and time.time() < deadline:
    time.sleep(0.05)
  with pytest.raises(failures.WorkdirBusyError, match=(
      rf"workdir='.*' was taken over by another run \(host .*, pid {other_process}, .*\) while "
      "this one trained")):
    ck.save(2, {"w": np.ones(2, np.float32)}, {"step": 2})
  ck.close()
  assert ckpt_lib.checkpoint_steps(workdir) == [1]
  held.release()
  assert read(workdir)["pid"] == other_process  # not ours: left to its holder


def test_the_command_on_a_held_workdir_stops_with_one_line(tmp_path, other_process):
  workdir = str(tmp_path / "run")
  write(workdir, record_of(other_process))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
  p = run_to_end([sys.executable, "-m", "decay_jax.cli.train", "--config=configs/mae_cpu_mnist.py",
                  f"--workdir={workdir}"], REPO, env, timeout=120)
  errors = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert p.returncode == failures.WORKDIR_BUSY == 73, p.stderr[-2000:]
  assert len(errors) == 1 and errors[0].startswith(
      f"error: workdir={workdir!r} is in use by another run (host {socket.gethostname()}, pid "
      f"{other_process}, since "), errors
  assert "Traceback" not in p.stderr
  assert sorted(os.listdir(workdir)) == [lease.NAME]  # nothing written: config.json untouched
