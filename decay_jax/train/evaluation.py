"""When the trainer runs its evaluators, and the fixed batch of images for monitoring pictures.

The trainer receives the evaluators as a function ``(config, model, mesh, task=task) -> {name:
evaluator}`` (``decay_jax.evals.registry.build``: the evaluators the task names in its
``evaluators``) and never imports their classes. An evaluator needs ``every_steps`` (0 = only at the end of training) and
``run(params) -> {name: float}``; ``summary(scalars) -> str`` (one short console line) is used when
it has one. The full dictionaries go to TensorBoard and metrics.jsonl, not to the console.

Two more, optional: ``weights = 'ema'`` asks for the EMA parameters (when the run keeps them)
instead of the trained ones, and ``bind(task, load_params)`` receives what only the training side
has (``evals`` never imports ``train``): the run's task object (its sampler) and
``checkpoint.load_params`` (to read converted weights such as the FID Inception). The generation
evaluator (``decay_jax.evals.generation_eval``) uses both.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

import jax.numpy as jnp

from decay_jax import logs
from decay_jax.data import pipeline
from decay_jax.train import checkpoint

MakeEvaluators = Callable[..., Dict[str, Any]]  # (config, model, mesh, task=task)


def compact(scalars: Dict[str, float]) -> str:
  """The console line of an evaluator without ``summary``: its first scalars (``logs.compact``)."""
  return logs.compact({k: float(v) for k, v in scalars.items()})


class Evaluators:
  """The evaluators of one run, plus a fixed batch of images for the monitoring pictures."""

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

  def run(self, params, step: int, last: bool, ema=None) -> Dict[str, float]:
    """The scalars of the evaluators due at ``step``; those with ``weights = 'ema'`` get
    ``ema`` (when the run keeps one), the others ``params``."""
    out = {}
    for name, e in self.evaluators.items():
      if self._due(e, step, last):
        use_ema = ema is not None and getattr(e, "weights", "params") == "ema"
        res = e.run(ema if use_ema else params)
        line = e.summary(res) if hasattr(e, "summary") else f"{name}: {compact(res)}"
        logging.info("eval at step %d: %s", step, line)
        out.update(res)
    return out


def make(config, model, mesh, make_evaluators: Optional[MakeEvaluators], task=None
         ) -> Evaluators:
  """The run's evaluators (none without ``make_evaluators``), bound to ``task`` where they ask
  for it (``bind``), and its picture batch."""
  evaluators = (make_evaluators(config, model, mesh, task=task) if make_evaluators is not None
                else {})
  for e in evaluators.values():
    if hasattr(e, "bind"):
      e.bind(task, checkpoint.load_params)
  pictures = None
  if config.picture_every_steps:
    split = config.evals.knn.eval_split if "knn" in config.evals else config.data.eval_split
    try:
      arrays = pipeline.load_eval_arrays(config.data, split)
      pictures = {k: jnp.asarray(v[:8]) for k, v in arrays.items()}
    except ValueError as e:  # a dataset without that split still trains; it just has no pictures
      logging.warning("no monitoring pictures: %s", e)
  return Evaluators(evaluators, pictures)
