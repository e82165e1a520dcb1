"""The evaluators by name (``config.evals.<name>``), built for one model.

``build(config, model, mesh, names, task=task)`` returns the enabled evaluators among the rows the
run's task names (its ``evaluators``) or exactly ``names``; the trainer receives this function
(``train.trainer.train_and_evaluate(..., evaluators=registry.build)``), passes its task and never
imports an evaluator class. Representation (MAE) evaluators:

  ``knn``: weighted KNN of the last block (``evals.knn``).
  ``linear``: linear probes of the last block, official and upstream-MAE protocols.
  ``layers``: KNN and a fast linear probe on every block.
  ``rank``: effective rank per block and branch ratios per sublayer (cheap; on by default).
Fine-tuning evaluator: ``accuracy``, top-1/top-5 of the classifier on the evaluation split.
SiT and U-ViT evaluator: ``generation``, the reported generation metrics of ``num_samples``
samples (``evals.generation_eval``; off unless enabled); the trainer binds it to the run's task.

An evaluator has ``every_steps`` (0 = only at the end of training), ``run(params) -> dict`` of
scalars, ``evaluate(params) -> dict`` of JSON-able report sections and ``summary(scalars) -> str``,
the one console line of a result.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from decay_jax import validate
from decay_jax.evals import evaluators, generation_eval

# config.evals section name -> evaluator class (the order of the report). A task names the rows
# it runs while training (``Task.evaluators``).
EVALUATORS = {"knn": evaluators.KnnEvaluator, "linear": evaluators.LinearEvaluator,
              "layers": evaluators.LayerwiseEvaluator, "rank": evaluators.RankEvaluator}
ROWS = dict(EVALUATORS, accuracy=evaluators.AccuracyEvaluator,
            generation=generation_eval.GenerationEvaluator)
# config.evals section name -> its check of the whole config (fields and input paths, one line).
CHECKS = {"generation": generation_eval.check_config}


def check_config(config, task) -> None:
  """One-line errors for the enabled evaluators' sections that need more than their own fields
  (input files, the task, the EMA): before training starts, nothing loaded or compiled.
  ``task``: the run's task class (``train.tasks``; its ``evaluators`` and samplers)."""
  for name, check in CHECKS.items():
    if name in task.evaluators and name in config.get("evals", {}):
      check(config, task)


def build(config, model, mesh, names: Optional[Sequence[str]] = None, task=None
          ) -> Dict[str, Any]:
  """The evaluators of ``config.evals`` among the rows ``task`` runs (the run's task object or
  class: its ``evaluators``, and ``check_config`` first; None: the representation evaluators):
  the enabled ones, or exactly ``names`` if given.

  Raises:
    ValueError: a name that is not one of the rows, or one without a ``config.evals`` section.
  """
  table = {name: ROWS[name] for name in (task.evaluators if task is not None else EVALUATORS)}
  for name in names or ():
    validate.check_choice("evals", name, tuple(table))
    if name not in config.evals:
      raise validate.not_allowed("evals", name, f"config.evals has no {name!r} section")
  wanted = names or [n for n in table if n in config.evals and config.evals[n].enabled]
  if task is not None:
    check_config(config, task)
  return {name: table[name](config.evals[name], model, config.data, mesh) for name in wanted}
