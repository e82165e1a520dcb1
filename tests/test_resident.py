"""``data.on_device=True`` (``decay_jax.data.resident``): batches built on the devices.

The box sampler against ``augment.crop_params`` (the same uniforms give the same boxes; the jax
draws give torchvision's distribution), the flip probability, the resize against crop + Pillow
(bit for bit), the whole batch against the host augmentation of the same draws, exact resume and
1 vs 8 devices, the errors, and a real training command killed with SIGKILL and rerun.

Tiny images and batches; each program compiles once per module (``resident.batch_program`` is
cached per mesh and crop settings).
"""

import functools
import os
import signal
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

from decay_jax import sharding as shd
from decay_jax.data import augment, loader, pipeline, resident
from decay_jax.train import checkpoint as ckpt_lib
from testing_configs import kill_at_first_checkpoint, run_to_end

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRAWS = 20000  # examples of the distribution tests
SIZE = 16


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
  """40 smooth 20 x 24 RGB images (taller than SIZE: the resize shrinks and enlarges) + labels."""
  rng = np.random.default_rng(0)
  yy, xx = np.mgrid[:20, :24]
  phase = rng.random((40, 1, 1, 3)) * 6.3
  freq = rng.random((40, 1, 1, 3)) * 0.6 + 0.1
  images = 127.5 + 127.5 * np.sin(freq * xx[None, ..., None] + 0.7 * freq * yy[None, ..., None]
                                   + phase)
  images = np.clip(images + rng.normal(0, 20, images.shape), 0, 255).astype(np.uint8)
  labels = rng.integers(0, 10, 40)
  path = tmp_path_factory.mktemp("resident") / "small.npz"
  np.savez(path, x_train=images, y_train=labels)
  return {"path": str(path), "x": images, "y": labels}


def cfg_for(path, **overrides):
  cfg = pipeline.default_data_config()
  cfg.update(dict(dict(dataset="npz:" + path, image_size=SIZE, normalize="imagenet",
                       on_device=True), **overrides))
  return cfg


def take(stream, n):
  return [jax.device_get(next(stream)) for _ in range(n)]


@functools.lru_cache(maxsize=None)
def _jitted(fn, *static):
  return jax.jit(functools.partial(fn, *static) if static else fn)


def device_draws(seed, positions):
  """float64 (L, NUM_UNIFORMS): the on-device stream's draws of these global positions."""
  high, low = resident.position_words(np.asarray(positions, np.int64))
  with jax.enable_x64(True):
    return np.asarray(_jitted(resident.example_uniforms)(resident.seed_salt(seed), high, low))


def device_boxes(uniforms, height, width, scale, ratio):
  """The on-device sampler (``resident.example_boxes``, jitted, float64) on these draws."""
  fn = lambda u: resident.example_boxes(u, height, width, scale, ratio)
  with jax.enable_x64(True):
    return [np.asarray(v) for v in jax.jit(fn)(uniforms)]


# ------------------------------------------------------------------------------------------------
# (a) Boxes: torchvision's rule.

SETTINGS = [(28, 28, (0.5, 1.0), (3 / 4, 4 / 3)), (20, 24, (0.08, 1.0), (3 / 4, 4 / 3)),
            (32, 17, (0.2, 1.0), (0.5, 2.0))]
FALLBACK = (28, 28, (0.9, 1.0), (4.0, 5.0))  # no attempt fits: the centre crop, clamped ratio


@pytest.mark.parametrize("height,width,scale,ratio", SETTINGS + [FALLBACK])
def test_the_same_uniforms_give_exactly_the_boxes_of_crop_params(height, width, scale, ratio):
  u = np.random.default_rng(1).random((DRAWS, augment.NUM_UNIFORMS))
  expected = augment.crop_params(u, height, width, scale, ratio)
  for e, g in zip(expected, device_boxes(u, height, width, scale, ratio)):
    np.testing.assert_array_equal(g, e)


def _ks_limit(n, m):
  """Two-sample Kolmogorov-Smirnov bound at alpha = 0.001 (conservative for discrete values)."""
  return 1.95 * np.sqrt((n + m) / (n * m))


@pytest.mark.parametrize("height,width,scale,ratio", SETTINGS)
def test_device_draws_give_torchvision_box_distribution(height, width, scale, ratio):
  dev = device_boxes(device_draws(0, np.arange(DRAWS)), height, width, scale, ratio)
  host = augment.crop_params(np.random.default_rng(2).random((DRAWS, augment.NUM_UNIFORMS)),
                             height, width, scale, ratio)
  for name, d, h in zip(("top", "left", "h", "w"), dev, host):
    se = np.sqrt(d.var() / DRAWS + h.var() / DRAWS)
    assert abs(d.mean() - h.mean()) < 5 * se, (name, d.mean(), h.mean(), se)
    values = np.union1d(d, h)
    cdf = lambda x: np.searchsorted(np.sort(x), values, side="right") / len(x)
    assert np.abs(cdf(d) - cdf(h)).max() < _ks_limit(DRAWS, DRAWS), name
    np.testing.assert_allclose(np.quantile(d, [0.1, 0.5, 0.9]), np.quantile(h, [0.1, 0.5, 0.9]),
                               atol=1)


