"""The reported generation evaluation of a SiT or U-ViT run, small-N and periodic, in training.

``config.evals.generation`` names the evaluation a config reports (sampler, steps, guidance,
``report_num`` samples, reference batch, FID Inception; ``train.config.generation_eval``). With
``enabled`` the trainer runs it every ``every_steps`` on ``num_samples`` samples of the EMA
weights (``weights``) and logs ``generation/fid``, ``sfid``, ``inception_score``, ``precision``,
``recall``, ``density`` and ``coverage`` (metrics.jsonl, TensorBoard; one console line).

The numbers are those of the standalone path on the same samples: the samples are drawn exactly
as ``decay_jax.cli.sample --num=num_samples --batch_size=batch_size --seed=seed`` with the
section's sampler draws them (``evals.sampling.chunk_program``: example ``j``'s noise and label
from ``fold_in(key(seed), j)``, chunk ``k``'s SDE draws from ``(seed, k B)``, split over the
mesh; pixels as that command writes them), and the metrics are ``decay_jax.cli.fid``'s functions
(``evals.generation.describe``/``compare``, ``evals.manifold``) with its defaults (float16
precision/recall distances as ADM, blocks of 10,000). The seed is the same at every evaluation, so
successive numbers differ by the weights only. Small-N FID is biased upwards (roughly as 1/N):
compare runs at equal ``num_samples``, never with a paper's FID-50K (``report_num``; that is
``cli.sample`` + ``cli.fid`` with the same settings, docs/generation_metrics.md).

What only the training side has comes through ``bind(task, load_params)``
(``train.evaluation.make``): the task's ``sample`` (``evals`` never imports ``train``) and
``train.checkpoint.load_params`` for the converted Inception and VAE. ``check_config`` gives
one-line errors for every field and input path before anything is compiled
(``decay_jax.cli.train`` calls it through ``registry.check_config``).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Tuple

import jax
import numpy as np

from decay_jax import paths, validate
from decay_jax import sharding as shd
from decay_jax.data import latents as latents_lib
from decay_jax.evals import generation, manifold, sampling
from decay_jax.models import inception as inception_lib

SECTION = "evals.generation"
METRICS = ("fid", "sfid", "inception_score", "precision", "recall", "density", "coverage")
WEIGHTS = ("ema", "params")
_SHORT = {"fid": "fid", "sfid": "sfid", "inception_score": "is", "precision": "prec",
          "recall": "rec", "density": "dens", "coverage": "cov"}


def _path(field: str, value: str, what: str) -> str:
  if not value:
    raise ValueError(f"{SECTION}.{field} is required when {SECTION}.enabled; give {what}")
  if not paths.exists(value):
    raise ValueError(f"{SECTION}.{field}={value!r} is not allowed; no such file or folder")
  return value


def check_reference(ref: str) -> None:
  """One-line errors for a reference batch: an ``.npz`` ``generation.read_batch`` accepts, or a
  folder holding images."""
  _path("ref", ref, "a reference batch (ADM's VIRTUAL_*.npz, or decay_jax.cli.fid --save_stats)")
  if paths.resolve(ref).is_dir():
    if not generation.list_images(ref):
      raise ValueError(f"{SECTION}.ref={ref!r} is not allowed; the folder holds no images")
    return
  if not str(ref).endswith(".npz"):
    raise ValueError(f"{SECTION}.ref={ref!r} is not allowed; give an .npz or an image folder")
  try:
    generation.read_batch(ref)
  except (OSError, ValueError) as e:
    raise ValueError(f"{SECTION}.ref: {' '.join(str(e).split())}") from None


def check_config(config, task) -> None:
  """One-line ``ValueError``s for ``config.evals.generation`` of a SiT or U-ViT config (``task``:
  its task class, whose ``evaluators`` name this one), when it is enabled: its numbers, its sampler, the EMA it asks for, and the reference batch, Inception
  and (latent runs) VAE directories, which must exist (nothing is downloaded)."""
  c = config.evals.get("generation") if "evals" in config else None
  if c is None or not c.enabled:
    return
  validate.check_int(f"{SECTION}.every_steps", c.every_steps, 0)
  for field in ("report_num", "batch_size", "inception_batch_size", "is_split_size", "pr_k",
                "dc_k"):
    validate.check_int(f"{SECTION}.{field}", c[field], 1)
  validate.check_int(f"{SECTION}.seed", c.seed, 0)
  need = max(c.pr_k, c.dc_k, 1) + 1
  validate.check_int(f"{SECTION}.num_samples", c.num_samples, need)
  validate.check_choice(f"{SECTION}.weights", c.weights, WEIGHTS)
  if c.weights == "ema" and not config.ema_decay > 0:
    raise validate.not_allowed(f"{SECTION}.weights", c.weights,
                               "the run keeps no EMA (ema_decay 0); use 'params'")
  sampling.check_sampler(c.sample, task.sampler_modes, f"{SECTION}.sample.")
  if "diffusion" in config and c.sample.cfg_scale and not (  # U-ViT: guidance needs dropout
      config.model.conditional and config.diffusion.class_dropout_prob > 0):
    raise validate.not_allowed(f"{SECTION}.sample.cfg_scale", c.sample.cfg_scale,
                               "the model is trained without label dropout; use 0")
  check_reference(c.ref)
  inception = _path("inception", c.inception, "the FID Inception converted with "
                    "decay_jax.cli.convert_external inception")
  if not paths.exists(paths.join(inception, "model.json")):
    raise ValueError(f"{SECTION}.inception={inception!r} is not allowed; it has no model.json "
                     "(convert pt_inception-2015-12-05-6726825d.pth with "
                     "decay_jax.cli.convert_external inception)")
  latent = config.data.dataset.startswith(latents_lib.PREFIX)
  if latent:
    vae = _path("vae", c.vae, "the converted VAE the latents were extracted with (latent runs "
                "are decoded to pixels)")
    if not paths.exists(paths.join(vae, "model.json")):
      raise ValueError(f"{SECTION}.vae={vae!r} is not allowed; it is not a converted VAE "
                       "directory (decay_jax.cli.convert_external vae)")
  elif c.vae:
    raise validate.not_allowed(f"{SECTION}.vae", c.vae, f"the run trains on pixels "
                               f"({config.data.dataset!r}); leave it empty")


class GenerationEvaluator:
  """FID, sFID, IS, precision, recall, density and coverage of ``cfg.num_samples`` samples of the
  run's sampler ``cfg.sample`` against ``cfg.ref`` (see the module docstring)."""

  def __init__(self, cfg, model, data_cfg, mesh):
    self.cfg, self.model, self.data_cfg, self.mesh = cfg, model, data_cfg, mesh
    self.every_steps = cfg.every_steps
    self.weights = cfg.weights
    self.batch = sampling.round_chunk(int(cfg.batch_size), mesh.size)
    self.latent = data_cfg.dataset.startswith(latents_lib.PREFIX)
    self.program: Optional[Callable] = None
    self._ref: Optional[Dict[str, np.ndarray]] = None

  def bind(self, task, load_params: Callable) -> None:
    """Reads the Inception (and a latent run's VAE) with ``load_params`` and compiles nothing
    yet: the sampling program of ``task.sample`` is jitted once, at the first ``run``."""
    cfg = self.cfg
    self.inception, self.inception_params = load_params(cfg.inception, "inception")
    inception_lib.check_loaded(self.inception, cfg.inception, f"{SECTION}.inception")
    decode, self.vae_params = None, None
    if self.latent:
      vae, vae_params = sampling.load_vae(cfg.vae, self.data_cfg.dataset, self.model, load_params,
                                          f"{SECTION}.vae")
      decode, self.vae_params = sampling.vae_decoder(vae), jax.device_put(
          vae_params, shd.replicated(self.mesh))
    sampler = cfg.sample
    self.program = sampling.chunk_program(
        lambda p, x, y, k: task.sample(p, x, y, k, sampler), self.mesh, int(cfg.seed), self.batch,
        task.image_shape(), task.num_labels, "uniform", decode)
    official = self.latent or self.data_cfg.normalize == "half"
    self.to_pixels = lambda x: sampling.to_pixels(x, official, task.mean, task.std)

  def draw(self, params) -> Tuple[np.ndarray, np.ndarray]:
    """``(images uint8 (N, H, W, 3), labels (N,))``: the first ``num_samples`` examples of
    ``decay_jax.cli.sample`` with the same seed, chunk size and sampler."""
    if self.program is None:
      raise ValueError("the generation evaluator is not bound to a task; call bind(task, "
                       "load_params) first (train.evaluation.make does)")
    n = int(self.cfg.num_samples)
    images, labels = [], []
    progress = generation.Progress("generation samples", n)
    for i in range(sampling.num_chunks(n, self.batch)):
      out = self.program(params, self.vae_params, np.int32(i))
      keep = min(self.batch, n - i * self.batch)
      images.append(self.to_pixels(sampling.to_host(out["out"]))[:keep])
      labels.append(sampling.to_host(out["labels"]).astype(np.int32)[:keep])
      progress.update(i * self.batch + keep)
    return np.concatenate(images), np.concatenate(labels)

  def reference(self) -> Dict[str, np.ndarray]:
    """The reference's statistics and features (``generation.describe``), computed once."""
    if self._ref is None:
      self._ref = generation.describe(self.cfg.ref, self.inception, self.inception_params,
                                      self.cfg.inception_batch_size, 0, "reference")
    return self._ref

  def metrics(self, images: np.ndarray) -> Tuple[Dict[str, float], list]:
    """``(metrics, missing)`` of uint8 ``images`` against the reference (``cli.fid``'s path)."""
    c = self.cfg
    side = generation.describe_images(images, self.inception, self.inception_params,
                                      c.inception_batch_size, what="samples")
    return generation.compare(side, self.reference(), c.is_split_size, c.pr_k, c.dc_k, True,
                              manifold.BATCH, names=("samples", c.ref))

  def evaluate(self, params) -> Dict[str, dict]:
    t0 = time.perf_counter()
    images, _ = self.draw(params)
    t1 = time.perf_counter()
    result, missing = self.metrics(images)
    ref = self.reference()
    return {"generation": dict(
        result, num_samples=len(images), num_ref=int(ref["n"]) if "n" in ref else None,
        missing=missing, ref=self.cfg.ref, sampler=self.cfg.sample.to_dict(),
        seed=int(self.cfg.seed), weights=self.weights, sample_seconds=t1 - t0,
        metric_seconds=time.perf_counter() - t1)}

  def run(self, params) -> Dict[str, float]:
    res = self.evaluate(params)["generation"]
    out = {f"generation/{k}": float(res[k]) for k in METRICS if k in res}
    out["generation/seconds"] = float(res["sample_seconds"] + res["metric_seconds"])
    return out

  def summary(self, scalars: Dict[str, float]) -> str:
    """``generation (2000 samples): fid 12.3 sfid 6.1 is 85.2 prec 0.71 rec 0.52 ...``."""
    items = [f"{_SHORT[k]} {float(scalars[f'generation/{k}']):.4g}" for k in METRICS
             if f"generation/{k}" in scalars]
    line = f"generation ({self.cfg.num_samples} samples): " + (" ".join(items) or "no results")
    if "generation/seconds" in scalars:
      line += f" ({scalars['generation/seconds']:.0f} s)"
    return line[:199]
