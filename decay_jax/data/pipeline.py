"""The input pipeline: the public face of ``decay_jax.data``.

``dataset_info``, ``make_train_iterator``, ``load_eval_arrays`` and ``eval_stream`` take one data
config (``default_data_config()``; the fields are documented in ``decay_jax.data.config``) and hand
the work to the source its ``dataset`` names (``decay_jax.data.sources``: the shipped MNIST subset, npz
files, image folders, TFDS datasets in ArrayRecord format, latent shards). All of them run through
one Grain loader (``decay_jax.data.loader``) and one augmentation (``decay_jax.data.augment``), and
every one resumes exactly: the stream is a pure function of (seed, step).

The other public names here (``normalization``, ``normalize_uint8``, ``crop_params``, the
constants) are re-exported from the modules that implement them.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import ml_collections
import numpy as np

from decay_jax.data import config
from decay_jax.data import resident
from decay_jax.data import sources
from decay_jax.data.augment import augment_batch
from decay_jax.data.augment import crop_params
from decay_jax.data.augment import EVAL_CROP_PCT
from decay_jax.data.augment import IMAGENET_MEAN
from decay_jax.data.augment import IMAGENET_STD
from decay_jax.data.augment import normalization
from decay_jax.data.augment import normalize_uint8
from decay_jax.data.augment import RRC_ATTEMPTS
from decay_jax.data.config import default_data_config
from decay_jax.data.config import EMBEDDED_MNIST
from decay_jax.data.config import EVAL_RESIZE
from decay_jax.data.config import NORMALIZE
from decay_jax.data.config import NPZ_PREFIX

__all__ = [
    "EMBEDDED_MNIST", "EVAL_CROP_PCT", "EVAL_RESIZE", "IMAGENET_MEAN", "IMAGENET_STD",
    "NORMALIZE", "NPZ_PREFIX", "RRC_ATTEMPTS", "augment_batch", "crop_params", "dataset_info",
    "default_data_config", "eval_stream", "load_eval_arrays", "make_train_iterator",
    "normalization", "normalize_uint8",
]


def dataset_info(data_cfg: ml_collections.ConfigDict) -> dict:
  """Static facts about the configured dataset.

  Args:
    data_cfg: the data config.

  Returns:
    ``{'num_train': int (examples in train_split, all processes together; None for a TFDS dataset
    whose split sizes are unknown), 'num_classes': int, 'channels': int, 'image_size': int (the
    output resolution)}``.
  """
  return sources.source_for(data_cfg).info()


def make_train_iterator(data_cfg: ml_collections.ConfigDict, global_batch: int, seed: int,
                        start_step: int = 0, process_index: int = 0, process_count: int = 1,
                        state: Optional[dict] = None,
                        mesh=None) -> Iterator[Dict[str, np.ndarray]]:
  """Infinite iterator of augmented training batches for this process.

  Args:
    data_cfg: the data config.
    global_batch: examples per step over all processes; a multiple of ``process_count``.
    seed: any Python int; fixes the order and the augmentation.
    start_step: first global step to produce.
    process_index: this process, in ``[0, process_count)``.
    process_count: number of processes sharing each global batch.
    state: what ``get_state()`` of an earlier stream returned at ``start_step`` (from a
      checkpoint); Grain restores its iterator from it when it describes this stream (same
      source, seed, batch layout and worker count), else the stream starts afresh at
      ``start_step``. Either way the batches are the same.
    mesh: the device mesh; needed (and used) only with ``data_cfg.on_device``.

  Returns:
    A ``loader.TrainStream``: an endless iterator of ``{'image': uint8 (L, S, S, C),
    'label': int32 (L,)}`` (numpy) with ``L = global_batch // process_count`` and
    ``S = image_size``, identical from ``start_step`` on to an uninterrupted stream's; it has
    ``get_state()``, ``restored``, ``next_step`` and ``close()``. With ``data_cfg.on_device``: a
    ``resident.ResidentStream`` of the same interface whose batches are the global ones,
    ``jax.Array``s ``(global_batch, S, S, C)`` split like ``sharding.batch_sharding(mesh)``.
  """
  config.check_fields(data_cfg)  # before the batch arguments; source_for then finds it cached
  config.check_batch(global_batch, seed, start_step, process_index, process_count)
  if data_cfg.get("on_device", False):
    resident.check_config(data_cfg, mesh)
    return resident.train_stream(sources.source_for(data_cfg), global_batch, seed, start_step,
                                 state, mesh)
  return sources.source_for(data_cfg).train_iterator(global_batch, seed, start_step,
                                                     process_index, process_count, state)


def load_eval_arrays(data_cfg: ml_collections.ConfigDict,
                     split: Optional[str] = None) -> Dict[str, np.ndarray]:
  """The first ``max_eval_examples`` examples of a split, resized without augmentation.

  Args:
    data_cfg: the data config.
    split: the split to read; None means ``data_cfg.eval_split``.

  Returns:
    ``{'image': uint8 (N, S, S, C), 'label': int32 (N,)}``: pixels, not normalised (consumers
    normalise them on the devices with ``normalization(data_cfg, C)``, see
    ``decay_jax.data.on_device``); a latent source gives float32 latents ``(N, h, w, c)``.
  """
  source = sources.source_for(data_cfg)
  if split is None:
    return source.eval_arrays(data_cfg.eval_split, "eval_split")
  return source.eval_arrays(split, "split")


def eval_stream(data_cfg: ml_collections.ConfigDict, split: str
                ) -> Tuple[int, Iterator[Dict[str, np.ndarray]]]:
  """``load_eval_arrays(data_cfg, split)`` in chunks: ``(n, chunks)``, the chunks
  ``{'image', 'label'}`` of the same first ``n`` examples in order, read as they are consumed
  (for inputs larger than host memory, e.g. a 50,000-image reference batch)."""
  return sources.source_for(data_cfg).eval_stream(split, "split")
