"""Evaluators run inside training (configured under ``config.evals``) and by ``decay_jax.evaluate``.

An evaluator has ``every_steps`` (0 = only at the end of training) and ``run(params) -> dict``.
Features are extracted with the model sharded as in training; every process gets all features.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import sharding as shd
from decay_jax.data import pipeline
from decay_jax.evals import knn


def extract(fn, params, images: np.ndarray, mesh, batch_size: int) -> np.ndarray:
  """Applies ``fn(params, images) -> (n, ...)`` in sharded batches; returns numpy for all rows.

  The last batch is padded (and the padding dropped) so one compiled program serves every batch;
  each process feeds its slice of every batch.
  """
  n = images.shape[0]
  per = mesh.size
  batch_size = max(per, (batch_size // per) * per)
  jitted = jax.jit(fn)
  pc, pi = jax.process_count(), jax.process_index()
  outs = []
  for start in range(0, n, batch_size):
    chunk = images[start:start + batch_size]
    valid = chunk.shape[0]
    if valid < batch_size:
      chunk = np.concatenate([chunk, np.zeros((batch_size - valid,) + chunk.shape[1:],
                                              chunk.dtype)], axis=0)
    local = chunk.reshape((pc, batch_size // pc) + chunk.shape[1:])[pi]
    out = jitted(params, shd.global_batch_from_local(local, mesh))
    if pc > 1:
      from jax.experimental import multihost_utils
      out = multihost_utils.process_allgather(out, tiled=True)
    outs.append(np.asarray(jax.device_get(out))[:valid])
  return np.concatenate(outs, axis=0)


def _limited(data_cfg, max_examples: int):
  """``data_cfg`` reading at most ``max_examples`` images (0: all) of an eval split."""
  cfg = data_cfg.copy_and_resolve_references()
  with cfg.unlocked():
    cfg.max_eval_examples = max_examples or None
  return cfg


class KnnEvaluator:
  """Weighted k-NN top-1/top-5 on pooled final-block features (our protocol, see ``evals.knn``)."""

  def __init__(self, cfg, task, data_cfg, mesh):
    self.cfg, self.task, self.mesh = cfg, task, mesh
    self.every_steps = cfg.every_steps
    self.train = pipeline.load_eval_arrays(_limited(data_cfg, cfg.max_train_examples),
                                           cfg.train_split)
    self.test = pipeline.load_eval_arrays(_limited(data_cfg, cfg.max_eval_examples),
                                          cfg.eval_split)
    self.num_classes = int(max(self.train["label"].max(), self.test["label"].max())) + 1
    model = task.model

    def features(params, images):
      tokens = model.apply({"params": params}, images, method=model.features)[-1]
      return knn.pool_tokens(tokens, cfg.pool, cfg.layernorm)

    self.features = features

  def run(self, params) -> Dict[str, float]:
    get = lambda d: extract(self.features, params, d["image"], self.mesh, self.cfg.batch_size)
    res = knn.knn_accuracy(get(self.train), self.train["label"], get(self.test), self.test["label"],
                           self.num_classes, k=self.cfg.k, temperature=self.cfg.temperature)
    out = {"knn/top1": res["top1"]}
    if "top5" in res:
      out["knn/top5"] = res["top5"]
    return out


class Evaluators:
  """All evaluators of a config, plus a fixed batch of images for the monitoring pictures."""

  def __init__(self, evaluators: Dict[str, Any], pictures: Optional[Dict[str, Any]]):
    self.evaluators = evaluators
    self._pictures = pictures

  def picture_batch(self):
    return self._pictures

  @staticmethod
  def _due(e, step: int, last: bool) -> bool:
    return last or bool(e.every_steps and step % e.every_steps == 0)

  def due(self, step: int, last: bool) -> bool:
    return any(self._due(e, step, last) for e in self.evaluators.values())

  def run(self, params, step: int, last: bool) -> Dict[str, float]:
    out = {}
    for name, e in self.evaluators.items():
      if self._due(e, step, last):
        res = e.run(params)
        logging.info("eval %s at step %d: %s", name, step, res)
        out.update(res)
    return out


def from_config(config, task, mesh) -> Evaluators:
  evaluators = {}
  if config.task == "mae" and "knn" in config.evals and config.evals.knn.enabled:
    evaluators["knn"] = KnnEvaluator(config.evals.knn, task, config.data, mesh)
  pictures = None
  if config.picture_every_steps:
    split = config.evals.knn.eval_split if "knn" in config.evals else config.data.eval_split
    try:
      arrays = pipeline.load_eval_arrays(config.data, split)
      pictures = {k: jnp.asarray(v[:8]) for k, v in arrays.items()}
    except ValueError as e:  # a dataset without that split still trains; it just has no pictures
      logging.warning("no monitoring pictures: %s", e)
  return Evaluators(evaluators, pictures)
