"""MAE's image preprocessing on the host (numpy + Pillow): the augmentation, the resizes, the
normalisation. One implementation for every source; ``decay_jax.data.loader`` applies it per record.

The augmentation of the example at global position ``g`` uses its own ``numpy`` Generator seeded
by ``SeedSequence([seed, 1, g])`` (``example_uniforms``), so it depends on nothing but the seed and
the position. Crops are resized with Pillow (bicubic, as torchvision on PIL images); sampling and
flips follow torchvision's ``RandomResizedCrop`` and ``RandomHorizontalFlip`` draw for draw.
"""

from __future__ import annotations

import math
from typing import Tuple

import ml_collections
import numpy as np
from PIL import Image

from decay_jax import validate
from decay_jax.data import config
from decay_jax.data import randaugment

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# MAE evaluation resizes the shorter side to 256 for a 224 crop: crop_pct = 224 / 256.
EVAL_CROP_PCT = 0.875
# torchvision RandomResizedCrop tries 10 (area, log-ratio) samples before its centre-crop fallback.
RRC_ATTEMPTS = 10
# The SeedSequence stream of the augmentation draws (the order uses stream 0, see loader.py).
_AUG_STREAM = 1
# Uniforms drawn per example: RRC_ATTEMPTS areas, RRC_ATTEMPTS log-ratios, top, left, flip.
NUM_UNIFORMS = 2 * RRC_ATTEMPTS + 3
_BICUBIC = Image.Resampling.BICUBIC


def seed_words(seed: int) -> int:
  """Maps any Python int seed to the non-negative 64-bit entropy SeedSequence accepts."""
  return int(seed) & ((1 << 64) - 1)


# ------------------------------------------------------------------------------------------------
# Normalisation.


def normalization(data_cfg, channels: int) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
  """``(mean, std)`` per channel of ``data_cfg.normalize``: images are ``(x/255 - mean) / std``."""
  validate.check_choice("normalize", data_cfg.normalize, config.NORMALIZE)
  if data_cfg.normalize == "imagenet":
    return IMAGENET_MEAN, IMAGENET_STD
  if data_cfg.normalize == "half":
    return (0.5,) * channels, (0.5,) * channels
  return (0.0,) * channels, (1.0,) * channels


def _normalize(images: np.ndarray, mode: str) -> np.ndarray:
  """``normalize_uint8`` for a mode that has already been checked."""
  x = images.astype(np.float32) / np.float32(255.0)
  if mode == "imagenet":
    x -= np.asarray(IMAGENET_MEAN, np.float32)
    x /= np.asarray(IMAGENET_STD, np.float32)
  elif mode == "half":
    x -= np.float32(0.5)
    x /= np.float32(0.5)
  return x


def normalize_uint8(images: np.ndarray, mode: str) -> np.ndarray:
  """ToTensor then Normalize: uint8 (..., C) pixels to float32 (..., C)."""
  validate.check_choice("normalize", mode, config.NORMALIZE)
  return _normalize(images, mode)


# ------------------------------------------------------------------------------------------------
# Resizing.


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


def center_crop_arr(pil_image: Image.Image, image_size: int) -> np.ndarray:
  """ADM's ``center_crop_arr`` (guided-diffusion ``image_datasets.py``, SiT and REPA ``train.py``):
  halve with a BOX filter while the short side is at least twice ``image_size``, BICUBIC resize of
  the short side to ``image_size`` (the long side rounded), centre crop with floor offsets.
  Returns uint8 ``(S, S)`` or ``(S, S, C)`` as the image's mode."""
  while min(*pil_image.size) >= 2 * image_size:
    pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
  scale = image_size / min(*pil_image.size)
  pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=_BICUBIC)
  arr = np.array(pil_image)
  crop_y = (arr.shape[0] - image_size) // 2
  crop_x = (arr.shape[1] - image_size) // 2
  return arr[crop_y:crop_y + image_size, crop_x:crop_x + image_size]


def eval_resize_one(image: np.ndarray, size: int, mode: str) -> np.ndarray:
  """uint8 (H, W, C) -> uint8 (size, size, C) by 'resize', MAE's 'resize_crop' or ADM's 'adm'
  (``center_crop_arr``: the crop of the SiT/ADM reference batches)."""
  if mode == "resize":
    return _pil_resize(image, size, size)
  if mode == "adm":
    return _from_pil_planes([center_crop_arr(p, size) for p in _to_pil_planes(image)],
                            image.shape[-1])
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


# ------------------------------------------------------------------------------------------------
# Per-example draws.


