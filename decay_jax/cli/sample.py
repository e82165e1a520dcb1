"""Sample a trained SiT or U-ViT: PNG grids and an ``.npz`` of uint8 images in the layout FID
tools expect.

    python -m decay_jax.cli.sample --workdir=DIR --num=50000 --mode=ode --method=dopri5 --cfg=1.0
    python -m decay_jax.cli.sample --workdir=DIR --num=64 --mode=sde --method=euler --steps=250
    python -m decay_jax.cli.sample --workdir=UVIT_DIR --num=50000 --mode=dpm --method=fast --steps=50

SiT samplers: ``--mode=ode`` (euler, heun, dopri5) or ``sde`` (euler, heun), CFG scale ``--cfg``
(1 = none). U-ViT samplers: ``--mode=dpm`` (``fast``: DPM-Solver-fast, ``--steps`` model calls;
``pp``: DPM-Solver++) or ``sde`` / ``ode`` (``euler``: Euler-Maruyama), guidance ``--cfg=s`` as
U-ViT's ``eps_c + s (eps_c - eps_null)`` (0 = none).

Reads the run's ``config.json`` and newest checkpoint (``--step`` for another), and samples with
the EMA weights (``--weights=params`` for the raw ones). Unset sampler flags take the run's
``config.sample`` values. Sampling is sharded over all devices; example ``i`` always gets the same
noise and label (seeded by ``--seed`` and ``i``), so the output does not depend on the device
count or the batch size. Labels are uniform in ``[0, num_classes)`` as the official FID sampler
(``--labels=cycle`` gives ``i % num_classes``).

Writes into ``--out`` (default ``DIR/samples/step_<step>``): ``samples.npz`` with ``arr_0`` uint8
``(N, H, W, 3)`` and ``labels``, ``grid.png`` (the first ``--grid`` images) and ``info.json``.
Pixel values follow the official rounding ``clip(127.5 x + 128, 0, 255)`` truncated to uint8, for
models trained on ``[-1, 1]`` images. Latent models (``data.dataset=latents:...``) write the raw
latents to ``latents.npz``; with ``--vae=DIR`` (the converted VAE the latents were extracted with)
each batch is also decoded, ``vae.decode(z / scaling_factor)``, on the same devices, and the
pixels go to ``samples.npz`` as above (the official FID sampler):

    python -m decay_jax.cli.sample --workdir=DIR --num=50000 --vae=/data/sd_vae_ft_ema --cfg=1.0
"""

import sys
import time

from absl import flags, logging

from decay_jax import logs, paths, plots, validate
from decay_jax import sharding as shd
from decay_jax.cli import errors
from decay_jax.data import latents as latents_lib
from decay_jax.diffusion import dpm_solver, samplers
from decay_jax.evals import generation
from decay_jax.train import checkpoint, setup

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (config.json + checkpoints/).")
_STEP = flags.DEFINE_integer("step", -1, "Checkpoint step (-1: newest).")
_WEIGHTS = flags.DEFINE_enum("weights", "ema", ["ema", "params"], "Which weights to sample with.")
_NUM = flags.DEFINE_integer("num", 64, "Number of images.")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Images per sampling call (0: config.sample).")
_MODE = flags.DEFINE_enum("mode", None, ["ode", "sde", "dpm"], "ODE or SDE sampler; U-ViT: dpm too.")
_METHOD = flags.DEFINE_string("method", None, "SiT ode: euler|heun|dopri5; sde: euler|heun. "
                              "U-ViT dpm: fast|pp; sde, ode: euler.")
_STEPS = flags.DEFINE_integer("steps", None, "Sampler steps (grid points).")
_CFG = flags.DEFINE_float("cfg", None, "Classifier-free guidance scale (1 = none).")
_CFG_CHANNELS = flags.DEFINE_integer("cfg_channels", None, "Guide channels [:k] (0 = all).")
_CFG_INTERVAL = flags.DEFINE_list("cfg_interval", None, "Guidance only for t in [lo, hi].")
_LABELS = flags.DEFINE_enum("labels", "uniform", ["uniform", "cycle"], "Class labels.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of noise and labels.")
_GRID = flags.DEFINE_integer("grid", 64, "Images in grid.png.")
_OUT = flags.DEFINE_string("out", None, "Output directory.")
_VAE = flags.DEFINE_string("vae", None, "Latent runs: converted VAE directory to decode with.")


