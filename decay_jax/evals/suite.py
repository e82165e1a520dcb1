"""One model through the representation evaluators: the record behind reports and studies.

``evaluate_model`` runs the evaluators of ``decay_jax.evals.runner`` (knn, linear, layers, rank) on
one MAE encoder with one shared feature cache and returns a JSON-able record (``evals.report`` turns
records into Markdown and plots). Used by ``decay_jax.evaluate`` and ``decay_jax.study``.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Sequence

from absl import logging


def run_model(config, params):
  """The model of a run's config; channels from the checkpoint's patch-embedding kernel."""
  from decay_jax.train import config as config_lib
  channels = int(params["patch_embed"]["proj"]["kernel"].shape[2])
  return config_lib.build_model(config, {"image_size": config.data.image_size,
                                         "channels": channels})


def model_summary(model) -> Dict[str, Any]:
  from decay_jax import checkpoint as ckpt_lib
  sc = model.shortcuts
  return dict(ckpt_lib.model_fields(model), alpha_eff=sc.alpha_eff, alphas=sc.alphas.tolist(),
              branch_scale=sc.branch_scale)


def check_data(model, data_cfg, label: str) -> None:
  from decay_jax.data import pipeline
  info = pipeline.dataset_info(data_cfg)
  if info["image_size"] != model.img_size or info["channels"] != model.in_chans:
    raise ValueError(f"data.image_size={info['image_size']} with {info['channels']} channels is not "
                     f"allowed for {label}; its model takes {model.img_size} px, "
                     f"{model.in_chans} channels")


def evaluate_model(name: str, model, params, data_cfg, evals_cfg, names, mesh,
                   source: Dict[str, Any], layer_features: Sequence[str] = ()) -> Dict[str, Any]:
  """Runs the evaluators ``names`` on one model; returns its JSON record.

  ``layer_features`` adds per-block probes (the ``layers`` evaluator) for more feature choices,
  reported under ``sections['layers_by_feature'][choice]``; they share the encoder pass with the
  other evaluators.
  """
  import ml_collections
  from decay_jax.evals import features, runner
  from decay_jax.train import tasks
  config = ml_collections.ConfigDict({"task": "mae", "data": data_cfg.to_dict(),
                                      "evals": evals_cfg.to_dict()})
  record = {"name": name, "source": source, "model": model_summary(model),
            "data": data_cfg.to_dict(), "sections": {}, "seconds": {}, "settings": {}}
  task = tasks.MAETask(model)
  built = runner.build(config, task, mesh, names)  # checks every name first
  extra = {}
  for choice in layer_features:
    cfg = config.evals.layers.copy_and_resolve_references()
    cfg.feature = choice
    extra[choice] = runner.MAE_EVALUATORS["layers"](cfg, task, config.data, mesh)
  # One encoder pass per image set for all evaluators (they pool different blocks and tokens).
  batch = max(int(config.evals[k].batch_size) for k in list(built) + (["layers"] if extra else []))
  cache = features.FeatureCache(model, params, mesh, batch)
  for evaluator in list(built.values()) + list(extra.values()):
    if hasattr(evaluator, "requests"):
      for request in evaluator.requests():
        cache.want(*request)
      evaluator.cache = cache
  jobs = [(key, key, e) for key, e in built.items()]
  jobs += [(f"layers[{c}]", "layers", e) for c, e in extra.items()]
  for label, key, evaluator in jobs:
    t0 = time.perf_counter()
    logging.info("[%s] %s ...", name, label)
    sections = evaluator.evaluate(params)
    if label != key:
      record["sections"].setdefault("layers_by_feature", {})[evaluator.cfg.feature] = (
          sections["layers"])
    else:
      record["sections"].update(sections)
      record["settings"][key] = config.evals[key].to_dict()
    record["seconds"][label] = time.perf_counter() - t0
    logging.info("[%s] %s done in %.1f s", name, label, record["seconds"][label])
  return record
