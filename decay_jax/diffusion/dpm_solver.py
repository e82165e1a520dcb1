"""U-ViT samplers: DPM-Solver-fast, DPM-Solver++ ('fast'), Euler-Maruyama, and CFG for noise models.

JAX re-implementation of the samplers baofff/U-ViT evaluates with (docs/uvit.md 3.4), formula by
formula:

- ``dpm_solver_fast``: ``DPM_Solver.sample(..., fast_version=True)`` of ``dpm_solver_pytorch.py``
  (pixel models and the continuous latent L/2; ``NoiseScheduleVP('linear')``, t from 1 to 1e-4).
  Noise prediction; ``K = nfe // 3 + 1`` steps on a grid uniform in lambda (K + 1 points), orders
  ``fast_orders(nfe)`` (50 NFE: ``[3] * 16 + [2]``), one grid interval per step, with the fixed
  intermediate ratios ``r1, r2 = 1/3, 2/3`` (order 3) and ``r1 = 1/2`` (order 2).
- ``dpm_solver_pp``: ``DPM_Solver(predict_x0=True).sample(method='fast', order=3,
  skip_type='time_uniform', eps=1/N, T=1)`` of ``dpm_solver_pp.py`` (the discrete H/2 model).
  Data prediction ``x0 = (x - sigma_t eps) / alpha_t``; a grid of ``steps`` intervals (time-uniform
  by default); step k of order o goes from grid point i to i + o and takes its intermediate ratios
  from the grid, ``r1 = (lambda_{i+1} - lambda_i) / h``, ``r2 = (lambda_{i+2} - lambda_i) / h``,
  ``h = lambda_{i+o} - lambda_i`` (50 steps: 16 third-order steps and one second-order step).
- ``euler_maruyama``: ``sde.euler_maruyama`` for ``ReverseSDE`` (``ode=False``) or ``ODE``.

Single-step updates (``solver_type='dpm_solver'``; s -> t, ``h = lambda_t - lambda_s``, ``e`` the
model's noise (noise form) or data (data form) prediction at s, ``e1``, ``e2`` at the intermediate
times ``s_i = inverse_lambda(lambda_s + r_i h)``). Write ``H = h`` (noise form) or ``H = -h`` (data
form), ``A(u) = exp(log alpha_u - log alpha_s)`` and ``C(u) = sigma_u`` (noise form) or
``A(u) = sigma_u / sigma_s`` and ``C(u) = alpha_u`` (data form), ``phi_1(H) = expm1(H)`` and
``phi_2(H) = expm1(H) / H - 1``; then upstream's formulas for both forms read
  order 1: ``x_t = A(t) x - C(t) phi_1(H) e``;
  order 2: ``x_s1 = A(s1) x - C(s1) phi_1(r1 H) e``,
           ``x_t = A(t) x - C(t) phi_1(H) e - (0.5 / r1) C(t) phi_1(H) (e1 - e)``;
  order 3: ``x_s1`` as for order 2,
           ``x_s2 = A(s2) x - C(s2) phi_1(r2 H) e - (r2 / r1) C(s2) phi_2(r2 H) (e1 - e)``,
           ``x_t = A(t) x - C(t) phi_1(H) e - (1 / r2) C(t) phi_2(H) (e2 - e)``.
(In the data form upstream writes ``phi_2`` as ``expm1(-h) / h + 1`` with the opposite sign in
front; the two spellings are the same floating-point numbers.)

Everything is a pure function of arrays and static Python configuration (schedules are frozen
dataclasses; step counts are Python ints), so it jits::

    fn = jax.jit(functools.partial(dpm_solver_fast, model_fn, schedule=vp.VPSDE(), nfe=50))
    samples = fn(noise, model_kwargs={"y": labels})

Runs of equal-order steps are one ``lax.scan`` each (so a 50-NFE solve traces the model 5 times,
not 50). ``model_fn(x (N, ...), t_net (N,), **model_kwargs) -> eps (N, ...)``, where ``t_net =
schedule.net_time(t)`` (999 t for VPSDE, N t for DiscreteVP). Every step is elementwise over the
batch axis.
"""

from __future__ import annotations

