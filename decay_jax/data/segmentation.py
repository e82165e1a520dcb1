"""Images with per-pixel class masks for the unsupervised segmentation evaluator.

Two sources, both returning ``{"image": (N, S, S, C) uint8, "mask": (N, S, S) uint8, "names": [N]}``
at the model's input size ``S`` and channel count ``C`` (mask values are class ids, ``IGNORE`` =
255 is ignored):

``read_folder(root, ...)``: ``root/images/NAME.jpg|jpeg|png`` with ``root/masks/NAME.png`` (one
  channel, uint8 class ids, 255 = ignore), in sorted name order. Each image and its mask must have
  the same size; both are resized so their shorter side is ``S`` (image bilinear, mask nearest) and
  centre-cropped to ``S x S``. docs/segmentation.md says how to lay out COCO-Stuff-27 and VOC2012.
``synthetic(n, ...)``: ``n`` images generated from ``seed`` alone: a noisy dark background (class
  0) with one or two rectangles of textured foreground classes (1 solid bright, 2 horizontal
  stripes, 3 checkerboard, 4 vertical stripes, ...) aligned to the patch grid and never touching
  the border, so the masks are exact at patch resolution.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import numpy as np

from decay_jax import validate

IGNORE = 255
IMAGE_EXTS = (".jpg", ".jpeg", ".png")
SYNTHETIC = "synthetic"
MAX_SYNTHETIC_CLASSES = 6


def _texture(cls: int, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
  """``(h, w)`` float pixels in [0, 1] of foreground class ``cls`` (>= 1)."""
  yy, xx = np.mgrid[0:h, 0:w]
  base = {1: np.ones((h, w)), 2: (yy // 2) % 2, 3: ((yy // 2) + (xx // 2)) % 2,
          4: (xx // 2) % 2, 5: 0.5 * np.ones((h, w))}[cls]
  return 0.25 + 0.7 * base + rng.normal(0, 0.03, (h, w))


def synthetic(n: int, image_size: int = 28, channels: int = 1, patch: int = 4, classes: int = 4,
              seed: int = 0, max_shapes: int = 2) -> Dict[str, object]:
  """``n`` images of 1 to ``max_shapes`` textured rectangles on noise with exact masks (module
  docstring); deterministic in ``seed``. ``classes`` counts the background (class 0)."""
  validate.check_int("seg_images", n)
  validate.check_int("seg_classes", classes, 2, MAX_SYNTHETIC_CLASSES)
  grid = image_size // patch
  if image_size % patch or grid < 5:
    raise validate.not_allowed("image_size", image_size, f"the synthetic set needs a multiple of "
                               f"the patch size {patch} with at least 5 patches a side")
  rng = np.random.default_rng(seed)
  images = np.zeros((n, image_size, image_size), np.float64)
  masks = np.zeros((n, image_size, image_size), np.uint8)
  for i in range(n):
    images[i] = rng.normal(0.1, 0.05, (image_size, image_size))
    for cls in rng.choice(np.arange(1, classes), size=min(classes - 1, rng.integers(1, max_shapes + 1)),
                          replace=False):
      h, w = rng.integers(2, min(4, grid - 2) + 1, size=2)
      r, c = rng.integers(1, grid - 1 - h + 1), rng.integers(1, grid - 1 - w + 1)
      ys, xs = slice(r * patch, (r + h) * patch), slice(c * patch, (c + w) * patch)
      images[i, ys, xs] = _texture(int(cls), h * patch, w * patch, rng)
      masks[i, ys, xs] = cls
  pixels = np.clip(np.round(images * 255), 0, 255).astype(np.uint8)[..., None]
  return {"image": np.repeat(pixels, channels, axis=-1), "mask": masks,
          "names": [f"synthetic_{i:05d}" for i in range(n)]}


def _square(img, size: int, resample):
  """Shorter side to ``size`` (PIL ``resample``), then the centre ``size x size``."""
  w, h = img.size
  scale = size / min(w, h)
  nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
  img = img.resize((nw, nh), resample)
  left, top = (nw - size) // 2, (nh - size) // 2
  return img.crop((left, top, left + size, top + size))


def read_folder(root: str, image_size: int, channels: int, limit: int = 0,
                num_classes: Optional[int] = None, ignore: int = IGNORE) -> Dict[str, object]:
  """The first ``limit`` (0: all) images of ``root`` with their masks (module docstring).

  Raises:
    ValueError: one line naming the folder, file or field: a missing folder or mask, a mask whose
      size differs from its image's, a mask value that is neither a class (< ``num_classes``) nor
      ``ignore``, or ``ignore`` inside the classes.
  """
  from PIL import Image
  image_dir, mask_dir = os.path.join(root, "images"), os.path.join(root, "masks")
  for d in (image_dir, mask_dir):
    if not os.path.isdir(d):
      raise validate.InputError(f"--seg_data {root}: no folder {d}; expected images/NAME.jpg|png "
                                "and masks/NAME.png (docs/segmentation.md)")
  if num_classes is not None and 0 <= ignore < num_classes:
    raise validate.not_allowed("seg_ignore", ignore, f"it is one of the {num_classes} classes "
                               f"0..{num_classes - 1}; use a label outside them (255)")
  files = sorted(f for f in os.listdir(image_dir) if f.lower().endswith(IMAGE_EXTS))
  if not files:
    raise validate.InputError(f"--seg_data {root}: {image_dir} holds no .jpg or .png image")
  files = files[:limit] if limit else files
  images: List[np.ndarray] = []
  masks: List[np.ndarray] = []
  for f in files:
    name = os.path.splitext(f)[0]
    image_path, mask_path = os.path.join(image_dir, f), os.path.join(mask_dir, name + ".png")
    if not os.path.isfile(mask_path):
      raise validate.InputError(f"{mask_path}: missing; every image needs its mask "
                                f"masks/NAME.png (image {image_path})")
    img, mask = Image.open(image_path), Image.open(mask_path)
    if img.size != mask.size:
      raise validate.InputError(f"{mask_path}: mask size {mask.size} differs from its image "
                                f"{image_path} {img.size}; masks must match their images")
    if mask.mode not in ("L", "P"):
      raise validate.InputError(f"{mask_path}: mode {mask.mode}; expected a one-channel uint8 "
                                "PNG of class ids (mode L or P)")
    values = np.unique(np.asarray(mask))
    if num_classes is not None:
      bad = [int(v) for v in values if v >= num_classes and v != ignore]
      if bad:
        raise validate.InputError(f"{mask_path}: label {bad[0]} is neither a class "
                                  f"(0..{num_classes - 1}, --seg_classes) nor the ignore label "
                                  f"{ignore} (--seg_ignore)")
    img = _square(img.convert("L" if channels == 1 else "RGB"), image_size, Image.BILINEAR)
    arr = np.asarray(img, np.uint8)
    images.append(arr[..., None] if arr.ndim == 2 else arr)
    masks.append(np.asarray(_square(mask, image_size, Image.NEAREST), np.uint8))
  return {"image": np.stack(images), "mask": np.stack(masks),
          "names": [os.path.splitext(f)[0] for f in files]}
