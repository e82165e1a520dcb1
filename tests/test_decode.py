"""Image folders' training read (``folder.crop_resized``): the crop box is ``crop_params``' box,
a full-scale decode gives ``augment_batch``'s pixels on the full decode bit for bit (JPEG and PNG,
RGB, greyscale and other modes, flips), a JPEG decoded at reduced scale stays within the measured
difference, and the training stream uses this path (RandAugment included)."""

import os

import numpy as np
import pytest
from PIL import Image

from decay_jax.data import augment, bench, folder, loader, pipeline

SCALE, RATIO = (0.2, 1.0), (3 / 4, 4 / 3)
# The reduced decode's difference to the full one on the test's own images (synthetic_image, JPEG
# quality 90; 24 crops of 108-160 px images to 16-24 px, factors 2 and 4), measured: mean
# |difference| 1.3-1.4 grey levels over the reduced crops, 2.7 at most for one crop, 13 at most
# for one pixel (tiny outputs; 448 px images to 64-112 px differ by 0.4-0.7 on average,
# docs/data.md). The bounds leave a margin.
REDUCED_MEAN_BOUND, REDUCED_CROP_MEAN_BOUND, REDUCED_MAX_BOUND = 2.0, 3.5, 32


class _Cfg:
  """The fields ``augment_batch`` reads."""

  def __init__(self, scale):
    self.crop_scale, self.crop_ratio, self.flip = scale, RATIO, True


def reference(path, channels, uniforms, size, scale=SCALE):
  """Today's array path: the whole image decoded, then augment_batch."""
  return augment.augment_batch(folder.decode(path, channels)[None], uniforms[None], size,
                               _Cfg(scale))[0]


def fast(path, channels, uniforms, size, draft=True, scale=SCALE):
  return folder.crop_resized(path, channels, uniforms, size, scale, RATIO, True, draft)


