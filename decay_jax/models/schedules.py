"""Decay schedules for decayed identity shortcuts (arXiv 2404.10947).

A decayed residual update replaces ``x + f(x)`` by ``alpha * x + f(x)``. This module computes the
alpha coefficients as plain numpy/Python floats. Models turn them into module constants: they are
never parameters and never stored in checkpoints (docs/official_code.md section 7).

Every table returned here has shape ``(depth, 2)``: row ``l`` holds the coefficients of the
attention identity and of the MLP identity of block ``l``.

Conventions (``convention=``)
  ``"sublayer"`` (official code, default): ``2*depth`` coefficients, one per sublayer,
      ``alpha_k = 1 - k (1 - alpha_min) / (2 depth - 1)``, ``k = 0 .. 2 depth - 1``, with sublayer
      ``k = 2l`` the attention and ``k = 2l + 1`` the MLP of block ``l``. The first value is exactly
      1.0 and the last exactly ``alpha_min`` (docs/official_code.md 1.4 and 4.4).
  ``"block"`` (the paper's equation): one coefficient per block,
      ``alpha_l = 1 - l (1 - alpha_min) / L``, ``l = 1 .. L``, applied to the block as a whole:
      ``x_{l+1} = alpha_l x_l + f_l(x_l)``. For a pre-norm block with two sublayers this is exactly
      the pair ``(alpha_l, 1)``, because ``x + M(x')`` with ``x' = a x + A(x)`` equals
      ``a x + [A(x) + M(x')]``.

Shapes (``shape=``)
  ``"linear"``: the formulas above.
  ``"cosine"`` (the paper's ablation; the exact curve is not in the released code, this is our
      choice): ``alpha = alpha_min + (1 - alpha_min) (1 + cos(pi u)) / 2`` where ``u`` runs over the
      same positions as the linear schedule normalised to ``[0, 1]`` (``k / (2L - 1)`` or ``l / L``).
      It has the same endpoints as the linear schedule.

Shortcut forms (``form=``): the ablations of the paper.
  ``"decay"``: ``x <- alpha x + f(x)`` (the method).
  ``"learnable"``: ``alpha`` is a trainable parameter initialised from the schedule.
  ``"sqrt_half_both"``: ``x <- sqrt(1/2) x + sqrt(1/2) f(x)`` (no schedule).
  ``"sqrt_half_f"``: ``x <- x + sqrt(1/2) f(x)`` (no schedule).
  ``"attn_only"`` / ``"mlp_only"``: the schedule on the attention (MLP) identity only, 1 elsewhere.

``alpha_eff`` is the product of all identity coefficients: the weight with which the block input
reaches the output along the pure identity path.

Command line::

    python -m decay_jax.models.schedules --depth 12 --alpha-min 0.6 [--convention block] [--plot out.png]
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import sys
from typing import Sequence

import numpy as np

from decay_jax import paths, validate

CONVENTIONS = ("sublayer", "block")
SHAPES = ("linear", "cosine")
FORMS = ("decay", "learnable", "sqrt_half_both", "sqrt_half_f", "attn_only", "mlp_only")
SQRT_HALF = math.sqrt(0.5)
UNSCHEDULED_FORMS = ("sqrt_half_both", "sqrt_half_f")  # alpha_min plays no part in these


def _positions(depth: int, convention: str) -> np.ndarray:
  """Normalised positions u in [0, 1] of each coefficient of the schedule, float64."""
  if convention == "sublayer":
    # np.linspace(0, 1, 2L) is the official construction (decay = 1 - linspace * (1 - alpha_min)).
    return np.linspace(0.0, 1.0, 2 * depth)
  return np.arange(1, depth + 1, dtype=np.float64) / depth


def decay_schedule(depth: int, alpha_min: float, convention: str = "sublayer",
                   shape: str = "linear") -> np.ndarray:
  """The identity coefficients of each block, a float64 array of shape ``(depth, 2)``.

  Column 0 scales the attention identity, column 1 the MLP identity (see the module docstring for
  the formulas). ``alpha_min = 1`` gives all ones, i.e. the standard residual network.
  """
  validate.check_int("depth", depth)
  validate.check_range("alpha_min", alpha_min, 0.0, 1.0, low_open=True)
  validate.check_choice("convention", convention, CONVENTIONS)
  validate.check_choice("shape", shape, SHAPES)
  u = _positions(depth, convention)
  if shape == "linear":
    a = 1.0 - u * (1.0 - alpha_min)
  else:
    a = alpha_min + (1.0 - alpha_min) * 0.5 * (1.0 + np.cos(np.pi * u))
  if convention == "sublayer":
    return a.reshape(depth, 2)
  return np.stack([a, np.ones_like(a)], axis=1)


@dataclasses.dataclass(frozen=True)
class Shortcuts:
  """Everything a stack of blocks needs to build its shortcuts.

  Attributes:
    alphas: float64 ``(depth, 2)`` identity coefficients (attention, MLP) per block.
    branch_scale: the factor on the residual branch ``f(x)`` (1 except for the sqrt(1/2) forms).
    learnable: whether ``alphas`` is only the initial value of a trainable parameter.
  """
  alphas: np.ndarray
  branch_scale: float = 1.0
  learnable: bool = False

  @property
  def alpha_eff(self) -> float:
    return float(np.prod(self.alphas))


@functools.lru_cache(maxsize=256)
def shortcuts(depth: int, alpha_min: float, convention: str = "sublayer", shape: str = "linear",
              form: str = "decay") -> Shortcuts:
  """The shortcut coefficients of ``depth`` blocks for one of the forms in the module docstring.

  Cached (the models ask for it at every trace), so each schedule is checked and built once per
  process; the returned arrays are read-only.
  """
  validate.check_choice("shortcut_form", form, FORMS)
  alphas = decay_schedule(depth, alpha_min, convention, shape)
  if form in UNSCHEDULED_FORMS:
    identity = SQRT_HALF if form == "sqrt_half_both" else 1.0
    return Shortcuts(_frozen(np.full((depth, 2), identity)), branch_scale=SQRT_HALF)
  if form == "attn_only":
    alphas = alphas.copy()
    alphas[:, 1] = 1.0
  elif form == "mlp_only":
    alphas = alphas.copy()
    alphas[:, 0] = 1.0
  return Shortcuts(_frozen(alphas), learnable=(form == "learnable"))


def _frozen(a: np.ndarray) -> np.ndarray:
  a.setflags(write=False)
  return a


def alpha_eff(depth: int, alpha_min: float, convention: str = "sublayer",
              shape: str = "linear") -> float:
  """Product of all identity coefficients of the schedule."""
  return float(np.prod(decay_schedule(depth, alpha_min, convention, shape)))


def alpha_min_for(target_alpha_eff: float, depth: int, convention: str = "sublayer",
                  shape: str = "linear", tol: float = 1e-12) -> float:
  """Inverse of ``alpha_eff``: the alpha_min that gives ``target_alpha_eff`` (bisection).

  ``alpha_eff`` increases strictly with ``alpha_min`` on (0, 1], so the root is unique. Targets
  below ``alpha_eff`` at ``alpha_min -> 0`` cannot be reached and raise a ValueError.
  """
  if not 0.0 < target_alpha_eff <= 1.0:
    raise ValueError(f"target_alpha_eff={target_alpha_eff!r} is not allowed; it must be in (0, 1]")
  lo, hi = 1e-12, 1.0
  floor = alpha_eff(depth, lo, convention, shape)
  if target_alpha_eff < floor:
    raise ValueError(f"target_alpha_eff={target_alpha_eff!r} is below the smallest reachable value "
                     f"{floor:.3e} for depth={depth}, convention={convention!r}, shape={shape!r}")
  while hi - lo > tol:
    mid = 0.5 * (lo + hi)
    if alpha_eff(depth, mid, convention, shape) < target_alpha_eff:
      lo = mid
    else:
      hi = mid
  return 0.5 * (lo + hi)


# ------------------------------------------------------------------------------------------------
# Command line: print the per-block table and alpha_eff, optionally plot the schedule.
# ------------------------------------------------------------------------------------------------


def format_table(sc: Shortcuts) -> str:
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


def plot(sc: Shortcuts, path: str, title: str) -> None:
  """Writes a PNG with the coefficient of every sublayer and the cumulative product."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  flat = sc.alphas.reshape(-1)
  k = np.arange(flat.size)
  fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.6))
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
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=120)
  plt.close(fig)
  paths.write_bytes(path, buf.getvalue())


