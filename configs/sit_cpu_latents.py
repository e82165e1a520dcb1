"""SiT on VAE latents of a small image folder, sized for a laptop CPU: the latent pipeline end to end.

It is ``configs/sit_cpu_mnist.py`` (same model width, optimiser, EMA and sampler) on the latent
shards of ``python -m decay_jax.cli.extract_latents``: 64x64 images through a VAE with
downsampling factor 8 give 8x8x4 latents, patch 2 (16 tokens), ADM flips drawn from the shards.
Command (docs/sit.md has the whole sequence):
  python -m decay_jax.cli.extract_latents --images=$IMAGES --vae=$VAE --out=/tmp/latents \
      --image_size=64
  python -m decay_jax.cli.train --config=configs/sit_cpu_latents.py --workdir=/tmp/sit_latents \
      --config.data.dataset=latents:/tmp/latents
  python -m decay_jax.cli.sample --workdir=/tmp/sit_latents --num=64 --vae=$VAE
Hardware: 2 CPU cores. Expected time: a few seconds per 10 steps on 2 free cores (the test runs
  3 steps); 2000 steps were not timed. Expected result: none measured; with the random VAE of the
  pipeline test the FID means nothing; real use extracts with sd-vae-ft-ema.
"""

import importlib.util
import os


def get_config():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sit_cpu_mnist.py")
  spec = importlib.util.spec_from_file_location("sit_cpu_mnist", path)
  base = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(base)
  c = base.get_config()
  c.model.preset = "mnist/2"
  c.data.dataset = "latents:/tmp/latents"
  c.data.image_size = 8  # latent side: 64-pixel images / VAE factor 8
  c.data.normalize = "none"  # latents are already scaled by the VAE's scaling_factor
  c.data.eval_split = "train"
  c.data.flip = True  # pick the stored original or flipped latent (the official flip)
  c.num_train_steps = 2000
  c.sample.cfg_channels = 3  # the official 3-of-4-channel guidance on latents
  c.evals.generation.sample.cfg_channels = 3  # its evaluation also needs evals.generation.vae
  return c
