"""SiT with decayed identity shortcuts and U-Net long skips (docs/official_code.md section 4).

``depth`` blocks split into ``depth/2`` encoder and ``depth/2`` decoder blocks. The decay schedule
runs over all ``2*depth`` sublayers, encoder then decoder, down to ``alpha_min`` (the official
``min_sigma``) at the last decoder MLP. Decoder block ``j`` receives the output of encoder block
``depth/2 - 1 - j`` through a Linear (``skip``), added without decay.

Inputs: ``x (N, H, W, C)`` latents, ``t (N,)`` in [0, 1] (t = 0 noise, t = 1 data; unscaled),
``y (N,)`` int labels (``num_classes`` is the null class). Output ``(N, H, W, C)``.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import validate
from decay_jax.models import fields, layers, routing, stack
from decay_jax.models import residual as residual_lib
from decay_jax.models.blocks import SiTBlock, modulate
from decay_jax.models.layers import Dtype
from decay_jax.models.residual import Residual


def timestep_frequencies(t, dim: int = 256, max_period: float = 10000.0):
  """``[cos(t f), sin(t f)]`` with ``f_j = exp(-ln(max_period) j / (dim/2))`` (4.6), ``(N, dim)``."""
  half = dim // 2
  freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
  args = t.astype(jnp.float32)[:, None] * freqs[None]
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class TimestepEmbedder(nn.Module):
  """Frequency features -> Linear -> SiLU -> Linear (weights normal std 0.02, biases 0)."""
  dim: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, t):
    h = nn.Dense(self.dim, dtype=self.dtype, kernel_init=layers.normal(0.02),
                 bias_init=layers.zeros, name="mlp0")(timestep_frequencies(t))
    return nn.Dense(self.dim, dtype=self.dtype, kernel_init=layers.normal(0.02),
                    bias_init=layers.zeros, name="mlp2")(nn.silu(h))


class SiT(residual_lib.HasResidual, nn.Module):
  """The official decayed SiT (``SiT`` of SiT/models.py) with ``learn_sigma`` handling.

  ``residual`` (``residual.Residual``, default ``alpha_min=0.8``, the official ``min_sigma``) is
  the update ``x <- alpha_k x + g_k f_k(x)`` of every sublayer ``k`` of the encoder, then the
  decoder half; ``alpha (depth, 2)`` is a module constant (a parameter ``alpha`` when learnable).

  With ``learn_sigma`` the final Linear has ``2C`` outputs per pixel (the official parameter shape,
  so checkpoints convert 1:1) and only the first ``C`` are returned, as the official forward does.
  ``residual_routing`` other than 'none' replaces the blocks by ``routing.RoutedTrunk`` (mirror
  routing and its variants; ``routing_decay`` says how they meet the decay; ``routing_gate`` gates
  them for a start from a trained SiT, models/routing_start.py), see models/routing.py.
  With hyper-connections the blocks carry ``n`` streams, summed before the final norm; the long
  skips read a block's sum and add to every stream.
  """
  input_size: int = 32
  patch_size: int = 2
  in_channels: int = 4
  dim: int = 1152
  depth: int = 28
  num_heads: int = 16
  mlp_ratio: float = 4.0
  num_classes: int = 1000
  class_dropout_prob: float = 0.1
  learn_sigma: bool = True
  residual: Residual = Residual(alpha_min=0.8)
  dtype: Dtype = jnp.float32
  attention_impl: Optional[str] = None
  remat_policy: str = "none"
  residual_routing: str = "none"
  routing_decay: str = "after"
  routing_gate: bool = False  # routing added to a trained SiT: x~ = x + g (R - x), g = 0 at init
  # REPA (docs/repa.md): projectors of the tokens after block ``repa_depth`` (1-based; 0: none),
  # one MLP per target width in ``repa_dims``; ``flow_convention='repa'``: the network sees REPA's
  # time (t = 0 data) and predicts REPA's velocity (noise - data); the forward maps both to ours.
  repa_depth: int = 0
  repa_dims: Tuple[int, ...] = ()
  repa_hidden: int = 2048
  flow_convention: str = "sit"

  def __post_init__(self):
    if isinstance(self.repa_dims, list):  # read back from JSON (model.json, config.json)
      object.__setattr__(self, "repa_dims", tuple(self.repa_dims))
    fields.check_once(self, validate_sit_fields)
    super().__post_init__()

  @property
  def out_channels(self) -> int:
    return 2 * self.in_channels if self.learn_sigma else self.in_channels

  @property
  def grid(self) -> int:
    return self.input_size // self.patch_size

  def block_slot(self, b: int):
    """Block ``b``'s parameters: ``enc_blocks``/``dec_blocks`` at ``b`` (scanned halves), or the
    routed trunk's own ``enc_BB``/``dec_BB``."""
    half = self.depth // 2
    if self.residual_routing != "none":
      return ("trunk", f"enc_{b:02d}" if b < half else f"dec_{b - half:02d}"), None
    return (("enc_blocks",), b) if b < half else (("dec_blocks",), b - half)

  def setup(self):
    half = self.depth // 2
    self.x_embedder = layers.PatchEmbed(self.dim, self.patch_size, dtype=self.dtype)
    self.t_embedder = TimestepEmbedder(self.dim, self.dtype)
    self.y_embedder = nn.Embed(self.num_classes + int(self.class_dropout_prob > 0), self.dim,
                               embedding_init=layers.normal(0.02))
    self.stream = stack.create(self, self.residual, self.depth, self.dim)
    if self.residual_routing != "none":
      self.trunk = routing.RoutedTrunk(
          depth=self.depth, num_heads=self.num_heads, mlp_ratio=self.mlp_ratio,
          variant=self.residual_routing, decay=self.routing_decay, residual=self.residual,
          dtype=self.dtype, attention_impl=self.attention_impl, remat_policy=self.remat_policy,
          gate=self.routing_gate, capture=self.repa_depth)
    else:
      common = dict(num_heads=self.num_heads, mlp_ratio=self.mlp_ratio,
                    residual=stack.blocks_residual(self.residual, self.depth), dtype=self.dtype,
                    attention_impl=self.attention_impl)
      self.enc_blocks = stack.scan(SiTBlock, half, self.remat_policy, broadcast=1)(
          has_skip=False, **common)
      self.dec_blocks = stack.scan(SiTBlock, half, self.remat_policy, broadcast=1)(
          has_skip=True, **common)
    self.final_adaLN = nn.Dense(2 * self.dim, dtype=self.dtype, kernel_init=layers.zeros,
                                bias_init=layers.zeros)
    self.norm_final = layers.layer_norm(affine=False)
    self.final_linear = nn.Dense(self.patch_size ** 2 * self.out_channels, dtype=self.dtype,
                                 kernel_init=layers.zeros, bias_init=layers.zeros)
    if self.repa_depth:
      self.projectors = [Projector(self.repa_hidden, d, self.dtype) for d in self.repa_dims]

  def pos_embed(self) -> np.ndarray:
    return layers.sincos_2d(self.dim, self.grid)

  def embed_labels(self, y, train: bool, force_drop_ids=None):
    """Label embedding with CFG dropout to the null class (training: prob ``class_dropout_prob``,
    RNG stream 'label_drop'; ``force_drop_ids`` (N,) drops where it equals 1)."""
    drop = None
    if force_drop_ids is not None:
      drop = force_drop_ids == 1
    elif train and self.class_dropout_prob > 0:
      drop = jax.random.uniform(self.make_rng("label_drop"), y.shape) < self.class_dropout_prob
    if drop is not None:
      y = jnp.where(drop, self.num_classes, y)
    return self.y_embedder(y)

  def block_inputs(self, half: int, drop_u=None, skips=None) -> stack.BlockInputs:
    """The scanned inputs of the encoder (``half`` 0) or decoder (1) blocks: their ``alpha``, the
    long-skip sources ``skips`` (decoder), drop rates and draws ``drop_u (depth, N, 2)``."""
    k = self.depth // 2
    part = slice(0, k) if half == 0 else slice(k, None)
    return stack.inputs(self.residual, self.stream, part, drop_u, skips)

  def __call__(self, x, t, y, train: bool = False, force_drop_ids=None, drop_u=None,
               features: bool = False):
    """``drop_u (depth, N, 2)``: the uniform draws of stochastic depth (training with
    ``residual.drop_path > 0``); without them no branch is dropped. ``features`` (REPA,
    ``repa_depth > 0``): returns ``(out, [z_1, ..., z_k])``, ``z_i (N, T, repa_dims[i])`` the
    projected tokens after block ``repa_depth``."""
    n, h, w, c = x.shape
    if self.flow_convention == "repa":
      t = 1.0 - t  # REPA's time: t = 0 data, t = 1 noise
    tokens = self.x_embedder(x).astype(jnp.float32) + self.pos_embed()[None]
    cond = (self.t_embedder(t).astype(jnp.float32)
            + self.embed_labels(y, train, force_drop_ids).astype(jnp.float32))
    aligned = None  # the stream after block repa_depth
    if self.residual_routing != "none":
      tokens = self.trunk(tokens, self.stream.alpha, cond)
      if self.repa_depth:
        tokens, aligned = tokens
    else:
      tokens = stack.expand(self.residual, tokens)  # n streams with hyper-connections
      tokens, enc_outs = self.enc_blocks(tokens, self.block_inputs(0, drop_u), cond)
      tokens, _ = self.dec_blocks(tokens, self.block_inputs(1, drop_u, enc_outs[::-1]), cond)
      tokens = stack.reduce(self.residual, tokens)
      aligned = enc_outs[self.repa_depth - 1] if self.repa_depth else None
    shift, scale = jnp.split(self.final_adaLN(nn.silu(cond)).astype(jnp.float32), 2, axis=-1)
    out = self.final_linear(modulate(self.norm_final(tokens),
                                     shift, scale)).astype(jnp.float32)
    out = layers.unpatchify(out, self.patch_size, h, w, self.out_channels)[..., :c]
    if self.flow_convention == "repa":
      out = -out  # REPA's velocity is noise - data, ours data - noise
    if self.repa_depth and (features or self.is_initializing()):
      zs = [p(aligned) for p in self.projectors]
      if features:
        return out, zs
    return out


