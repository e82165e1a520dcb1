"""SiT-B/2 with decayed identity shortcuts (alpha_min 0.8), batch 256, 400K steps, ImageNet 256
latents (the DiT/SiT ablation size).

Command:
  python -m decay_jax.cli.train --config=configs/sit_b2.py --workdir=$WORKDIR \
      --config.data.dataset=latents:$LATENTS
Hardware: 8 GPUs or a TPU v4-8 and up (bfloat16 compute).
Expected time: not measured by us (about a fifth of SiT-XL/2's compute per step).
Expected result: none published for the decayed SiT-B/2; upstream SiT-B/2 (plain residuals)
  reports FID-50K 33.0 at 400K steps (SiT paper, ODE sampler, no CFG).
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.sit_config()
  c.model.preset = "B/2"
  c.model.alpha_min = 0.8
  c.model.dtype = "bfloat16"
  c.data.dataset = "latents:/path/to/imagenet256_latents"
  return c
