"""DINOv2 ViT-S/B/L with patch 14 (Oquab et al. 2023), the layout of ``torch.hub
facebookresearch/dinov2`` (``dinov2_vit{s,b,l}14``) and timm's ``vit_{small,base,large}_patch14_dinov2``;
its ``x_norm_patchtokens`` are REPA's alignment target (docs/dinov2.md).

Forward of an image ``x (N, H, W, C)`` with ``H, W`` multiples of ``p = 14`` (``h = H/p, w = W/p``,
``T = h w`` patch tokens, ``R`` register tokens, width ``D``):

    t   = [cls; patch_embed(x)] + P(h, w)                         (N, 1+T, D)
    t   = [t_0; registers; t_1..T]                                (N, 1+R+T, D), R = 0 without
    t  <- t + ls1 * Attn(LN1(t));  t <- t + ls2 * MLP(LN2(t))     per block (LayerScale ``ls``)
    out = LN(t):  x_norm_clstoken out[:, 0] (N, D), x_norm_regtokens out[:, 1:1+R] (N, R, D),
                  x_norm_patchtokens out[:, 1+R:] (N, T, D); x_prenorm t (N, 1+R+T, D)

``P(h, w)`` is the stored table ``pos_embed (1, 1 + G*G, D)`` (``G = 37``: 518 px / 14): its cls row
unchanged, its ``G x G`` patch rows resized to ``h x w`` as torch ``F.interpolate(mode='bicubic')``
does (``pos_interpolation``): 'timm' (timm 1.0.31 ``resample_abs_pos_embed``: ``size=(h, w)``,
``antialias=True``; what REPA's ``load_encoders`` does to the hub model's table) or 'dinov2' (the
hub's ``interpolate_pos_encoding``: ``scale_factor=((h + 0.1)/G, (w + 0.1)/G)``,
``antialias=False``). The table is used as stored when ``(h, w) = (G, G)``.

All blocks: LayerNorm eps 1e-6, qkv / proj / MLP biases, exact-erf GELU, MLP ratio 4, head width 64,
LayerScale ``gamma (D,)`` initialised to ``layer_scale_init`` (1e-5, timm's; checkpoints overwrite
it). Parameters follow the hub's names (``patch_embed.proj``, ``cls_token``, ``pos_embed``,
``register_tokens``, ``blocks.j.{norm1,attn.qkv,attn.proj,ls1.gamma,norm2,mlp.fc1,mlp.fc2,ls2.gamma}``,
``norm``), the blocks scanned (a leading layer axis); ``decay_jax.io.convert_dinov2`` converts.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import validate
from decay_jax.models import fields, layers
from decay_jax.models.layers import Dtype

# hub name -> sizes (dinov2/models/vision_transformer.py vit_small / vit_base / vit_large; timm's
# vit_{small,base,large}_patch14_dinov2 are the same). ``_reg`` adds 4 register tokens.
PRESETS = {
    "dinov2_vits14": dict(dim=384, depth=12, num_heads=6),
    "dinov2_vitb14": dict(dim=768, depth=12, num_heads=12),
    "dinov2_vitl14": dict(dim=1024, depth=24, num_heads=16),
}
PRESETS.update({f"{k}_reg": dict(v, num_register_tokens=4) for k, v in list(PRESETS.items())})
POS_INTERPOLATIONS = ("timm", "dinov2")
HUB_OFFSET = 0.1  # dinov2 hub interpolate_offset
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # timm.data IMAGENET_DEFAULT_MEAN / STD (REPA train.py)
IMAGENET_STD = (0.229, 0.224, 0.225)
REPA_SIZE = 224  # REPA train.py: 224 * (resolution // 256) for 256 px images


# ------------------------------------------------------------------------------------------------
# torch's bicubic interpolation as matrices


def _keys_cubic(x: np.ndarray, a: float) -> np.ndarray:
  """Keys' cubic convolution kernel ``k_a(|x|)`` (zero for ``|x| >= 2``)."""
  x = np.abs(x)
  inner = ((a + 2) * x - (a + 3)) * x * x + 1
  outer = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
  return np.where(x < 1, inner, np.where(x < 2, outer, 0.0))


