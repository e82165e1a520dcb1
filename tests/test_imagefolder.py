"""Image folders (``dataset='imagefolder:DIR'``) end to end: the records, the Grain stream against
the npz stream of the same pixels, exact resume, any image size, one-line errors (an unreadable
image, a worker that died, an exception a worker cannot send back), workers that end with their
training process, a real training command killed with SIGKILL and rerun, a crash on an unreadable
image that keeps the checkpoints, and device-count invariance.

The training commands of this module share one JAX compilation cache (the first run compiles, the
others load the same executables), so that five real runs fit in a CI minute or two."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref

import chex
import jax
import numpy as np
import pytest
from PIL import Image

from decay_jax import sharding as shd
from decay_jax import validate
from decay_jax.data import loader, pipeline
from decay_jax.evals import registry
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import trainer
from test_train import restore_params, tiny_config
from testing_configs import FailingExample, session_processes, wait_for_no_processes
from testing_configs import kill_at_first_checkpoint, run_to_end, write_digit_folder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The command of the issue, made tiny: micro model, 16-px crops, 8 steps, a checkpoint every 2.
STEPS = 8
TINY = ["--config.model.preset=micro/4", "--config.data.image_size=16", "--config.batch_size=16",
        f"--config.num_train_steps={STEPS}", "--config.mesh.data=1", "--config.tensorboard=false",
        "--config.checkpoint.every_steps=2", "--config.checkpoint.async_save=false",
        "--config.picture_every_steps=0", "--config.evals.knn.enabled=false",
        "--config.evals.rank.enabled=false", "--config.warmup_epochs=0.0",
        "--config.data.num_workers=2", "--config.data.num_threads=1"]


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["label"], y["label"])


def cfg_for(dataset, **overrides):
  cfg = pipeline.default_data_config()
  cfg.dataset = dataset
  for key, value in overrides.items():
    setattr(cfg, key, value)
  return cfg


def folder_arrays(directory, split):
  """uint8 (N, H, W, 1) images and labels of a digit folder split in the folder's sorted order."""
  images, labels = [], []
  for label, name in enumerate(sorted(os.listdir(os.path.join(directory, split)))):
    for f in sorted(os.listdir(os.path.join(directory, split, name))):
      images.append(np.asarray(Image.open(os.path.join(directory, split, name, f)))[..., None])
      labels.append(label)
  return np.stack(images), np.asarray(labels)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
  """A PNG digit folder (64 train, 20 test) and an npz of the same pixels in the same order."""
  root = tmp_path_factory.mktemp("folder")
  directory = write_digit_folder(str(root / "digits"))
  (x_train, y_train), (x_test, y_test) = (folder_arrays(directory, s) for s in ("train", "test"))
  np.savez(root / "same.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  _CACHE["dir"] = str(root / "jax_cache")
  yield {"dir": directory, "npz": str(root / "same.npz"), "root": str(root)}
  _CACHE.clear()


def test_info_labels_and_channels(digits):
  cfg = cfg_for("imagefolder:" + digits["dir"], image_size=16)
  assert pipeline.dataset_info(cfg) == {
      "num_train": 64, "num_classes": 10, "channels": 1, "image_size": 16}
  with np.load(os.path.join(REPO, "decay_jax", "data", "embedded", "mnist_10k.npz")) as d:
    mnist_labels = np.sort(d["y_train"][:64])
  ev = pipeline.load_eval_arrays(cfg, "train")
  np.testing.assert_array_equal(ev["label"], mnist_labels)  # folder '3' is label 3
  rgb = cfg_for("imagefolder:" + digits["dir"], image_size=16, channels=3, normalize="imagenet")
  assert pipeline.dataset_info(rgb)["channels"] == 3
  ev_rgb = pipeline.load_eval_arrays(rgb)
  assert ev_rgb["image"].shape == (20, 16, 16, 3) and ev_rgb["image"].dtype == np.uint8
  # Grey converted to RGB: three equal channels (the devices normalise them per channel).
  assert ev_rgb["image"].max() > 0
  np.testing.assert_array_equal(ev_rgb["image"][..., 0], ev_rgb["image"][..., 2])


def test_stream_equals_the_npz_stream_of_the_same_pixels(digits):
  folder = cfg_for("imagefolder:" + digits["dir"], image_size=16, num_workers=2, num_threads=1)
  arrays = cfg_for("npz:" + digits["npz"], image_size=16)
  stream = pipeline.make_train_iterator(folder, 16, seed=7)
  try:
    from_folder = take(stream, 6)  # 96 examples: crosses into the second epoch
  finally:
    stream.close()
  from_npz = take(pipeline.make_train_iterator(arrays, 16, seed=7), 6)
  assert_batches_equal(from_folder, from_npz)
  assert not (from_npz[0]["image"] == from_npz[1]["image"]).all()  # not all blank
  # No worker processes, two threads: the same batches.
  in_process = cfg_for("imagefolder:" + digits["dir"], image_size=16, num_workers=0, num_threads=2)
  assert_batches_equal(from_folder, take(pipeline.make_train_iterator(in_process, 16, seed=7), 6))
  for split in ("train", "test"):
    a, b = pipeline.load_eval_arrays(folder, split), pipeline.load_eval_arrays(arrays, split)
    np.testing.assert_array_equal(a["image"], b["image"])
    np.testing.assert_array_equal(a["label"], b["label"])


def test_resume_from_step_and_from_saved_state(digits):
  cfg = cfg_for("imagefolder:" + digits["dir"], image_size=16)
  full = pipeline.make_train_iterator(cfg, 16, seed=2)
  take(full, 3)
  state = full.get_state()
  rest = take(full, 3)
  assert_batches_equal(rest, take(pipeline.make_train_iterator(cfg, 16, seed=2, start_step=3), 3))
  restored = pipeline.make_train_iterator(cfg, 16, seed=2, start_step=3, state=state)
  assert restored.restored and restored.next_step == 3
  assert_batches_equal(rest, take(restored, 3))
  # A state saved by another layout (here: another worker count) is not used; same batches.
  other = cfg_for("imagefolder:" + digits["dir"], image_size=16, num_workers=1)
  fresh = pipeline.make_train_iterator(other, 16, seed=2, start_step=3, state=state)
  try:
    assert not fresh.restored
    assert_batches_equal(rest, take(fresh, 3))
  finally:
    fresh.close()


def test_rgb_images_of_any_size_and_format(tmp_path):
  rng = np.random.default_rng(0)
  for split in ("train", "val"):
    for c, (h, w, ext) in enumerate([(20, 30, "png"), (40, 17, "JPEG"), (9, 9, "jpg")]):
      os.makedirs(tmp_path / split / f"class_{c}")
      for i in range(3):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
            tmp_path / split / f"class_{c}" / f"{i}.{ext}")
  cfg = cfg_for(f"imagefolder:{tmp_path}", image_size=24, normalize="imagenet", eval_split="val")
  assert pipeline.dataset_info(cfg) == {
      "num_train": 9, "num_classes": 3, "channels": 3, "image_size": 24}
  batch = next(pipeline.make_train_iterator(cfg, 9, seed=0))
  assert batch["image"].shape == (9, 24, 24, 3) and np.isfinite(batch["image"]).all()
  assert sorted(batch["label"].tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
  ev = pipeline.load_eval_arrays(cfg)
  assert ev["image"].shape == (9, 24, 24, 3)
  np.testing.assert_array_equal(ev["label"], [0, 0, 0, 1, 1, 1, 2, 2, 2])
  sliced = cfg_for(f"imagefolder:{tmp_path}", image_size=24, train_split="train[2:7]",
                   eval_split="val[:4]")
  assert pipeline.dataset_info(sliced)["num_train"] == 5
  assert pipeline.load_eval_arrays(sliced)["label"].tolist() == [0, 0, 0, 1]


def _tree(root, spec):
  """Creates directories and files: spec maps relative paths to bytes (None: a directory)."""
  for rel, content in spec.items():
    path = os.path.join(root, rel)
    if content is None:
      os.makedirs(path, exist_ok=True)
    else:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "wb") as f:
        f.write(content)
  return root


