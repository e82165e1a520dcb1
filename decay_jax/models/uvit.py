"""U-ViT (Bao et al., CVPR 2023; baofff/U-ViT ``libs/uvit.py``) with decayed identity shortcuts.

All inputs are tokens (docs/uvit.md 1). With ``K = depth // 2`` there are ``K``
in-blocks, one mid-block and ``K`` out-blocks, ``2K + 1`` blocks in all::

    tokens = [label?, time, patches] + pos_embed        (B, extras + N, D), extras = 1 + [cond]
    in-block i:  x = block(x); push x                    i = 0 .. K-1
    mid-block:   x = block(x)                            (its output is not pushed)
    out-block j: x = block(x, pop())                     out-block j reads in-block K-1-j
    eps = final_conv(unpatchify(decoder_pred(LN(x))[:, extras:]))

Every block is pre-norm (or the ``residual`` spec's form: hyper-connections carry ``n`` streams,
see ``SkipLinear`` for the long skip), block ``b`` (in0..in(K-1), mid, out0..out(K-1)) computing::

    out-blocks only:  x <- W_s [x ; s] + b_s        (skip_mode 'concat', U-ViT: a replacement)
    x <- alpha_{2b}   x + Attn(LN1(x))
    x <- alpha_{2b+1} x + MLP(LN2(x))

with LayerNorm eps 1e-5 (torch default, not the 1e-6 of MAE/SiT), qkv without bias, exact-erf GELU.
The update is the model's ``residual`` spec (``decay_jax.models.residual``, default
``alpha_min=0.7``; with its ``branch_scale`` on the branch for the sqrt(1/2) controls), ``alpha``
its coefficients over the ``2K + 1`` blocks in the order above: module constants computed in
Python, never parameters (unless ``shortcut_form='learnable'``). The skip Linear, the pos-embed add
and everything outside the blocks are not decayed.

Modes (``mode``):
  ``'uvit_original'``: alpha = 1 everywhere and U-ViT's init: bit for bit the baofff model
      (parity tests, released checkpoints). ``residual`` and ``zero_init_branches`` are not read
      in this mode: the blocks take the plain ``Residual()`` (``block_residual``).
  ``'decayed'`` (default): the blocks take ``residual``; ``zero_init_branches`` sets their init.

Choices where the sources are silent (the decayed paper ships no U-ViT code), docs/uvit.md 4.2:
  * [CHOICE] ``schedule_convention='sublayer'`` (default): one linear schedule over the
    ``S = 2(2K+1)`` sublayers in -> mid -> out, ``alpha_k = 1 - k (1 - alpha_min) / (S - 1)``, as
    the official decayed SiT; ``'block'`` is the paper's per-block equation (one ``alpha_l`` per
    block applied to the block as a whole, i.e. the pair ``(alpha_l, 1)``).
  * [CHOICE] ``zero_init_branches=True`` (decayed mode): ``attn.proj`` and ``mlp.fc2`` kernels
    start at zero in all blocks (as the official decayed MAE); the skip Linear, ``decoder_pred`` and
    the convs keep U-ViT's init.
  * [CHOICE] ``skip_mode='concat'`` is U-ViT's long skip; ``'add'`` (``x <- x + W s``, the decayed
    SiT's form, an ablation) and ``'none'`` (U-ViT's ``skip=False``) are alternatives.

Inputs: ``x (B, H, W, C)`` NHWC with ``H = W = img_size``, ``t (B,)`` float network time fed to the
sinusoid as given (U-ViT feeds ``999 t`` for continuous time, or the integer step), ``y (B,)`` int
labels when ``num_classes > 0`` (no label dropout here: the data pipeline maps dropped labels to a
null class, as U-ViT does) and ``None`` otherwise. Output: the noise prediction, ``(B, H, W, C)``
float32.
"""

from __future__ import annotations

from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from decay_jax import validate
from decay_jax.models import fields, layers, schedules, stack
from decay_jax.models import residual as residual_lib
from decay_jax.models.layers import Dtype
from decay_jax.models.residual import Residual
from decay_jax.models.sit import timestep_frequencies

MODES = ("decayed", "uvit_original")
SKIP_MODES = ("concat", "add", "none")
LN_EPS = 1e-5  # nn.LayerNorm(dim) in U-ViT: the torch default