def example_rng(position: int, seed: int, stream: int) -> np.random.Generator:
  """A generator of one example's draws in ``stream``, from (seed, stream, global position)."""
  return np.random.default_rng([seed_words(seed), int(stream), int(position)])


def rand_augment_one(image: np.ndarray, normalize: str, params: dict,
                     rng: np.random.Generator) -> np.ndarray:
  """RandAugment (``randaugment.rand_augment`` with ``params``) of one uint8 (S, S, C) image; the
  geometric ops fill with the normalisation mean (timm's ``img_mean``)."""
  channels = image.shape[-1]
  mean, _ = normalization(ml_collections.ConfigDict({"normalize": normalize}), channels)
  planes = _to_pil_planes(image)
  if len(planes) > 1:  # neither grey nor RGB: one plane at a time, one draw for all
    raise ValueError(f"rand_augment needs 1 or 3 channels; the images have {channels}")
  out = randaugment.rand_augment(planes[0], rng, randaugment.fill_color(mean), **params)
  return _from_pil_planes([out], channels)


def example_uniforms(position: int, seed: int) -> np.ndarray:
  """The draws of one example: float64 (NUM_UNIFORMS,) in [0, 1), from (seed, global position)."""
  return np.random.default_rng([seed_words(seed), _AUG_STREAM, int(position)]).random(NUM_UNIFORMS)


# ------------------------------------------------------------------------------------------------
# RandomResizedCrop + RandomHorizontalFlip.


def _fallback_crop(height: int, width: int, ratio: Tuple[float, float]) -> Tuple[int, int]:
  """torchvision's centre-crop size when no sample fits: (h, w) clamped to the ratio range."""
  in_ratio = width / height
  if in_ratio < min(ratio):
    return int(round(width / min(ratio))), width
  if in_ratio > max(ratio):
    return height, int(round(height * max(ratio)))
  return height, width


