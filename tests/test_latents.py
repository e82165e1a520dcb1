"""Latent shards: format, exact resume, per-process split, flip versions, errors."""

import numpy as np
import pytest

from decay_jax.data import latents, pipeline


def make_dir(tmp_path, flipped=True):
  rng = np.random.default_rng(0)
  shape = (2, 4, 4, 4) if flipped else (4, 4, 4)
  all_x, all_y = [], []
  for i, n in enumerate((5, 7)):  # two shards of different sizes
    x = rng.standard_normal((n,) + shape).astype(np.float16)
    y = rng.integers(0, 3, n)
    latents.write_shard(str(tmp_path), "train", i, x, y)
    all_x.append(x)
    all_y.append(y)
  return np.concatenate(all_x), np.concatenate(all_y)


def cfg(tmp_path, **kw):
  c = pipeline.default_data_config()
  c.dataset = f"latents:{tmp_path}"
  c.image_size = 4
  c.eval_split = "train"
  for k, v in kw.items():
    c[k] = v
  return c


def test_info_eval_and_flip_versions(tmp_path):
  x, y = make_dir(tmp_path)
  info = pipeline.dataset_info(cfg(tmp_path))
  assert info == {"num_train": 12, "num_classes": int(y.max()) + 1, "channels": 4, "image_size": 4}
  ev = pipeline.load_eval_arrays(cfg(tmp_path), "train")
  np.testing.assert_array_equal(ev["image"], x[:, 0].astype(np.float32))  # originals, in order
  np.testing.assert_array_equal(ev["label"], y)
  it = pipeline.make_train_iterator(cfg(tmp_path), 12, seed=1)
  seen = {0: 0, 1: 0}
  for _ in range(20):
    b = next(it)
    for img, lab in zip(b["image"], b["label"]):
      matches = [v for v in (0, 1) if any(np.array_equal(img, x[i, v].astype(np.float32))
                                          and lab == y[i] for i in range(12))]
      assert matches
      seen[matches[0]] += 1
  assert 0.35 < seen[1] / (seen[0] + seen[1]) < 0.65  # both versions drawn about equally
  # random access across the two shards (5 + 7 rows): the same rows as the concatenation
  records = latents.LatentRecords(str(tmp_path), "train")
  for i in range(12):
    latent, label = records[i]
    np.testing.assert_array_equal(latent, x[i].astype(np.float32))
    assert label == y[i] and records.record(i)[2] == []  # no REPA targets stored
  np.testing.assert_array_equal(records._get().locate(np.array([0, 4, 5, 11]))[1], [0, 4, 0, 6])


def test_exact_resume_and_process_split(tmp_path):
  make_dir(tmp_path)
  full = pipeline.make_train_iterator(cfg(tmp_path), 8, seed=3)
  batches = [next(full) for _ in range(5)]
  resumed = pipeline.make_train_iterator(cfg(tmp_path), 8, seed=3, start_step=3)
  for want in batches[3:]:
    got = next(resumed)
    np.testing.assert_array_equal(got["image"], want["image"])
  halves = [pipeline.make_train_iterator(cfg(tmp_path), 8, seed=3, process_index=p,
                                         process_count=2) for p in (0, 1)]
  b0, b1 = next(halves[0]), next(halves[1])
  np.testing.assert_array_equal(np.concatenate([b0["image"], b1["image"]]), batches[0]["image"])
  no_flip = next(pipeline.make_train_iterator(cfg(tmp_path, flip=False), 8, seed=3))
  assert not np.array_equal(no_flip["image"], batches[0]["image"])


def test_errors(tmp_path):
  make_dir(tmp_path, flipped=False)
  with pytest.raises(ValueError, match="image_size=8 is not allowed; the latents are 4x4"):
    pipeline.dataset_info(cfg(tmp_path, image_size=8))
  with pytest.raises(ValueError, match=r"split='val' is not allowed; .* has shards for \['train'\]"):
    pipeline.load_eval_arrays(cfg(tmp_path), "val")
  with pytest.raises(ValueError, match="the directory does not exist"):
    pipeline.dataset_info(cfg(tmp_path / "missing"))
