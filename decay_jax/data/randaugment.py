"""RandAugment ``rand-m9-mstd0.5-inc1`` as timm applies it in upstream MAE fine-tuning
(docs/finetune.md, "Augmentation"), on PIL images with Pillow's own operations.

Per image: 2 ops drawn uniformly with replacement from the 15 of timm's "increasing" list; each
runs with probability 0.5 and then draws its magnitude ``m = clip(N(9, 0.5), 0, 10)``; signed ops
then negate their argument with probability 0.5. Arguments at magnitude ``m``:

    Rotate ±30 m/10 degrees           Posterize 4 - int(4 m/10) bits    Solarize 256 - int(256 m/10)
    SolarizeAdd +int(110 m/10) < 128  Color/Contrast/Brightness/Sharpness 1 ± 0.9 m/10
    ShearX/Y ±0.3 m/10                TranslateX/YRel ±0.45 m/10 of the side

Geometric ops resample bicubically and fill with the dataset mean (``fill_color``). The draws come
from a ``numpy.random.Generator`` (per example, seeded by the pipeline), in timm's order; timm's
own streams (Python's ``random`` and numpy's global state) are not a parity target.
"""

from __future__ import annotations

from typing import Sequence, Tuple, Union

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing",
       "SolarizeIncreasing", "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing",
       "BrightnessIncreasing", "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel",
       "TranslateYRel")
SIGNED = ("Rotate", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing",
          "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
MAX_LEVEL = 10.0
Fill = Union[int, Tuple[int, ...]]


def fill_color(mean: Sequence[float]) -> Fill:
  """timm's ``img_mean``: per channel ``min(255, round(255 x mean))``; an int for one channel."""
  fill = tuple(min(255, int(round(255 * m))) for m in mean)
  return fill[0] if len(fill) == 1 else fill


def level_arg(name: str, magnitude: float, negate: bool = False):
  """The argument of op ``name`` at ``magnitude`` (``negate``: the sign of a signed op)."""
  level = magnitude / MAX_LEVEL
  sign = -1.0 if negate else 1.0
  if name == "Rotate":
    return sign * 30.0 * level
  if name == "PosterizeIncreasing":
    return 4 - int(4 * level)
  if name == "SolarizeIncreasing":
    return 256 - int(256 * level)
  if name == "SolarizeAdd":
    return int(110 * level)
  if name.endswith("Increasing"):  # Color, Contrast, Brightness, Sharpness
    return 1.0 + sign * 0.9 * level
  if name in ("ShearX", "ShearY"):
    return sign * 0.3 * level
  if name in ("TranslateXRel", "TranslateYRel"):
    return sign * 0.45 * level
  return None


def apply_op(img: Image.Image, name: str, arg, fill: Fill) -> Image.Image:
  """One op on a PIL image ('L' or 'RGB') with its argument (see ``level_arg``)."""
  geometric = dict(resample=Image.BICUBIC, fillcolor=fill)
  if name == "AutoContrast":
    return ImageOps.autocontrast(img)
  if name == "Equalize":
    return ImageOps.equalize(img)
  if name == "Invert":
    return ImageOps.invert(img)
  if name == "Rotate":
    return img.rotate(arg, **geometric)
  if name == "PosterizeIncreasing":  # 0 bits keep nothing: black (Pillow 13 refuses bits=0)
    if arg <= 0:
      return Image.new(img.mode, img.size, 0)
    return img if arg >= 8 else ImageOps.posterize(img, arg)
  if name == "SolarizeIncreasing":
    return ImageOps.solarize(img, arg)
  if name == "SolarizeAdd":
    lut = [min(255, i + arg) if i < 128 else i for i in range(256)]
    return img.point(lut * len(img.getbands()))
  if name == "ColorIncreasing":
    return ImageEnhance.Color(img).enhance(arg)
  if name == "ContrastIncreasing":
    return ImageEnhance.Contrast(img).enhance(arg)
  if name == "BrightnessIncreasing":
    return ImageEnhance.Brightness(img).enhance(arg)
  if name == "SharpnessIncreasing":
    return ImageEnhance.Sharpness(img).enhance(arg)
  # PIL's affine maps output (x, y) to input (a x + b y + c, d x + e y + f).
  if name == "ShearX":
    return img.transform(img.size, Image.AFFINE, (1, arg, 0, 0, 1, 0), **geometric)
  if name == "ShearY":
    return img.transform(img.size, Image.AFFINE, (1, 0, 0, arg, 1, 0), **geometric)
  if name == "TranslateXRel":
    return img.transform(img.size, Image.AFFINE, (1, 0, arg * img.size[0], 0, 1, 0), **geometric)
  if name == "TranslateYRel":
    return img.transform(img.size, Image.AFFINE, (1, 0, 0, 0, 1, arg * img.size[1]), **geometric)
  raise ValueError(f"RandAugment op {name!r} is not allowed; choose one of {', '.join(OPS)}")


def rand_augment(img: Image.Image, rng: np.random.Generator, fill: Fill, num_ops: int = 2,
                 magnitude: float = 9.0, magnitude_std: float = 0.5,
                 prob: float = 0.5) -> Image.Image:
  """``num_ops`` random ops (with replacement), each applied with probability ``prob``."""
  for k in rng.choice(len(OPS), num_ops, replace=True):
    name = OPS[int(k)]
    if rng.random() > prob:
      continue
    m = magnitude
    if magnitude_std > 0:
      m = rng.normal(magnitude, magnitude_std)
    m = min(MAX_LEVEL, max(0.0, m))
    negate = name in SIGNED and rng.random() > 0.5
    img = apply_op(img, name, level_arg(name, m, negate), fill)
  return img
