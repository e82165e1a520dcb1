"""SiT on the embedded MNIST digits in pixel space (28x28x1), sized for a laptop CPU.

Command:
  python -m decay_jax.cli.train --config=configs/sit_cpu_mnist.py --workdir=/tmp/sit_mnist
  python -m decay_jax.cli.sample --workdir=/tmp/sit_mnist --num=64
Hardware: 2 CPU cores. Expected time: about 85 min (1.6 steps/s on idle cores), sampling 14 s.
Expected result (measured, docs/sit.md): final loss 0.176; about 60 of 64 samples are
clearly the requested digit.
Evaluation (config.evals.generation): none reported; set up as the grid's sampler (ODE Heun 30
  steps, CFG 2.0), 1,000 samples every 2,000 steps once enabled with a reference batch of digits
  (decay_jax.cli.fid --save_stats) and an Inception directory (docs/generation_metrics.md).

Images are scaled to [-1, 1] (the official Normalize(0.5, 0.5)), no crop and no flip (a flipped
digit is another symbol). Classes are the 10 digits, with the null class 10 for guidance.
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.sit_config()
  c.model.preset = "mnist/4"
  c.model.alpha_min = 0.8
  c.model.num_classes = 10
  c.data.dataset = "embedded_mnist"
  c.data.image_size = 28
  c.data.normalize = "half"
  c.data.eval_split = "test"
  c.data.eval_resize = "resize"
  c.data.crop_scale = (1.0, 1.0)
  c.data.crop_ratio = (1.0, 1.0)
  c.data.flip = False
  c.batch_size = 64
  c.num_train_steps = 8000
  c.ema_decay = 0.999  # 0.9999 needs far more than 8000 steps to forget the initialisation
  c.optim.lr = 1e-3
  c.sample.cfg_scale = 2.0
  c.sample.cfg_channels = 0  # one channel: guide all of it
  c.sample.num_steps = 30
  c.evals.generation.sample.update(mode="ode", method="heun", num_steps=30, cfg_scale=2.0,
                                   cfg_channels=0)
  c.evals.generation.update(num_samples=1000, report_num=10_000, every_steps=2000)
  c.log_every_steps = 50
  c.picture_every_steps = 1000
  c.checkpoint.every_steps = 500
  return c