class Projector(nn.Module):
  """REPA's ``build_mlp``: Linear(d, hidden), SiLU, Linear(hidden, hidden), SiLU, Linear(hidden,
  out) (names ``fc0``, ``fc2``, ``fc4``: REPA's ``projectors.i.{0,2,4}``; xavier-uniform weights,
  zero biases, as REPA's ``_basic_init``). Applied per token; float32 output."""
  hidden: int
  out: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate((self.hidden, self.hidden, self.out)):
      x = nn.Dense(width, dtype=self.dtype, kernel_init=layers.xavier_uniform,
                   bias_init=layers.zeros, name=f"fc{2 * i}")(x)
      x = nn.silu(x) if i < 2 else x
    return x.astype(jnp.float32)


def validate_sit_fields(m) -> None:
  """One-line errors for bad model fields, raised at construction (before any compilation)."""
  fields.check_positive_ints(m, ("input_size", "patch_size", "in_channels", "dim", "depth",
                                 "num_heads", "num_classes"))
  if m.depth % 2:
    raise ValueError(f"depth={m.depth} is not allowed; SiT splits it into encoder and decoder "
                     "halves, so it must be even")
  if m.input_size % m.patch_size:
    raise ValueError(f"input_size={m.input_size} is not allowed; it must be a multiple of "
                     f"patch_size={m.patch_size}")
  if m.dim % m.num_heads or m.dim % 4:
    raise ValueError(f"dim={m.dim} must be divisible by num_heads={m.num_heads} and by 4")
  if not 0.0 <= m.class_dropout_prob < 1.0:
    raise ValueError(f"class_dropout_prob={m.class_dropout_prob!r} must be in [0, 1)")
  residual_lib.check_field(m)
  fields.check_execution(m)
  routing.check_fields(m)
  check_repa_fields(m)


