"""U-ViT's variance-preserving diffusion: the continuous VPSDE and the discrete SD schedule.

JAX re-implementation of baofff/U-ViT ``sde.py`` (``VPSDE``, ``LSimple``, ``ScoreModel``), of
``train_ldm_discrete.py`` (``stable_diffusion_beta_schedule``, ``Schedule``, ``LSimple``) and of the
``NoiseScheduleVP`` classes of ``dpm_solver_pytorch.py`` ('linear') and ``dpm_solver_pp.py``
('discrete') that DPM-Solver runs on (docs/uvit.md 3.3 and 3.4).

Conventions
  **t = 0 is data, t = 1 is noise** (the reverse of SiT's transport.py). With ``x0`` data and
  ``eps ~ N(0, I)``: ``x_t = sqrt(alpha_bar) x0 + sqrt(1 - alpha_bar) eps``. In DPM-Solver's
  notation ``alpha_t = sqrt(alpha_bar(t)) = exp(m(t))`` (``m`` = ``marginal_log_mean_coeff``),
  ``sigma_t = sqrt(1 - alpha_t^2)`` and the half log-SNR ``lambda_t = log alpha_t - log sigma_t``.
  The networks predict the noise: ``model_fn(x_t (N, ...), t_net (N,), **kw) -> eps (N, ...)``.
  Schedule functions work elementwise on arrays of any shape; training arrays are batch-first
  (images ``(N, H, W, C)``), with per-example times ``(N,)``.

Schedules (frozen dataclasses: hashable, so they can be jit-static arguments)
  ``VPSDE`` (train.py, train_ldm.py): ``beta(t) = 0.1 + 19.9 t``,
      ``alpha_bar(t) = exp(-(0.1 t + 9.95 t^2))``; training times ``t ~ U[0, 1)`` (no cut-off);
      **network time ``999 t``** in training and sampling alike (``ScoreModel.predict``).
  ``DiscreteVP`` (train_ldm_discrete.py, the H/2 latent model):
      ``beta_n = linspace(sqrt(0.00085), sqrt(0.012), 1000)^2``, ``alpha_bar_n = prod_{i<=n}
      (1 - beta_i)`` (``alpha_bar_0 = 1``); training steps ``n ~ U{1..1000}`` and **network time
      ``n``** (the integer step, passed as a float). For DPM-Solver the continuous time
      ``t in [1/N, 1]`` interpolates ``log alpha`` piecewise linearly between the knots
      ``(n / N, 0.5 log alpha_bar_n)``, n = 1..N (linear extrapolation outside, as upstream's
      ``interpolate_fn``), and the sampler's **network time is ``N t``** (= n on the knots,
      non-integer between them), as in U-ViT's ``dpm_solver_sample``.

The noise-prediction loss (``LSimple``) is ``mean over (C, H, W) of (eps - eps_hat)^2``, then the
mean over the batch, with no weighting.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax.diffusion.transport import expand_t_like_x, mean_flat

ModelFn = Callable[..., jax.Array]


def _float(t) -> jax.Array:
  """``t`` as an array of at least float32."""
  t = jnp.asarray(t)
  return t.astype(jnp.promote_types(t.dtype, jnp.float32))


def std_from_log_mean_coeff(m: jax.Array) -> jax.Array:
  """``sigma = sqrt(1 - exp(2 m))``, written with expm1 (upstream ``marginal_std``)."""
  return jnp.sqrt(-jnp.expm1(2.0 * m))


def lambda_from_log_mean_coeff(m: jax.Array) -> jax.Array:
  """``lambda = m - 0.5 log(1 - exp(2 m))`` (upstream ``marginal_lambda``)."""
  return m - 0.5 * jnp.log(-jnp.expm1(2.0 * m))


def log_mean_coeff_from_lambda(lamb: jax.Array) -> jax.Array:
  """``m = -0.5 log(1 + exp(-2 lambda))``, the inverse of lambda_from_log_mean_coeff."""
  return -0.5 * jnp.logaddexp(0.0, -2.0 * lamb)


class _Marginals:
  """What both schedules derive from ``marginal_log_mean_coeff`` and ``alpha_bar``."""

  T = 1.0

  def marginal_alpha(self, t) -> jax.Array:
    """``alpha_t = exp(m(t))`` (the data coefficient, = sqrt(alpha_bar))."""
    return jnp.exp(self.marginal_log_mean_coeff(t))

  def marginal_std(self, t) -> jax.Array:
    """``sigma_t = sqrt(1 - alpha_t^2)`` (the noise coefficient)."""
    return std_from_log_mean_coeff(self.marginal_log_mean_coeff(t))

  def marginal_lambda(self, t) -> jax.Array:
    """Half log-SNR ``lambda_t = log alpha_t - log sigma_t``."""
    return lambda_from_log_mean_coeff(self.marginal_log_mean_coeff(t))

  def perturb(self, x0: jax.Array, eps: jax.Array, t: jax.Array) -> jax.Array:
    """``x_t = sqrt(alpha_bar(t)) x0 + sqrt(1 - alpha_bar(t)) eps``.

    Shapes: x0, eps ``(N, ...)``, t ``(N,)`` -> ``(N, ...)``.

    ``t`` is a training time: continuous for VPSDE, the integer step n for DiscreteVP.
    """
    ab = expand_t_like_x(self.alpha_bar(t), x0)
    return (jnp.sqrt(ab) * x0 + jnp.sqrt(1 - ab) * eps).astype(x0.dtype)

  def per_example_loss(self, model_fn: ModelFn, x0: jax.Array, eps: jax.Array, t: jax.Array,
                       model_kwargs: Optional[Mapping] = None) -> jax.Array:
    """``mean over (C, H, W) of (eps - model_fn(x_t, t_net))^2``: ``(N,)``, float32 or wider.

    ``t_net = training_net_time(t)`` (999 t, or the step n); ``model_kwargs`` e.g. ``{"y": y}``.
    """
    x_t = self.perturb(x0, eps, t)
    out = model_fn(x_t, self.training_net_time(t), **dict(model_kwargs or {}))
    if out.shape != x0.shape:
      raise ValueError(f"model output shape {out.shape} must equal the input shape {x0.shape}")
    dtype = jnp.promote_types(out.dtype, jnp.float32)
    return mean_flat((eps.astype(dtype) - out.astype(dtype)) ** 2)

  def loss(self, model_fn: ModelFn, x0: jax.Array, eps: jax.Array, t: jax.Array,
           model_kwargs: Optional[Mapping] = None) -> jax.Array:
    """U-ViT's ``LSimple(...).mean()``: the batch mean of per_example_loss, a scalar."""
    return jnp.mean(self.per_example_loss(model_fn, x0, eps, t, model_kwargs))


