"""SiT-B/2 with decayed identity shortcuts (alpha_min 0.8), batch 256, 400K steps, ImageNet 256
latents (the DiT/SiT ablation size).

Command:
  python -m decay_jax.cli.train --config=configs/sit_b2.py --workdir=$WORKDIR \
      --config.data.dataset=latents:$LATENTS
Hardware: 8 GPUs or a TPU v4-8 and up (bfloat16 compute).
Expected time: not measured by us (about a fifth of SiT-XL/2's compute per step).
Expected result: none published for the decayed SiT-B/2; upstream SiT-B/2 (plain residuals)
  reports FID-50K 33.0 at 400K steps (SiT paper, ODE sampler, no CFG).
Evaluation (config.evals.generation, docs/generation_metrics.md "Periodic evaluation"): FID-50K,
  sFID, IS, precision, recall of 50,000 EMA samples, SDE Euler-Maruyama 250 steps, no guidance
  (the SiT paper's FID sampler; the decay paper's own is not public) against ADM's
  VIRTUAL_imagenet256_labeled.npz; --config.evals.generation.enabled=True (with its ref,
  inception and vae paths) logs them on 2,000 samples every 50K steps.
Compiled for its target (docs/tpu.md, 2026-12-07): v4-8 (4 chips, 64 per chip): 28.7 of 32.0 GiB
  per chip, fits; roofline MFU 15.9%.
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.sit_config()
  c.model.preset = "B/2"
  c.model.alpha_min = 0.8
  c.model.dtype = "bfloat16"
  c.data.dataset = "latents:/path/to/imagenet256_latents"
  # The reported evaluation (config.evals.generation; enable with the three paths set).
  c.evals.generation.update(ref="/path/to/VIRTUAL_imagenet256_labeled.npz",
                            inception="/path/to/fid_inception", vae="/path/to/sd_vae_ft_ema")
  return c
