"""U-ViT (the tiny CPU preset of docs/uvit.md) on the embedded MNIST digits, unconditional, in
pixel space (28x28x1), decayed shortcuts at alpha_min 0.7; the baseline arm is
--config.model.alpha_min=1.0.

Command:
  python -m decay_jax.cli.train --config=configs/uvit_cpu_mnist.py --workdir=/tmp/uvit_a0.7
  python -m decay_jax.cli.sample --workdir=/tmp/uvit_a0.7 --num=64
Hardware: 2 CPU cores. Expected time: about 66 minutes per arm with both arms running at once
  (measured 2026-12-04, about 98 images/s per arm), sampling 64 images 14 s.
Expected result (measured, one run each, docs/uvit.md 7): final loss 0.044 (alpha_min 0.7) and
  0.043 (1.0); KNN of the last block's diffusion features 23.10% and 26.30%, official linear
  probe 31.95% and 33.80%; samples show digit-sized strokes on black, not yet legible digits.
Evaluation (config.evals.generation): none reported; U-ViT's sampler (DPM-Solver-fast, 50 model
  calls), 1,000 samples every 2,000 steps once enabled with a reference batch of digits and an
  Inception directory (docs/generation_metrics.md).

U-ViT's CIFAR-10 recipe (AdamW, betas (0.99, 0.999), weight decay 0.03 on every parameter, VPSDE
noise prediction, DPM-Solver-fast for samples) with CPU changes: batch 64, lr 1e-3 (at U-ViT's 2e-4
the loss of the noisiest quarter of times was still 0.18 after 1,500 steps and every sampler
diverged), 200 warmup steps, 6,000 steps, EMA 0.999 (0.9999 forgets the initialisation too slowly
for a few thousand steps). The
tiny preset is 7 blocks of width 128 with patch 4: 49 patch tokens + the time token, 1,494,810
parameters on one channel. Images in [-1, 1], no flip (a flipped digit is another symbol).
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.uvit_config()
  c.model.preset = "tiny/4"
  c.model.alpha_min = 0.7
  c.data.dataset = "embedded_mnist"
  c.data.image_size = 28
  c.data.eval_resize = "resize"
  c.data.flip = False
  c.batch_size = 64
  c.num_train_steps = 6000
  c.warmup_steps = 200
  c.optim.lr = 1e-3  # U-ViT's 2e-4 leaves the high-noise predictions untrained after 2,000 steps
  c.ema_decay = 0.999
  c.sample.num_steps = 20  # DPM-Solver-fast model calls for the monitoring grid
  c.evals.generation.update(num_samples=1000, report_num=10_000, every_steps=2000)
  c.log_every_steps = 50
  c.picture_every_steps = 1000
  c.checkpoint.every_steps = 500
  # `python -m decay_jax.cli.evaluate --workdir=...`: the probe of the demo MAE's evaluation, on
  # the diffusion features (decay_jax.evals.diffusion_probe); patch tokens only, so "mean" is
  # their mean and the cls choices do not apply.
  for name in ("knn", "linear", "layers"):
    c.evals[name].update(eval_split="test", max_train_examples=0, batch_size=500)
  c.evals.layers.max_eval_examples = 0
  c.evals.layers.heldout_fraction = 0.1  # the best block, chosen on 10% of the training digits
  c.evals.linear.features = "mean,mean_ln"
  c.evals.linear.official.epochs = 100
  return c