def torch_bicubic_matrix(n_in: int, n_out: int, antialias: bool,
                         scale_factor: Optional[float] = None) -> np.ndarray:
  """``(n_out, n_in)`` float64 matrix ``M`` with ``y = M x`` equal to torch 2.x
  ``F.interpolate(mode='bicubic', align_corners=False)`` along one axis (CPU kernels,
  UpSampleKernel.cpp; coordinates in float32 as there).

  ``s = 1/scale_factor`` if given (torch keeps the factor), else ``n_in / n_out``.
  Without antialias: source ``u_o = s (o + 1/2) - 1/2``, taps ``floor(u_o) - 1 .. + 2`` clamped to
  the edges, weights ``k_a(u_o - i)`` with ``a = -0.75``. With antialias (PIL's filter): centre
  ``c_o = s (o + 1/2)``, support ``2 max(s, 1)``, taps ``i`` in ``[int(c_o - supp + 1/2),
  int(c_o + supp + 1/2))`` cut to ``[0, n_in)``, weights ``k_a((i - c_o + 1/2) / max(s, 1))`` with
  ``a = -0.5``, normalised to sum 1; an axis whose size does not change is copied.
  """
  f32 = np.float32
  o = np.arange(n_out)
  m = np.zeros((n_out, n_in))
  if antialias and n_in == n_out:
    return np.eye(n_in)
  s = f32(1.0 / scale_factor) if scale_factor else f32(n_in) / f32(n_out)
  if not antialias:
    src = s * (o.astype(f32) + f32(0.5)) - f32(0.5)
    base = np.floor(src)
    frac = (src - base).astype(np.float64)
    for k in range(-1, 3):
      np.add.at(m, (o, np.clip(base.astype(int) + k, 0, n_in - 1)), _keys_cubic(frac - k, -0.75))
    return m
  support = f32(2.0) * max(s, f32(1.0))
  inv = f32(1.0) / max(s, f32(1.0))
  centre = s * (o.astype(f32) + f32(0.5))
  lo = np.maximum((centre - support + f32(0.5)).astype(int), 0)
  hi = np.minimum((centre + support + f32(0.5)).astype(int), n_in)
  hi = np.minimum(hi, lo + int(np.ceil(support)) * 2 + 1)  # torch's max_interp_size clip
  i = np.arange(n_in)
  w = _keys_cubic(((i[None].astype(f32) - centre[:, None] + f32(0.5)) * inv).astype(np.float64),
                  -0.5)
  w = np.where((i[None] >= lo[:, None]) & (i[None] < hi[:, None]), w, 0.0)
  total = w.sum(axis=1, keepdims=True)
  return w / np.where(total == 0, 1.0, total)


def resize_bicubic(x, size: Tuple[int, int], antialias: bool = False,
                   scale_factor: Optional[Tuple[float, float]] = None):
  """``x (N, H, W, C)`` -> ``(N, h, w, C)`` float32, torch ``F.interpolate(mode='bicubic')``'s
  numbers (``torch_bicubic_matrix`` per axis; float32 matmuls at full precision)."""
  sh, sw = scale_factor or (None, None)
  mh = jnp.asarray(torch_bicubic_matrix(x.shape[1], size[0], antialias, sh), jnp.float32)
  mw = jnp.asarray(torch_bicubic_matrix(x.shape[2], size[1], antialias, sw), jnp.float32)
  hi = jax.lax.Precision.HIGHEST
  x = jnp.einsum("ai,nijc->najc", mh, x.astype(jnp.float32), precision=hi)
  return jnp.einsum("bj,najc->nabc", mw, x, precision=hi)