def crop_params(uniforms: np.ndarray, height: int, width: int, scale: Tuple[float, float],
                ratio: Tuple[float, float], xp=np) -> Tuple[np.ndarray, ...]:
  """RandomResizedCrop boxes for a batch, as torchvision's ``get_params`` draws them.

  The one implementation of the rule: the host pipeline runs it in numpy, the device-resident
  stream (``decay_jax.data.resident``) in ``jax.numpy`` under x64, so equal uniforms give equal
  boxes on both paths.

  Args:
    uniforms: float64 (L, >= 2 * RRC_ATTEMPTS + 2) in [0, 1): per example, RRC_ATTEMPTS area
      draws, RRC_ATTEMPTS log-ratio draws, then the top and left offset draws.
    height: image height H.
    width: image width W.
    scale: (low, high) fraction of the image area.
    ratio: (low, high) width / height.
    xp: the array module, ``numpy`` or ``jax.numpy`` (with ``jax.enable_x64``: float64 formulas).

  Returns:
    ``(top, left, h, w)``, each int64 (L,): the first of the attempts whose box fits, placed
    uniformly; torchvision's centre crop where none fits.
  """
  k = RRC_ATTEMPTS
  area = float(height * width)
  target_area = area * (scale[0] + (scale[1] - scale[0]) * uniforms[:, :k])
  log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
  aspect = xp.exp(log_lo + (log_hi - log_lo) * uniforms[:, k:2 * k])
  # round() rounds half to even, exactly like the Python round() torchvision uses.
  w = xp.round(xp.sqrt(target_area * aspect)).astype(xp.int64)
  h = xp.round(xp.sqrt(target_area / aspect)).astype(xp.int64)
  fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
  first = xp.argmax(fits, axis=1)
  rows = xp.arange(uniforms.shape[0])
  any_fit = fits[rows, first]
  h, w = h[rows, first], w[rows, first]
  # torch.randint(0, H - h + 1) is uniform over the integers [0, H - h].
  top = xp.floor(uniforms[:, 2 * k] * (height - h + 1)).astype(xp.int64)
  left = xp.floor(uniforms[:, 2 * k + 1] * (width - w + 1)).astype(xp.int64)
  fb_h, fb_w = _fallback_crop(height, width, ratio)
  top = xp.where(any_fit, top, (height - fb_h) // 2)
  left = xp.where(any_fit, left, (width - fb_w) // 2)
  h, w = xp.where(any_fit, h, fb_h), xp.where(any_fit, w, fb_w)
  return top, left, h, w


def augment_batch(images: np.ndarray, uniforms: np.ndarray, size: int,
                  cfg: ml_collections.ConfigDict) -> np.ndarray:
  """RandomResizedCrop(size, BICUBIC) then RandomHorizontalFlip on uint8 images.

  Args:
    images: uint8 (L, H, W, C).
    uniforms: float64 (L, NUM_UNIFORMS) per-example draws in [0, 1); the last one decides the
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


# ------------------------------------------------------------------------------------------------
# RandomResizedCrop + flip on a PIL image that may have been decoded at reduced scale (image
# folders: decay_jax.data.folder.crop_resized). The box comes from crop_params, so its
# distribution is torchvision's whatever the decode scale.

# The JPEG DCT-domain reductions libjpeg offers through Pillow's ``Image.draft``, largest first.
DCT_FACTORS = (8, 4, 2)
_FLIP = Image.Transpose.FLIP_LEFT_RIGHT


def crop_box(uniforms: np.ndarray, height: int, width: int, scale: Tuple[float, float],
             ratio: Tuple[float, float]) -> Tuple[int, int, int, int]:
  """``(top, left, h, w)`` of one example: ``crop_params`` of its (NUM_UNIFORMS,) draws."""
  top, left, h, w = crop_params(np.asarray(uniforms)[None], height, width, scale, ratio)
  return int(top[0]), int(left[0]), int(h[0]), int(w[0])


def flips(uniforms: np.ndarray, enabled: bool) -> bool:
  """Whether an example is flipped: as ``augment_batch``, when its last draw is < 0.5."""
  return bool(enabled) and bool(uniforms[-1] < 0.5)


def dct_factor(h: int, w: int, size: int) -> int:
  """The largest DCT reduction (8, 4 or 2; 1: none) that leaves an ``h x w`` crop at least
  ``size`` pixels on both sides, so that the resize to ``size`` still only shrinks."""
  for factor in DCT_FACTORS:
    if min(h, w) >= factor * size:
      return factor
  return 1


def resized_crop_pil(image: Image.Image, box: Tuple[int, int, int, int], factor: int, size: int,
                     flip: bool, mode: str) -> Image.Image:
  """RandomResizedCrop's crop, bicubic resize to ``size x size`` and flip, in Pillow.

  Args:
    image: the decoded image, at full scale (``factor`` 1) or reduced ``factor`` times by the
      decoder (then its pixel ``(x, y)`` covers the full-scale pixels ``[f x, f x + f)``).
    box: ``(top, left, h, w)`` in full-scale pixels (``crop_box``).
    factor: 1, 2, 4 or 8.
    size: the output side S.
    flip: mirror the result left to right.
    mode: 'L' or 'RGB': converted to it (after the crop, which is pointwise-exact) only when the
      image's own mode differs.

  At ``factor`` 1 the integer box is cropped, then resized: torchvision's order and, pixel for
  pixel, ``augment_batch`` on the full decode. At ``factor`` > 1 the box, mapped to the reduced
  image, is fractional, and the reduced image is resized straight from that float box
  (``Image.resize(box=...)``): the filter then reads up to its support beyond the box edges
  instead of clamping at them. Measured against the full-decode path on the synthetic 448 px JPEGs
  of ``decay_jax.data.bench`` (300 crops each, RGB, the mean over the reduced ones), this float
  box is the closer choice: mean |difference| 0.44 (factor 2, S=112) and 0.70 (factors 2 and 4,
  S=64) grey levels, largest single difference 20 and 16; cropping the enclosing integer box and
  resizing its float sub-box gave 0.44 and 0.71, cropping the box rounded to reduced pixels (a
  shift of up to half an output pixel) 2.0 and 2.4.
  """
  top, left, h, w = box
  if factor == 1:
    if (left, top, left + w, top + h) != (0, 0) + image.size:  # (already cropped: no copy)
      image = image.crop((left, top, left + w, top + h))
    if image.mode != mode:
      image = image.convert(mode)
    if image.size != (size, size):  # as _pil_resize: a same-size resize is the identity
      image = image.resize((size, size), _BICUBIC)
  else:
    if image.mode != mode:
      image = image.convert(mode)
    image = image.resize((size, size), _BICUBIC, box=(left / factor, top / factor,
                                                      (left + w) / factor, (top + h) / factor))
  return image.transpose(_FLIP) if flip else image


def pil_to_uint8(image: Image.Image) -> np.ndarray:
  """A writable uint8 (H, W, C) array of an 'L' or 'RGB' image (one copy)."""
  pixels = np.array(image)  # np.asarray would be read-only (Pillow hands out bytes)
  return pixels[..., None] if pixels.ndim == 2 else pixels
