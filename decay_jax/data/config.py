"""The data config: its defaults and the checks of its fields (no image is read before these pass).

Field checks run once per distinct config: ``check_fields`` remembers (``validate.check_once``) the
type and value of the checked fields of every config that passed, so each entry point calls it and
only the first pays.

Everything is driven by one ``ml_collections.ConfigDict`` (start from ``default_data_config()``):

  ``dataset``: ``'embedded_mnist'`` (the MNIST subset shipped in ``decay_jax/data/embedded/``),
      ``'npz:/abs/path.npz'`` (any npz with uint8 NHWC ``x_train``/``y_train`` and optionally
      ``x_test``/``y_test``, ``class_names``), ``'imagefolder:/dir'`` (``dir/<split>/<class>/*``
      JPEG/PNG images of any size; the sorted class folder names are the labels, as torchvision's
      ``ImageFolder``), ``'latents:/dir'`` (pre-extracted latent shards, see
      ``decay_jax.data.latents``), or a TFDS dataset name such as ``'cifar10'`` or
      ``'imagenet2012'`` prepared in ArrayRecord format under ``data_dir`` (read through
      ``tfds.data_source``; see docs/data.md).
  ``train_split`` / ``eval_split``: ``'train'``, ``'test'`` (an image folder: the name of any of
      its split folders, e.g. ``'val'``); npz and image folders also take Python slices, e.g.
      ``'train[:8000]'`` / ``'train[8000:]'`` for an npz without a test set; TFDS sources take any
      TFDS split string.
  ``image_size``: output resolution ``S``.
  ``crop_scale``, ``crop_ratio``, ``flip``: the MAE pretraining augmentation, i.e. torchvision's
      ``RandomResizedCrop(S, scale, ratio, BICUBIC)`` then ``RandomHorizontalFlip(0.5)``.
  ``normalize``: ``'imagenet'`` (``(x - mean) / std`` with the ImageNet statistics; 3 channels
      only), ``'half'`` (``(x - 0.5) / 0.5``) or ``'none'`` (``x`` in ``[0, 1]``), where
      ``x = pixel / 255``.
  ``eval_resize``: ``'resize_crop'`` (MAE evaluation: bicubic resize of the shorter side to
      ``int(S / 0.875)``, then a centre crop ``S``) or ``'resize'`` (bicubic resize straight to
      ``S x S``, for tiny images) or ``'adm'`` (ADM's ``center_crop_arr``: BOX halvings, bicubic
      resize of the shorter side to ``S``, centre crop; the crop of ADM's reference batches).
  ``channels``: None (the source's own: 1 for a folder of greyscale images, else 3) or 1 / 3 to
      convert every decoded image of an image folder to that many channels.
  ``jpeg_draft``: image folders decode a training JPEG at 1/2, 1/4 or 1/8 scale when the crop
      still spans ``image_size`` reduced pixels (``decay_jax.data.folder.crop_resized``; a slight
      pixel difference); False decodes every image at full scale.
  ``num_workers``: Grain worker processes that read, decode and augment (0 = in this process).
  ``num_threads``: threads per process preparing batches concurrently; ``prefetch``: batches
      prepared ahead per process. None of the three changes a single value of the stream.
  ``data_dir`` (TFDS only), ``max_eval_examples`` (None = the whole split).
  ``on_device``: False (the host path above) or True: the train split of an npz or
      ``embedded_mnist`` source is kept on the devices and each batch is gathered, cropped and
      flipped there in one jitted program (``decay_jax.data.resident``; same order and rule as the
      host path, ``jax.random`` draws instead of numpy's); not with ``rand_augment``.
"""

from __future__ import annotations

import re

import os
from typing import Optional

import ml_collections

from decay_jax import validate

EMBEDDED_MNIST = "embedded_mnist"
NPZ_PREFIX = "npz:"
IMAGEFOLDER_PREFIX = "imagefolder:"
NORMALIZE = ("imagenet", "half", "none")
EVAL_RESIZE = ("resize_crop", "resize", "adm")
# The file behind dataset='embedded_mnist' (decay_jax.data.embedded builds it and re-exports these;
# they live here so that reading the file never imports that command-line module).
EMBEDDED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "embedded")
EMBEDDED_NPZ = os.path.join(EMBEDDED_DIR, "mnist_10k.npz")

# The fields check_fields reads (its memory, ``validate.check_once``, is keyed by their values).
_CHECKED_FIELDS = ("image_size", "crop_scale", "crop_ratio", "flip", "normalize", "eval_resize",
                   "max_eval_examples", "dataset", "channels", "num_workers", "num_threads",
                   "prefetch", "rand_augment", "on_device", "jpeg_draft")
