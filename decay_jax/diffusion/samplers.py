"""SiT samplers: ODE (Euler, Heun, dopri5), SDE (Euler-Maruyama, Heun) and classifier-free guidance.

JAX re-implementation of upstream willisma/SiT ``Sampler.sample_ode`` / ``Sampler.sample_sde`` and
``integrators.py`` (docs/official_code.md 5.3), integrating from noise (t = t0, near 0) to data (t = t1,
near 1) with the interval rules of ``Transport.interval``.

- ODE ``dx/dt = drift(x, t)`` (the velocity for velocity models). Fixed-step "euler" and "heun"
  take ``num_steps - 1`` steps on ``linspace(t0, t1, num_steps)`` (torchdiffeq fixed-grid
  semantics). "dopri5" is adaptive (official defaults ``atol = 1e-6``, ``rtol = 1e-3``) and ``num_steps`` only
  sets the saved output times. It runs on diffrax but steps exactly as torchdiffeq's dopri5 (the
  official solver): same initial step, error test (RMS over the whole state of
  ``err / (atol + rtol max(|y0|, |y1|))``), step-size controller, and a last step that overshoots t1
  and is interpolated back. On the Gaussian toy of tests/test_transport.py it matches torchdiffeq
  0.2.5 to 2e-14 in float64 (2e-5 in float32).
- SDE ``dx = [drift + w(t) score] dt + sqrt(2 w(t)) dW`` on ``linspace(t0, t1, num_steps)`` with
  ``t1 = 1 - last_step_size``: ``num_steps - 1`` stochastic steps of constant ``dt`` and then one
  deterministic last step at ``t1`` ("mean", "tweedie", "euler" or None).

Everything is a pure function of arrays and static Python configuration, so it jits::

    fn = jax.jit(functools.partial(sample_sde, transport, model_fn, method="heun"))
    samples = fn(noise, rng, {"y": labels})

The loops are ``lax.scan`` (fixed steps) or diffrax's while loop (dopri5); the batch axis is first
and every step is elementwise over it (except dopri5's error norm, which like torchdiffeq's couples
the whole batch), so callers can shard the batch over devices.

``model_fn(x, t, **model_kwargs)`` takes ``x (N, ...)`` and ``t (N,)`` and returns ``(N, ...)``.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence, Tuple, Union

import diffrax
import jax
import jax.numpy as jnp

from decay_jax.diffusion import transport as transport_lib
from decay_jax import validate
from decay_jax.validate import check_choice
from decay_jax.diffusion.transport import ModelFn, Transport

ODE_METHODS = ("euler", "heun", "dopri5")
SDE_METHODS = ("euler", "heun")
LAST_STEPS = (None, "mean", "tweedie", "euler")


def _canon(field: str, value, allowed: Sequence):
  """Case-insensitive choice check (upstream spells "Euler", "Heun", "Mean", "Tweedie")."""
  lowered = value.lower() if isinstance(value, str) else value
  check_choice(field, lowered, allowed)
  return lowered


def _time_dtype(x: jax.Array):
  return jnp.promote_types(x.dtype, jnp.float32)


def _batch_time(t: jax.Array, x: jax.Array) -> jax.Array:
  """Broadcasts a scalar time to the per-example vector ``(N,)`` that models take."""
  return jnp.full((x.shape[0],), t, _time_dtype(x))


# --------------------------------------------------------------------------------------------------
# ODE.

def _fixed_step_ode(drift: Callable, x: jax.Array, ts: jax.Array, method: str,
                    return_trajectory: bool):
  """Euler / Heun (explicit trapezoid) on the grid ``ts (S,)``; returns ``(x_final, xs or None)``.

  Euler: ``x + dt f(t, x)``. Heun: ``k1 = f(t, x)``, ``k2 = f(t + dt, x + dt k1)``,
  ``x + dt (k1 + k2) / 2``. ``xs`` ``(S, N, ...)`` holds the state at every grid time (x first).
  """
  def step(x_cur, t_pair):
    t_cur, t_next = t_pair
    dt = t_next - t_cur
    k1 = drift(x_cur, t_cur)
    if method == "euler":
      x_next = x_cur + dt * k1
    else:
      k2 = drift(x_cur + dt * k1, t_next)
      x_next = x_cur + 0.5 * dt * (k1 + k2)
    x_next = x_next.astype(x_cur.dtype)
    return x_next, (x_next if return_trajectory else None)

  x_final, xs = jax.lax.scan(step, x, (ts[:-1], ts[1:]))
  if return_trajectory:
    xs = jnp.concatenate([x[None], xs], axis=0)
  return x_final, xs


def _rms_norm(x: jax.Array) -> jax.Array:
  """Root-mean-square over the whole state (torchdiffeq's default error norm)."""
  return jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.promote_types(x.dtype, jnp.float32)))))