def save(path, pixels, mode=None, **kwargs):
  image = Image.fromarray(pixels) if mode is None else Image.fromarray(pixels).convert(mode)
  image.save(path, **kwargs)
  return str(path)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
  """Synthetic photograph-like images (``bench.synthetic_image``): RGB and greyscale JPEGs
  (quality 90) and the same pixels as PNG, 112 to 160 px."""
  root = tmp_path_factory.mktemp("photos")
  files = {"rgb_jpg": [], "grey_jpg": [], "rgb_png": []}
  for i, side in enumerate((112, 160, 136, 144)):
    pixels = bench.synthetic_image(3, i, side)
    if i % 2:  # a non-square one too
      pixels = pixels[:, : side * 3 // 4]
    files["rgb_jpg"].append(save(root / f"{i}.jpg", pixels, quality=90))
    files["grey_jpg"].append(save(root / f"{i}_grey.jpg", pixels, "L", quality=90))
    files["rgb_png"].append(save(root / f"{i}.png", pixels))
  return files


def uniforms_for(n, seed=0):
  return [augment.example_uniforms(p, seed) for p in range(n)]


def test_crop_box_is_crop_params_box():
  u = np.random.default_rng(0).random((300, augment.NUM_UNIFORMS))
  for height, width in [(375, 500), (224, 224), (20, 31), (40, 10)]:
    want = np.stack(augment.crop_params(u, height, width, SCALE, RATIO), axis=1)
    got = np.array([augment.crop_box(row, height, width, SCALE, RATIO) for row in u])
    np.testing.assert_array_equal(got, want)


def test_dct_factor_keeps_size_pixels_on_both_sides():
  assert augment.dct_factor(447, 900, 224) == 1
  assert augment.dct_factor(448, 900, 224) == 2
  assert augment.dct_factor(900, 1000, 224) == 4
  assert augment.dct_factor(1792, 1792, 224) == 8
  assert augment.dct_factor(5000, 5000, 224) == 8
  for h in range(1, 200):
    f = augment.dct_factor(h, 199, 10)
    assert (f == 1 or h >= f * 10) and (f == 8 or h < 2 * f * 10)


@pytest.mark.parametrize("kind", ["rgb_jpg", "grey_jpg", "rgb_png"])
@pytest.mark.parametrize("channels", [3, 1])
def test_full_scale_decode_is_the_array_path_bit_for_bit(photos, kind, channels):
  # draft=False, and crops too small to reduce (size 96 > half of every side): full scale.
  for path in photos[kind]:
    for p, u in enumerate(uniforms_for(6)):
      want = reference(path, channels, u, 96)
      np.testing.assert_array_equal(fast(path, channels, u, 96), want)
      np.testing.assert_array_equal(fast(path, channels, u, 16, draft=False),
                                    reference(path, channels, u, 16))
      assert want.shape == (96, 96, channels) and want.dtype == np.uint8
      if p == 0:
        assert fast(path, channels, u, 96).flags.writeable


def test_png_is_never_reduced(photos):
  for path in photos["rgb_png"]:
    for u in uniforms_for(4):
      np.testing.assert_array_equal(fast(path, 3, u, 16), reference(path, 3, u, 16))


@pytest.mark.parametrize("kind,channels", [("rgb_jpg", 3), ("rgb_jpg", 1), ("grey_jpg", 1),
                                           ("grey_jpg", 3)])
def test_reduced_decode_is_within_the_measured_difference(photos, kind, channels):
  factors, diffs = [], []
  for path in photos[kind]:
    with Image.open(path) as image:
      width, height = image.size
    for size, u in zip((16, 24) * 3, uniforms_for(6)):
      box = augment.crop_box(u, height, width, SCALE, RATIO)
      factors.append(augment.dct_factor(box[2], box[3], size))
      got, want = fast(path, channels, u, size), reference(path, channels, u, size)
      assert got.shape == want.shape == (size, size, channels) and got.dtype == np.uint8
      diff = np.abs(got.astype(np.int16) - want)
      diffs.append((diff.mean(), diff.max()))
  assert {2, 4} <= set(factors)  # the test does reduce, by more than one factor
  reduced = [d for d, f in zip(diffs, factors) if f > 1]
  assert np.mean([d[0] for d in reduced]) < REDUCED_MEAN_BOUND
  assert max(d[0] for d in reduced) < REDUCED_CROP_MEAN_BOUND
  assert max(d[1] for d in reduced) <= REDUCED_MAX_BOUND
  assert all(d == (0, 0) for d, f in zip(diffs, factors) if f == 1)


def test_simplejpeg_decodes_pillows_pixels_at_every_scale(tmp_path, monkeypatch):
  pixels = bench.synthetic_image(1, 0, 120)
  paths = [save(tmp_path / "420.jpg", pixels, quality=90),
           save(tmp_path / "444.jpg", pixels, quality=90, subsampling=0),
           save(tmp_path / "422.jpg", pixels[:, :100], quality=80, subsampling=1),
           save(tmp_path / "progressive.jpg", pixels[:90], quality=90, progressive=True),
           save(tmp_path / "grey.jpg", pixels, "L", quality=90)]
  sizes = (6, 12, 24, 64) * 2
  cases = [(path, channels, u, size) for path in paths for channels in (1, 3)
           for size, u in zip(sizes, uniforms_for(8))]
  used = []
  original = folder._simplejpeg_crop  # pylint: disable=protected-access
  monkeypatch.setattr(folder, "_simplejpeg_crop", lambda *a: used.append(1) or original(*a))
  by_simplejpeg = [fast(*case) for case in cases]
  assert len(used) == len(cases)
  monkeypatch.setattr(folder, "_simplejpeg_crop", lambda *a: None)  # Pillow: open, draft, load
  for case, got in zip(cases, by_simplejpeg):
    np.testing.assert_array_equal(got, fast(*case))
  factors = {augment.dct_factor(*augment.crop_box(u, 120, 120, SCALE, RATIO)[2:], size)
             for size, u in zip(sizes, uniforms_for(8))}
  assert factors == {1, 2, 4, 8}


def test_other_modes_convert_after_the_crop_exactly(tmp_path):
  rng = np.random.default_rng(0)
  rgba = rng.integers(0, 256, (50, 70, 4), dtype=np.uint8)
  paths = [save(tmp_path / "rgba.png", rgba),
           save(tmp_path / "p.png", rgba[..., :3], "P"),
           save(tmp_path / "cmyk.jpg", rgba, "CMYK", quality=95),
           save(tmp_path / "i16.png", rgba[..., 0].astype(np.uint16) * 200)]
  for path in paths:
    for channels in (1, 3):
      for u in uniforms_for(4):  # size 26: more than half of any crop side, so full scale
        np.testing.assert_array_equal(fast(path, channels, u, 26), reference(path, channels, u, 26))
        np.testing.assert_array_equal(fast(path, channels, u, 8, draft=False),
                                      reference(path, channels, u, 8))
  # A CMYK JPEG can be reduced too (converted after the reduced decode).
  out = fast(paths[2], 3, augment.example_uniforms(0, 0), 8, scale=(1.0, 1.0))
  assert out.shape == (8, 8, 3)


def test_a_whole_image_at_the_output_size_is_read_as_it_is(tmp_path):
  # The whole image is the crop and already size x size: no crop, resize or conversion is left
  # to force the decode, which must still happen while the file is open.
  pixels = bench.synthetic_image(2, 0, 24)
  paths = [save(tmp_path / "a.png", pixels), save(tmp_path / "a.jpg", pixels, quality=90),
           save(tmp_path / "grey.png", pixels, "L"), save(tmp_path / "p.png", pixels, "P")]
  for path in paths:
    for channels in (1, 3):
      for u in uniforms_for(4):  # flipped and not
        got = fast(path, channels, u, 24, scale=(1.0, 1.0))
        np.testing.assert_array_equal(got, reference(path, channels, u, 24, scale=(1.0, 1.0)))
        assert got.shape == (24, 24, channels)


def test_unreadable_file_gives_the_one_line_error(tmp_path):
  bad = tmp_path / "bad.jpg"
  bad.write_bytes(b"not an image")
  with pytest.raises(ValueError, match="cannot be read \\(not an image file Pillow can decode\\)"):
    fast(str(bad), 3, augment.example_uniforms(0, 0), 8)
  truncated = tmp_path / "truncated.jpg"
  save(truncated, bench.synthetic_image(0, 0, 64), quality=90)
  truncated.write_bytes(truncated.read_bytes()[:300])
  with pytest.raises(ValueError, match=f"image '{truncated}' cannot be read \\(OSError"):
    fast(str(truncated), 3, augment.example_uniforms(0, 0), 8)


class _ArraysOnly:
  """A source without ``crop_resized``: the loader's array path over the same records."""

  def __init__(self, records):
    self.records = records

  def __len__(self):
    return len(self.records)

  def __getitem__(self, index):
    return self.records[index]


@pytest.mark.parametrize("rand_augment", ["", "rand-m9-mstd0.5-inc1"])
def test_training_examples_take_the_fast_path_with_the_same_pixels(tmp_path, rand_augment):
  for c in range(2):
    os.makedirs(tmp_path / "train" / f"class_{c}")
    for i in range(3):
      save(tmp_path / "train" / f"class_{c}" / f"{i}.jpg", bench.synthetic_image(c, i, 40),
           quality=90)
  cfg = pipeline.default_data_config()
  cfg.update(dataset=f"imagefolder:{tmp_path}", image_size=32, rand_augment=rand_augment)
  records = folder.FolderRecords(str(tmp_path), "train", "train_split", 3)
  spec = loader.AugmentSpec.of(cfg)
  layout = loader.Layout(global_batch=6, process_index=0, process_count=1, start_step=0)
  example = loader.ImageTrainExample(records, layout, 5, spec)
  arrays = loader.ImageTrainExample(_ArraysOnly(records), layout, 5, spec)
  calls = []
  original = records.crop_resized
  records.crop_resized = lambda *a: calls.append(a[0]) or original(*a)
  for j in range(12):  # two epochs; 32-px crops of 40-px images are never reduced
    got, want = example(j), arrays(j)
    np.testing.assert_array_equal(got["image"], want["image"])
    assert got["label"] == want["label"] and got["image"].shape == (32, 32, 3)
  assert len(calls) == 12
