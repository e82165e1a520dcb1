"""Image folders (``dataset='imagefolder:/dir'``): ``dir/<split>/<class>/**/<image>``, as torchvision.

Each split is a folder of class folders; the sorted class folder names are the labels 0, 1, ...
(torchvision's ``ImageFolder``, which the official MAE code trains from), and the images of a class
are every file below its folder with an image extension, in sorted path order. Images are decoded
with Pillow when a record is read (in a Grain worker), at any size, and converted to RGB or to
greyscale (``data.channels``; by default greyscale only when the first training image is).

Training reads go through ``crop_resized`` instead: the RandomResizedCrop box is drawn from the
header's image size before anything is decoded, a JPEG is decoded at 1/2, 1/4 or 1/8 scale where
the crop allows (``data.jpeg_draft``), by simplejpeg (the same pixels as Pillow, for less CPU)
where it can, and only the crop goes through Pillow's resize and flip.
"""

from __future__ import annotations

import functools
import io
from typing import List, Optional, Tuple

import numpy as np
from PIL import Image
import simplejpeg

from decay_jax import paths
from decay_jax.data import augment
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


def _unreadable(path: str, e: BaseException) -> ValueError:
  """The one-line error of an image file that cannot be read."""
  if isinstance(e, Image.UnidentifiedImageError):
    return ValueError(f"image {path!r} cannot be read (not an image file Pillow can decode)")
  return ValueError(f"image {path!r} cannot be read ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:120]})")


def decode(path: str, channels: int) -> np.ndarray:
  """uint8 (H, W, channels) pixels of one image file; one-line ValueError if it cannot be read."""
  try:
    with paths.resolve(path).open("rb") as f, Image.open(f) as image:
      image = image.convert("L" if channels == 1 else "RGB")
      pixels = np.asarray(image)
  except Exception as e:  # pylint: disable=broad-except  (PIL raises many unrelated types)
    raise _unreadable(path, e) from None
  return pixels[..., None] if channels == 1 else pixels


# The JPEG colour spaces that simplejpeg decodes to exactly Pillow's pixels; CMYK, YCCK and
# RGB-coded JPEGs are left to Pillow, which converts them its own way.
_SIMPLEJPEG_SPACES = ("YCbCr", "Gray")


def _box_and_factor(uniforms: np.ndarray, height: int, width: int, size: int,
                    scale: Tuple[float, float], ratio: Tuple[float, float], draft: bool):
  """``(box, factor)``: the crop box drawn from the image's size and the DCT reduction it allows
  (1 without ``draft``), the same for both decoders."""
  box = augment.crop_box(uniforms, height, width, scale, ratio)
  return box, (augment.dct_factor(box[2], box[3], size) if draft else 1)