# U-ViT's init (docs/uvit.md 2.1): timm trunc_normal_(std=.02) with absolute bounds +-2 is N(0, 0.02^2) in
# practice; Linear biases 0. The convs keep torch's default init, U(+-1/sqrt(fan_in)) for kernel and
# bias; the label table keeps nn.Embedding's N(0, 1).
linear_init = layers.normal(0.02)
torch_conv_kernel_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def dense(features: int, dtype: Dtype, name: Optional[str] = None,
          kernel_init: Callable = linear_init, use_bias: bool = True) -> nn.Dense:
  """A Linear with U-ViT's init (kernel N(0, 0.02^2), bias 0)."""
  return nn.Dense(features, use_bias=use_bias, dtype=dtype, kernel_init=kernel_init,
                  bias_init=layers.zeros, name=name)


class SkipLinear(nn.Module):
  """U-ViT's long skip ``x <- W [x ; s] + b``, Linear(2D, D) (``kernel (2D, D)``, ``bias (D,)``:
  the torch ``skip_linear``, U-ViT's init), a replacement of the stream by a Linear of it and the
  mirrored in-block's output ``s (B, T, D)``.

  With hyper-connections (``streams = n``; ``x (B, T, n, D)``, ``s`` the sum of the in-block's
  streams) every stream is replaced as U-ViT replaces its one, beside the mean of the source's
  streams: ``H_i <- W_x H_i + (W_s s / n + b)`` (``W = [W_x ; W_s]``), the skip's half computed
  once for all streams; equal streams stay equal, each the plain model's stream.
  """
  features: int
  dtype: Dtype = jnp.float32
  streams: int = 0

  @nn.compact
  def __call__(self, x, s):
    d = x.shape[-1]
    kernel = self.param("kernel", linear_init, (2 * d, self.features))
    bias = self.param("bias", layers.zeros, (self.features,))
    x, s, kernel, bias = nn.dtypes.promote_dtype(x, s, kernel, bias, dtype=self.dtype)
    if not self.streams:  # nn.Dense's own computation on the concatenation
      return jax.lax.dot_general(jnp.concatenate([x, s], axis=-1), kernel,
                                 (((x.ndim - 1,), (0,)), ((), ()))) + bias
    return x @ kernel[:d] + (s / self.streams @ kernel[d:] + bias)[..., None, :]


def layer_norm(name: Optional[str] = None) -> nn.LayerNorm:
  """U-ViT's affine LayerNorm: torch's eps 1e-5."""
  return layers.layer_norm(name, eps=LN_EPS)


def torch_conv(features: int, kernel: int, fan_in: int, dtype: Dtype, padding, strides: int = 1,
               name: Optional[str] = None) -> nn.Conv:
  """A square Conv2d with torch's default init (kernel and bias U(+-1/sqrt(fan_in)))."""
  return nn.Conv(features, (kernel, kernel), strides=(strides, strides), padding=padding,
                 dtype=dtype, kernel_init=torch_conv_kernel_init,
                 bias_init=layers.torch_conv_bias_init(fan_in), name=name)


class UViTBlock(nn.Module):
  """U-ViT ``Block`` with decayed shortcuts, written for ``nn.scan``: ``(x, state) -> (x, x)``.

  ``state`` is this block's ``stack.BlockInputs``: ``alpha = (alpha_attn, alpha_mlp)`` and, when
  ``skip_mode`` is 'concat' (``x <- skip_linear([x ; s])``, Linear(2D, D)) or 'add'
  (``x <- x + skip_linear(s)``, Linear(D, D)), the long-skip source ``skip = s``; then
  ``x <- alpha_attn x + Attn(LN1 x)``, ``x <- alpha_mlp x + MLP(LN2 x)`` (``stack.sublayer``).
  ``x, s: (B, T, D)`` float32; output ``(B, T, D)``. With ``zero_init`` the ``attn.proj`` and
  ``mlp.fc2`` kernels start at zero. With ``'intermediates'`` mutable it sows ``attn_norms`` /
  ``mlp_norms`` as ``MAEBlock``. With hyper-connections (``state.hyper``: this block's
  ``(2, ...)`` weights) ``x`` is the streams ``(B, T, n, D)``, the long skip is ``SkipLinear``'s
  per-stream rule and the second output is the streams' sum.
  """
  num_heads: int
  mlp_ratio: float = 4.0
  qkv_bias: bool = False
  skip_mode: str = "none"
  zero_init: bool = False
  residual: Residual = Residual()
  dtype: Dtype = jnp.float32
  attention_impl: Optional[str] = None

  @nn.compact
  def __call__(self, x, state: stack.BlockInputs):
    d = x.shape[-1]
    res = self.residual
    if self.skip_mode == "concat":
      x = SkipLinear(d, self.dtype, stack.streams(res), name="skip_linear")(
          x, state.skip).astype(jnp.float32)
    elif self.skip_mode == "add":
      x = stack.inject(res, x, dense(d, self.dtype, "skip_linear")(state.skip))
    last_init = stack.output_init(res, linear_init, zero=self.zero_init)
    attn = layers.Attention(self.num_heads, self.dtype, last_init, self.attention_impl,
                            qkv_bias=self.qkv_bias,
                            qkv_init=stack.branch_init(res, linear_init, value_only=True),
                            name="attn")
    mlp = layers.Mlp(int(d * self.mlp_ratio), approximate_gelu=False, dtype=self.dtype,
                     fc2_init=last_init, fc1_init=stack.branch_init(res, linear_init),
                     name="mlp")
    x = stack.sublayer(self, res, 0, x, state, layer_norm("norm1"), attn)
    x = stack.sublayer(self, res, 1, x, state, layer_norm("norm2"), mlp)
    return x, stack.reduce(res, x)


