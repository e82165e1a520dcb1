"""Transformer blocks with decayed identity shortcuts (paper eq.: ``x_{l+1} = alpha_l x_l + f(x_l)``).

Each of a block's two sublayers (attention, MLP) updates the float32 stream ``x (N, T, C)`` as
``x <- alpha_s x + branch_scale f_s(LN(x))`` through its ``residual`` (a ``residual.Residual``,
taken by keyword: the one place of the update and its forms: ``branch_input`` and ``add`` place
the sublayer's norm before the branch or after the sum, ``scaled_init`` gives DeepNorm's init,
``branch`` the trained gains; docs/residual_forms.md). Both blocks are written for
``nn.scan``: ``__call__(carry, xs, ...) -> (carry, carry)`` where ``xs`` holds this block's
identity coefficients ``alpha = (alpha_attn, alpha_mlp)`` (a row of ``Residual.coefficients``: a
constant, or a trainable parameter for the 'learnable' ablation).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from decay_jax.models import layers
from decay_jax.models.layers import Dtype
from decay_jax.models.residual import Residual


def sow_branch_norms(module: nn.Module, name: str, x, alpha, branch) -> None:
  """Records ``(mean_t ||branch_t||, mean_t ||alpha x_t||)`` per example, ``(N, 2)``, where
  ``branch`` is what is added (``Residual.branch``: ``g * branch_scale * f(x)``).

  Only when the caller made ``'intermediates'`` mutable (``decay_jax.evals.branches``); otherwise
  nothing is computed, so training and the parity tests see exactly the same program.
  """
  if not module.is_mutable_collection("intermediates"):
    return
  f = jnp.linalg.norm(branch.astype(jnp.float32), axis=-1).mean(axis=-1)
  ident = jnp.linalg.norm((alpha * x).astype(jnp.float32), axis=-1).mean(axis=-1)
  module.sow("intermediates", name, jnp.stack([f, ident], axis=-1))


def drop_path(module: nn.Module, branch, rate, u=None):
  """Stochastic depth on a residual branch ``(N, T, C)`` (timm ``DropPath``): per example, the
  whole branch is kept with probability ``1 - rate`` (``keep = floor(1 - rate + U[0, 1))``) and
  then scaled by ``1 / (1 - rate)``. ``u (N,)`` are the uniform draws; without them, one draw per
  call from the ``'dropout'`` RNG. ``rate`` 0 keeps every example unchanged."""
  keep_prob = 1.0 - rate
  if u is None:
    u = jax.random.uniform(module.make_rng("dropout"), branch.shape[:1])
  u = u.reshape(branch.shape[:1] + (1,) * (branch.ndim - 1))
  return branch * (jnp.floor(keep_prob + u) / keep_prob).astype(branch.dtype)


def drop_branch(module, branch, rate, drop_u, i: int):
  """``branch`` through ``drop_path`` with the draws ``drop_u[:, i]`` (pre-training: the task
  draws them per step, ``Residual.drop_path``), or unchanged (``drop_u`` None: evaluation)."""
  return branch if drop_u is None else drop_path(module, branch, rate, drop_u[:, i])


class MAEBlock(nn.Module):
  """Pre-norm ViT block of the official decayed MAE (docs/official_code.md 1.5).

  ``x <- a_attn x + g s Attn(LN1(x)); x <- a_mlp x + g s MLP(LN2(x))`` (``residual.branch`` and
  ``residual.add``: ``s`` its ``branch_scale``, ``g`` its trained gain, 1 without one; with
  post-norm or DeepNorm ``x <- LN1(a' a_attn x + g s Attn(x))`` ...) with affine LN (eps 1e-6),
  qkv bias, exact-erf GELU, and ``attn.proj`` / ``mlp.fc2`` weights zero-initialised. Input
  ``(N, T, C)``, ``alpha (2,)``; output ``(N, T, C)``.
  The MAE decoder's blocks take the default ``Residual()`` with ``alpha = (1, 1)``: ``x + f(x)``.
  With ``'intermediates'`` mutable it also sows ``attn_norms`` and ``mlp_norms``, each ``(N, 2)``:
  the mean token norm of the branch and of the scaled identity (see ``sow_branch_norms``).
  With ``stochastic_depth`` (fine-tuning, training only) each branch goes through ``drop_path``
  at ``drop_rate``, two independent draws (``drop_u (N, 2)`` when given, else the 'dropout' RNG);
  without it, where ``drop_u`` is given (pre-training with ``Residual.drop_path``); the scaled
  identity is never dropped.
  """
  num_heads: int
  mlp_ratio: float = 4.0
  residual: Residual = Residual()
  dtype: Dtype = jnp.float32
  attention_impl: Optional[str] = None
  stochastic_depth: bool = False

  @nn.compact
  def __call__(self, x, alpha, drop_rate=0.0, drop_u=None, hyper=None):
    c = x.shape[-1]
    res = self.residual
    dropping = self.stochastic_depth or drop_u is not None
    last_init = layers.zeros if res.zero_branch_init else layers.xavier_uniform
    norm1, norm2 = layers.layer_norm("norm1"), layers.layer_norm("norm2")
    x_in, conn = res.read(x, hyper, 0)
    h = layers.Attention(self.num_heads, self.dtype, proj_init=res.scaled_init(last_init),
                         qkv_init=res.scaled_init(layers.xavier_uniform, value_only=True),
                         implementation=self.attention_impl,
                         name="attn")(res.branch_input(norm1, x_in))
    if dropping:
      h = drop_path(self, h, drop_rate, None if drop_u is None else drop_u[:, 0])
    h = res.branch(self, "attn", h)
    sow_branch_norms(self, "attn_norms", x_in, res.shortcut(alpha[0]), h)
    x = res.add(x, alpha[0], h, norm1, conn)
    x_in, conn = res.read(x, hyper, 1)
    h = layers.Mlp(int(c * self.mlp_ratio), approximate_gelu=False, dtype=self.dtype,
                   fc2_init=res.scaled_init(last_init),
                   fc1_init=res.scaled_init(layers.xavier_uniform),
                   name="mlp")(res.branch_input(norm2, x_in))
    if dropping:
      h = drop_path(self, h, drop_rate, None if drop_u is None else drop_u[:, 1])
    h = res.branch(self, "mlp", h)
    sow_branch_norms(self, "mlp_norms", x_in, res.shortcut(alpha[1]), h)
    x = res.add(x, alpha[1], h, norm2, conn)
    return x, res.reduce(x)


def modulate(x, shift, scale):
  """adaLN modulation ``x (1 + scale) + shift``, broadcast over tokens. ``shift, scale: (N, C)``."""
  return x * (1 + scale[:, None, :]) + shift[:, None, :]


class SiTInputs(NamedTuple):
  """The scanned inputs of a ``SiTBlock``: ``alpha (2,)``, the long-skip source ``skip (N, T, C)``
  (decoder blocks; None for encoder blocks), the drop-path rate and draws ``drop_u (N, 2)`` (None:
  no drop path) and the block's hyper-connection weights (``Residual.hyper_weights``; None:
  none)."""
  alpha: Any
  skip: Any = None
  drop_rate: Any = None
  drop_u: Any = None
  hyper: Any = None


class SiTBlock(nn.Module):
  """adaLN-Zero DiT/SiT block with decayed shortcuts and an optional long-skip input (4.5).

  Decoder blocks first add ``skip(s)`` (a Linear of the mirrored encoder output, no decay), then
  ``x <- a0 x + g_msa * Attn(mod(LN(x))); x <- a1 x + g_mlp * MLP(mod(LN(x)))`` (each through
  ``residual.branch`` and ``residual.add``, which also scale the gated branch by ``branch_scale`` and
  the spec's trained gain, if any) with the adaLN
  output of ``SiLU(c)`` chunked as (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp).
  LN has no affine parameters; GELU is the tanh form; adaLN is zero-initialised. With post-norm or
  DeepNorm the modulation reads the stream itself and the norm follows the sum:
  ``x <- LN(a' a0 x + g_msa * Attn(mod(x)))``.

  ``xs`` is ``alpha (2,)`` for encoder blocks and ``(alpha, s)`` for decoder blocks, or a
  ``SiTInputs`` with the drop-path rate and draws ``drop_u (N, 2)`` besides (pre-training with
  ``Residual.drop_path``: drop path on the gated branches; ``drop_u`` None: none).

  ``x, s`` are ``(N, T, C)``, ``c`` is ``(N, C)``; the output is ``(N, T, C)``.
  """
  num_heads: int
  mlp_ratio: float = 4.0
  has_skip: bool = False
  residual: Residual = Residual()
  dtype: Dtype = jnp.float32
  attention_impl: Optional[str] = None

  @nn.compact
  def __call__(self, x, xs, c):
    dim = x.shape[-1]
    res = self.residual
    if isinstance(xs, SiTInputs):
      alpha, s, drop_rate, drop_u, hyper = xs
    else:  # alpha, or (alpha, s) for decoder blocks
      (alpha, s), drop_rate, drop_u = (xs if self.has_skip else (xs, None)), 0.0, None
      hyper = None
    if self.has_skip:
      x = res.inject(x, nn.Dense(dim, dtype=self.dtype, kernel_init=layers.xavier_uniform,
                                 bias_init=layers.zeros, name="skip")(s))
    # adaLN-Zero (zero gates at init), or a random init where the form needs a live branch.
    mod_init = layers.zeros if res.zero_branch_init else layers.xavier_uniform
    mod = nn.Dense(6 * dim, dtype=self.dtype, kernel_init=mod_init, bias_init=layers.zeros,
                   name="adaLN_modulation")(nn.silu(c)).astype(jnp.float32)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(mod, 6, axis=-1)
    norm1 = layers.layer_norm("norm1", affine=False)
    norm2 = layers.layer_norm("norm2", affine=False)
    x_in, conn = res.read(x, hyper, 0)
    h = modulate(res.branch_input(norm1, x_in), shift_msa, scale_msa)
    h = layers.Attention(self.num_heads, self.dtype, implementation=self.attention_impl,
                         proj_init=res.scaled_init(layers.xavier_uniform),
                         qkv_init=res.scaled_init(layers.xavier_uniform, value_only=True),
                         name="attn")(h)
    h = drop_branch(self, gate_msa[:, None, :] * h, drop_rate, drop_u, 0)
    x = res.add(x, alpha[0], res.branch(self, "attn", h), norm1, conn)
    x_in, conn = res.read(x, hyper, 1)
    h = modulate(res.branch_input(norm2, x_in), shift_mlp, scale_mlp)
    h = layers.Mlp(int(dim * self.mlp_ratio), approximate_gelu=True, dtype=self.dtype,
                   fc1_init=res.scaled_init(layers.xavier_uniform),
                   fc2_init=res.scaled_init(layers.xavier_uniform), name="mlp")(h)
    h = drop_branch(self, gate_mlp[:, None, :] * h, drop_rate, drop_u, 1)
    x = res.add(x, alpha[1], res.branch(self, "mlp", h), norm2, conn)
    return x, res.reduce(x)