def _png():
  import io  # pylint: disable=g-import-not-at-top
  buf = io.BytesIO()
  Image.fromarray(np.zeros((4, 4), np.uint8)).save(buf, "PNG")
  return buf.getvalue()


@pytest.mark.parametrize("case,spec,overrides,phrase", [
    ("missing", None, {}, "the directory '{root}' does not exist"),
    ("no_splits", {"readme.txt": b"x"}, {}, "'{root}' has no split folders"),
    ("no_classes", {"train": None, "test/a/0.png": "png"}, {},
     "'{root}/train' has no class folders"),
    ("empty_class", {"train/a/0.png": "png", "train/b/notes.txt": b"x", "test/a/0.png": "png"},
     {}, "the class folder '{root}/train/b' has no images"),
    ("no_split", {"train/a/0.png": "png"}, {}, "eval_split='test' is not allowed; '{root}' has "
     "the splits 'train'"),
    ("other_classes", {"train/a/0.png": "png", "test/b/0.png": "png"}, {},
     "eval_split='test' is not allowed; its class folders differ"),
    ("bad_slice", {"train/a/0.png": "png", "test/a/0.png": "png"},
     {"train_split": "train[5:]"}, "train_split='train[5:]' is not allowed; it selects no examples"),
])
def test_bad_folders_give_one_line_naming_the_path(tmp_path, case, spec, overrides, phrase):
  root = str(tmp_path / case)
  if spec is not None:
    _tree(root, {k: (_png() if v == "png" else v) for k, v in spec.items()})
  cfg = cfg_for(f"imagefolder:{root}", image_size=4, **overrides)
  with pytest.raises(ValueError) as e:
    pipeline.dataset_info(cfg)
  message = str(e.value)
  assert "\n" not in message and phrase.format(root=root) in message, message