class UViT(residual_lib.HasResidual, fields.PatchGrid, nn.Module):
  """U-ViT noise-prediction network with decayed identity shortcuts (see the module docstring).

  Fields as U-ViT's constructor (``dim`` is ``embed_dim``; ``depth`` is U-ViT's argument, giving
  ``2 (depth // 2) + 1`` blocks; ``num_classes > 0`` adds the label token; ``conv`` the final 3x3
  conv; ``mlp_time_embed`` the Linear-SiLU-Linear on the time token) plus ``skip_mode``, ``mode``,
  ``residual`` (the blocks' update, default ``alpha_min=0.7``) and ``zero_init_branches`` (the
  branch init of 'decayed' mode; an init choice of this model, not of the update). Defaults are
  U-ViT's constructor defaults; ``UVIT_PRESETS`` holds the
  released configurations. Parameter names follow the torch state_dict (``pos_embed``,
  ``patch_embed``, ``label_emb``, ``in_blocks`` / ``out_blocks`` (scanned, leading block axis),
  ``mid_block``, ``norm``, ``decoder_pred``, ``final_layer``).
  """
  img_size: int = 224
  patch_size: int = 16
  in_chans: int = 3
  dim: int = 768
  depth: int = 12
  num_heads: int = 12
  mlp_ratio: float = 4.0
  qkv_bias: bool = False
  mlp_time_embed: bool = False
  num_classes: int = -1
  conv: bool = True
  skip_mode: str = "concat"
  mode: str = "decayed"
  residual: Residual = Residual(alpha_min=0.7)
  zero_init_branches: bool = True
  dtype: Dtype = jnp.float32
  attention_impl: Optional[str] = None
  remat_policy: str = "none"

  def __post_init__(self):
    fields.check_once(self, validate_uvit_fields)
    super().__post_init__()

  # ----- constants derived from the fields -------------------------------------------------------
  @property
  def half(self) -> int:
    """``K``: the number of in-blocks, and of out-blocks."""
    return self.depth // 2

  @property
  def num_blocks(self) -> int:
    """``2K + 1`` blocks: in-blocks, the mid-block, out-blocks."""
    return 2 * self.half + 1

  @property
  def conditional(self) -> bool:
    return self.num_classes > 0

  def block_slot(self, b: int):
    """Block ``b`` (in -> mid -> out order)'s parameters: ``in_blocks``/``out_blocks`` at their
    index (scanned), or ``mid_block``."""
    k = self.half
    if b == k:
      return ("mid_block",), None
    return (("in_blocks",), b) if b < k else (("out_blocks",), b - k - 1)

  @property
  def extras(self) -> int:
    """Tokens before the patches: ``[label, time]`` (conditional) or ``[time]``."""
    return 2 if self.conditional else 1

  @property
  def block_residual(self) -> Residual:
    """The update the blocks use: ``residual``, or the plain ``Residual()`` in 'uvit_original'."""
    return Residual() if self.mode == "uvit_original" else self.residual

  @property
  def shortcuts(self) -> schedules.Shortcuts:
    """Identity coefficients ``(num_blocks, 2)`` in block order in -> mid -> out; all ones in
    'uvit_original' mode."""
    return self.block_residual.shortcuts(self.num_blocks)

  @property
  def zero_init(self) -> bool:
    """Whether the branch outputs (``attn.proj``, ``mlp.fc2`` kernels) start at zero."""
    return (self.mode == "decayed" and self.zero_init_branches
            and self.residual.zero_branch_init)

  # ----- modules ---------------------------------------------------------------------------------
  def setup(self):
    d, p, c = self.dim, self.patch_size, self.in_chans
    self.patch_embed = torch_conv(d, p, c * p * p, self.dtype, "VALID", strides=p)
    if self.mlp_time_embed:
      self.time_embed_0 = dense(4 * d, self.dtype)
      self.time_embed_2 = dense(d, self.dtype)
    if self.conditional:
      self.label_emb = nn.Embed(self.num_classes, d, embedding_init=layers.normal(1.0))
    self.pos_embed = self.param("pos_embed", linear_init, (1, self.extras + self.num_patches, d))
    # alpha (2K + 1, 2) and the hyper-connection weights, in block order in -> mid -> out
    self.stream = stack.create(self, self.block_residual, self.num_blocks, self.dim)
    common = dict(num_heads=self.num_heads, mlp_ratio=self.mlp_ratio, qkv_bias=self.qkv_bias,
                  zero_init=self.zero_init, dtype=self.dtype, attention_impl=self.attention_impl,
                  residual=stack.blocks_residual(self.block_residual, self.num_blocks))
    self.in_blocks = stack.scan(UViTBlock, self.half, self.remat_policy)(
        skip_mode="none", **common)
    self.mid_block = layers.remat(UViTBlock, self.remat_policy)(skip_mode="none", **common)
    self.out_blocks = stack.scan(UViTBlock, self.half, self.remat_policy)(
        skip_mode=self.skip_mode, **common)
    self.norm = layer_norm()
    self.decoder_pred = dense(p * p * c, self.dtype)
    if self.conv:
      self.final_layer = torch_conv(c, 3, 9 * c, self.dtype, ((1, 1), (1, 1)))

  # ----- forward ---------------------------------------------------------------------------------
  def embed(self, x, t, y=None):
    """Tokens ``[label?, time, patches] + pos_embed``, ``(B, extras + N, D)`` float32."""
    b, h, w, c = x.shape
    if (h, w, c) != (self.img_size, self.img_size, self.in_chans):
      raise ValueError(f"x of shape {x.shape} is not allowed; this UViT takes (B, {self.img_size}, "
                       f"{self.img_size}, {self.in_chans})")
    if (y is not None) != self.conditional:
      raise ValueError(f"y={'None' if y is None else 'labels'} is not allowed with num_classes="
                       f"{self.num_classes}; labels go with num_classes > 0 only")
    patches = self.patch_embed(x).reshape(b, -1, self.dim).astype(jnp.float32)
    time = timestep_frequencies(t, self.dim)
    if self.mlp_time_embed:
      time = self.time_embed_2(nn.silu(self.time_embed_0(time))).astype(jnp.float32)
    tokens = [time[:, None]]
    if y is not None:
      tokens.insert(0, self.label_emb(y).astype(jnp.float32)[:, None])
    return jnp.concatenate(tokens + [patches], axis=1) + self.pos_embed

  def run_blocks(self, tokens, drop_u=None):
    """All blocks on ``tokens (B, T, D)``: the final stream ``(B, T, D)``, the in-block outputs
    ``(K, B, T, D)`` (the long-skip sources), the mid output and the out-block outputs (with
    hyper-connections each of them the sum of its ``n`` streams).
    ``drop_u (2K + 1, B, 2)``: the drop-path draws of training (``residual.drop_path``)."""
    k, res = self.half, self.block_residual
    h, in_outs = self.in_blocks(stack.expand(res, tokens),
                                stack.inputs(res, self.stream, slice(0, k), drop_u))
    h, mid = self.mid_block(h, stack.inputs(res, self.stream, k, drop_u))
    skips = None if self.skip_mode == "none" else in_outs[::-1]
    h, out_outs = self.out_blocks(h, stack.inputs(res, self.stream, slice(k + 1, None), drop_u,
                                                  skips))
    return stack.reduce(res, h), in_outs, mid, out_outs

  def block_outputs(self, x, t, y=None):
    """The residual stream after every block, in -> mid -> out: ``(2K+1, B, extras + N, D)``.

    Raw (before the final ``norm``), all tokens; the probe features of docs/uvit.md 5.2 pool these over
    the patch tokens ``[:, :, extras:]``.
    """
    _, in_outs, mid, out_outs = self.run_blocks(self.embed(x, t, y))
    return jnp.concatenate([in_outs, mid[None], out_outs], axis=0)

  def __call__(self, x, t, y=None, drop_u=None):
    """Noise prediction ``(B, H, W, C)`` float32 for ``x (B, H, W, C)``, ``t (B,)``, ``y (B,)``;
    ``drop_u (2K + 1, B, 2)`` the drop-path draws of training (none dropped without them)."""
    _, h, w, c = x.shape
    tokens = self.run_blocks(self.embed(x, t, y), drop_u)[0]  # the out-block outputs: unused
    out = self.decoder_pred(self.norm(tokens)).astype(jnp.float32)[:, self.extras:]
    out = layers.unpatchify(out, self.patch_size, h, w, c)
    if self.conv:
      out = self.final_layer(out).astype(jnp.float32)
    return out


