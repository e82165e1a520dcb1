"""Train the same config at several alpha_min values with the same budget and compare them.

    python -m decay_jax.cli.compare --config=configs/mae_cpu_mnist.py --workdir=DIR --alphas=0.6,1.0

Each arm trains in ``DIR/alpha_<value>`` (resumable, like ``decay_jax.cli.train``) with identical data,
seed, schedule and steps; only ``model.alpha_min`` differs (1.0 is the standard residual network).
Writes ``DIR/comparison.md`` (the table printed at the end, with the budget), ``DIR/comparison.json``
and ``DIR/reconstructions.png`` (each arm's final reconstruction grid, one above the other).
"""

import io
import sys
import time

from absl import flags, logging
from ml_collections import config_flags

from decay_jax import logs, paths
from decay_jax.cli import errors
from decay_jax.evals import registry
from decay_jax.train import trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (one sub-directory per arm).")
_ALPHAS = flags.DEFINE_list("alphas", ["0.6", "1.0"], "alpha_min of each arm.")
flags.mark_flags_as_required(["config", "workdir"])


def table(rows, config) -> str:
  steps = rows[0]["step"] if rows else 0
  lines = [
      f"Budget per arm: {steps} steps x batch {config.batch_size} = {steps * config.batch_size:,} "
      f"images ({config.data.dataset}, {config.model.preset}, seed {config.seed}); same data, "
      "schedule and seed for every arm.",
      "",
      "| alpha_min | alpha_eff | final loss | KNN top-1 | KNN top-5 | train+eval time |",
      "|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(f"| {r['alpha_min']:.2f} | {r['alpha_eff']:.4g} | {r['loss']:.4f} | "
                 f"{100 * r.get('knn/top1', float('nan')):.2f}% | "
                 f"{100 * r.get('knn/top5', float('nan')):.2f}% | {r['seconds']:.0f} s |")
  return "\n".join(lines)


def stack_pictures(pictures, out: str) -> None:
  """One image of ``pictures`` (``[(path, label)]``) above each other, each under its label."""
  from PIL import Image, ImageDraw
  ims = [Image.open(io.BytesIO(paths.resolve(p).read_bytes())).convert("RGB") for p, _ in pictures]
  label_h = 14
  w = max(i.width for i in ims)
  canvas = Image.new("RGB", (w, sum(i.height + label_h for i in ims)), "white")
  y = 0
  for im, (_, label) in zip(ims, pictures):
    ImageDraw.Draw(canvas).text((2, y), label, fill="black")
    canvas.paste(im, (0, y + label_h))
    y += im.height + label_h
  paths.save_png(out, canvas)


def main(argv):
  del argv
  logs.quiet_libraries()

  base = _CONFIG.value
  try:
    alphas = [float(a) for a in _ALPHAS.value]
    for a in alphas:
      cfg = base.copy_and_resolve_references()
      cfg.model.alpha_min = a
      trainer.check_config(cfg)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  rows, pictures = [], []
  for a in alphas:
    cfg = base.copy_and_resolve_references()
    cfg.model.alpha_min = a
    workdir = paths.join(_WORKDIR.value, f"alpha_{a:g}")
    logging.info("=== arm alpha_min=%g -> %s", a, workdir)
    t0 = time.perf_counter()
    res = trainer.train_and_evaluate(cfg, workdir, evaluators=registry.build)
    info, model, _ = trainer.check_config(cfg)
    rows.append(dict(res, alpha_min=a, alpha_eff=model.shortcuts.alpha_eff,
                     seconds=time.perf_counter() - t0, workdir=workdir))
    picture_dir = paths.resolve(workdir) / "pictures"
    pics = sorted(p.name for p in picture_dir.iterdir()) if picture_dir.is_dir() else []
    if pics:
      pictures.append((str(picture_dir / pics[-1]), f"alpha_min = {a:g}"))
  text = table(rows, base)
  paths.write_text(paths.join(_WORKDIR.value, "comparison.md"), text + "\n")
  paths.write_json(paths.join(_WORKDIR.value, "comparison.json"), rows)
  if pictures:
    stack_pictures(pictures, paths.join(_WORKDIR.value, "reconstructions.png"))
  print("\n" + text + "\n")
  print(f"tables and pictures in {paths.resolve(_WORKDIR.value)}")
  return 0


def run():
  errors.run(main)


if __name__ == "__main__":
  run()