def _initial_step(drift: Callable, t0, y0: jax.Array, rtol: float, atol: float) -> jax.Array:
  """torchdiffeq's initial step (Hairer, Norsett and Wanner II.4) for dopri5 (error order 5).

  ``d0 = |y0 / sc|``, ``d1 = |f0 / sc|`` with ``sc = atol + rtol |y0|``; ``h0 = 0.01 d0 / d1``;
  ``d2 = |f(t0 + h0, y0 + h0 f0) - f0| / (sc h0)``; ``h = min(100 h0, (0.01 / max(d1, d2))^(1/5))``.
  Passing it explicitly matters: diffrax's own choice falls back to 0.01 for wrapped terms.
  """
  scale = atol + jnp.abs(y0) * rtol
  f0 = drift(y0, t0)
  d0, d1 = _rms_norm(y0 / scale), _rms_norm(f0 / scale)
  h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / jnp.where(d1 == 0, 1.0, d1))
  f1 = drift((y0 + h0 * f0).astype(y0.dtype), t0 + h0)
  d2 = _rms_norm((f1 - f0) / scale) / h0
  max_d = jnp.maximum(d1, d2)
  h1 = jnp.where(max_d <= 1e-15, jnp.maximum(1e-6, h0 * 1e-3),
                 (0.01 / jnp.where(max_d == 0, 1.0, max_d)) ** (1.0 / 5))
  return jnp.minimum(100 * h0, h1)


def _dopri5_ode(drift: Callable, x: jax.Array, ts: jax.Array, t0: float, t1: float, atol: float,
                rtol: float, max_steps: int, overshoot: bool, return_trajectory: bool):
  """Adaptive Dormand-Prince 5(4) with diffrax, stepping as torchdiffeq's ``dopri5`` does.

  Same initial step, error test (RMS of ``err / (atol + rtol max(|y0|, |y1|))`` <= 1) and I
  controller (safety 0.9, factors in [0.2, 10]). torchdiffeq does not shorten its last step to land
  on t1: it steps past t1 (the model sees t > t1) and interpolates back. ``overshoot=True``
  reproduces that (integrate towards ``t0 + 11 (t1 - t0)``, stop after the first step ending at or
  beyond t1); then ``ts`` are read from the dense (4th-order) interpolant, as in torchdiffeq.
  """
  term = diffrax.ODETerm(lambda t, y, args: drift(y, t).astype(y.dtype))
  save_ts = ts if return_trajectory else ts[-1:]
  kwargs = dict(t1=t1)
  if overshoot:
    kwargs = dict(t1=t0 + 11 * (t1 - t0), event=diffrax.Event(lambda t, y, args, **kw: t >= t1))
  sol = diffrax.diffeqsolve(
      term, diffrax.Dopri5(), t0=t0, dt0=_initial_step(drift, jnp.asarray(t0, ts.dtype), x, rtol,
                                                       atol),
      y0=x, stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
      saveat=diffrax.SaveAt(ts=save_ts), max_steps=max_steps, **kwargs)
  return sol.ys[-1], (sol.ys if return_trajectory else None)


