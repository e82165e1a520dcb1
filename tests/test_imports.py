"""TensorFlow is imported only where TFDS or TensorBoard needs it: not by importing a command, not by
a training run with ``--config.tensorboard=false``. Also our own writer fan-out and progress report
(which replaced clu's, whose modules import TensorFlow)."""

import glob
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from decay_jax.train import progress, writers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMANDS = ("decay_jax.cli.train", "decay_jax.cli.evaluate", "decay_jax.cli.bench",
            "decay_jax.cli.data_bench", "decay_jax.cli.sample", "decay_jax.cli.fid",
            "decay_jax.cli.compare", "decay_jax.cli.lower", "decay_jax.cli.memory",
            "decay_jax.cli.extract_latents", "decay_jax.cli.trace_table", "decay_jax.main",
            "decay_jax.evaluate", "decay_jax.sample", "research.small_scale_study.study")
HEAVY = ("tensorflow", "tensorflow_datasets", "clu.metric_writers")


def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([REPO, os.path.join(
      REPO, "tests")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_no_command_imports_tensorflow():
  # One fresh interpreter imports the commands one after the other and names the first one after
  # whose import a heavy module is loaded. Each command's absl flags are dropped after its import,
  # so that the next may define its own of the same name.
  p = run_python(f"""
      import importlib, sys
      from absl import flags
      for name in {COMMANDS!r}:
        before = set(flags.FLAGS)
        importlib.import_module(name)
        for flag in set(flags.FLAGS) - before:
          delattr(flags.FLAGS, flag)
        heavy = [m for m in {HEAVY!r} if m in sys.modules]
        if heavy:
          print(f"{{name}} imports {{heavy}}")
          break
      else:
        print("none")
      """)
  assert p.returncode == 0, p.stderr[-3000:]
  assert p.stdout.strip() == "none"


def test_training_without_tensorboard_does_not_import_tensorflow(tmp_path):
  # The real command line, a picture, a checkpoint and the KNN evaluator included; the process
  # reports at exit what it had imported.
  workdir = str(tmp_path / "run")
  args = ["--config=configs/mae_cpu_mnist.py", f"--workdir={workdir}",
          "--config.tensorboard=false", "--config.model.preset=micro/4",
          "--config.data.image_size=16", "--config.batch_size=16", "--config.num_train_steps=2",
          "--config.warmup_epochs=0.0", "--config.log_every_steps=1",
          "--config.picture_every_steps=2", "--config.checkpoint.every_steps=2",
          "--config.checkpoint.async_save=false", "--config.mesh.data=1",
          "--config.evals.knn.max_train_examples=64", "--config.evals.knn.max_eval_examples=32",
          "--config.evals.knn.batch_size=32", "--config.evals.rank.enabled=false"]
  p = run_python(f"""
      import atexit, runpy, sys
      atexit.register(lambda: print("HEAVY", [m for m in {HEAVY!r} if m in sys.modules]))
      sys.argv = ["decay_jax.cli.train"] + {args!r}
      runpy.run_module("decay_jax.cli.train", run_name="__main__")
      """)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
  assert p.stdout.strip().splitlines()[-1] == "HEAVY []", p.stdout[-2000:]
  assert not glob.glob(os.path.join(workdir, "events.out.tfevents.*"))
  rows = writers.read_rows(workdir)
  assert [r["step"] for r in rows if "loss" in r] == [1, 2]
  assert any("knn/top1" in r for r in rows)
  assert os.path.exists(os.path.join(workdir, "pictures", "step_0000002.png"))


# ----------------------------------------------------------------------------------------------
# The asynchronous fan-out.


class Recorder(writers.Writer):
  def __init__(self, fail_at=None, gate=None):
    self.calls, self.threads, self.fail_at, self.gate = [], set(), fail_at, gate
    self.flushed = self.closed = 0

  def write_scalars(self, step, scalars):
    if self.gate is not None:
      self.gate.wait(10)
    self.threads.add(threading.get_ident())
    if step == self.fail_at:
      raise OSError(f"disk full at {step}")
    self.calls.append(("scalars", step, dict(scalars)))

  def write_images(self, step, images):
    self.calls.append(("images", step, sorted(images)))

  def flush(self):
    self.flushed += 1

  def close(self):
    self.closed += 1


def test_fan_out_writes_in_order_in_the_background_and_flushes_and_closes():
  gate = threading.Event()
  slow, fast = Recorder(gate=gate), Recorder()
  w = writers.AsyncMultiWriter([slow, fast])
  for step in range(5):
    w.write_scalars(step, {"loss": float(step)})
  w.write_images(5, {"picture": None})
  assert slow.calls == []  # the caller did not wait for the slow writer ...
  w._pools[1].submit(lambda: None).result(10)  # ... nor did the other writer
  assert len(fast.calls) == 6
  gate.set()
  w.flush()
  expected = [("scalars", s, {"loss": float(s)}) for s in range(5)] + [("images", 5, ["picture"])]
  assert slow.calls == fast.calls == expected
  assert slow.threads.isdisjoint(fast.threads) and threading.get_ident() not in slow.threads
  assert (slow.flushed, fast.flushed) == (1, 1)
  w.close()
  assert (slow.closed, fast.closed) == (1, 1)


def test_a_failed_background_write_is_raised_by_the_next_write_flush_or_close():
  gate = threading.Event()
  bad, good = Recorder(fail_at=1, gate=gate), Recorder()
  w = writers.AsyncMultiWriter([bad, good])
  for step in range(3):
    w.write_scalars(step, {"loss": 1.0})
  gate.set()
  with pytest.raises(writers.WriterError, match="disk full at 1"):
    w.flush()
  assert [c[1] for c in good.calls] == [0, 1, 2] and [c[1] for c in bad.calls] == [0, 2]
  assert good.flushed == bad.flushed == 1  # the writers are flushed all the same
  w.write_scalars(3, {"loss": 1.0})
  w.close()  # raised once: later writes go on
  assert bad.closed == good.closed == 1 and [c[1] for c in bad.calls] == [0, 2, 3]
  # Raised by the next write once it has happened; that write is queued all the same.
  gate = threading.Event()
  rec = Recorder(fail_at=0, gate=gate)
  w = writers.AsyncMultiWriter([rec])
  w.write_scalars(0, {"loss": 1.0})
  gate.set()
  w._pools[0].submit(lambda: None).result(10)
  with pytest.raises(writers.WriterError, match="disk full at 0"):
    w.write_scalars(1, {"loss": 1.0})
  w.close()
  assert [c[1] for c in rec.calls] == [1]
  gate = threading.Event()
  w = writers.AsyncMultiWriter([Recorder(fail_at=0, gate=gate)])
  w.write_scalars(0, {"loss": 1.0})
  gate.set()
  with pytest.raises(writers.WriterError):
    w.close()


# ----------------------------------------------------------------------------------------------
# The progress report (clu's ReportProgress rule and line).


def test_progress_reports_rate_eta_and_timed_share(caplog):
  rec = Recorder()
  report = progress.ReportProgress(num_train_steps=1000, writer=rec)
  assert not report(100, t=0.0)  # the first call starts the clock
  assert not report(101, t=30.0)  # not a minute yet
  with report.timed("eval", wait_jax_async_dispatch=False):
    pass
  report._time_per_part["eval"] = 12.0
  report._t0 -= 120.0  # pretend two minutes have passed since the start
  with caplog.at_level("INFO"):
    assert report(250, t=60.5)
  (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress: ")]
  assert line.startswith("progress: 2.5 steps/s, 25.0% (250/1000), ETA: 5m (2m : ")
  assert line.endswith("% eval)")
  share = float(line.split("(2m : ")[1].split("%")[0])
  assert 9.0 < share <= 10.0  # 12 s of the (just over) 120 s
  ((kind, step, scalars),) = rec.calls
  assert kind == "scalars" and step == 250 and set(scalars) == {"steps_per_sec", "uptime"}
  assert scalars["steps_per_sec"] == pytest.approx(150 / 60.5) and scalars["uptime"] >= 120
  assert not report(251, t=61.0)
  assert report(1000, t=62.0)  # the last step always reports
  assert progress.format_secs(123456.7) == "1d10h17m" and progress.format_secs(59) == "0m"


def test_progress_timed_measures_the_device_work_of_the_block():
  report = progress.ReportProgress(num_train_steps=10)
  with report.timed("eval"):
    pass
  report._executor.submit(lambda: None).result()  # the measurements are done in order
  assert set(report._time_per_part) == {"eval"} and report._time_per_part["eval"] >= 0
