"""Input pipelines for MAE pretraining: in-memory arrays (numpy + PIL) and TFDS (tf.data).

Everything is driven by one ``ml_collections.ConfigDict`` (start from ``default_data_config()``):

  ``dataset``: ``'embedded_mnist'`` (the MNIST subset shipped in ``decay_jax/data/embedded/``),
      ``'npz:/abs/path.npz'`` (any npz with uint8 NHWC ``x_train``/``y_train`` and optionally
      ``x_test``/``y_test``, ``class_names``), or a TFDS builder name such as ``'cifar10'`` or
      ``'imagenet2012'`` (read from ``data_dir``).
  ``train_split`` / ``eval_split``: ``'train'``, ``'test'``; in-memory sources also take Python
      slices of those, e.g. ``'train[:8000]'`` / ``'train[8000:]'`` for an npz without a test set;
      TFDS sources take any TFDS split string.
  ``image_size``: output resolution ``S``.
  ``crop_scale``, ``crop_ratio``, ``flip``: the MAE pretraining augmentation, i.e. torchvision's
      ``RandomResizedCrop(S, scale, ratio, BICUBIC)`` then ``RandomHorizontalFlip(0.5)``.
  ``normalize``: ``'imagenet'`` (``(x - mean) / std`` with the ImageNet statistics; 3 channels
      only), ``'half'`` (``(x - 0.5) / 0.5``) or ``'none'`` (``x`` in ``[0, 1]``), where
      ``x = pixel / 255``.
  ``eval_resize``: ``'resize_crop'`` (MAE evaluation: bicubic resize of the shorter side to
      ``int(S / 0.875)``, then a centre crop ``S``) or ``'resize'`` (bicubic resize straight to
      ``S x S``, for tiny images).
  ``data_dir``, ``shuffle_buffer`` (TFDS only), ``max_eval_examples`` (None = the whole split).

In-memory sources are deterministic and exactly resumable. The training order is the
concatenation of per-epoch permutations drawn from ``(seed, epoch)``; global step ``s`` consumes the
global positions ``[s B, (s + 1) B)`` and process ``p`` of ``P`` takes the slice
``[s B + p B / P, s B + (p + 1) B / P)``; the augmentation of the example at global position ``g``
uses its own ``numpy`` Generator seeded by ``SeedSequence([seed, stream, g])``. So an iterator
started at ``start_step=s`` yields exactly what an uninterrupted one yields at step ``s``, whatever
the process count. Crops are resized on the host with PIL (bicubic, as torchvision on PIL images);
sampling, flips and normalisation are vectorised over the batch.

TFDS sources use tf.data with per-process sharding (``tfds.split_for_jax_process`` with the given
``process_index``/``process_count``), the same augmentation in TensorFlow (stateless
``sample_distorted_bounding_box`` with 10 attempts and torchvision's centre-crop fallback, bicubic
antialiased resize, random flip), ``shuffle(shuffle_buffer, seed)``, ``repeat``, ``batch`` and
``prefetch``, with deterministic tf.data options. Resuming at ``start_step`` folds the step into
the shuffle and augmentation seeds: the stream is a fresh, valid stream, but tf.data order is NOT
bit-identical to what an uninterrupted run would have produced after step ``start_step``.
TensorFlow is imported only when a TFDS source is used, and it never sees the GPUs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import zipfile
from typing import Dict, Iterator, Optional, Tuple

import ml_collections
import numpy as np
from PIL import Image

from decay_jax.data import latents

EMBEDDED_MNIST = "embedded_mnist"
NPZ_PREFIX = "npz:"
NORMALIZE = ("imagenet", "half", "none")
EVAL_RESIZE = ("resize_crop", "resize")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# MAE evaluation resizes the shorter side to 256 for a 224 crop: crop_pct = 224 / 256.
EVAL_CROP_PCT = 0.875
# torchvision RandomResizedCrop tries 10 (area, log-ratio) samples before its centre-crop fallback.
RRC_ATTEMPTS = 10
# Independent SeedSequence streams derived from the same user seed.
_PERM_STREAM, _AUG_STREAM, _TF_SHUFFLE_STREAM, _TF_AUG_STREAM = 0, 1, 2, 3
# Uniforms drawn per example: RRC_ATTEMPTS areas, RRC_ATTEMPTS log-ratios, top, left, flip.
_NUM_UNIFORMS = 2 * RRC_ATTEMPTS + 3
_ARRAY_SPLIT_RE = re.compile(r"^(train|test)(?:\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\])?$")
_BICUBIC = Image.Resampling.BICUBIC
_EVAL_BATCH = 256


def default_data_config() -> ml_collections.ConfigDict:
  """Defaults that run anywhere: the shipped MNIST subset at its native 28 x 28 resolution.

  The augmentation and ``eval_resize='resize_crop'`` are MAE's. ``normalize='half'`` is the one
  choice valid for every channel count; MAE on ImageNet sets ``normalize='imagenet'`` (and
  ``dataset``, ``image_size=224``); tiny images may prefer ``eval_resize='resize'``.
  """
  return ml_collections.ConfigDict({
      "dataset": EMBEDDED_MNIST,
      "train_split": "train",
      "eval_split": "test",
      "image_size": 28,
      "crop_scale": (0.2, 1.0),
      "crop_ratio": (3.0 / 4.0, 4.0 / 3.0),
      "flip": True,
      "normalize": "half",
      "data_dir": None,
      "shuffle_buffer": 10_000,
      "max_eval_examples": None,
      "eval_resize": "resize_crop",
  })


# ------------------------------------------------------------------------------------------------
# Config validation (cheap: no image is read or decoded before these pass).


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check_range_pair(field: str, value, at_most_one: bool) -> Tuple[float, float]:
  """Checks a ``(low, high)`` pair of numbers with ``0 < low <= high`` (and ``high <= 1``)."""
  ok = (isinstance(value, (tuple, list)) and len(value) == 2 and all(map(_is_number, value))
        and 0.0 < float(value[0]) <= float(value[1]))
  if ok and at_most_one:
    ok = float(value[1]) <= 1.0
  if not ok:
    limit = "0 < low <= high <= 1" if at_most_one else "0 < low <= high"
    raise ValueError(f"{field}={value!r} is not allowed; "
                     f"it must be a pair (low, high) with {limit}")
  return float(value[0]), float(value[1])


def _check_choice(field: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(f"{field}={value!r} is not allowed; choose one of "
                     f"{', '.join(map(repr, allowed))}")


def _check_fields(cfg: ml_collections.ConfigDict) -> None:
  """Checks the fields that need no I/O."""
  if not (_is_int(cfg.image_size) and cfg.image_size >= 1):
    raise ValueError(f"image_size={cfg.image_size!r} is not allowed; it must be an integer >= 1")
  _check_range_pair("crop_scale", cfg.crop_scale, at_most_one=True)
  _check_range_pair("crop_ratio", cfg.crop_ratio, at_most_one=False)
  if not isinstance(cfg.flip, (bool, np.bool_)):
    raise ValueError(f"flip={cfg.flip!r} is not allowed; it must be True or False")
  _check_choice("normalize", cfg.normalize, NORMALIZE)
  _check_choice("eval_resize", cfg.eval_resize, EVAL_RESIZE)
  if not (_is_int(cfg.shuffle_buffer) and cfg.shuffle_buffer >= 1):
    raise ValueError(f"shuffle_buffer={cfg.shuffle_buffer!r} is not allowed; "
                     "it must be an integer >= 1")
  if cfg.max_eval_examples is not None and not (
      _is_int(cfg.max_eval_examples) and cfg.max_eval_examples >= 1):
    raise ValueError(f"max_eval_examples={cfg.max_eval_examples!r} is not allowed; "
                     "it must be None or an integer >= 1")
  if not isinstance(cfg.dataset, str):
    raise ValueError(f"dataset={cfg.dataset!r} is not allowed; it must be a string")


def _check_batch(global_batch, seed, start_step, process_index, process_count) -> None:
  if not (_is_int(process_count) and process_count >= 1):
    raise ValueError(f"process_count={process_count!r} is not allowed; "
                     "it must be an integer >= 1")
  if not (_is_int(process_index) and 0 <= process_index < process_count):
    raise ValueError(f"process_index={process_index!r} is not allowed; "
                     f"it must be an integer in [0, {process_count})")
  if not (_is_int(global_batch) and global_batch >= 1 and global_batch % process_count == 0):
    raise ValueError(f"global_batch={global_batch!r} is not allowed; it must be a positive "
                     f"multiple of process_count={process_count}")
  if not _is_int(seed):
    raise ValueError(f"seed={seed!r} is not allowed; it must be an integer")
  if not (_is_int(start_step) and start_step >= 0):
    raise ValueError(f"start_step={start_step!r} is not allowed; it must be an integer >= 0")


def _seed_words(seed: int) -> int:
  """Maps any Python int seed to the non-negative 64-bit entropy SeedSequence accepts."""
  return int(seed) & ((1 << 64) - 1)


def _check_channels(cfg: ml_collections.ConfigDict, channels: int) -> None:
  if cfg.normalize == "imagenet" and channels != 3:
    raise ValueError(f"normalize='imagenet' is not allowed for {channels}-channel images; "
                     "choose 'half' or 'none'")


# ------------------------------------------------------------------------------------------------
# Sources.


def _npz_path(dataset: str) -> Optional[str]:
  """The file of an in-memory source, or None for a TFDS name."""
  if dataset == EMBEDDED_MNIST:
    # Imported here, not at the top: the package __init__ imports this module, and a top-level
    # import would make `python -m decay_jax.data.embedded` warn about a pre-imported module.
    from decay_jax.data import embedded  # pylint: disable=g-import-not-at-top
    return embedded.EMBEDDED_MNIST
  if dataset.startswith(NPZ_PREFIX):
    path = os.path.expanduser(dataset[len(NPZ_PREFIX):])
    if not os.path.isfile(path):
      raise ValueError(f"dataset={dataset!r} is not allowed; the npz file {path!r} does not exist")
    return path
  return None


def _npz_header(path: str, dataset: str) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
  """Shapes and dtypes of an npz's arrays, read from the .npy headers without decompressing data."""
  out = {}
  try:
    with zipfile.ZipFile(path) as zf:
      for name in zf.namelist():
        if not name.endswith(".npy"):
          continue
        with zf.open(name) as f:
          version = np.lib.format.read_magic(f)
          read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                         else np.lib.format.read_array_header_2_0)
          shape, _, dtype = read_header(f)
        out[name[:-4]] = (tuple(shape), np.dtype(dtype))
  except zipfile.BadZipFile as e:
    raise ValueError(f"dataset={dataset!r} is not allowed; {path!r} is not an npz file") from e
  for key in ("x_train", "y_train"):
    if key not in out:
      raise ValueError(f"dataset={dataset!r} is not allowed; {path!r} has no {key!r} "
                       "(it needs x_train, y_train and optionally x_test, y_test)")
  for key in ("x_train", "x_test"):
    if key in out and (len(out[key][0]) != 4 or out[key][1] != np.uint8):
      raise ValueError(f"dataset={dataset!r} is not allowed; {key} in {path!r} is "
                       f"{out[key][1]} {out[key][0]}, it must be uint8 (N, H, W, C)")
  return out


