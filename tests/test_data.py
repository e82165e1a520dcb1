"""Input pipeline: shipped MNIST, exact resume, sharding, augmentation, TFDS (ArrayRecord on disk and
mocked), errors."""

import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from decay_jax.data import augment
from decay_jax.data import on_device
from decay_jax.data import embedded
from decay_jax.data import pipeline

FULL_MNIST = "/work/shared/data/mnist_full.npz"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def cfg_for(dataset="embedded_mnist", **overrides):
  cfg = pipeline.default_data_config()
  cfg.dataset = dataset
  for key, value in overrides.items():
    setattr(cfg, key, value)
  return cfg


@pytest.fixture(scope="module")
def indexed_npz(tmp_path_factory):
  """An npz whose label is the example index: (40, 16, 16, 3) random uint8 train, 8 test."""
  rng = np.random.default_rng(0)
  path = tmp_path_factory.mktemp("npz") / "indexed.npz"
  np.savez(path, x_train=rng.integers(0, 256, (40, 16, 16, 3), dtype=np.uint8),
           y_train=np.arange(40), x_test=rng.integers(0, 256, (8, 16, 16, 3), dtype=np.uint8),
           y_test=np.arange(8))
  return str(path)


@pytest.fixture(scope="module")
def train_only_npz(tmp_path_factory):
  """An npz without a test split: (30, 12, 12, 1)."""
  path = tmp_path_factory.mktemp("npz") / "train_only.npz"
  rng = np.random.default_rng(1)
  np.savez(path, x_train=rng.integers(0, 256, (30, 12, 12, 1), dtype=np.uint8),
           y_train=np.arange(30) % 3)
  return str(path)


# ------------------------------------------------------------------------------------------------
# The shipped file.


def test_embedded_file_contents_and_checksum():
  d = embedded.load_embedded_mnist()
  assert d["x_train"].shape == (10000, 28, 28, 1) and d["x_train"].dtype == np.uint8
  assert d["x_test"].shape == (2000, 28, 28, 1) and d["x_test"].dtype == np.uint8
  assert d["y_train"].shape == (10000,) and d["y_test"].shape == (2000,)
  assert set(np.unique(d["y_train"])) == set(range(10)) == set(np.unique(d["y_test"]))
  assert d["x_train"].max() == 255 and d["x_train"].min() == 0
  assert 1_000_000 < os.path.getsize(embedded.EMBEDDED_MNIST) < 3_500_000
  assert embedded.sha256_file(embedded.EMBEDDED_MNIST) == embedded.readme_sha256()
  with open(embedded.EMBEDDED_README, encoding="utf-8") as f:
    readme = f.read()
  assert "Yann LeCun and Corinna Cortes" in readme and "CC BY-SA 3.0" in readme


@pytest.mark.skipif(not os.path.exists(FULL_MNIST), reason="development data not present")
def test_embedded_file_is_the_first_images_of_mnist():
  d = embedded.load_embedded_mnist()
  with np.load(FULL_MNIST) as full:
    np.testing.assert_array_equal(d["x_train"], full["x_train"][:10000])
    np.testing.assert_array_equal(d["y_train"], full["y_train"][:10000])
    np.testing.assert_array_equal(d["x_test"], full["x_test"][:2000])
    np.testing.assert_array_equal(d["y_test"], full["y_test"][:2000])


def test_dataset_info_and_eval_arrays_embedded():
  cfg = cfg_for(eval_resize="resize")
  assert pipeline.dataset_info(cfg) == {
      "num_train": 10000, "num_classes": 10, "channels": 1, "image_size": 28}
  ev = pipeline.load_eval_arrays(cfg, "test")
  assert ev["image"].shape == (2000, 28, 28, 1) and ev["image"].dtype == np.uint8
  assert ev["label"].dtype == np.int32
  # 'resize' at the native size is the identity: exactly the pixels (uint8, normalised on device).
  x_test = embedded.load_embedded_mnist()["x_test"]
  np.testing.assert_array_equal(ev["image"], x_test)
  cfg.max_eval_examples, cfg.eval_resize, cfg.image_size = 100, "resize_crop", 24
  ev = pipeline.load_eval_arrays(cfg)
  assert ev["image"].shape == (100, 24, 24, 1) and ev["label"].shape == (100,)
  # The pixels the former code normalised on the host: each record's evaluation resize.
  want = np.stack([augment.eval_resize_one(x, 24, "resize_crop") for x in x_test[:100]])
  assert ev["image"].dtype == np.uint8 and len(np.unique(want)) > 100  # not all blank
  np.testing.assert_array_equal(ev["image"], want)


