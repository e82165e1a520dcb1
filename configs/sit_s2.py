"""SiT-S/2 with decayed identity shortcuts (alpha_min 0.8), batch 256, 400K steps, ImageNet 256
latents (the smallest SiT; the mirror-routing ablations use this size).

Command:
  python -m decay_jax.cli.train --config=configs/sit_s2.py --workdir=$WORKDIR \
      --config.data.dataset=latents:$LATENTS
Hardware: one to eight GPUs (bfloat16 compute).
Expected time: not measured by us.
Expected result: none published for the decayed SiT-S/2; upstream SiT-S/2 (plain residuals)
  reports FID-50K 57.6 at 400K steps (SiT paper).
Evaluation (config.evals.generation, docs/generation_metrics.md "Periodic evaluation"): FID-50K,
  sFID, IS, precision, recall of 50,000 EMA samples, SDE Euler-Maruyama 250 steps, no guidance
  (the SiT paper's FID sampler; the decay paper's own is not public) against ADM's
  VIRTUAL_imagenet256_labeled.npz; --config.evals.generation.enabled=True (with its ref,
  inception and vae paths) logs them on 2,000 samples every 50K steps.
Compiled for its target (docs/tpu.md, 2026-12-07): v5e-8 (8 chips, 32 per chip): 7.0 of 14.9 GiB
  per chip, fits; roofline MFU 9.5%.
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.sit_config()
  c.model.preset = "S/2"
  c.model.alpha_min = 0.8
  c.model.dtype = "bfloat16"
  c.data.dataset = "latents:/path/to/imagenet256_latents"
  # The reported evaluation (config.evals.generation; enable with the three paths set).
  c.evals.generation.update(ref="/path/to/VIRTUAL_imagenet256_labeled.npz",
                            inception="/path/to/fid_inception", vae="/path/to/sd_vae_ft_ema")
  return c
