"""RandAugment rand-m9-mstd0.5-inc1 (decay_jax/data/randaugment.py) against the spec's arguments
and Pillow's documented arithmetic: lookup-table ops exactly, enhance ops within one level,
translation by whole pixels exactly, and the draws (op choice, probability, magnitude, sign)."""

import collections

import numpy as np
import pytest
from PIL import Image

from decay_jax.data import randaugment as ra


def test_levels_at_magnitude_9_and_10():
  want = {"Rotate": 27.0, "PosterizeIncreasing": 1, "SolarizeIncreasing": 26, "SolarizeAdd": 99,
          "ColorIncreasing": 1.81, "ContrastIncreasing": 1.81, "BrightnessIncreasing": 1.81,
          "SharpnessIncreasing": 1.81, "ShearX": 0.27, "ShearY": 0.27, "TranslateXRel": 0.405,
          "TranslateYRel": 0.405}
  for name, value in want.items():
    assert ra.level_arg(name, 9.0) == pytest.approx(value), name
  assert ra.level_arg("Rotate", 9.0, negate=True) == pytest.approx(-27.0)
  assert ra.level_arg("ColorIncreasing", 9.0, negate=True) == pytest.approx(0.19)
  assert ra.level_arg("PosterizeIncreasing", 10.0) == 0  # Pillow's posterize(0): a black image
  assert ra.level_arg("PosterizeIncreasing", 0.0) == 4 and ra.level_arg("SolarizeAdd", 0.0) == 0
  assert ra.fill_color((0.485, 0.456, 0.406)) == (124, 116, 104)
  assert ra.fill_color((0.5,)) == 128
  assert len(ra.OPS) == 15 and set(ra.SIGNED) < set(ra.OPS)


