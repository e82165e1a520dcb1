"""Pre-extracted latent shards for latent-space SiT training (``dataset='latents:/dir'``).

Format (written by the latent-extraction tool, or by ``write_shard`` below):

    DIR/{split}_latents_{i:05d}.npy   float16 or float32, (n_i, H, W, C) or (n_i, 2, H, W, C)
    DIR/{split}_labels_{i:05d}.npy    int32/int64, (n_i,)
    DIR/meta.json                     optional: {"scale": 0.18215, "vae": "...", ...}
    DIR/{split}_repa_target_{I}_{i:05d}.npy   optional: REPA's targets of each image, (n_i, T, D)
                                      or (n_i, 2, T, D) as the latents (``--repa_encoder`` of the
                                      extraction tool); delivered as ``repa_target_I``

Latents are stored already multiplied by the VAE scale (0.18215 for sd-vae-ft-ema), as the official
SiT trains on ``vae.encode(x).latent_dist.sample() * 0.18215``. A 5-D array holds two versions of
every image, the original and its horizontal flip (the official training flips images before the
VAE); each time an example is drawn one version is chosen at random. Shards are memory-mapped, so
ImageNet-size splits need no RAM to open, and any number of shards may be appended (extraction
can resume). Order and flips are a pure function of (seed, global position) and the stream runs
through the same Grain loader as images (``decay_jax.data.loader``): resuming at a step reproduces
the uninterrupted stream exactly, as for every other source.
"""

from __future__ import annotations

import re
from typing import Dict, List, Tuple

import numpy as np

from decay_jax import paths
from decay_jax.data import augment

PREFIX = "latents:"
_SHARD_RE = re.compile(r"^(?P<split>[a-z]+)_latents_(?P<idx>\d{5})\.npy$")
TARGET = "repa_target_{}"  # the batch key (and file infix) of REPA's stored target I


def path_of(dataset: str):
  return dataset[len(PREFIX):] if dataset.startswith(PREFIX) else None


class Split:
  """A virtual concatenation of the memory-mapped shards of one split."""

  def __init__(self, directory: str, split: str):
    root = paths.resolve(directory)
    if not root.is_dir():
      raise ValueError(f"dataset='{PREFIX}{directory}' is not allowed; the directory does not exist")
    names = sorted(p.name for p in root.iterdir())
    files = [str(root / n) for n in names
             if (m := _SHARD_RE.match(n)) and m.group("split") == split]
    if not files:
      found = sorted({m.group("split") for n in names if (m := _SHARD_RE.match(n))})
      raise ValueError(f"split={split!r} is not allowed; {directory} has shards for {found}")
    # Local shards are memory-mapped (a latent dataset may exceed host memory); shards on an
    # object store are read whole.
    self.latents = [paths.load_numpy(f, mmap=True) for f in files]
    self.labels = [paths.load_numpy(f.replace("_latents_", "_labels_")) for f in files]
    for f, x, y in zip(files, self.latents, self.labels):
      if x.ndim not in (4, 5) or len(x) != len(y):
        raise ValueError(f"{f}: expected (n, H, W, C) or (n, 2, H, W, C) latents and n labels, "
                         f"got {x.shape} and {y.shape}")
    self.offsets = np.cumsum([0] + [len(y) for y in self.labels])
    self.flipped = self.latents[0].ndim == 5
    self.shape = self.latents[0].shape[-3:]
    self.targets = []  # per stored REPA target: its shards, (n, [2,] T, D)
    while True:
      infix = "_" + TARGET.format(len(self.targets)) + "_"
      found = [f.replace("_latents_", infix) for f in files]
      have = [paths.exists(f) for f in found]
      if not any(have):
        break
      if not all(have):
        missing = found[have.index(False)]
        raise ValueError(f"{missing} is missing: every shard of split {split!r} needs its REPA "
                         "targets, or none (rerun the extraction with --repa_encoder)")
      shards = [paths.load_numpy(f, mmap=True) for f in found]
      for f, t, y in zip(found, shards, self.labels):
        if t.ndim != (4 if self.flipped else 3) or len(t) != len(y):
          raise ValueError(f"{f}: expected {'(n, 2, T, D)' if self.flipped else '(n, T, D)'} "
                           f"targets for {len(y)} latents, got {t.shape}")
      self.targets.append(shards)

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def locate(self, indices):
    """``(shard, row)`` of global rows ``indices`` (an int, or an array: arrays of both)."""
    shard = np.searchsorted(self.offsets, indices, side="right") - 1
    return shard, indices - self.offsets[shard]

  def gather(self, indices: np.ndarray, versions: np.ndarray) -> Dict[str, np.ndarray]:
    """Rows ``indices`` (global), using version ``versions`` (0 original, 1 flipped) if present."""
    shard, row = self.locate(indices)
    out = np.empty((len(indices),) + self.shape, np.float32)
    labels = np.empty((len(indices),), np.int32)
    for s in np.unique(shard):
      rows = np.nonzero(shard == s)[0]
      local = row[rows]
      order = np.argsort(local)  # sorted reads are much faster on memory-mapped files
      x = self.latents[s][local[order]]
      if self.flipped:
        x = x[np.arange(len(order)), versions[rows][order]]
      out[rows[order]] = x
      labels[rows[order]] = self.labels[s][local[order]]
    return {"image": out, "label": labels}


