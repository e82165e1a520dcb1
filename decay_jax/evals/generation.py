"""Generation metrics: Inception activations, FID, Inception Score, reference statistics.

* FID (Heusel et al. 2017): ``d^2 = |mu_1 - mu_2|^2 + Tr(S_1 + S_2 - 2 (S_1 S_2)^(1/2))`` between
  Gaussians fitted to the 2048-d pool features of the FID Inception (``models/inception.py``).
  ``Tr (S_1 S_2)^(1/2)`` is computed as the sum of the singular values of ``S_2^(1/2) S_1^(1/2)``
  (float64 symmetric eigendecompositions and one SVD) instead of pytorch-fid's
  ``scipy.linalg.sqrtm`` of the non-symmetric product: same value (tested against scipy to 1e-6
  relative), no complex round-off, and 0 to round-off for identical statistics even when the
  covariance is singular (fewer images than 2048).
* Statistics: ``mu`` = mean, ``sigma`` = ``np.cov(acts, rowvar=False)`` (unbiased), float64, as
  pytorch-fid and ADM's evaluator. ``.npz`` files with keys ``mu`` and ``sigma`` (ADM's reference
  batches, e.g. ``VIRTUAL_imagenet256_labeled.npz``, and pytorch-fid's ``--save-stats``) are read and
  written; an ``.npz`` with only ``arr_0`` (uint8 ``(N, H, W, 3)`` images) is treated as images.
* Inception Score (Salimans et al. 2016): ``exp(E_x KL(p(y|x) || p(y)))`` on the softmax of the
  1008-way logits, averaged over splits of ``split_size`` images (ADM's evaluator: 5000).

Protocol note: the network and preprocessing are pytorch-fid's (bilinear resize to 299 with
``align_corners=False``, ``x/255 * 2 - 1``). ADM's evaluator feeds the TensorFlow graph of the same
weights, which resizes with TF1's legacy bilinear (no half-pixel centres) and normalises as
``(x - 128) / 128``; FIDs against ADM's reference statistics are therefore close to, not equal to,
the numbers ADM's TensorFlow suite prints. For paper tables, also run ADM's suite on samples.npz.
"""

from __future__ import annotations

import functools
import io
import time
from typing import Dict, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from decay_jax import paths
from decay_jax.data.folder import IMAGE_EXTENSIONS



# ------------------------------------------------------------------------------------------------
# Statistics and distances (numpy, float64)
# ------------------------------------------------------------------------------------------------


def to_uint8_official(x) -> np.ndarray:
  """Samples in [-1, 1] -> uint8 ``clip(127.5 x + 128, 0, 255)`` truncated (the official
  sample_ddp rounding, which ADM's evaluator and our FID read)."""
  return np.clip(127.5 * np.asarray(x, np.float32) + 128.0, 0, 255).astype(np.uint8)


def statistics(acts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """``(mu (D,), sigma (D, D))`` of activations ``(N, D)``, float64 (sigma unbiased)."""
  acts = np.asarray(acts, np.float64)
  if acts.ndim != 2 or len(acts) < 2:
    raise ValueError(f"activations of shape {acts.shape} are not allowed; need (N >= 2, D)")
  return acts.mean(axis=0), np.cov(acts, rowvar=False)


def _psd_sqrt(s: np.ndarray) -> np.ndarray:
  w, v = np.linalg.eigh((s + s.T) / 2)
  return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
  """FID between ``N(mu1, sigma1)`` and ``N(mu2, sigma2)`` (see the module docstring)."""
  mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
  s1, s2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
  if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != mu1.shape * 2:
    raise ValueError(f"statistics do not match: mu {mu1.shape} vs {mu2.shape}, sigma {s1.shape} "
                     f"vs {s2.shape}")
  # Tr (S1 S2)^(1/2) = sum of the singular values of S2^(1/2) S1^(1/2) (its Gram matrix is
  # S1^(1/2) S2 S1^(1/2)); singular values keep the null space of rank-deficient covariances at
  # round-off, where square roots of eigenvalues would amplify it to sqrt(round-off).
  tr_covmean = np.linalg.svd(_psd_sqrt(s2) @ _psd_sqrt(s1), compute_uv=False).sum()
  diff = mu1 - mu2
  return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2.0 * tr_covmean)


