"""Runtime failures of the training command end in one line and an exit status of their own.

Real commands (``python -m decay_jax.cli.train``), as a user or a scheduler runs them: two runs started
on one workdir at once (one trains, the other stops: 73); SIGTERM during startup, during a save and
at a random moment (143; each rerun resumes and the last ends with the parameters of an
uninterrupted run, bit for bit); a tmpfs that fills during a save (74: the line lists the intact
checkpoints and removes the partial save; the rerun on the enlarged tmpfs resumes and ends equal
to the uninterrupted run); an object store that cannot be reached (75). In-process: the line and
status ``errors.report`` gives each failure class, and the divergence line with and without a
checkpoint.

The commands share one JAX compilation cache with test_checkpoint_integrity.py (see there).
"""

import os
import random
import re
import signal
import socket
import subprocess
import threading
import time

import chex
import pytest

from decay_jax.cli import errors
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import failures, trainer
from decay_jax.validate import InputError
from test_checkpoint_integrity import STEPS, command, command_env, final_state, jit_cache, spec
from testing_configs import run_to_end, wait_for_no_processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
assert spec  # a fixture of this module too (imported)


class Running:
  """A command started in its own session, its stderr collected line by line as it comes."""

  def __init__(self, args, env):
    self.proc = subprocess.Popen(args, cwd=REPO, env=env, text=True, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, start_new_session=True)
    self.lines = []
    self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr),
                                    daemon=True)
    self._reader.start()

  def seen(self, text):
    return any(text in line for line in list(self.lines))

  def finish(self, timeout=300):
    """Waits for the end (killing it after ``timeout`` s); checks that nothing is left running."""
    try:
      self.proc.wait(timeout=timeout)
    finally:
      if self.proc.poll() is None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
    self._reader.join(timeout=10)
    assert wait_for_no_processes(self.proc.pid) == [], "the command left processes behind"
    return self.proc.returncode, "".join(self.lines)


def error_lines(stderr):
  return [line for line in stderr.splitlines() if line.startswith("error:")]


def one_error_line(stderr):
  lines = error_lines(stderr)
  assert len(lines) == 1, stderr[-3000:]
  assert "Traceback" not in stderr, stderr[-3000:]
  return lines[0]