def test_train_batches_shapes_embedded():
  batch = next(pipeline.make_train_iterator(cfg_for(image_size=32), 64, seed=0))
  assert batch["image"].shape == (64, 32, 32, 1) and batch["image"].dtype == np.uint8
  assert batch["label"].shape == (64,) and batch["label"].dtype == np.int32
  assert batch["image"].max() > 128  # digits: white strokes on black


def test_npz_slices_and_info(train_only_npz):
  cfg = cfg_for("npz:" + train_only_npz, train_split="train[:20]", eval_split="train[20:]",
                image_size=12)
  assert pipeline.dataset_info(cfg) == {
      "num_train": 20, "num_classes": 3, "channels": 1, "image_size": 12}
  ev = pipeline.load_eval_arrays(cfg)
  np.testing.assert_array_equal(ev["label"], np.arange(20, 30) % 3)


# ------------------------------------------------------------------------------------------------
# Determinism, exact resume, sharding.


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["label"], y["label"])


@pytest.mark.parametrize("dataset_kind", ["embedded", "indexed"])
def test_exact_resume_and_seeds(dataset_kind, indexed_npz):
  # The indexed source has 40 examples and batch 16: steps 3..4 cross an epoch boundary.
  cfg = cfg_for() if dataset_kind == "embedded" else cfg_for("npz:" + indexed_npz, image_size=16)
  full = take(pipeline.make_train_iterator(cfg, 16, seed=5), 5)
  resumed = take(pipeline.make_train_iterator(cfg, 16, seed=5, start_step=3), 2)
  assert_batches_equal(full[3:], resumed)
  assert_batches_equal(full[:2], take(pipeline.make_train_iterator(cfg, 16, seed=5), 2))
  other = next(pipeline.make_train_iterator(cfg, 16, seed=6))
  assert not np.array_equal(full[0]["image"], other["image"])


def test_order_is_a_permutation_per_epoch(indexed_npz):
  cfg = cfg_for("npz:" + indexed_npz, image_size=16)
  labels = np.concatenate([b["label"] for b in take(
      pipeline.make_train_iterator(cfg, 8, seed=0), 10)])
  assert sorted(labels[:40]) == list(range(40)) and sorted(labels[40:]) == list(range(40))
  assert not np.array_equal(labels[:40], labels[40:])  # a fresh permutation each epoch


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_concatenate_to_the_global_batch(process_count):
  cfg = cfg_for()
  single = take(pipeline.make_train_iterator(cfg, 16, seed=3, start_step=1), 2)
  parts = [take(pipeline.make_train_iterator(cfg, 16, seed=3, start_step=1, process_index=p,
                                             process_count=process_count), 2)
           for p in range(process_count)]
  for step in range(2):
    for key in ("image", "label"):
      joined = np.concatenate([parts[p][step][key] for p in range(process_count)])
      np.testing.assert_array_equal(joined, single[step][key])
  assert parts[0][0]["image"].shape == (16 // process_count, 28, 28, 1)


# ------------------------------------------------------------------------------------------------
# Augmentation.


def reference_crop_params(u, height, width, scale, ratio):
  """torchvision RandomResizedCrop.get_params, one example, with our uniforms for torch.rand."""
  area = height * width
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for k in range(10):
    target_area = area * (scale[0] + (scale[1] - scale[0]) * u[k])
    aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[10 + k])
    w = int(round(math.sqrt(target_area * aspect)))
    h = int(round(math.sqrt(target_area / aspect)))
    if 0 < w <= width and 0 < h <= height:
      return int(u[20] * (height - h + 1)), int(u[21] * (width - w + 1)), h, w
  in_ratio = width / height
  if in_ratio < min(ratio):
    w, h = width, int(round(width / min(ratio)))
  elif in_ratio > max(ratio):
    h, w = height, int(round(height * max(ratio)))
  else:
    w, h = width, height
  return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize("height,width,scale,ratio", [
    (28, 28, (0.2, 1.0), (3 / 4, 4 / 3)),
    (20, 31, (0.08, 1.0), (3 / 4, 4 / 3)),
    (32, 32, (0.9, 1.0), (3.0, 4.0)),  # nothing fits: always the centre-crop fallback
    (40, 10, (0.95, 1.0), (1.0, 2.0)),  # tall image, fallback clamps the ratio
])
def test_crop_params_match_torchvision_rule(height, width, scale, ratio):
  u = np.random.default_rng(0).random((500, 23))
  got = np.stack(pipeline.crop_params(u, height, width, scale, ratio), axis=1)
  want = np.array([reference_crop_params(row, height, width, scale, ratio) for row in u])
  np.testing.assert_array_equal(got, want)
  top, left, h, w = got.T
  assert (top >= 0).all() and (left >= 0).all()
  assert (top + h <= height).all() and (left + w <= width).all()