def sample_ode(transport: Transport, model_fn: ModelFn, x: jax.Array,
               model_kwargs: Optional[Mapping] = None, *, method: str = "dopri5",
               num_steps: int = 50, atol: float = 1e-6, rtol: float = 1e-3,
               max_steps: int = 4096, overshoot: bool = True, return_trajectory: bool = False):
  """Integrates the probability-flow ODE from noise to data (upstream ``sample_ode``).

  Args:
    transport: the Transport the model was trained with.
    model_fn: ``(x (N, ...), t (N,), **model_kwargs) -> (N, ...)``.
    x: ``(N, ...)`` initial noise, ``N(0, I)``.
    model_kwargs: extra model arguments (e.g. ``{"y": labels}``), a pytree of arrays.
    method: one of ODE_METHODS.
    num_steps: grid size ``S`` of ``linspace(t0, t1, S)``: ``S - 1`` steps for euler/heun, the
      saved output times for dopri5 (upstream default 50; sample_ddp uses 250).
    atol: dopri5 absolute tolerance.
    rtol: dopri5 relative tolerance.
    max_steps: dopri5 step budget (diffrax raises if it is exhausted; torchdiffeq has no limit).
    overshoot: dopri5 only: let the last step pass t1 and interpolate back, as torchdiffeq does
      (the official behaviour; the model is then evaluated at t > t1). False clips it at t1.
    return_trajectory: also return the states at the ``S`` grid times.

  Returns:
    ``x (N, ...)`` at t1, or ``(x, xs (S, N, ...))`` with ``xs[0]`` the input noise.
  """
  method = _canon("method", method, ODE_METHODS)
  validate.check_int("num_steps", num_steps, 2)
  model_kwargs = dict(model_kwargs or {})
  t0, t1 = transport.interval(eval=True, sde=False)
  ode_drift = transport.drift(model_fn)
  drift = lambda y, t: ode_drift(y, _batch_time(t, y), **model_kwargs)
  ts = jnp.linspace(t0, t1, num_steps, dtype=_time_dtype(x))
  if method == "dopri5":
    x_final, xs = _dopri5_ode(drift, x, ts, t0, t1, atol, rtol, max_steps, overshoot,
                              return_trajectory)
  else:
    x_final, xs = _fixed_step_ode(drift, x, ts, method, return_trajectory)
  return (x_final, xs) if return_trajectory else x_final


# --------------------------------------------------------------------------------------------------
# SDE.

def sde_drift_and_diffusion(transport: Transport, model_fn: ModelFn, diffusion_form: str = "sigma",
                            diffusion_norm: float = 1.0):
  """Returns ``(sde_drift(x, t, **kw), diffusion(x, t))`` of the sampling SDE.

  ``sde_drift = drift + w(t) score`` (one model call serves both terms) and
  ``diffusion = w(t)`` of shape ``(N, 1, ..., 1)`` (transport.compute_diffusion).
  """
  diffusion_form = transport_lib.canonical_diffusion_form(diffusion_form)

  def diffusion(x, t):
    return transport_lib.compute_diffusion(transport.path_type, x, t, diffusion_form,
                                           diffusion_norm)

  def sde_drift(x, t, **kw):
    out = model_fn(x, t, **kw)
    return (transport.drift_from_output(out, x, t)
            + diffusion(x, t) * transport.score_from_output(out, x, t))

  return sde_drift, diffusion


def sde_last_step(transport: Transport, model_fn: ModelFn, x: jax.Array, t1: float,
                  model_kwargs: Optional[Mapping] = None, *, last_step: Optional[str] = "mean",
                  last_step_size: float = 0.04, diffusion_form: str = "sigma",
                  diffusion_norm: float = 1.0) -> jax.Array:
  """The deterministic final step at ``t1`` (upstream ``__get_last_step``); x ``(N, ...)``.

  None: ``x``. "mean": ``x + sde_drift(x, t1) h``. "euler": ``x + drift(x, t1) h`` (ODE drift).
  "tweedie": ``x / alpha_t1 + sigma_t1^2 / alpha_t1 * score(x, t1)`` (= E[x1 | x_t1] for the exact
  score). ``h = last_step_size``.
  """
  last_step = _canon("last_step", last_step, LAST_STEPS)
  model_kwargs = dict(model_kwargs or {})
  if last_step is None:
    return x
  t = _batch_time(t1, x)
  if last_step == "mean":
    sde_drift, _ = sde_drift_and_diffusion(transport, model_fn, diffusion_form, diffusion_norm)
    return (x + sde_drift(x, t, **model_kwargs) * last_step_size).astype(x.dtype)
  if last_step == "euler":
    return (x + transport.drift(model_fn)(x, t, **model_kwargs) * last_step_size).astype(x.dtype)
  t_scalar = jnp.asarray(t1, _time_dtype(x))
  alpha = transport_lib.compute_alpha_t(transport.path_type, t_scalar)[0]
  sigma = transport_lib.compute_sigma_t(transport.path_type, t_scalar)[0]
  score = transport.score(model_fn)(x, t, **model_kwargs)
  return (x / alpha + sigma ** 2 / alpha * score).astype(x.dtype)


