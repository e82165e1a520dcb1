"""SiT transport and samplers: closed forms, eps rules, a Gaussian toy with exact fields, CFG rules.

The Gaussian toy: data ``x1 ~ N(mu, diag(s^2))`` (8 dims, NHWC ``(2, 2, 2)``), noise
``x0 ~ N(0, I)``, ``x_t = a_t x1 + b_t x0`` (a = alpha, b = sigma). Then ``x_t ~ N(a mu, V)`` with
``V = a^2 s^2 + b^2`` per dimension, and the exact fields are the Gaussian conditional means
  velocity ``E[a' x1 + b' x0 | x_t] = a' mu + (a a' s^2 + b b') / V (x - a mu)``,
  noise ``E[x0 | x_t] = b / V (x - a mu)``, score ``-(x - a mu) / V``.
The probability-flow ODE is affine: ``x_t = a_t mu + sqrt(V_t / V_t0) (x_t0 - a_t0 mu)``, which
gives an exact per-sample reference for the ODE samplers.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.diffusion import samplers
from decay_jax.diffusion import transport as T

N = 4096
SHAPE = (2, 2, 2)
MU = jnp.linspace(-1.5, 2.0, 8).reshape(SHAPE)
S = jnp.linspace(0.5, 1.2, 8).reshape(SHAPE)
PATHS = T.PATH_TYPES


# --------------------------------------------------------------------------------------------------
# Independent closed forms (written from the formulas, not from the module).

def alpha_sigma(path, t):
  """(alpha_t, sigma_t) for the three upstream paths."""
  if path == "linear":
    return t, 1 - t
  if path == "gvp":
    return jnp.sin(math.pi * t / 2), jnp.cos(math.pi * t / 2)
  log_mean = -0.25 * (1 - t) ** 2 * (20.0 - 0.1) - 0.5 * (1 - t) * 0.1
  return jnp.exp(log_mean), jnp.sqrt(1 - jnp.exp(2 * log_mean))


def derivs(path, t):
  """(alpha, d_alpha, sigma, d_sigma) with the derivatives by autodiff of the closed forms."""
  a, da = jax.jvp(lambda u: alpha_sigma(path, u)[0], (t,), (jnp.ones_like(t),))
  b, db = jax.jvp(lambda u: alpha_sigma(path, u)[1], (t,), (jnp.ones_like(t),))
  return a, da, b, db


def bt(t):
  return t[:, None, None, None]


@functools.partial(jax.jit, static_argnums=0)  # one compilation instead of many eager ops
def toy_fields(path, x, t):
  """Exact (velocity, noise, score) of the Gaussian toy at x (N, 2, 2, 2), t (N,)."""
  a, da, b, db = (bt(c) for c in derivs(path, t))
  v_var = a ** 2 * S ** 2 + b ** 2
  centred = x - a * MU
  velocity = da * MU + (a * da * S ** 2 + b * db) / v_var * centred
  return velocity, b / v_var * centred, -centred / v_var


def toy_velocity(x, t):
  return toy_fields("linear", x, t)[0]


def exact_flow(path, x, t0, t1):
  """The exact ODE map of the toy from time t0 to t1 (scalars)."""
  a0, b0 = alpha_sigma(path, jnp.float32(t0))
  a1, b1 = alpha_sigma(path, jnp.float32(t1))
  ratio = jnp.sqrt((a1 ** 2 * S ** 2 + b1 ** 2) / (a0 ** 2 * S ** 2 + b0 ** 2))
  return a1 * MU + ratio * (x - a0 * MU)


@functools.partial(jax.jit, static_argnums=(0, 1))
def standard_noise(seed=0, n=N):
  """N(0, I) noise standardised per dimension, so the exact ODE image has moments (mu, s^2)."""
  z = jax.random.normal(jax.random.key(seed), (n,) + SHAPE)
  return (z - z.mean(0)) / z.std(0)


def rand(seed, shape=(64,) + SHAPE):
  return jax.random.normal(jax.random.key(seed), shape)


def times(seed, n=64, lo=0.05, hi=0.95):
  return jax.random.uniform(jax.random.key(seed), (n,), minval=lo, maxval=hi)


# --------------------------------------------------------------------------------------------------
# Paths, targets, conversions.

@pytest.mark.parametrize("path", PATHS)
def test_path_closed_forms(path):
  x1, x0, t = rand(0), rand(1), times(2)
  a, da, b, db = (bt(c) for c in derivs(path, t))
  tr = T.Transport(path, "velocity")
  t_out, x_t, u_t = tr.plan(x1, x0, t)
  assert t_out is t and x_t.shape == u_t.shape == x1.shape
  np.testing.assert_allclose(x_t, a * x1 + b * x0, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(u_t, da * x1 + db * x0, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(tr.target(x1, x0, t), u_t, rtol=1e-6)
  np.testing.assert_array_equal(T.Transport(path, "noise").target(x1, x0, t), x0)
  np.testing.assert_allclose(T.Transport(path, "score").target(x1, x0, t), -x0 / b, rtol=1e-5)
  # d_alpha / alpha and the drift variance in closed form.
  ta = bt(t)
  drift_var = {"linear": (1 - ta) / ta, "gvp": math.pi / 2 / jnp.tan(math.pi * ta / 2),
               "vp": (0.1 + (1 - ta) * 19.9) / 2}[path]
  drift_mean, var = T.compute_drift(path, x1, t)
  np.testing.assert_allclose(var, jnp.broadcast_to(drift_var, var.shape), rtol=1e-4)
  np.testing.assert_allclose(drift_mean, -(da / a) * x1, rtol=1e-4, atol=1e-5)
  assert path != "linear" or np.array_equal(T.compute_alpha_t(path, t)[0], t)


@pytest.mark.parametrize("path", PATHS)
def test_conversions_round_trip_and_conditional_targets(path):
  x1, x0, t = rand(3), rand(4), times(5)
  _, x_t, u_t = T.Transport(path).plan(x1, x0, t)
  b = bt(alpha_sigma(path, t)[1])
  tol = dict(rtol=2e-3, atol=2e-3)
  # The conversions are exact linear maps: the conditional velocity maps to the conditional
  # noise x0 and the conditional score -x0 / sigma_t.
  np.testing.assert_allclose(T.get_noise_from_velocity(path, u_t, x_t, t), x0, **tol)
  np.testing.assert_allclose(T.get_score_from_velocity(path, u_t, x_t, t), -x0 / b, **tol)
  np.testing.assert_allclose(T.get_velocity_from_score(path, -x0 / b, x_t, t), u_t, **tol)
  np.testing.assert_allclose(T.get_velocity_from_noise(path, x0, x_t, t), u_t, **tol)
  # Round trips on arbitrary (non-conditional) fields.
  v = rand(6)
  score = T.get_score_from_velocity(path, v, x_t, t)
  np.testing.assert_allclose(T.get_velocity_from_score(path, score, x_t, t), v, **tol)
  noise = T.get_noise_from_velocity(path, v, x_t, t)
  np.testing.assert_allclose(T.get_score_from_noise(path, noise, x_t, t), score, **tol)
  np.testing.assert_allclose(T.get_noise_from_score(path, score, x_t, t), noise, **tol)


def test_linear_conversions_closed_form():
  x, v, t = rand(7), rand(8), times(9)
  np.testing.assert_allclose(T.get_score_from_velocity("linear", v, x, t),
                             (bt(t) * v - x) / (1 - bt(t)), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(T.get_noise_from_velocity("linear", v, x, t), x - bt(t) * v,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("prediction", ["noise", "score"])
def test_drift_and_score_of_exact_models(path, prediction):
  # Noise and score models are turned into the exact ODE drift (velocity) and score.
  x, t = rand(10), times(11)
  velocity, noise, score = toy_fields(path, x, t)
  model = {"noise": lambda x, t: toy_fields(path, x, t)[1],
           "score": lambda x, t: toy_fields(path, x, t)[2]}[prediction]
  tr = T.Transport(path, prediction)
  np.testing.assert_allclose(tr.drift(model)(x, t), velocity, rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(tr.score(model)(x, t), score, rtol=1e-3, atol=1e-3)
  tv = T.Transport(path, "velocity")
  np.testing.assert_allclose(tv.score(lambda x, t: velocity)(x, t), score, rtol=1e-3, atol=1e-3)
  np.testing.assert_array_equal(tv.drift(lambda x, t: velocity)(x, t), velocity)


def test_diffusion_forms_linear():
  x, t = rand(12), times(13)
  ta = bt(t)
  expected = {"constant": 2.0 * jnp.ones_like(ta), "SBDM": 2.0 * (1 - ta) / ta,
              "sigma": 2.0 * (1 - ta), "linear": 2.0 * (1 - ta),
              "decreasing": 0.25 * (2.0 * jnp.cos(math.pi * ta) + 1) ** 2,
              "increasing-decreasing": 2.0 * jnp.sin(math.pi * ta) ** 2}
  for form, want in expected.items():
    got = T.compute_diffusion("linear", x, t, form, norm=2.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=form)
  np.testing.assert_array_equal(T.compute_diffusion("linear", x, t, "inccreasing-decreasing"),
                                T.compute_diffusion("linear", x, t, "increasing-decreasing"))
  with pytest.raises(ValueError, match="diffusion_form='cosine'"):
    T.compute_diffusion("linear", x, t, "cosine")


# --------------------------------------------------------------------------------------------------
# Eps rules (upstream create_transport + check_interval) and time sampling.

def test_eps_defaults_and_intervals():
  lin = T.Transport()
  assert lin.eps == (0.0, 0.0) and lin.interval() == (0.0, 1.0)
  assert T.Transport("Linear", train_eps=0.1, sample_eps=0.2).eps == (0.0, 0.0)  # overridden to 0
  assert T.Transport("gvp").interval(eval=True) == (0.0, 1.0)
  noise = T.Transport("linear", "noise")
  assert noise.eps == (1e-3, 1e-3) and noise.interval() == (1e-3, 1 - 1e-3)
  # Upstream picks the sample default by testing train_eps: a lone sample_eps is ignored.
  assert T.Transport("linear", "score", sample_eps=0.05).eps == (1e-3, 1e-3)
  assert T.Transport("gvp", "noise", train_eps=0.01, sample_eps=0.02).eps == (0.01, 0.02)
  vp = T.Transport("vp")
  assert vp.eps == (1e-5, 1e-3)
  assert vp.interval() == (0.0, 1 - 1e-5) and vp.interval(eval=True) == (0.0, 1 - 1e-3)
  assert vp.interval(eval=True, sde=True, last_step_size=0.04) == (0.0, 0.96)
  # SDE intervals: velocity models start at 0 except with SBDM, where t0 = sample_eps (0 here).
  assert lin.interval(eval=True, sde=True, diffusion_form="sigma",
                      last_step_size=0.04) == (0.0, 0.96)
  assert lin.interval(eval=True, sde=True, last_step_size=0.0) == (0.0, 1.0)
  assert noise.interval(eval=True, sde=True, diffusion_form="sigma",
                        last_step_size=0.04) == (1e-3, 0.96)
  t0, t1 = noise.interval(eval=True, reverse=True)
  assert math.isclose(t0, 1 - 1e-3) and math.isclose(t1, 1e-3)


def test_transport_errors():
  for kwargs, field in [(dict(path_type="cosine"), "path_type"),
                        (dict(prediction="x0"), "prediction"),
                        (dict(loss_weight="snr"), "loss_weight"),
                        (dict(train_eps=-1.0), "train_eps")]:
    with pytest.raises(ValueError, match=field):
      T.Transport(**kwargs)
  with pytest.raises(ValueError, match="sample_eps=None"):
    T.Transport("vp", train_eps=1e-4)


@pytest.mark.parametrize("tr", [T.Transport(), T.Transport("linear", "noise"), T.Transport("vp"),
                                T.Transport("gvp", "score", train_eps=0.1, sample_eps=0.1)],
                         ids=["linear-velocity", "linear-noise", "vp-velocity", "gvp-score-0.1"])
def test_sample_time_respects_interval(tr):
  t0, t1 = tr.interval()
  t = tr.sample_time(jax.random.key(0), 20000)
  assert t.shape == (20000,) and t.dtype == jnp.float32
  assert float(t.min()) >= t0 and float(t.max()) <= t1
  # Uniform over the whole interval: both ends are approached (20000 draws, gaps ~5e-5).
  assert float(t.min()) < t0 + 1e-3 and float(t.max()) > t1 - 1e-3
  assert abs(float(t.mean()) - (t0 + t1) / 2) < 0.01


# --------------------------------------------------------------------------------------------------
# Training loss.

def test_training_loss_exact_velocity_is_irreducible_variance():
  tr = T.Transport()
  n = 8192
  x1 = MU + S * jax.random.normal(jax.random.key(20), (n,) + SHAPE)
  x0 = jax.random.normal(jax.random.key(21), (n,) + SHAPE)
  t = tr.sample_time(jax.random.key(22), n)
  loss = jax.jit(lambda x1, x0, t: tr.loss(toy_velocity, x1, x0, t))(x1, x0, t)
  assert loss.shape == (n,)
  # Var(x1 - x0 | x_t) = s^2 / V_t per dimension: the irreducible loss of the exact field.
  v_var = bt(t) ** 2 * S ** 2 + (1 - bt(t)) ** 2
  expected = float(jnp.mean(S ** 2 / v_var))
  # Relative Monte-Carlo SE ~ 0.6-1% (8 n squared Gaussians with unequal weights s^2 / V);
  # tolerance 4%, measured -1.3%.
  assert abs(float(loss.mean()) / expected - 1) < 0.04
  # A field off by a constant 0.3 costs 0.3^2 more on average (the cross term averages out;
  # measured 0.087).
  wrong = tr.loss(lambda x, t: toy_velocity(x, t) + 0.3, x1, x0, t)
  assert abs(float((wrong - loss).mean()) - 0.09) < 0.01
  # training_loss draws (t, x0) from the key as documented.
  rng = jax.random.key(23)
  rng_t, rng_noise = jax.random.split(rng)
  direct = tr.loss(toy_velocity, x1, jax.random.normal(rng_noise, x1.shape),
                   tr.sample_time(rng_t, n))
  np.testing.assert_allclose(tr.training_loss(toy_velocity, x1, rng), direct, rtol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_loss_weighting_rules(path):
  x1, x0, t = rand(30), rand(31), times(32)
  out = rand(33)
  a, b = (bt(c) for c in alpha_sigma(path, t))
  _, drift_var = T.compute_drift(path, x1, t)
  weights = {None: 1.0, "velocity": (drift_var / b) ** 2, "likelihood": drift_var / b ** 2}
  mean = lambda z: jnp.mean(z, axis=(1, 2, 3))
  for loss_weight, w in weights.items():
    noise = T.Transport(path, "noise", loss_weight)
    score = T.Transport(path, "score", loss_weight)
    velocity = T.Transport(path, "velocity", loss_weight)
    np.testing.assert_allclose(noise.loss_from_output(out, x1, x0, t), mean(w * (out - x0) ** 2),
                               rtol=1e-5)
    np.testing.assert_allclose(score.loss_from_output(out, x1, x0, t),
                               mean(w * (out * b + x0) ** 2), rtol=1e-5)
    # Velocity models are never weighted (upstream).
    u_t = velocity.plan(x1, x0, t)[2]
    np.testing.assert_allclose(velocity.loss_from_output(out, x1, x0, t), mean((out - u_t) ** 2),
                               rtol=1e-5)
  with pytest.raises(ValueError, match="output shape"):
    T.Transport(path).loss_from_output(out[..., :1], x1, x0, t)


# --------------------------------------------------------------------------------------------------
# Samplers on the Gaussian toy.

def moments_error(x):
  """(max |mean - mu|, max |var / s^2 - 1|) over the 8 dimensions."""
  return float(jnp.max(jnp.abs(x.mean(0) - MU))), float(jnp.max(jnp.abs(x.var(0) / S ** 2 - 1)))


def run_ode(method, num_steps, z=None, tr=T.Transport(), model=toy_velocity, **kw):
  fn = jax.jit(functools.partial(samplers.sample_ode, tr, model, method=method,
                                 num_steps=num_steps, **kw))
  return fn(standard_noise() if z is None else z)


# (method, steps, max per-sample error vs the exact flow, max relative variance error). Measured on
# CPU float32: euler/250 0.023 and 0.012; heun/50 3.6e-4 and 3.7e-4; dopri5 with the official
# rtol 1e-3 / atol 1e-6 0.021 and 0.016 (3 steps: the official tolerance is loose; torchdiffeq
# 0.2.5 takes the same steps and lands within 2e-5 of these samples).
ODE_CASES = [("euler", 250, 0.05, 0.03), ("heun", 50, 2e-3, 5e-3), ("dopri5", 50, 0.05, 0.04)]


@pytest.mark.parametrize("method,num_steps,max_err,var_tol", ODE_CASES)
def test_ode_maps_noise_to_data(method, num_steps, max_err, var_tol):
  z = standard_noise()
  x = run_ode(method, num_steps)
  assert x.shape == z.shape and x.dtype == z.dtype
  err = float(jnp.max(jnp.abs(x - exact_flow("linear", z, 0.0, 1.0))))
  mean_err, var_err = moments_error(x)
  assert err < max_err, err
  # The noise is standardised, so the exact image has exactly (mu, s^2): the moment errors are the
  # integrator's only. The mean path t mu has a constant velocity, so every method gets it exactly.
  assert mean_err < 1e-4 and var_err < var_tol, (mean_err, var_err)


def test_ode_heun_beats_euler_and_dopri5_converges():
  z = standard_noise()
  exact = exact_flow("linear", z, 0.0, 1.0)
  err = lambda x: float(jnp.max(jnp.abs(x - exact)))
  euler, heun = err(run_ode("euler", 10)), err(run_ode("heun", 10))
  assert heun < euler / 10, (heun, euler)  # measured 0.0088 against 0.60
  assert err(run_ode("dopri5", 2, rtol=1e-6, atol=1e-8)) < 1e-4  # measured 4.8e-6


def test_ode_trajectory():
  z = standard_noise(n=64)
  tr = T.Transport()
  for method, num_steps, tol in [("heun", 101, 1e-3), ("dopri5", 11, 1e-4)]:
    x, xs = jax.jit(functools.partial(samplers.sample_ode, tr, toy_velocity, method=method,
                                      num_steps=num_steps, return_trajectory=True, rtol=1e-6,
                                      atol=1e-8))(z)
    assert xs.shape == (num_steps,) + z.shape
    np.testing.assert_array_equal(xs[-1], x)
    np.testing.assert_allclose(xs[0], z, atol=1e-6)
    # The grid is linspace(0, 1, num_steps): the middle state is the exact flow at t = 0.5.
    np.testing.assert_allclose(xs[num_steps // 2], exact_flow("linear", z, 0.0, 0.5), atol=tol)


@pytest.mark.parametrize("path,prediction",
                         [("gvp", "noise"), ("linear", "score"), ("vp", "velocity")])
def test_ode_non_velocity_paths_use_eps_interval(path, prediction):
  # Upstream samples [t0, t1] = [eps, 1 - eps] (vp: [0, 1 - eps]); the ODE of a noise/score model
  # goes through the drift conversion and must follow the exact flow between those times.
  tr = T.Transport(path, prediction)
  t0, t1 = tr.interval(eval=True)
  index = T.PREDICTIONS.index(prediction)
  model = lambda x, t: toy_fields(path, x, t)[index]
  z = standard_noise(n=512)
  x = run_ode("heun", 200, z, tr=tr, model=model)
  np.testing.assert_allclose(x, exact_flow(path, z, t0, t1), atol=5e-4)  # measured <= 1.7e-4


# Moment tolerances of the SDE samplers (4096 samples, 8 dims, fixed seed): mean within
# 4 standard errors (s / sqrt(4096)) + 0.01, variance within 10% relative (the sampling SE of a
# variance is sqrt(2 / 4095) = 2.2%, the Mean last step at t = 0.96 biases it by up to -2% for
# s = 0.5). Measured (key 1): mean <= 1.9 SE for both methods, variance <= 3.5% (Euler) and
# 4.0% (Heun).
@pytest.mark.parametrize("method", samplers.SDE_METHODS)
def test_sde_maps_noise_to_data(method):
  z = standard_noise()
  fn = jax.jit(functools.partial(samplers.sample_sde, T.Transport(), toy_velocity, method=method,
                                 num_steps=250))
  x = fn(z, jax.random.key(1))
  assert x.shape == z.shape and bool(jnp.isfinite(x).all())
  mean_err = jnp.abs(x.mean(0) - MU)
  var_err = jnp.abs(x.var(0) / S ** 2 - 1)
  assert bool(jnp.all(mean_err < 4 * S / math.sqrt(N) + 0.01)), mean_err / (S / math.sqrt(N))
  assert float(var_err.max()) < 0.10, var_err
  # A different key gives different samples (the Brownian noise comes from the key).
  assert not np.allclose(fn(z, jax.random.key(2)), x)


def test_sde_last_steps_and_trajectory():
  tr = T.Transport()
  z, key = standard_noise(n=256), jax.random.key(3)
  sample = lambda **kw: jax.jit(functools.partial(samplers.sample_sde, tr, toy_velocity,
                                                  num_steps=20, **kw))(z, key)
  x, xs = sample(return_trajectory=True)
  assert xs.shape == (20,) + z.shape  # num_steps - 1 stochastic steps + the last step, as upstream
  np.testing.assert_array_equal(xs[-1], x)
  # The default last step ("Mean", h = 0.04) acts on the state at t1 = 0.96.
  x_t1 = xs[-2]
  t1 = jnp.full((z.shape[0],), 0.96)
  velocity, _, score = toy_fields("linear", x_t1, t1)
  w = 1 - bt(t1)  # diffusion "sigma" with norm 1
  np.testing.assert_allclose(x, x_t1 + 0.04 * (velocity + w * score), rtol=1e-4, atol=1e-4)
  last = functools.partial(samplers.sde_last_step, tr, toy_velocity, x_t1, 0.96)
  np.testing.assert_allclose(last(last_step="Euler"), x_t1 + 0.04 * velocity, rtol=1e-4, atol=1e-4)
  # Tweedie gives the posterior mean E[x1 | x_t] = mu + a s^2 / V (x - a mu) of the exact score.
  v_var = 0.96 ** 2 * S ** 2 + 0.04 ** 2
  tweedie = MU + 0.96 * S ** 2 / v_var * (x_t1 - 0.96 * MU)
  np.testing.assert_allclose(last(last_step="Tweedie"), tweedie, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(last(last_step=None), x_t1)
  # None: no last step and no last step size, so the grid runs to t1 = 1 - sample_eps = 1.
  x_none, xs_none = sample(last_step=None, return_trajectory=True)
  np.testing.assert_array_equal(xs_none[-1], xs_none[-2])
  assert bool(jnp.isfinite(x_none).all())


def test_samplers_errors():
  tr, z = T.Transport(), standard_noise(n=8)
  for call, field in [(lambda: samplers.sample_ode(tr, toy_velocity, z, method="rk4"), "method"),
                      (lambda: samplers.sample_ode(tr, toy_velocity, z, num_steps=1), "num_steps"),
                      (lambda: samplers.sample_sde(tr, toy_velocity, z, jax.random.key(0),
                                                   last_step="mode"), "last_step"),
                      (lambda: samplers.sample_sde(tr, toy_velocity, z, jax.random.key(0),
                                                   diffusion_form="cos"), "diffusion_form")]:
    with pytest.raises(ValueError, match=field):
      call()


def test_loops_are_scans_and_batch_shards():
  # The traced program does not grow with the number of steps (no Python loop over steps).
  tr, z, key = T.Transport(), standard_noise(n=64), jax.random.key(0)
  size = lambda n: len(jax.make_jaxpr(functools.partial(
      samplers.sample_sde, tr, toy_velocity, method="heun", num_steps=n))(z, key).eqns)
  assert size(10) == size(200)
  size_ode = lambda n: len(jax.make_jaxpr(functools.partial(
      samplers.sample_ode, tr, toy_velocity, method="heun", num_steps=n))(z).eqns)
  assert size_ode(10) == size_ode(200)
  # Sharding the batch over the 8 fake devices gives the same samples.
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  sharded = jax.device_put(z, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  fn = jax.jit(functools.partial(samplers.sample_sde, tr, toy_velocity, method="heun",
                                 num_steps=20))
  out = fn(sharded, key)
  np.testing.assert_allclose(out, fn(z, key), rtol=1e-5, atol=1e-5)
  assert out.sharding.is_equivalent_to(sharded.sharding, z.ndim)


# --------------------------------------------------------------------------------------------------
# Classifier-free guidance.

NULL = 10


def label_model(calls=None):
  """A conditional toy model (output shaped like x); records the batches it sees."""
  def fn(x, t, y):
    if calls is not None:
      calls.append((x.shape[0], y))
    scale = (1.0 + y.astype(jnp.float32))[:, None, None, None]
    return x * scale + bt(t) * jnp.arange(x.shape[-1], dtype=jnp.float32)
  return fn


def cfg_inputs(n=6):
  x = rand(40, (n, 2, 2, 4))  # 4 channels, like the SiT latents
  t = jnp.linspace(0.05, 0.95, n)
  y = jnp.arange(n) % 3
  return x, t, y


def test_cfg_scale_one_is_the_conditional_model():
  x, t, y = cfg_inputs()
  model = label_model()
  cond = model(x, t, y)
  np.testing.assert_array_equal(samplers.cfg_model_fn(model, 1.0, NULL)(x, t, y), cond)
  # A traced scale of 1 uses the doubled batch and still returns the conditional output exactly.
  traced = jax.jit(lambda s, x, t, y: samplers.cfg_model_fn(model, s, NULL, interval=(0.2, 0.8))(
      x, t, y))
  # (Compared with the jitted model: XLA may fuse the model's own arithmetic differently.)
  np.testing.assert_array_equal(traced(1.0, x, t, y), jax.jit(model)(x, t, y))
  # And in a sampler, scale 1 gives the unguided samples exactly.
  sample = lambda m: samplers.sample_ode(T.Transport(), m, x, {"y": y}, method="euler", num_steps=5)
  np.testing.assert_array_equal(sample(samplers.cfg_model_fn(model, 1.0, NULL)), sample(model))


@pytest.mark.parametrize("channels", [3, None])
def test_cfg_channel_rule(channels):
  x, t, y = cfg_inputs()
  calls = []
  model = label_model(calls)
  out = samplers.cfg_model_fn(model, 4.0, NULL, channels=channels)(x, t, y)
  # One model call on the doubled batch [x; x] with labels [y; null].
  assert len(calls) == 1 and calls[0][0] == 2 * x.shape[0]
  np.testing.assert_array_equal(calls[0][1], jnp.concatenate([y, jnp.full_like(y, NULL)]))
  cond, uncond = model(x, t, y), model(x, t, jnp.full_like(y, NULL))
  guided = uncond + 4.0 * (cond - uncond)
  k = 4 if channels is None else 3
  np.testing.assert_allclose(out[..., :k], guided[..., :k], rtol=1e-5, atol=1e-5)
  if channels == 3:
    np.testing.assert_array_equal(out[..., 3:], cond[..., 3:])  # official: channel 3 unguided
  assert not np.allclose(out[..., :3], cond[..., :3])


def test_cfg_interval_rule():
  x, t, y = cfg_inputs()  # t = 0.05, 0.23, 0.41, 0.59, 0.77, 0.95
  model = label_model()
  out = samplers.cfg_model_fn(model, 3.0, NULL, channels=None, interval=(0.2, 0.6))(x, t, y)
  cond, uncond = model(x, t, y), model(x, t, jnp.full_like(y, NULL))
  inside = np.array((t >= 0.2) & (t <= 0.6))
  assert inside.tolist() == [False, True, True, True, False, False]
  np.testing.assert_array_equal(out[~inside], cond[~inside])
  np.testing.assert_allclose(out[inside], (uncond + 3.0 * (cond - uncond))[inside], rtol=1e-5,
                             atol=1e-5)
  with pytest.raises(ValueError, match="interval"):
    samplers.cfg_model_fn(model, 3.0, NULL, interval=(0.6, 0.2))
  with pytest.raises(ValueError, match="channels"):
    samplers.cfg_model_fn(model, 3.0, NULL, channels=0)
