"""U-ViT-M/4 on 64-pixel ImageNet (pixel space, no VAE): the paper's ImageNet-100 and ImageNet-1K
rows (docs/uvit.md). The argument picks the row:
  "in1k" (default): ImageNet-1K class-conditional, alpha_min 0.6;
  "in100_cond":     ImageNet-100 class-conditional, alpha_min 0.6;
  "in100_uncond":   ImageNet-100 unconditional, alpha_min 0.8.

Command:
  python -m decay_jax.cli.train --config=configs/uvit_m4_imagenet.py:in1k --workdir=$WORKDIR \
      --config.data.data_dir=$TFDS_DIR      # ImageNet-100: an image folder of your 100 classes,
      # --config=configs/uvit_m4_imagenet.py:in100_cond --config.data.dataset=imagefolder:$DIR
  (and --config.model.alpha_min=1.0 for the baseline of each row)
Hardware: eight GPUs or a TPU slice (bfloat16 compute). Expected time: not measured by us.
Expected result (the paper's, not reproduced here): FID ImageNet-1K class-conditional 4.90 at
  alpha_min 0.6 against 7.65 at 1.0; ImageNet-100 class-conditional 4.98 (0.6) against 6.93;
  ImageNet-100 unconditional FID 40.96 (0.8) against 44.40 and linear probe 74.5% against 72.8%.

Our choices where the paper is silent (docs/uvit.md): U-ViT's imagenet64_uvit_mid recipe (M/4,
130,940,292 parameters at 1000 classes; 300K steps at batch 1024; AdamW 3e-4, betas (0.99, 0.99),
weight decay 0.03, 5,000 warmup steps, EMA 0.9999; centre crop and flips), no guidance (the
paper's decayed FIDs are unguided), the ImageNet-100 class list left to the user.
Evaluation (config.evals.generation, docs/generation_metrics.md "Periodic evaluation"): FID of
  50,000 EMA samples, DPM-Solver-fast with 50 model calls, unguided (our choice, U-ViT's
  sampler), against ADM's VIRTUAL_imagenet64_labeled.npz (in1k) or a reference batch of your
  ImageNet-100 images (decay_jax.cli.fid --save_stats); enabled, 10,000 samples every 50K steps.
Compiled for its target (docs/tpu.md, 2026-12-07): v5p-16 (8 chips, 128 per chip): 21.5 of 88.5 GiB
  per chip, fits; cost-model MFU 36.9%.
"""

from decay_jax.train import config as config_lib

ROWS = {"in1k": ("imagenet2012", True, 0.6), "in100_cond": ("imagefolder:/path/to/imagenet100",
                                                              True, 0.6),
        "in100_uncond": ("imagefolder:/path/to/imagenet100", False, 0.8)}


def get_config(row: str = "in1k"):
  if row not in ROWS:
    raise ValueError(f"config argument {row!r} is not allowed; choose one of {sorted(ROWS)}")
  dataset, conditional, alpha_min = ROWS[row]
  c = config_lib.uvit_config()
  c.model.preset = "M/4"
  c.model.alpha_min = alpha_min
  c.model.conditional = conditional
  c.model.dtype = "bfloat16"
  c.model.remat_policy = "dots"  # U-ViT's ImageNet configs checkpoint every block
  c.data.dataset = dataset
  c.data.image_size = 64
  c.data.eval_split = "validation"
  c.batch_size = 1024
  c.num_train_steps = 300_000
  c.warmup_steps = 5000
  c.optim.lr = 3e-4
  c.optim.b2 = 0.99
  ref = "VIRTUAL_imagenet64_labeled.npz" if row == "in1k" else "imagenet100_ref.npz"
  c.evals.generation.update(inception="/path/to/fid_inception", ref=f"/path/to/{ref}")
  return c