def sample_sde(transport: Transport, model_fn: ModelFn, x: jax.Array, rng: jax.Array,
               model_kwargs: Optional[Mapping] = None, *, method: str = "euler",
               diffusion_form: str = "sigma", diffusion_norm: float = 1.0,
               last_step: Optional[str] = "mean", last_step_size: float = 0.04,
               num_steps: int = 250, return_trajectory: bool = False):
  """Integrates the sampling SDE from noise to data (upstream ``sample_sde`` + ``integrators.sde``).

  Grid ``ts = linspace(t0, t1, num_steps)`` with ``(t0, t1) = transport.interval(eval=True,
  sde=True, ...)`` (for the official Linear/velocity model: ``[0, 1 - last_step_size]``), constant
  ``dt = ts[1] - ts[0]``, one step per ``ts[:-1]``, ``xi ~ N(0, I)`` from ``rng``:
  - Euler-Maruyama: ``x <- x + sde_drift(x, t) dt + sqrt(2 w(t)) sqrt(dt) xi``.
  - Heun: ``xh = x + sqrt(2 w(t)) sqrt(dt) xi``, ``k1 = sde_drift(xh, t)``,
    ``k2 = sde_drift(xh + dt k1, t + dt)``, ``x <- xh + dt (k1 + k2) / 2``.
  then ``sde_last_step`` at t1. With ``last_step=None`` the last step size is 0 (as upstream), so
  t1 = 1 - sample_eps; Heun's second stage then reaches t = 1, where the score of a linear-path
  model is singular (as upstream). Upstream's SBDM form is infinite at t0 = 0 for Linear/velocity
  (sample_eps 0) and gives NaN, as upstream; use "sigma" (the official sample_ddp default, and the
  default here).

  Args:
    transport: the Transport the model was trained with.
    model_fn: ``(x (N, ...), t (N,), **model_kwargs) -> (N, ...)``.
    x: ``(N, ...)`` initial noise.
    rng: PRNG key for the Brownian increments.
    model_kwargs: extra model arguments (e.g. ``{"y": labels}``).
    method: one of SDE_METHODS.
    diffusion_form: one of transport.DIFFUSION_FORMS (default "sigma": ``w = norm (1 - t)`` for the
      linear path).
    diffusion_norm: the ``norm`` of the diffusion form.
    last_step: one of LAST_STEPS.
    last_step_size: the size ``h`` of the last step (upstream default 0.04).
    num_steps: number of grid points (= number of returned states, as upstream).
    return_trajectory: also return the states after every step.

  Returns:
    ``x (N, ...)``, or ``(x, xs (num_steps, N, ...))`` (the states after each of the
    ``num_steps - 1`` steps, then the last-step output; ``xs[-1] == x``).
  """
  method = _canon("method", method, SDE_METHODS)
  last_step = _canon("last_step", last_step, LAST_STEPS)
  validate.check_int("num_steps", num_steps, 2)
  model_kwargs = dict(model_kwargs or {})
  if last_step is None:
    last_step_size = 0.0
  t0, t1 = transport.interval(eval=True, sde=True, diffusion_form=diffusion_form,
                              last_step_size=last_step_size)
  sde_drift, diffusion = sde_drift_and_diffusion(transport, model_fn, diffusion_form,
                                                 diffusion_norm)
  ts = jnp.linspace(t0, t1, num_steps, dtype=_time_dtype(x))
  dt = ts[1] - ts[0]

  def step(x_cur, inputs):
    t_scalar, key = inputs
    t = _batch_time(t_scalar, x_cur)
    dw = jax.random.normal(key, x_cur.shape, x_cur.dtype) * jnp.sqrt(dt)
    if method == "euler":
      mean_x = x_cur + sde_drift(x_cur, t, **model_kwargs) * dt
      x_next = mean_x + jnp.sqrt(2 * diffusion(x_cur, t)) * dw
    else:
      x_hat = x_cur + jnp.sqrt(2 * diffusion(x_cur, t)) * dw
      k1 = sde_drift(x_hat, t, **model_kwargs)
      k2 = sde_drift(x_hat + dt * k1, t + dt, **model_kwargs)
      x_next = x_hat + 0.5 * dt * (k1 + k2)
    x_next = x_next.astype(x_cur.dtype)
    return x_next, (x_next if return_trajectory else None)

  keys = jax.random.split(rng, num_steps - 1)
  x_last, xs = jax.lax.scan(step, x, (ts[:-1], keys))
  x_final = sde_last_step(transport, model_fn, x_last, t1, model_kwargs, last_step=last_step,
                          last_step_size=last_step_size, diffusion_form=diffusion_form,
                          diffusion_norm=diffusion_norm)
  if return_trajectory:
    return x_final, jnp.concatenate([xs, x_final[None]], axis=0)
  return x_final