def _labels(split: Split) -> np.ndarray:
  return np.concatenate(split.labels)


def dataset_info(data_cfg) -> dict:
  split = Split(path_of(data_cfg.dataset), data_cfg.train_split)
  if split.shape[0] != data_cfg.image_size:
    raise ValueError(f"image_size={data_cfg.image_size} is not allowed; the latents are "
                     f"{split.shape[0]}x{split.shape[1]} (set data.image_size={split.shape[0]})")
  return {"num_train": len(split), "num_classes": int(_labels(split).max()) + 1,
          "channels": int(split.shape[-1]), "image_size": int(split.shape[0])}


# SeedSequence streams of the latent order and of the choice between original and flipped.
ORDER_STREAM, FLIP_STREAM = 7, 8


class LatentRecords:
  """``records[i] -> (float (H, W, C) or (2, H, W, C), int label)`` of one split; pickles as
  (directory, split) and maps the shards again in each Grain worker."""

  def __init__(self, directory: str, split: str):
    self.directory, self.split = directory, split
    self._split = Split(directory, split)

  def __getstate__(self):
    return {"directory": self.directory, "split": self.split, "_split": None}

  def _get(self) -> Split:
    if self._split is None:
      self._split = Split(self.directory, self.split)
    return self._split

  def __len__(self) -> int:
    return len(self._get())

  def __getitem__(self, index: int):
    return self.record(index, with_targets=False)[:2]

  def record(self, index: int, with_targets: bool = True
             ) -> Tuple[np.ndarray, int, List[np.ndarray]]:
    """``(latent, label, targets)`` of record ``index``: ``records[index]`` and REPA's stored
    targets (float32, ``(T, D)`` or ``(2, T, D)`` each; none without them, or not asked)."""
    split = self._get()
    shard, row = (int(v) for v in split.locate(int(index)))
    stored = split.targets if with_targets else []
    return (np.asarray(split.latents[shard][row], np.float32), int(split.labels[shard][row]),
            [np.asarray(t[shard][row], np.float32) for t in stored])


class LatentTrainExample:
  """``j -> {'image': float32 (H, W, C), 'label': int32}``: one latent, the flipped version with
  probability 1/2 when the shards hold both (and ``flip``); with stored REPA targets also
  ``repa_target_I`` float32 ``(T, D)`` of the same version."""

  def __init__(self, records: LatentRecords, layout, seed: int, flip: bool, order):
    self.records, self.layout, self.seed, self.flip, self.order = records, layout, seed, flip, order

  def __call__(self, j: int) -> dict:
    position = self.layout.position(j)
    index = self.order(position)
    latent, label, targets = self.records.record(index)
    version = None
    if latent.ndim == 4:
      version = 0
      if self.flip:
        version = int(np.random.default_rng(np.random.SeedSequence(
            [augment.seed_words(self.seed), FLIP_STREAM, position])).integers(0, 2))
      latent = latent[version]
    out = {"image": latent, "label": np.int32(label)}
    for i, t in enumerate(targets):
      out[TARGET.format(i)] = t if version is None else t[version]
    return out


def load_eval_arrays(data_cfg, split_name: str) -> Dict[str, np.ndarray]:
  split = Split(path_of(data_cfg.dataset), split_name)
  n = len(split) if data_cfg.max_eval_examples is None else min(len(split), data_cfg.max_eval_examples)
  idx = np.arange(n, dtype=np.int64)
  return split.gather(idx, np.zeros(n, np.int64))


def write_shard(directory: str, split: str, index: int, latents: np.ndarray,
                labels: np.ndarray, targets=()) -> List[str]:
  """Writes one shard in the format above (atomically: temporary name, then rename), REPA's
  ``targets`` (a list, target I at I) before the latents, whose file marks the shard complete."""
  written = []
  files = [("labels", np.asarray(labels))]
  files += [(TARGET.format(i), np.asarray(t)) for i, t in enumerate(targets)]
  for kind, arr in files + [("latents", np.asarray(latents))]:
    final = paths.resolve(directory) / f"{split}_{kind}_{index:05d}.npy"
    if paths.is_uri(final):  # an object appears whole when its upload ends
      paths.save_npy(final, arr)
    else:
      tmp = final.parent / (final.name + ".tmp.npy")
      paths.save_npy(tmp, arr)
      tmp.replace(final)
    written.append(str(final))
  return written