def resample_pos_embed(pos_embed, grid: Tuple[int, int], mode: str = "timm"):
  """``pos_embed (1, 1 + G*G, D)`` -> ``(1, 1 + h*w, D)`` for a ``grid = (h, w)`` token grid: the
  cls row kept, the patch rows resized bicubically (``mode``: 'timm' or 'dinov2', module doc);
  unchanged when ``(h, w) = (G, G)``."""
  validate.check_choice("pos_interpolation", mode, POS_INTERPOLATIONS)
  d = pos_embed.shape[-1]
  g = int(round(np.sqrt(pos_embed.shape[1] - 1)))
  if g * g != pos_embed.shape[1] - 1:
    raise ValueError(f"pos_embed with {pos_embed.shape[1]} rows is not allowed; it must be "
                     "1 + a square")
  h, w = grid
  if (h, w) == (g, g):
    return pos_embed
  patches = pos_embed[:, 1:].reshape(1, g, g, d)
  if mode == "timm":
    patches = resize_bicubic(patches, (h, w), antialias=True)
  else:
    patches = resize_bicubic(patches, (h, w), antialias=False,
                             scale_factor=((h + HUB_OFFSET) / g, (w + HUB_OFFSET) / g))
  return jnp.concatenate([pos_embed[:, :1].astype(jnp.float32), patches.reshape(1, h * w, d)],
                         axis=1)


