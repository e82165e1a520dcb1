"""Train arms of one config with the same budget, over seeds, and compare them with intervals.

    python -m decay_jax.cli.compare --config=configs/mae_cpu_mnist.py --workdir=DIR --alphas=0.6,1.0
    python -m decay_jax.cli.compare --config=configs/mae_cpu_mnist.py --workdir=DIR --seeds=3 \\
        --grid=model.alpha_min=0.6,1.0 --grid=model.branch_gain=none,layerscale

The arms are the product of the ``--grid`` values (``FIELD=V1,V2,...``, any config field;
``decay_jax.train.grid``), or one per ``--arm=FIELD=V[+FIELD=V...]``; otherwise ``--alphas`` varies
``model.alpha_min`` (1.0 is the standard residual network). Every arm trains with identical data, schedule and steps, once per
seed (``config.seed + 0 .. seeds-1``), in its own resumable directory ``DIR/<arm>[_seed<N>]``.

Metrics: the final loss (the mean over the last logging window; with REPA it holds the alignment
term), SiT's flow loss alone (``loss_v``: runs with and without REPA compare on it), KNN top-1/5.
With two or more seeds the table gives, per metric, the mean, the standard deviation and the 95%
Student-t interval, and lists for each pair of arms the 95% Welch interval of the difference and
whether it excludes 0 (``decay_jax.evals.intervals``). Writes ``DIR/comparison.md`` (the table
printed at the end, with the budget), ``DIR/comparison.json`` (every run and every summary) and
``DIR/reconstructions.png`` (each arm's final reconstruction grid of its first seed).
"""

import io
import itertools
import sys
import time

from absl import flags, logging
from ml_collections import config_flags

from decay_jax import logs, paths
from decay_jax.cli import errors
from decay_jax.evals import intervals, registry
from decay_jax.train import grid as grid_lib
from decay_jax.train import setup, trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (one sub-directory per run).")
_ALPHAS = flags.DEFINE_list("alphas", ["0.6", "1.0"], "alpha_min of each arm (without --grid).")
_GRID = flags.DEFINE_multi_string("grid", [], "FIELD=V1,V2,...: a config field and its values; "
                                  "repeat for a product of several fields.")
_ARM = flags.DEFINE_multi_string("arm", [], "FIELD=V[+FIELD=V...]: one arm; repeat for each arm "
                                 "(instead of --grid, for arms that are no product).")
_SEEDS = flags.DEFINE_integer("seeds", 1, "Runs per arm, seeds config.seed + 0, 1, ...")
flags.mark_flags_as_required(["config", "workdir"])

# (result key, column title, shown in percent)
METRICS = (("loss", "final loss", False), ("loss_v", "flow loss", False),
           ("knn/top1", "KNN top-1", True), ("knn/top5", "KNN top-5", True))


def _cell(s, percent: bool) -> str:
  scale, unit, digits = (100.0, "%", 2) if percent else (1.0, "", 4)
  text = f"{scale * s['mean']:.{digits}f}{unit}"
  if s["n"] > 1:
    text += f" ± {scale * (s['hi'] - s['mean']):.{digits}f} (sd {scale * s['sd']:.{digits}f})"
  return text


def table(arms, config, seeds) -> str:
  """The markdown report of ``arms`` (``[{'name', 'alpha_eff', 'runs', 'summary'}]``)."""
  steps = arms[0]["runs"][0]["step"]
  metrics = [m for m in METRICS if m[0] in arms[0]["summary"]]
  n = len(seeds)
  lines = [
      f"Budget per run: {steps} steps x batch {config.batch_size} = "
      f"{steps * config.batch_size:,} images ({config.data.dataset}, {config.model.preset}); "
      f"{n} seed{'s' if n > 1 else ''} per arm ({', '.join(map(str, seeds))}); same data, "
      "schedule and seeds for every arm.",
  ]
  if n > 1:
    lines.append(f"Cells: mean ± half-width of the 95% Student-t interval over the {n} seeds "
                 "(sd: the standard deviation).")
  lines += ["", "| arm | alpha_eff | " + " | ".join(t for _, t, _ in metrics)
            + " | train+eval time |", "|---|---:|" + "---:|" * len(metrics) + "---:|"]
  for arm in arms:
    cells = [_cell(arm["summary"][key], pct) for key, _, pct in metrics]
    seconds = sum(r["seconds"] for r in arm["runs"]) / len(arm["runs"])
    lines.append(f"| {arm['name']} | {arm['alpha_eff']:.4g} | " + " | ".join(cells)
                 + f" | {seconds:.0f} s |")
  if n > 1 and len(arms) > 1:
    lines += ["", "Differences (first arm minus second; 95% Welch interval; separated when it "
              "excludes 0):", ""]
    for a, b in itertools.combinations(arms, 2):
      for key, title, pct in metrics:
        d = difference_of(a, b, key)
        scale, unit = (100.0, " points") if pct else (1.0, "")
        verdict = ("separated: " + (a["name"] if d["diff"] > 0 else b["name"]) + " higher"
                   if d["separated"] else "not separated")
        lines.append(f"- {title}, {a['name']} vs {b['name']}: {scale * d['diff']:+.4g}{unit} "
                     f"[{scale * d['lo']:+.4g}, {scale * d['hi']:+.4g}]: {verdict}")
  return "\n".join(lines)


