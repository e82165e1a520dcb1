"""SiT-S/2 with decayed identity shortcuts (alpha_min 0.8), batch 256, 400K steps, ImageNet 256
latents (the smallest SiT; the mirror-routing ablations use this size).

Command:
  python -m decay_jax.cli.train --config=configs/sit_s2.py --workdir=$WORKDIR \
      --config.data.dataset=latents:$LATENTS
Hardware: one to eight GPUs (bfloat16 compute).
Expected time: not measured by us.
Expected result: none published for the decayed SiT-S/2; upstream SiT-S/2 (plain residuals)
  reports FID-50K 57.6 at 400K steps (SiT paper).
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.sit_config()
  c.model.preset = "S/2"
  c.model.alpha_min = 0.8
  c.model.dtype = "bfloat16"
  c.data.dataset = "latents:/path/to/imagenet256_latents"
  return c