def test_unreadable_image_in_a_worker_gives_one_line(tmp_path):
  root = _tree(str(tmp_path), {f"train/{c}/{i}.png": _png() for c in "ab" for i in range(4)})
  with open(os.path.join(root, "train", "b", "2.png"), "wb") as f:
    f.write(b"not an image")
  cfg = cfg_for(f"imagefolder:{root}", image_size=4, eval_split="train", num_workers=2)
  stream = pipeline.make_train_iterator(cfg, 8, seed=0)
  try:
    with pytest.raises(validate.InputError) as e:
      next(stream)
  finally:
    stream.close()
  assert str(e.value) == (f"dataset='imagefolder:{root}', step 0: image "
                          f"'{root}/train/b/2.png' cannot be read (not an image file Pillow can "
                          "decode)")
  with pytest.raises(validate.InputError, match="2.png' cannot be read"):
    pipeline.load_eval_arrays(cfg)


def test_a_worker_that_dies_gives_one_line(digits):
  import multiprocessing  # pylint: disable=g-import-not-at-top
  cfg = cfg_for("imagefolder:" + digits["dir"], image_size=16, num_workers=2, num_threads=1)
  before = {p.pid for p in multiprocessing.active_children()}
  stream = pipeline.make_train_iterator(cfg, 16, seed=0)
  try:
    next(stream)
    workers = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert len(workers) == 2, workers
    os.kill(workers[0].pid, signal.SIGKILL)
    with pytest.raises(validate.InputError) as e:
      for _ in range(50):  # the batches already prepared by the other worker come first
        next(stream)
    # The stream closed itself: the other worker is gone, and asking again gives the same line.
    assert not [p for p in multiprocessing.active_children() if p.pid not in before]
    with pytest.raises(validate.InputError) as again:
      next(stream)
    assert str(again.value) == str(e.value)
  finally:
    stream.close()
  message = str(e.value)
  assert "\n" not in message and message.startswith(
      f"dataset='imagefolder:{digits['dir']}', step "), message
  assert message.endswith(": an input worker process died (killed by SIGKILL: out of memory? "
                          "fewer data.num_workers or a smaller data.prefetch need less)"), message


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_a_worker_cannot_send_back_gives_one_line(workers):
  # Grain pickles a worker's exception to send it; this one cannot be pickled (it holds a lock),
  # which used to leave the training process waiting for ever. Same line with or without workers.
  stream = loader.TrainStream(FailingExample(at=5), loader.Layout(4, 0, 1, 0), 0,
                              loader.Parallelism(workers, 1, 2), "imagefolder:/x:train[:8]")
  try:
    assert next(stream)["label"].tolist() == [0, 1, 2, 3]
    with pytest.raises(validate.InputError) as e:
      next(stream)
  finally:
    stream.close()
  assert str(e.value) == ("dataset='imagefolder:/x', step 1: the input pipeline failed "
                          "(_Unpicklable: record 5 is cursed)")


