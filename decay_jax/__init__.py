"""decay-jax: decayed identity shortcuts (arXiv 2404.10947) for MAE and SiT in JAX/Flax.

Importing the package has no side effects; the subpackages are, from the bottom up: ``models``
(layers, decay schedules, MAE, SiT, routing, VAE, Inception), ``data``, ``diffusion`` (transport,
samplers), ``train``, ``evals``, ``io`` (checkpoint converters) and ``cli`` (the commands).
"""

__version__ = "0.1.0"
