"""Where examples come from: one ``Source`` per kind of ``dataset``, chosen by ``source_for``.

  ``'latents:/dir'``: pre-extracted latent shards (``decay_jax.data.latents``).
  ``'embedded_mnist'`` and ``'npz:/abs/path.npz'``: in-memory uint8 NHWC arrays, loaded once per
      (path, mtime, size) and preprocessed on the host (``decay_jax.data.augment``).
  anything else: a TFDS builder name, read with tf.data (``decay_jax.data.tf_augment``).

Every source has ``info()``, ``train_iterator(global_batch, seed, start_step, process_index,
process_count)`` and ``eval_arrays(split, field)``; constructing one checks the config fields
(``config.check_fields``) and whatever the split-independent I/O can check (the npz file and its
headers, the TFDS builder), and each method checks the splits and channels it uses before reading.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import zipfile
from typing import Dict, Iterator, Tuple

import ml_collections
import numpy as np

from decay_jax import paths
from decay_jax.data import augment
from decay_jax.data import config
from decay_jax.data import latents
from decay_jax.data import tf_augment

_ARRAY_SPLIT_RE = re.compile(r"^(train|test)(?:\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\])?$")

Batches = Iterator[Dict[str, np.ndarray]]


# ------------------------------------------------------------------------------------------------
# npz files and their splits.


def _npz_path(dataset: str) -> str:
  """The file of an in-memory source (``'embedded_mnist'`` or ``'npz:...'``)."""
  if dataset == config.EMBEDDED_MNIST:
    return config.EMBEDDED_NPZ
  path = str(paths.resolve(dataset[len(config.NPZ_PREFIX):]))  # local (~ expanded) or gs://...
  if not paths.exists(path) or paths.resolve(path).is_dir():
    raise ValueError(f"dataset={dataset!r} is not allowed; the npz file {path!r} does not exist")
  return path


def _npz_header(path: str, dataset: str) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
  """Shapes and dtypes of an npz's arrays, read from the .npy headers without decompressing data."""
  out = {}
  try:
    with paths.resolve(path).open("rb") as raw, zipfile.ZipFile(raw) as zf:
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
  with paths.load_numpy(path) as d:
    arrays = {k: d[k] for k in d.files}
  for value in arrays.values():
    value.setflags(write=False)
  return arrays


def _load_npz(path: str) -> Dict[str, np.ndarray]:
  if paths.is_uri(path):
    stat = paths.resolve(path).stat()
    return _load_npz_cached(path, int(stat.mtime * 1e9), stat.length)
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
class ArraySplit:
  """One split of an in-memory source.

  Attributes:
    images: uint8 (N, H, W, C), read-only.
    labels: int32 (N,).
  """
  images: np.ndarray
  labels: np.ndarray


def _array_num_classes(path: str) -> int:
  arrays = _load_npz(path)
  if "class_names" in arrays:
    return int(len(arrays["class_names"]))
  labels = [arrays[k] for k in ("y_train", "y_test") if k in arrays]
  return int(max(int(y.max()) for y in labels)) + 1


# ------------------------------------------------------------------------------------------------
# TFDS builders and splits.


