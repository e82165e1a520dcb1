"""The input pipeline: the shipped MNIST subset, npz files, image folders, TFDS and latent shards.

``pipeline``: the public functions re-exported here. ``config``: the data config's fields, defaults
and checks. ``sources``: one source per kind of dataset, each giving random-access records
(``npz``, ``folder``, ``tfds_records``, ``latents``; ``splits`` parses their split strings).
``loader``: the Grain pipeline and its exact-resume guarantee. ``augment``: the one numpy + Pillow
preprocessing. ``on_device``: uint8 pixels to model inputs inside jitted programs, and batches
prefetched onto the devices. ``resident``: small npz datasets kept on the devices, cropped and
flipped in one jitted program (``data.on_device``). ``embedded``: the shipped MNIST subset and the
command that builds it. ``bench``: the input pipeline's throughput.
"""

from decay_jax.data.pipeline import dataset_info
from decay_jax.data.pipeline import default_data_config
from decay_jax.data.pipeline import load_eval_arrays
from decay_jax.data.pipeline import make_train_iterator

__all__ = ["dataset_info", "default_data_config", "load_eval_arrays", "make_train_iterator"]
