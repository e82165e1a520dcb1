"""U-ViT's VP schedules (vp.py) and samplers (dpm_solver.py): spec values, step plans, Gaussian toy.

The Gaussian toy: data ``x0 ~ N(mu, diag(s^2))`` (8 dims, NHWC ``(2, 2, 2)``) and
``x_t = a_t x0 + sigma_t eps`` with ``a_t = sqrt(alpha_bar(t))``, ``sigma_t = sqrt(1 - a_t^2)``.
Then ``x_t ~ N(a mu, V)`` with ``V = a^2 s^2 + sigma^2`` per dimension, and the exact noise
predictor is the Gaussian conditional mean ``E[eps | x_t] = sigma_t (x - a_t mu) / V_t``.
The probability-flow ODE maps every x_T affinely,
``x_t = a_t mu + sqrt(V_t / V_T) (x_T - a_T mu)``, which is the per-sample reference for the
deterministic samplers (at their own end time t_end, and at t = 0 for the Euler ODE).
Everything here (schedules, tables, lambda grids) is written again from the formulas, not taken
from the module.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.diffusion import dpm_solver as D
from decay_jax.diffusion import vp

SHAPE = (2, 2, 2)
MU = np.linspace(-1.5, 2.0, 8).reshape(SHAPE)
S = np.linspace(0.5, 1.2, 8).reshape(SHAPE)
N_TOY = 128

# Independent float64 tables of the discrete SD schedule.
BETAS = np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000) ** 2
ALPHA_BAR = np.cumprod(1 - BETAS)                       # alpha_bar_1 .. alpha_bar_1000
KNOTS = np.arange(1, 1001) / 1000.0                      # t = n / N
HALF_LOG_AB = 0.5 * np.log(ALPHA_BAR)                    # log alpha at the knots


def vp_alpha_bar(t):
  """Continuous VPSDE: ``exp(-(0.1 t + 9.95 t^2))``."""
  return np.exp(-(0.1 * t + 9.95 * t ** 2))


def vp_lambda(t):
  ab = vp_alpha_bar(t)
  return 0.5 * np.log(ab / (1 - ab))


def discrete_lambda(t):
  log_a = np.interp(t, KNOTS, HALF_LOG_AB)
  return log_a - 0.5 * np.log(-np.expm1(2 * log_a))


def inverse_by_bisection(fn, lam, lo, hi, iters=200):
  """t in [lo, hi] with fn(t) = lam for a decreasing fn (float64, elementwise)."""
  lo, hi = np.full_like(lam, lo), np.full_like(lam, hi)
  for _ in range(iters):
    mid = 0.5 * (lo + hi)
    above = fn(mid) > lam
    lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
  return 0.5 * (lo + hi)


# --------------------------------------------------------------------------------------------------
# (a) schedule values.

def test_vpsde_spec_values_and_round_trip():
  sde = vp.VPSDE()
  ab = np.asarray(sde.alpha_bar(jnp.asarray([0.01, 0.1, 1.0])))
  assert abs(ab[0] - 0.998007) < 5e-7
  assert abs(ab[1] - 0.896282) < 5e-7
  assert abs(ab[2] - 4.3186e-5) < 5e-10
  t = jnp.asarray(np.geomspace(1e-4, 1.0, 41), jnp.float32)
  np.testing.assert_allclose(sde.alpha_bar(t), vp_alpha_bar(np.asarray(t, np.float64)), rtol=2e-6)
  np.testing.assert_allclose(sde.marginal_lambda(t), vp_lambda(np.asarray(t, np.float64)),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(sde.inverse_lambda(sde.marginal_lambda(t)), t, rtol=2e-5)
  np.testing.assert_allclose(sde.marginal_std(t) ** 2 + sde.marginal_alpha(t) ** 2, 1, atol=1e-6)
  np.testing.assert_allclose(sde.beta(jnp.asarray([0.0, 0.5, 1.0])), [0.1, 10.05, 20.0], rtol=1e-6)
  np.testing.assert_allclose(sde.net_time(t), 999 * t, rtol=1e-6)
  times = sde.sample_time(jax.random.PRNGKey(0), 4096)
  assert times.shape == (4096,) and float(times.min()) >= 0 and float(times.max()) < 1


def test_discrete_spec_values_and_interpolation():
  sched = vp.DiscreteVP()
  assert abs(float(sched.alpha_bar(1000)) - 0.004660) < 5e-7
  assert float(sched.alpha_bar(0)) == 1.0
  n = jnp.asarray([1, 2, 250, 999, 1000])
  np.testing.assert_allclose(sched.alpha_bar(n), ALPHA_BAR[np.asarray(n) - 1], rtol=1e-6)
  # On the knots n / N the interpolated alpha_t^2 is alpha_bar_n; between them log alpha is linear.
  np.testing.assert_allclose(sched.marginal_alpha(n / 1000.0) ** 2, ALPHA_BAR[np.asarray(n) - 1],
                             rtol=1e-5)
  t = jnp.asarray(np.linspace(0.001, 1.0, 97), jnp.float32)
  np.testing.assert_allclose(sched.marginal_log_mean_coeff(t),
                             np.interp(np.asarray(t, np.float64), KNOTS, HALF_LOG_AB),
                             rtol=1e-5, atol=1e-7)
  # Linear extension past the first knot (upstream interpolate_fn), not clamping.
  slope = (HALF_LOG_AB[1] - HALF_LOG_AB[0]) * 1000
  np.testing.assert_allclose(sched.marginal_log_mean_coeff(0.0), HALF_LOG_AB[0] - slope / 1000,
                             rtol=0, atol=1e-10)
  np.testing.assert_allclose(sched.inverse_lambda(sched.marginal_lambda(t)), t, rtol=1e-4,
                             atol=1e-6)
  np.testing.assert_allclose(sched.net_time(t), 1000 * t, rtol=1e-6)
  steps = sched.sample_time(jax.random.PRNGKey(0), 8192)
  assert steps.dtype == jnp.int32 and int(steps.min()) == 1 and int(steps.max()) == 1000


# --------------------------------------------------------------------------------------------------
# (b) the step plans.

def test_fast_orders():
  assert D.fast_orders(50) == [3] * 16 + [2]
  assert D.fast_orders(49) == [3] * 16 + [1]
  assert D.fast_orders(48) == [3] * 15 + [2, 1]
  assert D.fast_orders(10) == [3, 3, 3, 1]
  assert D.fast_orders(7, order=2) == [2, 2, 2, 1]
  for nfe in range(1, 61):
    assert sum(D.fast_orders(nfe)) == nfe and sum(D.fast_orders(nfe, 2)) == nfe
  with pytest.raises(ValueError):
    D.fast_orders(50, order=1)


def test_dpm_solver_fast_plan_is_logsnr_uniform():
  plan = D.dpm_solver_fast_plan(vp.VPSDE(), nfe=50, t_start=1.0, t_end=1e-4)
  assert plan.orders == tuple([3] * 16 + [2])
  lam = np.linspace(vp_lambda(1.0), vp_lambda(1e-4), 18)
  ts = inverse_by_bisection(vp_lambda, lam, 0.0, 1.0)
  np.testing.assert_allclose(plan.s, ts[:-1], rtol=2e-5)
  np.testing.assert_allclose(plan.t, ts[1:], rtol=2e-5)
  np.testing.assert_allclose(plan.r1, [1 / 3] * 16 + [0.5], rtol=1e-7)
  np.testing.assert_allclose(plan.r2[:16], 2 / 3, rtol=1e-7)


def test_dpm_solver_pp_plan_spans_grid_intervals():
  plan = D.dpm_solver_pp_plan(vp.DiscreteVP(), steps=50, order=3, t_start=1.0, t_end=1e-3)
  assert plan.orders == tuple([3] * 16 + [2])
  grid = np.linspace(1.0, 1e-3, 51)
  starts, ends = np.arange(0, 49, 3), np.append(np.arange(3, 49, 3), 50)
  np.testing.assert_allclose(plan.s, grid[starts], rtol=1e-6)
  np.testing.assert_allclose(plan.t, grid[ends], rtol=1e-5)
  lam = discrete_lambda(grid)
  h = lam[ends] - lam[starts]
  np.testing.assert_allclose(plan.r1, (lam[starts + 1] - lam[starts]) / h, rtol=1e-4)
  np.testing.assert_allclose(plan.r2[:16], ((lam[starts + 2] - lam[starts]) / h)[:16], rtol=1e-4)
  log_plan = D.dpm_solver_pp_plan(vp.VPSDE(), steps=9, skip_type="logSNR", t_end=1e-4)
  assert log_plan.orders == (3, 3, 2, 1)                 # 9 % 3 == 0
  lam9 = np.linspace(vp_lambda(1.0), vp_lambda(1e-4), 10)
  ts9 = inverse_by_bisection(vp_lambda, lam9, 0.0, 1.0)
  np.testing.assert_allclose(log_plan.t, ts9[[3, 6, 8, 9]], rtol=2e-5)
  np.testing.assert_allclose(log_plan.r1[:3], [1 / 3, 1 / 3, 1 / 2], rtol=1e-4)  # lambda-uniform


# --------------------------------------------------------------------------------------------------
# (c) the Gaussian toy.

def toy_alpha(kind, t):
  """a_t (jnp, float32) of the two schedules, written from the formulas."""
  if kind == "vp":
    return jnp.exp(-0.5 * (0.1 * t + 9.95 * t ** 2))
  return jnp.exp(jnp.interp(t, jnp.asarray(KNOTS, t.dtype), jnp.asarray(HALF_LOG_AB, t.dtype)))


def toy_eps_model(kind):
  """Exact noise predictor ``sigma (x - a mu) / (a^2 s^2 + sigma^2)`` fed with the network time."""
  scale = 999.0 if kind == "vp" else 1000.0

  def model_fn(x, t_net):
    a = toy_alpha(kind, t_net / scale)[:, None, None, None]
    var = a ** 2 * S ** 2 + 1 - a ** 2
    return jnp.sqrt(1 - a ** 2) * (x - a * MU) / var
  return model_fn


def exact_flow(kind, x_T, t_end):
  """The probability-flow ODE solution at t_end from x_T at t = 1."""
  a_T, a_e = toy_alpha(kind, jnp.float32(1.0)), toy_alpha(kind, jnp.float32(t_end))
  var_T, var_e = a_T ** 2 * S ** 2 + 1 - a_T ** 2, a_e ** 2 * S ** 2 + 1 - a_e ** 2
  return a_e * MU + jnp.sqrt(var_e / var_T) * (x_T - a_T * MU)


@pytest.fixture(scope="module")
def x_T():
  return jax.random.normal(jax.random.PRNGKey(0), (N_TOY,) + SHAPE)


def toy_error(sampler, kind, x, t_end, **static):
  schedule = vp.VPSDE() if kind == "vp" else vp.DiscreteVP()
  fn = jax.jit(functools.partial(sampler, toy_eps_model(kind), schedule=schedule, **static))
  return float(jnp.max(jnp.abs(fn(x) - exact_flow(kind, x, t_end))))


def test_dpm_solver_fast_matches_exact_flow(x_T):
  """U-ViT's pixel sampler: 50 NFE from t = 1 to 1e-4; the error falls fast with the NFE."""
  errors = [toy_error(D.dpm_solver_fast, "vp", x_T, 1e-4, nfe=n) for n in (12, 24, 50)]
  assert errors[2] < 3e-3, errors                      # measured 1.4e-3 (max over 1024 values)
  assert errors[0] > 5 * errors[1] > 25 * errors[2], errors