@dataclasses.dataclass(frozen=True)
class VPSDE(_Marginals):
  """The continuous linear VPSDE ``dx = -beta(t) x / 2 dt + sqrt(beta(t)) dW``, t in [0, 1].

  Attributes:
    beta_min: ``beta(0)`` (0.1).
    beta_max: ``beta(1)`` (20).
    net_time_scale: network time per unit t (999: ``ScoreModel.predict`` feeds ``999 t``).
  """
  beta_min: float = 0.1
  beta_max: float = 20.0
  net_time_scale: float = 999.0

  def beta(self, t) -> jax.Array:
    """``beta(t) = beta_min + t (beta_max - beta_min)`` (= g(t)^2)."""
    return self.beta_min + _float(t) * (self.beta_max - self.beta_min)

  def marginal_log_mean_coeff(self, t) -> jax.Array:
    """``m(t) = -(beta_max - beta_min) t^2 / 4 - beta_min t / 2`` (log alpha_t)."""
    t = _float(t)
    return -0.25 * t ** 2 * (self.beta_max - self.beta_min) - 0.5 * t * self.beta_min

  def alpha_bar(self, t) -> jax.Array:
    """``alpha_bar(t) = exp(-(beta_min t + (beta_max - beta_min) t^2 / 2))`` = alpha_t^2."""
    return jnp.exp(2.0 * self.marginal_log_mean_coeff(t))

  def inverse_lambda(self, lamb) -> jax.Array:
    """The t with ``lambda_t = lamb`` (upstream closed form, stable for large |lamb|):
    ``tmp = 2 (b1 - b0) log(1 + exp(-2 lamb))``, ``t = tmp / (sqrt(b0^2 + tmp) + b0) / (b1 - b0)``.
    """
    diff = self.beta_max - self.beta_min
    tmp = 2.0 * diff * jnp.logaddexp(-2.0 * _float(lamb), 0.0)
    return tmp / (jnp.sqrt(self.beta_min ** 2 + tmp) + self.beta_min) / diff

  def net_time(self, t) -> jax.Array:
    """Network time of the continuous time ``t``: ``999 t``."""
    return self.net_time_scale * _float(t)

  def training_net_time(self, t) -> jax.Array:
    """Network time of a training time (the same ``999 t``)."""
    return self.net_time(t)

  def sample_time(self, rng: jax.Array, n: int, dtype=jnp.float32) -> jax.Array:
    """Training times ``t ~ U[0, 1)`` of shape ``(n,)`` (``sde.sample``, no lower cut-off)."""
    return jax.random.uniform(rng, (n,), dtype)


