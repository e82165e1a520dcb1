"""Encode an image folder into SiT training latents (docs/official_code.md 5.2), sharded and resumable.

    python -m decay_jax.cli.extract_latents --images=/data/imagenet/train \
        --vae=/data/sd_vae_ft_ema --out=/data/latents256 --image_size=256

``--images``: an ImageFolder tree (``DIR/<class>/<image>``; classes are the sorted sub-folder
names, labels their indices, as torchvision's ImageFolder), or a flat folder (every label 0).
``--vae``: an ``AutoencoderKL`` directory from ``python -m decay_jax.cli.convert_external vae``
(sd-vae-ft-ema for the paper's setting).

Each image goes through ADM's ``center_crop_arr`` (halve with a BOX filter while the short side is
at least twice the target, BICUBIC resize of the short side to ``image_size``, centre crop with
floor offsets), ``x / 127.5 - 1``, and is encoded twice, as is and flipped left-right; the stored
latent is the *sampled* ``(mean + std * eps) * scaling_factor`` (not the mean), as the official
training does on the fly. ``eps`` depends only on ``(--seed, image index, flip)``, so the output does
not depend on device count, batch size or interruptions.

Output format: the memory-mapped ``.npy`` shards that ``data.dataset=latents:DIR`` reads
(``decay_jax/data/latents.py``): ``{split}_latents_{i:05d}.npy`` ``(n, 2, h, w, C)`` (original,
flipped) and ``{split}_labels_{i:05d}.npy``, plus ``meta.json``. We keep this format rather than
ArrayRecord/TFRecord because the trainer reads any row directly from a memory map (exact resume
by position, random access for the per-epoch permutation, no RAM to open 1.28M latents, no extra
dependency), and a shard is complete exactly when its file exists (written under a temporary name,
then renamed): rerunning the command skips finished shards, so extraction is resumable.

``--repa_encoder``: also store REPA's targets beside each shard (``{split}_repa_target_0_{i:05d}.npy``,
``(n, 2, T, D)`` for the original and the flipped image, ``--dtype``): the patch tokens of a
frozen encoder (a converted DINOv2 params directory, or an MAE, ``decay_jax.train.repa``) of the
same cropped uint8 image, so that ``configs/sit_repa_xl2.py`` trains on the latents without an
encoder in the step; the latent source delivers them as ``repa_target_0`` with the latent's version.

Parallelism: shard ``i`` is written by process ``i % process_count``; within a process each batch
is split over the local devices. Progress and ETA are printed.
"""

from __future__ import annotations

import io
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from decay_jax import logs, paths, validate
from decay_jax.data import augment
from decay_jax.data import latents as latents_lib
from decay_jax.evals.generation import IMAGE_EXTENSIONS, list_images, Progress
from decay_jax.train import checkpoint
from decay_jax.train import repa as repa_lib
from decay_jax.train.tasks.mae import MAETask

META_KEYS = ("image_size", "scale", "shard_size", "num_images", "seed", "split", "latent_shape",
             "repa_encoder", "repa_shape")


def load_cropped(path: str, image_size: int) -> np.ndarray:
  with Image.open(io.BytesIO(paths.resolve(path).read_bytes())) as im:
    return augment.center_crop_arr(im.convert("RGB"), image_size)


def list_labelled_images(directory: str) -> Tuple[List[str], np.ndarray, List[str]]:
  """``(files, labels, class_names)`` of an ImageFolder tree (or a flat folder: label 0)."""
  root = paths.resolve(directory)
  if not root.is_dir():
    raise ValueError(f"images={directory!r} is not allowed; the directory does not exist")
  classes = sorted(d.name for d in root.iterdir() if d.is_dir())
  files, labels = [], []
  if classes:
    for i, c in enumerate(classes):
      found = list_images(str(root / c))
      files += found
      labels += [i] * len(found)
  else:
    files = list_images(directory)
    labels = [0] * len(files)
    classes = [""]
  if not files:
    raise ValueError(f"images={directory!r} is not allowed; it holds no images "
                     f"({', '.join(IMAGE_EXTENSIONS)})")
  return files, np.asarray(labels, np.int32), classes


def shard_paths(out: str, split: str, index: int) -> Tuple[str, str]:
  return (paths.join(out, f"{split}_latents_{index:05d}.npy"),
          paths.join(out, f"{split}_labels_{index:05d}.npy"))


