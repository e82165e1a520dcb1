"""Evaluators run inside training (configured under ``config.evals``) and by ``decay_jax.evaluate``.

An evaluator has ``every_steps`` (0 = only at the end of training), ``run(params) -> dict`` of
scalars and ``evaluate(params) -> dict`` of JSON-able report sections. Features are extracted with
the model sharded as in training; every process gets all features. MAE evaluators:

  ``knn``: weighted KNN of the last block (``evals.knn``, below).
  ``linear``: linear probes of the last block, official and upstream-MAE protocols.
  ``layers``: KNN and a fast linear probe on every block.
  ``rank``: effective rank per block and branch ratios per sublayer (cheap; on by default).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import jax.numpy as jnp

from decay_jax.data import pipeline
from decay_jax.evals import evaluators as evaluators_lib
from decay_jax.evals import knn
from decay_jax.evals.features import extract  # also public here, as before


class KnnEvaluator:
  """Weighted k-NN top-1/top-5 on pooled final-block features (our protocol, see ``evals.knn``)."""

  def __init__(self, cfg, task, data_cfg, mesh):
    self.cfg, self.task, self.mesh = cfg, task, mesh
    self.every_steps = cfg.every_steps
    self.train = evaluators_lib.load_split(data_cfg, cfg.train_split, cfg.max_train_examples)
    self.test = evaluators_lib.load_split(data_cfg, cfg.eval_split, cfg.max_eval_examples)
    self.num_classes = int(max(self.train["label"].max(), self.test["label"].max())) + 1
    self.model = model = task.model
    self.choice = cfg.pool + ("_ln" if cfg.layernorm else "")
    self.cache = None  # a features.FeatureCache shared with other evaluators (decay_jax.evaluate)

    def features(params, images):
      tokens = model.apply({"params": params}, images, method=model.features)[-1]
      return knn.pool_tokens(tokens, cfg.pool, cfg.layernorm)

    self.features = features

  def requests(self):
    return [(d["image"], (self.choice,), (-1,)) for d in (self.train, self.test)]

  def _get(self, params, images):
    if self.cache is not None and self.cache.params is params:
      return self.cache.pooled(images, (self.choice,), (-1,))[:, 0, 0]
    return extract(self.features, params, images, self.mesh, self.cfg.batch_size)

  def evaluate(self, params) -> Dict[str, dict]:
    get = lambda d: self._get(params, d["image"])
    res = knn.knn_accuracy(get(self.train), self.train["label"], get(self.test), self.test["label"],
                           self.num_classes, k=self.cfg.k, temperature=self.cfg.temperature)
    return {"knn": dict(res, pool=self.cfg.pool, layernorm=bool(self.cfg.layernorm))}

  def run(self, params) -> Dict[str, float]:
    res = self.evaluate(params)["knn"]
    out = {"knn/top1": res["top1"]}
    if "top5" in res:
      out["knn/top5"] = res["top5"]
    return out


# config.evals section name -> evaluator class (the order of the report).
MAE_EVALUATORS = {"knn": KnnEvaluator, "linear": evaluators_lib.LinearEvaluator,
                  "layers": evaluators_lib.LayerwiseEvaluator, "rank": evaluators_lib.RankEvaluator}


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


def build(config, task, mesh, names=None) -> Dict[str, Any]:
  """The MAE evaluators of ``config.evals``: the enabled ones, or exactly ``names`` if given.

  Raises:
    ValueError: a name that is not an evaluator, or one without a ``config.evals`` section.
  """
  if config.task != "mae":
    if names:
      raise ValueError(f"task={config.task!r} is not allowed; the evaluators need task='mae'")
    return {}
  for name in names or ():
    if name not in MAE_EVALUATORS:
      raise ValueError(f"evals={name!r} is not allowed; choose from "
                       f"{', '.join(map(repr, MAE_EVALUATORS))}")
    if name not in config.evals:
      raise ValueError(f"evals={name!r} is not allowed; config.evals has no {name!r} section")
  wanted = names or [n for n in MAE_EVALUATORS if n in config.evals and config.evals[n].enabled]
  out = {}
  for name in wanted:
    out[name] = MAE_EVALUATORS[name](config.evals[name], task, config.data, mesh)
  return out


def from_config(config, task, mesh) -> Evaluators:
  evaluators = build(config, task, mesh)
  pictures = None
  if config.picture_every_steps:
    split = config.evals.knn.eval_split if "knn" in config.evals else config.data.eval_split
    try:
      arrays = pipeline.load_eval_arrays(config.data, split)
      pictures = {k: jnp.asarray(v[:8]) for k, v in arrays.items()}
    except ValueError as e:  # a dataset without that split still trains; it just has no pictures
      logging.warning("no monitoring pictures: %s", e)
  return Evaluators(evaluators, pictures)
