"""Generation metrics: Inception activations, FID, sFID, Inception Score, reference batches.

* FID (Heusel et al. 2017): ``d^2 = |mu_1 - mu_2|^2 + Tr(S_1 + S_2 - 2 (S_1 S_2)^(1/2))`` between
  Gaussians fitted to the 2048-d pool features of the FID Inception (``models/inception.py``).
  ``Tr (S_1 S_2)^(1/2)`` is computed as the sum of the singular values of ``S_2^(1/2) S_1^(1/2)``
  (float64 symmetric eigendecompositions and one SVD) instead of pytorch-fid's
  ``scipy.linalg.sqrtm`` of the non-symmetric product: same value (tested against scipy to 1e-6
  relative), no complex round-off, and 0 to round-off for identical statistics even when the
  covariance is singular (fewer images than 2048).
* sFID (Nash et al. 2021, as ADM's evaluator): the same distance on the 2023-d spatial features
  (``mixed_6/conv``, first 7 channels; ``models/inception.py`` says which layer of ours that is).
* Statistics: ``mu`` = mean, ``sigma`` = ``np.cov(acts, rowvar=False)`` (unbiased), float64, as
  pytorch-fid and ADM's evaluator (``compute_statistics``).
* Reference batches in ADM's layout (``VIRTUAL_imagenet256_labeled.npz``): ``arr_0`` uint8
  ``(N, H, W, 3)`` images (ADM computes precision/recall on their pool features), ``mu``/``sigma``
  (FID) and ``mu_s``/``sigma_s`` (sFID) statistics, which ADM's ``read_statistics`` prefers to the
  images' own when present. ``read_batch`` reads any subset of these keys (pytorch-fid's
  ``--save-stats`` files hold ``mu``/``sigma`` only); ``save_batch`` writes all of them.
* Inception Score (Salimans et al. 2016): ``exp(E_x KL(p(y|x) || p(y)))`` on the softmax of the
  1008-way logits, averaged over splits of ``split_size`` images (ADM's evaluator: 5000).
  ADM's ``_create_softmax_graph`` multiplies the pool feature by the ``softmax/logits`` weights
  without their bias; these logits (pytorch-fid's ``fc``) include it.

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
from typing import Dict, Iterable, Iterator, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from decay_jax import paths
from decay_jax.data.folder import IMAGE_EXTENSIONS
from decay_jax.evals import manifold
from decay_jax.models import inception as inception_lib

# ADM's reference-batch keys besides arr_0, and the feature each pair describes.
STAT_KEYS = {"mu": "sigma", "mu_s": "sigma_s"}
FEATURE_DIMS = {"mu": inception_lib.POOL_DIM, "mu_s": inception_lib.SPATIAL_DIM}
REF_IMAGES = 10_000  # images in ADM's VIRTUAL_* reference batches (arr_0)


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
  save_batch(path, {"mu": mu, "sigma": sigma})


def save_batch(path: str, stats: Dict[str, np.ndarray], images: Optional[np.ndarray] = None
               ) -> None:
  """A reference batch in ADM's layout: ``arr_0`` (uint8 images, if given) and the statistics
  ``mu``, ``sigma``, ``mu_s``, ``sigma_s`` that ``stats`` holds (float64)."""
  arrays = {} if images is None else {"arr_0": np.asarray(images, np.uint8)}
  arrays.update({k: np.asarray(v, np.float64) for k, v in stats.items() if k in STAT_KEYS
                 or k in STAT_KEYS.values()})
  paths.save_npz(path, **arrays)


def read_batch(path: str) -> Tuple[Dict[str, np.ndarray], bool]:
  """``(stats, has_images)`` of an ``.npz``: the statistics it holds (``mu``/``sigma`` and/or
  ``mu_s``/``sigma_s``, float64) and whether it has ``arr_0`` images. Checks that every ``mu``
  has its ``sigma`` of matching shape and that the file holds something usable."""
  with paths.load_numpy(path) as f:
    keys = set(f.keys())
    stats = {k: np.asarray(f[k], np.float64) for k in keys
             if k in STAT_KEYS or k in STAT_KEYS.values()}
  for mu_key, sigma_key in STAT_KEYS.items():
    if (mu_key in stats) != (sigma_key in stats):
      have, miss = (mu_key, sigma_key) if mu_key in stats else (sigma_key, mu_key)
      raise ValueError(f"{path}: has {have} but no {miss}; write both (decay_jax.cli.fid "
                       f"--save_stats) or neither")
    if mu_key in stats:
      mu, sigma = stats[mu_key], stats[sigma_key]
      if mu.ndim != 1 or sigma.shape != mu.shape * 2:
        raise ValueError(f"{path}: {mu_key} {mu.shape} and {sigma_key} {sigma.shape} are not "
                         f"allowed; need (D,) and (D, D)")
  if not stats and "arr_0" not in keys:
    raise ValueError(f"{path} is not allowed; it has neither mu/sigma nor arr_0 "
                     f"(keys: {sorted(keys)})")
  return stats, "arr_0" in keys


def load_stats(path: str) -> Optional[Tuple[np.ndarray, np.ndarray]]:
  """``(mu, sigma)`` of an ``.npz`` holding them, or None if it holds images only."""
  stats, _ = read_batch(path)
  return (stats["mu"], stats["sigma"]) if "mu" in stats else None


def subset(n: int, size: int, seed: int = 0) -> np.ndarray:
  """Sorted indices of ``min(n, size)`` of ``range(n)`` drawn without replacement (the images a
  reference batch keeps: a folder sorted by class would otherwise give its first classes)."""
  if size >= n:
    return np.arange(n)
  return np.sort(np.random.default_rng(seed).choice(n, size, replace=False))


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


class ImageStream(NamedTuple):
  """``n`` uint8 images ``(H, W, 3)`` in ``chunks`` ``(m, H, W, 3)``, read as they are consumed:
  an input larger than host memory (a 50,000-image reference batch at 256 px is 9.8 GB)."""
  n: int
  chunks: Iterable[np.ndarray]


def _fixed_batches(images, batch: int) -> Iterator[np.ndarray]:
  """The rows of ``images`` (an array or an ``ImageStream``) in order, ``batch`` at a time (the
  last one shorter)."""
  if not isinstance(images, ImageStream):
    yield from (np.asarray(images[a:b]) for a, b in _batches(len(images), batch))
    return
  rows = None  # the rows read and not yet yielded
  for chunk in images.chunks:
    rows = np.asarray(chunk) if rows is None else np.concatenate([rows, chunk])
    while len(rows) >= batch:
      yield rows[:batch]
      rows = rows[batch:]
  if rows is not None and len(rows):
    yield rows


def _keeping(stream: ImageStream, rows: np.ndarray, kept: list) -> ImageStream:
  """``stream`` unchanged, appending its images at the sorted indices ``rows`` to ``kept``."""
  def chunks():
    start = 0
    for chunk in stream.chunks:
      here = rows[(rows >= start) & (rows < start + len(chunk))] - start
      kept.append(np.asarray(chunk)[here])
      start += len(chunk)
      yield chunk
  return ImageStream(stream.n, chunks())


@functools.lru_cache(maxsize=4)
def _inception_forward(model, mesh: Mesh):
  """One jitted forward per (model, mesh): reference and samples share the compiled program."""
  sharding = NamedSharding(mesh, P(mesh.axis_names))
  fwd = jax.jit(lambda p, x: model.apply({"params": p}, x.astype(jnp.float32) / 255.0),
                in_shardings=(None, sharding), out_shardings=sharding)
  return fwd, sharding


def inception_activations(model, params, images, batch_size: int = 200,
                          mesh: Optional[Mesh] = None, what: str = "images"
                          ) -> Dict[str, np.ndarray]:
  """``{'pool': (N, 2048), 'spatial': (N, 2023), 'logits': (N, 1008)}`` float32 of uint8
  ``images (N, H, W, 3)``, an array or an ``ImageStream`` (then only a batch of images is held).

  Batches are split over the devices of ``mesh`` (default: this process's devices); the last
  batch is padded, so one program serves all batches. Logs progress and ETA.
  """
  mesh = mesh or local_mesh()
  per = mesh.size
  batch = max(per, (batch_size // per) * per)
  fwd, sharding = _inception_forward(model, mesh)
  params = jax.device_put(params, NamedSharding(mesh, P()))  # replicated on the mesh
  outs = {"pool": [], "spatial": [], "logits": []}
  n = images.n if isinstance(images, ImageStream) else len(images)
  progress, done = Progress(f"inception features of {what}", n), 0
  for x in _fixed_batches(images, batch):
    m = len(x)
    if m < batch:
      x = np.concatenate([x, np.zeros((batch - m,) + x.shape[1:], x.dtype)])
    out = jax.device_get(fwd(params, jax.device_put(x, sharding)))
    for key, parts in outs.items():
      parts.append(np.asarray(out[key])[:m])
    done += m
    progress.update(done)
  if done != n:
    raise ValueError(f"{what}: {done} images were read, {n} were announced")
  return {key: np.concatenate(parts) for key, parts in outs.items()}


# ------------------------------------------------------------------------------------------------
# All metrics of a sample set against a reference
# ------------------------------------------------------------------------------------------------


def describe(path: str, model=None, params=None, batch_size: int = 200, keep_images: int = 0,
             what: str = "images") -> Dict[str, np.ndarray]:
  """What the metrics need of one input (an ``.npz`` in ADM's layout, an image ``.npz`` or a
  folder): the statistics ``mu``/``sigma``/``mu_s``/``sigma_s`` (the file's where it has them, as
  ADM's ``read_statistics``; else those of its images), and with a ``model`` the images' ``pool``
  features and ``logits`` (ADM computes precision/recall on the reference's ``arr_0`` even when
  the file holds statistics), ``n`` and, if ``keep_images``, a random subset ``images`` of at most
  that many images (``subset``)."""
  stats, has_images = read_batch(path) if str(path).endswith(".npz") else ({}, True)
  if has_images and model is not None:
    return describe_images(load_images(path), model, params, batch_size, stats, keep_images, what)
  return dict(stats)


def describe_images(images: np.ndarray, model, params, batch_size: int = 200,
                    stats: Optional[Dict[str, np.ndarray]] = None, keep_images: int = 0,
                    what: str = "images") -> Dict[str, np.ndarray]:
  """``describe`` of uint8 ``images (N, H, W, 3)``, in memory (the evaluator's samples) or an
  ``ImageStream`` (a dataset split): their ``pool`` features, ``logits``, ``n``, the statistics
  of ``stats`` where given, else the images' own, and with ``keep_images`` a random subset
  ``images``."""
  side: Dict[str, np.ndarray] = dict(stats or {})
  n = images.n if isinstance(images, ImageStream) else len(images)
  keep, kept = (subset(n, keep_images) if keep_images else None), []
  if keep is not None and isinstance(images, ImageStream):
    images = _keeping(images, keep, kept)
  acts = inception_activations(model, params, images, batch_size, what=what)
  side.update(pool=acts["pool"], logits=acts["logits"], n=n)
  for mu_key, feature in (("mu", "pool"), ("mu_s", "spatial")):
    if mu_key not in side:
      side[mu_key], side[STAT_KEYS[mu_key]] = statistics(acts[feature])
  if keep is not None:
    side["images"] = np.concatenate(kept) if kept else images[keep]
  return side


def compare(samples: Dict, ref: Dict, is_split_size: int = 5000, pr_k: int = manifold.PR_K,
            dc_k: int = manifold.DC_K, half: bool = True, batch: int = manifold.BATCH,
            names: Tuple[str, str] = ("samples", "reference")) -> Tuple[Dict[str, float], list]:
  """``(metrics, missing)``: FID, sFID, IS, precision, recall, density and coverage of the
  ``describe`` dicts ``samples`` and ``ref``, each where its inputs are there; ``missing`` names the
  others (no spatial statistics, no features)."""
  result, missing = {}, []
  for metric, mu_key in (("fid", "mu"), ("sfid", "mu_s")):
    if mu_key not in samples or mu_key not in ref:
      missing.append(metric)
      continue
    if samples[mu_key].shape != ref[mu_key].shape:
      raise ValueError(f"{mu_key} of {names[0]} has {samples[mu_key].shape[0]} dims and of "
                       f"{names[1]} {ref[mu_key].shape[0]}; both must come from the same "
                       f"network layer ({FEATURE_DIMS[mu_key]} dims here)")
    result[metric] = frechet_distance(samples[mu_key], samples[STAT_KEYS[mu_key]], ref[mu_key],
                                      ref[STAT_KEYS[mu_key]])
  if "logits" in samples:
    result["inception_score"] = inception_score(samples["logits"], is_split_size)
  else:
    missing.append("inception_score")
  if "pool" in samples and "pool" in ref:
    result.update(manifold.precision_recall(ref["pool"], samples["pool"], pr_k, half, batch))
    result.update(manifold.density_coverage(ref["pool"], samples["pool"], dc_k, batch))
  else:
    missing += ["precision", "recall", "density", "coverage"]
  return result, missing
