"""Shared Flax Linen layers: attention, MLP, patch embedding, sin-cos tables, initialisers.

Parameter names mirror the official PyTorch modules (``attn.qkv``, ``mlp.fc1`` ...) so that the
converter is a table, not a translation. Layouts: tokens are ``(N, T, C)``, images ``(N, H, W, C)``.

Precision: parameters are float32; ``dtype`` is the compute dtype of the matmuls. LayerNorm always
computes in float32 and the residual stream stays float32 (docs/official_code.md 1.11), so a bfloat16
model differs from the float32 one only inside the branches.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Iterator, Optional

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np

Dtype = Any

ATTENTION_IMPLS = (None, "xla", "cudnn", "einsum")
# cuDNN flash attention has kernels for these compute dtypes only.
CUDNN_DTYPES = ("bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_context")

xavier_uniform = nn.initializers.xavier_uniform()
zeros = nn.initializers.zeros


def patch_kernel_init(key, shape, dtype=jnp.float32):
  """xavier_uniform on the 2-D view ``(out, in*kh*kw)`` of a patch-embedding conv kernel.

  PyTorch's official init views the conv weight as a Linear (docs/official_code.md 1.3), so the bound is
  ``sqrt(6 / (in*kh*kw + out))``; Flax's conv xavier would fold the receptive field into fan_out too.
  ``shape`` is the Flax kernel shape ``(kh, kw, in, out)``.
  """
  kh, kw, cin, cout = shape
  bound = math.sqrt(6.0 / (kh * kw * cin + cout))
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def torch_conv_bias_init(fan_in: int):
  """PyTorch's default Conv2d bias init U(+-1/sqrt(fan_in)), kept by the official MAE."""
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


def normal(std: float):
  """Plain (not truncated) normal, as torch ``normal_(std=...)``."""
  return lambda key, shape, dtype=jnp.float32: std * jax.random.normal(key, shape, dtype)


