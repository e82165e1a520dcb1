"""TFDS preprocessing in tf.data: the same augmentation and eval resizes as ``augment``, in TF.

TFDS sources use tf.data with per-process sharding (``tfds.split_for_jax_process`` with the given
``process_index``/``process_count``), the same augmentation in TensorFlow (stateless
``sample_distorted_bounding_box`` with 10 attempts and torchvision's centre-crop fallback, bicubic
antialiased resize, random flip), ``shuffle(shuffle_buffer, seed)``, ``repeat``, ``batch`` and
``prefetch``, with deterministic tf.data options. Resuming at ``start_step`` folds the step into
the shuffle and augmentation seeds: the stream is a fresh, valid stream, but tf.data order is NOT
bit-identical to what an uninterrupted run would have produced after step ``start_step``.

TensorFlow and TensorFlow Datasets are optional heavy dependencies: they are imported only here,
inside ``tensorflow()`` and ``tensorflow_datasets()``, the first time a TFDS source is used, and
TensorFlow never sees the GPUs.
"""

from __future__ import annotations

import functools
from typing import Dict

import numpy as np

from decay_jax.data import augment

# SeedSequence streams of the TFDS path (augment uses 0 and 1 for the in-memory path).
_TF_SHUFFLE_STREAM, _TF_AUG_STREAM = 2, 3
_EVAL_BATCH = 256


@functools.lru_cache(maxsize=1)
def tensorflow():
  """TensorFlow with the GPUs hidden, so it never reserves accelerator memory JAX needs."""
  import tensorflow as tf_module  # pylint: disable=g-import-not-at-top
  try:
    tf_module.config.set_visible_devices([], "GPU")
  except RuntimeError:
    pass  # TF was already initialised by someone else; its device list can no longer change.
  return tf_module


def tensorflow_datasets():
  """The ``tensorflow_datasets`` module."""
  import tensorflow_datasets  # pylint: disable=g-import-not-at-top
  return tensorflow_datasets


def image_feature(builder):
  """The ``image`` feature of a TFDS builder (its ``shape`` ends with the channel count)."""
  return builder.info.features["image"]


def _derived_seed(*words: int) -> int:
  """A 31-bit seed for TF from SeedSequence entropy (TF wants int32/int64 seeds)."""
  entropy = [augment.seed_words(w) for w in words]
  return int(np.random.SeedSequence(entropy).generate_state(1)[0] >> 1)


def _tf_normalize(tf, image, mode: str):
  """float32 pixels in [0, 255] (..., C) -> normalised float32."""
  x = image / 255.0
  if mode == "imagenet":
    return ((x - tf.constant(augment.IMAGENET_MEAN, tf.float32))
            / tf.constant(augment.IMAGENET_STD, tf.float32))
  if mode == "half":
    return (x - 0.5) / 0.5
  return x


def _tf_resize(tf, image, height, width):
  """Bicubic antialiased resize (close to PIL's) rounded back onto the uint8 grid, float32."""
  resized = tf.image.resize(image, tf.stack([height, width]), method="bicubic", antialias=True)
  return tf.clip_by_value(tf.round(resized), 0.0, 255.0)


