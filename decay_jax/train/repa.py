"""REPA's representation alignment for SiT (Yu et al. 2024; docs/repa.md): the projection loss,
the frozen target encoder and the targets of a batch.

**Loss** (REPA ``loss.py``): for targets ``y_i (N, T, D_i)`` and projected SiT tokens
``z_i (N, T, D_i)``, ``L_proj = -mean_i mean_n mean_tau cos(z_i[n, tau], y_i[n, tau])`` with each
vector normalised as ``torch.nn.functional.normalize`` does (``v / max(|v|, 1e-12)``).

**Targets** reach the loss in the batch, as ``repa_target_I (N, T, D_I)``: either delivered by the
input stream (features stored beside the data) or computed in the step by ``targets`` from the
uint8 pixels (``repa_pixels``: the step keeps a pixel stream's images, a latent stream must
deliver them) with the frozen encoder, whose parameters are the train
state's ``frozen`` entry (sharded like parameters, never optimised, never averaged): the jitted step
takes them as an argument, so they are not constants baked into the program.

**Encoder interface** (``Encoder``): a Flax module, a ``preprocess`` of the pixels and a method
whose output holds the patch tokens. A DINOv2 (``models/dinov2.py``) uses its ``repa_preprocess``
and reads ``x_norm_patchtokens`` of its dict output; an MAE sees the
pixels normalised as it was trained (``repa.encoder_normalize``), encodes them without masking
(``features``) and gives its last block's patch tokens (class token dropped).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

import jax
import jax.numpy as jnp

from decay_jax import paths, validate
from decay_jax import sharding as shd
from decay_jax.data import augment, on_device
from decay_jax.data import latents as latents_lib
from decay_jax.data import config as data_config
from decay_jax.models import dinov2 as dinov2_lib
from decay_jax.models import mae as mae_lib
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import pretrained

NORM_EPS = 1e-12  # torch.nn.functional.normalize
TARGET = latents_lib.TARGET  # "repa_target_{}": a latent source delivers the stored ones
PIXELS = "repa_pixels"


def normalize(x):
  """``x / max(|x|_2, 1e-12)`` over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), NORM_EPS)


def proj_loss_per_example(zs, targets):
  """``(N,)``: minus the cosine similarity of ``zs[i]`` and ``targets[i]`` (each ``(N, T, D_i)``)
  averaged over tokens, then over targets (the batch mean of it is REPA's ``proj_loss``)."""
  per = [-(normalize(z) * normalize(y)).sum(-1).mean(-1) for z, y in zip(zs, targets)]
  return sum(per) / len(per)


@dataclasses.dataclass(frozen=True)
class Encoder:
  """A frozen target encoder: ``tokens(params, pixels) -> (N, T, D)`` float32, no gradient."""
  module: Any
  preprocess: Callable
  method: Optional[str] = None
  pick: Callable = lambda out: out

  def tokens(self, params, pixels):
    method = getattr(self.module, self.method) if self.method else None
    out = self.module.apply({"params": params}, self.preprocess(pixels), method=method)
    return jax.lax.stop_gradient(self.pick(out).astype(jnp.float32))


def encoder_for(module, normalize: str = "imagenet") -> Encoder:
  """The ``Encoder`` of a module: DINOv2 (REPA's ``preprocess_raw_image`` of uint8 pixels, its
  ``x_norm_patchtokens``) or an MAE (the pixels normalised by ``normalize``, a ``data.normalize``
  mode: the normalisation it was trained with)."""
  if isinstance(module, dinov2_lib.DINOv2):
    return Encoder(module, dinov2_lib.repa_preprocess, None, lambda out: out["x_norm_patchtokens"])
  if isinstance(module, mae_lib.MaskedAutoencoder):
    if normalize == "imagenet" and module.in_chans != 3:
      raise validate.not_allowed("repa.encoder_normalize", normalize, f"the MAE encoder takes "
                                 f"{module.in_chans} channel(s); ImageNet's statistics are for 3")
    mean, std = augment.normalization(SimpleNamespace(normalize=normalize), module.in_chans)
    return Encoder(module, lambda pixels: on_device.to_model_input(pixels, mean, std), "features",
                   lambda out: out[-1][:, 1:])
  raise ValueError(f"repa.encoder holds a {type(module).__name__}, which has no REPA target "
                   "interface (a DINOv2 or a MaskedAutoencoder)")


def load_encoder(directory: str, normalize: str, mae_task):
  """``(Encoder, params)`` of a params directory (``model.json`` + ``params``: a converted DINOv2
  or MAE) or of an MAE training workdir of ``decay_jax.cli.train`` (its latest trained weights;
  ``mae_task``: the MAE task class, ``train.tasks.mae.MAETask``, which reads it)."""
  if (paths.resolve(directory) / "config.json").exists():
    module, params = pretrained.load(directory, shd.make_mesh(), mae_task, what="repa.encoder")
  else:
    module, params = ckpt_lib.load_params(directory, "repa.encoder")
  return encoder_for(module, normalize), params


def check_config(config) -> None:
  """One-line errors for ``config.repa`` against ``config.model``."""
  repa, m = config.get("repa"), config.model
  if repa is None or not m.get("repa_depth", 0):
    return
  validate.check_range("repa.proj_coeff", repa.proj_coeff, 0.0)
  validate.check_choice("repa.encoder_normalize", repa.encoder_normalize, data_config.NORMALIZE)
  if repa.encoder and len(m.repa_dims) != 1:
    raise validate.not_allowed("model.repa_dims", tuple(m.repa_dims), "with repa.encoder (one "
                               "encoder) it must hold one width; several targets come in the batch")


def targets(batch: Dict[str, Any], count: int, encoder: Optional[Encoder], frozen) -> List:
  """The ``count`` targets of a batch: its ``repa_target_I``, or the encoder's tokens of its
  uint8 pixels ``repa_pixels``."""
  keys = [TARGET.format(i) for i in range(count)]
  if all(k in batch for k in keys):
    return [jax.lax.stop_gradient(batch[k].astype(jnp.float32)) for k in keys]
  if encoder is None or frozen is None:
    raise ValueError(f"model.repa_depth > 0 needs targets: set repa.encoder (a frozen encoder's "
                     f"params directory) or deliver {', '.join(keys)} in the batch")
  if PIXELS not in batch:
    raise ValueError("repa.encoder computes its targets from the pixels, which this stream does not "
                     f"deliver (latents): deliver {PIXELS} uint8 (N, H, W, 3) or the stored targets "
                     f"{', '.join(keys)}")
  return [encoder.tokens(frozen, batch[PIXELS])]


def check_targets(targets_: List, tokens: int, dims) -> None:
  """Each target must be ``(N, tokens, dims[i])`` (the SiT's token grid and projector width)."""
  for i, (y, d) in enumerate(zip(targets_, dims)):
    if y.shape[1:] != (tokens, d):
      raise ValueError(f"REPA target {i} has shape {tuple(y.shape)}; the model aligns {tokens} "
                       f"tokens of width model.repa_dims[{i}]={d} (N, {tokens}, {d})")