@pytest.fixture(scope="module")
def image():
  rng = np.random.default_rng(0)
  base = rng.integers(30, 220, (24, 20, 3))
  base[:, :, 1] = np.clip(base[:, :, 1] // 2 + 40, 0, 255)  # channels with different ranges
  return base.astype(np.uint8)


def pil(a):
  return Image.fromarray(a, "RGB")


def equalize_lut(band):
  """Pillow's ImageOps.equalize rule for one band."""
  histo = np.bincount(band.ravel(), minlength=256)
  nonzero = histo[histo > 0]
  if len(nonzero) <= 1:
    return np.arange(256)
  step = (nonzero.sum() - nonzero[-1]) // 255
  if not step:
    return np.arange(256)
  lut, n = [], step // 2
  for i in range(256):
    lut.append(min(255, n // step))
    n += histo[i]
  return np.array(lut)


def autocontrast_lut(band):
  lo, hi = int(band.min()), int(band.max())
  if hi <= lo:
    return np.arange(256)
  scale = 255.0 / (hi - lo)
  return np.clip([int(i * scale - lo * scale) for i in range(256)], 0, 255)


def test_lookup_table_ops_are_exact(image):
  x = image.astype(np.int64)
  run = lambda name, arg=None: np.asarray(ra.apply_op(pil(image), name, arg, (124, 116, 104)))
  np.testing.assert_array_equal(run("Invert"), 255 - x)
  for bits in (1, 2, 4):
    np.testing.assert_array_equal(run("PosterizeIncreasing", bits), x & ~(2 ** (8 - bits) - 1))
  np.testing.assert_array_equal(run("PosterizeIncreasing", 0), 0)
  for thr in (26, 128, 200):
    np.testing.assert_array_equal(run("SolarizeIncreasing", thr), np.where(x >= thr, 255 - x, x))
  np.testing.assert_array_equal(run("SolarizeAdd", 99),
                                np.where(x < 128, np.minimum(255, x + 99), x))
  for c in range(3):
    band = image[..., c]
    np.testing.assert_array_equal(run("AutoContrast")[..., c], autocontrast_lut(band)[band])
    np.testing.assert_array_equal(run("Equalize")[..., c], equalize_lut(band)[band])


def test_enhance_ops_blend_within_one_level(image):
  x = image.astype(np.float64)
  for f in (0.19, 1.81):
    got = np.asarray(ra.apply_op(pil(image), "BrightnessIncreasing", f, 0)).astype(np.float64)
    assert np.abs(got - np.clip(x * f, 0, 255)).max() <= 1
    grey = np.asarray(pil(image).convert("L")).astype(np.float64)
    mean = int(grey.mean() + 0.5)
    got = np.asarray(ra.apply_op(pil(image), "ContrastIncreasing", f, 0)).astype(np.float64)
    assert np.abs(got - np.clip(mean + f * (x - mean), 0, 255)).max() <= 1
    got = np.asarray(ra.apply_op(pil(image), "ColorIncreasing", f, 0)).astype(np.float64)
    assert np.abs(got - np.clip(grey[..., None] + f * (x - grey[..., None]), 0, 255)).max() <= 1


def test_geometric_ops_sample_the_input_and_fill_with_the_mean(image):
  fill = (124, 116, 104)
  h, w = image.shape[:2]
  # output(x) = input(x + px): a whole-pixel translation moves pixels exactly and fills the rest.
  out = np.asarray(ra.apply_op(pil(image), "TranslateXRel", 5 / w, fill))
  np.testing.assert_array_equal(out[:, :w - 5], image[:, 5:])
  np.testing.assert_array_equal(out[:, w - 5:], np.broadcast_to(fill, (h, 5, 3)))
  out = np.asarray(ra.apply_op(pil(image), "TranslateYRel", -6 / h, fill))
  np.testing.assert_array_equal(out[6:], image[:h - 6])
  np.testing.assert_array_equal(out[:6], np.broadcast_to(fill, (6, w, 3)))
  # Shear about the top-left corner: on a ramp of 4 levels per column, row y moves by s (y + 0.5)
  # columns (Pillow samples at pixel centres): mean error under one level away from the filled edge
  # (Pillow truncates to an integer level).
  ramp = Image.fromarray(np.tile(np.arange(64, dtype=np.uint8) * 4, (16, 1)), "L")
  out = np.asarray(ra.apply_op(ramp, "ShearX", 0.27, 0)).astype(np.float64)
  want = 4 * (np.arange(64)[None, :] + 0.27 * (np.arange(16)[:, None] + 0.5))
  err = np.abs(out - want)[want < 4 * 60]
  assert err.mean() < 1.0 and err.max() < 1.5
  # Rotation about the centre fills the corners.
  out = np.asarray(ra.apply_op(pil(image), "Rotate", 27.0, fill))
  np.testing.assert_array_equal(out[0, 0], fill)
  np.testing.assert_array_equal(np.asarray(ra.apply_op(pil(image), "Rotate", 0.0, fill)), image)
  grey = Image.fromarray(image[..., 0], "L")  # one channel: the fill is one value
  assert np.asarray(ra.apply_op(grey, "Rotate", 45.0, 128))[0, 0] == 128
  with pytest.raises(ValueError, match="RandAugment op 'Blur' is not allowed"):
    ra.apply_op(grey, "Blur", None, 128)


def test_draws_follow_timms_order_and_rates(image, monkeypatch):
  calls = []
  monkeypatch.setattr(ra, "apply_op", lambda img, name, arg, fill: calls.append((name, arg)) or img)
  rng = np.random.default_rng(0)
  trials = 4000
  for _ in range(trials):
    ra.rand_augment(pil(image), rng, (124, 116, 104))
  # 2 ops per image, each applied with probability 0.5: one op per image on average.
  assert len(calls) / trials == pytest.approx(1.0, abs=0.05)
  counts = collections.Counter(name for name, _ in calls)
  assert set(counts) == set(ra.OPS)
  assert max(counts.values()) / min(counts.values()) < 1.5  # uniform over the 15
  rot = np.array([arg for name, arg in calls if name == "Rotate"])
  assert 0.4 < np.mean(rot < 0) < 0.6  # the sign is a coin
  assert np.abs(rot).max() <= 30.0 and np.mean(np.abs(rot)) == pytest.approx(27.0, abs=0.3)
  # Same generator state, same image; the ops really run.
  monkeypatch.undo()
  a = ra.rand_augment(pil(image), np.random.default_rng(7), (124, 116, 104))
  b = ra.rand_augment(pil(image), np.random.default_rng(7), (124, 116, 104))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  changed = [not np.array_equal(np.asarray(ra.rand_augment(pil(image), np.random.default_rng(s),
                                                           (124, 116, 104))), image)
             for s in range(40)]
  assert 0.5 < np.mean(changed) < 0.95  # no op in a quarter of the images (0.5^2)


def test_the_training_stream_applies_it_per_position_and_resumes_exactly():
  from decay_jax.data import augment, pipeline
  from decay_jax.data.config import default_data_config, rand_augment_params
  cfg = default_data_config()
  cfg.rand_augment = "rand-m9-mstd0.5-inc1"
  take = lambda it, n: [next(it) for _ in range(n)]
  full = take(pipeline.make_train_iterator(cfg, 16, seed=3), 3)
  resumed = take(pipeline.make_train_iterator(cfg, 16, seed=3, start_step=2), 1)
  np.testing.assert_array_equal(full[2]["image"], resumed[0]["image"])
  plain_cfg = default_data_config()
  plain = take(pipeline.make_train_iterator(plain_cfg, 16, seed=3), 1)[0]
  np.testing.assert_array_equal(plain["label"], full[0]["label"])  # same order
  changed = (plain["image"] != full[0]["image"]).any(axis=(1, 2, 3))
  assert 0.5 <= changed.mean() < 1.0  # a quarter of the images get no op
  # Example 0 is the crop and flip of the plain stream, then RandAugment with its own draws.
  assert plain["image"].dtype == full[0]["image"].dtype == np.uint8  # uint8 on the wire
  want = augment.rand_augment_one(plain["image"][0], "half", rand_augment_params(cfg.rand_augment),
                                  augment.example_rng(0, 3, 2))
  np.testing.assert_array_equal(full[0]["image"][0], want)
  bad = default_data_config()
  bad.rand_augment = "rand-m9"
  with pytest.raises(ValueError, match="rand_augment='rand-m9' is not allowed"):
    pipeline.dataset_info(bad)
