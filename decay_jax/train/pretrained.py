"""The pre-trained model a run starts from (``config.init_from``): an MAE for fine-tuning, a SiT
for a SiT run (the same SiT continued, or routing added to a plain one: docs/routing.md).

Either a training workdir of ``decay_jax.cli.train`` (its latest checkpoint's trained weights,
``params``, as a resumed run would continue, never its EMA; the model rebuilt from its
``config.json``) or a params directory (``model.json`` + ``params``, as written by
``decay_jax.cli.convert`` from an official checkpoint, e.g. REPA's EMA weights, or by
``save_params``). The decay schedule comes with the model's fields; it is never a default.
"""

from __future__ import annotations

from typing import Any, Tuple

from decay_jax import paths
from decay_jax.train import checkpoint as ckpt_lib


def load(init_from: str, mesh, source, what: str = "init_from") -> Tuple[Any, Any]:
  """``(model, its parameters)`` of ``init_from`` for a run starting from a model of the task
  class ``source`` (``train.tasks``: its ``model_class``, ``embed``, ``default_config`` and
  ``build_model``); one-line errors, naming the field ``what``, for anything else."""
  root = paths.resolve(init_from)
  if (root / "model.json").exists():
    model, params = ckpt_lib.load_params(init_from, what)
  elif (root / "config.json").exists():
    run_cfg = ckpt_lib.run_config(init_from, [source])
    params, _ = ckpt_lib.restore_run_params(init_from, mesh)
    channels = int(params[source.embed]["proj"]["kernel"].shape[2])
    model = source.build_model(run_cfg, {"image_size": run_cfg.data.image_size,
                                         "channels": channels})
  else:
    raise ckpt_lib.CheckpointError(
        f"{what}={init_from!r} is not allowed; it is neither a pre-training workdir "
        "(config.json and checkpoints/) nor a params directory (model.json and params/)")
  cls = source.model_class
  if not isinstance(model, cls):
    raise ValueError(f"{what}={init_from!r} is not allowed; it holds a {type(model).__name__}, "
                     f"a {source.name} model is needed here (a {cls.__name__})")
  return model, params
