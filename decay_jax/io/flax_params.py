"""Flax weights for ``to-torch``: a training workdir's checkpoint (orbax) or a params directory,
read with their model and checked against it. Every failure is one ``InputError`` line naming
``--params`` (or ``--step``, ``--weights``)."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Mapping, Optional

import jax
import numpy as np
from flax import traverse_util

from decay_jax import paths
from decay_jax import sharding as shd
from decay_jax.io.inputs import bad_input, error_detail
from decay_jax.io.official import mae_init_args
from decay_jax.io.rules import abstract_params
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib
from decay_jax.train import checkpoint, tasks
from decay_jax.validate import InputError

PARAMS_EXPECTED = ("a training workdir (config.json and checkpoints/, from decay_jax.cli.train) or a "
                   "params directory (model.json and params/, from this converter)")


def _unreadable(e: checkpoint.CheckpointError, what: str, full: str, directory: str) -> InputError:
  """A ``CheckpointError`` about ``what=full`` as the same line about ``--params directory``."""
  text = str(e)
  for prefix in (f"{what}={full!r} is not allowed; ", f"{what}={full!r} "):
    if text.startswith(prefix):
      return bad_input("--params", directory, text[len(prefix):])
  return bad_input("--params", directory, text)


@contextlib.contextmanager
def _quiet_orbax():
  """Holds back library warnings while a checkpoint is read: orbax logs one for each file that a
  corrupt checkpoint lacks before it raises, and the error line already says what is wrong."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _restore(full: str, directory: str, mesh, step: int, key: str):
  try:
    with _quiet_orbax():
      weights, _ = checkpoint.restore_run_params(full, mesh, step, key)
  except checkpoint.CheckpointError as e:
    raise _unreadable(e, "workdir", full, directory) from None
  return jax.device_get(weights)


def _is_sit(params: Mapping) -> bool:
  """Whether ``params`` are a SiT's: its patch embedding is ``x_embedder`` (an MAE's is
  ``patch_embed``)."""
  return "x_embedder" in params


def _refuse_weights_of_sit(params: Mapping, weights: Optional[str]) -> None:
  if weights is not None and _is_sit(params):
    raise bad_input("--weights", weights, "to-torch of a SiT writes both 'model' (the params) and "
                    "'ema'; leave --weights out")


def read_params(directory: str, step: Optional[int] = None, weights: Optional[str] = None):
  """``(model, params, ema, source)`` of a training workdir or a params directory.

  A workdir gives its newest checkpoint (or ``step``) and the model of its ``config.json``;
  ``weights`` ('model' or 'ema') picks an MAE run's weights; a SiT run gives params and, where the
  run kept them, the EMA (else ``ema`` is ``None``). A params directory gives its one set of
  weights.
  Every failure is one ``InputError`` line naming ``--params`` (or ``--step``, ``--weights``).
  """
  root = paths.resolve(directory)
  full = os.fspath(root)
  try:
    exists, is_dir = root.exists(), root.is_dir()
  except Exception as e:  # pylint: disable=broad-except
    raise bad_input("--params", directory, f"cannot be opened ({error_detail(e)})",
                    PARAMS_EXPECTED) from None
  if not exists:
    raise bad_input("--params", directory, "no such directory", PARAMS_EXPECTED)
  if not is_dir:
    raise bad_input("--params", directory, "is a file, not a directory", PARAMS_EXPECTED)
  if (root / "model.json").exists():
    for name, value in (("--step", step), ("--weights", weights)):
      if value is not None:
        raise bad_input(name, value, f"is for a training workdir; {directory} is a params "
                        "directory (one set of weights)")
    try:
      with _quiet_orbax():
        model, params = checkpoint.load_params(full, "params")
    except checkpoint.CheckpointError as e:
      raise _unreadable(e, "params", full, directory) from None
    except ValueError as e:  # fields that the model class refuses
      raise bad_input("--params", directory, f"its model.json is not a model ({e})",
                      PARAMS_EXPECTED) from None
    return model, jax.device_get(params), None, f"params directory {directory}"
  if not (root / "config.json").exists():
    raise bad_input("--params", directory, "has neither model.json nor config.json",
                    PARAMS_EXPECTED)
  try:
    config = tasks.run_config(full)
  except checkpoint.CheckpointError as e:
    raise _unreadable(e, "workdir", full, directory) from None
  except (ValueError, TypeError) as e:
    raise bad_input("--params", directory, f"its config.json is not a training config ({e})",
                    PARAMS_EXPECTED) from None
  try:
    steps = checkpoint.checkpoint_steps(full)
  except Exception as e:  # pylint: disable=broad-except
    raise bad_input("--params", directory, "its checkpoints/ cannot be listed "
                    f"({error_detail(e)})", PARAMS_EXPECTED) from None
  if not steps:
    raise bad_input("--params", directory, "is a training workdir with no finished checkpoint "
                    "in checkpoints/", "a run that saved at least one step")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise bad_input("--step", step, f"{directory} has checkpoints at steps {steps}")
  mesh = shd.make_mesh(1, 1)  # one device: the weights are read whole, to be written whole
  first = "ema" if weights == "ema" else "params"
  try:
    params = _restore(full, directory, mesh, step, first)
  except InputError:
    raise
  except ValueError:  # restore_run_params: the checkpoint holds no such subtree
    if first == "params":
      raise bad_input("--params", directory, f"the checkpoint of step {step} holds no params",
                      PARAMS_EXPECTED) from None
    # A SiT run refuses --weights whether or not it kept an EMA; an MAE run says it kept none.
    _refuse_weights_of_sit(_restore(full, directory, mesh, step, "params"), weights)
    raise bad_input("--weights", "ema", f"the checkpoint of step {step} in {directory} holds no "
                    "EMA weights (the run had ema_decay 0)") from None
  _refuse_weights_of_sit(params, weights)
  ema = None
  if _is_sit(params):  # the official SiT file holds the EMA too, where the run kept one
    try:
      ema = _restore(full, directory, mesh, step, "ema")
    except InputError:
      raise
    except ValueError:  # no 'ema' subtree: the run had ema_decay 0
      pass
  source = f"training workdir {directory}, step {step}"
  try:
    embed = params["x_embedder" if _is_sit(params) else "patch_embed"]["proj"]["kernel"]
    model = tasks.build_model(config, {"image_size": config.data.image_size,
                                       "channels": int(embed.shape[2])})
  except (KeyError, TypeError, IndexError, ValueError) as e:
    raise bad_input("--params", directory, f"its config.json and checkpoint do not make a model "
                    f"({error_detail(e)})", PARAMS_EXPECTED) from None
  return model, params, ema, source


def check_params_match(model, params: Mapping, arg: str, value: str) -> None:
  """Every leaf of ``params`` has the shape ``model`` gives it, and no leaf is missing or extra."""
  is_mae = isinstance(model, mae_lib.MaskedAutoencoder)
  init = mae_init_args(model) if is_mae else sit_lib.init_args(model)
  want = {p: tuple(s.shape) for p, s in abstract_params(model, *init).items()}
  got = {p: tuple(np.shape(v)) for p, v in traverse_util.flatten_dict(dict(params)).items()}
  bad = [f"{'/'.join(p)} {got.get(p, 'missing')} (the model has {want.get(p, 'none')})"
         for p in sorted(set(want) | set(got)) if want.get(p) != got.get(p)]
  if bad:
    raise bad_input(arg, value, f"its weights do not fit its model: {'; '.join(bad[:3])}"
                    f"{' ...' if len(bad) > 3 else ''}")