def test_dpm_solver_pp_matches_exact_flow(x_T):
  """U-ViT's discrete latent sampler: time-uniform 'fast' grid, t from 1 to 1/1000.

  On a time-uniform grid the intermediate ratios are not (1/3, 2/3) and the last interval spans a
  large lambda step near t = 1e-3, so it converges slowly (as upstream does); on a lambda-uniform
  grid the same solver is far more accurate.
  """
  errors = [toy_error(D.dpm_solver_pp, "discrete", x_T, 1e-3, steps=n) for n in (24, 50, 100)]
  assert errors[1] < 5e-2, errors                      # measured 2.5e-2
  assert errors[0] > 2 * errors[1] > 3 * errors[2], errors
  log_error = toy_error(D.dpm_solver_pp, "discrete", x_T, 1e-3, steps=50, skip_type="logSNR")
  assert log_error < 1e-3, log_error                   # measured 1.3e-4


def test_euler_ode_converges(x_T):
  errors = [toy_error(D.euler_maruyama, "vp", x_T, 0.0, rng=None, steps=n, ode=True)
            for n in (250, 1000)]
  assert errors[1] < 3e-3, errors                      # measured 1.2e-3
  assert errors[0] > 3 * errors[1], errors             # first order: 4x the steps, ~4x less error