def sample_config(base, task_name: str = "sit"):
  c = base.copy_and_resolve_references()
  for flag, key in ((_MODE, "mode"), (_METHOD, "method"), (_STEPS, "num_steps"),
                    (_CFG, "cfg_scale"), (_CFG_CHANNELS, "cfg_channels")):
    if flag.value is not None:
      if key not in c:
        raise ValueError(f"--{flag.name} is not allowed for a {task_name} run")
      c[key] = flag.value
  if _CFG_INTERVAL.value is not None:
    if "cfg_interval" not in c:
      raise ValueError(f"--cfg_interval is not allowed for a {task_name} run")
    c.cfg_interval = tuple(float(v) for v in _CFG_INTERVAL.value)
  if task_name == "uvit":
    modes = dpm_solver.SAMPLERS
  else:
    modes = {"ode": samplers.ODE_METHODS, "sde": samplers.SDE_METHODS}
  validate.check_choice("mode", c.mode, tuple(modes))
  validate.check_choice("method", c.method.lower(), modes[c.mode])
  if c.num_steps < 2:
    raise ValueError(f"steps={c.num_steps} is not allowed; it must be >= 2")
  return c


def load_vae(directory, config, model):
  """``(vae, params)`` of a converted VAE that fits the latents of the run (channels, scale)."""
  if not config.data.dataset.startswith(latents_lib.PREFIX):
    raise ValueError(f"vae={directory!r} is not allowed; the run trained on "
                     f"{config.data.dataset!r}, not on latents")
  if not paths.exists(paths.join(directory, "model.json")):
    raise ValueError(f"vae={directory!r} is not allowed; it is not a converted VAE directory")
  vae, params = checkpoint.load_params(directory, "vae")
  channels = model.in_chans if hasattr(model, "in_chans") else model.in_channels
  if type(vae).__name__ != "AutoencoderKL" or vae.latent_channels != channels:
    raise ValueError(f"vae={directory!r} is not allowed; it is not a VAE with "
                     f"{channels} latent channels")
  meta = paths.join(latents_lib.path_of(config.data.dataset), "meta.json")
  if paths.exists(meta):
    scale = paths.read_json(meta).get("scale")
    if scale is not None and abs(scale - vae.scaling_factor) > 1e-9:
      raise ValueError(f"vae={directory!r} is not allowed; its scaling_factor "
                       f"{vae.scaling_factor} differs from the latents' scale {scale}")
  return vae, params


