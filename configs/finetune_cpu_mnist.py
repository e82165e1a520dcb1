"""End-to-end fine-tuning of the demo's MAE on the embedded MNIST digits (upstream MAE's protocol,
docs/finetune.md, at laptop size).

Command (DEMO: the README's main command's output, by default workdir/demo):
  python -m decay_jax.cli.train --config=configs/finetune_cpu_mnist.py --workdir=/tmp/ft_a0.6 \
      --config.init_from=$DEMO/alpha_0.6
  (and --config.init_from=$DEMO/alpha_1.0 for the baseline)
Hardware: 2 CPU cores. Expected time: about 2.2 minutes per encoder (measured 2026-12-04).
Expected result (measured, one run each; docs/finetune.md): top-1 on the 2,000 embedded test
  digits 17.30% from the alpha_min 0.6 demo encoder and 22.35% from the alpha_min 1.0 one (in
  results.json as accuracy/top1 and accuracy/top1_best).

The recipe is upstream's ViT-B/16 one with laptop sizes: AdamW (0.9, 0.999), weight decay 0.05,
layer decay 0.75 over the demo encoder's 6 blocks, drop path 0.1, RandAugment m9 (grey fill 128),
random erasing 0.25, Mixup 0.8 / CutMix 1.0 in groups of 32 with label smoothing 0.1, warmup then
cosine to 1e-6; 2 epochs of 10,000 digits at batch 128 and lr 1e-3 instead of 100 epochs at 1024
and 2e-3; the demo's crop scale (0.5-1) instead of (0.08-1), as for its pre-training.
"""

from decay_jax.train import config as config_lib

STEPS_PER_EPOCH = 10_000 // 128


def get_config():
  c = config_lib.finetune_config()
  c.model.preset = "mnist/4"  # used only without init_from
  c.model.drop_path = 0.1
  c.data.dataset = "embedded_mnist"
  c.data.image_size = 28
  c.data.normalize = "half"
  c.data.eval_split = "test"
  c.data.eval_resize = "resize"
  c.data.crop_scale = (0.5, 1.0)
  c.batch_size = 128
  c.num_epochs = 2.0
  c.warmup_epochs = 0.5
  c.optim.lr = 1e-3
  c.optim.layer_decay = 0.75
  c.checkpoint.every_steps = STEPS_PER_EPOCH
  c.log_every_steps = 13
  c.evals.accuracy.every_steps = STEPS_PER_EPOCH
  c.evals.accuracy.eval_split = "test"
  c.evals.accuracy.batch_size = 500
  return c
