"""Attention padded to the lengths cuDNN's kernel takes equals the unpadded attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.models import layers


def _reference(q, k, v):
  """numpy softmax attention, (N, T, H, D) in and out, float64."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  logits = np.einsum("nthd,nshd->nhts", q, k) / np.sqrt(q.shape[-1])
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return np.einsum("nhts,nshd->nthd", w, v)


@pytest.mark.parametrize("tokens, multiple", [(197, 2), (50, 64), (5, 8), (6, 2)])
def test_padded_attention_equals_unpadded_forward_and_gradient(tokens, multiple):
  keys = jax.random.split(jax.random.PRNGKey(tokens), 4)
  q, k, v = (jax.random.normal(r, (2, tokens, 3, 8)) for r in keys[:3])
  cotangent = jax.random.normal(keys[3], (2, tokens, 3, 8))

  def loss(q, k, v, multiple):
    return jnp.sum(layers.attend(q, k, v, "xla", multiple) * cotangent)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
  plain = jax.jit(layers.attend, static_argnums=(3, 4))(q, k, v, "xla", 1)
  padded = jax.jit(layers.attend, static_argnums=(3, 4))(q, k, v, "xla", multiple)
  assert padded.shape == plain.shape == (2, tokens, 3, 8)
  np.testing.assert_allclose(plain, _reference(q, k, v), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(padded, plain, rtol=1e-5, atol=1e-6)
  g_plain, g_padded = grad(q, k, v, 1), grad(q, k, v, multiple)
  for a, b in zip(g_padded, g_plain):
    assert np.isfinite(np.asarray(a)).all()
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_cudnn_pads_odd_token_counts_only():
  q = jnp.ones((1, 197, 2, 8), jnp.bfloat16)
  text = jax.jit(lambda q: layers.attend(q, q, q, "xla", layers.CUDNN_TOKEN_MULTIPLE)).lower(
      q).as_text()
  assert "198" in text  # padded to 198 tokens
  even = jax.jit(lambda q: layers.attend(q, q, q, "xla", 1)).lower(q[:, :196]).as_text()
  assert "198" not in even and "197" not in even


def test_cudnn_is_chosen_for_any_token_count_on_a_gpu(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert layers.resolve_attention(None, jnp.bfloat16, 197, 64) == "cudnn"  # MAE's decoder
  assert layers.resolve_attention(None, jnp.bfloat16, 50, 64) == "cudnn"  # its encoder
  assert layers.resolve_attention(None, jnp.float32, 197, 64) is None