def check_repa_fields(m) -> None:
  """One-line errors for the REPA fields (``repa_depth``, ``repa_dims``, ``repa_hidden``,
  ``flow_convention``)."""
  validate.check_choice("flow_convention", m.flow_convention, FLOW_CONVENTIONS)
  validate.check_int("repa_depth", m.repa_depth, 0, m.depth)
  if not m.repa_depth:
    return
  validate.check_int("repa_hidden", m.repa_hidden)
  if not m.repa_dims or not all(validate.is_int(d) and d > 0 for d in m.repa_dims):
    raise validate.not_allowed("repa_dims", m.repa_dims, "it must be a non-empty tuple of "
                               "positive ints (one target width per encoder)")
  if m.residual_routing == "attnres":
    raise validate.not_allowed("repa_depth", m.repa_depth, "residual_routing='attnres' has no "
                               "block stream to align (use 'plain', REPA's SiT)")
  if m.residual_routing == "none" and m.repa_depth > m.depth // 2:
    raise validate.not_allowed("repa_depth", m.repa_depth, f"with residual_routing='none' it "
                               f"must be <= depth/2 = {m.depth // 2} (an encoder block)")


FLOW_CONVENTIONS = ("sit", "repa")


SIT_SIZES = {
    "XL": dict(depth=28, dim=1152, num_heads=16),
    "L": dict(depth=24, dim=1024, num_heads=16),
    "B": dict(depth=12, dim=768, num_heads=12),
    "S": dict(depth=12, dim=384, num_heads=6),
    "mnist": dict(depth=8, dim=128, num_heads=4),  # the CPU config on the embedded digits
    "micro": dict(depth=4, dim=32, num_heads=2),
}
SIT_PRESETS = {f"{size}/{p}": dict(patch_size=p, **cfg)
               for size, cfg in SIT_SIZES.items() for p in (2, 4, 8)}


def sit(preset: str, **overrides) -> SiT:
  """A ``SiT`` from a preset name such as 'XL/2', 'B/4' or 'micro/2', with field overrides."""
  return fields.from_preset(SiT, SIT_PRESETS, preset, overrides)


def init_args(model: SiT, batch: int = 1):
  """Example inputs of ``model.init``: latents ``(batch, S, S, C)``, times ``(batch,)`` and labels
  ``(batch,)`` int32, all zeros."""
  return (jnp.zeros((batch, model.input_size, model.input_size, model.in_channels), jnp.float32),
          jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.int32))


def abstract_params(model: SiT):
  """Shapes and dtypes of ``model``'s parameters (``jax.eval_shape`` of its init: nothing
  allocated)."""
  return jax.eval_shape(model.init, jax.random.key(0), *init_args(model))["params"]
