"""Command-line tools around training: latent extraction (``python -m decay_jax.tools.extract_latents``)."""
