"""Input pipelines: the shipped MNIST subset, external npz files and TFDS datasets.

See ``decay_jax.data.pipeline`` for the config fields and the determinism guarantees.
"""

from decay_jax.data.pipeline import dataset_info
from decay_jax.data.pipeline import default_data_config
from decay_jax.data.pipeline import load_eval_arrays
from decay_jax.data.pipeline import make_train_iterator

__all__ = ["dataset_info", "default_data_config", "load_eval_arrays", "make_train_iterator"]