@functools.lru_cache(maxsize=4)
def _load_npz_cached(path: str, mtime_ns: int, size: int) -> Dict[str, np.ndarray]:
  """Loads every array of an npz once per (path, mtime, size); arrays are made read-only."""
  del mtime_ns, size  # Only part of the cache key: a rewritten file is loaded again.
  with np.load(path, allow_pickle=False) as d:
    arrays = {k: d[k] for k in d.files}
  for value in arrays.values():
    value.setflags(write=False)
  return arrays


def _load_npz(path: str) -> Dict[str, np.ndarray]:
  stat = os.stat(path)
  return _load_npz_cached(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


def _parse_array_split(split, field: str, has_test: bool) -> Tuple[str, slice]:
  """Parses ``'train'``, ``'test'`` or ``'train[a:b]'`` into (array name suffix, slice)."""
  match = _ARRAY_SPLIT_RE.match(split) if isinstance(split, str) else None
  allowed = "'train', 'test' or a slice such as 'train[:8000]'"
  if match is None:
    raise ValueError(f"{field}={split!r} is not allowed; choose {allowed}")
  name, start, stop = match.groups()
  if name == "test" and not has_test:
    raise ValueError(f"{field}={split!r} is not allowed; this npz has no x_test, "
                     "use a slice of 'train' such as 'train[8000:]'")
  to_int = lambda s: int(s) if s else None
  return name, slice(to_int(start), to_int(stop))


@dataclasses.dataclass(frozen=True)
class _ArraySplit:
  """One split of an in-memory source.

  Attributes:
    images: uint8 (N, H, W, C), read-only.
    labels: int32 (N,).
  """
  images: np.ndarray
  labels: np.ndarray


def _array_split(path: str, split: str, field: str, dataset: str) -> _ArraySplit:
  header = _npz_header(path, dataset)
  name, sl = _parse_array_split(split, field, has_test="x_test" in header and "y_test" in header)
  arrays = _load_npz(path)
  images, labels = arrays["x_" + name][sl], arrays["y_" + name][sl].astype(np.int32)
  if len(images) == 0:
    raise ValueError(f"{field}={split!r} is not allowed; it selects no examples")
  return _ArraySplit(images, labels)


def _array_num_classes(path: str) -> int:
  arrays = _load_npz(path)
  if "class_names" in arrays:
    return int(len(arrays["class_names"]))
  labels = [arrays[k] for k in ("y_train", "y_test") if k in arrays]
  return int(max(int(y.max()) for y in labels)) + 1


def _tfds():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  return tfds


def _tfds_builder(cfg: ml_collections.ConfigDict):
  """The TFDS builder named by ``cfg.dataset`` (constructing it reads metadata only)."""
  tfds = _tfds()
  try:
    return tfds.builder(cfg.dataset, data_dir=cfg.data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(
        f"dataset={cfg.dataset!r} is not allowed; choose {EMBEDDED_MNIST!r}, "
        f"'{NPZ_PREFIX}/abs/path.npz', '{latents.PREFIX}/dir' or a TFDS builder name such as 'cifar10' or "
        "'imagenet2012' (see tfds.list_builders())") from e


def _check_tfds_split(builder, split, field: str) -> None:
  """Checks a split against the prepared split names; unprepared datasets accept any split."""
  if not isinstance(split, str) or not split:
    raise ValueError(f"{field}={split!r} is not allowed; it must be a TFDS split string")
  known = builder.info.splits
  if not known:
    return
  try:
    known[split]  # pylint: disable=pointless-statement
  except (KeyError, ValueError, AssertionError) as e:
    raise ValueError(f"{field}={split!r} is not allowed; {builder.name} has splits "
                     f"{', '.join(map(repr, sorted(known.keys())))}") from e


def _tfds_image_feature(builder):
  return builder.info.features["image"]


# ------------------------------------------------------------------------------------------------
# Public API.


def dataset_info(data_cfg: ml_collections.ConfigDict) -> dict:
  """Static facts about the configured dataset.

  Args:
    data_cfg: the data config.

  Returns:
    ``{'num_train': int (examples in train_split, all processes together; None for a TFDS dataset
    whose split sizes are unknown), 'num_classes': int, 'channels': int, 'image_size': int (the
    output resolution)}``.
  """
  _check_fields(data_cfg)
  if latents.path_of(data_cfg.dataset) is not None:
    return latents.dataset_info(data_cfg)
  path = _npz_path(data_cfg.dataset)
  if path is not None:
    header = _npz_header(path, data_cfg.dataset)
    channels = header["x_train"][0][-1]
    _check_channels(data_cfg, channels)
    _parse_array_split(data_cfg.eval_split, "eval_split",
                       has_test="x_test" in header and "y_test" in header)
    train = _array_split(path, data_cfg.train_split, "train_split", data_cfg.dataset)
    return {"num_train": len(train.labels), "num_classes": _array_num_classes(path),
            "channels": int(channels), "image_size": int(data_cfg.image_size)}
  builder = _tfds_builder(data_cfg)
  _check_tfds_split(builder, data_cfg.train_split, "train_split")
  _check_tfds_split(builder, data_cfg.eval_split, "eval_split")
  channels = _tfds_image_feature(builder).shape[-1]
  _check_channels(data_cfg, channels)
  num_train = None
  if builder.info.splits:
    num_train = int(builder.info.splits[data_cfg.train_split].num_examples)
  return {"num_train": num_train,
          "num_classes": int(builder.info.features["label"].num_classes),
          "channels": int(channels), "image_size": int(data_cfg.image_size)}


def make_train_iterator(data_cfg: ml_collections.ConfigDict, global_batch: int, seed: int,
                        start_step: int = 0, process_index: int = 0,
                        process_count: int = 1) -> Iterator[Dict[str, np.ndarray]]:
  """Infinite iterator of augmented training batches for this process.

  Args:
    data_cfg: the data config.
    global_batch: examples per step over all processes; a multiple of ``process_count``.
    seed: any Python int; fixes the order and the augmentation.
    start_step: first global step to produce (exact resumption for in-memory sources).
    process_index: this process, in ``[0, process_count)``.
    process_count: number of processes sharing each global batch.

  Returns:
    An iterator of ``{'image': float32 (L, S, S, C) normalised, 'label': int32 (L,)}`` with
    ``L = global_batch // process_count`` and ``S = image_size``. In-memory sources resume exactly
    at ``start_step``; TFDS sources fold it into the shuffle and augmentation seeds, so their
    resumed stream is valid but not bit-identical to the uninterrupted one.
  """
  _check_fields(data_cfg)
  _check_batch(global_batch, seed, start_step, process_index, process_count)
  if latents.path_of(data_cfg.dataset) is not None:
    return latents.make_train_iterator(data_cfg, global_batch, seed, start_step, process_index,
                                       process_count)
  path = _npz_path(data_cfg.dataset)
  if path is not None:
    header = _npz_header(path, data_cfg.dataset)
    _check_channels(data_cfg, header["x_train"][0][-1])
    train = _array_split(path, data_cfg.train_split, "train_split", data_cfg.dataset)
    return _array_train_iterator(data_cfg, train, global_batch, seed, start_step,
                                 process_index, process_count)
  builder = _tfds_builder(data_cfg)
  _check_tfds_split(builder, data_cfg.train_split, "train_split")
  _check_channels(data_cfg, _tfds_image_feature(builder).shape[-1])
  return _tfds_train_iterator(data_cfg, builder, global_batch, seed, start_step,
                              process_index, process_count)


def load_eval_arrays(data_cfg: ml_collections.ConfigDict,
                     split: Optional[str] = None) -> Dict[str, np.ndarray]:
  """The first ``max_eval_examples`` examples of a split, resized without augmentation.

  Args:
    data_cfg: the data config.
    split: the split to read; None means ``data_cfg.eval_split``.

  Returns:
    ``{'image': float32 (N, S, S, C) normalised, 'label': int32 (N,)}``.
  """
  _check_fields(data_cfg)
  field = "eval_split" if split is None else "split"
  split = data_cfg.eval_split if split is None else split
  if latents.path_of(data_cfg.dataset) is not None:
    return latents.load_eval_arrays(data_cfg, split)
  path = _npz_path(data_cfg.dataset)
  if path is not None:
    header = _npz_header(path, data_cfg.dataset)
    _check_channels(data_cfg, header["x_train"][0][-1])
    source = _array_split(path, split, field, data_cfg.dataset)
    images, labels = source.images, source.labels
    if data_cfg.max_eval_examples is not None:
      images, labels = images[:data_cfg.max_eval_examples], labels[:data_cfg.max_eval_examples]
    resized = _eval_resize_batch(images, data_cfg.image_size, data_cfg.eval_resize)
    return {"image": normalize_uint8(resized, data_cfg.normalize), "label": labels.copy()}
  builder = _tfds_builder(data_cfg)
  _check_tfds_split(builder, split, field)
  _check_channels(data_cfg, _tfds_image_feature(builder).shape[-1])
  return _tfds_eval_arrays(data_cfg, builder, split)


# ------------------------------------------------------------------------------------------------
# Host-side (numpy + PIL) preprocessing.


def normalization(data_cfg, channels: int) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
  """``(mean, std)`` per channel of ``data_cfg.normalize``: images are ``(x / 255 - mean) / std``."""
  _check_choice("normalize", data_cfg.normalize, NORMALIZE)
  if data_cfg.normalize == "imagenet":
    return IMAGENET_MEAN, IMAGENET_STD
  if data_cfg.normalize == "half":
    return (0.5,) * channels, (0.5,) * channels
  return (0.0,) * channels, (1.0,) * channels


def normalize_uint8(images: np.ndarray, mode: str) -> np.ndarray:
  """ToTensor then Normalize: uint8 (..., C) pixels to float32 (..., C)."""
  _check_choice("normalize", mode, NORMALIZE)
  x = images.astype(np.float32) / np.float32(255.0)
  if mode == "imagenet":
    x -= np.asarray(IMAGENET_MEAN, np.float32)
    x /= np.asarray(IMAGENET_STD, np.float32)
  elif mode == "half":
    x -= np.float32(0.5)
    x /= np.float32(0.5)
  return x


def _to_pil_planes(image: np.ndarray):
  """PIL images of one uint8 (H, W, C) array: one 'L'/'RGB' image, or one 'L' image per channel."""
  channels = image.shape[-1]
  if channels == 1:
    return [Image.fromarray(image[..., 0], "L")]
  if channels == 3:
    return [Image.fromarray(np.ascontiguousarray(image), "RGB")]
  return [Image.fromarray(np.ascontiguousarray(image[..., c]), "L") for c in range(channels)]


def _from_pil_planes(planes, channels: int) -> np.ndarray:
  if channels == 1:
    return np.asarray(planes[0])[..., None]
  if channels == 3:
    return np.asarray(planes[0])
  return np.stack([np.asarray(p) for p in planes], axis=-1)


def _pil_resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
  """Bicubic resize of uint8 (h, w, C) to uint8 (height, width, C), as torchvision on PIL."""
  if image.shape[0] == height and image.shape[1] == width:
    return image  # PIL's same-size resize is the identity; skip the round trip.
  planes = [p.resize((width, height), _BICUBIC) for p in _to_pil_planes(image)]
  return _from_pil_planes(planes, image.shape[-1])


def _eval_resize_one(image: np.ndarray, size: int, mode: str) -> np.ndarray:
  """uint8 (H, W, C) -> uint8 (size, size, C) by 'resize' or MAE's 'resize_crop'."""
  if mode == "resize":
    return _pil_resize(image, size, size)
  # torchvision Resize(int): the shorter side becomes `short`, the longer int(short * long / short).
  height, width = image.shape[:2]
  short = int(size / EVAL_CROP_PCT)
  if height <= width:
    new_h, new_w = short, int(short * width / height)
  else:
    new_h, new_w = int(short * height / width), short
  resized = _pil_resize(image, new_h, new_w)
  # torchvision center_crop rounds the offsets half-to-even, as Python's round does.
  top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
  return resized[top:top + size, left:left + size]


def _eval_resize_batch(images: np.ndarray, size: int, mode: str) -> np.ndarray:
  """uint8 (N, H, W, C) -> uint8 (N, size, size, C)."""
  out = np.empty((len(images), size, size, images.shape[-1]), np.uint8)
  for i, image in enumerate(images):
    out[i] = _eval_resize_one(image, size, mode)
  return out


def _epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
  """The order of epoch ``epoch``: int64 (n,), a permutation drawn from (seed, epoch)."""
  rng = np.random.default_rng([_seed_words(seed), _PERM_STREAM, epoch])
  return rng.permutation(n)


def _example_indices(positions: np.ndarray, seed: int, n: int, cache: dict) -> np.ndarray:
  """Dataset indices of global positions: int64 (L,) -> int64 (L,).

  ``cache`` maps epoch -> permutation; only the epochs of the current batch are kept.
  """
  epochs, offsets = np.divmod(positions, n)
  needed = set(np.unique(epochs).tolist())
  for epoch in list(cache):
    if epoch not in needed:
      del cache[epoch]
  out = np.empty_like(positions)
  for epoch in needed:
    if epoch not in cache:
      cache[epoch] = _epoch_permutation(seed, epoch, n)
    sel = epochs == epoch
    out[sel] = cache[epoch][offsets[sel]]
  return out


def _example_uniforms(positions: np.ndarray, seed: int) -> np.ndarray:
  """Per-example uniforms in [0, 1): float64 (L, _NUM_UNIFORMS), from (seed, global position)."""
  words = _seed_words(seed)
  return np.stack([
      np.random.default_rng([words, _AUG_STREAM, int(g)]).random(_NUM_UNIFORMS)
      for g in positions
  ]) if len(positions) else np.zeros((0, _NUM_UNIFORMS))


def _fallback_crop(height: int, width: int, ratio: Tuple[float, float]) -> Tuple[int, int]:
  """torchvision's centre-crop size when no sample fits: (h, w) clamped to the ratio range."""
  in_ratio = width / height
  if in_ratio < min(ratio):
    return int(round(width / min(ratio))), width
  if in_ratio > max(ratio):
    return height, int(round(height * max(ratio)))
  return height, width


def crop_params(uniforms: np.ndarray, height: int, width: int, scale: Tuple[float, float],
                ratio: Tuple[float, float]) -> Tuple[np.ndarray, ...]:
  """RandomResizedCrop boxes for a batch, as torchvision's ``get_params`` draws them.

  Args:
    uniforms: float64 (L, >= 2 * RRC_ATTEMPTS + 2) in [0, 1): per example, RRC_ATTEMPTS area
      draws, RRC_ATTEMPTS log-ratio draws, then the top and left offset draws.
    height: image height H.
    width: image width W.
    scale: (low, high) fraction of the image area.
    ratio: (low, high) width / height.

  Returns:
    ``(top, left, h, w)``, each int64 (L,): the first of the attempts whose box fits, placed
    uniformly; torchvision's centre crop where none fits.
  """
  k = RRC_ATTEMPTS
  area = float(height * width)
  target_area = area * (scale[0] + (scale[1] - scale[0]) * uniforms[:, :k])
  log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
  aspect = np.exp(log_lo + (log_hi - log_lo) * uniforms[:, k:2 * k])
  # np.round rounds half to even, exactly like the Python round() torchvision uses.
  w = np.round(np.sqrt(target_area * aspect)).astype(np.int64)
  h = np.round(np.sqrt(target_area / aspect)).astype(np.int64)
  fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
  first = np.argmax(fits, axis=1)
  rows = np.arange(len(uniforms))
  any_fit = fits[rows, first]
  h, w = h[rows, first], w[rows, first]
  # torch.randint(0, H - h + 1) is uniform over the integers [0, H - h].
  top = np.floor(uniforms[:, 2 * k] * (height - h + 1)).astype(np.int64)
  left = np.floor(uniforms[:, 2 * k + 1] * (width - w + 1)).astype(np.int64)
  fb_h, fb_w = _fallback_crop(height, width, ratio)
  top = np.where(any_fit, top, (height - fb_h) // 2)
  left = np.where(any_fit, left, (width - fb_w) // 2)
  h, w = np.where(any_fit, h, fb_h), np.where(any_fit, w, fb_w)
  return top, left, h, w


def augment_batch(images: np.ndarray, uniforms: np.ndarray, size: int,
                  cfg: ml_collections.ConfigDict) -> np.ndarray:
  """RandomResizedCrop(size, BICUBIC) then RandomHorizontalFlip on uint8 images.

  Args:
    images: uint8 (L, H, W, C).
    uniforms: float64 (L, _NUM_UNIFORMS) per-example draws in [0, 1); the last one decides the
      flip (flipped when < 0.5, as torchvision's ``torch.rand(1) < p``).
    size: output resolution S.
    cfg: the data config (crop_scale, crop_ratio, flip).

  Returns:
    uint8 (L, S, S, C).
  """
  num, height, width, channels = images.shape
  top, left, h, w = crop_params(uniforms, height, width, tuple(cfg.crop_scale),
                                tuple(cfg.crop_ratio))
  out = np.empty((num, size, size, channels), np.uint8)
  for i in range(num):
    # Crop first, then resize: PIL's resize(box=...) would blend in pixels outside the box.
    crop = images[i, top[i]:top[i] + h[i], left[i]:left[i] + w[i]]
    out[i] = _pil_resize(crop, size, size)
  if cfg.flip:
    flip = uniforms[:, -1] < 0.5
    out[flip] = out[flip, :, ::-1]
  return out


def _array_train_iterator(cfg, train: _ArraySplit, global_batch: int, seed: int,
                          start_step: int, process_index: int,
                          process_count: int) -> Iterator[Dict[str, np.ndarray]]:
  """Deterministic in-memory batches; see the module docstring for the position scheme."""
  n = len(train.labels)
  local = global_batch // process_count
  cache: dict = {}
  step = start_step
  while True:
    first = step * global_batch + process_index * local
    positions = np.arange(first, first + local, dtype=np.int64)
    indices = _example_indices(positions, seed, n, cache)
    uniforms = _example_uniforms(positions, seed)
    images = augment_batch(train.images[indices], uniforms, cfg.image_size, cfg)
    yield {"image": normalize_uint8(images, cfg.normalize), "label": train.labels[indices]}
    step += 1


# ------------------------------------------------------------------------------------------------
# TFDS (tf.data) preprocessing. TensorFlow is imported only from here.


@functools.lru_cache(maxsize=1)
def _tf():
  """TensorFlow with the GPUs hidden, so it never reserves accelerator memory JAX needs."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    tf.config.set_visible_devices([], "GPU")
  except RuntimeError:
    pass  # TF was already initialised by someone else; its device list can no longer change.
  return tf


def _derived_seed(*words: int) -> int:
  """A 31-bit seed for TF from SeedSequence entropy (TF wants int32/int64 seeds)."""
  return int(np.random.SeedSequence([_seed_words(w) for w in words]).generate_state(1)[0] >> 1)


def _tf_normalize(tf, image, mode: str):
  """float32 pixels in [0, 255] (..., C) -> normalised float32."""
  x = image / 255.0
  if mode == "imagenet":
    return (x - tf.constant(IMAGENET_MEAN, tf.float32)) / tf.constant(IMAGENET_STD, tf.float32)
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
      max_attempts=RRC_ATTEMPTS, use_image_if_no_bounding_boxes=True)
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
      short = tf.constant(float(int(size / EVAL_CROP_PCT)), tf.float64)
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


def _tfds_train_iterator(cfg, builder, global_batch: int, seed: int, start_step: int,
                         process_index: int, process_count: int):
  """tf.data training batches of this process's shard of ``train_split``."""
  tf, tfds = _tf(), _tfds()
  local = global_batch // process_count
  feature = _tfds_image_feature(builder)
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


def _tfds_eval_arrays(cfg, builder, split: str) -> Dict[str, np.ndarray]:
  """The first ``max_eval_examples`` examples of ``split`` in file order, no augmentation."""
  tf = _tf()
  ds = builder.as_dataset(split=split, shuffle_files=False)
  if cfg.max_eval_examples is not None:
    ds = ds.take(cfg.max_eval_examples)
  ds = ds.map(_tf_eval_map(tf, cfg), num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.batch(_EVAL_BATCH).prefetch(tf.data.AUTOTUNE).with_options(_tf_options(tf))
  images, labels = [], []
  for batch in ds.as_numpy_iterator():
    images.append(batch["image"])
    labels.append(batch["label"])
  channels = int(_tfds_image_feature(builder).shape[-1])
  size = int(cfg.image_size)
  if not images:
    return {"image": np.zeros((0, size, size, channels), np.float32),
            "label": np.zeros((0,), np.int32)}
  return {"image": np.concatenate(images), "label": np.concatenate(labels)}
