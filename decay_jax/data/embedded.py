"""The MNIST subset shipped inside the package, and the command that builds it.

``decay_jax/data/embedded/mnist_10k.npz`` holds the first 10,000 official MNIST training images
(``x_train`` uint8 ``(10000, 28, 28, 1)``, ``y_train`` int64 ``(10000,)``), the first 2,000 official
test images (``x_test`` uint8 ``(2000, 28, 28, 1)``, ``y_test`` int64 ``(2000,)``) and
``class_names`` (``'0'`` .. ``'9'``). It lets the README's commands and the tests run on a fresh
machine, where the development data folder does not exist. MNIST is by Yann LeCun and Corinna
Cortes, CC BY-SA 3.0 (see ``embedded/README.md``).

Rebuild it (and its README, which records the sha256) with::

    python -m decay_jax.data.embedded --source /work/shared/data/mnist_full.npz

The file is byte-reproducible: the zip members get a fixed timestamp, so rebuilding from the same
source gives the same sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import sys
import zipfile
from typing import Dict, Optional, Sequence

import numpy as np

from decay_jax.data import config

# The paths are defined in config (dataset='embedded_mnist' reads the file without importing this
# command-line module, so `python -m decay_jax.data.embedded` finds it not yet imported).
EMBEDDED_DIR = config.EMBEDDED_DIR
EMBEDDED_MNIST = config.EMBEDDED_NPZ
EMBEDDED_README = os.path.join(EMBEDDED_DIR, "README.md")
NUM_TRAIN = 10_000
NUM_TEST = 2_000
# Zip's earliest representable date: a fixed member timestamp makes the npz byte-reproducible.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)

_README_TEMPLATE = """\
# Embedded MNIST subset

`mnist_10k.npz` is a subset of the MNIST handwritten-digit dataset, shipped so that the package
runs on machines without any downloaded data (dataset name `embedded_mnist` in
`decay_jax.data.pipeline`).

- **Credit:** MNIST by Yann LeCun and Corinna Cortes (with Christopher J. C. Burges),
  http://yann.lecun.com/exdb/mnist/.
- **Licence:** Creative Commons Attribution-Share Alike 3.0 (CC BY-SA 3.0),
  https://creativecommons.org/licenses/by-sa/3.0/. This subset is redistributed under the same
  licence.
- **Which images:** the first {num_train:,} images of the official training set, in the official
  order (`x_train` uint8 {train_shape}, `y_train` int64), and the first {num_test:,} images of the
  official test set (`x_test` uint8 {test_shape}, `y_test` int64); `class_names` are
  `'0'`..`'9'`. Pixels and labels are unmodified (lossless).
- **Train class counts:** {train_counts}
- **Test class counts:** {test_counts}
- **File:** {size:,} bytes, written with `np.savez_compressed` (zip members re-stamped with a
  fixed date so the file is byte-reproducible).
- **sha256:** `{sha256}`

Rebuilt with `python -m decay_jax.data.embedded --source /path/to/mnist_full.npz`, where
`mnist_full.npz` holds the full official MNIST (`x_train` (60000,28,28,1), `y_train`, `x_test`
(10000,28,28,1), `y_test`).
"""


def sha256_file(path: str) -> str:
  """Hex sha256 of a file's bytes."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def readme_sha256(readme_path: str = EMBEDDED_README) -> Optional[str]:
  """The sha256 recorded in the embedded README (the line ``- **sha256:** `<hex>` ``), or None."""
  with open(readme_path, encoding="utf-8") as f:
    for line in f:
      if line.startswith("- **sha256:**"):
        return line.split("`")[1]
  return None


def load_embedded_mnist() -> Dict[str, np.ndarray]:
  """Loads the shipped subset.

  Returns:
    ``{'x_train': uint8 (10000, 28, 28, 1), 'y_train': int64 (10000,), 'x_test': uint8
    (2000, 28, 28, 1), 'y_test': int64 (2000,), 'class_names': str (10,)}``.
  """
  with np.load(EMBEDDED_MNIST) as d:
    return {k: d[k] for k in d.files}


