"""Transformer blocks with decayed identity shortcuts (paper eq.: ``x_{l+1} = alpha_l x_l + f(x_l)``).

Each of a block's two sublayers (attention, MLP) updates the float32 stream ``x (N, T, C)`` as
``x <- alpha_s x + branch_scale f_s(LN(x))`` through ``stack.sublayer`` and the block's
``residual`` (a ``residual.Residual``, taken by keyword; docs/residual_forms.md): a block defines
its branches ``f_s`` and norms only; where the norm sits, the gains, drop path, hyper-connections
and the update are the stack's. Both blocks are written for ``nn.scan``:
``__call__(carry, state, ...) -> (carry, output)`` where ``state`` is this block's
``stack.BlockInputs`` (its ``alpha = (alpha_attn, alpha_mlp)``, a row of the model's
coefficients: a constant, or a trainable parameter for the 'learnable' ablation).
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from decay_jax.models import layers, stack
from decay_jax.models.layers import Dtype
from decay_jax.models.residual import Residual


class MAEBlock(nn.Module):
  """Pre-norm ViT block of the official decayed MAE (docs/official_code.md 1.5).

  ``x <- a_attn x + g s Attn(LN1(x)); x <- a_mlp x + g s MLP(LN2(x))`` (``residual.branch`` and
  ``residual.add``: ``s`` its ``branch_scale``, ``g`` its trained gain, 1 without one; with
  post-norm or DeepNorm ``x <- LN1(a' a_attn x + g s Attn(x))`` ...) with affine LN (eps 1e-6),
  qkv bias, exact-erf GELU, and ``attn.proj`` / ``mlp.fc2`` weights zero-initialised. Input
  ``(N, T, C)``, ``state.alpha (2,)``; output ``(N, T, C)``.
  The MAE decoder's blocks take the default ``Residual()`` and ``stack.PLAIN``: ``x + f(x)``.
  With ``'intermediates'`` mutable it also sows ``attn_norms`` and ``mlp_norms``, each ``(N, 2)``:
  the mean token norm of the branch and of the scaled identity (``stack.sow_branch_norms``).
  With ``stochastic_depth`` (fine-tuning, training only) each branch goes through drop path at
  ``state.drop_rate``, two independent draws (``state.drop_u (N, 2)`` when given, else the
  'dropout' RNG); without it, where ``drop_u`` is given (pre-training with
  ``Residual.drop_path``); the scaled identity is never dropped.
  """
  num_heads: int
  mlp_ratio: float = 4.0
  residual: Residual = Residual()
  dtype: Dtype = jnp.float32
  attention_impl: Optional[str] = None
  stochastic_depth: bool = False

  @nn.compact
  def __call__(self, x, state: stack.BlockInputs):
    c = x.shape[-1]
    res = self.residual
    last_init = stack.output_init(res, layers.xavier_uniform)
    attn = layers.Attention(self.num_heads, self.dtype, proj_init=last_init,
                            qkv_init=stack.branch_init(res, layers.xavier_uniform, True),
                            implementation=self.attention_impl, name="attn")
    mlp = layers.Mlp(int(c * self.mlp_ratio), approximate_gelu=False, dtype=self.dtype,
                     fc2_init=last_init, fc1_init=stack.branch_init(res, layers.xavier_uniform),
                     name="mlp")
    drop = self.stochastic_depth
    x = stack.sublayer(self, res, 0, x, state, layers.layer_norm("norm1"), attn, drop)
    x = stack.sublayer(self, res, 1, x, state, layers.layer_norm("norm2"), mlp, drop)
    return x, stack.reduce(res, x)


def modulate(x, shift, scale):
  """adaLN modulation ``x (1 + scale) + shift``, broadcast over tokens. ``shift, scale: (N, C)``."""
  return x * (1 + scale[:, None, :]) + shift[:, None, :]


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

  ``state`` is the block's ``stack.BlockInputs``: ``alpha (2,)``, the long-skip source ``skip``
  (decoder blocks), the drop-path rate and draws ``drop_u (N, 2)`` (pre-training with
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
  def __call__(self, x, state: stack.BlockInputs, c):
    dim = x.shape[-1]
    res = self.residual
    if self.has_skip:
      x = stack.inject(res, x, nn.Dense(dim, dtype=self.dtype, kernel_init=layers.xavier_uniform,
                                        bias_init=layers.zeros, name="skip")(state.skip))
    # adaLN-Zero (zero gates at init), or a random init where the form needs a live branch.
    mod = nn.Dense(6 * dim, dtype=self.dtype, kernel_init=stack.start_init(
        res, layers.xavier_uniform), bias_init=layers.zeros,
                   name="adaLN_modulation")(nn.silu(c)).astype(jnp.float32)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(mod, 6, axis=-1)
    attn = layers.Attention(self.num_heads, self.dtype, implementation=self.attention_impl,
                            proj_init=stack.branch_init(res, layers.xavier_uniform),
                            qkv_init=stack.branch_init(res, layers.xavier_uniform, True),
                            name="attn")
    mlp = layers.Mlp(int(dim * self.mlp_ratio), approximate_gelu=True, dtype=self.dtype,
                     fc1_init=stack.branch_init(res, layers.xavier_uniform),
                     fc2_init=stack.branch_init(res, layers.xavier_uniform), name="mlp")
    x = stack.sublayer(
        self, res, 0, x, state, layers.layer_norm("norm1", affine=False),
        lambda h: gate_msa[:, None, :] * attn(modulate(h, shift_msa, scale_msa)))
    x = stack.sublayer(
        self, res, 1, x, state, layers.layer_norm("norm2", affine=False),
        lambda h: gate_mlp[:, None, :] * mlp(modulate(h, shift_mlp, scale_mlp)))
    return x, stack.reduce(res, x)