def repa_size(resolution: int) -> int:
  """REPA's encoder input side for ``resolution`` px images: ``224 * (resolution // 256)``."""
  return REPA_SIZE * (resolution // 256)


def repa_preprocess(images, size: int = REPA_SIZE):
  """REPA ``train.py`` ``preprocess_raw_image`` for 'dinov2': pixels ``(N, H, W, 3)`` in 0..255
  (uint8 or float) -> float32 ``(N, size, size, 3)``:

      y = resize_bicubic((x / 255 - mean) / std, (size, size))      mean, std: ImageNet's

  with torch's bicubic (``a = -0.75``, no antialias: REPA calls ``F.interpolate(x, 224,
  mode='bicubic')``), after the normalisation as REPA does (resizing is affine with weights
  summing to 1, so the order changes only rounding). REPA's size is ``repa_size(resolution)``:
  224 for 256 px, 448 for 512 px.
  """
  x = images.astype(jnp.float32) / 255.0
  x = (x - jnp.asarray(IMAGENET_MEAN, jnp.float32)) / jnp.asarray(IMAGENET_STD, jnp.float32)
  return resize_bicubic(x, (size, size), antialias=False)


# ------------------------------------------------------------------------------------------------
# the network


class LayerScale(nn.Module):
  """``x * gamma``, ``gamma (D,)`` initialised to ``init`` (timm / hub ``LayerScale``)."""
  init: float

  @nn.compact
  def __call__(self, x):
    gamma = self.param("gamma", nn.initializers.constant(self.init), (x.shape[-1],))
    return x * gamma


class DINOv2Block(nn.Module):
  """``t <- t + ls1 Attn(LN1(t)); t <- t + ls2 MLP(LN2(t))``; ``(N, T, D)`` in and out (float32
  residual stream, branches in ``dtype``). Returns ``(t, None)`` for ``nn.scan``."""
  num_heads: int
  mlp_ratio: float = 4.0
  layer_scale_init: float = 1e-5
  dtype: Dtype = jnp.float32
  attention_impl: Optional[str] = None

  @nn.compact
  def __call__(self, x, _=None):
    init = layers.normal(0.02)
    h = layers.Attention(self.num_heads, self.dtype, proj_init=init, qkv_init=init,
                         implementation=self.attention_impl,
                         name="attn")(layers.layer_norm("norm1")(x))
    x = x + LayerScale(self.layer_scale_init, name="ls1")(h.astype(jnp.float32))
    h = layers.Mlp(int(x.shape[-1] * self.mlp_ratio), approximate_gelu=False, dtype=self.dtype,
                   fc1_init=init, fc2_init=init, name="mlp")(layers.layer_norm("norm2")(x))
    x = x + LayerScale(self.layer_scale_init, name="ls2")(h.astype(jnp.float32))
    return x, None


class DINOv2(nn.Module):
  """DINOv2 ViT feature extractor (module doc). Input ``(N, H, W, in_chans)`` float, ImageNet-
  normalised (``repa_preprocess``), ``H`` and ``W`` multiples of ``patch_size``; output the dict
  of the hub's ``forward_features`` (without ``masks``): ``x_norm_clstoken (N, D)``,
  ``x_norm_regtokens (N, R, D)``, ``x_norm_patchtokens (N, T, D)``, ``x_prenorm (N, 1+R+T, D)``,
  float32; ``T = (H/p)(W/p)`` in row-major order.

  ``pos_grid``: the side ``G`` of the stored position table (37: the checkpoints' 518 px);
  ``pos_interpolation``: 'timm' or 'dinov2' (module doc); ``layer_scale_init``: LayerScale's
  initial gamma; ``dtype``: compute dtype of the matmuls; ``attention_impl``: as
  ``layers.resolve_attention``.
  """
  patch_size: int = 14
  dim: int = 768
  depth: int = 12
  num_heads: int = 12
  mlp_ratio: float = 4.0
  in_chans: int = 3
  pos_grid: int = 37
  num_register_tokens: int = 0
  layer_scale_init: float = 1e-5
  pos_interpolation: str = "timm"
  dtype: Dtype = jnp.float32
  attention_impl: Optional[str] = None

  remat_policy = "none"  # not a field: for fields.check_execution

  def __post_init__(self):
    fields.check_once(self, validate_dinov2_fields)
    super().__post_init__()

  @nn.compact
  def __call__(self, imgs) -> Dict[str, jax.Array]:
    n, hh, ww, _ = imgs.shape
    p = self.patch_size
    if hh % p or ww % p:
      raise ValueError(f"image size {hh}x{ww} is not allowed; it must be a multiple of "
                       f"patch_size={p}")
    x = layers.PatchEmbed(self.dim, p, dtype=self.dtype, name="patch_embed")(imgs)
    x = x.astype(jnp.float32)
    cls_token = self.param("cls_token", layers.normal(1e-6), (1, 1, self.dim))
    pos_embed = self.param("pos_embed", layers.normal(0.02),
                           (1, self.pos_grid ** 2 + 1, self.dim))
    x = jnp.concatenate([jnp.broadcast_to(cls_token, (n, 1, self.dim)), x], axis=1)
    x = x + resample_pos_embed(pos_embed, (hh // p, ww // p), self.pos_interpolation)
    r = self.num_register_tokens
    if r:
      reg = self.param("register_tokens", layers.normal(1e-6), (1, r, self.dim))
      x = jnp.concatenate([x[:, :1], jnp.broadcast_to(reg, (n, r, self.dim)), x[:, 1:]], axis=1)
    blocks = layers.scan_blocks(DINOv2Block, self.depth, in_axes=())(
        num_heads=self.num_heads, mlp_ratio=self.mlp_ratio,
        layer_scale_init=self.layer_scale_init, dtype=self.dtype,
        attention_impl=self.attention_impl, name="blocks")
    x, _ = blocks(x)
    out = layers.layer_norm("norm")(x)
    return {"x_norm_clstoken": out[:, 0], "x_norm_regtokens": out[:, 1:1 + r],
            "x_norm_patchtokens": out[:, 1 + r:], "x_prenorm": x}


def validate_dinov2_fields(m) -> None:
  """One-line errors for bad fields, raised at construction (before any compilation)."""
  fields.check_positive_ints(m, ("patch_size", "dim", "depth", "num_heads", "in_chans",
                                 "pos_grid"))
  validate.check_int("num_register_tokens", m.num_register_tokens, minimum=0)
  if m.dim % m.num_heads:
    raise ValueError(f"dim={m.dim} is not allowed; it must be divisible by num_heads="
                     f"{m.num_heads}")
  validate.check_range("mlp_ratio", m.mlp_ratio, 0.0, low_open=True)
  validate.check_range("layer_scale_init", m.layer_scale_init)
  validate.check_choice("pos_interpolation", m.pos_interpolation, POS_INTERPOLATIONS)
  fields.check_execution(m)


def dinov2(preset: str, **overrides) -> DINOv2:
  """A DINOv2 of a hub preset (``PRESETS``: ``dinov2_vit{s,b,l}14`` and their ``_reg``)."""
  validate.check_choice("preset", preset, tuple(PRESETS))
  return DINOv2(**dict(PRESETS[preset], **overrides))
