"""Mirror routing on the embedded-digits SiT (configs/sit_cpu_mnist.py: mnist/4, 28x28x1, batch 64),
one row of configs/sit_s2_routing.py per config string (default: mirror).

Command (the short runs of docs/routing.md, mirror routing and mirror routing + decay):
  python -m decay_jax.cli.train --config=configs/sit_cpu_mnist_routing.py:mirror \
      --workdir=/tmp/sit_mnist_mirror --config.num_train_steps=300
  python -m decay_jax.cli.train --config=configs/sit_cpu_mnist_routing.py:mirror_decay \
      --workdir=/tmp/sit_mnist_mirror_decay --config.num_train_steps=300
Hardware: 2 CPU cores.
Expected time and result: measured, see docs/routing.md: about 1 step/s; the last
  picture (WORKDIR/pictures/step_0000300.png) has the samples and the routing-weight heat-map.
"""

import os
import runpy

_ROUTING = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                       "sit_s2_routing.py"))


def get_config(row: str = "mirror"):
  return _ROUTING["apply_row"](_ROUTING["sibling"]("sit_cpu_mnist")["get_config"](), row)
