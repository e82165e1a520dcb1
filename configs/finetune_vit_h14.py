"""Fine-tuning a pre-trained MAE ViT-H/14 on ImageNet-1K, upstream MAE's recipe (docs/finetune.md):
batch 1024, base lr 1e-3 (lr 4e-3), layer decay 0.75, drop path 0.3, 50 epochs (5 warmup), AdamW
(0.9, 0.999), weight decay 0.05, Mixup 0.8 / CutMix 1.0 per 32 examples, label smoothing 0.1.

Command (PRE: a pre-training workdir of configs/mae_vit_h14.py, or a params directory written by
`python -m decay_jax.cli.convert mae --checkpoint checkpoint-799.pth --out PRE`):
  python -m decay_jax.cli.train --config=configs/finetune_vit_h14.py --workdir=$WORKDIR \
      --config.init_from=$PRE
Hardware: 32+ GPUs or TPU chips (bfloat16 compute); fewer with --config.accum_steps.
Expected time: not measured by us; about 13 h on 64 V100 for upstream's run.
Expected result (not reproduced here): top-1 86.9 (upstream MAE, standard residuals).
Compiled for its target (docs/tpu.md, 2026-12-07): v5p-64 (32 chips, 32 per chip): 44.9 of 88.5 GiB
  per chip, fits; cost-model MFU 58.9%.
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.finetune_config()
  c.model.preset = "H/14"  # used only without init_from
  c.model.dtype = "bfloat16"
  c.model.drop_path = 0.3
  c.optim.base_lr = 1e-3
  c.optim.layer_decay = 0.75
  c.num_epochs = 50.0
  return c
