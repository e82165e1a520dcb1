"""The mirror-routing ablation on SiT-S/2 (docs/routing.md 9), one row per
config string: batch 256, 400K steps, ImageNet 256 latents, AdamW 1e-4, EMA 0.9999 (configs/sit_s2.py).

Command (ROW is one of the rows below; without ':ROW' the row is fused_mirror):
  python -m decay_jax.cli.train --config=configs/sit_s2_routing.py:ROW --workdir=$WORKDIR/ROW \
      --config.data.dataset=latents:$LATENTS
  python -m decay_jax.cli.sample --workdir=$WORKDIR/ROW --num=50000 --sampler=eval --vae=$VAE
  (--sampler=eval: the evaluation of configs/sit_s2.py, SDE Euler 250 steps, no guidance)
Hardware: one to eight GPUs (bfloat16 compute), like configs/sit_s2.py.
Expected time: not measured by us; routing adds < 0.5% FLOPs to SiT-S/2 (docs/routing.md).
Expected result: the FID-50K at 400K steps the paper summary reports for DiT-S/2 (DDPM, so compare
  the differences between rows, not the values: this is SiT's linear flow matching):

  row                         model                                            FID (paper)
  baseline                    plain DiT residuals, no long skip                 69.81
  static_skip                 U-ViT concat + Linear mirror skip                 67.90
  mirror                      mirror adaptive routing, decoder only             64.83
  fused_last                  encoder routing + decoder (x, x_K)                66.05
  fused_first                 encoder routing + decoder (x, x_0)                not given
  fused_all                   encoder routing + decoder (x, x_0..x_K)           63.48
  attnres                     dense Attention Residuals                         62.87
  fused_mirror                encoder routing + decoder (x, x_{K-j+1})          62.48
  decay                       plain residuals decayed to alpha_min 0.8           not published
  mirror_decay                mirror, decayed (A: alpha x~ + f(x~)), 0.8        not published
  fused_mirror_decay          fused_mirror, decayed (A), 0.8                    not published
  fused_mirror_decay_current  fused_mirror, only the stream decayed (B), 0.8    not published

The official decayed SiT-S/2 (long skips through a Linear, alpha_min 0.8) is configs/sit_s2.py.
Compiled for its target (docs/tpu.md, 2026-12-07): v5e-8 (8 chips, 32 per chip): 1.9 of 14.9 GiB
  per chip, fits; roofline MFU 8.5%.
"""

import os
import runpy

ROWS = {
    "baseline": dict(residual_routing="plain", alpha_min=1.0),
    "static_skip": dict(residual_routing="static_skip", alpha_min=1.0),
    "mirror": dict(residual_routing="mirror", alpha_min=1.0),
    "fused_last": dict(residual_routing="fused_last", alpha_min=1.0),
    "fused_first": dict(residual_routing="fused_first", alpha_min=1.0),
    "fused_all": dict(residual_routing="fused_all", alpha_min=1.0),
    "attnres": dict(residual_routing="attnres", alpha_min=1.0),
    "fused_mirror": dict(residual_routing="fused_mirror", alpha_min=1.0),
    "decay": dict(residual_routing="plain", alpha_min=0.8),
    "mirror_decay": dict(residual_routing="mirror", alpha_min=0.8, routing_decay="after"),
    "fused_mirror_decay": dict(residual_routing="fused_mirror", alpha_min=0.8,
                               routing_decay="after"),
    "fused_mirror_decay_current": dict(residual_routing="fused_mirror", alpha_min=0.8,
                                       routing_decay="current"),
}


def sibling(name: str) -> dict:
  """The namespace of ``configs/<name>.py`` (configs are files, not a package)."""
  return runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))


def apply_row(c, row: str):
  """Sets the model fields of ablation ``row`` on config ``c``; returns ``c``."""
  if row not in ROWS:
    raise ValueError(f"row={row!r} is not allowed; choose one of {', '.join(map(repr, ROWS))}")
  for k, v in ROWS[row].items():
    c.model[k] = v
  return c


def get_config(row: str = "fused_mirror"):
  return apply_row(sibling("sit_s2")["get_config"](), row)
