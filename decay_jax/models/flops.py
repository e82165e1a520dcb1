"""Analytic model FLOPs (2 per multiply-add), the numerator of MFU as MaxText defines it.

Counted: every matmul of the forward pass, attention scores and values included; not counted:
norms, activations, softmax, additions. A training step costs 3x the forward (the backward pass
computes gradients for activations and weights). MAE's encoder sees only the visible tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from decay_jax.models import routing
from decay_jax.models import sit as sit_lib


def _block_macs(tokens: int, dim: int, mlp_ratio: float) -> float:
  """One transformer block on ``tokens`` tokens: qkv + proj + MLP, plus QK^T and AV."""
  return (4 + 2 * mlp_ratio) * dim * dim * tokens + 2 * tokens * tokens * dim


def mae_forward_flops(m) -> float:
  """Forward FLOPs of one example through ``MaskedAutoencoder`` ``m`` (masked, as in training)."""
  patch_dim = m.patch_size ** 2 * m.in_chans
  t_enc = 1 + m.len_keep
  t_dec = 1 + m.num_patches
  macs = m.num_patches * patch_dim * m.dim  # the conv runs on all patches before masking
  macs += m.depth * _block_macs(t_enc, m.dim, m.mlp_ratio)
  macs += m.num_skip_layers * t_dec * ((m.dim + m.decoder_dim) * m.decoder_dim
                                       + m.decoder_dim ** 2)
  macs += m.decoder_depth * _block_macs(t_dec, m.decoder_dim, m.mlp_ratio)
  macs += t_dec * m.decoder_dim * patch_dim
  return 2.0 * macs


def mae_feature_flops(m) -> float:
  """Forward FLOPs of the unmasked encoder (feature extraction for probes)."""
  t = 1 + m.num_patches
  macs = m.num_patches * m.patch_size ** 2 * m.in_chans * m.dim
  macs += m.depth * _block_macs(t, m.dim, m.mlp_ratio)
  return 2.0 * macs


def vit_forward_flops(m) -> float:
  """Forward FLOPs of the fine-tuning classifier: the unmasked encoder plus the head."""
  return mae_feature_flops(m) + 2.0 * m.dim * m.num_classes


def sit_forward_flops(m) -> float:
  """Forward FLOPs of one example through ``SiT`` ``m``."""
  t = m.grid ** 2
  d = m.dim
  macs = t * m.patch_size ** 2 * m.in_channels * d
  macs += 256 * d + d * d  # timestep MLP
  macs += m.depth * (_block_macs(t, d, m.mlp_ratio) + 6 * d * d)  # blocks + adaLN
  macs += routing.long_range_macs(m)  # decoder long-skip Linears, or the residual routing
  macs += 2 * d * d + t * d * m.patch_size ** 2 * m.out_channels
  return 2.0 * macs


def sit_train_flops(m) -> float:
  """Training FLOPs of one example through ``SiT`` ``m`` (forward + backward, 3x the forward),
  with REPA's projectors (three Linears per target on every token) when ``m.repa_depth``."""
  h = m.repa_hidden
  proj = sum(m.grid ** 2 * (m.dim * h + h * h + h * d) for d in m.repa_dims) if m.repa_depth else 0
  return 3.0 * (sit_forward_flops(m) + 2.0 * proj)


def uvit_forward_flops(m) -> float:
  """Forward FLOPs of one example through ``UViT`` ``m``: ``2K + 1`` blocks on ``extras + N``
  tokens, the long-skip Linears (``[x ; s]`` of width 2D, or D for 'add'; with hyper-connections
  ``W_x`` on each of the ``n`` streams and ``W_s`` once: ``(n + 1) D^2``), patch embedding, the
  optional time MLP, ``decoder_pred`` on every token and the final 3x3 conv. S/2 at 32 px:
  24.4 GFLOP (docs/uvit.md 3.1)."""
  t, d = m.extras + m.num_patches, m.dim
  patch_dim = m.patch_size ** 2 * m.in_chans
  res = m.block_residual
  streams = res.hyper_rate if res.hyper else 1
  macs = m.num_patches * patch_dim * d
  macs += m.num_blocks * _block_macs(t, d, m.mlp_ratio)
  macs += m.half * t * d * d * {"concat": 1 + streams, "add": 1, "none": 0}[m.skip_mode]
  macs += 8 * d * d if m.mlp_time_embed else 0
  macs += t * d * patch_dim
  macs += m.img_size ** 2 * 9 * m.in_chans ** 2 if m.conv else 0
  return 2.0 * macs


# Dense bf16 peak FLOP/s per device (vendor figures), for MFU. Unknown kinds (e.g. CPUs) give 0 and
# no MFU is reported; set ``peak_tflops_per_device`` in the config to override.
PEAK_TFLOPS_BF16 = {
    "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100": 989.0, "NVIDIA H200": 989.0,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100-SXM4-40GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0,
    "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v5": 459.0,
    "TPU v6 lite": 918.0, "TPU v6e": 918.0,
}


def peak_flops_per_device(override_tflops: float = 0.0) -> float:
  """Peak FLOP/s of the first device (0 when unknown)."""
  if override_tflops:
    return override_tflops * 1e12
  kind = jax.devices()[0].device_kind
  for name, tflops in PEAK_TFLOPS_BF16.items():
    if kind.startswith(name):
      return tflops * 1e12
  return 0.0


def overhead(model) -> dict:
  """Parameters (counted on the abstract init) and train FLOPs of the routing of SiT ``model``
  against the same SiT with ``residual_routing='plain'`` (the DiT baseline without long-range connections)."""
  def count(m):
    return sum(int(np.prod(l.shape)) for l in jax.tree_util.tree_leaves(sit_lib.abstract_params(m)))

  plain = dataclasses.replace(model, residual_routing="plain", routing_decay="after",
                              routing_gate=False)
  n, n0 = count(model), count(plain)
  f, f0 = 3 * sit_forward_flops(model), 3 * sit_forward_flops(plain)
  return {"residual_routing": model.residual_routing, "routing_decay": model.routing_decay,
          "plain_params": n0, "routing_params": n - n0,
          "routing_params_pct": round(100 * (n - n0) / n0, 4),
          "routing_gflops_per_example": round((f - f0) / 1e9, 4),
          "routing_flops_pct": round(100 * (f - f0) / f0, 4)}
