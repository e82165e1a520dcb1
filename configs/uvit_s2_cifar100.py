"""U-ViT-S/2 on CIFAR-100, unconditional: the paper's CIFAR-100 row (docs/uvit.md), alpha_min 0.7.

Command:
  python -m decay_jax.cli.train --config=configs/uvit_s2_cifar100.py --workdir=$WORKDIR \
      --config.data.data_dir=$TFDS_DIR    # and --config.model.alpha_min=1.0 for the baseline
  python -m decay_jax.cli.sample --workdir=$WORKDIR --num=50000   # then decay_jax.cli.fid
Hardware: one to eight GPUs (bfloat16 compute). Expected time: not measured by us; about 3.3 h
  of one H200 at 40% MFU for the 500K x 128 images (docs/uvit.md, from 73 GFLOP per image).
Expected result (the paper's, not reproduced here): linear probe 66.86% and FID 8.99 at
  alpha_min 0.7, against 62.47% and 14.34 for plain U-ViT (alpha_min 1.0).

Our choices where the paper is silent (docs/uvit.md): U-ViT's cifar10_uvit_small recipe unchanged
(S/2, 44,255,328 parameters; 500K steps at batch 128; AdamW 2e-4, betas (0.99, 0.999), weight decay
0.03, 2,500 warmup steps, EMA 0.9999; random flips), the sublayer schedule and zero-initialised
branch outputs; FID of 50K DPM-Solver-fast samples (50 model calls, EMA) against CIFAR-100 train.
Evaluation (config.evals.generation, docs/generation_metrics.md "Periodic evaluation"): those
  settings (report_num 50,000); enabled, 10,000 samples every 50K steps as U-ViT's train.py,
  against a reference batch of the CIFAR-100 training images (decay_jax.cli.fid --save_stats).
Compiled for its target (docs/tpu.md, 2026-12-07): v5e-8 (8 chips, 16 per chip): 5.0 of 14.9 GiB
  per chip, fits; roofline MFU 12.2%.
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.uvit_config()
  c.model.preset = "S/2"
  c.model.alpha_min = 0.7
  c.model.dtype = "bfloat16"
  c.data.dataset = "cifar100"
  c.evals.generation.update(ref="/path/to/cifar100_train_ref.npz",
                            inception="/path/to/fid_inception")
  return c
