"""One model through the representation evaluators: the record behind reports and studies.

``evaluate_model`` runs the evaluators of ``decay_jax.evals.registry`` (knn, linear, layers, rank) on
one MAE encoder (or the probe view of a U-ViT: knn, linear, layers) with one shared feature cache and returns a JSON-able record (``evals.report`` turns
records into Markdown and plots). Used by ``decay_jax.cli.evaluate`` and ``research.small_scale_study.run``.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Sequence

import ml_collections
from absl import logging

from decay_jax import validate
from decay_jax.data import pipeline
from decay_jax.evals import diffusion_probe, features, registry
from decay_jax.models import factory


def run_model(config, params, probe_t: float = diffusion_probe.PROBE_T):
  """The model of a run's config; channels (and a U-ViT's classes) from the checkpoint. A U-ViT
  comes as its probe view (``diffusion_probe.probed`` at noise level ``probe_t``)."""
  embed = params["patch_embed"]
  channels = int(embed.get("proj", embed)["kernel"].shape[2])  # MAE: patch_embed.proj; U-ViT: patch_embed
  info = {"image_size": config.data.image_size, "channels": channels}
  if "diffusion" not in config:  # a representation model (MAE); U-ViT runs carry a diffusion section
    return factory.build_model(config, info, factory.mae)
  dropout = config.diffusion.class_dropout_prob > 0
  rows = params["label_emb"]["embedding"].shape[0] if "label_emb" in params else 0
  model = factory.build_model(config, dict(info, num_classes=rows - dropout), factory.uvit)
  return diffusion_probe.probed(model, probe_t, rows - 1 if dropout else -1,
                                config.diffusion.schedule)


def check_data(model, data_cfg, label: str) -> None:
  info = pipeline.dataset_info(data_cfg)
  if info["image_size"] != model.img_size or info["channels"] != model.in_chans:
    raise validate.not_allowed(
        "data.image_size", info["image_size"],
        f"{label}'s model takes {model.img_size} px with {model.in_chans} channels "
        f"(the data has {info['channels']})")


def evaluate_model(name: str, model, params, data_cfg, evals_cfg, names, mesh,
                   source: Dict[str, Any], layer_features: Sequence[str] = ()) -> Dict[str, Any]:
  """Runs the evaluators ``names`` on one model; returns its JSON record.

  ``layer_features`` adds per-block probes (the ``layers`` evaluator) for more feature choices,
  reported under ``sections['layers_by_feature'][choice]``; they share the encoder pass with the
  other evaluators.
  """
  config = ml_collections.ConfigDict({"task": "mae", "data": data_cfg.to_dict(),
                                      "evals": evals_cfg.to_dict()})
  record = {"name": name, "source": source, "model": factory.summary(model),
            "data": data_cfg.to_dict(), "sections": {}, "seconds": {}, "settings": {}}
  built = registry.build(config, model, mesh, names)  # checks every name first
  extra = {}
  for choice in layer_features:
    cfg = config.evals.layers.copy_and_resolve_references()
    cfg.feature = choice
    extra[choice] = registry.EVALUATORS["layers"](cfg, model, config.data, mesh)
  # One encoder pass per image set for all evaluators (they pool different blocks and tokens).
  batch = max(int(config.evals[k].batch_size) for k in list(built) + (["layers"] if extra else []))
  cache = features.FeatureCache(model, params, mesh, batch, config.data)
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