def difference_of(a, b, key):
  return intervals.difference([r[key] for r in a["runs"]], [r[key] for r in b["runs"]])


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


def _arms(base):
  """The arms and seeds of the flags; one-line ValueError for bad flags."""
  given = [f"--{n}" for n in ("alphas", "grid", "arm") if flags.FLAGS[n].present]
  if len(given) > 1:
    raise ValueError(f"{' and '.join(given)} were given; choose one way to name the arms "
                     "(--alphas=A,B is --grid=model.alpha_min=A,B)")
  if _ARM.value:
    arms = grid_lib.parse_arms(base, _ARM.value)
  else:
    arms = grid_lib.parse(base, _GRID.value or ["model.alpha_min=" + ",".join(_ALPHAS.value)])
  seeds = grid_lib.seeds(base, _SEEDS.value)
  for arm in arms:
    setup.check_config(arm.config(base, seeds[0]))
  return arms, seeds


def main(argv):
  del argv
  logs.quiet_libraries()
  base = _CONFIG.value
  try:
    arms, seeds = _arms(base)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  results, pictures = [], []
  total, done, t_start = len(arms) * len(seeds), 0, time.perf_counter()
  for arm in arms:
    runs = []
    for seed in seeds:
      cfg = arm.config(base, seed)
      workdir = paths.join(_WORKDIR.value, arm.dirname(seed, int(base.seed)))
      logging.info("=== run %d/%d: %s, seed %d -> %s", done + 1, total, arm.name, seed, workdir)
      t0 = time.perf_counter()
      res = trainer.train_and_evaluate(cfg, workdir, evaluators=registry.build)
      runs.append(dict(res, seed=seed, workdir=workdir, seconds=time.perf_counter() - t0))
      done += 1
      elapsed = time.perf_counter() - t_start
      logging.info("=== %d/%d runs done in %.0f s; about %.0f s left", done, total, elapsed,
                   elapsed / done * (total - done))
      if seed == seeds[0]:
        picture_dir = paths.resolve(workdir) / "pictures"
        pics = sorted(p.name for p in picture_dir.iterdir()) if picture_dir.is_dir() else []
        if pics:
          pictures.append((str(picture_dir / pics[-1]), arm.name))
    _, model, _ = setup.check_config(arm.config(base, seeds[0]))
    keys = [k for k, _, _ in METRICS if all(k in r for r in runs)]
    results.append({"name": arm.name, "overrides": dict(arm.overrides),
                    "alpha_eff": model.shortcuts.alpha_eff, "runs": runs,
                    "summary": {k: intervals.summary([r[k] for r in runs]) for k in keys}})
  text = table(results, base, seeds)
  differences = [dict(difference_of(a, b, k), metric=k, a=a["name"], b=b["name"])
                 for a, b in itertools.combinations(results, 2) for k in a["summary"]]
  paths.write_text(paths.join(_WORKDIR.value, "comparison.md"), text + "\n")
  paths.write_json(paths.join(_WORKDIR.value, "comparison.json"),
                   {"seeds": seeds, "arms": results, "differences": differences})
  if pictures:
    stack_pictures(pictures, paths.join(_WORKDIR.value, "reconstructions.png"))
  print("\n" + text + "\n")
  print(f"tables and pictures in {paths.resolve(_WORKDIR.value)}")
  return 0


def run():
  errors.run(main)


if __name__ == "__main__":
  run()
