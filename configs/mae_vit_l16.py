"""MAE ViT-L/16 with decayed identity shortcuts (alpha_min 0.6), 800 epochs, batch 4096.

The official code crashes for ViT-L (its 4 unused SkipLayers break DDP); here only the 8 used
SkipLayers exist, so it trains.
Command:
  python -m decay_jax.cli.train --config=configs/mae_vit_l16.py --workdir=$WORKDIR
Hardware: 64-128 chips (bfloat16 compute). For fewer chips raise accum_steps or set
  --config.mesh.fsdp to shard parameters and optimiser state.
Expected time: not measured by us; upstream MAE ViT-L/16 (plain residuals) took 15.4 h on 128
  TPU-v3 cores for 800 epochs.
Expected result: none published for the decayed ViT-L; the paper's tables report ViT-B/16.
Compiled for its target (docs/tpu.md, 2026-12-07): v5p-128 (64 chips, 64 per chip): 21.4 of 88.5
  GiB per chip, fits; cost-model MFU 26.7%.
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.mae_config()
  c.model.preset = "L/16"
  c.model.alpha_min = 0.6
  c.model.dtype = "bfloat16"
  return c
