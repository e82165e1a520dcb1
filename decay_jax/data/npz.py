"""npz sources (``dataset='embedded_mnist'`` or ``'npz:/abs/path.npz'``): uint8 NHWC arrays.

An npz holds ``x_train`` (uint8 (N, H, W, C)), ``y_train`` (N,) and optionally ``x_test``,
``y_test`` and ``class_names``. Headers are checked without decompressing; the arrays are loaded
once per (path, mtime, size) and process, read-only.
"""

from __future__ import annotations

import functools
import os
import zipfile
from typing import Dict, Tuple

import numpy as np

from decay_jax import paths
from decay_jax.data import config
from decay_jax.data import splits


def npz_path(dataset: str) -> str:
  """The file of an npz source (``'embedded_mnist'`` or ``'npz:...'``)."""
  if dataset == config.EMBEDDED_MNIST:
    return config.EMBEDDED_NPZ
  path = str(paths.resolve(dataset[len(config.NPZ_PREFIX):]))  # local (~ expanded) or gs://...
  if not paths.exists(path) or paths.resolve(path).is_dir():
    raise ValueError(f"dataset={dataset!r} is not allowed; the npz file {path!r} does not exist")
  return path


def header(path: str, dataset: str) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
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
def _load_cached(path: str, mtime_ns: int, size: int) -> Dict[str, np.ndarray]:
  """Loads every array of an npz once per (path, mtime, size); arrays are made read-only."""
  del mtime_ns, size  # Only part of the cache key: a rewritten file is loaded again.
  with paths.load_numpy(path) as d:
    arrays = {k: d[k] for k in d.files}
  for value in arrays.values():
    value.setflags(write=False)
  return arrays


def load(path: str) -> Dict[str, np.ndarray]:
  if paths.is_uri(path):
    stat = paths.resolve(path).stat()
    return _load_cached(path, int(stat.mtime * 1e9), stat.length)
  stat = os.stat(path)
  return _load_cached(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


def num_classes(path: str) -> int:
  arrays = load(path)
  if "class_names" in arrays:
    return int(len(arrays["class_names"]))
  labels = [arrays[k] for k in ("y_train", "y_test") if k in arrays]
  return int(max(int(y.max()) for y in labels)) + 1


class NpzRecords:
  """Random access to one split of an npz: ``records[i] -> (uint8 (H, W, C), int label)``.

  Pickles as (path, split) and reloads in the process that reads it (a Grain worker), so a
  large array never travels through a pipe.
  """

  def __init__(self, path: str, split: str, field: str, has_test: bool):
    self.path, self.split, self.field, self.has_test = path, split, field, has_test
    names = ("train", "test") if has_test else ("train",)
    where = "this npz" if has_test else "this npz (no x_test)"
    self.name, sl = splits.parse(split, field, names, where)
    n = load(path)["y_" + self.name].shape[0]
    self.indices = splits.select(n, sl, split, field)
    self._arrays = None

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k != "_arrays"} | {"_arrays": None}

  def _get(self) -> Tuple[np.ndarray, np.ndarray]:
    if self._arrays is None:
      arrays = load(self.path)
      self._arrays = (arrays["x_" + self.name], arrays["y_" + self.name])
    return self._arrays

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, index: int) -> Tuple[np.ndarray, int]:
    images, labels = self._get()
    i = self.indices[index]
    return images[i], int(labels[i])

  def image_shape(self) -> Tuple[int, ...]:
    return tuple(self._get()[0].shape[1:])
