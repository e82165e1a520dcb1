"""MAE ViT-B/16 exactly as the official command (MAE/srun.sh): alpha_min 0.7, effective batch 8192.

The official run is 8 GPUs x 256 images x accum_iter 4 = 8192 per optimiser step, so
lr = 1.5e-4 * 8192 / 256 = 4.8e-3, 800 epochs with 40 warmup epochs, norm-pix loss.
Command:
  python -m decay_jax.cli.train --config=configs/mae_vit_b16_official.py --workdir=$WORKDIR
Hardware: the official hardware is one node of 8 GPUs (accum_steps 4, 256 images per GPU per
  microbatch, as here). On 32+ chips set --config.accum_steps=1.
Expected time: not measured by us (8 GPUs: several days).
Expected result (the paper's): ImageNet-1k KNN 63.9%, linear probe 72.7% (ViT-B/16).
Compiled for its target (docs/tpu.md, 2026-12-07): v5p-16 (8 chips, 1024 per chip in 4
  microbatches): 36.0 of 88.5 GiB per chip, fits; cost-model MFU 33.4%; h100-8 (8 chips, 1024 per
  chip in 4 microbatches): 30.2 of 79.1 GiB per chip, fits; roofline MFU 21.5%.
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.mae_config()
  c.model.preset = "B/16"
  c.model.alpha_min = 0.7
  c.model.dtype = "bfloat16"
  c.batch_size = 8192
  c.accum_steps = 4
  c.checkpoint.every_steps = 1000
  c.checkpoint.keep_every_steps = 7800  # ~every 50 epochs, like checkpoint-{epoch:05d}.pth
  c.evals.knn.every_steps = 15_600
  return c