@pytest.fixture(scope="module")
def unreachable_store(tmp_path_factory):
  """The command on a gs:// workdir whose endpoint refuses connections, started now and left
  running (its client retries for about half a minute) while the other tests run."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # closed again: nothing listens there
  url = f"http://127.0.0.1:{port}"
  env = command_env(jit_cache(tmp_path_factory), STORAGE_EMULATOR_HOST=url, FSSPEC_GCS_TOKEN="anon",
                    GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", EPATH_USE_TF="false",
                    TENSORSTORE_GCS_HTTP_URL=url, GOOGLE_AUTH_TOKEN_FOR_TESTING="test")
  return port, Running(command("gs://decay-jax-test/run"), env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, spec, unreachable_store):
  """Two commands started at once on one workdir: one trains to the end, uninterrupted (the
  reference of this module), the other stops at once."""
  del unreachable_store  # started first, so that its retries overlap with everything here
  workdir = str(tmp_path_factory.mktemp("failures") / "straight")
  env = command_env(jit_cache(tmp_path_factory))
  runs = [Running(command(workdir), env) for _ in range(2)]
  results = [run.finish() for run in runs]
  return {"workdir": workdir, "results": results, "pids": [r.proc.pid for r in runs],
          "state": final_state(workdir, spec)[0] if os.path.isdir(workdir) else None}


def test_two_runs_on_one_workdir_one_trains_the_other_stops(reference):
  codes = [code for code, _ in reference["results"]]
  assert sorted(codes) == [0, failures.WORKDIR_BUSY], [s[-2000:] for _, s in reference["results"]]
  loser = codes.index(failures.WORKDIR_BUSY)
  line = one_error_line(reference["results"][loser][1])
  winner = reference["pids"][1 - loser]
  assert line.startswith(f"error: workdir={reference['workdir']!r} is in use by another run "
                         f"(host {socket.gethostname()}, pid {winner}, since "), line
  assert ckpt_lib.checkpoint_steps(reference["workdir"]) == [2, 4, 6]
  assert not os.path.exists(os.path.join(reference["workdir"], "lease.json"))


def test_sigterm_at_startup_in_a_save_and_at_random_then_rerun_equals_uninterrupted(
    reference, spec, tmp_path, tmp_path_factory):
  workdir = str(tmp_path / "run")
  env = command_env(jit_cache(tmp_path_factory))
  # 1. During startup (restore, input, compilation): stops at once, nothing new to save.
  run = Running(command(workdir), env)
  while not run.seen("model: ") and run.proc.poll() is None:  # logged before restore and compile
    time.sleep(0.005)
  run.proc.send_signal(signal.SIGTERM)
  code, stderr = run.finish()
  assert code == failures.PREEMPTED == 143, stderr[-3000:]
  assert one_error_line(stderr) == (
      "error: stopped by SIGTERM outside the train loop (startup, restore, compilation, or after "
      "the last step), with nothing new to save; no checkpoint saved yet (a rerun starts afresh)")
  assert not os.path.exists(os.path.join(workdir, "lease.json"))
  # 2. While a checkpoint is being written: it completes, the next step is saved, exit 143.
  run = Running(command(workdir), env)
  checkpoints = os.path.join(workdir, "checkpoints")
  saving = lambda: os.path.isdir(checkpoints) and any(".orbax-checkpoint-tmp" in n
                                                     for n in os.listdir(checkpoints))
  while run.proc.poll() is None and not saving():
    time.sleep(0.002)
  assert run.proc.poll() is None, "no save was seen in progress"
  run.proc.send_signal(signal.SIGTERM)
  code, stderr = run.finish()
  assert code == failures.PREEMPTED, stderr[-3000:]
  stopped = re.search(r"stopped at step (\d+) after SIGTERM, its checkpoint saved; rerun the same "
                      r"command to resume \(the command exits with status 143\)", stderr)
  assert stopped and error_lines(stderr) == [], stderr[-3000:]
  saved = ckpt_lib.checkpoint_steps(workdir)
  assert saved[-1] == int(stopped.group(1)) < STEPS and saved[0] == 2, (saved, stderr[-3000:])
  # 3. At a random moment of a rerun (during imports SIGTERM ends the process itself: -15, which
  # a shell reports as 143 too; after the end it changes nothing).
  seed = random.randrange(10**6)
  delay = random.Random(seed).uniform(0.0, 10.0)
  run = Running(command(workdir), env)
  time.sleep(delay)
  run.proc.send_signal(signal.SIGTERM)
  code, stderr = run.finish()
  assert code in (failures.PREEMPTED, -signal.SIGTERM, 0), (seed, delay, code, stderr[-3000:])
  if code == failures.PREEMPTED:
    assert len(error_lines(stderr)) + stderr.count("after SIGTERM, its checkpoint saved") == 1, (
        seed, delay, stderr[-3000:])
  # 4. The rerun resumes and ends where the uninterrupted run ended, bit for bit.
  p = run_to_end(command(workdir), REPO, env)
  assert p.returncode == 0, (seed, delay, p.stderr[-3000:])
  state, meta = final_state(workdir, spec)
  assert meta["step"] == STEPS
  chex.assert_trees_all_equal(state, reference["state"])


def _blocks(directory):
  """Bytes the files under ``directory`` take on a tmpfs (whole pages)."""
  total = 0
  for d, _, files in os.walk(directory):
    for f in files:
      total += -(-os.path.getsize(os.path.join(d, f)) // 4096) * 4096
  return total


@pytest.fixture
def small_tmpfs(tmp_path):
  mount = tmp_path / "disk"
  mount.mkdir()
  def resize(kib):
    options = ["-o", f"remount,size={kib}k" if os.path.ismount(mount) else f"size={kib}k"]
    subprocess.run(["mount", "-t", "tmpfs", *options, "tmpfs", str(mount)], check=True)
  try:
    yield mount, resize
  finally:
    if os.path.ismount(mount):
      subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_disk_that_fills_during_a_save_gives_one_line_and_the_rerun_resumes(
    reference, spec, small_tmpfs, tmp_path_factory):
  mount, resize = small_tmpfs
  ref = os.path.join(reference["workdir"], "checkpoints")
  # Room for checkpoints 2 and 4 and the small files, and about half of checkpoint 6.
  size = _blocks(os.path.join(ref, "2")) + _blocks(os.path.join(ref, "4")) + 64 * 1024
  resize((size + _blocks(os.path.join(ref, "6")) // 2) // 1024)
  workdir = str(mount / "run")
  env = command_env(jit_cache(tmp_path_factory))
  p = run_to_end(command(workdir), REPO, env)
  line = one_error_line(p.stderr)
  assert p.returncode == failures.STORAGE_FULL == 74, p.stderr[-3000:]
  intact = ckpt_lib.checkpoint_steps(workdir)
  assert intact and intact[-1] < STEPS, intact
  listed = ", ".join(map(str, intact))
  assert re.fullmatch(
      rf"error: no space left in workdir='{re.escape(workdir)}' \(disk or quota full: No space "
      rf"left on device\) while saving checkpoint \d+; intact checkpoints: {listed} \(a rerun "
      rf"resumes from step {intact[-1]}\); the partial save \d+\.orbax-checkpoint-tmp\S* was "
      r"removed; free space or raise the quota, then rerun the same command", line), line
  assert not [n for n in os.listdir(os.path.join(workdir, "checkpoints")) if "tmp" in n]
  resize(64 * 1024)  # a bigger disk, the same workdir
  p = run_to_end(command(workdir), REPO, env)
  assert p.returncode == 0, p.stderr[-3000:]
  assert f"resumed from step {intact[-1]}" in p.stderr
  state, meta = final_state(workdir, spec)
  assert meta["step"] == STEPS
  chex.assert_trees_all_equal(state, reference["state"])


def test_each_failure_is_one_line_with_its_status(capsys):
  cases = [
      (trainer.NonFiniteLossError("training diverged: x"), 3),
      (failures.WorkdirBusyError("workdir='w' is in use by another run"), 73),
      (failures.StorageFullError("no space left"), 74),
      (failures.StoreUnreachableError("cannot be reached"), 75),
      (failures.Terminated("SIGTERM"), 143),
      (ckpt_lib.CheckpointError("workdir='w' cannot be resumed"), 2),
      (InputError("--x: bad"), 2),
      (OSError(28, "No space left on device", "/w/metrics.jsonl"), 74),
      (ValueError("RESOURCE_EXHAUSTED: Error writing local file \"/w/x\": [os_error_code='28']"
                  " No space left on device"), 74),
      (ConnectionRefusedError(111, "Connect call failed"), 75),
  ]
  for e, status in cases:
    assert errors.report(e) == status, e
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
  assert errors.report(OSError(28, "No space left on device", "/w/m.jsonl")) == 74
  assert capsys.readouterr().err == ("error: no space left (disk or quota full: No space left on "
                                     "device, writing /w/m.jsonl); free space or raise the quota, "
                                     "then rerun the same command\n")
  assert errors.report(KeyError("a bug")) is None  # keeps its traceback
  assert errors.report(ValueError("shapes (3,) and (4,) differ")) is None


class _Checkpoints:
  def __init__(self, latest):
    self.latest = latest

  def wait(self):
    pass

  def latest_step(self):
    return self.latest


@pytest.mark.parametrize("latest,newest", [
    (None, "no checkpoint saved yet (a rerun starts afresh)"),
    (20, "the newest checkpoint is step 20, finite (a rerun resumes from it)")])
def test_divergence_names_its_step_and_the_newest_checkpoint(latest, newest):
  history = [(21, {"loss": 0.5, "grad_norm": 1.0}), (22, {"loss": float("nan"), "grad_norm": 2.0})]
  with pytest.raises(trainer.NonFiniteLossError) as e:
    trainer._check_finite(history, 22, _Checkpoints(latest))
  assert str(e.value) == (
      f"training diverged: non-finite loss/gradient at step 22 (loss=nan, grad_norm=2.0); "
      f"{newest}; lower the learning rate (or use float32) and rerun")
  assert e.value.status == failures.DIVERGED == 3


def test_an_unreachable_object_store_gives_one_line(unreachable_store):
  port, run = unreachable_store
  code, stderr = run.finish(timeout=240)
  line = one_error_line(stderr)
  assert code == failures.UNREACHABLE == 75, stderr[-3000:]
  assert line.startswith("error: a server or object store cannot be reached (ClientConnectorError: "
                         f"Cannot connect to host 127.0.0.1:{port} "), line
  assert line.endswith("(workdir='gs://decay-jax-test/run'); check the network, the endpoint and "
                       "the credentials, then rerun the same command: it resumes from the newest "
                       "checkpoint"), line
