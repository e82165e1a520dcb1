"""MAE on the embedded MNIST subset, sized for a laptop CPU (the README's main command uses it).

Command (one model; the README's main command trains alpha_min 0.6 and 1.0 and compares them):
  python -m decay_jax.cli.train --config=configs/mae_cpu_mnist.py --workdir=/tmp/mae_mnist
Hardware: 2 CPU cores. Expected time: about 4 minutes per model (measured; see the README).
Expected result: measured KNN top-1 on the 2,000 embedded test digits in the README's table.

Data: the first 10,000 MNIST training digits (shipped in decay_jax/data/embedded), KNN against
their features, evaluated on the first 2,000 test digits. The crop scale is (0.5, 1) instead of
MAE's (0.2, 1) because a 20% crop of a 28-pixel digit is mostly background; both arms of any
comparison use the same settings.
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.mae_config()
  c.model.preset = "mnist/4"
  c.model.alpha_min = 0.6
  c.data.dataset = "embedded_mnist"
  c.data.image_size = 28
  c.data.normalize = "half"
  c.data.eval_split = "test"
  c.data.eval_resize = "resize"
  c.data.crop_scale = (0.5, 1.0)
  c.batch_size = 128
  c.num_epochs = 4.0
  c.warmup_epochs = 0.5
  c.optim.lr = 1e-3
  c.checkpoint.every_steps = 100
  c.log_every_steps = 25
  c.picture_every_steps = 100
  c.evals.knn.every_steps = 0
  c.evals.knn.train_split = "train"
  c.evals.knn.eval_split = "test"
  c.evals.knn.max_train_examples = 0
  c.evals.knn.batch_size = 500
  c.evals.linear.eval_split = "test"
  c.evals.linear.max_train_examples = 0
  c.evals.linear.batch_size = 500
  c.evals.linear.features = "mean,patch_mean,cls,mean_ln,patch_mean_ln,cls_ln"
  c.evals.linear.protocols = "official,mae"
  # Upstream's probe scaled to 10,000 digits: batch 256 at upstream's peak lr 6.4 (the linear
  # scaling rule would give 0.1, with which LARS barely leaves its N(0, 0.01^2) start in 10 epochs).
  c.evals.linear.mae.update(batch_size=256, blr=6.4, epochs=10, warmup_epochs=1.0)
  c.evals.linear.mae.crop_scale = (0.5, 1.0)  # as pretraining: 8% of a 28-pixel digit is blank
  c.evals.layers.eval_split = "test"
  c.evals.layers.max_train_examples = 0
  c.evals.layers.max_eval_examples = 0
  c.evals.layers.batch_size = 500
  c.evals.rank.split = "test"
  c.evals.rank.every_steps = 100
  c.evals.rank.num_images = 1000
  c.evals.rank.batch_size = 500
  return c