# --------------------------------------------------------------------------------------------------
# Classifier-free guidance.

def guidance_combine(cond: jax.Array, uncond: jax.Array, scale: Union[float, jax.Array],
                     channels: Optional[int] = 3) -> jax.Array:
  """``uncond + s (cond - uncond)`` on the first ``channels`` channels (last axis), else ``cond``.

  Written as ``cond + (s - 1)(cond - uncond)`` so that ``s = 1`` returns ``cond`` bit-exactly.
  ``scale`` may be a scalar or per-example ``(N,)``. Shapes: cond, uncond ``(N, ..., C)``.
  """
  scale = jnp.asarray(scale, cond.dtype)
  scale = scale.reshape(scale.shape + (1,) * (cond.ndim - scale.ndim))
  guided = cond + (scale - 1) * (cond - uncond)
  if channels is None:
    return guided
  return jnp.concatenate([guided[..., :channels], cond[..., channels:]], axis=-1)


def cfg_model_fn(model_fn: ModelFn, scale: Union[float, jax.Array], null_label: int,
                 channels: Optional[int] = 3,
                 interval: Optional[Tuple[float, float]] = None) -> ModelFn:
  """Classifier-free guided model (official ``forward_with_cfg``, docs/official_code.md 4.8).

  The returned ``guided(x, t, y, **kw)`` runs ``model_fn`` once on the doubled batch
  ``([x; x], [t; t], y=[y; null_label])`` and returns ``(N, ..., C)``:
  ``v = v_uncond + scale (v_cond - v_uncond)`` on channels ``[:channels]`` and ``v_cond`` on the
  rest (``channels=3``: the official rule for 4-channel latents; ``None``: every channel).
  With ``interval=(lo, hi)`` the guidance acts only where ``lo <= t <= hi`` (per example) and the
  output is ``v_cond`` elsewhere. A Python ``scale == 1`` returns ``model_fn(x, t, y=y)`` itself
  (one batch, like sample_ddp at cfg-scale 1); a traced scale of 1 gives ``v_cond`` bit-exactly.

  Args:
    model_fn: conditional model ``(x (N, ...), t (N,), y=(N,) int, **kw) -> (N, ..., C)``.
    scale: guidance scale (Python number or traced scalar).
    null_label: the unconditional class id (1000 for ImageNet).
    channels: number of guided leading channels, or None for all.
    interval: optional ``(lo, hi)`` time window of the guidance.
  """
  if channels is not None and not (isinstance(channels, int) and channels >= 1):
    raise ValueError(f"channels={channels!r} is not allowed; it must be None or an integer >= 1")
  if interval is not None:
    lo, hi = interval
    if not lo <= hi:
      raise ValueError(f"interval={interval!r} is not allowed; it must be (lo, hi) with lo <= hi")
  if isinstance(scale, (int, float)) and scale == 1:
    return lambda x, t, y, **kw: model_fn(x, t, y=y, **kw)

  def guided(x, t, y, **kw):
    n = x.shape[0]
    out = model_fn(jnp.concatenate([x, x], axis=0), jnp.concatenate([t, t], axis=0),
                   y=jnp.concatenate([y, jnp.full_like(y, null_label)], axis=0), **kw)
    cond, uncond = out[:n], out[n:]
    s = jnp.asarray(scale, out.dtype)
    if interval is not None:
      inside = (t >= interval[0]) & (t <= interval[1])
      s = jnp.where(inside, s, jnp.ones_like(s))  # scale 1 leaves cond untouched
    return guidance_combine(cond, uncond, s, channels)

  return guided