def _tfds_builder(cfg: ml_collections.ConfigDict):
  """The TFDS builder named by ``cfg.dataset`` (constructing it reads metadata only)."""
  tfds = tf_augment.tensorflow_datasets()
  try:
    return tfds.builder(cfg.dataset, data_dir=cfg.data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(
        f"dataset={cfg.dataset!r} is not allowed; choose {config.EMBEDDED_MNIST!r}, "
        f"'{config.NPZ_PREFIX}/abs/path.npz', '{latents.PREFIX}/dir' or a TFDS builder name such "
        "as 'cifar10' or 'imagenet2012' (see tfds.list_builders())") from e


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


# ------------------------------------------------------------------------------------------------
# The sources.


class Source:
  """The interface of every source; ``cfg`` has passed ``config.check_fields``."""

  def __init__(self, cfg: ml_collections.ConfigDict):
    self.cfg = cfg

  def info(self) -> dict:
    """``{'num_train', 'num_classes', 'channels', 'image_size'}``; see ``pipeline.dataset_info``."""
    raise NotImplementedError

  def train_iterator(self, global_batch: int, seed: int, start_step: int, process_index: int,
                     process_count: int) -> Batches:
    """See ``pipeline.make_train_iterator``; the arguments have passed ``config.check_batch``."""
    raise NotImplementedError

  def eval_arrays(self, split: str, field: str) -> Dict[str, np.ndarray]:
    """See ``pipeline.load_eval_arrays``; ``field`` names ``split`` in error messages."""
    raise NotImplementedError


class LatentSource(Source):
  """``dataset='latents:/dir'``: memory-mapped latent shards."""

  def info(self) -> dict:
    return latents.dataset_info(self.cfg)

  def train_iterator(self, global_batch, seed, start_step, process_index, process_count):
    return latents.make_train_iterator(self.cfg, global_batch, seed, start_step, process_index,
                                       process_count)

  def eval_arrays(self, split, field):
    del field  # latents name the split 'split' in their own messages
    return latents.load_eval_arrays(self.cfg, split)


class ArraySource(Source):
  """``dataset='embedded_mnist'`` or ``'npz:/abs/path.npz'``: uint8 arrays in host memory."""

  def __init__(self, cfg: ml_collections.ConfigDict):
    super().__init__(cfg)
    self.path = _npz_path(cfg.dataset)
    self.header = _npz_header(self.path, cfg.dataset)
    self.has_test = "x_test" in self.header and "y_test" in self.header
    self.channels = self.header["x_train"][0][-1]
    config.check_channels(cfg, self.channels)

  def split(self, split: str, field: str) -> ArraySplit:
    """The examples of ``split`` (``'train'``, ``'test'`` or a slice of them)."""
    name, sl = _parse_array_split(split, field, self.has_test)
    arrays = _load_npz(self.path)
    images, labels = arrays["x_" + name][sl], arrays["y_" + name][sl].astype(np.int32)
    if len(images) == 0:
      raise ValueError(f"{field}={split!r} is not allowed; it selects no examples")
    return ArraySplit(images, labels)

  def info(self) -> dict:
    _parse_array_split(self.cfg.eval_split, "eval_split", self.has_test)
    train = self.split(self.cfg.train_split, "train_split")
    return {"num_train": len(train.labels), "num_classes": _array_num_classes(self.path),
            "channels": int(self.channels), "image_size": int(self.cfg.image_size)}

  def train_iterator(self, global_batch, seed, start_step, process_index, process_count):
    train = self.split(self.cfg.train_split, "train_split")
    return augment.train_batches(self.cfg, train.images, train.labels, global_batch, seed,
                                 start_step, process_index, process_count)

  def eval_arrays(self, split, field):
    source = self.split(split, field)
    images, labels = source.images, source.labels
    if self.cfg.max_eval_examples is not None:
      images, labels = images[:self.cfg.max_eval_examples], labels[:self.cfg.max_eval_examples]
    return {"image": augment.eval_images(images, self.cfg), "label": labels.copy()}


class TfdsSource(Source):
  """Any other ``dataset``: a TFDS builder name, read with tf.data."""

  def __init__(self, cfg: ml_collections.ConfigDict):
    super().__init__(cfg)
    self.builder = _tfds_builder(cfg)

  def _check(self, *splits: Tuple[str, str]) -> int:
    """Checks ``(split, field)`` pairs, then the channel count (which it returns)."""
    for split, field in splits:
      _check_tfds_split(self.builder, split, field)
    channels = tf_augment.image_feature(self.builder).shape[-1]
    config.check_channels(self.cfg, channels)
    return channels

  def info(self) -> dict:
    channels = self._check((self.cfg.train_split, "train_split"),
                           (self.cfg.eval_split, "eval_split"))
    splits = self.builder.info.splits
    num_train = int(splits[self.cfg.train_split].num_examples) if splits else None
    return {"num_train": num_train,
            "num_classes": int(self.builder.info.features["label"].num_classes),
            "channels": int(channels), "image_size": int(self.cfg.image_size)}

  def train_iterator(self, global_batch, seed, start_step, process_index, process_count):
    self._check((self.cfg.train_split, "train_split"))
    return tf_augment.train_iterator(self.cfg, self.builder, global_batch, seed, start_step,
                                     process_index, process_count)

  def eval_arrays(self, split, field):
    self._check((split, field))
    return tf_augment.eval_arrays(self.cfg, self.builder, split)


def source_for(data_cfg: ml_collections.ConfigDict) -> Source:
  """The source of ``data_cfg.dataset``, after ``config.check_fields`` (cached per config)."""
  config.check_fields(data_cfg)
  dataset = data_cfg.dataset
  if latents.path_of(dataset) is not None:
    return LatentSource(data_cfg)
  if dataset == config.EMBEDDED_MNIST or dataset.startswith(config.NPZ_PREFIX):
    return ArraySource(data_cfg)
  return TfdsSource(data_cfg)
