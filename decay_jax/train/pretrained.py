"""The pre-trained MAE a fine-tuning run starts from (``config.init_from``).

Either a pre-training workdir of ``decay_jax.cli.train`` (its latest checkpoint's parameters, the model
rebuilt from its ``config.json``) or a params directory (``model.json`` + ``params``, as written by
``decay_jax.cli.convert mae`` from an official checkpoint or by ``save_params``). The decay schedule
comes with the model's fields; it is never a default.
"""

from __future__ import annotations

from typing import Any, Tuple

from decay_jax import paths
from decay_jax.models import factory
from decay_jax.models import mae as mae_lib
from decay_jax.train import checkpoint as ckpt_lib


def load(init_from: str, mesh) -> Tuple[mae_lib.MaskedAutoencoder, Any]:
  """``(MAE model, its parameters)`` of ``init_from``; one-line errors for anything else."""
  root = paths.resolve(init_from)
  if (root / "model.json").exists():
    model, params = ckpt_lib.load_params(init_from, "init_from")
  elif (root / "config.json").exists():
    run_cfg = ckpt_lib.run_config(init_from, task="mae")
    params, _ = ckpt_lib.restore_run_params(init_from, mesh)
    channels = int(params["patch_embed"]["proj"]["kernel"].shape[2])
    model = factory.build_model(run_cfg, {"image_size": run_cfg.data.image_size,
                                          "channels": channels})
  else:
    raise ckpt_lib.CheckpointError(
        f"init_from={init_from!r} is not allowed; it is neither a pre-training workdir "
        "(config.json and checkpoints/) nor a params directory (model.json and params/)")
  if not isinstance(model, mae_lib.MaskedAutoencoder):
    raise ValueError(f"init_from={init_from!r} is not allowed; it holds a {type(model).__name__}, "
                     "fine-tuning starts from a MaskedAutoencoder")
  return model, params
