"""MAE ViT-H/14 with decayed identity shortcuts (alpha_min 0.6), 800 epochs, batch 4096.

The official code crashes for ViT-H (8 unused SkipLayers); here it trains. Activation memory is
large: the config turns on rematerialisation of the blocks and FSDP over 8 chips.
Command:
  python -m decay_jax.cli.train --config=configs/mae_vit_h14.py --workdir=$WORKDIR
Hardware: 64+ chips with >= 32 GB each (bfloat16 compute, remat 'dots', fsdp 8): XLA's estimate
  is 20.0 GiB per device at 64 images per chip (`python -m decay_jax.cli.memory
  --config=configs/mae_vit_h14.py --devices=64`; docs/performance.md, "Does it fit").
Expected time: not measured by us; upstream MAE ViT-H/14 (plain residuals, 8-block decoder) took
  34.5 h on 128 TPU-v3 cores for 800 epochs.
Expected result: none published for the decayed ViT-H.
Compiled for its target (docs/tpu.md, 2026-12-07): v5p-128 (64 chips, 64 per chip): 12.7 of 88.5
  GiB per chip, fits; cost-model MFU 25.5%.
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.mae_config()
  c.model.preset = "H/14"
  c.model.alpha_min = 0.6
  c.model.dtype = "bfloat16"
  c.model.remat_policy = "dots"
  c.mesh.fsdp = 8
  return c
