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
``config.sample`` values, or with ``--sampler=eval`` those of the evaluation the config reports
(``config.evals.generation``: its ``sample`` section and ``batch_size``; with its ``seed``, the
first ``num_samples`` images are those the periodic evaluation of training scores). Labels are uniform in ``[0, num_classes)`` as ADM's and SiT's FID
samplers draw them (``--labels=cycle`` gives ``i % num_classes``); example ``i`` always gets the
same noise and label (seeded by ``--seed`` and ``i``).

Sampling at scale (``decay_jax/evals/sampling.py``, docs/generation_metrics.md "Sampling 50,000
images"): chunk ``k`` is examples ``[k B, (k + 1) B)`` of one sampling call of ``B``
(``--batch_size``, or ``--per_device_batch`` x the devices) split over every device of every
process; each chunk is written to ``OUT/chunks/chunk_<k>.npz`` whole (temporary name, rename),
with progress and ETA. Killed and rerun with the same flags, the command draws only the chunks
that are missing (or damaged: named and drawn again) and gives the same images as an
uninterrupted run. Several processes (``DECAY_JAX_DISTRIBUTED=1``): process 0 writes everything.

Writes into ``--out`` (default ``DIR/samples/step_<step>``): ``samples.npz`` in ADM's layout,
``arr_0`` uint8 ``(N, H, W, 3)`` and, for class-conditional models, ``arr_1`` (the labels, as ADM's
``image_sample.py``), plus ``labels``; ``grid.png`` (the first ``--grid`` images) and
``info.json``; the chunks are deleted then (``--keep_chunks`` keeps them).
Pixel values follow the official rounding ``clip(127.5 x + 128, 0, 255)`` truncated to uint8, for
models trained on ``[-1, 1]`` images. Latent models (``data.dataset=latents:...``) write the raw
latents to ``latents.npz``; with ``--vae=DIR`` (the converted VAE the latents were extracted with)
each batch is also decoded, ``vae.decode(z / scaling_factor)``, on the same devices, and the
pixels go to ``samples.npz`` as above (the official FID sampler):

    python -m decay_jax.cli.sample --workdir=DIR --num=50000 --vae=/data/sd_vae_ft_ema --cfg=1.0
"""

import hashlib
import json
import os
import sys
import time

from absl import flags

from decay_jax import logs, paths, plots, validate
from decay_jax import sharding as shd
from decay_jax.cli import errors
from decay_jax.data import latents as latents_lib
from decay_jax.evals import sampling
from decay_jax.train import checkpoint, digest, setup, tasks

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (config.json + checkpoints/).")
_STEP = flags.DEFINE_integer("step", -1, "Checkpoint step (-1: newest).")
_WEIGHTS = flags.DEFINE_enum("weights", "ema", ["ema", "params"], "Which weights to sample with.")
_NUM = flags.DEFINE_integer("num", 64, "Number of images.")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Images per chunk = per sampling call, all devices "
                               "(0: --per_device_batch x devices, else config.sample).")
_PER_DEVICE = flags.DEFINE_integer("per_device_batch", 0, "Images per device per chunk (0: unset).")
_MODE = flags.DEFINE_enum("mode", None, ["ode", "sde", "dpm"], "ODE or SDE sampler; U-ViT: dpm too.")
_METHOD = flags.DEFINE_string("method", None, "SiT ode: euler|heun|dopri5; sde: euler|heun. "
                              "U-ViT dpm: fast|pp; sde, ode: euler.")
_STEPS = flags.DEFINE_integer("steps", None, "Sampler steps (grid points).")
_CFG = flags.DEFINE_float("cfg", None, "Classifier-free guidance scale (1 = none).")
_CFG_CHANNELS = flags.DEFINE_integer("cfg_channels", None, "Guide channels [:k] (0 = all).")
_CFG_INTERVAL = flags.DEFINE_list("cfg_interval", None, "Guidance only for t in [lo, hi].")
_LABELS = flags.DEFINE_enum("labels", "uniform", ["uniform", "cycle"], "Class labels.")
_SAMPLER = flags.DEFINE_enum("sampler", "sample", ["sample", "eval"], "Defaults of the sampler "
                             "flags: config.sample, or the reported evaluation's "
                             "config.evals.generation (its sample section and batch_size).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of noise and labels.")
_GRID = flags.DEFINE_integer("grid", 64, "Images in grid.png.")
_OUT = flags.DEFINE_string("out", None, "Output directory.")
_VAE = flags.DEFINE_string("vae", None, "Latent runs: converted VAE directory to decode with.")
_KEEP = flags.DEFINE_bool("keep_chunks", False, "Keep OUT/chunks/ after writing the .npz files.")


def sample_config(base, task):
  """The sampler section ``base`` with the sampler flags given, checked against the samplers of
  ``task`` (the run's task class)."""
  task_name = task.name
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
  sampling.check_sampler(c, task.sampler_modes)
  return c


def eval_section(config):
  """``config.evals.generation`` of a run (``--sampler=eval``): the reported evaluation's
  sampler and chunk size, so that ``--num=report_num`` draws the paper's row."""
  if "generation" not in config.get("evals", {}):
    raise ValueError("--sampler=eval is not allowed; the run's config has no "
                     "evals.generation section (older runs: give the sampler flags)")
  return config.evals.generation


def load_vae(directory, config, model):
  """``(vae, params)`` of a converted VAE that fits the latents of the run (channels, scale)."""
  return sampling.load_vae(directory, config.data.dataset, model, checkpoint.load_params)


def _weights_id(tree) -> str:
  """A short hash of the digests of ``tree``'s arrays (``train.digest``): the weights' identity."""
  sums, _ = digest.compute(tree)
  return hashlib.sha256(json.dumps(sorted(sums.items())).encode()).hexdigest()[:16]


def chunk_size(mesh, default: int) -> int:
  """Examples per chunk (= per sampling call): ``--batch_size``, else ``--per_device_batch`` x the
  devices, else ``default``; rounded down to a multiple of the device count."""
  validate.check_int("batch_size", _BATCH.value, 0)
  validate.check_int("per_device_batch", _PER_DEVICE.value, 0)
  per = mesh.size
  batch = _BATCH.value or _PER_DEVICE.value * per or default
  if batch % per:
    rounded = sampling.round_chunk(batch, per)
    print(f"batch_size={batch} is not divisible by the {per} devices; using {rounded}")
    batch = rounded
  return batch


def main(argv):
  del argv
  logs.quiet_libraries()
  import jax
  import numpy as np
  from PIL import Image

  if os.environ.get("DECAY_JAX_DISTRIBUTED") == "1":
    jax.distributed.initialize()
  try:
    if not _WORKDIR.value:
      raise ValueError("workdir is required")
    validate.check_int("num", _NUM.value, 1)
    validate.check_int("grid", _GRID.value, 0)
    config = tasks.run_config(_WORKDIR.value,
                              [name for name, t in tasks.TASKS.items() if t.sampler_modes])
    mesh = shd.make_mesh(-1, config.mesh.fsdp)  # every device of every process
    section = eval_section(config) if _SAMPLER.value == "eval" else config.sample
    batch = chunk_size(mesh, section.batch_size)
    # check_batch asks for a multiple of devices x accum_steps, a training notion
    info, model, mesh = setup.check_config(config, mesh=mesh, batch=batch * config.accum_steps)
    scfg = sample_config(section.sample if _SAMPLER.value == "eval" else section,
                         tasks.get(config.task))
    params, step = checkpoint.restore_run_params(_WORKDIR.value, mesh, _STEP.value,
                                                 _WEIGHTS.value)
    vae, vae_params = load_vae(_VAE.value, config, model) if _VAE.value else (None, None)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  task = setup.make_task(config, model, info)
  latent = config.data.dataset.startswith(latents_lib.PREFIX)
  out_dir = str(paths.resolve(_OUT.value or paths.join(_WORKDIR.value, "samples",
                                                       f"step_{step:07d}")))
  classes = task.num_labels  # unconditional U-ViT: 1 (labels are written, not used)
  conditional = getattr(model, "conditional", True)  # SiT: always class-conditional
  decode = None
  if vae is not None:
    decode = sampling.vae_decoder(vae)
    vae_params = jax.device_put(vae_params, shd.replicated(mesh))
  program = sampling.chunk_program(lambda p, x, y, k: task.sample(p, x, y, k, scfg), mesh,
                                   _SEED.value, batch, task.image_shape(), classes,
                                   _LABELS.value, decode)
  try:  # traces the sampler: a setting it rejects (U-ViT guidance without dropout) is one line
    shapes = jax.eval_shape(program, params, vae_params, np.int32(0))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  pixels = not latent or vae is not None
  keys = {"labels": ((), "int32")}
  if latent:
    keys["latents"] = (shapes["latents" if vae is not None else "out"].shape[1:], "float32")
  if pixels:
    keys["images"] = (shapes["out"].shape[1:3] + (3,), "uint8")
  expect = sampling.expected(batch, keys)

  official = vae is not None or config.data.normalize == "half"
  to_pixels = lambda x: sampling.to_pixels(x, official, task.mean, task.std)

  def make_chunk(i):
    out = program(params, vae_params, np.int32(i))
    arrays = {"labels": sampling.to_host(out["labels"]).astype(np.int32)}
    x = sampling.to_host(out["out"])
    if latent:
      arrays["latents"] = np.asarray(sampling.to_host(out["latents"]) if vae is not None else x,
                                     np.float32)
    if pixels:
      arrays["images"] = to_pixels(x)
    return arrays

  sampler = {k: v for k, v in scfg.to_dict().items() if k not in ("batch_size", "grid_size")}
  manifest = json.loads(json.dumps({
      "step": step, "weights": _WEIGHTS.value, "weights_digest": _weights_id(params),
      "seed": _SEED.value, "labels": _LABELS.value, "classes": classes, "sampler": sampler,
      "chunk_size": batch, "vae": _weights_id(vae_params) if vae is not None else None,
      "arrays": {k: [list(shape), dtype] for k, (shape, dtype) in expect.items()}}))
  t0 = time.perf_counter()
  try:
    counts = sampling.sample(out_dir, manifest, _NUM.value, batch, make_chunk, expect)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if jax.process_index() != 0:
    return 0
  outputs = {}
  if pixels:
    outputs["samples.npz"] = ([("arr_0", "images")] + ([("arr_1", "labels")] if conditional else [])
                              + [("labels", "labels")])
  if latent:
    outputs["latents.npz"] = [("latents", "latents"), ("labels", "labels")]
  try:
    kept = sampling.assemble(out_dir, _NUM.value, batch, expect, outputs,
                             _GRID.value if pixels else 0)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if pixels and _GRID.value:
    grid = kept["images"]
    cols = int(np.ceil(np.sqrt(len(grid))))
    rows = [grid[i:i + cols] for i in range(0, len(grid), cols)]
    if rows[-1].shape[0] < cols:
      rows[-1] = np.concatenate([rows[-1], np.full((cols - rows[-1].shape[0],) + rows[-1].shape[1:],
                                                   255, np.uint8)])
    picture = plots.image_grid(rows)
    scale = max(1, 512 // picture.shape[0])
    paths.save_png(paths.join(out_dir, "grid.png"), Image.fromarray(picture).resize(
        (picture.shape[1] * scale, picture.shape[0] * scale), Image.Resampling.NEAREST))
  paths.write_json(paths.join(out_dir, "info.json"), {
      "workdir": str(paths.resolve(_WORKDIR.value)), "step": step, "weights": _WEIGHTS.value,
      "num": _NUM.value, "seed": _SEED.value, "labels": _LABELS.value, "sampler": scfg.to_dict(),
      "chunk_size": batch, "devices": mesh.size, "processes": jax.process_count(), **counts,
      "seconds": round(time.perf_counter() - t0, 1),
      "vae": str(paths.resolve(_VAE.value)) if _VAE.value else None})
  if not _KEEP.value:
    sampling.remove_chunks(out_dir)
  print(f"wrote {_NUM.value} samples to {out_dir} ({counts['reused']} of {counts['chunks']} "
        f"chunks reused)")
  return 0


def run():
  errors.run(main)


if __name__ == "__main__":
  run()
