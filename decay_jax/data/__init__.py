"""Input pipelines: the shipped MNIST subset, external npz files, latent shards and TFDS datasets.

``pipeline``: the public functions re-exported here. ``config``: the data config's fields, defaults
and checks. ``sources``: one source per kind of dataset. ``augment``: the numpy + PIL preprocessing
of in-memory images and its exact-resume guarantee. ``tf_augment``: the tf.data preprocessing of
TFDS datasets (TensorFlow is imported lazily there). ``latents``: latent shards. ``embedded``: the
shipped MNIST subset and the command that builds it.
"""

from decay_jax.data.pipeline import dataset_info
from decay_jax.data.pipeline import default_data_config
from decay_jax.data.pipeline import load_eval_arrays
from decay_jax.data.pipeline import make_train_iterator

__all__ = ["dataset_info", "default_data_config", "load_eval_arrays", "make_train_iterator"]
