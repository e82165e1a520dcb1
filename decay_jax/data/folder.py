"""Image folders (``dataset='imagefolder:/dir'``): ``dir/<split>/<class>/**/<image>``, as torchvision.

Each split is a folder of class folders; the sorted class folder names are the labels 0, 1, ...
(torchvision's ``ImageFolder``, which the official MAE code trains from), and the images of a class
are every file below its folder with an image extension, in sorted path order. Images are decoded
with Pillow when a record is read (in a Grain worker), at any size, and converted to RGB or to
greyscale (``data.channels``; by default greyscale only when the first training image is).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import numpy as np
from PIL import Image

from decay_jax import paths
from decay_jax.data import config
from decay_jax.data import splits

# torchvision.datasets.folder.IMG_EXTENSIONS (compared case-insensitively, as torchvision does).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_GREY_MODES = ("1", "L", "LA", "I", "I;16", "F")


def root_of(dataset: str) -> Optional[str]:
  if not dataset.startswith(config.IMAGEFOLDER_PREFIX):
    return None
  return str(paths.resolve(dataset[len(config.IMAGEFOLDER_PREFIX):]))


def _subdirs(directory: str, dataset: str) -> List[str]:
  """The sorted names of the folders in ``directory``; a one-line error if it cannot be listed."""
  try:
    return sorted(p.name for p in paths.resolve(directory).iterdir() if p.is_dir())
  except OSError as e:
    raise ValueError(f"dataset={dataset!r} cannot be read; the folder {directory!r} cannot be "
                     f"listed ({type(e).__name__}: {e.strerror or e})") from None


def split_names(root: str, dataset: str) -> List[str]:
  """The split folders of an image-folder root; one-line errors for a missing or empty root."""
  if not paths.exists(root):
    raise ValueError(f"dataset={dataset!r} is not allowed; the directory {root!r} does not exist")
  if not paths.resolve(root).is_dir():
    raise ValueError(f"dataset={dataset!r} is not allowed; {root!r} is a file, not a directory "
                     "(expected DIR/<split>/<class>/<image>)")
  names = _subdirs(root, dataset)
  if not names:
    raise ValueError(f"dataset={dataset!r} is not allowed; {root!r} has no split folders "
                     "(expected DIR/<split>/<class>/<image>, e.g. DIR/train/cat/1.png)")
  return names


@functools.lru_cache(maxsize=8)
def listing(root: str, split: str) -> Tuple[Tuple[str, ...], Tuple[str, ...], np.ndarray]:
  """``(class_names, files, labels int32)`` of one split folder (cached per process)."""
  directory = paths.join(root, split)
  classes = tuple(_subdirs(directory, config.IMAGEFOLDER_PREFIX + root))
  if not classes:
    raise ValueError(f"dataset='{config.IMAGEFOLDER_PREFIX}{root}' is not allowed; "
                     f"{directory!r} has no class folders (expected {directory}/<class>/<image>)")
  files, labels = [], []
  for label, name in enumerate(classes):
    found = paths.list_files(paths.join(directory, name), IMAGE_EXTENSIONS)
    if not found:
      raise ValueError(f"dataset='{config.IMAGEFOLDER_PREFIX}{root}' is not allowed; the class "
                       f"folder {paths.join(directory, name)!r} has no images "
                       f"({', '.join(IMAGE_EXTENSIONS)})")
    files += found
    labels += [label] * len(found)
  return classes, tuple(files), np.asarray(labels, np.int32)


def decode(path: str, channels: int) -> np.ndarray:
  """uint8 (H, W, channels) pixels of one image file; one-line ValueError if it cannot be read."""
  try:
    with paths.resolve(path).open("rb") as f, Image.open(f) as image:
      image = image.convert("L" if channels == 1 else "RGB")
      pixels = np.asarray(image)
  except Image.UnidentifiedImageError:
    raise ValueError(f"image {path!r} cannot be read (not an image file Pillow can decode)"
                     ) from None
  except Exception as e:  # pylint: disable=broad-except  (PIL raises many unrelated types)
    raise ValueError(f"image {path!r} cannot be read ({type(e).__name__}: "
                     f"{' '.join(str(e).split())[:120]})") from None
  return pixels[..., None] if channels == 1 else pixels


def native_channels(path: str) -> int:
  """1 if an image file is greyscale, else 3 (only the header is read)."""
  try:
    with paths.resolve(path).open("rb") as f, Image.open(f) as image:
      return 1 if image.mode in _GREY_MODES else 3
  except Image.UnidentifiedImageError:
    raise ValueError(f"image {path!r} cannot be read (not an image file Pillow can decode)"
                     ) from None
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"image {path!r} cannot be read ({type(e).__name__}: "
                     f"{' '.join(str(e).split())[:120]})") from None


class FolderRecords:
  """Random access to one split: ``records[i] -> (uint8 (H, W, C), int label)``, decoded on read.

  Pickles without its file list (each Grain worker lists the folder again, once).
  """

  def __init__(self, root: str, split: str, field: str, channels: int):
    self.root, self.split, self.field, self.channels = root, split, field, channels
    dataset = config.IMAGEFOLDER_PREFIX + root
    self.name, sl = splits.parse(split, field, split_names(root, dataset), repr(root))
    self.indices = splits.select(len(listing(root, self.name)[1]), sl, split, field)

  def class_names(self) -> Tuple[str, ...]:
    return listing(self.root, self.name)[0]

  def __len__(self) -> int:
    return len(self.indices)

  def path(self, index: int) -> str:
    return listing(self.root, self.name)[1][self.indices[index]]

  def __getitem__(self, index: int) -> Tuple[np.ndarray, int]:
    _, files, labels = listing(self.root, self.name)
    i = self.indices[index]
    return decode(files[i], self.channels), int(labels[i])