def test_crop_area_statistics():
  u = np.random.default_rng(1).random((4000, 23))
  _, _, h, w = pipeline.crop_params(u, 224, 224, (0.2, 1.0), (3 / 4, 4 / 3))
  frac = h * w / 224**2
  assert 0.19 < frac.min() and frac.max() <= 1.0
  # Areas are drawn uniformly on [0.2, 1] (mean 0.6), but large non-square boxes do not fit and
  # are redrawn, so accepted crops are a little smaller on average.
  assert 0.5 < frac.mean() < 0.6
  # Ratios stay in [3/4, 4/3] up to the rounding of h and w to whole pixels.
  assert 0.74 < (w / h).min() and (w / h).max() < 1.35


@pytest.mark.parametrize("image_size", [16, 24])
def test_full_crop_without_flip_is_the_resized_original(indexed_npz, image_size):
  cfg = cfg_for("npz:" + indexed_npz, image_size=image_size, crop_scale=(1.0, 1.0),
                crop_ratio=(1.0, 1.0), flip=False, normalize="none", eval_resize="resize")
  batch = next(pipeline.make_train_iterator(cfg, 40, seed=0))
  originals = pipeline.load_eval_arrays(cfg, "train")["image"]  # file order: label == index
  np.testing.assert_array_equal(batch["image"], originals[batch["label"]])
  if image_size == 16:
    x = np.load(indexed_npz)["x_train"]
    np.testing.assert_array_equal(batch["image"], x[batch["label"]])  # uint8 on the wire


def test_flips_happen_half_the_time(indexed_npz):
  cfg = cfg_for("npz:" + indexed_npz, image_size=16, crop_scale=(1.0, 1.0),
                crop_ratio=(1.0, 1.0), normalize="none", eval_resize="resize")
  originals = pipeline.load_eval_arrays(cfg, "train")["image"]
  flipped = []
  for batch in take(pipeline.make_train_iterator(cfg, 200, seed=0), 5):
    orig = originals[batch["label"]]
    same = (batch["image"] == orig).all(axis=(1, 2, 3))
    mirrored = (batch["image"] == orig[:, :, ::-1]).all(axis=(1, 2, 3))
    assert (same | mirrored).all()
    flipped.append(mirrored)
  rate = np.concatenate(flipped).mean()
  assert 0.44 < rate < 0.56, rate


def test_normalisation_values():
  pixels = np.array([0, 128, 255], np.uint8).reshape(1, 1, 3, 1).repeat(3, axis=-1)
  x = pixels.astype(np.float32) / 255
  np.testing.assert_allclose(pipeline.normalize_uint8(pixels, "none"), x)
  np.testing.assert_allclose(pipeline.normalize_uint8(pixels, "half"), 2 * x - 1, atol=1e-6)
  mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
  np.testing.assert_allclose(pipeline.normalize_uint8(pixels, "imagenet"), (x - mean) / std,
                             atol=1e-6)
  assert pipeline.normalize_uint8(pixels, "imagenet").dtype == np.float32


