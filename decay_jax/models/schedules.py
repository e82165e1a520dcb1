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

The command ``python -m decay_jax.cli.schedules`` prints and plots a schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from decay_jax import validate

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
    return Shortcuts(_frozen(np.full((depth, 2), identity)), branch_scale=branch_scale(form))
  if form == "attn_only":
    alphas = alphas.copy()
    alphas[:, 1] = 1.0
  elif form == "mlp_only":
    alphas = alphas.copy()
    alphas[:, 0] = 1.0
  return Shortcuts(_frozen(alphas), learnable=(form == "learnable"))


def branch_scale(form: str) -> float:
  """The factor on the branch ``f(x)`` of shortcut form ``form``: sqrt(1/2) for the
  ``sqrt_half_*`` controls, 1 otherwise."""
  return SQRT_HALF if form in UNSCHEDULED_FORMS else 1.0


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