def sincos_1d(embed_dim: int, pos: np.ndarray) -> np.ndarray:
  """``[sin(p w_i), cos(p w_i)]`` with ``w_i = 10000^(-i / (E/2))``; float64, shape (len(pos), E)."""
  if embed_dim % 2:
    raise ValueError(f"embed_dim={embed_dim} must be even for a sin-cos embedding")
  omega = 1.0 / 10000 ** (np.arange(embed_dim // 2, dtype=np.float64) / (embed_dim / 2.0))
  out = np.einsum("m,d->md", pos.reshape(-1).astype(np.float64), omega)
  return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def sincos_2d(embed_dim: int, grid_size: int, cls_token: bool = False) -> np.ndarray:
  """Fixed 2-D sin-cos position table, float32 ``(grid**2 [+1], embed_dim)`` (official 1.12).

  Token ``n = row * grid + col``; the first half of the channels encodes the column, the second the
  row; with ``cls_token`` a zero row is prepended.
  """
  if embed_dim % 4:
    raise ValueError(f"embed_dim={embed_dim} must be a multiple of 4 for a 2-D sin-cos embedding")
  rows, cols = np.meshgrid(np.arange(grid_size), np.arange(grid_size), indexing="ij")
  emb = np.concatenate([sincos_1d(embed_dim // 2, cols), sincos_1d(embed_dim // 2, rows)], axis=1)
  if cls_token:
    emb = np.concatenate([np.zeros((1, embed_dim)), emb], axis=0)
  return emb.astype(np.float32)


# The platform a program is traced for, where it is not this process's default backend: the
# ahead-of-time compile for a TPU slice or GPU host on a CPU machine (``perf.tpu``) sets it, so
# the attention chosen is the one the target would run.
_TARGET_PLATFORM: contextvars.ContextVar = contextvars.ContextVar("target_platform", default=None)


@contextlib.contextmanager
def target_platform(platform: Optional[str]) -> Iterator[None]:
  """Trace for ``platform`` ('tpu', 'gpu', 'cpu'; None: the default backend) inside the block."""
  token = _TARGET_PLATFORM.set(platform)
  try:
    yield
  finally:
    _TARGET_PLATFORM.reset(token)


def platform() -> str:
  """The platform programs are traced for: ``target_platform``'s, else the default backend."""
  return _TARGET_PLATFORM.get() or jax.default_backend()


def resolve_attention(implementation: Optional[str], dtype, tokens: int, head_dim: int
                      ) -> Optional[str]:
  """The attention kernel for ``tokens`` x ``head_dim`` heads: ``implementation`` where given;
  where None, cuDNN flash attention on a GPU backend for bfloat16/float16 compute and head dims its
  kernel takes (a multiple of 8 up to 128), for any token count (``attend`` pads odd ones); on
  TPUs the heads-major einsum (``einsum_attention``, which XLA:TPU's cost model puts cheaper than
  XLA's ``dot_product_attention`` for MAE and SiT: docs/tpu.md); XLA's otherwise (None).

  An execution choice, not part of the model: both compute the same softmax attention.
  """
  del tokens  # any count: attend() pads what the kernel refuses
  if implementation is not None:
    return implementation
  if (platform() == "gpu" and jnp.dtype(dtype).name in CUDNN_DTYPES
      and head_dim % 8 == 0 and head_dim <= 128):
    return "cudnn"
  if platform() == "tpu":
    return "einsum"
  return None


# JAX 0.10-0.11 (jax/_src/cudnn/fused_attention_stablehlo.py) replace a missing bias by an empty
# array before the training rule checks ``bias is not None``, so its "with a bias, even sequence
# lengths" rule applies to every cuDNN training call: odd T raises NotImplementedError.
CUDNN_TOKEN_MULTIPLE = 2


def attend(q, k, v, implementation: Optional[str] = None, multiple: Optional[int] = None):
  """``softmax(q k^T / sqrt(D)) v`` per head: ``q, k, v, out (N, T, H, D)``.

  The token axis is zero-padded to a multiple of ``multiple`` (default: 2 for cuDNN, else 1) and
  ``jax.nn.dot_product_attention`` gets the true length ``T`` as ``query_seq_lengths`` and
  ``key_value_seq_lengths``: padded keys are masked out of every softmax, padded query rows are
  dropped, so the result (and its gradient) is that of the unpadded attention.
  """
  if implementation == "einsum":
    return einsum_attention(q, k, v)
  t = q.shape[1]
  if multiple is None:
    multiple = CUDNN_TOKEN_MULTIPLE if implementation == "cudnn" else 1
  pad = -t % multiple
  if not pad:
    return jax.nn.dot_product_attention(q, k, v, implementation=implementation)
  widths = ((0, 0), (0, pad), (0, 0), (0, 0))
  q, k, v = (jnp.pad(a, widths) for a in (q, k, v))
  lengths = jnp.full((q.shape[0],), t, jnp.int32)
  out = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=lengths,
                                     key_value_seq_lengths=lengths, implementation=implementation)
  return out[:, :t]


def einsum_attention(q, k, v):
  """The official MAE/SiT ``Attention`` written out, heads-major: ``(q k^T) D^-1/2``, softmax in
  float32, ``@ v``; ``(N, T, H, D)`` in and out. ``attention_impl='einsum'``: the same numbers as
  XLA's ``dot_product_attention`` in another op order (for CPU comparisons)."""
  logits = jnp.einsum("nthd,nshd->nhts", q, k) * (q.shape[-1] ** -0.5)
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
  return jnp.einsum("nhts,nshd->nthd", weights, v)


def layer_norm(name: Optional[str] = None, affine: bool = True, eps: float = 1e-6) -> nn.LayerNorm:
  """LayerNorm (eps 1e-6 as timm's ViTs; U-ViT keeps torch's 1e-5) computed in float32 (two-pass
  variance, as torch)."""
  return nn.LayerNorm(epsilon=eps, use_bias=affine, use_scale=affine, dtype=jnp.float32,
                      use_fast_variance=False, name=name)


class Attention(nn.Module):
  """Multi-head self-attention with packed qkv (timm layout), through ``jax.nn.dot_product_attention``.

  The ``3C`` qkv outputs are ``[q | k | v]``, each split head-major into contiguous ``C/H`` chunks;
  softmax scale ``(C/H)^-1/2``; no mask, no dropout (docs/official_code.md 1.5).
  Input and output ``(N, T, C)``. ``implementation`` None chooses per shape (``resolve_attention``).
  ``qkv_bias`` and ``qkv_init`` default to MAE/SiT's (bias, xavier); U-ViT has no qkv bias and
  N(0, 0.02^2) weights.
  """
  num_heads: int
  dtype: Dtype = jnp.float32
  proj_init: Callable = xavier_uniform
  implementation: Optional[str] = None
  qkv_bias: bool = True
  qkv_init: Callable = xavier_uniform

  @nn.compact
  def __call__(self, x):
    n, t, c = x.shape
    qkv = nn.Dense(3 * c, use_bias=self.qkv_bias, dtype=self.dtype, kernel_init=self.qkv_init,
                   bias_init=zeros, name="qkv")(x)
    qkv = qkv.reshape(n, t, 3, self.num_heads, c // self.num_heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    # The keys, heads concatenated (N, T, C), kept only when an apply makes 'keys' mutable
    # (segmentation's key features, as deep spectral methods read them from the qkv output);
    # never at init, whose variables would otherwise hold them.
    if self.is_mutable_collection("keys") and not self.is_initializing():
      self.sow("keys", "k", k.reshape(n, t, c))
    impl = resolve_attention(self.implementation, self.dtype, t, c // self.num_heads)
    out = checkpoint_name(attend(q, k, v, impl), "context")
    return nn.Dense(c, dtype=self.dtype, kernel_init=self.proj_init, bias_init=zeros,
                    name="proj")(out.reshape(n, t, c))


class Mlp(nn.Module):
  """fc1 -> GELU -> fc2 (timm Mlp). ``approximate_gelu`` selects tanh (SiT) or exact erf (MAE,
  U-ViT); ``fc1_init`` / ``fc2_init`` the kernels' init (biases start at zero)."""
  hidden: int
  approximate_gelu: bool
  dtype: Dtype = jnp.float32
  fc2_init: Callable = xavier_uniform
  fc1_init: Callable = xavier_uniform

  @nn.compact
  def __call__(self, x):
    c = x.shape[-1]
    h = nn.Dense(self.hidden, dtype=self.dtype, kernel_init=self.fc1_init, bias_init=zeros,
                 name="fc1")(x)
    h = nn.gelu(h, approximate=self.approximate_gelu)
    return nn.Dense(c, dtype=self.dtype, kernel_init=self.fc2_init, bias_init=zeros, name="fc2")(h)


class PatchEmbed(nn.Module):
  """Non-overlapping ``p x p`` patches of an ``(N, H, W, C)`` image -> ``(N, (H/p)(W/p), D)``.

  Tokens are in row-major order (row = h, col = w), as the official timm PatchEmbed.
  """
  dim: int
  patch_size: int
  bias_init: Callable = zeros
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    p = self.patch_size
    y = nn.Conv(self.dim, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype,
                kernel_init=patch_kernel_init, bias_init=self.bias_init, name="proj")(x)
    return y.reshape(y.shape[0], -1, self.dim)


def patchify(imgs, p: int):
  """``(N, H, W, C)`` -> ``(N, (H/p)(W/p), p*p*C)``, per-patch order (row, col, channel).

  This is the layout of the MAE loss target and of the SiT output, not the conv-weight order.
  """
  n, h, w, c = imgs.shape
  x = imgs.reshape(n, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(n, (h // p) * (w // p), p * p * c)


def unpatchify(x, p: int, h: int, w: int, c: int):
  """Inverse of ``patchify``: ``(N, (h/p)(w/p), p*p*c)`` -> ``(N, h, w, c)``."""
  n = x.shape[0]
  x = x.reshape(n, h // p, w // p, p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(n, h, w, c)


def remat(block_cls, policy: str):
  """Wraps a Linen block class for rematerialisation: 'none', 'full', 'dots' (save the matmuls
  without batch dimensions: the projections and MLPs) or 'dots_context' (those and each
  attention's output, named ``context`` in ``Attention``; MaxText's ``minimal_flash``), so that the
  backward pass does not run the attention's forward again (attention's own matmuls carry batch
  dimensions and a fused kernel is a custom call: neither is saved by 'dots')."""
  if policy == "none":
    return block_cls
  if policy == "full":
    return nn.remat(block_cls, prevent_cse=False)
  saveable = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  if policy == "dots_context":
    saveable = jax.checkpoint_policies.save_from_both_policies(
        saveable, jax.checkpoint_policies.save_only_these_names("context"))
  return nn.remat(block_cls, prevent_cse=False, policy=saveable)


def scan_blocks(block_cls, depth: int, in_axes, remat_policy: str = "none"):
  """``nn.scan`` over ``depth`` stacked copies of ``block_cls`` (parameters get a leading axis).

  Scanning keeps compile time flat in depth, which matters on pods and in CI. Per-layer constants
  (the decay coefficients) and per-layer inputs enter as scanned arrays ``xs``. Sown
  ``'intermediates'`` (branch norms) and ``'keys'`` (attention keys), kept only when the caller makes
  them mutable, get the layer axis too.
  """
  return nn.scan(remat(block_cls, remat_policy),
                 variable_axes={"params": 0, "intermediates": 0, "keys": 0},
                 split_rngs={"params": True, "dropout": True}, in_axes=in_axes, length=depth)