def main(argv: Sequence[str] | None = None) -> int:
  p = validate.ArgumentParser(prog="python -m decay_jax.models.schedules", description=__doc__.split("\n")[0])
  p.add_argument("--depth", type=int, default=12, help="number of transformer blocks")
  p.add_argument("--alpha-min", type=float, default=None, help="last coefficient (default 0.7)")
  p.add_argument("--target-alpha-eff", type=float, default=None,
                 help="instead of --alpha-min: solve for the alpha_min giving this alpha_eff")
  p.add_argument("--convention", choices=CONVENTIONS, default="sublayer")
  p.add_argument("--shape", choices=SHAPES, default="linear")
  p.add_argument("--form", choices=FORMS, default="decay")
  p.add_argument("--plot", default=None, metavar="PNG", help="write a plot of the schedule here")
  args = p.parse_args(argv)
  try:
    if args.target_alpha_eff is not None:
      if args.alpha_min is not None:
        raise ValueError("give either --alpha-min or --target-alpha-eff, not both")
      alpha_min = alpha_min_for(args.target_alpha_eff, args.depth, args.convention, args.shape)
      print(f"alpha_min = {alpha_min:.6f} gives alpha_eff = {args.target_alpha_eff:g}")
    else:
      alpha_min = 0.7 if args.alpha_min is None else args.alpha_min
    sc = shortcuts(args.depth, alpha_min, args.convention, args.shape, args.form)
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
