"""Print (and plot) a decay schedule and its ``alpha_eff``: the coefficients of
``decay_jax.models.schedules``, block by block.

    python -m decay_jax.cli.schedules --depth 12 --alpha-min 0.6 [--convention block] [--plot out.png]
    python -m decay_jax.cli.schedules --depth 12 --target-alpha-eff 0.0176   # solve for alpha_min
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from decay_jax import plots, validate
from decay_jax.models import schedules


def format_table(sc: schedules.Shortcuts) -> str:
  """One row per block: both coefficients, their product and the running product; then alpha_eff."""
  lines = [f"{'block':>5}  {'alpha_attn':>10}  {'alpha_mlp':>10}  {'block product':>13}  "
           f"{'cumulative':>10}"]
  cum = 1.0
  for l, (a0, a1) in enumerate(sc.alphas):
    cum *= a0 * a1
    lines.append(f"{l:>5}  {a0:>10.6f}  {a1:>10.6f}  {a0 * a1:>13.6f}  {cum:>10.6f}")
  if sc.branch_scale != 1.0:
    lines.append(f"branch scale on f(x): {sc.branch_scale:.6f}")
  lines.append(f"alpha_eff (product of all {sc.alphas.size} coefficients) = {sc.alpha_eff:.6g}")
  return "\n".join(lines)


def plot(sc: schedules.Shortcuts, path: str, title: str) -> None:
  """Writes a PNG with the coefficient of every sublayer and the cumulative product."""
  flat = sc.alphas.reshape(-1)
  k = np.arange(flat.size)
  with plots.figure(path, 1, 2, size=(10, 3.6)) as (fig, axes):
    ax0, ax1 = axes[0]
    ax0.step(k, flat, where="mid", color="tab:blue")
    ax0.plot(k[0::2], flat[0::2], "o", ms=4, label="attention identity")
    ax0.plot(k[1::2], flat[1::2], "s", ms=4, label="MLP identity")
    ax0.set_xlabel("sublayer k (block = k // 2)")
    ax0.set_ylabel("alpha_k")
    ax0.set_ylim(min(0.0, flat.min() - 0.05), 1.05)
    ax0.legend(loc="lower left")
    ax0.grid(alpha=0.3)
    ax1.semilogy(k, np.cumprod(flat), color="tab:red")
    ax1.set_xlabel("sublayer k")
    ax1.set_ylabel("cumulative product (identity path weight)")
    ax1.grid(alpha=0.3, which="both")
    fig.suptitle(f"{title}   alpha_eff = {sc.alpha_eff:.4g}")


def main(argv: Sequence[str] | None = None) -> int:
  p = validate.ArgumentParser(prog="python -m decay_jax.cli.schedules", description=__doc__.split("\n")[0])
  p.add_argument("--depth", type=int, default=12, help="number of transformer blocks")
  p.add_argument("--alpha-min", type=float, default=None, help="last coefficient (default 0.7)")
  p.add_argument("--target-alpha-eff", type=float, default=None,
                 help="instead of --alpha-min: solve for the alpha_min giving this alpha_eff")
  p.add_argument("--convention", choices=schedules.CONVENTIONS, default="sublayer")
  p.add_argument("--shape", choices=schedules.SHAPES, default="linear")
  p.add_argument("--form", choices=schedules.FORMS, default="decay")
  p.add_argument("--plot", default=None, metavar="PNG", help="write a plot of the schedule here")
  args = p.parse_args(argv)
  try:
    if args.target_alpha_eff is not None:
      if args.alpha_min is not None:
        raise ValueError("give either --alpha-min or --target-alpha-eff, not both")
      alpha_min = schedules.alpha_min_for(args.target_alpha_eff, args.depth, args.convention, args.shape)
      print(f"alpha_min = {alpha_min:.6f} gives alpha_eff = {args.target_alpha_eff:g}")
    else:
      alpha_min = 0.7 if args.alpha_min is None else args.alpha_min
    sc = schedules.shortcuts(args.depth, alpha_min, args.convention, args.shape, args.form)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  title = (f"depth {args.depth}, alpha_min {alpha_min:g}, {args.convention}, {args.shape}, "
           f"{args.form}")
  print(title)
  print(format_table(sc))
  if args.plot:
    plot(sc, args.plot, title)
    print(f"wrote {args.plot}")
  return 0


def run():
  sys.exit(main())


if __name__ == "__main__":
  run()
