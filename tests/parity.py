"""Helpers shared by the parity tests."""

import jax.numpy as jnp
import numpy as np


def nhwc(x):
  """PyTorch NCHW array -> JAX NHWC array."""
  return jnp.asarray(np.asarray(x).transpose(0, 2, 3, 1))


def assert_grads_match(checks, torch_grads, rtol):
  """Each Flax gradient (already in torch layout) equals torch's to ``rtol`` x its max entry."""
  for key, got in checks.items():
    want = torch_grads[key]
    scale = np.abs(want).max()
    assert scale > 0, key  # a zero gradient would make the comparison vacuous
    np.testing.assert_allclose(np.asarray(got), want, atol=rtol * scale, rtol=0, err_msg=key)