def make_encoder(vae, mesh, seed: int):
  """jitted ``(params, images uint8 (B, S, S, 3), indices (B,)) -> (B, 2, h, w, C)`` latents."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  sharding = NamedSharding(mesh, P(mesh.axis_names))
  base = jax.random.key(seed)

  def encode(params, images, indices):
    x = images.astype(jnp.float32) / 127.5 - 1.0  # ToTensor + Normalize(0.5, 0.5)
    both = jnp.stack([x, x[:, :, ::-1]], axis=1)  # (B, 2, S, S, 3): original, flipped
    b = both.shape[0]
    f = vae.downsample_factor
    shape = (x.shape[1] // f, x.shape[2] // f, vae.latent_channels)
    noise = jax.vmap(lambda i: jax.vmap(lambda v: jax.random.normal(
        jax.random.fold_in(jax.random.fold_in(base, i), v), shape))(jnp.arange(2)))(indices)
    z = vae.apply({"params": params}, both.reshape((2 * b,) + both.shape[2:]),
                  noise.reshape((2 * b,) + shape), method=vae.sample_latent)
    return z.reshape((b, 2) + shape)

  return jax.jit(encode, in_shardings=(None, sharding, sharding), out_shardings=sharding), sharding


def make_targets(encoder, mesh):
  """jitted ``(params, images uint8 (B, S, S, 3)) -> (B, 2, T, D)``: REPA's targets of the images
  and of their left-right flips."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  sharding = NamedSharding(mesh, P(mesh.axis_names))

  def targets(params, images):
    both = [encoder.tokens(params, images), encoder.tokens(params, images[:, :, ::-1])]
    return jnp.stack(both, axis=1)

  return jax.jit(targets, in_shardings=(None, sharding), out_shardings=sharding)


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = validate.ArgumentParser(prog="python -m decay_jax.cli.extract_latents",
                              description=__doc__.split("\n")[0])
  p.add_argument("--images", required=True, help="ImageFolder tree (or flat folder)")
  p.add_argument("--vae", required=True, help="converted AutoencoderKL directory")
  p.add_argument("--out", required=True, help="output directory of the latent shards")
  p.add_argument("--split", default="train", help="split name in the file names (lowercase)")
  p.add_argument("--image_size", type=int, default=256, help="ADM centre-crop size")
  p.add_argument("--batch_size", type=int, default=64, help="images per encoder call (all devices)")
  p.add_argument("--shard_size", type=int, default=10_000, help="images per shard file")
  p.add_argument("--seed", type=int, default=0, help="seed of the latent sampling noise")
  p.add_argument("--dtype", choices=("float16", "float32"), default="float16",
                 help="storage dtype of the latents")
  p.add_argument("--workers", type=int, default=8, help="threads decoding and cropping images")
  p.add_argument("--repa_encoder", default="",
                 help="also store REPA's targets of this encoder (DINOv2 or MAE params directory)")
  p.add_argument("--repa_normalize", default="imagenet",
                 help="the pixel normalisation an MAE encoder was trained with (DINOv2: REPA's)")
  a = p.parse_args(argv)

  logs.quiet_libraries()
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  try:
    if not a.split.isalpha() or not a.split.islower():
      raise ValueError(f"split={a.split!r} is not allowed; use lowercase letters (e.g. train)")
    for name in ("batch_size", "shard_size", "workers", "image_size"):
      if getattr(a, name) < 1:
        raise ValueError(f"{name}={getattr(a, name)} is not allowed; it must be >= 1")
    if not paths.exists(paths.join(a.vae, "model.json")):
      raise ValueError(f"vae={a.vae!r} is not allowed; it is not a converted VAE directory "
                       "(python -m decay_jax.cli.convert_external vae ...)")
    vae, params = checkpoint.load_params(a.vae, "vae")
    if type(vae).__name__ != "AutoencoderKL":
      raise ValueError(f"vae={a.vae!r} is not allowed; it holds a {type(vae).__name__}")
    f = vae.downsample_factor
    if a.image_size % f:
      raise ValueError(f"image_size={a.image_size} is not allowed; it must be a multiple of the "
                       f"VAE's downsampling factor {f}")
    encoder = None
    if a.repa_encoder:
      encoder, enc_params = repa_lib.load_encoder(a.repa_encoder, a.repa_normalize,
                                                     MAETask)
      probe = jax.eval_shape(encoder.tokens, enc_params,
                             jax.ShapeDtypeStruct((1, a.image_size, a.image_size, 3), np.uint8))
    files, labels, classes = list_labelled_images(a.images)
    meta = dict(image_size=a.image_size, scale=float(vae.scaling_factor), shard_size=a.shard_size,
                num_images=len(files), seed=a.seed, split=a.split,
                latent_shape=[2, a.image_size // f, a.image_size // f, vae.latent_channels],
                vae=str(paths.resolve(a.vae)), images=str(paths.resolve(a.images)), classes=classes,
                crop="ADM center_crop_arr", flips="index 1 of axis 1 is the left-right flip",
                latent="vae.encode(x).latent_dist.sample() * scale")
    if encoder is not None:
      meta.update(repa_encoder=str(paths.resolve(a.repa_encoder)),
                  repa_shape=[2] + list(probe.shape[1:]))
    meta_path = paths.join(a.out, f"meta_{a.split}.json" if a.split != "train" else "meta.json")
    if paths.exists(meta_path):
      old = paths.read_json(meta_path)
      changed = [k for k in META_KEYS if old.get(k) != meta.get(k)]
      if changed:
        raise ValueError(f"out={a.out!r} is not allowed; it holds latents made with other "
                         f"settings ({', '.join(f'{k}: {old.get(k)} != {meta.get(k)}' for k in changed)}); "
                         "use a new directory")
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if jax.process_index() == 0:
    paths.write_json(meta_path, meta)

  mesh = Mesh(np.asarray(jax.local_devices()), ("data",))
  per = mesh.size
  batch = max(per, (a.batch_size // per) * per)
  encode, sharding = make_encoder(vae, mesh, a.seed)
  params = jax.device_put(params, NamedSharding(mesh, P()))  # replicated on the local devices
  if encoder is not None:
    targets_of = make_targets(encoder, mesh)
    enc_params = jax.device_put(enc_params, NamedSharding(mesh, P()))
  num_shards = -(-len(files) // a.shard_size)
  mine = [s for s in range(num_shards) if s % jax.process_count() == jax.process_index()]
  todo = [s for s in mine if not paths.exists(shard_paths(a.out, a.split, s)[0])]
  size = lambda s: min(len(files), (s + 1) * a.shard_size) - s * a.shard_size
  total = sum(size(s) for s in mine)
  already = total - sum(size(s) for s in todo)
  print(f"{len(files)} images, {len(classes)} classes, {num_shards} shards; this process: "
        f"{len(mine)} shards, {len(mine) - len(todo)} already done; {per} devices, batch {batch}",
        flush=True)
  progress = Progress("encoded", total)
  done = already
  t0 = time.perf_counter()
  with ThreadPoolExecutor(a.workers) as pool:
    for s in todo:
      lo, hi = s * a.shard_size, s * a.shard_size + size(s)
      out = np.empty((hi - lo,) + tuple(meta["latent_shape"]), a.dtype)
      targets = ([np.empty((hi - lo,) + tuple(meta["repa_shape"]), a.dtype)]
                 if encoder is not None else [])
      for start in range(lo, hi, batch):
        stop = min(hi, start + batch)
        images = np.stack(list(pool.map(lambda fn: load_cropped(fn, a.image_size),
                                        files[start:stop])))
        idx = np.arange(start, start + batch, dtype=np.int32)
        if len(images) < batch:  # pad the last batch: one compiled program for all batches
          images = np.concatenate([images, np.zeros((batch - len(images),) + images.shape[1:],
                                                    np.uint8)])
        on_devices = jax.device_put(images, sharding)
        z = encode(params, on_devices, jax.device_put(idx, sharding))
        out[start - lo:stop - lo] = np.asarray(jax.device_get(z))[:stop - start]
        if targets:
          y = targets_of(enc_params, on_devices)
          targets[0][start - lo:stop - lo] = np.asarray(jax.device_get(y))[:stop - start]
        done += stop - start
        progress.update(done, already)
      latents_lib.write_shard(a.out, a.split, s, out, labels[lo:hi], targets)
  print(f"wrote {len(todo)} shards to {a.out} in {time.perf_counter() - t0:.1f} s "
        f"(latents {tuple(meta['latent_shape'])} per image, {a.dtype})", flush=True)
  return 0


def run():
  logs.run_command(main)


if __name__ == "__main__":
  run()
