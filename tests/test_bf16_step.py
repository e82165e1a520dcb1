"""One training step with ``model.dtype=bfloat16`` (the GPU and TPU configs' compute dtype) on CPU:
parameters and optimizer state stay float32, gradients are finite, and loss and gradient norm
are those of float32 within bfloat16's rounding, for MAE and SiT from the same parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.train import setup
from decay_jax.train import step as step_lib
from testing_configs import load_config, override

# bfloat16 keeps 8 significant bits (relative rounding 2^-8 = 0.4%) in the branches' matmuls; the
# residual stream, LayerNorm and the loss are float32 (models/layers.py).
LOSS_RTOL = 0.02
GRAD_NORM_RTOL = 0.05


def one_step(name, dtype):
  c = load_config(name)
  override(c, **{"model.preset": "micro/4", "model.dtype": dtype, "data.image_size": 16,
                 "batch_size": 8, "mesh.data": 1, "warmup_epochs": 0.0})
  s = setup.build(c)
  info, task, tx, schedule = s.info, s.task, s.tx, s.schedule
  state = s.init_state()
  rng = np.random.default_rng(0)
  batch = {"image": rng.standard_normal((8, 16, 16, info["channels"])).astype(np.float32),
           "label": rng.integers(0, 10, 8).astype(np.int32)}
  step = jax.jit(step_lib.make_train_step(task, tx, schedule))
  new_state, metrics = step(state, batch)
  return state, new_state, jax.device_get(metrics)


@pytest.mark.parametrize("name", ["mae_cpu_mnist", "sit_cpu_mnist"])
def test_bfloat16_step_keeps_float32_state_and_matches_float32(name):
  init32, after32, m32 = one_step(name, "float32")
  init16, after16, m16 = one_step(name, "bfloat16")
  # Same seed, same float32 initial parameters: only the compute dtype differs.
  for a, b in zip(jax.tree_util.tree_leaves(init32["params"]),
                  jax.tree_util.tree_leaves(init16["params"])):
    np.testing.assert_array_equal(a, b)
  for tree in (after16["params"], after16["opt_state"]):
    floats = [l for l in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(l.dtype, jnp.floating)]
    assert floats and all(l.dtype == jnp.float32 for l in floats)
  assert all(np.isfinite(v) for v in m16.values())
  assert m16["grad_norm"] > 0
  assert m16["loss"] == pytest.approx(m32["loss"], rel=LOSS_RTOL)
  assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=GRAD_NORM_RTOL)
  # bfloat16 did change the computation. (The loss at initialisation is the targets' energy:
  # predictions start near zero, so it can agree to the last bit.)
  assert m16["grad_norm"] != m32["grad_norm"] and m16["update_norm"] != m32["update_norm"]


def loss_curve(dtype, steps=60):
  """Losses of ``steps`` training steps of the demo MAE (micro size, 16-pixel digits from the
  embedded data through the training pipeline), same seed and batches for every dtype."""
  from decay_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  c = load_config("mae_cpu_mnist")
  override(c, **{"model.preset": "micro/4", "model.dtype": dtype, "data.image_size": 16,
                 "batch_size": 64, "mesh.data": 1, "warmup_epochs": 0.0})
  s = setup.build(c)
  state = s.init_state()
  stream = pipeline.make_train_iterator(c.data, c.batch_size, c.seed, mesh=s.mesh)
  step = jax.jit(step_lib.make_train_step(s.task, s.tx, s.schedule))
  losses = []
  for _ in range(steps):
    state, metrics = step(state, next(stream))
    losses.append(float(metrics["loss"]))
  stream.close()
  return np.asarray(losses)


def test_bfloat16_training_loss_falls_like_float32():
  """bfloat16 compute (the TPU configs' dtype; float32 parameters, residual stream and loss)
  trains the demo MAE as float32 does: the same falling curve, step for step."""
  l32, l16 = loss_curve("float32"), loss_curve("bfloat16")
  for losses in (l32, l16):
    assert losses[-10:].mean() < 0.93 * losses[:5].mean(), losses  # 0.649 -> 0.585
  assert l16[-10:].mean() == pytest.approx(l32[-10:].mean(), rel=0.02)
  assert np.max(np.abs(l16 - l32) / l32) < 0.05, np.abs(l16 - l32) / l32
