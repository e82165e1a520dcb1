"""MAE ViT-B/16 with decayed identity shortcuts, as in the paper: alpha_min 0.6, 800 epochs.

Command (ImageNet-1k as TFDS ArrayRecord, prepared once, or an ImageFolder tree; docs/data.md):
  python -m decay_jax.cli.train --config=configs/mae_vit_b16.py --workdir=$WORKDIR
  (add --config.data.data_dir=$TFDS_DIR, or --config.data.dataset=imagefolder:/data/imagenet with
  train/ and val/ class folders; on a pod use launch/tpu_pod.sh, on GPUs launch/slurm.sh)
Hardware: written for 32-128 TPU/GPU chips; any device count that divides the batch works, and
  accum_steps splits the batch into microbatches when memory is short. bfloat16 compute with a
  float32 encoder stream, parameters and loss, as the official code's fp16 autocast
  (docs/official_code.md 1.11); the TPU compiler's cost model of both: docs/tpu.md.
Expected time: not measured by us. Upstream MAE reports ViT-L/16 800 epochs in 15.4 h on 128
  TPU-v3 cores; ViT-B needs roughly a third of ViT-L's compute.
Expected result (the paper's, not reproduced here): ImageNet-1k KNN 63.9% (baseline 27.4%),
  linear probe 72.7% (baseline 67.8%). The batch size of the paper is not stated in the official
  code; this config uses upstream MAE's 4096 (see mae_vit_b16_official.py for the released 8192).
Compiled for its target (docs/tpu.md, 2026-12-07): v5p-64 (32 chips, 128 per chip): 17.7 of 88.5
  GiB per chip, fits; cost-model MFU 29.4%; v5e-64 (64 chips, 64 per chip): 9.2 of 14.9 GiB per
  chip, fits; roofline MFU 14.1%.
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.mae_config()
  c.model.preset = "B/16"
  c.model.alpha_min = 0.6
  c.model.dtype = "bfloat16"  # the official run's autocast (docstring)
  return c
