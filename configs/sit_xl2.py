"""SiT-XL/2 with decayed identity shortcuts as in the paper: alpha_min 0.8, batch 256, 400K steps,
ImageNet 256x256 as sd-vae-ft-ema latents (32x32x4, scaled by 0.18215).

Command (latents extracted once into $LATENTS, format in decay_jax/data/latents.py):
  python -m decay_jax.cli.train --config=configs/sit_xl2.py --workdir=$WORKDIR \
      --config.data.dataset=latents:$LATENTS
Hardware: the official run is 4 GPUs (64 images each); any device count dividing 256 works.
  bfloat16 compute here (the official code uses fp16 autocast). Blocks rematerialised ('dots'):
  at 64 images per chip the step needs 101.6 GiB per chip without (TPU compiler, docs/tpu.md),
  36.4 GiB with, and the compiler's cost model puts it 5% faster (fewer bytes moved).
Expected time: not measured by us. DiT-XL/2 at batch 256 runs ~5.7 it/s on TPU v3-256 (DiT paper),
  so 400K steps is roughly a day there; on 8 A100 at ~0.8 steps/s it is about a week.
Expected result (the paper's, not reproduced here): FID-50K 11.8 at 400K steps (alpha_min = 1:
  16.5), EMA weights, ADM evaluation suite.
Evaluation (config.evals.generation, docs/generation_metrics.md "Periodic evaluation"): FID-50K,
  sFID, IS, precision, recall of 50,000 EMA samples, SDE Euler-Maruyama 250 steps, no guidance
  (the SiT paper's FID sampler; the decay paper's own is not public) against ADM's
  VIRTUAL_imagenet256_labeled.npz; --config.evals.generation.enabled=True (with its ref,
  inception and vae paths) logs them on 2,000 samples every 50K steps.
Compiled for its target (docs/tpu.md, 2026-12-07): v5p-8 (4 chips, 64 per chip): 36.0 of 88.5 GiB
  per chip, fits; cost-model MFU 42.3%; h100-8 (8 chips, 32 per chip): 20.4 of 79.1 GiB per chip,
  fits; roofline MFU 27.5%.
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.sit_config()
  c.model.preset = "XL/2"
  c.model.alpha_min = 0.8
  c.model.dtype = "bfloat16"
  c.model.remat_policy = "dots"  # fits 64 images per 80-95 GB chip (docstring)
  c.data.dataset = "latents:/path/to/imagenet256_latents"
  # The reported evaluation (config.evals.generation; enable with the three paths set).
  c.evals.generation.update(ref="/path/to/VIRTUAL_imagenet256_labeled.npz",
                            inception="/path/to/fid_inception", vae="/path/to/sd_vae_ft_ema")
  return c