@functools.lru_cache(maxsize=8)
def discrete_tables(beta_start: float, beta_end: float, num_steps: int
                    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
  """float64 tables of the discrete schedule (computed once per schedule).

  Returns:
    ``alpha_bar (N + 1,)``: ``alpha_bar[0] = 1``, ``alpha_bar[n] = prod_{i<=n} (1 - beta_i)``;
    ``t_knots (N,) = linspace(1/N, 1, N)``; ``log_alpha (N,) = 0.5 cumsum(log(1 - beta))``
    (``log_alpha[n - 1] = 0.5 log alpha_bar[n]``).
  """
  betas = np.linspace(beta_start ** 0.5, beta_end ** 0.5, num_steps, dtype=np.float64) ** 2
  alpha_bar = np.concatenate([[1.0], np.cumprod(1.0 - betas)])
  t_knots = np.linspace(1.0 / num_steps, 1.0, num_steps)
  log_alpha = 0.5 * np.cumsum(np.log(1.0 - betas))
  for table in (alpha_bar, t_knots, log_alpha):
    table.setflags(write=False)
  return alpha_bar, t_knots, log_alpha


def interpolate(x: jax.Array, xp: jax.Array, fp: jax.Array) -> jax.Array:
  """Piecewise-linear ``f(x)`` through the knots ``(xp, fp)`` (xp increasing), extended past both
  ends by the outermost segments (upstream ``interpolate_fn``). x any shape; xp, fp ``(K,)``."""
  idx = jnp.clip(jnp.searchsorted(xp, x, side="left") - 1, 0, xp.shape[0] - 2)
  x0, x1, f0, f1 = xp[idx], xp[idx + 1], fp[idx], fp[idx + 1]
  return f0 + (x - x0) * (f1 - f0) / (x1 - x0)


@dataclasses.dataclass(frozen=True)
class DiscreteVP(_Marginals):
  """The Stable-Diffusion discrete schedule, and its continuous-time interpolation for DPM-Solver.

  Attributes:
    beta_start: ``beta_1`` (0.00085); the betas are ``linspace(sqrt(start), sqrt(end), N)^2``.
    beta_end: ``beta_N`` (0.012).
    num_steps: N (1000).
  """
  beta_start: float = 0.00085
  beta_end: float = 0.012
  num_steps: int = 1000

  def _tables(self, dtype):
    return tuple(jnp.asarray(a, dtype) for a in discrete_tables(
        self.beta_start, self.beta_end, self.num_steps))

  def alpha_bar(self, n) -> jax.Array:
    """``alpha_bar_n = prod_{i<=n} (1 - beta_i)`` of integer steps ``n`` in {0..N} (float32, or
    float64 with x64 enabled)."""
    return self._tables(jax.dtypes.canonicalize_dtype(np.float64))[0][jnp.asarray(n)]

  def marginal_log_mean_coeff(self, t) -> jax.Array:
    """``log alpha_t``: the piecewise-linear interpolation of ``(n / N, 0.5 log alpha_bar_n)``."""
    t = _float(t)
    _, t_knots, log_alpha = self._tables(t.dtype)
    return interpolate(t, t_knots, log_alpha)

  def inverse_lambda(self, lamb) -> jax.Array:
    """The t with ``lambda_t = lamb``: ``log alpha = -0.5 log(1 + exp(-2 lamb))``, then the
    interpolation of the flipped knots ``(0.5 log alpha_bar_n, n / N)`` (upstream)."""
    log_alpha_t = log_mean_coeff_from_lambda(_float(lamb))
    _, t_knots, log_alpha = self._tables(log_alpha_t.dtype)
    return interpolate(log_alpha_t, log_alpha[::-1], t_knots[::-1])

  def net_time(self, t) -> jax.Array:
    """Network time of the continuous time ``t``: ``N t`` (U-ViT's ``t_continuous * N``)."""
    return self.num_steps * _float(t)

  def training_net_time(self, n) -> jax.Array:
    """Network time of a training step n: n itself, as float32 (``nnet(xn, n)``)."""
    return _float(n)

  def sample_time(self, rng: jax.Array, n: int) -> jax.Array:
    """Training steps ``n ~ U{1..N}`` of shape ``(n,)``, int32 (``Schedule.sample``)."""
    return jax.random.randint(rng, (n,), 1, self.num_steps + 1, jnp.int32)


SCHEDULES = ("vpsde", "discrete")


def schedule(name: str):
  """The schedule a config names (``diffusion.schedule``): ``'vpsde'`` or ``'discrete'``, each
  with U-ViT's constants."""
  if name not in SCHEDULES:
    raise ValueError(f"schedule={name!r} is not allowed; choose one of {SCHEDULES}")
  return VPSDE() if name == "vpsde" else DiscreteVP()
