"""Masked autoencoder with decayed identity shortcuts and U-Net skip layers (docs/official_code.md 1).

Differences from upstream MAE that the official model makes, all reproduced here:
  * encoder blocks use decayed shortcuts (schedule over all ``2 * depth`` sublayers), no final LN;
  * the decoder does not read the encoder latent: its input is
    ``decoder_embed([decoder_cls ; sincos[1:]])``, identical for every image, and all image
    information enters through the SkipLayers;
  * SkipLayer ``k`` feeds decoder block ``k`` with the output of encoder block ``skip_ids[-1-k]``
    (deepest first); ``skip_ids`` are the odd block indices. Encoders deeper than twice the
    decoder have more skip outputs than decoder blocks: the official code builds SkipLayers for
    them that are never used (and crash DDP); we do not build them;
  * zero-initialised ``attn.proj``, ``mlp.fc2``, SkipLayer output and ``decoder_pred``.

Images are ``(N, H, W, C)``; patch vectors use the (row, col, channel) order of the loss target.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from decay_jax.models import fields, layers, stack
from decay_jax.models import residual as residual_lib
from decay_jax.models.blocks import MAEBlock
from decay_jax.models.layers import Dtype
from decay_jax.models.residual import Residual


class SkipLayer(nn.Module):
  """Long skip from one encoder block into the decoder stream (docs/official_code.md 1.7).

  ``u: (N, 1+L, d)`` decoder stream, ``s: (N, 1+K, D)`` encoder output on the visible tokens,
  ``ids_restore: (N, L)``. Missing tokens are filled with this layer's own mask token (encoder
  width), the sequence is unshuffled, and ``u + fc([s~ ; u])`` is returned, where
  ``fc = Linear(D+d, d) -> SiLU -> Linear(d, d)`` with a zero-initialised last weight.
  """
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, u, s, ids_restore):
    n, t, d = u.shape
    enc_dim = s.shape[-1]
    mask_token = self.param("mask_token", layers.normal(0.02), (1, 1, enc_dim))
    num_masked = t - s.shape[1]
    tokens = jnp.concatenate(
        [s[:, 1:], jnp.broadcast_to(mask_token, (n, num_masked, enc_dim)).astype(s.dtype)], axis=1)
    tokens = jnp.take_along_axis(tokens, ids_restore[:, :, None], axis=1)
    s_full = jnp.concatenate([s[:, :1], tokens], axis=1)
    h = jnp.concatenate([s_full, u.astype(s_full.dtype)], axis=-1)
    h = nn.Dense(d, dtype=self.dtype, kernel_init=layers.xavier_uniform, bias_init=layers.zeros,
                 name="fc0")(h)
    h = nn.silu(h)
    h = nn.Dense(d, dtype=self.dtype, kernel_init=layers.zeros, bias_init=layers.zeros,
                 name="fc2")(h)
    return u + h.astype(u.dtype)


def random_masking(noise, len_keep: int):
  """Per-example random masking from uniform noise ``(N, L)`` (docs/official_code.md 1.6).

  Returns ``ids_keep (N, len_keep)`` (shuffled order), ``mask (N, L)`` (1 = removed, in original
  patch order) and ``ids_restore (N, L)``.
  """
  ids_shuffle = jnp.argsort(noise, axis=1)
  ids_restore = jnp.argsort(ids_shuffle, axis=1)
  ids_keep = ids_shuffle[:, :len_keep]
  n, length = noise.shape
  mask = jnp.ones((n, length), jnp.float32).at[:, :len_keep].set(0.0)
  mask = jnp.take_along_axis(mask, ids_restore, axis=1)
  return ids_keep, mask, ids_restore


def norm_pix_target(target):
  """Per-patch ``(t - mean) / sqrt(var + 1e-6)`` with the UNBIASED variance (torch ``var``)."""
  mean = target.mean(axis=-1, keepdims=True)
  var = target.var(axis=-1, keepdims=True, ddof=1)
  return (target - mean) / (var + 1.0e-6) ** 0.5


class MaskedAutoencoder(residual_lib.HasResidual, fields.PatchGrid, nn.Module):
  """The official decayed-shortcut MAE (``MaskedAutoencoderViT`` of models_mae.py).

  ``residual`` (``residual.Residual``; default ``alpha_min=1``, the standard residual network) is
  the update of every encoder sublayer, ``x <- alpha_k x + f_k(x)`` over ``k = 0 .. 2 depth - 1``;
  the coefficients ``alpha (depth, 2)`` are a module constant (a parameter ``alpha`` for
  ``shortcut_form='learnable'``). The decoder blocks are plain ``x + f(x)``. With
  hyper-connections the encoder carries ``n`` streams and a block's output is their sum.
  """
  img_size: int = 224
  patch_size: int = 16
  in_chans: int = 3
  dim: int = 768
  depth: int = 12
  num_heads: int = 12
  decoder_dim: int = 512
  decoder_depth: int = 8
  decoder_num_heads: int = 16
  mlp_ratio: float = 4.0
  norm_pix_loss: bool = True
  mask_ratio: float = 0.75
  residual: Residual = Residual()
  dtype: Dtype = jnp.float32
  attention_impl: Optional[str] = None
  remat_policy: str = "none"

  def __post_init__(self):
    fields.check_once(self, validate_mae_fields)
    super().__post_init__()

  # ----- constants derived from the fields -------------------------------------------------------
  @property
  def len_keep(self) -> int:
    return int(self.num_patches * (1 - self.mask_ratio))

  @property
  def skip_ids(self) -> tuple:
    """Encoder blocks whose outputs feed SkipLayers: the odd indices (official ``skip_id``)."""
    return tuple(range(1, self.depth, 2))

  @property
  def num_skip_layers(self) -> int:
    """SkipLayers that the forward uses: one per decoder block, at most one per skip output."""
    return min(len(self.skip_ids), self.decoder_depth)

  # ----- modules ---------------------------------------------------------------------------------
  def setup(self):
    self.patch_embed = layers.PatchEmbed(
        self.dim, self.patch_size, dtype=self.dtype,
        bias_init=layers.torch_conv_bias_init(self.in_chans * self.patch_size ** 2))
    self.cls_token = self.param("cls_token", layers.normal(0.02), (1, 1, self.dim))
    self.decoder_cls_token = self.param("decoder_cls_token", layers.normal(0.02),
                                        (1, 1, self.decoder_dim))
    self.stream = stack.create(self, self.residual, self.depth, self.dim)
    self.blocks = stack.scan(MAEBlock, self.depth, self.remat_policy)(
        num_heads=self.num_heads, mlp_ratio=self.mlp_ratio,
        residual=stack.blocks_residual(self.residual, self.depth), dtype=self.dtype,
        attention_impl=self.attention_impl)
    self.skip = [SkipLayer(self.dtype) for k in range(self.num_skip_layers)]
    self.decoder_embed = nn.Dense(self.decoder_dim, dtype=self.dtype,
                                  kernel_init=layers.xavier_uniform, bias_init=layers.zeros)
    self.decoder_blocks = [  # plain residual blocks: Residual() with alpha (1, 1)
        MAEBlock(num_heads=self.decoder_num_heads, mlp_ratio=self.mlp_ratio, residual=Residual(),
                 dtype=self.dtype, attention_impl=self.attention_impl)
        for _ in range(self.decoder_depth)]
    self.decoder_norm = layers.layer_norm()
    self.decoder_pred = nn.Dense(self.patch_size ** 2 * self.in_chans, dtype=self.dtype,
                                 kernel_init=layers.zeros, bias_init=layers.zeros)

  def pos_embed(self) -> np.ndarray:
    return layers.sincos_2d(self.dim, self.grid, cls_token=True)

  def decoder_pos_embed(self) -> np.ndarray:
    return layers.sincos_2d(self.decoder_dim, self.grid, cls_token=True)

  # ----- forward ---------------------------------------------------------------------------------
  def embed(self, imgs):
    """Patch tokens plus positions, ``(N, L, D)`` float32."""
    return self.patch_embed(imgs).astype(jnp.float32) + self.pos_embed()[None, 1:]

  def run_encoder(self, x, drop_u=None):
    """Prepends cls, runs all blocks. Returns every block's output, ``(depth, N, T, D)``.
    ``drop_u (depth, N, 2)``: the drop-path draws of training (``residual.drop_path``)."""
    cls = self.cls_token + self.pos_embed()[None, :1]
    x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, self.dim)), x], axis=1)
    _, outs = self.blocks(stack.expand(self.residual, x),
                          stack.inputs(self.residual, self.stream, drop_u=drop_u))
    return outs

  def forward_encoder(self, imgs, noise, drop_u=None):
    """Masked encoder (1.6): ``(block outputs (depth, N, 1+K, D), mask, ids_restore)``."""
    x = self.embed(imgs)
    ids_keep, mask, ids_restore = random_masking(noise, self.len_keep)
    x = jnp.take_along_axis(x, ids_keep[:, :, None], axis=1)
    return self.run_encoder(x, drop_u), mask, ids_restore

  def forward_decoder(self, block_outs, ids_restore):
    """Decoder (1.8). Returns predictions ``(N, L, p*p*C)`` and per-block mean token norms."""
    n = block_outs.shape[1]
    query = jnp.concatenate([self.decoder_cls_token, self.decoder_pos_embed()[None, 1:]], axis=1)
    u = jnp.broadcast_to(self.decoder_embed(query).astype(jnp.float32),
                         (n, self.num_patches + 1, self.decoder_dim))
    norms = []
    for k, block in enumerate(self.decoder_blocks):
      if k < self.num_skip_layers:
        u = self.skip[k](u, block_outs[self.skip_ids[-1 - k]], ids_restore)
      u, _ = block(u, stack.PLAIN)
      norms.append(jnp.linalg.norm(u, axis=-1).mean())
    pred = self.decoder_pred(self.decoder_norm(u)).astype(jnp.float32)
    return pred[:, 1:], jnp.stack(norms)

  def loss(self, imgs, pred, mask):
    """Mean squared error on masked patches, optionally against norm-pix targets (1.9)."""
    target = layers.patchify(imgs.astype(jnp.float32), self.patch_size)
    if self.norm_pix_loss:
      target = norm_pix_target(target)
    per_patch = ((pred - target) ** 2).mean(axis=-1)
    return (per_patch * mask).sum() / mask.sum()

  def __call__(self, imgs, noise=None, drop_u=None) -> Dict[str, Any]:
    """Training forward. ``noise (N, L)`` fixes the masking; otherwise the 'masking' RNG is used.
    ``drop_u (depth, N, 2)``: the uniform draws of stochastic depth in the encoder (training with
    ``residual.drop_path > 0``); without them no branch is dropped.

    Returns a dict: ``loss`` (scalar), ``pred (N, L, p*p*C)``, ``mask (N, L)``, ``latent``
    (final block on the visible tokens, ``(N, 1+K, D)``), and the mean token L2 norms of every
    block's output, ``encoder_norms (depth,)`` and ``decoder_norms (decoder_depth,)``.
    """
    if noise is None:
      noise = jax.random.uniform(self.make_rng("masking"), (imgs.shape[0], self.num_patches))
    block_outs, mask, ids_restore = self.forward_encoder(imgs, noise, drop_u)
    pred, dec_norms = self.forward_decoder(block_outs, ids_restore)
    return dict(loss=self.loss(imgs, pred, mask), pred=pred, mask=mask, latent=block_outs[-1],
                encoder_norms=jnp.linalg.norm(block_outs, axis=-1).mean(axis=(1, 2)),
                decoder_norms=dec_norms)

  def features(self, imgs):
    """Unmasked encoder: every block's output on all tokens, ``(depth, N, 1+L, D)`` (1.10).

    ``features(imgs)[-1]`` is the official ``forward_feat`` (final block, raw, no LayerNorm).
    """
    return self.run_encoder(self.embed(imgs))


def validate_mae_fields(m) -> None:
  """One-line errors for bad model fields, raised at construction (before any compilation)."""
  fields.check_positive_ints(m, ("img_size", "patch_size", "in_chans", "dim", "depth", "num_heads",
                                 "decoder_dim", "decoder_depth", "decoder_num_heads"))
  fields.check_patches(m)
  if m.dim % m.num_heads or m.decoder_dim % m.decoder_num_heads:
    raise ValueError(f"dim={m.dim}/decoder_dim={m.decoder_dim} must be divisible by num_heads="
                     f"{m.num_heads}/decoder_num_heads={m.decoder_num_heads}")
  if m.dim % 4 or m.decoder_dim % 4:
    raise ValueError(f"dim={m.dim} and decoder_dim={m.decoder_dim} must be multiples of 4 "
                     "(2-D sin-cos positions)")
  if not 0.0 <= m.mask_ratio < 1.0:
    raise ValueError(f"mask_ratio={m.mask_ratio!r} is not allowed; it must be in [0, 1)")
  if m.depth < 2:
    raise ValueError(f"depth={m.depth} is not allowed; the skip layers need depth >= 2")
  residual_lib.check_field(m)
  fields.check_execution(m)


# Presets: (patch, dim, depth, heads, decoder dim, decoder depth, decoder heads). The official three
# plus CPU sizes: 'tiny' is the small-scale-study model (12x192, decoder 8x128, patch 4), 'mnist'
# the model of the README's main command (embedded 28x28 digits), 'micro' is for tests.
MAE_PRESETS = {
    "B/16": dict(patch_size=16, dim=768, depth=12, num_heads=12, decoder_dim=512, decoder_depth=8,
                 decoder_num_heads=16),
    "L/16": dict(patch_size=16, dim=1024, depth=24, num_heads=16, decoder_dim=512, decoder_depth=8,
                 decoder_num_heads=16),
    "H/14": dict(patch_size=14, dim=1280, depth=32, num_heads=16, decoder_dim=512, decoder_depth=8,
                 decoder_num_heads=16),
    "tiny/4": dict(img_size=32, patch_size=4, dim=192, depth=12, num_heads=3, decoder_dim=128,
                   decoder_depth=8, decoder_num_heads=4),
    "mnist/4": dict(img_size=28, patch_size=4, dim=128, depth=6, num_heads=4, decoder_dim=64,
                    decoder_depth=4, decoder_num_heads=4),
    "micro/4": dict(img_size=16, patch_size=4, dim=32, depth=4, num_heads=2, decoder_dim=16,
                    decoder_depth=3, decoder_num_heads=2),
}


def mae(preset: str, **overrides) -> MaskedAutoencoder:
  """A ``MaskedAutoencoder`` from a preset name (see ``MAE_PRESETS``) with field overrides."""
  return fields.from_preset(MaskedAutoencoder, MAE_PRESETS, preset, overrides)