def _savez_compressed_reproducible(path: str, arrays: Dict[str, np.ndarray]) -> None:
  """``np.savez_compressed`` with every zip member's timestamp set to a fixed date.

  ``np.savez_compressed`` stamps members with the current time, so two builds of the same data
  would differ in their sha256. We let numpy write the archive in memory, then copy each member's
  bytes into a new archive with the same compression and a fixed ``date_time``.
  """
  buf = io.BytesIO()
  np.savez_compressed(buf, **arrays)
  buf.seek(0)
  with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
      member = zipfile.ZipInfo(info.filename, date_time=_ZIP_EPOCH)
      member.compress_type = zipfile.ZIP_DEFLATED
      member.external_attr = 0o644 << 16
      dst.writestr(member, src.read(info.filename), compresslevel=9)


def build_subset(source: Dict[str, np.ndarray], num_train: int = NUM_TRAIN,
                 num_test: int = NUM_TEST) -> Dict[str, np.ndarray]:
  """The first ``num_train`` training and ``num_test`` test examples of a full MNIST dict.

  Args:
    source: ``x_train`` uint8 (60000, 28, 28, 1), ``y_train`` (60000,), ``x_test`` uint8
      (10000, 28, 28, 1), ``y_test`` (10000,), optionally ``class_names`` (10,).
    num_train: training examples to keep.
    num_test: test examples to keep.

  Returns:
    Dict with ``x_train`` uint8 (num_train, 28, 28, 1), ``y_train`` int64 (num_train,),
    ``x_test`` uint8 (num_test, 28, 28, 1), ``y_test`` int64 (num_test,), ``class_names`` (10,).
  """
  for key in ("x_train", "y_train", "x_test", "y_test"):
    if key not in source:
      raise ValueError(f"source is missing {key!r}; it must hold x_train, y_train, x_test, y_test")
  if source["x_train"].dtype != np.uint8 or source["x_train"].ndim != 4:
    raise ValueError(f"source x_train has dtype {source['x_train'].dtype} and shape "
                     f"{source['x_train'].shape}; it must be uint8 (N, H, W, C)")
  class_names = source.get("class_names", np.array([str(i) for i in range(10)]))
  return {
      "x_train": np.ascontiguousarray(source["x_train"][:num_train]),
      "y_train": source["y_train"][:num_train].astype(np.int64),
      "x_test": np.ascontiguousarray(source["x_test"][:num_test]),
      "y_test": source["y_test"][:num_test].astype(np.int64),
      "class_names": np.asarray(class_names).astype(str),
  }


def write_embedded(source_path: str, out_path: str = EMBEDDED_MNIST,
                   readme_path: Optional[str] = EMBEDDED_README) -> str:
  """Writes the subset npz (and its README) from a full MNIST npz; returns the npz sha256."""
  with np.load(source_path) as d:
    subset = build_subset({k: d[k] for k in d.files})
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  _savez_compressed_reproducible(out_path, subset)
  sha = sha256_file(out_path)
  if readme_path is not None:
    counts = lambda y: str(np.bincount(y, minlength=10).tolist())
    text = _README_TEMPLATE.format(
        num_train=len(subset["y_train"]), num_test=len(subset["y_test"]),
        train_shape=tuple(subset["x_train"].shape), test_shape=tuple(subset["x_test"].shape),
        train_counts=counts(subset["y_train"]), test_counts=counts(subset["y_test"]),
        size=os.path.getsize(out_path), sha256=sha)
    with open(readme_path, "w", encoding="utf-8") as f:
      f.write(text)
  return sha


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--source", required=True, help="full MNIST npz (x_train, y_train, ...)")
  parser.add_argument("--out", default=EMBEDDED_MNIST, help="output npz (default: the shipped one)")
  parser.add_argument("--readme", default=None,
                      help="README to write (default: embedded/README.md when --out is default)")
  args = parser.parse_args(argv)
  readme = args.readme
  if readme is None and os.path.abspath(args.out) == EMBEDDED_MNIST:
    readme = EMBEDDED_README
  sha = write_embedded(args.source, args.out, readme)
  print(f"wrote {args.out} ({os.path.getsize(args.out):,} bytes, sha256 {sha})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
