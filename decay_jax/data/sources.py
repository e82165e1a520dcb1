"""Where examples come from: one ``Source`` per kind of ``dataset``, chosen by ``source_for``.

  ``'embedded_mnist'`` and ``'npz:/abs/path.npz'``: uint8 arrays (``decay_jax.data.npz``);
  ``'imagefolder:/dir'``: JPEG/PNG files in class folders (``decay_jax.data.folder``);
  ``'latents:/dir'``: pre-extracted latent shards (``decay_jax.data.latents``);
  anything else: a TFDS dataset prepared as ArrayRecord (``decay_jax.data.tfds_records``).

Every source gives random-access records, and all of them run through the one Grain loader
(``decay_jax.data.loader``) and the one augmentation (``decay_jax.data.augment``), so every source
resumes exactly. Each source has ``info()``, ``train_iterator(...)``, ``eval_arrays(split,
field)`` and ``eval_stream(split, field)``; constructing one checks the config fields and whatever
the split-independent I/O can check, and each method checks the splits and channels it uses before
reading a pixel.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import ml_collections
import numpy as np

from decay_jax.data import config
from decay_jax.data import folder
from decay_jax.data import latents
from decay_jax.data import loader
from decay_jax.data import npz
from decay_jax.data import tfds_records


class Source:
  """The interface of every source; ``cfg`` has passed ``config.check_fields``."""

  def __init__(self, cfg: ml_collections.ConfigDict):
    self.cfg = cfg
    self.spec = loader.AugmentSpec.of(cfg)
    self.parallel = loader.Parallelism.of(cfg)

  def info(self) -> dict:
    """``{'num_train', 'num_classes', 'channels', 'image_size'}``; see ``pipeline.dataset_info``."""
    raise NotImplementedError

  def records(self, split: str, field: str):
    """The random-access records of ``split`` (``field`` names it in errors)."""
    raise NotImplementedError

  def train_example(self, records, layout: loader.Layout, seed: int):
    """``j -> example`` of the training stream (images: MAE's crop and flip)."""
    return loader.ImageTrainExample(records, layout, seed, self.spec)

  def train_iterator(self, global_batch: int, seed: int, start_step: int, process_index: int,
                     process_count: int, state: Optional[dict] = None) -> loader.TrainStream:
    """See ``pipeline.make_train_iterator``; the arguments have passed ``config.check_batch``."""
    records = self.records(self.cfg.train_split, "train_split")
    name = f"{self.cfg.dataset}:{self.cfg.train_split}"
    layout = loader.Layout(global_batch, process_index, process_count, start_step)
    saved = loader.resume_layout(state, layout, seed, self.parallel, name)
    stream = loader.TrainStream(self.train_example(records, saved or layout, seed), saved or layout,
                                seed, self.parallel, name)
    if saved is not None:
      stream.restore(state)
    return stream

  def _eval_count(self, records) -> int:
    n = len(records)
    return n if self.cfg.max_eval_examples is None else min(n, self.cfg.max_eval_examples)

  def eval_arrays(self, split: str, field: str) -> Dict[str, np.ndarray]:
    """See ``pipeline.load_eval_arrays``; ``field`` names ``split`` in error messages."""
    return loader.gather(self.eval_stream(split, field)[1])

  def eval_stream(self, split: str, field: str) -> Tuple[int, Iterator[Dict[str, np.ndarray]]]:
    """See ``pipeline.eval_stream``."""
    records = self.records(split, field)
    n = self._eval_count(records)
    return n, loader.eval_stream(records, self.spec, n, self.parallel,
                                 source=f"{self.cfg.dataset}:{split}")


class NpzSource(Source):
  """``dataset='embedded_mnist'`` or ``'npz:/abs/path.npz'``: uint8 arrays in host memory."""

  def __init__(self, cfg: ml_collections.ConfigDict):
    super().__init__(cfg)
    self.path = npz.npz_path(cfg.dataset)
    self.header = npz.header(self.path, cfg.dataset)
    self.has_test = "x_test" in self.header and "y_test" in self.header
    self.channels = self.header["x_train"][0][-1]
    config.check_channels(cfg, self.channels)

  def records(self, split, field):
    return npz.NpzRecords(self.path, split, field, self.has_test)

  def info(self) -> dict:
    npz.NpzRecords(self.path, self.cfg.eval_split, "eval_split", self.has_test)
    train = self.records(self.cfg.train_split, "train_split")
    return {"num_train": len(train), "num_classes": npz.num_classes(self.path),
            "channels": int(self.channels), "image_size": int(self.cfg.image_size)}


class FolderSource(Source):
  """``dataset='imagefolder:/dir'``: ``dir/<split>/<class>/<image>``, decoded on read."""

  def __init__(self, cfg: ml_collections.ConfigDict):
    super().__init__(cfg)
    self.root = folder.root_of(cfg.dataset)
    folder.split_names(self.root, cfg.dataset)
    self._channels: Optional[int] = cfg.channels

  def channels(self) -> int:
    if self._channels is None:
      train = folder.FolderRecords(self.root, self.cfg.train_split, "train_split", 3)
      self._channels = folder.native_channels(train.path(0))
    config.check_channels(self.cfg, self._channels)
    return self._channels

  def records(self, split, field):
    return folder.FolderRecords(self.root, split, field, self.channels())

  def info(self) -> dict:
    train = self.records(self.cfg.train_split, "train_split")
    evaluation = self.records(self.cfg.eval_split, "eval_split")
    if evaluation.class_names() != train.class_names():
      raise ValueError(
          f"eval_split={self.cfg.eval_split!r} is not allowed; its class folders differ from "
          f"train_split={self.cfg.train_split!r}'s ({len(evaluation.class_names())} vs "
          f"{len(train.class_names())} classes), so their labels would not agree")
    return {"num_train": len(train), "num_classes": len(train.class_names()),
            "channels": self.channels(), "image_size": int(self.cfg.image_size)}


class LatentSource(Source):
  """``dataset='latents:/dir'``: memory-mapped latent shards (no augmentation but the flip)."""

  def info(self) -> dict:
    return latents.dataset_info(self.cfg)

  def records(self, split, field):
    del field  # latents name the split 'split' in their own messages
    return latents.LatentRecords(latents.path_of(self.cfg.dataset), split)

  def train_example(self, records, layout, seed):
    order = loader.EpochOrder(seed, len(records), latents.ORDER_STREAM)
    return latents.LatentTrainExample(records, layout, seed, self.spec.flip, order)

  def eval_arrays(self, split, field):
    del field
    return latents.load_eval_arrays(self.cfg, split)

  def eval_stream(self, split, field):
    arrays = self.eval_arrays(split, field)  # memory-mapped shards: the gather is the read
    return len(arrays["label"]), iter([arrays])


class TfdsSource(Source):
  """Any other ``dataset``: a TFDS dataset in ArrayRecord format, through ``tfds.data_source``."""

  def __init__(self, cfg: ml_collections.ConfigDict):
    super().__init__(cfg)
    self.builder = tfds_records.builder(cfg)

  def _check(self, *splits: Tuple[str, str]) -> int:
    """Checks ``(split, field)`` pairs, then the channel count (which it returns)."""
    for split, field in splits:
      tfds_records.check_split(self.builder, split, field)
    channels = tfds_records.image_channels(self.builder)
    config.check_channels(self.cfg, channels)
    return channels

  def records(self, split, field):
    self._check((split, field))
    return tfds_records.TfdsRecords(self.builder, split, field)

  def info(self) -> dict:
    channels = self._check((self.cfg.train_split, "train_split"),
                           (self.cfg.eval_split, "eval_split"))
    splits = self.builder.info.splits
    num_train = int(splits[self.cfg.train_split].num_examples) if splits else None
    return {"num_train": num_train,
            "num_classes": int(self.builder.info.features["label"].num_classes),
            "channels": int(channels), "image_size": int(self.cfg.image_size)}


def source_for(data_cfg: ml_collections.ConfigDict) -> Source:
  """The source of ``data_cfg.dataset``, after ``config.check_fields`` (cached per config)."""
  config.check_fields(data_cfg)
  dataset = data_cfg.dataset
  if latents.path_of(dataset) is not None:
    return LatentSource(data_cfg)
  if folder.root_of(dataset) is not None:
    return FolderSource(data_cfg)
  if dataset == config.EMBEDDED_MNIST or dataset.startswith(config.NPZ_PREFIX):
    return NpzSource(data_cfg)
  return TfdsSource(data_cfg)