def test_euler_sde_statistics():
  n = 4096
  sde = vp.VPSDE()
  fn = jax.jit(functools.partial(D.euler_maruyama, toy_eps_model("vp"), schedule=sde, steps=500))
  x = fn(jax.random.normal(jax.random.PRNGKey(1), (n,) + SHAPE), rng=jax.random.PRNGKey(2))
  mean, std = np.asarray(x.mean(0)), np.asarray(x.std(0))
  assert np.all(np.abs(mean - MU) < 5 * S / math.sqrt(n)), mean - MU
  assert np.all(np.abs(std / S - 1) < 0.05), std / S


def test_euler_sde_last_step_is_noise_free():
  """One step (grid [0, 1e-3]) is the noise-free last step: the rng does not matter."""
  x = jax.random.normal(jax.random.PRNGKey(3), (4,) + SHAPE)
  run = lambda key: D.euler_maruyama(toy_eps_model("vp"), x, vp.VPSDE(), key, 1)
  np.testing.assert_array_equal(run(jax.random.PRNGKey(0)), run(jax.random.PRNGKey(1)))


# --------------------------------------------------------------------------------------------------
# (d) loss and CFG.

def toy_net(x, t_net):
  return 0.5 * x + 1e-3 * t_net[:, None, None, None]


@pytest.mark.parametrize("kind", ["vp", "discrete"])
def test_loss_matches_hand_computation(kind):
  x0 = np.random.RandomState(0).randn(3, 4, 4, 2).astype(np.float32)
  eps = np.random.RandomState(1).randn(3, 4, 4, 2).astype(np.float32)
  if kind == "vp":
    sched, t = vp.VPSDE(), np.asarray([0.0, 0.3, 0.9], np.float32)
    ab, t_net = vp_alpha_bar(t.astype(np.float64)), 999.0 * t
  else:
    sched, t = vp.DiscreteVP(), np.asarray([1, 500, 1000], np.int32)
    ab, t_net = ALPHA_BAR[t - 1], t.astype(np.float64)
  ab = ab[:, None, None, None]
  x_t = np.sqrt(ab) * x0 + np.sqrt(1 - ab) * eps
  per_example = np.mean((eps - (0.5 * x_t + 1e-3 * t_net[:, None, None, None])) ** 2,
                        axis=(1, 2, 3))
  np.testing.assert_allclose(sched.perturb(x0, eps, t), x_t, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sched.per_example_loss(toy_net, x0, eps, t), per_example, rtol=1e-5)
  np.testing.assert_allclose(sched.loss(toy_net, x0, eps, t), per_example.mean(), rtol=1e-5)


def test_cfg_eps():
  def model_fn(x, t, y):
    return x * (y + 1.0)[:, None, None, None] + t[:, None, None, None]
  x = jax.random.normal(jax.random.PRNGKey(0), (3,) + SHAPE)
  t, y = jnp.asarray([1.0, 500.0, 999.0]), jnp.asarray([0, 3, 7])
  cond, uncond = model_fn(x, t, y), model_fn(x, t, jnp.full((3,), 10))
  np.testing.assert_allclose(D.cfg_eps(model_fn, 0.4, 10)(x, t, y=y),
                             cond + 0.4 * (cond - uncond), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(D.cfg_eps(model_fn, 0, 10)(x, t, y=y), cond)