def test_normalisation_on_the_device_equals_the_host_normalisation(indexed_npz):
  # The stream is uint8 whatever the mode; the device turns it into what the host used to ship
  # (augment.normalize_uint8, torchvision's ToTensor + Normalize) to 1e-6.
  base = dict(image_size=16, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip=False)
  for mode in ("none", "half", "imagenet"):
    cfg = cfg_for("npz:" + indexed_npz, normalize=mode, **base)
    pixels = next(pipeline.make_train_iterator(cfg, 8, seed=0))["image"]
    assert pixels.dtype == np.uint8 and pixels.shape == (8, 16, 16, 3)
    mean, std = pipeline.normalization(cfg, 3)
    host = pipeline.normalize_uint8(pixels, mode)
    device = np.asarray(jax.jit(lambda x: on_device.to_model_input(x, mean, std))(pixels))
    assert device.dtype == np.float32 and np.abs(host).max() > 0.5
    np.testing.assert_allclose(device, host, rtol=0, atol=1e-6)
  # Floating inputs (latents) pass unchanged.
  latents = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 2, 2, 3)
  np.testing.assert_array_equal(on_device.to_model_input(latents, (0.5,), (0.5,)), latents)


def test_in_memory_sources_do_not_import_tensorflow():
  code = ("import sys; from decay_jax.data import pipeline as p; "
          "next(p.make_train_iterator(p.default_data_config(), 8, seed=0)); "
          "p.load_eval_arrays(p.default_data_config()); "
          "print('tensorflow' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------------
# TFDS sources: real ArrayRecord datasets prepared on disk, and tfds.testing.mock_data (nothing
# is downloaded).


def store_tfds(monkeypatch, data_dir, name, encoding, images_by_split, file_format="array_record"):
  """Prepares a real on-disk TFDS dataset (ArrayRecord shards + metadata) from uint8 NHWC arrays;
  the label of image i of a split is i % 10."""
  import importlib.resources  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  # tfds 4.9.10 needs the `importlib_resources` backport to *prepare* a dataset (not to read one)
  # and it is not among our pinned requirements; the standard library module serves here.
  monkeypatch.setitem(sys.modules, "importlib_resources", importlib.resources)
  shape = next(iter(images_by_split.values())).shape[1:]
  features = tfds.features.FeaturesDict({
      "image": tfds.features.Image(shape=shape, encoding_format=encoding),
      "label": tfds.features.ClassLabel(num_classes=10)})
  splits = {split: tf.data.Dataset.from_tensor_slices(
      {"image": images, "label": np.arange(len(images)) % 10})
            for split, images in images_by_split.items()}
  tfds.dataset_builders.store_as_tfds_dataset(name=name, version="1.0.0", features=features,
                                              split_datasets=splits, data_dir=data_dir,
                                              file_format=file_format)


def constant_images(first, n, size=8):
  """Image i is filled with the value first + i, so the pixels name the example after any crop
  or flip (and after TFDS shuffles the records when it writes them)."""
  return np.broadcast_to(np.arange(first, first + n, dtype=np.uint8)[:, None, None, None],
                         (n, size, size, 3)).copy()


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  """A data_dir with 'tiny_indexed' (50 train + 20 test constant PNG images, ArrayRecord),
  'tiny_jpeg' (12 random 20 x 30 JPEG images, ArrayRecord) and 'tiny_tfrecord' (TFRecord)."""
  monkeypatch = pytest.MonkeyPatch()
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  store_tfds(monkeypatch, data_dir, "tiny_indexed", "png",
             {"train": constant_images(0, 50), "test": constant_images(100, 20)})
  rng = np.random.default_rng(0)
  store_tfds(monkeypatch, data_dir, "tiny_jpeg", "jpeg",
             {"train": rng.integers(0, 256, (12, 20, 30, 3), dtype=np.uint8)})
  store_tfds(monkeypatch, data_dir, "tiny_tfrecord", "png", {"train": constant_images(0, 4)},
             file_format="tfrecord")
  monkeypatch.undo()
  return data_dir


def pixel_index(batch):
  """The example index each image of a batch was filled with (normalize='none')."""
  return batch["image"][:, 0, 0, 0].astype(int)


def test_tfds_array_record_dataset_on_disk(tfds_dir):
  cfg = cfg_for("tiny_indexed", data_dir=tfds_dir, image_size=8, normalize="none")
  assert pipeline.dataset_info(cfg) == {
      "num_train": 50, "num_classes": 10, "channels": 3, "image_size": 8}
  shards = []
  for p in range(2):
    batches = take(pipeline.make_train_iterator(cfg, 10, seed=0, process_index=p,
                                                process_count=2), 5)
    for batch in batches:
      index = pixel_index(batch)
      # A constant image stays constant through crop, bicubic resize and flip; labels follow.
      np.testing.assert_array_equal(batch["image"], np.broadcast_to(
          batch["image"][:, :1, :1, :1], batch["image"].shape))
      np.testing.assert_array_equal(batch["label"], index % 10)
      assert batch["image"].shape == (5, 8, 8, 3) and batch["label"].dtype == np.int32
    shards.append(np.concatenate([pixel_index(b) for b in batches]))
  # One epoch over both processes: 25 distinct examples each, together the whole split.
  assert [len(set(s)) for s in shards] == [25, 25]
  assert sorted(np.concatenate(shards)) == list(range(50))
  ev = pipeline.load_eval_arrays(cfg)
  assert sorted(ev["image"][:, 0, 0, 0].astype(int)) == list(range(100, 120))
  np.testing.assert_array_equal(ev["label"], (ev["image"][:, 0, 0, 0].astype(int) - 100) % 10)
  with pytest.raises(ValueError, match="^eval_split="):
    pipeline.load_eval_arrays(cfg_for("tiny_indexed", data_dir=tfds_dir, eval_split="validation"))
  with pytest.raises(ValueError, match="^train_split="):
    pipeline.make_train_iterator(cfg_for("tiny_indexed", data_dir=tfds_dir,
                                         train_split="validation"), 8, seed=0)
  # JPEG-encoded images of another size take the decode-and-crop path.
  jpeg = cfg_for("tiny_jpeg", data_dir=tfds_dir, image_size=16, normalize="imagenet",
                 eval_split="train")
  batch = next(pipeline.make_train_iterator(jpeg, 4, seed=0))
  assert batch["image"].shape == (4, 16, 16, 3) and np.isfinite(batch["image"]).all()
  assert pipeline.load_eval_arrays(jpeg)["image"].shape == (12, 16, 16, 3)


def test_tfds_resumes_exactly_with_any_worker_count(tfds_dir):
  cfg = cfg_for("tiny_indexed", data_dir=tfds_dir, image_size=8, normalize="none")
  full = pipeline.make_train_iterator(cfg, 8, seed=4)
  first = take(full, 3)
  state = full.get_state()
  rest = take(full, 6)  # steps 3..8 cross the epoch boundary (50 examples = 6.25 steps)
  assert_batches_equal(rest, take(pipeline.make_train_iterator(cfg, 8, seed=4, start_step=3), 6))
  restored = pipeline.make_train_iterator(cfg, 8, seed=4, start_step=3, state=state)
  assert restored.restored
  assert_batches_equal(rest, take(restored, 6))
  workers = cfg_for("tiny_indexed", data_dir=tfds_dir, image_size=8, normalize="none",
                    num_workers=2, num_threads=1)
  stream = pipeline.make_train_iterator(workers, 8, seed=4)
  try:
    assert_batches_equal(first + rest, take(stream, 9))
  finally:
    stream.close()


def test_tfds_tfrecord_dataset_says_how_to_rebuild(tfds_dir):
  with pytest.raises(ValueError, match=r"^dataset='tiny_tfrecord' .*file_format=array_record"):
    pipeline.make_train_iterator(cfg_for("tiny_tfrecord", data_dir=tfds_dir, image_size=8), 4,
                                 seed=0)


@pytest.mark.parametrize("name,channels", [("mnist", 1), ("imagenet2012", 3)])
def test_tfds_mock_data_shapes(name, channels):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  normalize = "imagenet" if channels == 3 else "half"
  cfg = cfg_for(name, image_size=32, normalize=normalize, eval_resize="resize_crop",
                max_eval_examples=6)
  with tfds.testing.mock_data(num_examples=12):
    info = pipeline.dataset_info(cfg)
    assert info["channels"] == channels and info["image_size"] == 32
    batches = take(pipeline.make_train_iterator(cfg, 8, seed=0, process_index=1,
                                                process_count=2), 3)
    for batch in batches:
      assert batch["image"].shape == (4, 32, 32, channels)
      assert batch["image"].dtype == np.uint8 and batch["label"].dtype == np.int32
    ev = pipeline.load_eval_arrays(cfg, "train")
    assert ev["image"].shape == (6, 32, 32, channels) and ev["label"].shape == (6,)


def test_tfds_full_crop_without_flip_matches_eval_resize():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from decay_jax.data import loader  # pylint: disable=g-import-not-at-top
  cfg = cfg_for("cifar10", image_size=32, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0),
                flip=False, normalize="none", eval_resize="resize")
  with tfds.testing.mock_data(num_examples=8):
    batch = next(pipeline.make_train_iterator(cfg, 8, seed=3))
    ev = pipeline.load_eval_arrays(cfg, "train")
  # The full, unflipped crop of the examples in the first epoch's order is the resized original.
  order = loader.EpochOrder(3, 8, loader.IMAGE_ORDER_STREAM).permutation(0)
  # Not vacuous: the mock images are distinct and the permutation moves them.
  assert len(np.unique(ev["image"].reshape(8, -1), axis=0)) == 8
  assert not np.array_equal(order, np.arange(8))
  np.testing.assert_array_equal(batch["image"], ev["image"][order])
  np.testing.assert_array_equal(batch["label"], ev["label"][order])


