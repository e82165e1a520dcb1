"""TFDS datasets read through ``tfds.data_source``: random access to ArrayRecord files.

A TFDS dataset prepared in ArrayRecord format (``tfds build NAME --file_format=array_record``, see
docs/data.md) is read record by record, each process and Grain worker reading only the records it
needs; TensorFlow is not imported to read. A dataset prepared as TFRecord gets a one-line error
saying how to rebuild it.
"""

from __future__ import annotations

import importlib
from typing import Tuple

import numpy as np

from decay_jax.data import config
from decay_jax.data import latents


def tensorflow_datasets():
  """``tensorflow_datasets``, imported on first use (the other sources never need it)."""
  return importlib.import_module("tensorflow_datasets")


def builder(cfg):
  """The TFDS builder named by ``cfg.dataset`` (constructing it reads metadata only)."""
  tfds = tensorflow_datasets()
  try:
    return tfds.builder(cfg.dataset, data_dir=cfg.data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(
        f"dataset={cfg.dataset!r} is not allowed; choose {config.EMBEDDED_MNIST!r}, "
        f"'{config.NPZ_PREFIX}/abs/path.npz', '{config.IMAGEFOLDER_PREFIX}/dir', "
        f"'{latents.PREFIX}/dir' or a TFDS dataset name such as 'cifar10' or 'imagenet2012' "
        "(see tfds.list_builders())") from e


def check_split(tfds_builder, split, field: str) -> None:
  """Checks a split against the prepared split names; unprepared datasets accept any split."""
  if not isinstance(split, str) or not split:
    raise ValueError(f"{field}={split!r} is not allowed; it must be a TFDS split string")
  known = tfds_builder.info.splits
  if not known:
    return
  try:
    known[split]  # pylint: disable=pointless-statement
  except (KeyError, ValueError, AssertionError) as e:
    raise ValueError(f"{field}={split!r} is not allowed; {tfds_builder.name} has splits "
                     f"{', '.join(map(repr, sorted(known.keys())))}") from e


def image_channels(tfds_builder) -> int:
  """Channels of the dataset's ``image`` feature."""
  features = tfds_builder.info.features
  if "image" not in features or "label" not in features:
    raise ValueError(f"dataset={tfds_builder.name!r} is not allowed; it needs 'image' and "
                     f"'label' features, it has {sorted(features.keys())}")
  return int(features["image"].shape[-1])


def data_source(tfds_builder, split: str, field: str):
  """The random-access source of one split; one line if it is not prepared as ArrayRecord."""
  try:
    return tfds_builder.as_data_source(split=split)
  except NotImplementedError:
    formats = [str(f) for f in (tfds_builder.info.file_format,) if f] or ["tfrecord"]
    raise ValueError(
        f"dataset={tfds_builder.name!r} is not allowed; it is prepared as {formats[0]}, and "
        f"Grain reads ArrayRecord: rebuild it with `tfds build {tfds_builder.name} "
        "--file_format=array_record` (docs/data.md)") from None
  except (FileNotFoundError, AssertionError) as e:
    raise ValueError(f"{field}={split!r} is not allowed; {tfds_builder.name} is not prepared "
                     f"under data_dir ({type(e).__name__})") from None


class TfdsRecords:
  """``records[i] -> (uint8 (H, W, C), int label)`` of one TFDS split (pickles for Grain workers)."""

  def __init__(self, tfds_builder, split: str, field: str):
    """``tfds_builder``: from ``builder``; ``split`` has passed ``check_split``."""
    self.source = data_source(tfds_builder, split, field)

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index: int) -> Tuple[np.ndarray, int]:
    example = self.source[int(index)]
    return np.asarray(example["image"], np.uint8), int(example["label"])