def _tf_crop_box(tf, shape, seed, cfg):
  """RandomResizedCrop box (top, left, h, w) of an image of shape (H, W, C), int32 scalars."""
  bbox = tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, shape=[1, 1, 4])
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      shape, bounding_boxes=bbox, seed=seed, min_object_covered=0.0,
      aspect_ratio_range=tuple(cfg.crop_ratio), area_range=tuple(cfg.crop_scale),
      max_attempts=augment.RRC_ATTEMPTS, use_image_if_no_bounding_boxes=True)
  top, left, h, w = begin[0], begin[1], size[0], size[1]
  height, width = shape[0], shape[1]
  # When every attempt fails TF returns the whole image; torchvision then centre-crops to the
  # nearest allowed ratio. A genuine whole-image sample has an allowed ratio, so the fallback
  # leaves it unchanged and this test is exact.
  failed = tf.logical_and(tf.equal(h, height), tf.equal(w, width))
  hf, wf = tf.cast(height, tf.float32), tf.cast(width, tf.float32)
  lo, hi = float(min(cfg.crop_ratio)), float(max(cfg.crop_ratio))
  in_ratio = wf / hf
  fb_h = tf.where(in_ratio < lo, tf.cast(tf.round(wf / lo), tf.int32), height)
  fb_w = tf.where(in_ratio > hi, tf.cast(tf.round(hf * hi), tf.int32), width)
  h, w = tf.where(failed, fb_h, h), tf.where(failed, fb_w, w)
  top = tf.where(failed, (height - h) // 2, top)
  left = tf.where(failed, (width - w) // 2, left)
  return top, left, h, w


def _tf_train_map(tf, cfg, channels: int, encoded_jpeg: bool):
  """Per-example augmentation ``(seed int64 (2,), example) -> {"image": (S, S, C), "label"}``."""
  size = int(cfg.image_size)

  def fn(seed, example):
    crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    if encoded_jpeg:
      # Decoding only the crop of a JPEG is much cheaper than decoding the full image.
      shape = tf.io.extract_jpeg_shape(example["image"])
      top, left, h, w = _tf_crop_box(tf, shape, crop_seed, cfg)
      crop = tf.io.decode_and_crop_jpeg(example["image"], tf.stack([top, left, h, w]),
                                        channels=channels)
    else:
      image = example["image"]
      top, left, h, w = _tf_crop_box(tf, tf.shape(image), crop_seed, cfg)
      crop = tf.slice(image, tf.stack([top, left, 0]), tf.stack([h, w, -1]))
    image = _tf_resize(tf, tf.cast(crop, tf.float32), size, size)
    if cfg.flip:
      do_flip = tf.random.stateless_uniform([], flip_seed) < 0.5
      image = tf.cond(do_flip, lambda: tf.image.flip_left_right(image), lambda: image)
    image = tf.ensure_shape(_tf_normalize(tf, image, cfg.normalize), [size, size, channels])
    return {"image": image, "label": tf.cast(example["label"], tf.int32)}

  return fn


def _tf_eval_map(tf, cfg):
  """``example -> {'image': (S, S, C), 'label'}`` with 'resize' or MAE's 'resize_crop'."""
  size = int(cfg.image_size)

  def fn(example):
    image = tf.cast(example["image"], tf.float32)
    if cfg.eval_resize == "resize":
      image = _tf_resize(tf, image, size, size)
    else:
      shape = tf.shape(image)
      height, width = tf.cast(shape[0], tf.float64), tf.cast(shape[1], tf.float64)
      short = tf.constant(float(int(size / augment.EVAL_CROP_PCT)), tf.float64)
      # Same rule as torchvision Resize(int): the longer side is truncated, not rounded.
      new_h = tf.cast(tf.where(height <= width, short, short * height / width), tf.int32)
      new_w = tf.cast(tf.where(height <= width, short * width / height, short), tf.int32)
      image = _tf_resize(tf, image, new_h, new_w)
      top = tf.cast(tf.round(tf.cast(new_h - size, tf.float32) / 2.0), tf.int32)
      left = tf.cast(tf.round(tf.cast(new_w - size, tf.float32) / 2.0), tf.int32)
      image = image[top:top + size, left:left + size]
    channels = example["image"].shape[-1]
    image = tf.ensure_shape(_tf_normalize(tf, image, cfg.normalize), [size, size, channels])
    return {"image": image, "label": tf.cast(example["label"], tf.int32)}

  return fn


def _tf_options(tf):
  options = tf.data.Options()
  options.deterministic = True
  return options


def train_iterator(cfg, builder, global_batch: int, seed: int, start_step: int,
                   process_index: int, process_count: int):
  """tf.data training batches of this process's shard of ``train_split``.

  Returns:
    A numpy iterator of ``{'image': float32 (L, S, S, C) normalised, 'label': int32 (L,)}``,
    ``L = global_batch // process_count``; see the module docstring for resumption.
  """
  tf, tfds = tensorflow(), tensorflow_datasets()
  local = global_batch // process_count
  feature = image_feature(builder)
  channels = int(feature.shape[-1])
  encoded_jpeg = getattr(feature, "encoding_format", None) == "jpeg"
  shuffle_seed = _derived_seed(seed, _TF_SHUFFLE_STREAM, process_index, start_step)
  aug_seed = _derived_seed(seed, _TF_AUG_STREAM, process_index, start_step)
  split = tfds.split_for_jax_process(cfg.train_split, process_index=process_index,
                                     process_count=process_count)
  read_config = tfds.ReadConfig(shuffle_seed=shuffle_seed, options=_tf_options(tf))
  decoders = {"image": tfds.decode.SkipDecoding()} if encoded_jpeg else None
  ds = builder.as_dataset(split=split, shuffle_files=True, read_config=read_config,
                          decoders=decoders)
  ds = ds.shuffle(cfg.shuffle_buffer, seed=shuffle_seed, reshuffle_each_iteration=True)
  ds = ds.repeat()
  # Each example's augmentation seed is (aug_seed, its position in this process's stream).
  ds = ds.enumerate(start=start_step * local)
  train_map = _tf_train_map(tf, cfg, channels, encoded_jpeg)
  ds = ds.map(lambda i, ex: train_map(tf.stack([tf.cast(aug_seed, tf.int64), i]), ex),
              num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.batch(local, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
  ds = ds.with_options(_tf_options(tf))
  return ds.as_numpy_iterator()


def eval_arrays(cfg, builder, split: str) -> Dict[str, np.ndarray]:
  """The first ``max_eval_examples`` examples of ``split`` in file order, no augmentation.

  Returns:
    ``{'image': float32 (N, S, S, C) normalised, 'label': int32 (N,)}``.
  """
  tf = tensorflow()
  ds = builder.as_dataset(split=split, shuffle_files=False)
  if cfg.max_eval_examples is not None:
    ds = ds.take(cfg.max_eval_examples)
  ds = ds.map(_tf_eval_map(tf, cfg), num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.batch(_EVAL_BATCH).prefetch(tf.data.AUTOTUNE).with_options(_tf_options(tf))
  images, labels = [], []
  for batch in ds.as_numpy_iterator():
    images.append(batch["image"])
    labels.append(batch["label"])
  channels = int(image_feature(builder).shape[-1])
  size = int(cfg.image_size)
  if not images:
    return {"image": np.zeros((0, size, size, channels), np.float32),
            "label": np.zeros((0,), np.int32)}
  return {"image": np.concatenate(images), "label": np.concatenate(labels)}
