"""Small-scale study (issue 9): MAE-tiny on 10,000 CIFAR-10 images, 8,000 to train, 2,000 to test.

Command (every arm of one grid, resumable; grids and arms in decay_jax/evals/study.py):
  python -m decay_jax.study --config=configs/study_cifar10k.py --workdir=/tmp/study --grid=alpha
  python -m decay_jax.study --config=configs/study_cifar10k.py --workdir=/tmp/study --list
  (add --archive=docs/study_records to keep every finished arm's record in the repository)
Hardware: 2 CPU cores (measured below); one GPU should take minutes for the whole grid (an
estimate from 1.35 GFLOP per training image, not measured).
Expected time (measured 2026-11-30/12-03, 2-core Xeon/EPYC, fp32): 80 min to 2 h per 30-epoch arm;
the machine's speed differed between sessions (train step 68 or 50 images/s in ``bench``). An arm
is ten in-training KNN passes of 67-80 s, a final evaluation of 2-2.5 min, and the training.
Times per arm in docs/small_scale_study.md.
Expected result (measured, docs/small_scale_study.md; one run per arm, +-3 points between runs): at
lr 1e-3, 30 epochs, last-block KNN 29.90% / 31.45% / 37.30% / 40.30% / 42.80% for alpha_min 0.6 /
0.7 / 0.8 / 0.9 / 1.0; official probe on the token mean 37.50 / 40.90 / 47.25 / 50.75 / 52.70%, on
the cls token 38.30 / 40.20 / 48.10 / 51.05 / 42.40% (alpha_min 0.8 and 0.9 beat 1.0 only with the
cls token, and 1.0 with seed 1 gives 49.10% there). At the official lr 7.5e-5: 22.65% / 29.75% /
33.95% / 31.55% / 31.25% (0.6 / 0.7 / 0.8 / 0.9 / 1.0) on the last block, 31.65% (block 3) / 33.15%
(block 7) / 33.95% (block 12) / 32.30% (block 9) / 32.40% (block 5) at the best; official probe on
the token mean 21.45 / 25.30 / 31.80 / 38.15 / 40.30%, standardised (official_std) - / 40.70 / 41.00
/ 43.65 / 46.05% (the baseline's from a second run of it). The control sqrt_half_both (lr 1e-3):
25.55% last-block KNN, probe 26.60% (token mean) and 25.60% (cls), the worst arm; attn_only 0.6:
36.45% KNN, probe 46.05% (token mean) and 44.20% (cls); mlp_only 0.6: 33.80% KNN, probe 39.25%
(token mean) and 38.10% (cls). At lr 1e-3 for 100 epochs (--grid=long; 232-355 min of training per
arm on 2 cores): last-block KNN 34.20% / 44.30% / 45.85% for alpha_min 0.6 / 0.8 / 1.0, best-block
KNN 45.80% (block 6) / 47.35% (block 9) / 46.45% (block 10), official probe 42.70 / 54.30 / 56.10%
(token mean) and 43.15 / 53.30 / 54.90% (cls): 0.8 is level with 1.0, 0.6 behind at the last block.

Data: ``cifar10_train10k.npz`` (the 10,000 images of CIFAR-10 ``data_batch_1``, JPEG-75 copies; see
the README of ../shared/data). The split is fixed: ``train[:8000]`` trains the MAE and is the KNN
memory bank / probe training set, ``train[8000:]`` (2,000 images, 172-216 per class) is only ever
evaluated. The file lives beside the repository on the project's machines; elsewhere pass
``--config.data.dataset=npz:/path/to/cifar10_train10k.npz``.

Model and recipe: the official MAE architecture scaled down (encoder 12 x 192, 3 heads, decoder
8 x 128, patch 4 on 32 x 32, mask ratio 0.75, norm-pix loss), AdamW (0.9, 0.95), weight decay
0.05, batch 128, warmup 2 epochs then half-cycle cosine, 30 epochs, RandomResizedCrop(0.2, 1) and
flips. ``optim.lr`` 1e-3 is the absolute learning rate the earlier CPU test used; the study's
``lr`` grid also runs the official rule 1.5e-4 x 128 / 256 = 7.5e-5. The KNN of the last block
(k 20, T 0.07, mean of all tokens) is logged every 3 epochs; per-block probes, the linear probes
(the official one on raw features and on features standardised per dimension, official_std) and
the rank pass run once at the end of each arm.
"""

import os

from decay_jax.train import config as config_lib

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared",
                    "data", "cifar10_train10k.npz")
STEPS_PER_EPOCH = 8000 // 128  # the trainer rounds a partial last batch away


def get_config():
  c = config_lib.mae_config()
  c.model.preset = "tiny/4"
  c.model.alpha_min = 0.6
  c.data.dataset = "npz:" + os.path.normpath(DATA)
  c.data.train_split = "train[:8000]"
  c.data.eval_split = "train[8000:]"
  c.data.image_size = 32
  c.data.normalize = "imagenet"
  c.data.eval_resize = "resize"
  c.batch_size = 128
  c.num_epochs = 30.0
  c.warmup_epochs = 2.0
  c.optim.lr = 1e-3
  c.checkpoint.every_steps = 10 * STEPS_PER_EPOCH
  c.log_every_steps = STEPS_PER_EPOCH
  c.picture_every_steps = 10 * STEPS_PER_EPOCH
  c.evals.knn.every_steps = 3 * STEPS_PER_EPOCH  # each pass encodes 10,000 images
  c.evals.knn.train_split = "train[:8000]"
  c.evals.knn.eval_split = "train[8000:]"
  c.evals.knn.max_train_examples = 0
  c.evals.knn.batch_size = 500
  c.evals.linear.train_split = "train[:8000]"
  c.evals.linear.eval_split = "train[8000:]"
  c.evals.linear.max_train_examples = 0
  c.evals.linear.batch_size = 500
  c.evals.linear.protocols = "official,official_std"
  c.evals.linear.features = "mean,mean_ln,cls,cls_ln,patch_mean,patch_mean_ln"
  c.evals.layers.train_split = "train[:8000]"
  c.evals.layers.eval_split = "train[8000:]"
  c.evals.layers.max_train_examples = 0
  c.evals.layers.max_eval_examples = 0
  c.evals.layers.batch_size = 500
  c.evals.rank.split = "train[8000:]"
  c.evals.rank.every_steps = 0
  c.evals.rank.num_images = 1000
  c.evals.rank.batch_size = 500
  return c
