"""Routing added to a trained plain SiT on the embedded digits: the CPU counterpart of
configs/sit_repa_xl2_routing_finetune.py (docs/routing.md, "Routing added to a pretrained SiT").

Command (first a plain SiT, the `baseline` row of configs/sit_cpu_mnist_routing.py, then routing
added to it; START as in configs/sit_repa_xl2_routing_finetune.py, default mirror):
  python -m decay_jax.cli.train --config=configs/sit_cpu_mnist_routing.py:baseline \
      --workdir=/tmp/sit_mnist_plain --config.num_train_steps=300
  python -m decay_jax.cli.train --config=configs/sit_cpu_mnist_routing_finetune.py:START \
      --workdir=/tmp/sit_mnist_plain_mirror --config.init_from=/tmp/sit_mnist_plain
Hardware: 2 CPU cores.
Expected time: estimated from the routed runs' 1 step/s (docs/routing.md), about 5 min for the
  plain 300 steps and 4 min for each fine-tune of 200 steps; measured on busy cores (0.3 steps/s):
  about 5 min for 20 fine-tune steps, most of it compilation.
Expected result (measured, see docs/routing.md; 20 steps from a plain run at step 66): the routed
  run's first loss equals the plain run's on the same batch with the function-preserving start
  (mirror: 0.5881, the same as plain continued) and about doubles with the paper's start
  (mirror_paper: 1.166).
"""

import os
import runpy

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPA = runpy.run_path(os.path.join(_HERE, "sit_repa_xl2_routing_finetune.py"))


def get_config(start: str = "mirror"):
  c = _REPA["sibling"]("sit_cpu_mnist_routing")["get_config"]("baseline")
  c.init_from = "/tmp/sit_mnist_plain"  # the plain run of the command above
  c.num_train_steps = 200
  c.picture_every_steps = 100
  c.checkpoint.every_steps = 100
  return _REPA["apply_start"](c, start)