def _simplejpeg_crop(data: bytes, mode: str, uniforms: np.ndarray, size: int,
                     scale: Tuple[float, float], ratio: Tuple[float, float], draft: bool):
  """``(image, box, factor)`` for ``augment.resized_crop_pil``, decoded by simplejpeg, or None
  where Pillow is to decode the file (not a YCbCr or grey JPEG, or data libjpeg only warns
  about, which Pillow decodes as it always has).

  At full scale only the crop is handed to Pillow (``box`` then starts at (0, 0)); reduced, the
  whole reduced image (the resize reads around the float box).
  """
  if not data.startswith(b"\xff\xd8"):
    return None
  try:
    height, width, space, _ = simplejpeg.decode_jpeg_header(data)
  except Exception:  # pylint: disable=broad-except  (Pillow decides, and words any error)
    return None
  limit = Image.MAX_IMAGE_PIXELS
  if space not in _SIMPLEJPEG_SPACES or (limit and height * width > 2 * limit):
    return None  # (Pillow refuses such a decompression bomb)
  box, factor = _box_and_factor(uniforms, height, width, size, scale, ratio, draft)
  grey = space == "Gray" or (mode == "L" and factor > 1)  # reduced: as Pillow's draft('L')
  shape = (-(-height // factor), -(-width // factor))
  scaling = {} if factor == 1 else {"min_factor": factor, "min_height": shape[0],
                                      "min_width": shape[1]}
  try:
    pixels = simplejpeg.decode_jpeg(data, "GRAY" if grey else "RGB", **scaling)
  except Exception:  # pylint: disable=broad-except
    return None
  if pixels.shape[:2] != shape:
    return None
  if factor == 1:
    top, left, h, w = box
    pixels, box = pixels[top:top + h, left:left + w], (0, 0, h, w)
  return Image.fromarray(pixels[..., 0] if grey else pixels), box, factor


def crop_resized(path: str, channels: int, uniforms: np.ndarray, size: int,
                 scale: Tuple[float, float], ratio: Tuple[float, float], flip: bool,
                 draft: bool = True) -> np.ndarray:
  """uint8 (size, size, channels): RandomResizedCrop(size, bicubic) and flip of one image file,
  decoded no larger than the crop needs; one-line ValueError if it cannot be read.

  The same result as ``augment.augment_batch`` on ``decode(path, channels)`` with the same
  ``uniforms`` (float64 (NUM_UNIFORMS,)), bit for bit whenever the image is decoded at full
  scale, at less cost: the box is drawn from the size in the file's header
  (``augment.crop_box``, i.e. ``crop_params``: torchvision's distribution, whatever follows);
  then, with ``draft``, a JPEG is decoded at 1/2, 1/4 or 1/8 scale (libjpeg's DCT-domain
  scaling) when the crop still spans at least ``size`` reduced pixels on both sides
  (``augment.dct_factor``), a greyscale result (``channels`` 1) of a colour JPEG then decoded as
  grey (the luma) directly. YCbCr and grey JPEGs are decoded by simplejpeg (libjpeg-turbo, the
  same pixels as Pillow's decoder at every scale, for 15-21% less CPU per training read than
  Pillow's ``Image.open``/``load`` in docs/data.md's measurements: no header parsing in Python,
  one decode call); other files by Pillow (lazy ``Image.open``, ``Image.draft`` for other
  JPEGs). Only the crop (or the reduced image) is handed to Pillow, which crops, converts (only
  if the mode differs), resizes and flips (``augment.resized_crop_pil``: how the box maps to a
  reduced image, and the pixel difference that a reduced decode makes).
  """
  mode = "L" if channels == 1 else "RGB"
  flipped = augment.flips(uniforms, flip)
  try:
    with paths.resolve(path).open("rb") as f:
      data = f.read()
    decoded = _simplejpeg_crop(data, mode, uniforms, size, scale, ratio, draft)
    if decoded is not None:
      return augment.pil_to_uint8(augment.resized_crop_pil(*decoded, size, flipped, mode))
    with Image.open(io.BytesIO(data)) as image:
      width, height = image.size
      box, factor = _box_and_factor(uniforms, height, width, size, scale, ratio, draft)
      if factor > 1:
        # Pillow picks the largest reduction s with s <= min(W // w', H // h') for the
        # requested (w', h'); for (W // f, H // f) that is f. None: the format has none.
        drafted = image.draft(mode, (width // factor, height // factor))
        factor = round(width / drafted[1][2]) if drafted else 1
      # Inside the with: an image that needs no crop, resize or flip is loaded only here.
      return augment.pil_to_uint8(
          augment.resized_crop_pil(image, box, factor, size, flipped, mode))
  except Exception as e:  # pylint: disable=broad-except  (PIL raises many unrelated types)
    raise _unreadable(path, e) from None


def native_channels(path: str) -> int:
  """1 if an image file is greyscale, else 3 (only the header is read)."""
  try:
    with paths.resolve(path).open("rb") as f, Image.open(f) as image:
      return 1 if image.mode in _GREY_MODES else 3
  except Exception as e:  # pylint: disable=broad-except
    raise _unreadable(path, e) from None


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

  def crop_resized(self, index: int, uniforms: np.ndarray, size: int, scale: Tuple[float, float],
                   ratio: Tuple[float, float], flip: bool,
                   draft: bool = True) -> Tuple[np.ndarray, int]:
    """``(uint8 (size, size, C), label)``: the training crop of record ``index`` straight from its
    file (module-level ``crop_resized``), for ``loader.ImageTrainExample``."""
    _, files, labels = listing(self.root, self.name)
    i = self.indices[index]
    return (crop_resized(files[i], self.channels, uniforms, size, scale, ratio, flip, draft),
            int(labels[i]))