# One token of timm's RandAugment string after 'rand': m<magnitude>, mstd<std>, n<ops>, inc<0|1>.
_RAND_AUGMENT_TOKEN = re.compile(r"(mstd|m|n|inc)(\d+(?:\.\d+)?)")


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
      # Typed references, not bare None: a None field cannot be overridden from the command line.
      "data_dir": ml_collections.FieldReference(None, field_type=str),
      "channels": ml_collections.FieldReference(None, field_type=int),
      "num_workers": 0,
      "num_threads": 2,
      "prefetch": 2,
      "max_eval_examples": ml_collections.FieldReference(None, field_type=int),
      "eval_resize": "resize_crop",
      # '' (none) or timm's RandAugment string, e.g. fine-tuning's 'rand-m9-mstd0.5-inc1'; applied
      # after the crop and flip (data/randaugment.py).
      "rand_augment": "",
      # True: the train split lives on the devices, batches are built there (data/resident.py).
      "on_device": False,
      # Image folders: decode a training JPEG at 1/2, 1/4 or 1/8 scale when the crop still spans
      # image_size pixels (data/folder.py); False: always at full scale.
      "jpeg_draft": True,
  })


def _key(cfg) -> Optional[tuple]:
  """What the checks depend on: the type and value of every checked field (None: not cacheable)."""
  try:
    return ("data",) + tuple((field, validate.frozen(getattr(cfg, field)))
                             for field in _CHECKED_FIELDS)
  except (AttributeError, KeyError, TypeError):
    return None  # A missing field or an unhashable value: check (and fail) every time.


def _check_fields_uncached(cfg: ml_collections.ConfigDict) -> None:
  validate.check_int("image_size", cfg.image_size, 1)
  validate.check_pair("crop_scale", cfg.crop_scale, at_most_one=True)
  validate.check_pair("crop_ratio", cfg.crop_ratio, at_most_one=False)
  validate.check_flag("flip", cfg.flip)
  validate.check_choice("normalize", cfg.normalize, NORMALIZE)
  validate.check_choice("eval_resize", cfg.eval_resize, EVAL_RESIZE)
  validate.check_int("num_workers", cfg.num_workers, 0)
  validate.check_int("num_threads", cfg.num_threads, 1)
  validate.check_int("prefetch", cfg.prefetch, 1)
  if cfg.channels is not None and cfg.channels not in (1, 3):
    raise validate.not_allowed("channels", cfg.channels, "it must be None, 1 or 3")
  if cfg.max_eval_examples is not None and not (
      validate.is_int(cfg.max_eval_examples) and cfg.max_eval_examples >= 1):
    raise validate.not_allowed("max_eval_examples", cfg.max_eval_examples,
                               "it must be None or an integer >= 1")
  if not isinstance(cfg.dataset, str):
    raise validate.not_allowed("dataset", cfg.dataset, "it must be a string")
  rand_augment_params(cfg.get("rand_augment", ""))
  validate.check_flag("on_device", cfg.get("on_device", False))
  validate.check_flag("jpeg_draft", cfg.get("jpeg_draft", True))


def rand_augment_params(spec: str) -> Optional[dict]:
  """``{'num_ops', 'magnitude', 'magnitude_std'}`` of a RandAugment string; None for ''."""
  if not spec:
    return None
  tokens = spec.split("-") if isinstance(spec, str) else []
  found = [_RAND_AUGMENT_TOKEN.fullmatch(t) for t in tokens[1:]]
  parts = {m.group(1): m.group(2) for m in found if m}
  if (tokens[:1] != ["rand"] or not all(found) or parts.get("inc") != "1" or "m" not in parts
      or not parts.get("n", "2").isdigit()):
    raise validate.not_allowed("rand_augment", spec, "give '' or timm's 'rand-m<magnitude>"
                               "[-mstd<std>][-n<ops>]-inc1', e.g. 'rand-m9-mstd0.5-inc1'")
  return {"num_ops": int(parts.get("n", 2)), "magnitude": float(parts["m"]),
          "magnitude_std": float(parts.get("mstd", 0.0))}


def check_fields(cfg: ml_collections.ConfigDict) -> None:
  """Checks the fields that need no I/O, once per distinct config (see the module docstring)."""
  validate.check_once(lambda: _check_fields_uncached(cfg), _key(cfg))


def check_batch(global_batch, seed, start_step, process_index, process_count) -> None:
  """Checks the arguments of ``make_train_iterator`` (they change per call, so no cache)."""
  validate.check_int("process_count", process_count, 1)
  if not (validate.is_int(process_index) and 0 <= process_index < process_count):
    raise validate.not_allowed("process_index", process_index,
                               f"it must be an integer in [0, {process_count})")
  if not (validate.is_int(global_batch) and global_batch >= 1
          and global_batch % process_count == 0):
    raise validate.not_allowed("global_batch", global_batch,
                               f"it must be a positive multiple of process_count={process_count}")
  if not validate.is_int(seed):
    raise validate.not_allowed("seed", seed, "it must be an integer")
  validate.check_int("start_step", start_step, 0)


def check_channels(cfg: ml_collections.ConfigDict, channels: int) -> None:
  """``normalize='imagenet'`` needs 3 channels."""
  if cfg.normalize == "imagenet" and channels != 3:
    raise ValueError(f"normalize='imagenet' is not allowed for {channels}-channel images; "
                     "choose 'half' or 'none'")