def test_workers_end_with_a_killed_training_process(digits):
  # SIGKILL (or the out-of-memory killer) to the training process alone: its Grain workers notice
  # and exit instead of waiting for ever on their full queues.
  code = ("import multiprocessing, sys, time\n"
          "from decay_jax.data import pipeline\n"
          "cfg = pipeline.default_data_config()\n"
          f"cfg.dataset = 'imagefolder:{digits['dir']}'\n"
          "cfg.update(image_size=16, num_workers=2, num_threads=1)\n"
          "stream = pipeline.make_train_iterator(cfg, 16, 0)\n"
          "next(stream)\n"
          "print(*[p.pid for p in multiprocessing.active_children()], flush=True)\n"
          "time.sleep(600)\n")
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          start_new_session=True)
  try:
    workers = [int(p) for p in proc.stdout.readline().split()]
    assert len(workers) == 2, workers
    assert {proc.pid, *workers} <= set(session_processes(proc.pid))  # + the resource tracker
  finally:
    proc.kill()  # the training process only
    proc.wait()
  assert wait_for_no_processes(proc.pid) == []


class _InterruptedWhileFreed:
  """Ctrl-C arrives while this object frees itself, as while a shared-memory batch unlinks."""

  def __del__(self):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)  # the handler runs here, inside __del__


def test_ctrl_c_while_a_batch_frees_itself_is_raised_not_lost():
  # pytest-xdist's workers start with Ctrl-C ignored: handle it as a terminal's Python would
  previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
  unraisable = []
  previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
  try:
    obj = _InterruptedWhileFreed()
    del obj  # the interrupt dies in __del__: Python reports it as unraisable and goes on
    assert [type(u.exc_value) for u in unraisable] == [KeyboardInterrupt]
    unraisable.clear()
    obj = _InterruptedWhileFreed()
    with pytest.raises(KeyboardInterrupt):
      with loader.sigint_deferred():
        del obj
    assert unraisable == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
  finally:
    sys.unraisablehook = previous_hook
    signal.signal(signal.SIGINT, previous_handler)


def test_the_stream_frees_each_batch_two_steps_later(digits):
  cfg = cfg_for("imagefolder:" + digits["dir"], image_size=16)
  stream = pipeline.make_train_iterator(cfg, 16, 0)
  try:
    first = weakref.ref(next(stream)["image"])
    assert first() is not None  # held by the stream: the caller's loop variable may still hold it
    next(stream)
    assert first() is not None
    next(stream)
    assert first() is None  # freed by the stream, under sigint_deferred
  finally:
    stream.close()


def test_ctrl_c_stops_the_stream_without_worker_tracebacks(digits):
  # Ctrl-C reaches the whole process group: the workers leave it to the training process, which
  # closes the stream (before, each worker printed a KeyboardInterrupt traceback).
  code = ("import signal, time\n"
          "signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it\n"
          "from decay_jax.data import pipeline\n"
          "cfg = pipeline.default_data_config()\n"
          f"cfg.dataset = 'imagefolder:{digits['dir']}'\n"
          "cfg.update(image_size=16, num_workers=2, num_threads=1)\n"
          "stream = pipeline.make_train_iterator(cfg, 16, 0)\n"
          "for _ in range(4):\n"
          "  next(stream)  # both workers have sent batches: they are past their start\n"
          "try:\n"
          "  # inside the try: the signal can land as this print returns\n"
          "  print('reading', flush=True)\n"
          "  while True:\n"
          "    next(stream)\n"
          "    time.sleep(0.01)\n"
          "except KeyboardInterrupt:\n"
          "  print('interrupted', flush=True)\n"
          "finally:\n"
          "  stream.close()\n"
          "print('closed', flush=True)\n")
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
  try:
    assert proc.stdout.readline() == "reading\n"
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
    stdout, stderr = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  assert proc.returncode == 0 and stdout == "interrupted\nclosed\n", (stdout, stderr[-3000:])
  assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-2000:]
  assert wait_for_no_processes(proc.pid) == []