import itertools
from typing import Callable, List, Mapping, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import validate
from decay_jax.diffusion import samplers
from decay_jax.diffusion.vp import DiscreteVP, ModelFn, VPSDE

Schedule = Union[VPSDE, DiscreteVP]
# The U-ViT samplers by mode and method, as configs and the sample command name them: 'dpm' runs
# dpm_solver_fast ('fast') or dpm_solver_pp ('pp'); 'sde' / 'ode' run euler_maruyama.
SAMPLERS = {"dpm": ("fast", "pp"), "sde": ("euler",), "ode": ("euler",)}
SKIP_TYPES = ("time_uniform", "logSNR")


class StepPlan(NamedTuple):
  """The steps of a single-step solver: step k goes from ``s[k]`` to ``t[k]`` with order
  ``orders[k]`` and intermediate ratios ``r1[k]``, ``r2[k]`` (unused entries hold the defaults)."""
  orders: Tuple[int, ...]
  s: jax.Array
  t: jax.Array
  r1: jax.Array
  r2: jax.Array


def fast_orders(nfe: int, order: int = 3) -> List[int]:
  """Orders of DPM-Solver-fast for ``nfe`` model calls (``get_time_steps_for_dpm_solver_fast``).

  order 3: ``K = nfe // 3 + 1`` steps: ``[3] * (K - 2) + [2, 1]`` if ``nfe % 3 == 0``,
  ``[3] * (K - 1) + [1]`` if 1, ``[3] * (K - 1) + [2]`` if 2. order 2: ``[2] * (nfe // 2)``, plus
  ``[1]`` if nfe is odd. The orders always sum to nfe.
  """
  validate.check_int("nfe", nfe, 1)
  validate.check_choice("order", order, (2, 3))
  if order == 2:
    return [2] * (nfe // 2) + [1] * (nfe % 2)
  k = nfe // 3 + 1
  return [3] * (k - 2) + [2, 1] if nfe % 3 == 0 else [3] * (k - 1) + [nfe % 3]


def time_steps(schedule: Schedule, skip_type: str, t_start: float, t_end: float, n: int,
               dtype=jnp.float32) -> jax.Array:
  """``n + 1`` times from t_start down to t_end (``get_time_steps``): ``(n + 1,)``.

  "logSNR": ``inverse_lambda(linspace(lambda(t_start), lambda(t_end), n + 1))``;
  "time_uniform": ``linspace(t_start, t_end, n + 1)``.
  """
  validate.check_choice("skip_type", skip_type, SKIP_TYPES)
  if skip_type == "time_uniform":
    return jnp.linspace(t_start, t_end, n + 1, dtype=dtype)
  lam = schedule.marginal_lambda(jnp.asarray([t_start, t_end], dtype))
  return schedule.inverse_lambda(jnp.linspace(lam[0], lam[1], n + 1, dtype=dtype))


def dpm_solver_fast_plan(schedule: Schedule, nfe: int = 50, t_start: float = 1.0,
                         t_end: float = 1e-4, dtype=jnp.float32) -> StepPlan:
  """The steps of ``dpm_solver_fast``: ``len(fast_orders(nfe))`` lambda-uniform intervals, one a
  step, with ``r1, r2 = 1/3, 2/3`` (order 3) or ``r1 = 1/2`` (order 2)."""
  orders = tuple(fast_orders(nfe, 3))
  ts = time_steps(schedule, "logSNR", t_start, t_end, len(orders), dtype)
  r1 = jnp.asarray([1 / 3 if o == 3 else 0.5 for o in orders], dtype)
  r2 = jnp.full((len(orders),), 2 / 3, dtype)
  return StepPlan(orders, ts[:-1], ts[1:], r1, r2)


def dpm_solver_pp_plan(schedule: Schedule, steps: int = 50, order: int = 3, t_start: float = 1.0,
                       t_end: float = 1e-3, skip_type: str = "time_uniform",
                       dtype=jnp.float32) -> StepPlan:
  """The steps of ``dpm_solver_pp`` (``method='fast'`` of dpm_solver_pp.py): a grid of ``steps``
  intervals; a step of order o spans o intervals, from grid point i to i + o, with
  ``r1 = (lambda_{i+1} - lambda_i) / h`` and ``r2 = (lambda_{i+2} - lambda_i) / h``."""
  orders = tuple(fast_orders(steps, order))
  ts = time_steps(schedule, skip_type, t_start, t_end, steps, dtype)
  lam = schedule.marginal_lambda(ts)
  starts = np.concatenate([[0], np.cumsum(orders)[:-1]]).astype(int)
  ends = starts + np.asarray(orders)
  h = lam[ends] - lam[starts]
  r1 = jnp.where(ends > starts + 1, (lam[np.minimum(starts + 1, steps)] - lam[starts]) / h, 0.5)
  r2 = jnp.where(ends > starts + 2, (lam[np.minimum(starts + 2, steps)] - lam[starts]) / h, 2 / 3)
  return StepPlan(orders, ts[starts], ts[ends], r1, r2)


def _predictor(model_fn: ModelFn, schedule: Schedule, predict_x0: bool,
               model_kwargs: Mapping) -> Callable:
  """``predict(x, u)``: the model's noise at the scalar time u, or its data prediction
  ``(x - sigma_u eps) / alpha_u`` when ``predict_x0`` (``DPM_Solver.model_fn``)."""
  def predict(x, u):
    t_net = jnp.broadcast_to(schedule.net_time(u), (x.shape[0],))
    eps = model_fn(x, t_net, **model_kwargs)
    if not predict_x0:
      return eps
    return (x - schedule.marginal_std(u) * eps) / schedule.marginal_alpha(u)
  return predict


def singlestep_update(predict: Callable, schedule: Schedule, x: jax.Array, s: jax.Array,
                      t: jax.Array, order: int, r1=0.5, r2=2 / 3,
                      predict_x0: bool = False) -> jax.Array:
  """One DPM-Solver(-++) step of ``order`` from the scalar time s to t (module docstring formulas).

  Args:
    predict: ``(x (N, ...), u ()) -> (N, ...)`` noise (or data, with predict_x0) prediction.
    schedule: the noise schedule.
    x: ``(N, ...)`` state at s.
    s, t: scalar start and end times.
    order: 1, 2 or 3 (static).
    r1, r2: intermediate ratios (scalars; r2 only for order 3).
    predict_x0: data-prediction form (DPM-Solver++) instead of the noise form.

  Returns:
    ``(N, ...)`` state at t, in x's dtype.
  """
  lam_s, lam_t = schedule.marginal_lambda(s), schedule.marginal_lambda(t)
  h = lam_t - lam_s
  big_h = -h if predict_x0 else h
  log_alpha_s, sigma_s = schedule.marginal_log_mean_coeff(s), schedule.marginal_std(s)

  def coefficients(u):  # (A(u), C(u)) of the module docstring
    log_alpha_u = schedule.marginal_log_mean_coeff(u)
    if predict_x0:
      return schedule.marginal_std(u) / sigma_s, jnp.exp(log_alpha_u)
    return jnp.exp(log_alpha_u - log_alpha_s), schedule.marginal_std(u)

  phi_1 = lambda z: jnp.expm1(z)
  phi_2 = lambda z: jnp.expm1(z) / z - 1.0
  e = predict(x, s)
  a_t, c_t = coefficients(t)
  x_t = a_t * x - c_t * phi_1(big_h) * e
  if order == 2:
    s1 = schedule.inverse_lambda(lam_s + r1 * h)
    a_1, c_1 = coefficients(s1)
    e1 = predict(a_1 * x - c_1 * phi_1(r1 * big_h) * e, s1)
    x_t = x_t - (0.5 / r1) * c_t * phi_1(big_h) * (e1 - e)
  elif order == 3:
    s1, s2 = schedule.inverse_lambda(lam_s + r1 * h), schedule.inverse_lambda(lam_s + r2 * h)
    a_1, c_1 = coefficients(s1)
    a_2, c_2 = coefficients(s2)
    e1 = predict(a_1 * x - c_1 * phi_1(r1 * big_h) * e, s1)
    x_s2 = (a_2 * x - c_2 * phi_1(r2 * big_h) * e
            - (r2 / r1) * c_2 * phi_2(r2 * big_h) * (e1 - e))
    e2 = predict(x_s2, s2)
    x_t = x_t - (1.0 / r2) * c_t * phi_2(big_h) * (e2 - e)
  elif order != 1:
    raise ValueError(f"order={order!r} is not allowed; choose one of 1, 2, 3")
  return x_t.astype(x.dtype)


def solve(model_fn: ModelFn, x: jax.Array, schedule: Schedule, plan: StepPlan,
          predict_x0: bool = False, model_kwargs: Optional[Mapping] = None) -> jax.Array:
  """Runs the steps of ``plan`` from x: one ``lax.scan`` per run of equal orders. x ``(N, ...)``."""
  predict = _predictor(model_fn, schedule, predict_x0, dict(model_kwargs or {}))
  start = 0
  for order, run in itertools.groupby(plan.orders):
    stop = start + len(list(run))

    def step(x_cur, inputs, order=order):
      s, t, r1, r2 = inputs
      return singlestep_update(predict, schedule, x_cur, s, t, order, r1, r2, predict_x0), None

    x, _ = jax.lax.scan(step, x, tuple(a[start:stop] for a in plan[1:]))
    start = stop
  return x


def dpm_solver_fast(model_fn: ModelFn, x_T: jax.Array, schedule: Schedule, nfe: int = 50,
                    t_end: float = 1e-4, t_start: Optional[float] = None,
                    model_kwargs: Optional[Mapping] = None) -> jax.Array:
  """DPM-Solver-fast with noise prediction (U-ViT's pixel-model sampler, ``dpm_solver_pytorch``).

  Args:
    model_fn: ``(x (N, ...), t_net (N,), **model_kwargs) -> eps (N, ...)``.
    x_T: ``(N, ...)`` initial noise ``N(0, I)`` at t_start.
    schedule: VPSDE() for U-ViT (upstream ``NoiseScheduleVP('linear')``); DiscreteVP also works.
    nfe: number of model calls (50: 17 lambda-uniform steps, orders ``[3] * 16 + [2]``).
    t_end: final time (upstream ``eps = 1e-4``).
    t_start: initial time (default ``schedule.T = 1``).
    model_kwargs: extra model arguments, e.g. ``{"y": labels}``.

  Returns:
    ``(N, ...)`` samples at t_end, in x_T's dtype.
  """
  t_start = schedule.T if t_start is None else t_start
  dtype = jnp.promote_types(x_T.dtype, jnp.float32)
  plan = dpm_solver_fast_plan(schedule, nfe, t_start, t_end, dtype)
  return solve(model_fn, x_T, schedule, plan, False, model_kwargs)


def dpm_solver_pp(model_fn: ModelFn, x_T: jax.Array, schedule: Schedule, steps: int = 50,
                  order: int = 3, t_end: Optional[float] = None, t_start: Optional[float] = None,
                  skip_type: str = "time_uniform",
                  model_kwargs: Optional[Mapping] = None) -> jax.Array:
  """DPM-Solver++ ``method='fast'`` with data prediction (U-ViT's discrete latent sampler).

  Args:
    model_fn: noise model ``(x (N, ...), t_net (N,), **model_kwargs) -> eps (N, ...)``; the solver
      converts it to ``x0 = (x - sigma_t eps) / alpha_t`` (no thresholding, as U-ViT).
    x_T: ``(N, ...)`` initial noise at t_start.
    schedule: DiscreteVP() for U-ViT's H/2 (``NoiseScheduleVP('discrete', betas)``).
    steps: number of grid intervals = number of model calls (50).
    order: 3 (U-ViT) or 2.
    t_end: final time; default ``1 / schedule.num_steps`` for a DiscreteVP (U-ViT's ``eps = 1/N``)
      and 1e-4 otherwise (upstream's default).
    t_start: initial time (default ``schedule.T = 1``).
    skip_type: the grid, "time_uniform" (upstream default, U-ViT) or "logSNR".
    model_kwargs: extra model arguments.

  Returns:
    ``(N, ...)`` samples at t_end (no final denoising step: upstream ``denoise=False``).
  """
  if t_end is None:
    t_end = 1.0 / schedule.num_steps if isinstance(schedule, DiscreteVP) else 1e-4
  t_start = schedule.T if t_start is None else t_start
  dtype = jnp.promote_types(x_T.dtype, jnp.float32)
  plan = dpm_solver_pp_plan(schedule, steps, order, t_start, t_end, skip_type, dtype)
  return solve(model_fn, x_T, schedule, plan, True, model_kwargs)


def euler_maruyama(model_fn: ModelFn, x_T: jax.Array, schedule: VPSDE, rng: Optional[jax.Array],
                   steps: int, ode: bool = False, eps: float = 1e-3, T: float = 1.0,
                   model_kwargs: Optional[Mapping] = None) -> jax.Array:
  """Euler-Maruyama for the reverse SDE or the probability-flow ODE (``sde.euler_maruyama``).

  Grid ``[0, linspace(eps, T, steps)]`` (steps + 1 points), walked from T down to 0: for each pair
  ``s < t``, ``dt = s - t``, with ``eps_hat = model_fn(x, 999 t)``, ``score = -eps_hat / sigma_t``:
  ``drift = -beta(t) x / 2 - k beta(t) score`` (k = 1 for the SDE, 1/2 for the ODE),
  ``x <- x + drift dt + sqrt(beta(t) (-dt)) xi`` (SDE only; ``xi ~ N(0, I)``); the last step, to
  s = 0, adds no noise.

  Args:
    model_fn: ``(x (N, ...), t_net (N,), **model_kwargs) -> eps (N, ...)``.
    x_T: ``(N, ...)`` initial noise at T.
    schedule: a VPSDE (the continuous SDE the sampler discretises).
    rng: PRNG key for the noise (unused, may be None, when ``ode``).
    steps: number of steps.
    ode: probability-flow ODE (upstream ``ODE``) instead of the reverse SDE (``ReverseSDE``).
    eps: the first positive grid time (1e-3).
    T: the final grid time (1).
    model_kwargs: extra model arguments.

  Returns:
    ``(N, ...)`` samples at t = 0.
  """
  if not isinstance(schedule, VPSDE):
    raise TypeError(f"euler_maruyama needs a VPSDE schedule, got {type(schedule).__name__}")
  validate.check_int("steps", steps, 1)
  if not ode and rng is None:
    raise ValueError("rng=None is not allowed for the SDE (ode=False); pass a PRNG key")
  model_kwargs = dict(model_kwargs or {})
  dtype = jnp.promote_types(x_T.dtype, jnp.float32)
  grid = np.append(0.0, np.linspace(eps, T, steps))
  s_all, t_all = jnp.asarray(grid[:-1][::-1], dtype), jnp.asarray(grid[1:][::-1], dtype)
  keys = jax.random.split(rng if rng is not None else jax.random.PRNGKey(0), steps)

  def step(x, inputs):
    s, t, key = inputs
    beta = schedule.beta(t)
    eps_hat = model_fn(x, jnp.broadcast_to(schedule.net_time(t), (x.shape[0],)), **model_kwargs)
    score = -eps_hat / schedule.marginal_std(t)
    drift = -0.5 * beta * x - (0.5 if ode else 1.0) * beta * score
    dt = s - t
    x_next = x + drift * dt
    if not ode:
      noise = jnp.sqrt(beta * -dt) * jax.random.normal(key, x.shape, x.dtype)
      x_next = jnp.where(s != 0, x_next + noise, x_next)
    return x_next.astype(x.dtype), None

  x, _ = jax.lax.scan(step, x_T, (s_all, t_all, keys))
  return x


def cfg_eps(model_fn: ModelFn, scale: Union[float, jax.Array], null_label: int) -> ModelFn:
  """U-ViT's classifier-free guidance ``eps = eps_c + s (eps_c - eps_null)`` on every channel.

  ``samplers.cfg_model_fn`` with guidance ``1 + s`` and ``channels=None``: ``guided(x, t, y, **kw)``
  runs ``model_fn`` once on the doubled batch ``([x; x], [t; t], y=[y; null_label])``. U-ViT's
  ImageNet-256 configs use ``s = 0.4`` and ``null_label = 1000``. (The coefficient is computed as
  ``(1 + s) - 1``, which can differ from s in the last bit.)
  """
  return samplers.cfg_model_fn(model_fn, 1 + scale, null_label, channels=None)
