"""The KL autoencoder of Stable Diffusion (diffusers ``AutoencoderKL``; sd-vae-ft-ema), in Flax.

SiT trains on ``z = vae.encode(x).latent_dist.sample() * 0.18215`` of ADM-centre-cropped images
in [-1, 1] (docs/official_code.md 5.2) and decodes ``vae.decode(z / 0.18215)`` for FID. Images and
latents are NHWC: ``x (N, H, W, 3)`` -> ``z (N, H/f, W/f, latent_channels)`` with
``f = 2 ** (len(block_out_channels) - 1)`` (8 for sd-vae-ft-ema: 256x256 images, 32x32x4 latents).

Architecture (diffusers 0.42, default ``AutoencoderKL`` blocks; parameter names mirror the
state_dict so ``convert_external.vae_from_torch`` is a renaming):
  encoder: conv_in -> per level [ResnetBlock x layers_per_block, Downsample (not the last)]
           -> mid (Resnet, single-head self-attention, Resnet) -> GroupNorm -> SiLU -> conv_out
           (2 * latent_channels) ; quant_conv (1x1) ; mean, logvar = split ; logvar clipped to
           [-30, 20] ; sample = mean + exp(logvar / 2) * eps.
  decoder: post_quant_conv (1x1) -> conv_in -> mid -> per level, widest first
           [ResnetBlock x (layers_per_block + 1), Upsample (not the last)] -> GroupNorm -> SiLU
           -> conv_out.
ResnetBlock: ``x' = shortcut(x) + conv2(silu(gn2(conv1(silu(gn1(x))))))`` (shortcut a 1x1 conv
when the width changes). Downsample pads one zero row/column at the bottom/right and applies a
stride-2 3x3 conv without padding; Upsample is nearest x2 then a 3x3 conv. GroupNorm eps 1e-6.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from decay_jax.models.layers import Dtype

GN_EPS = 1e-6
LOGVAR_RANGE = (-30.0, 20.0)

# diffusers' AutoencoderKL config of stabilityai/sd-vae-ft-ema (and sd-vae-ft-mse).
SD_VAE_FT_EMA = dict(in_channels=3, out_channels=3, block_out_channels=(128, 256, 512, 512),
                     layers_per_block=2, latent_channels=4, norm_num_groups=32,
                     scaling_factor=0.18215)


def _conv(features: int, kernel: int, name: str, dtype, stride: int = 1, pad: int = None):
  pad = kernel // 2 if pad is None else pad
  return nn.Conv(features, (kernel, kernel), (stride, stride), padding=((pad, pad), (pad, pad)),
                 dtype=dtype, name=name)


def _norm(groups: int, name: str):
  # use_fast_variance=False: E[(x - mean)^2] as torch computes it (E[x^2] - mean^2 loses digits).
  return nn.GroupNorm(num_groups=groups, epsilon=GN_EPS, use_fast_variance=False,
                      dtype=jnp.float32, name=name)


class ResnetBlock(nn.Module):
  out_channels: int
  groups: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = _conv(self.out_channels, 3, "conv1", self.dtype)(nn.silu(_norm(self.groups, "norm1")(x)))
    h = _conv(self.out_channels, 3, "conv2", self.dtype)(nn.silu(_norm(self.groups, "norm2")(h)))
    if x.shape[-1] != self.out_channels:
      x = _conv(self.out_channels, 1, "conv_shortcut", self.dtype)(x)
    return x + h


class SelfAttention(nn.Module):
  """Single-head attention over the H*W positions, residual (diffusers ``Attention`` in the VAE)."""
  groups: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    n, h, w, c = x.shape
    t = _norm(self.groups, "group_norm")(x).reshape(n, h * w, c)
    dense = lambda name: nn.Dense(c, dtype=self.dtype, name=name)
    q, k, v = dense("to_q")(t), dense("to_k")(t), dense("to_v")(t)
    scores = jnp.einsum("nqc,nkc->nqk", q, k).astype(jnp.float32) / jnp.sqrt(jnp.float32(c))
    att = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = dense("to_out_0")(jnp.einsum("nqk,nkc->nqc", att, v))
    return x + out.reshape(n, h, w, c).astype(x.dtype)


class MidBlock(nn.Module):
  channels: int
  groups: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = ResnetBlock(self.channels, self.groups, self.dtype, name="resnets_0")(x)
    x = SelfAttention(self.groups, self.dtype, name="attentions_0")(x)
    return ResnetBlock(self.channels, self.groups, self.dtype, name="resnets_1")(x)


class Downsample(nn.Module):
  """One zero row/column at the bottom/right, then a stride-2 3x3 conv without padding."""
  channels: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))
    return _conv(self.channels, 3, "conv", self.dtype, stride=2, pad=0)(x)


class Upsample(nn.Module):
  """Nearest-neighbour x2, then a 3x3 conv."""
  channels: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
    return _conv(self.channels, 3, "conv", self.dtype)(x)


class Level(nn.Module):
  """One encoder (``down_blocks_i``) or decoder (``up_blocks_i``) level."""
  out_channels: int
  num_layers: int
  groups: int
  resample: str  # 'down', 'up' or 'none'
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    for j in range(self.num_layers):
      x = ResnetBlock(self.out_channels, self.groups, self.dtype, name=f"resnets_{j}")(x)
    if self.resample == "down":
      x = Downsample(self.out_channels, self.dtype, name="downsamplers_0")(x)
    elif self.resample == "up":
      x = Upsample(self.out_channels, self.dtype, name="upsamplers_0")(x)
    return x


class Encoder(nn.Module):
  block_out_channels: Tuple[int, ...]
  layers_per_block: int
  latent_channels: int
  groups: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = _conv(self.block_out_channels[0], 3, "conv_in", self.dtype)(x)
    last = len(self.block_out_channels) - 1
    for i, ch in enumerate(self.block_out_channels):
      x = Level(ch, self.layers_per_block, self.groups, "none" if i == last else "down",
                self.dtype, name=f"down_blocks_{i}")(x)
    x = MidBlock(self.block_out_channels[-1], self.groups, self.dtype, name="mid_block")(x)
    x = nn.silu(_norm(self.groups, "conv_norm_out")(x))
    return _conv(2 * self.latent_channels, 3, "conv_out", self.dtype)(x)


class Decoder(nn.Module):
  block_out_channels: Tuple[int, ...]
  layers_per_block: int
  out_channels: int
  groups: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, z):
    widths = tuple(reversed(self.block_out_channels))
    x = _conv(widths[0], 3, "conv_in", self.dtype)(z)
    x = MidBlock(widths[0], self.groups, self.dtype, name="mid_block")(x)
    last = len(widths) - 1
    for i, ch in enumerate(widths):
      x = Level(ch, self.layers_per_block + 1, self.groups, "none" if i == last else "up",
                self.dtype, name=f"up_blocks_{i}")(x)
    x = nn.silu(_norm(self.groups, "conv_norm_out")(x))
    return _conv(self.out_channels, 3, "conv_out", self.dtype)(x)


class AutoencoderKL(nn.Module):
  """``encode(x) -> (mean, logvar)``, ``sample_latent(x, key) -> z * scaling_factor``,
  ``decode(z) -> x``. ``__call__`` (for init) encodes and decodes the mean."""
  in_channels: int = 3
  out_channels: int = 3
  block_out_channels: Sequence[int] = (128, 256, 512, 512)
  layers_per_block: int = 2
  latent_channels: int = 4
  norm_num_groups: int = 32
  scaling_factor: float = 0.18215
  dtype: Dtype = jnp.float32

  def __post_init__(self):
    # model.json stores lists; a tuple keeps the module hashable and its fields comparable.
    object.__setattr__(self, "block_out_channels", tuple(int(c) for c in self.block_out_channels))
    super().__post_init__()

  @property
  def downsample_factor(self) -> int:
    return 2 ** (len(self.block_out_channels) - 1)

  def setup(self):
    widths = tuple(int(c) for c in self.block_out_channels)
    for field in ("in_channels", "out_channels", "layers_per_block", "latent_channels",
                  "norm_num_groups"):
      if int(getattr(self, field)) < 1:
        raise ValueError(f"{field}={getattr(self, field)!r} is not allowed; it must be >= 1")
    bad = [c for c in widths if c % self.norm_num_groups]
    if not widths or bad:
      raise ValueError(f"block_out_channels={widths} is not allowed; every width must be a "
                       f"multiple of norm_num_groups={self.norm_num_groups}")
    self.encoder = Encoder(widths, self.layers_per_block, self.latent_channels,
                           self.norm_num_groups, self.dtype)
    self.quant_conv = _conv(2 * self.latent_channels, 1, None, self.dtype)
    self.post_quant_conv = _conv(self.latent_channels, 1, None, self.dtype)
    self.decoder = Decoder(widths, self.layers_per_block, self.out_channels,
                           self.norm_num_groups, self.dtype)

  def encode(self, x):
    """``x (N, H, W, in_channels)`` in [-1, 1] -> ``(mean, logvar)``, each ``(N, H/f, W/f, C)``."""
    moments = self.quant_conv(self.encoder(x)).astype(jnp.float32)
    mean, logvar = jnp.split(moments, 2, axis=-1)
    return mean, jnp.clip(logvar, *LOGVAR_RANGE)

  def sample_latent(self, x, noise):
    """The training latent: ``(mean + exp(logvar / 2) * noise) * scaling_factor``.

    ``noise`` is standard normal of the latent shape (callers seed it per example)."""
    mean, logvar = self.encode(x)
    return (mean + jnp.exp(0.5 * logvar) * noise) * self.scaling_factor

  def decode(self, z):
    """Unscaled latent ``z (N, h, w, latent_channels)`` -> image ``(N, h*f, w*f, out_channels)``.
    Callers divide training latents by ``scaling_factor`` first."""
    return self.decoder(self.post_quant_conv(z)).astype(jnp.float32)

  def __call__(self, x):
    mean, _ = self.encode(x)
    return self.decode(mean)