def inception_score(logits: np.ndarray, split_size: int = 5000) -> float:
  """Mean over splits of ``exp(mean_x KL(p(y|x) || p(y)))``; ``logits (N, 1008)``."""
  logits = np.asarray(logits, np.float64)
  logp = logits - logits.max(axis=1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
  scores = []
  for i in range(0, len(logp), split_size):
    part = logp[i:i + split_size]
    prob = np.exp(part)
    with np.errstate(divide="ignore", invalid="ignore"):  # classes no image predicts: log 0,
      log_marginal = np.log(prob.mean(axis=0))               # always weighted by p = 0
      kl = np.where(prob > 0, prob * (part - log_marginal[None]), 0.0).sum(axis=1)
    scores.append(np.exp(kl.mean()))
  return float(np.mean(scores))


def save_stats(path: str, mu: np.ndarray, sigma: np.ndarray) -> None:
  """``.npz`` with ``mu`` and ``sigma`` (the keys of ADM's reference batches and pytorch-fid)."""
  paths.save_npz(path, mu=np.asarray(mu), sigma=np.asarray(sigma))


def load_stats(path: str) -> Optional[Tuple[np.ndarray, np.ndarray]]:
  """``(mu, sigma)`` of an ``.npz`` holding them, or None if it holds images only."""
  with paths.load_numpy(path) as f:
    if "mu" in f and "sigma" in f:
      return np.asarray(f["mu"], np.float64), np.asarray(f["sigma"], np.float64)
    if "arr_0" not in f:
      raise ValueError(f"{path} is not allowed; it has neither mu/sigma nor arr_0 "
                       f"(keys: {sorted(f.keys())})")
  return None


# ------------------------------------------------------------------------------------------------
# Images
# ------------------------------------------------------------------------------------------------


def list_images(directory: str):
  """All image files under ``directory`` (recursively), sorted."""
  return paths.list_files(directory, IMAGE_EXTENSIONS)


def load_images(path: str) -> np.ndarray:
  """uint8 ``(N, H, W, 3)`` from an ``.npz`` (``arr_0``, as ``decay_jax.cli.sample`` and ADM write)
  or an image folder (RGB; all images must share one size, as pytorch-fid requires)."""
  if paths.resolve(path).is_dir():
    from PIL import Image
    files = list_images(path)
    if not files:
      raise ValueError(f"{path} is not allowed; it holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    images = [np.asarray(Image.open(io.BytesIO(paths.resolve(f).read_bytes())).convert("RGB"))
              for f in files]
    sizes = sorted({im.shape for im in images})
    if len(sizes) > 1:
      raise ValueError(f"{path}: images of several sizes {sizes[:4]}; resize them to one size")
    return np.stack(images)
  if not paths.exists(path):
    raise ValueError(f"{path!r} is not allowed; it is neither a folder nor an .npz file")
  with paths.load_numpy(path) as f:
    if "arr_0" not in f:
      raise ValueError(f"{path} is not allowed; it has no arr_0 images (keys: {sorted(f.keys())})")
    images = np.asarray(f["arr_0"])
  if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
    raise ValueError(f"{path}: arr_0 must be uint8 (N, H, W, 3), got {images.dtype} "
                     f"{images.shape}")
  return images


# ------------------------------------------------------------------------------------------------
# Activations, sharded over devices
# ------------------------------------------------------------------------------------------------


class Progress:
  """Prints ``what: done/total, rate, ETA`` at most every ``every`` seconds and at the end."""

  def __init__(self, what: str, total: int, unit: str = "images", every: float = 10.0):
    self.what, self.total, self.unit, self.every = what, total, unit, every
    self.t0 = self.last = time.perf_counter()

  def update(self, done: int, already: int = 0) -> None:
    """``done`` of ``total`` finished, ``already`` of them before this run (resumed work)."""
    now = time.perf_counter()
    if now - self.last < self.every and done < self.total:
      return
    self.last = now
    rate = max(done - already, 1e-9) / max(now - self.t0, 1e-9)
    print(f"{self.what}: {done}/{self.total} {self.unit}, {rate:.1f} {self.unit}/s, "
          f"ETA {(self.total - done) / rate:.0f} s", flush=True)


def local_mesh() -> Mesh:
  """A 1-D mesh of this process's devices: metric passes are embarrassingly parallel."""
  return Mesh(np.asarray(jax.local_devices()), ("data",))


def _batches(n: int, batch: int) -> Iterator[Tuple[int, int]]:
  for start in range(0, n, batch):
    yield start, min(n, start + batch)


@functools.lru_cache(maxsize=4)
def _inception_forward(model, mesh: Mesh):
  """One jitted forward per (model, mesh): reference and samples share the compiled program."""
  sharding = NamedSharding(mesh, P(mesh.axis_names))
  fwd = jax.jit(lambda p, x: model.apply({"params": p}, x.astype(jnp.float32) / 255.0),
                in_shardings=(None, sharding), out_shardings=sharding)
  return fwd, sharding


def inception_activations(model, params, images: np.ndarray, batch_size: int = 200,
                          mesh: Optional[Mesh] = None, what: str = "images"
                          ) -> Dict[str, np.ndarray]:
  """``{'pool': (N, 2048), 'logits': (N, 1008)}`` float32 of uint8 ``images (N, H, W, 3)``.

  Batches are split over the devices of ``mesh`` (default: this process's devices); the last
  batch is padded, so one program serves all batches. Logs progress and ETA.
  """
  mesh = mesh or local_mesh()
  per = mesh.size
  batch = max(per, (batch_size // per) * per)
  fwd, sharding = _inception_forward(model, mesh)
  params = jax.device_put(params, NamedSharding(mesh, P()))  # replicated on the mesh
  pools, logits = [], []
  n = len(images)
  progress = Progress(f"inception features of {what}", n)
  for start, stop in _batches(n, batch):
    x = np.asarray(images[start:stop])
    if len(x) < batch:
      x = np.concatenate([x, np.zeros((batch - len(x),) + x.shape[1:], x.dtype)])
    out = jax.device_get(fwd(params, jax.device_put(x, sharding)))
    pools.append(np.asarray(out["pool"])[:stop - start])
    logits.append(np.asarray(out["logits"])[:stop - start])
    progress.update(stop)
  return {"pool": np.concatenate(pools), "logits": np.concatenate(logits)}