# ------------------------------------------------------------------------------------------------
# The training command, for real: SIGKILL + rerun, and a crash on a bad image.


def _command(workdir, folder):
  return [sys.executable, "-m", "decay_jax.cli.train", "--config=configs/mae_cpu_mnist.py",
          f"--workdir={workdir}", f"--config.data.dataset=imagefolder:{folder}", *TINY]


_CACHE = {}  # the module's JAX compilation cache directory (set by the digits fixture)


def _env(**extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
  env.update(extra)
  if "dir" in _CACHE:
    env.update(JAX_COMPILATION_CACHE_DIR=_CACHE["dir"],
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return env


# Put first on PYTHONPATH, this sitecustomize makes every Grain worker process of the command write
# the names in its sys.modules (and its resident memory) to MODULES_DIR/<pid>.json, five times a
# second, for as long as it lives: what a worker has imported after it has read and augmented.
_WORKER_WATCH = """
import json, os, sys, threading, time
def _watch(directory):
  import multiprocessing
  while True:
    time.sleep(0.2)
    if not multiprocessing.current_process().name.startswith("grain-process-prefetch"):
      continue
    try:
      names = sorted(list(sys.modules))
    except RuntimeError:  # an import in another thread changed sys.modules: next time
      continue
    with open("/proc/self/status") as f:
      rss = [int(l.split()[1]) for l in f if l.startswith("VmRSS:")][0] // 1024
    path = os.path.join(directory, "%d.json" % os.getpid())
    with open(path + ".tmp", "w") as f:
      json.dump({"modules": names, "rss_mb": rss}, f)
    os.replace(path + ".tmp", path)
if os.environ.get("MODULES_DIR"):
  threading.Thread(target=_watch, args=(os.environ["MODULES_DIR"],), daemon=True).start()
"""
# What a worker must not import: a 700 MB worker is one that re-imported the training command.
_HEAVY = ("tensorflow", "flax", "optax", "orbax", "clu", "decay_jax.models", "decay_jax.train",
          "decay_jax.evals", "decay_jax.diffusion", "decay_jax.cli", "decay_jax.io")


def _run(workdir, folder, **extra_env):
  """Runs the training command to its end; checks that it left no process behind."""
  return run_to_end(_command(workdir, folder), REPO, _env(**extra_env))


def _final_params(workdir):
  params, step = ckpt_lib.restore_run_params(workdir, shd.make_mesh(1, 1))
  return jax.device_get(params), step


@pytest.fixture(scope="module")
def uninterrupted(digits):
  """The uninterrupted run's final parameters; its Grain workers' modules go to worker_modules."""
  workdir = os.path.join(digits["root"], "straight")
  watch, modules = os.path.join(digits["root"], "watch"), os.path.join(digits["root"], "modules")
  os.makedirs(watch)
  os.makedirs(modules)
  with open(os.path.join(watch, "sitecustomize.py"), "w") as f:
    f.write(_WORKER_WATCH)
  p = _run(workdir, digits["dir"], PYTHONPATH=os.pathsep.join([watch, REPO]), MODULES_DIR=modules)
  assert p.returncode == 0, p.stderr[-3000:]
  _CACHE["modules"] = modules
  return _final_params(workdir)


def test_workers_of_a_training_command_import_only_what_reading_needs(uninterrupted):
  # Grain spawns its workers; they must not re-import the command's __main__ (the trainer, flax,
  # optax, orbax, clu, TensorFlow: about 700 MB each), only what reading and augmenting import.
  del uninterrupted
  # Grain 0.2.18 imports jax and part of orbax (its checkpoint handlers) itself: the floor.
  grain_floor = set(subprocess.run(
      [sys.executable, "-c", "import sys, grain; print(' '.join(sys.modules))"], check=True,
      capture_output=True, text=True, env=_env()).stdout.split())
  assert "jax" in grain_floor
  found = sorted(os.listdir(_CACHE["modules"]))
  assert len(found) == 2, found  # data.num_workers=2
  for name in found:
    with open(os.path.join(_CACHE["modules"], name)) as f:
      seen = json.load(f)
    modules = seen["modules"]
    heavy = [m for m in modules if any(m == h or m.startswith(h + ".") for h in _HEAVY)
             and m not in grain_floor]
    assert heavy == [], (name, heavy[:20])
    # It did read and augment (the loader, the folder source, Pillow are there) ...
    assert {"decay_jax.data.loader", "decay_jax.data.folder", "PIL.Image"} <= set(modules)
    # ... and Grain itself brings jax, the floor of this path.
    assert "jax" in modules, name
    print(f"worker {name}: {len(modules)} modules, {seen['rss_mb']} MB resident")


def test_sigkill_and_rerun_give_the_uninterrupted_parameters(digits, uninterrupted):
  workdir = os.path.join(digits["root"], "killed")
  proc = subprocess.Popen(_command(workdir, digits["dir"]), cwd=REPO, env=_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True)
  steps = kill_at_first_checkpoint(proc, workdir)  # the trainer and its workers, mid-step
  assert proc.returncode == -signal.SIGKILL and steps and steps[-1] < STEPS, (proc.returncode, steps)
  assert os.path.exists(os.path.join(workdir, "checkpoints", str(steps[0]), "data",
                                     "process_0-of-1.json"))
  p = _run(workdir, digits["dir"])
  assert p.returncode == 0, p.stderr[-3000:]
  assert "restored from the checkpoint's input state" in p.stderr
  params, step = _final_params(workdir)
  expected, expected_step = uninterrupted
  assert step == expected_step == STEPS
  chex.assert_trees_all_equal(params, expected)  # bit for bit


def test_unreadable_image_stops_training_with_one_line_and_intact_checkpoints(digits,
                                                                           uninterrupted):
  broken = os.path.join(digits["root"], "broken_digits")
  shutil.copytree(digits["dir"], broken)
  # The example that step 3 reads first: its file is replaced by garbage.
  files = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(broken, "train"))
                 for f in fs)
  files.sort(key=lambda f: (int(os.path.basename(os.path.dirname(f))), f))
  victim = files[loader.EpochOrder(0, len(files), loader.IMAGE_ORDER_STREAM)(3 * 16)]
  original = open(victim, "rb").read()
  with open(victim, "wb") as f:
    f.write(b"\x89PNG truncated")
  workdir = os.path.join(digits["root"], "crashed")
  p = _run(workdir, broken)
  lines = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert p.returncode == 2 and lines == [
      f"error: dataset='imagefolder:{broken}', step 3: image '{victim}' cannot be read "
      "(not an image file Pillow can decode)"], p.stderr[-3000:]
  assert "Traceback" not in p.stderr
  assert ckpt_lib.checkpoint_steps(workdir) == [2]
  assert os.path.exists(os.path.join(workdir, "checkpoints", "2", "data", "process_0-of-1.json"))
  _final_params(workdir)  # the last checkpoint restores
  with open(victim, "wb") as f:  # mended: the rerun continues from step 2 to the same end
    f.write(original)
  p = _run(workdir, broken)
  assert p.returncode == 0, p.stderr[-3000:]
  params, step = _final_params(workdir)
  assert step == STEPS
  chex.assert_trees_all_equal(params, uninterrupted[0])


def test_device_count_does_not_change_training_on_a_folder(digits, tmp_path):
  folder = {"data.dataset": "imagefolder:" + digits["dir"], "num_train_steps": 3,
            "checkpoint.every_steps": 3}
  one = tiny_config(**folder)
  many = tiny_config(**folder, **{"mesh.data": 4, "mesh.fsdp": 2})
  r1 = trainer.train_and_evaluate(one, str(tmp_path / "one"), evaluators=registry.build)
  r8 = trainer.train_and_evaluate(many, str(tmp_path / "many"), evaluators=registry.build)
  np.testing.assert_allclose(r8["loss"], r1["loss"], rtol=1e-5)
  p1, _ = restore_params(str(tmp_path / "one"), one)
  p8, _ = restore_params(str(tmp_path / "many"), one)
  chex.assert_trees_all_close(p8["params"], p1["params"], atol=2e-6, rtol=1e-5)
