"""Config helpers shared by the end-to-end tests."""

import importlib.util
import os
import signal
import subprocess
import time

from decay_jax.train import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str, *args):
  """``configs/<name>.py``'s ``get_config(*args)`` (``args``: the ``:string`` of ``--config``).

  A ``name`` ending in ``.py`` is a path from the repository root (the study's config).
  """
  path = (os.path.join(REPO, name) if name.endswith(".py")
          else os.path.join(REPO, "configs", f"{name}.py"))
  spec = importlib.util.spec_from_file_location("cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(*args)


override = config_lib.override  # dotted-field overrides, shared with research.small_scale_study.run


def shrink_lines(steps: int) -> str:
  """Lines of a config file's ``get_config`` that shrink a CPU config to ``steps`` steps on 16-pixel
  digits, one device, synchronous checkpoints (at the last step), logging every ``steps / 2``."""
  return f"""
  c.data.image_size = 16
  c.num_train_steps = {steps}
  c.warmup_epochs = 0.0
  c.log_every_steps = {max(1, steps // 2)}
  c.picture_every_steps = 0
  c.checkpoint.every_steps = {steps}
  c.checkpoint.async_save = False
  c.mesh.data = 1
"""


def write_digit_folder(directory: str, train: int = 64, test_per_class: int = 2) -> str:
  """An image folder of PNG digits from the embedded MNIST: ``directory/train/<digit>/<i>.png``
  (the first ``train`` training digits) and ``directory/test/<digit>/<i>.png`` (the first
  ``test_per_class`` test digits of each class, so both splits have all ten class folders).
  File names are zero-padded indices, so the sorted order is the index order within a class.
  Written once; returns ``directory``."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  if os.path.isdir(directory):
    return directory
  with np.load(os.path.join(REPO, "decay_jax", "data", "embedded", "mnist_10k.npz")) as d:
    test = np.concatenate([np.nonzero(d["y_test"] == c)[0][:test_per_class] for c in range(10)])
    arrays = {"train": (d["x_train"][:train], d["y_train"][:train]),
              "test": (d["x_test"][test], d["y_test"][test])}
  for split, (images, labels) in arrays.items():
    for i, (image, label) in enumerate(zip(images, labels)):
      os.makedirs(os.path.join(directory, split, str(label)), exist_ok=True)
      Image.fromarray(image[..., 0], "L").save(
          os.path.join(directory, split, str(label), f"{i:04d}.png"))
  return directory


def session_processes(session_id: int) -> list:
  """Pids of the live processes of a session (``start_new_session=True`` makes a command the leader
  of its own; workers it spawned stay in it even when orphaned). Zombies do not count."""
  out = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone meanwhile
      continue
    if fields[0] not in "ZX" and int(fields[3]) == session_id:
      out.append(int(entry))
  return out


def wait_for_no_processes(session_id: int, limit_s: float = 60.0) -> list:
  """Waits (up to ``limit_s``) until no process of the session is left; returns the pids that were
  left, after killing them (so that a failing test leaves nothing running)."""
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + limit_s
  while (left := session_processes(session_id)) and time.monotonic() < deadline:
    time.sleep(0.2)
  for pid in left:
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass
  return left


class _Unpicklable(Exception):
  """An exception a worker cannot send back (pickling its lock fails in the queue's thread)."""

  def __init__(self, message):
    super().__init__(message)
    import threading  # pylint: disable=g-import-not-at-top
    self.lock = threading.Lock()


class FailingExample:
  """A training-stream example (``loader.TrainStream``) that raises an exception Grain cannot pickle
  at index ``at`` (importable here, so that a Grain worker process can unpickle it)."""

  def __init__(self, at: int):
    self.at = at

  def __call__(self, j):
    import numpy as np  # pylint: disable=g-import-not-at-top
    if j == self.at:
      raise _Unpicklable(f"record {j} is cursed")
    return {"image": np.zeros((2, 2, 1), np.uint8), "label": np.int32(j)}


def run_to_end(args, cwd: str, env: dict, timeout: float = 300):
  """Runs a command in its own session to its end (killed after ``timeout`` s); checks that it
  left no process behind. Returns the ``subprocess.CompletedProcess`` (text stdout and stderr)."""
  proc = subprocess.Popen(args, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, start_new_session=True)
  try:
    stdout, stderr = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  assert wait_for_no_processes(proc.pid) == [], "the command left processes behind"
  return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def kill_at_first_checkpoint(proc, workdir: str, limit_s: float = 240) -> list:
  """SIGKILLs ``proc``'s session (the trainer and its workers, mid-step) once ``workdir`` holds a
  checkpoint (or after ``limit_s``); returns the checkpoint steps found."""
  from decay_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + limit_s
  try:
    while time.monotonic() < deadline and proc.poll() is None:
      if os.path.isdir(os.path.join(workdir, "checkpoints")) and ckpt_lib.checkpoint_steps(workdir):
        break
      time.sleep(0.05)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
  return ckpt_lib.checkpoint_steps(workdir)