def main(argv):
  del argv
  logs.quiet_libraries()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from PIL import Image


  try:
    if not _WORKDIR.value:
      raise ValueError("workdir is required")
    if _NUM.value < 1:
      raise ValueError(f"num={_NUM.value} is not allowed; it must be >= 1")
    config = checkpoint.run_config(_WORKDIR.value, task=("sit", "uvit"))
    info, model, mesh = setup.check_config(config)
    scfg = sample_config(config.sample, config.task)
    params, step = checkpoint.restore_run_params(_WORKDIR.value, mesh, _STEP.value,
                                                 _WEIGHTS.value)
    vae, vae_params = load_vae(_VAE.value, config, model) if _VAE.value else (None, None)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  task = setup.make_task(config, model, info)
  latent = config.data.dataset.startswith("latents:")
  out_dir = str(paths.resolve(_OUT.value or paths.join(_WORKDIR.value, "samples",
                                                       f"step_{step:07d}")))
  per = mesh.size
  batch = _BATCH.value or scfg.batch_size
  batch = max(per, (batch // per) * per)
  shape = task.image_shape()
  classes = task.num_labels  # unconditional U-ViT: 1 (labels are written, not used)
  base = jax.random.key(_SEED.value)
  sharding = shd.batch_sharding(mesh)

  @jax.jit
  def draw(indices):
    """Noise, labels and an SDE key per example, from (seed, example index) only."""
    keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(indices)
    noise = jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, 0), shape))(keys)
    if _LABELS.value == "uniform":
      labels = jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 1), (),
                                                     0, classes))(keys)
    else:
      labels = indices % classes
    return noise, labels

  run = jax.jit(lambda p, x, y, k: task.sample(p, x, y, k, scfg),
                in_shardings=(None, sharding, sharding, None), out_shardings=sharding)
  if vae is not None:
    decode = jax.jit(lambda p, z: vae.apply({"params": p}, z / vae.scaling_factor,
                                            method=vae.decode),
                     in_shardings=(None, sharding), out_shardings=sharding)
    vae_params = jax.device_put(vae_params, shd.replicated(mesh))
  images, all_labels, all_latents = [], [], []
  t0 = time.perf_counter()
  for start in range(0, _NUM.value, batch):
    idx = jnp.arange(start, start + batch)
    noise, labels = draw(idx)
    out = run(params, jax.device_put(noise, sharding), jax.device_put(labels, sharding),
              jax.random.fold_in(base, 10_000_000 + start))
    keep = min(batch, _NUM.value - start)
    if vae is not None:
      all_latents.append(np.asarray(jax.device_get(out))[:keep])
      # uint8 per batch: 50K decoded float images would need 39 GB of host memory.
      images.append(generation.to_uint8_official(jax.device_get(decode(vae_params, out))[:keep]))
    else:
      images.append(np.asarray(jax.device_get(out))[:keep])
    all_labels.append(np.asarray(labels)[:keep])
    done = start + keep
    rate = done / (time.perf_counter() - t0)
    logging.info("sampled %d/%d images, %.2f images/s, ETA %.0f s", done, _NUM.value, rate,
                 (_NUM.value - done) / rate)
  x = np.concatenate(images)
  labels = np.concatenate(all_labels)
  info_out = {"workdir": str(paths.resolve(_WORKDIR.value)), "step": step, "weights": _WEIGHTS.value,
              "num": int(len(x)), "seed": _SEED.value, "labels": _LABELS.value,
              "sampler": scfg.to_dict(), "seconds": round(time.perf_counter() - t0, 1),
              "vae": str(paths.resolve(_VAE.value)) if _VAE.value else None}
  if latent:
    paths.save_npz(paths.join(out_dir, "latents.npz"), labels=labels,
                   latents=np.concatenate(all_latents) if vae is not None else x)
  if not latent or vae is not None:
    if vae is not None:
      pixels = x
    else:
      pixels = (generation.to_uint8_official(x) if config.data.normalize == "half"
                else plots.to_uint8(x, task.mean, task.std))
    if pixels.shape[-1] == 1:
      pixels = np.repeat(pixels, 3, axis=-1)
    paths.save_npz(paths.join(out_dir, "samples.npz"), arr_0=pixels, labels=labels)
    n = min(_GRID.value, len(pixels))
    cols = int(np.ceil(np.sqrt(n)))
    rows = [pixels[i:i + cols] for i in range(0, n, cols)]
    if rows[-1].shape[0] < cols:
      rows[-1] = np.concatenate([rows[-1], np.full((cols - rows[-1].shape[0],) + rows[-1].shape[1:],
                                                   255, np.uint8)])
    picture = plots.image_grid(rows)
    scale = max(1, 512 // picture.shape[0])
    paths.save_png(paths.join(out_dir, "grid.png"), Image.fromarray(picture).resize(
        (picture.shape[1] * scale, picture.shape[0] * scale), Image.Resampling.NEAREST))
  paths.write_json(paths.join(out_dir, "info.json"), info_out)
  print(f"wrote {len(x)} samples to {out_dir}")
  return 0


def run():
  errors.run(main)


if __name__ == "__main__":
  run()