def test_fallback_box_for_an_extreme_ratio():
  height, width, scale, ratio = FALLBACK
  top, left, h, w = device_boxes(device_draws(0, np.arange(1000)), height, width, scale, ratio)
  assert (top == 10).all() and (left == 0).all() and (h == 7).all() and (w == 28).all()


# ------------------------------------------------------------------------------------------------
# (b) Flip.


def test_flip_probability_is_one_half():
  flipped = device_draws(5, np.arange(DRAWS))[:, -1] < 0.5
  assert abs(flipped.mean() - 0.5) < 5 * np.sqrt(0.25 / DRAWS), flipped.mean()


def test_whole_image_crops_are_the_image_or_its_mirror(arrays):
  # Crops of the whole image at its own size: the resize is the identity, only the flip acts.
  cfg = cfg_for(arrays["path"], image_size=20, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0))
  square = arrays["path"].replace(".npz", "_square.npz")
  np.savez(square, x_train=arrays["x"][:, :, :20], y_train=arrays["y"])
  cfg.dataset = "npz:" + square
  stream = pipeline.make_train_iterator(cfg, 40, seed=4, mesh=shd.make_mesh(1, 1))
  batch = take(stream, 1)[0]
  records = stream.rows(0)[:, 0]
  mirrored = device_draws(4, np.arange(40))[:, -1] < 0.5
  source = arrays["x"][records, :, :20]
  np.testing.assert_array_equal(batch["image"], np.where(mirrored[:, None, None, None],
                                                         source[:, :, ::-1], source))
  assert 0 < mirrored.sum() < 40


# ------------------------------------------------------------------------------------------------
# (c) Resize: Pillow's bicubic, bit for bit.


def _pil_box(image, top, left, h, w, size):
  """The host path's resize of one box: crop, then Pillow's bicubic (``augment._pil_resize``)."""
  crop = image[top:top + h, left:left + w]
  return augment._pil_resize(crop, size, size)  # pylint: disable=protected-access


@pytest.mark.parametrize("shape,size", [((20, 24, 3), 16), ((11, 9, 1), 16), ((28, 28, 1), 28)])
def test_resize_equals_crop_then_pil_bicubic(shape, size):
  rng = np.random.default_rng(3)
  image = rng.integers(0, 256, shape, dtype=np.uint8)
  height, width = shape[:2]
  coef, start = resident.pil_bicubic_tables(max(height, width), size)
  boxes = [(int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w)
           for h, w in zip(rng.integers(1, height + 1, 120), rng.integers(1, width + 1, 120))]
  boxes += [(0, 0, height, width), (height - 1, width - 1, 1, 1)]
  columns = [np.asarray(c, np.int32) for c in zip(*boxes)]
  out = jax.jit(jax.vmap(resident.resize_box, in_axes=(None, 0, 0, 0, 0, None, None)))(
      image, *columns, coef, start)
  expected = np.stack([_pil_box(image, *b, size) for b in boxes])
  np.testing.assert_array_equal(np.asarray(out), expected)  # measured tolerance: 0


def test_pass_order_matches_pillow_for_every_box_size():
  # Every (h, w) up to 24 x 24 to 8 x 8: both of Pillow 13's pass orders occur.
  rng = np.random.default_rng(4)
  image = rng.integers(0, 256, (24, 24, 1), dtype=np.uint8)
  coef, start = resident.pil_bicubic_tables(24, 8)
  hs, ws = (a.ravel().astype(np.int32) for a in np.mgrid[1:25, 1:25])
  zeros = np.zeros_like(hs)
  out = jax.jit(jax.vmap(resident.resize_box, in_axes=(None, 0, 0, 0, 0, None, None)))(
      image, zeros, zeros, hs, ws, coef, start)
  expected = np.stack([_pil_box(image, 0, 0, h, w, 8) for h, w in zip(hs, ws)])
  np.testing.assert_array_equal(np.asarray(out), expected)
  assert np.asarray(resident.vertical_first(hs, ws, 8)).any()


# ------------------------------------------------------------------------------------------------
# The stream: the host augmentation of its own draws, exact resume, device counts, errors.


def test_batches_are_the_host_augmentation_of_the_same_records_and_draws(arrays):
  cfg = cfg_for(arrays["path"])
  stream = pipeline.make_train_iterator(cfg, 16, seed=9, start_step=2, mesh=shd.make_mesh(1, 1))
  for step, batch in zip((2, 3, 4), take(stream, 3)):  # 40 records: crosses epochs
    rows = stream.rows(step)
    positions = step * 16 + np.arange(16)
    order = loader.EpochOrder(9, 40, loader.IMAGE_ORDER_STREAM)
    np.testing.assert_array_equal(rows[:, 0], [order(g) for g in positions])  # the host's order
    expected = augment.augment_batch(arrays["x"][rows[:, 0]], device_draws(9, positions), SIZE,
                                     cfg)
    np.testing.assert_array_equal(batch["image"], expected)
    np.testing.assert_array_equal(batch["label"], arrays["y"][rows[:, 0]])
    assert batch["image"].dtype == np.uint8 and batch["label"].dtype == np.int32


