"""REPA on the embedded digits: the SiT of configs/sit_cpu_mnist.py with block 2's tokens aligned to
the patch tokens of a frozen MAE trained on the same digits (DINOv2 cannot be downloaded here), the
CPU counterpart of configs/sit_repa_xl2.py (docs/repa.md, "On the embedded digits").

Command (first the encoder: the demo's MAE, the standard-residual arm; then the SiT with and
without REPA, same budget, 3 seeds):
  python -m decay_jax.cli.train --config=configs/mae_cpu_mnist.py --workdir=/tmp/mae_mnist \
      --config.model.alpha_min=1.0
  python -m decay_jax.cli.compare --config=configs/sit_cpu_mnist_repa.py --workdir=/tmp/sit_repa \
      --config.repa.encoder=/tmp/mae_mnist --seeds=3 --grid=model.repa_depth=0,2
Hardware: 2 CPU cores.
Expected time: about 2 min for the MAE's 312 steps, then 7-10 min per SiT run of 400 steps on cores
  shared with another run (measured), less on idle cores.
Expected result (measured, docs/repa.md "On the embedded digits"): flow loss (loss_v) 0.3341 +-
  0.0046 without and 0.3347 +- 0.0055 with REPA at 400 steps, not separated; REPA ahead by 2-3% of
  the loss in the first 100 steps.

Scaled from REPA's XL/2 recipe: the aligned block is 8 of 28 there, 2 of this SiT's 8; the
projector is twice the width (REPA: 2048 for width 1152), here 256 for 128; proj_coeff 0.5 as
REPA. The MAE (mnist/4 at 28 px: 7x7 patch tokens of width 128) reads the pixels as it was
trained (encoder_normalize 'half'); the SiT's 7x7 token grid matches it. Everything else is
configs/sit_cpu_mnist.py's (lr 1e-3, batch 64, EMA 0.999).
"""

import os
import runpy


def get_config():
  here = os.path.dirname(os.path.abspath(__file__))
  c = runpy.run_path(os.path.join(here, "sit_cpu_mnist.py"))["get_config"]()
  c.model.alpha_min = 1.0  # REPA's SiT: plain residuals
  c.model.repa_depth = 2
  c.model.repa_dims = (128,)
  c.model.repa_hidden = 256
  c.repa.update(proj_coeff=0.5, encoder="", encoder_normalize="half")  # encoder: the MAE's workdir
  c.num_train_steps = 400
  c.picture_every_steps = 400
  c.checkpoint.every_steps = 200
  return c