def validate_uvit_fields(m) -> None:
  """One-line errors for bad model fields, raised at construction (before any compilation)."""
  fields.check_positive_ints(m, ("img_size", "patch_size", "in_chans", "dim", "depth",
                                 "num_heads"))
  validate.check_int("num_classes", m.num_classes, minimum=-1)
  fields.check_patches(m)
  if m.depth < 2 or m.depth % 2:
    raise ValueError(f"depth={m.depth} is not allowed; U-ViT builds depth//2 in-blocks, a "
                     "mid-block and depth//2 out-blocks, so it must be even and >= 2")
  if m.dim % m.num_heads or m.dim % 2:
    raise ValueError(f"dim={m.dim} is not allowed; it must be even (the time sinusoid) and "
                     f"divisible by num_heads={m.num_heads}")
  for flag in ("qkv_bias", "mlp_time_embed", "conv", "zero_init_branches"):
    validate.check_flag(flag, getattr(m, flag))
  validate.check_choice("skip_mode", m.skip_mode, SKIP_MODES)
  validate.check_choice("mode", m.mode, MODES)
  residual_lib.check_field(m)
  fields.check_execution(m)


# Released configurations (baofff/U-ViT configs/*.py; docs/uvit.md 3.1) and the CPU preset of docs/uvit.md 7. Sizes
# and data shapes only: execution fields (remat, dtype) and the mode are the caller's.
UVIT_PRESETS = {
    # cifar10_uvit_small: 44,255,328 parameters
    "S/2": dict(img_size=32, patch_size=2, in_chans=3, dim=512, depth=12, num_heads=8),
    # celeba64_uvit_small: 44,292,228
    "S/4": dict(img_size=64, patch_size=4, in_chans=3, dim=512, depth=12, num_heads=8),
    # imagenet64_uvit_mid: 130,940,292
    "M/4": dict(img_size=64, patch_size=4, in_chans=3, dim=768, depth=16, num_heads=12,
                num_classes=1000),
    # imagenet64_uvit_large: 286,827,652
    "L/4": dict(img_size=64, patch_size=4, in_chans=3, dim=1024, depth=20, num_heads=16,
                num_classes=1000),
    # imagenet256_uvit_large, SD-VAE latents 4x32x32, 1000 classes + the CFG null class: 286,763,172
    "L/2": dict(img_size=32, patch_size=2, in_chans=4, dim=1024, depth=20, num_heads=16,
                num_classes=1001),
    # imagenet256_uvit_huge, no final conv: 500,832,016
    "H/2": dict(img_size=32, patch_size=2, in_chans=4, dim=1152, depth=28, num_heads=16,
                num_classes=1001, conv=False),
    # [CHOICE] docs/uvit.md 7: 7 blocks, 65 tokens, 1,505,028 parameters (92 state_dict keys)
    "tiny/4": dict(img_size=32, patch_size=4, in_chans=3, dim=128, depth=6, num_heads=4),
}


def uvit(preset: str, **overrides) -> UViT:
  """A ``UViT`` from a preset name (see ``UVIT_PRESETS``) with field overrides."""
  return fields.from_preset(UViT, UVIT_PRESETS, preset, overrides)
