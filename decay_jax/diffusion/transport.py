"""SiT transport: interpolation paths, training loss, ODE drift and score (docs/official_code.md 5.1).

A JAX re-implementation of the upstream ``transport`` package of willisma/SiT (``path.py``,
``transport.py``, ``create_transport`` of ``__init__.py``), which the official decayed-SiT code uses
unchanged (apart from fp16 autocast around the model call). The numerics follow upstream formula by
formula, including its epsilon rules; only the code is new.

Conventions
  ``x1`` is data, ``x0 ~ N(0, I)`` is noise, and **t = 0 is noise, t = 1 is data**:
  ``x_t = alpha_t x1 + sigma_t x0`` and ``u_t = d_alpha_t x1 + d_sigma_t x0``.
  Arrays are batch-first: ``x`` is ``(N, ...)`` (images ``(N, H, W, C)`` in this repo) and ``t`` is
  ``(N,)``; per-example coefficients are broadcast as ``(N, 1, ..., 1)``.

Paths (``path_type``)
  ``"linear"`` (upstream ICPlan): ``alpha_t = t``, ``sigma_t = 1 - t``.
  ``"gvp"`` (GVPCPlan): ``alpha_t = sin(pi t / 2)``, ``sigma_t = cos(pi t / 2)``.
  ``"vp"`` (VPCPlan, ``sigma_min = 0.1``, ``sigma_max = 20``): with
      ``m(t) = -(1 - t)^2 (sigma_max - sigma_min) / 4 - (1 - t) sigma_min / 2``,
      ``alpha_t = exp(m(t))`` and ``sigma_t = sqrt(1 - exp(2 m(t)))``.

Predictions (``prediction``): ``"velocity"`` (target ``u_t``), ``"noise"`` (target ``x0``) and
``"score"`` (target ``-x0 / sigma_t``, the score of ``p(x_t | x1)``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from decay_jax.validate import check_choice

PATH_TYPES = ("linear", "gvp", "vp")
PREDICTIONS = ("velocity", "noise", "score")
LOSS_WEIGHTS = (None, "velocity", "likelihood")
# Upstream spells the last form "inccreasing-decreasing"; both spellings are accepted.
DIFFUSION_FORMS = ("constant", "SBDM", "sigma", "linear", "decreasing", "increasing-decreasing")
_DIFFUSION_ALIASES = {"inccreasing-decreasing": "increasing-decreasing"}
VP_SIGMA_MIN = 0.1
VP_SIGMA_MAX = 20.0

ModelFn = Callable[..., jax.Array]


def canonical_diffusion_form(form: str) -> str:
  """Returns the canonical name of a diffusion form (accepts upstream's misspelling)."""
  form = _DIFFUSION_ALIASES.get(form, form)
  check_choice("diffusion_form", form, DIFFUSION_FORMS)
  return form


def expand_t_like_x(t: jax.Array, x: jax.Array) -> jax.Array:
  """Reshapes time ``t`` ``(N,)`` (or a scalar) to ``(N, 1, ..., 1)`` to broadcast with x."""
  t = jnp.asarray(t)
  return t.reshape(t.shape + (1,) * (x.ndim - t.ndim))


def mean_flat(x: jax.Array) -> jax.Array:
  """Mean over all non-batch axes: ``(N, ...) -> (N,)``."""
  return jnp.mean(x, axis=tuple(range(1, x.ndim)))


# --------------------------------------------------------------------------------------------------
# Path coefficients. Every function takes an already broadcast ``t`` and works elementwise.

def _vp_log_mean_coeff(t):
  """``m(t) = -(1 - t)^2 (s_max - s_min) / 4 - (1 - t) s_min / 2``, so that ``alpha_t = exp(m)``."""
  return -0.25 * (1 - t) ** 2 * (VP_SIGMA_MAX - VP_SIGMA_MIN) - 0.5 * (1 - t) * VP_SIGMA_MIN


def _vp_d_log_mean_coeff(t):
  """``m'(t) = (1 - t) (s_max - s_min) / 2 + s_min / 2`` (= beta_t / 2)."""
  return 0.5 * (1 - t) * (VP_SIGMA_MAX - VP_SIGMA_MIN) + 0.5 * VP_SIGMA_MIN


def compute_alpha_t(path_type: str, t: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """Data coefficient ``alpha_t`` and its time derivative ``d_alpha_t`` (same shape as t)."""
  if path_type == "linear":
    return t, jnp.ones_like(t)
  if path_type == "gvp":
    return jnp.sin(t * math.pi / 2), math.pi / 2 * jnp.cos(t * math.pi / 2)
  check_choice("path_type", path_type, PATH_TYPES)
  alpha_t = jnp.exp(_vp_log_mean_coeff(t))
  return alpha_t, alpha_t * _vp_d_log_mean_coeff(t)


def compute_sigma_t(path_type: str, t: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """Noise coefficient ``sigma_t`` and its time derivative ``d_sigma_t`` (same shape as t)."""
  if path_type == "linear":
    return 1 - t, -jnp.ones_like(t)
  if path_type == "gvp":
    return jnp.cos(t * math.pi / 2), -math.pi / 2 * jnp.sin(t * math.pi / 2)
  check_choice("path_type", path_type, PATH_TYPES)
  p_sigma_t = 2 * _vp_log_mean_coeff(t)
  sigma_t = jnp.sqrt(1 - jnp.exp(p_sigma_t))
  # d/dt sqrt(1 - exp(2m)) = -exp(2m) m' / sigma_t, written as upstream does.
  d_sigma_t = jnp.exp(p_sigma_t) * (2 * _vp_d_log_mean_coeff(t)) / (-2 * sigma_t)
  return sigma_t, d_sigma_t


def compute_d_alpha_alpha_ratio_t(path_type: str, t: jax.Array) -> jax.Array:
  """``d_alpha_t / alpha_t`` in a stable closed form (infinite at t = 0 for linear and gvp)."""
  if path_type == "linear":
    return 1 / t
  if path_type == "gvp":
    return math.pi / (2 * jnp.tan(t * math.pi / 2))
  check_choice("path_type", path_type, PATH_TYPES)
  return _vp_d_log_mean_coeff(t)


def compute_drift(path_type: str, x: jax.Array, t: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """Drift of the probability-flow ODE in score form: ``dx/dt = -drift_mean + drift_var * score``.

  ``drift_mean = -(d_alpha_t / alpha_t) x`` and
  ``drift_var = (d_alpha_t / alpha_t) sigma_t^2 - sigma_t d_sigma_t``; for ``"vp"`` upstream writes
  the same quantities through ``beta_t = s_min + (1 - t)(s_max - s_min)``: ``(-beta_t x / 2,
  beta_t / 2)``.

  Args:
    path_type: one of PATH_TYPES.
    x: ``(N, ...)`` state.
    t: ``(N,)`` times.

  Returns:
    ``(drift_mean (N, ...), drift_var (N, 1, ..., 1))``.
  """
  t = expand_t_like_x(t, x)
  if path_type == "vp":
    beta_t = VP_SIGMA_MIN + (1 - t) * (VP_SIGMA_MAX - VP_SIGMA_MIN)
    return -0.5 * beta_t * x, beta_t / 2
  alpha_ratio = compute_d_alpha_alpha_ratio_t(path_type, t)
  sigma_t, d_sigma_t = compute_sigma_t(path_type, t)
  return -alpha_ratio * x, alpha_ratio * sigma_t ** 2 - sigma_t * d_sigma_t


def compute_diffusion(path_type: str, x: jax.Array, t: jax.Array, form: str = "constant",
                      norm: float = 1.0) -> jax.Array:
  """Diffusion coefficient ``w(t)`` of the sampling SDE ``dx = [v + w s] dt + sqrt(2 w) dW``.

  Forms (upstream ``compute_diffusion``):
    ``"constant"``: ``norm``; ``"SBDM"``: ``norm * drift_var``; ``"sigma"``: ``norm * sigma_t``;
    ``"linear"``: ``norm (1 - t)``; ``"decreasing"``: ``(norm cos(pi t) + 1)^2 / 4``;
    ``"increasing-decreasing"``: ``norm sin(pi t)^2``.

  Args:
    path_type: one of PATH_TYPES.
    x: ``(N, ...)`` state (only its shape is used).
    t: ``(N,)`` times.
    form: one of DIFFUSION_FORMS.
    norm: the scale of the diffusion.

  Returns:
    ``(N, 1, ..., 1)`` diffusion coefficients.
  """
  form = canonical_diffusion_form(form)
  te = expand_t_like_x(t, x)
  if form == "constant":
    return jnp.full_like(te, norm)
  if form == "SBDM":
    return norm * compute_drift(path_type, x, t)[1]
  if form == "sigma":
    return norm * compute_sigma_t(path_type, te)[0]
  if form == "linear":
    return norm * (1 - te)
  if form == "decreasing":
    return 0.25 * (norm * jnp.cos(math.pi * te) + 1) ** 2
  return norm * jnp.sin(math.pi * te) ** 2


# --------------------------------------------------------------------------------------------------
# Conversions between velocity, score and noise predictions (exact for the conditional targets).

def get_score_from_velocity(path_type: str, velocity: jax.Array, x: jax.Array,
                            t: jax.Array) -> jax.Array:
  """``score = (r v - x) / (sigma_t^2 - r d_sigma_t sigma_t)`` with ``r = alpha_t / d_alpha_t``.

  Linear path: ``score = (t v - x) / (1 - t)``. Shapes: velocity, x ``(N, ...)``, t ``(N,)``.
  """
  t = expand_t_like_x(t, x)
  alpha_t, d_alpha_t = compute_alpha_t(path_type, t)
  sigma_t, d_sigma_t = compute_sigma_t(path_type, t)
  reverse_alpha_ratio = alpha_t / d_alpha_t
  var = sigma_t ** 2 - reverse_alpha_ratio * d_sigma_t * sigma_t
  return (reverse_alpha_ratio * velocity - x) / var


def get_noise_from_velocity(path_type: str, velocity: jax.Array, x: jax.Array,
                            t: jax.Array) -> jax.Array:
  """``noise = (r v - x) / (r d_sigma_t - sigma_t)`` with ``r = alpha_t / d_alpha_t``.

  Linear path: ``noise = x - t v``. Shapes: velocity, x ``(N, ...)``, t ``(N,)``.
  """
  t = expand_t_like_x(t, x)
  alpha_t, d_alpha_t = compute_alpha_t(path_type, t)
  sigma_t, d_sigma_t = compute_sigma_t(path_type, t)
  reverse_alpha_ratio = alpha_t / d_alpha_t
  var = reverse_alpha_ratio * d_sigma_t - sigma_t
  return (reverse_alpha_ratio * velocity - x) / var


def get_velocity_from_score(path_type: str, score: jax.Array, x: jax.Array,
                            t: jax.Array) -> jax.Array:
  """``v = drift_var * score - drift_mean`` (compute_drift). Shapes: ``(N, ...)``, t ``(N,)``."""
  drift_mean, drift_var = compute_drift(path_type, x, t)
  return drift_var * score - drift_mean


def get_score_from_noise(path_type: str, noise: jax.Array, x: jax.Array, t: jax.Array) -> jax.Array:
  """``score = -noise / sigma_t`` (upstream ``get_score`` for noise models). Shapes as above."""
  return noise / -compute_sigma_t(path_type, expand_t_like_x(t, x))[0]


def get_noise_from_score(path_type: str, score: jax.Array, x: jax.Array, t: jax.Array) -> jax.Array:
  """``noise = -sigma_t * score`` (inverse of get_score_from_noise). Shapes as above."""
  return -compute_sigma_t(path_type, expand_t_like_x(t, x))[0] * score


def get_velocity_from_noise(path_type: str, noise: jax.Array, x: jax.Array,
                            t: jax.Array) -> jax.Array:
  """``v = -drift_mean + drift_var * (-noise / sigma_t)`` (upstream ``noise_ode``)."""
  return get_velocity_from_score(path_type, get_score_from_noise(path_type, noise, x, t), x, t)


# --------------------------------------------------------------------------------------------------
# Interpolation.

def compute_xt(path_type: str, t: jax.Array, x0: jax.Array, x1: jax.Array) -> jax.Array:
  """``x_t = alpha_t x1 + sigma_t x0``; t ``(N,)``, x0/x1 ``(N, ...)`` -> ``(N, ...)``."""
  t = expand_t_like_x(t, x1)
  return compute_alpha_t(path_type, t)[0] * x1 + compute_sigma_t(path_type, t)[0] * x0


def compute_ut(path_type: str, t: jax.Array, x0: jax.Array, x1: jax.Array) -> jax.Array:
  """``u_t = d_alpha_t x1 + d_sigma_t x0``; t ``(N,)``, x0/x1 ``(N, ...)`` -> ``(N, ...)``."""
  t = expand_t_like_x(t, x1)
  return compute_alpha_t(path_type, t)[1] * x1 + compute_sigma_t(path_type, t)[1] * x0


def default_eps(path_type: str, prediction: str, train_eps: Optional[float],
                sample_eps: Optional[float]) -> Tuple[float, float]:
  """The (train_eps, sample_eps) that upstream ``create_transport`` settles on.

  - ``"vp"``: train 1e-5, sample 1e-3 when ``train_eps`` is None.
  - ``"linear"``/``"gvp"`` with noise or score prediction: train 1e-3, sample 1e-3 when
    ``train_eps`` is None.
  - ``"linear"``/``"gvp"`` with velocity prediction: both are forced to 0, whatever is passed.

  Upstream quirk kept on purpose: the sample default is chosen by testing ``train_eps``, so a
  ``sample_eps`` given without a ``train_eps`` is ignored (replaced by 1e-3).
  """
  if path_type in ("linear", "gvp") and prediction == "velocity":
    return 0.0, 0.0
  train_default = 1e-5 if path_type == "vp" else 1e-3
  if train_eps is None:
    return train_default, 1e-3
  if sample_eps is None:
    raise ValueError(f"sample_eps=None is not allowed when train_eps={train_eps!r} is set "
                     f"(upstream would fail at sampling time); pass a number")
  return float(train_eps), float(sample_eps)


@dataclasses.dataclass(frozen=True)
class Transport:
  """The upstream ``Transport`` as built by ``create_transport`` (frozen, hashable: jit-static).

  Attributes:
    path_type: one of PATH_TYPES (case-insensitive: upstream's "Linear", "GVP", "VP" work too).
    prediction: one of PREDICTIONS (what the model outputs).
    loss_weight: one of LOSS_WEIGHTS; used only for noise/score prediction (as upstream).
    train_eps: None for the upstream default (see default_eps).
    sample_eps: None for the upstream default (see default_eps).
  """
  path_type: str = "linear"
  prediction: str = "velocity"
  loss_weight: Optional[str] = None
  train_eps: Optional[float] = None
  sample_eps: Optional[float] = None

  def __post_init__(self):
    if isinstance(self.path_type, str):
      object.__setattr__(self, "path_type", self.path_type.lower())
    check_choice("path_type", self.path_type, PATH_TYPES)
    check_choice("prediction", self.prediction, PREDICTIONS)
    check_choice("loss_weight", self.loss_weight, LOSS_WEIGHTS)
    for name in ("train_eps", "sample_eps"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, (int, float)) and 0 <= value < 0.5):
        raise ValueError(f"{name}={value!r} is not allowed; it must be None or a number in "
                         f"[0, 0.5)")
    # Raises now, not at sampling time, for an unusable train/sample eps pair.
    default_eps(self.path_type, self.prediction, self.train_eps, self.sample_eps)

  @property
  def eps(self) -> Tuple[float, float]:
    """The resolved ``(train_eps, sample_eps)`` (upstream ``create_transport`` rules)."""
    return default_eps(self.path_type, self.prediction, self.train_eps, self.sample_eps)

  def interval(self, *, eval: bool = False, sde: bool = False, diffusion_form: str = "SBDM",
               last_step_size: float = 0.0, reverse: bool = False) -> Tuple[float, float]:
    """Time interval ``(t0, t1)`` (upstream ``check_interval``), Python floats.

    ``eps`` is sample_eps when ``eval`` else train_eps.
    - ``"vp"``: ``t0 = 0``; ``t1 = 1 - eps``, or ``1 - last_step_size`` for an SDE with a last step.
    - ``"linear"``/``"gvp"`` with a non-velocity model or an SDE: ``t0 = eps`` if the model is not a
      velocity model or (SDE and form "SBDM"), else 0; ``t1`` as for "vp".
    - otherwise ``[0, 1]``.
    ``reverse`` maps ``(t0, t1)`` to ``(1 - t0, 1 - t1)``.
    """
    train_eps, sample_eps = self.eps
    eps = sample_eps if eval else train_eps
    diffusion_form = canonical_diffusion_form(diffusion_form)
    t0, t1 = 0.0, 1.0
    end = 1 - eps if (not sde or last_step_size == 0) else 1 - last_step_size
    if self.path_type == "vp":
      t1 = end
    elif self.prediction != "velocity" or sde:
      # Upstream avoids the singular t = 0 end by starting at eps (a "semi-implicit first step").
      t0 = eps if (diffusion_form == "SBDM" and sde) or self.prediction != "velocity" else 0.0
      t1 = end
    if reverse:
      t0, t1 = 1 - t0, 1 - t1
    return float(t0), float(t1)

  def sample_time(self, rng: jax.Array, n: int, dtype=jnp.float32) -> jax.Array:
    """Training times ``t ~ U[t0, t1)`` of shape ``(n,)``, with ``(t0, t1) = interval()``."""
    t0, t1 = self.interval()
    return jax.random.uniform(rng, (n,), dtype) * (t1 - t0) + t0

  def plan(self, x1: jax.Array, x0: jax.Array, t: jax.Array):
    """Returns ``(t, x_t, u_t)``: x1 data and x0 noise ``(N, ...)``, t ``(N,)``."""
    return t, compute_xt(self.path_type, t, x0, x1), compute_ut(self.path_type, t, x0, x1)

  def target(self, x1: jax.Array, x0: jax.Array, t: jax.Array) -> jax.Array:
    """Regression target of the model ``(N, ...)``: ``u_t``, ``x0`` or ``-x0 / sigma_t``."""
    if self.prediction == "velocity":
      return compute_ut(self.path_type, t, x0, x1)
    if self.prediction == "noise":
      return x0
    return -x0 / compute_sigma_t(self.path_type, expand_t_like_x(t, x0))[0]

  def loss_weight_t(self, x_t: jax.Array, t: jax.Array) -> jax.Array:
    """Weight of the noise/score losses ``(N, 1, ..., 1)``: ``(drift_var / sigma_t)^2`` for
    "velocity", ``drift_var / sigma_t^2`` for "likelihood", 1 for None."""
    if self.loss_weight is None:
      return jnp.ones_like(expand_t_like_x(t, x_t))
    _, drift_var = compute_drift(self.path_type, x_t, t)
    sigma_t = compute_sigma_t(self.path_type, expand_t_like_x(t, x_t))[0]
    if self.loss_weight == "velocity":
      return (drift_var / sigma_t) ** 2
    return drift_var / sigma_t ** 2

  def loss_from_output(self, output: jax.Array, x1: jax.Array, x0: jax.Array,
                       t: jax.Array) -> jax.Array:
    """Per-example loss ``(N,)`` of a model output ``(N, ...)`` at ``x_t`` (upstream rules).

    velocity: ``mean((v - u_t)^2)`` (never weighted); noise: ``mean(w (eps - x0)^2)``;
    score: ``mean(w (s sigma_t + x0)^2)``; the mean is over all non-batch axes, in float32 or wider.
    """
    if output.shape != x1.shape:
      raise ValueError(f"model output shape {output.shape} must equal the input shape {x1.shape}")
    dtype = jnp.promote_types(output.dtype, jnp.float32)
    output, x1, x0 = output.astype(dtype), x1.astype(dtype), x0.astype(dtype)
    t = t.astype(jnp.promote_types(t.dtype, jnp.float32))
    if self.prediction == "velocity":
      return mean_flat((output - compute_ut(self.path_type, t, x0, x1)) ** 2)
    x_t = compute_xt(self.path_type, t, x0, x1)
    weight = self.loss_weight_t(x_t, t)
    if self.prediction == "noise":
      return mean_flat(weight * (output - x0) ** 2)
    sigma_t = compute_sigma_t(self.path_type, expand_t_like_x(t, x_t))[0]
    return mean_flat(weight * (output * sigma_t + x0) ** 2)

  def loss(self, model_fn: ModelFn, x1: jax.Array, x0: jax.Array, t: jax.Array,
           **model_kwargs) -> jax.Array:
    """Per-example loss ``(N,)`` for given noise x0 ``(N, ...)`` and times t ``(N,)``."""
    _, x_t, _ = self.plan(x1, x0, t)
    return self.loss_from_output(model_fn(x_t, t, **model_kwargs), x1, x0, t)

  def training_loss(self, model_fn: ModelFn, x1: jax.Array, rng: jax.Array,
                    **model_kwargs) -> jax.Array:
    """Upstream ``training_losses(...)["loss"]``: per-example loss ``(N,)``.

    Draws ``t ~ U[t0, t1)`` (``sample_time``) and ``x0 ~ N(0, I)`` from ``rng`` (split as
    ``rng_t, rng_noise = split(rng)``), then calls ``model_fn(x_t, t, **model_kwargs)``.

    Args:
      model_fn: ``(x_t (N, ...), t (N,), **kw) -> (N, ...)``.
      x1: ``(N, ...)`` data (images NHWC).
      rng: a PRNG key.
      **model_kwargs: passed to model_fn (e.g. ``y=labels``).
    """
    rng_t, rng_noise = jax.random.split(rng)
    x0 = jax.random.normal(rng_noise, x1.shape, x1.dtype)
    t = self.sample_time(rng_t, x1.shape[0], jnp.promote_types(x1.dtype, jnp.float32))
    return self.loss(model_fn, x1, x0, t, **model_kwargs)

  # ------------------------------------------------------------------------------------------------
  # Drift and score from a model output (one model call serves both in the SDE sampler).

  def drift_from_output(self, output: jax.Array, x: jax.Array, t: jax.Array) -> jax.Array:
    """Probability-flow ODE drift ``dx/dt`` ``(N, ...)`` of a model output (upstream get_drift)."""
    if output.shape != x.shape:
      raise ValueError(f"model output shape {output.shape} must equal the state shape {x.shape}")
    if self.prediction == "velocity":
      return output
    drift_mean, drift_var = compute_drift(self.path_type, x, t)
    score = output if self.prediction == "score" else get_score_from_noise(
        self.path_type, output, x, t)
    return -drift_mean + drift_var * score

  def score_from_output(self, output: jax.Array, x: jax.Array, t: jax.Array) -> jax.Array:
    """Score ``grad log p_t(x)`` ``(N, ...)`` from a model output (upstream get_score)."""
    if self.prediction == "score":
      return output
    if self.prediction == "noise":
      return get_score_from_noise(self.path_type, output, x, t)
    return get_score_from_velocity(self.path_type, output, x, t)

  def drift(self, model_fn: ModelFn) -> ModelFn:
    """``drift(x, t, **kw) -> (N, ...)``: the ODE drift of a model; x ``(N, ...)``, t ``(N,)``."""
    return lambda x, t, **kw: self.drift_from_output(model_fn(x, t, **kw), x, t)

  def score(self, model_fn: ModelFn) -> ModelFn:
    """``score(x, t, **kw) -> (N, ...)``: the score of a model; x ``(N, ...)``, t ``(N,)``."""
    return lambda x, t, **kw: self.score_from_output(model_fn(x, t, **kw), x, t)


def create_transport(path_type: str = "Linear", prediction: str = "velocity",
                     loss_weight: Optional[str] = None, train_eps: Optional[float] = None,
                     sample_eps: Optional[float] = None) -> Transport:
  """Upstream-named constructor; the defaults are the official SiT run (Linear, velocity, None)."""
  return Transport(path_type, prediction, loss_weight, train_eps, sample_eps)