# ------------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize("field,overrides,call_kwargs", [
    ("dataset", dict(dataset="no_such_dataset_xyz"), {}),
    ("dataset", dict(dataset="npz:/no/such/file.npz"), {}),
    ("global_batch", {}, dict(global_batch=10, process_count=3)),
    ("global_batch", {}, dict(global_batch=0)),
    ("process_index", {}, dict(process_index=2, process_count=2)),
    ("image_size", dict(image_size=0), {}),
    ("crop_scale", dict(crop_scale=(0.0, 1.0)), {}),
    ("crop_scale", dict(crop_scale=(0.8, 0.2)), {}),
    ("crop_scale", dict(crop_scale=(0.2, 1.5)), {}),
    ("crop_ratio", dict(crop_ratio=(4 / 3, 3 / 4)), {}),
    ("crop_ratio", dict(crop_ratio=(0.0, 1.0)), {}),
    ("normalize", dict(normalize="zscore"), {}),
    ("normalize", dict(normalize="imagenet"), {}),  # MNIST has 1 channel
    ("eval_resize", dict(eval_resize="stretch"), {}),
    ("train_split", dict(train_split="validation"), {}),
    ("train_split", dict(train_split="train[a:b]"), {}),
    ("start_step", {}, dict(start_step=-1)),
    ("num_workers", dict(num_workers=-1), {}),
    ("num_threads", dict(num_threads=0), {}),
    ("prefetch", dict(prefetch=0), {}),
    ("channels", dict(channels=2), {}),
])
def test_bad_train_configs_raise(field, overrides, call_kwargs):
  kwargs = dict(global_batch=8, seed=0)
  kwargs.update(call_kwargs)
  with pytest.raises(ValueError, match=f"^{field}="):
    pipeline.make_train_iterator(cfg_for(**overrides), **kwargs)


def test_bad_eval_splits_raise(train_only_npz):
  with pytest.raises(ValueError, match="^eval_split="):
    pipeline.load_eval_arrays(cfg_for(eval_split="valid"))
  with pytest.raises(ValueError, match="^split="):
    pipeline.load_eval_arrays(cfg_for(), "dev")
  with pytest.raises(ValueError, match="^eval_split="):
    pipeline.load_eval_arrays(cfg_for("npz:" + train_only_npz, image_size=12))
  with pytest.raises(ValueError, match="^eval_split="):
    pipeline.dataset_info(cfg_for("npz:" + train_only_npz, image_size=12))
  with pytest.raises(ValueError, match="^train_split="):
    pipeline.dataset_info(cfg_for(train_split="train[10:10]"))