def test_resume_and_device_count_give_the_same_batches(arrays):
  cfg = cfg_for(arrays["path"])
  one, eight = shd.make_mesh(1, 1), shd.make_mesh(4, 2)
  full = pipeline.make_train_iterator(cfg, 16, seed=3, mesh=one)
  batches = take(full, 5)
  state = full.get_state()
  assert state == {"kind": "on_device", "source": f"npz:{arrays['path']}:train", "seed": 3,
                   "global_batch": 16, "next_step": 5}
  early = pipeline.make_train_iterator(cfg, 16, seed=3, mesh=one)
  take(early, 3)
  resumed = pipeline.make_train_iterator(cfg, 16, seed=3, start_step=3, mesh=eight,
                                         state=early.get_state())
  assert resumed.restored and resumed.next_step == 3
  first = next(resumed)
  assert first["image"].sharding == shd.batch_sharding(eight)
  rest = [jax.device_get(first)] + take(resumed, 1)
  fresh = take(pipeline.make_train_iterator(cfg, 16, seed=3, start_step=3, mesh=one), 2)
  for a, b, c in zip(batches[3:], rest, fresh):
    for key in ("image", "label"):
      np.testing.assert_array_equal(a[key], b[key])
      np.testing.assert_array_equal(a[key], c[key])
  # A Grain stream's state (or another seed's) is not taken; the batches are the same anyway.
  other = pipeline.make_train_iterator(cfg, 16, seed=3, start_step=3, mesh=one,
                                       state=dict(state, next_step=3, seed=4))
  assert not other.restored
  other.close()
  with pytest.raises(ValueError, match="closed"):
    next(other)


@pytest.mark.parametrize("overrides,message", [
    ({"dataset": "imagefolder:/nonexistent"}, "on_device=True is not allowed; dataset="),
    ({"rand_augment": "rand-m9-mstd0.5-inc1"}, "on_device=True is not allowed; rand_augment"),
])
def test_one_line_errors(arrays, overrides, message):
  with pytest.raises(ValueError, match=message) as e:
    pipeline.make_train_iterator(cfg_for(arrays["path"], **overrides), 16, seed=0,
                                 mesh=shd.make_mesh(1, 1))
  assert "\n" not in str(e.value)


def test_mesh_is_needed_and_the_batch_must_split_over_it(arrays):
  with pytest.raises(ValueError, match="on_device=True is not allowed; the stream needs the"):
    pipeline.make_train_iterator(cfg_for(arrays["path"]), 16, seed=0)
  with pytest.raises(ValueError, match="global_batch=12 is not allowed"):
    pipeline.make_train_iterator(cfg_for(arrays["path"]), 12, seed=0, mesh=shd.make_mesh(4, 2))


# ------------------------------------------------------------------------------------------------
# (e) The training command, for real: SIGKILL mid-run and a rerun.

STEPS = 8
COMMAND = ["--config=configs/mae_cpu_mnist.py", "--config.data.on_device=True",
           "--config.model.preset=micro/4", "--config.data.image_size=16",
           "--config.batch_size=16", f"--config.num_train_steps={STEPS}", "--config.mesh.data=1",
           "--config.tensorboard=false", "--config.checkpoint.every_steps=2",
           "--config.checkpoint.async_save=false", "--config.picture_every_steps=0",
           "--config.evals.knn.enabled=false", "--config.evals.rank.enabled=false",
           "--config.warmup_epochs=0.0"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("runs")


def _env(run_dir):
  # One compilation cache for the module's commands: the first compiles, the others load.
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
              JAX_COMPILATION_CACHE_DIR=str(run_dir / "jax_cache"),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def _start(workdir, run_dir, **kwargs):
  return subprocess.Popen([sys.executable, "-m", "decay_jax.cli.train", f"--workdir={workdir}",
                           *COMMAND], cwd=REPO, env=_env(run_dir), start_new_session=True,
                          **kwargs)


def _run(workdir, run_dir):
  return run_to_end([sys.executable, "-m", "decay_jax.cli.train", f"--workdir={workdir}", *COMMAND],
                    REPO, _env(run_dir))


def _final_params(workdir):
  params, step = ckpt_lib.restore_run_params(workdir, shd.make_mesh(1, 1))
  return jax.device_get(params), step


def test_sigkill_and_rerun_give_the_uninterrupted_parameters(run_dir):
  straight = str(run_dir / "straight")
  p = _run(straight, run_dir)
  assert p.returncode == 0, p.stderr[-3000:]
  expected, expected_step = _final_params(straight)
  killed = str(run_dir / "killed")
  proc = _start(killed, run_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  steps = kill_at_first_checkpoint(proc, killed)
  assert proc.returncode == -signal.SIGKILL and steps and steps[-1] < STEPS, (proc.returncode,
                                                                             steps)
  p = _run(killed, run_dir)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "restored from the checkpoint" in p.stderr  # the saved on-device state was taken
  params, step = _final_params(killed)
  assert step == expected_step == STEPS
  chex.assert_trees_all_equal(params, expected)  # bit for bit
