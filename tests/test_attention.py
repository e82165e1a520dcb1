"""Attention padded to the lengths cuDNN's kernel takes equals the unpadded attention."""

import jax
from jax import ad_checkpoint
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


def test_einsum_attention_equals_xla_forward_and_gradient():
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v = (jax.random.normal(r, (2, 50, 3, 8)) for r in keys[:3])
  cotangent = jax.random.normal(keys[3], (2, 50, 3, 8))
  loss = lambda impl: jax.grad(lambda q, k, v: jnp.sum(layers.attend(q, k, v, impl) * cotangent),
                               argnums=(0, 1, 2))
  np.testing.assert_allclose(layers.attend(q, k, v, "einsum"), _reference(q, k, v), rtol=1e-5,
                             atol=1e-5)
  for a, b in zip(loss("einsum")(q, k, v), loss("xla")(q, k, v)):
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


def test_tpu_traces_the_heads_major_einsum():
  """A program traced for a TPU (``target_platform``, as the ahead-of-time compile for a slice
  does on a CPU host) takes the einsum attention; an explicit choice stays; outside, this host's."""
  with layers.target_platform("tpu"):
    assert layers.platform() == "tpu"
    assert layers.resolve_attention(None, jnp.bfloat16, 197, 32) == "einsum"
    assert layers.resolve_attention(None, jnp.float32, 50, 64) == "einsum"
    assert layers.resolve_attention("xla", jnp.bfloat16, 50, 64) == "xla"
  assert layers.platform() == jax.default_backend() == "cpu"
  assert layers.resolve_attention(None, jnp.bfloat16, 197, 32) is None


@pytest.fixture(scope="module")
def micro_mae():
  from decay_jax.models import mae as mae_lib
  x = jax.random.uniform(jax.random.PRNGKey(0), (2, 16, 16, 1))
  params = mae_lib.mae("micro/4", img_size=16, in_chans=1).init(
      {"params": jax.random.PRNGKey(1), "masking": jax.random.PRNGKey(2)}, x)["params"]
  return x, params


def _loss(policy, x):
  from decay_jax.models import mae as mae_lib
  model = mae_lib.mae("micro/4", img_size=16, in_chans=1, remat_policy=policy)
  return lambda p: model.apply({"params": p}, x, rngs={"masking": jax.random.PRNGKey(2)})["loss"]


def test_dots_context_saves_the_attention_output_and_keeps_the_gradient(micro_mae, capsys):
  x, params = micro_mae
  saved = {}
  for policy in ("dots", "dots_context"):
    ad_checkpoint.print_saved_residuals(_loss(policy, x), params)
    saved[policy] = capsys.readouterr().out
  # the encoder's attention outputs, (depth 4, N 2, 5 visible tokens, 2 heads, head dim 16), leave
  # the scan over blocks as residuals only under dots_context
  context = "f32[4,2,5,2,16] output of scan"
  assert context not in saved["dots"] and context in saved["dots_context"]
  g_none = jax.jit(jax.grad(_loss("none", x)))(params)
  g_ctx = jax.jit(jax.grad(_loss("dots_context", x)))(params)
  for a, b in zip(jax.tree.leaves(g_ctx), jax.tree.leaves(g_none)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
