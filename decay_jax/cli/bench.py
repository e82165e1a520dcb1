"""Benchmark the train step of a config: compile seconds, images/s, model TFLOP/s, MFU, memory.

    python -m decay_jax.cli.bench --config=configs/mae_vit_b16.py --batch_per_device=64 --steps=20
    python -m decay_jax.cli.bench --config=configs/mae_vit_h14.py --compile_only --fake_devices=8
    python -m decay_jax.cli.bench --config=configs/mae_cpu_mnist.py --torch   # + PyTorch reference
    python -m decay_jax.cli.bench --task=sit --preset=XL/2 --compile_only --batch_per_device=32

Inputs are synthetic (the model's shape, standard normal), so no dataset is needed. With
``--compile_only`` nothing is allocated: the step is lowered and compiled on abstract inputs
(``jit(...).lower(...).compile()``) and XLA's memory analysis is printed. ``--fake_devices=N``
makes N CPU devices (set before JAX starts) to size pods on a laptop. ``--torch`` times the
PyTorch reference of the tests (fp32, same batch, AdamW) on the same machine and prints the ratio.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _early_fake_devices(argv) -> None:
  """``--fake_devices`` must reach XLA before JAX is imported."""
  for a in argv:
    if a.startswith("--fake_devices="):
      n = int(a.split("=", 1)[1])
      if n > 0:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={n}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


_early_fake_devices(sys.argv)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from decay_jax import paths  # noqa: E402
from decay_jax import sharding as shd  # noqa: E402
from decay_jax.cli import errors, memory  # noqa: E402
from decay_jax.models import flops  # noqa: E402
from decay_jax.train import config as config_lib  # noqa: E402
from decay_jax.train import step as step_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_TASK = flags.DEFINE_enum("task", "mae", ["mae", "sit"], "Without --config: the task's defaults.")
_PRESET = flags.DEFINE_string("preset", None, "Without --config: the model preset (e.g. XL/2).")
_DTYPE = flags.DEFINE_string("dtype", None, "Override model.dtype (float32, bfloat16).")
_REMAT = flags.DEFINE_string("remat", None, "Override model.remat_policy (none, full, dots).")
_BATCH = flags.DEFINE_integer("batch_per_device", 0, "Per-device batch (0: the config's batch).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per repeat (after one warm-up step).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed windows of --steps steps; min and median.")
_COMPILE_ONLY = flags.DEFINE_bool("compile_only", False, "Only lower + compile on abstract inputs.")
flags.DEFINE_integer("fake_devices", 0, "Number of fake CPU devices (read before JAX starts).")
_CHANNELS = flags.DEFINE_integer("channels", 0, "Input channels (0: 3 for MAE, 4 for SiT).")
_TORCH = flags.DEFINE_bool("torch", False, "Also time the PyTorch reference (CPU, fp32).")
_OUT = flags.DEFINE_string("out", None, "Append the result as one JSON line to this file.")


def torch_reference_seconds(config, model, batch: int, steps: int) -> float:
  """Seconds per train step of the PyTorch reference (tests/torch_reference.py) on CPU."""
  tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests")
  if not os.path.isfile(os.path.join(tests, "torch_reference.py")):
    raise ValueError("--torch is not allowed here; it needs a checkout of decay-jax (it runs "
                     "tests/torch_reference.py)")
  sys.path.insert(0, tests)
  import torch
  import torch_reference as ref

  torch.manual_seed(0)
  if config.task == "mae":
    tm = ref.MaskedAutoencoderViT(
        img_size=model.img_size, patch_size=model.patch_size, in_chans=model.in_chans,
        embed_dim=model.dim, depth=model.depth, num_heads=model.num_heads,
        decoder_embed_dim=model.decoder_dim, decoder_depth=model.decoder_depth,
        decoder_num_heads=model.decoder_num_heads, norm_pix_loss=model.norm_pix_loss,
        min_decay=model.alpha_min)
    x = torch.randn(batch, model.in_chans, model.img_size, model.img_size)
    loss_fn = lambda: tm(x, model.mask_ratio, torch.rand(batch, model.num_patches))[0]
  else:
    tm = ref.SiT(input_size=model.input_size, patch_size=model.patch_size,
                 in_channels=model.in_channels, hidden_size=model.dim, depth=model.depth,
                 num_heads=model.num_heads, num_classes=model.num_classes,
                 learn_sigma=model.learn_sigma, min_sigma=model.alpha_min)
    x = torch.randn(batch, model.in_channels, model.input_size, model.input_size)
    y = torch.randint(0, model.num_classes, (batch,))
    loss_fn = lambda: ((tm(x, torch.rand(batch), y) - x) ** 2).mean()
  tm.train()
  opt = torch.optim.AdamW([p for p in tm.parameters() if p.requires_grad], lr=1e-4)

  def one():
    opt.zero_grad(set_to_none=True)
    loss_fn().backward()
    opt.step()

  one()
  t = time.perf_counter()
  for _ in range(steps):
    one()
  return (time.perf_counter() - t) / steps


def main(argv):
  del argv
  config = _CONFIG.value
  if config is None:
    config = config_lib.mae_config() if _TASK.value == "mae" else config_lib.sit_config()
  try:  # bad value: one line, nothing compiled
    config_lib.override(config, **config_lib.model_overrides(
        preset=None if _CONFIG.value is not None else _PRESET.value, dtype=_DTYPE.value,
        remat=_REMAT.value))
    config_lib.validate(config)
    if _TORCH.value and config.task not in ("mae", "sit"):
      raise ValueError(f"--torch is not allowed with task={config.task!r}; the PyTorch reference "
                       "times MAE and SiT pre-training")
    mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp)
    batch = _BATCH.value * mesh.size if _BATCH.value else config.batch_size
    shd.check_batch(batch, mesh, config.accum_steps)
    memory.build(config, batch, _CHANNELS.value)  # the model checks its own fields
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  c = memory.compile_train_step(config, batch, _CHANNELS.value)
  model, task, tx, compiled = c["model"], c["task"], c["tx"], c["compiled"]
  abstract, shardings, a_batch = c["abstract"], c["shardings"], c["a_batch"]
  ema = config.ema_decay > 0
  n_params = sum(int(np.prod(l.shape)) for l in jax.tree_util.tree_leaves(abstract["params"]))
  flops_step = task.train_flops_per_example() * batch
  name = (os.path.basename(config_flags.get_config_filename(flags.FLAGS["config"]))
          if _CONFIG.value is not None else f"{config.task} defaults")
  res = {"config": name,
         "preset": config.model.preset,
         "alpha_min": model.alpha_min, "dtype": config.model.dtype, "remat": config.model.remat_policy,
         "attention": model.attention_impl or "auto", "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "devices": mesh.size, "device_kind": jax.devices()[0].device_kind,
         "mesh": dict(mesh.shape), "global_batch": batch, "accum_steps": config.accum_steps,
         "params": n_params, "model_gflops_per_example": task.train_flops_per_example() / 1e9,
         "lower_seconds": round(c["lower_seconds"], 2),
         "compile_seconds": round(c["compile_seconds"], 2), **memory.memory_report(compiled)}
  if config.task == "sit":  # residual routing: parameters and train FLOPs against plain residuals
    res.update(flops.overhead(model))
  if not _COMPILE_ONLY.value:
    rng = np.random.default_rng(0)
    local = {"image": rng.standard_normal(a_batch["image"].shape, np.float32),
             "label": rng.integers(0, 10, batch).astype(np.int32)}
    data = shd.global_batch_from_local(local, mesh)
    state = jax.jit(lambda: step_lib.init_state(task, tx, config.seed, ema),
                    out_shardings=shardings)()
    state, m = compiled(state, data)
    jax.block_until_ready(m)
    walls, cpus = [], []
    for _ in range(_REPEATS.value):
      t, cpu = time.perf_counter(), time.process_time()
      for _ in range(_STEPS.value):
        state, m = compiled(state, data)
      jax.block_until_ready(m)
      walls.append((time.perf_counter() - t) / _STEPS.value)
      cpus.append((time.process_time() - cpu) / _STEPS.value)
    # The median window is the figure; the min says how much a busy machine stretched it.
    sec = float(np.median(walls))
    res.update(step_seconds_min=round(min(walls), 5), repeats=_REPEATS.value, steps=_STEPS.value)
    # CPU seconds of this process (all threads) per step: on CPU, the work done, which a shared
    # machine inflates less than the wall clock.
    res["step_cpu_seconds"] = round(float(np.median(cpus)), 5)
    peak = flops.peak_flops_per_device(config.get("peak_tflops_per_device", 0.0))
    res.update(step_seconds=round(sec, 5), images_per_sec=round(batch / sec, 1),
               images_per_sec_per_device=round(batch / sec / mesh.size, 1),
               model_tflops_per_sec_per_device=round(flops_step / sec / mesh.size / 1e12, 4))
    if peak:
      res["mfu"] = round(flops_step / sec / mesh.size / peak, 4)
    if _TORCH.value:
      tsec = torch_reference_seconds(config, model, batch, _STEPS.value)
      res.update(torch_step_seconds=round(tsec, 5), torch_images_per_sec=round(batch / tsec, 1),
                 speedup_vs_torch=round(tsec / sec, 3))
  for k, v in res.items():
    print(f"{k:>32}: {v}")
  if _OUT.value:
    paths.append_text(_OUT.value, json.dumps(res) + "\n")
  return 0


def run():
  errors.run(main)


if __name__ == "__main__":
  run()
