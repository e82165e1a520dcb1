"""Mirror routing added to the released REPA SiT-XL/2 (4M steps) and fine-tuned 280K more steps,
the mirror-routing paper's best result (docs/routing.md, "Routing added to a pretrained SiT").

Command (REPA: the released SiT-XL/2 checkpoint converted once by `decay-jax convert repa`,
decay_jax/io/convert_repa.py, into a params directory; latents as for configs/sit_xl2.py):
  python -m decay_jax.cli.convert repa --checkpoint SiT-XL-2-256x256.pt --out $REPA
  python -m decay_jax.cli.train --config=configs/sit_repa_xl2_routing_finetune.py:START \
      --workdir=$WORKDIR --config.init_from=$REPA --config.data.dataset=latents:$LATENTS
  python -m decay_jax.cli.sample --workdir=$WORKDIR --num=50000 --mode=sde --cfg=1.0
START (default mirror): mirror (function-preserving: gated, g = 0), mirror_paper (the paper's
  start as far as it is public: w = 0, uniform routing, no gate), fused_mirror,
  fused_mirror_paper, or plain (REPA continued 280K steps without routing: the baseline).
Hardware: 8+ GPUs or TPU chips (bfloat16 compute; REPA trained on 8 H100 at batch 256).
Expected time: not measured by us; 280K steps of SiT-XL/2 at batch 256, about 5 days on 8 A100 at
  the 0.8 steps/s of configs/sit_xl2.py (routing adds 0.03% FLOPs).
Expected result (the paper's, not reproduced here): FID-50K without guidance 5.9 (REPA, 4M steps)
  -> 4.94 after the routed fine-tune. The paper's fine-tune initialisation, optimiser and whether
  REPA's alignment loss stays on are not public; this config keeps REPA's optimiser (AdamW lr 1e-4,
  no weight decay, batch 256, EMA 0.9999) and drops the alignment loss with its projectors (set
  model.repa_depth=8, repa_dims=(768,) and repa.encoder to keep it: docs/repa.md).

The model fields must be the converted checkpoint's (its model.json): REPA's SiT is a plain SiT
(residual_routing 'plain', alpha_min 1, no long skip) without a sigma output (learn_sigma False)
that runs in REPA's time and velocity convention (flow_convention 'repa'); a field that differs
stops the run at its start, in one line.
Compiled for its target (docs/tpu.md, 2026-12-07): v5p-16 (8 chips, 32 per chip): 20.2 of 88.5 GiB
  per chip, fits; cost-model MFU 36.4%.
"""

import os
import runpy

# Start -> model fields (the source is a plain SiT; docs/routing.md "Routing added to a
# pretrained SiT").
STARTS = {
    "mirror": dict(residual_routing="mirror", routing_gate=True),
    "mirror_paper": dict(residual_routing="mirror", routing_gate=False),
    "fused_mirror": dict(residual_routing="fused_mirror", routing_gate=True),
    "fused_mirror_paper": dict(residual_routing="fused_mirror", routing_gate=False),
    "plain": dict(residual_routing="plain", routing_gate=False),
}


def apply_start(c, start: str):
  """Sets the routing fields of ``start`` on config ``c``; returns ``c``."""
  if start not in STARTS:
    raise ValueError(f"start={start!r} is not allowed; choose one of "
                     f"{', '.join(map(repr, STARTS))}")
  for k, v in STARTS[start].items():
    c.model[k] = v
  return c


def sibling(name: str) -> dict:
  """The namespace of ``configs/<name>.py`` (configs are files, not a package)."""
  return runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))


def get_config(start: str = "mirror"):
  c = sibling("sit_xl2")["get_config"]()
  c.model.alpha_min = 1.0  # REPA: plain residuals
  c.model.learn_sigma = False
  c.model.flow_convention = "repa"  # the converted weights answer in REPA's convention inside
  c.init_from = "/path/to/repa_sit_xl2"  # a params directory of `decay-jax convert repa`
  c.num_train_steps = 280_000
  return apply_start(c, start)
