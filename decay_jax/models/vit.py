"""The fine-tuning classifier: the decayed MAE encoder with upstream MAE's classification head.

Upstream MAE fine-tunes ``models_vit.VisionTransformer(global_pool=True)`` (docs/finetune.md 3):

    x = [cls; patch_embed(img)] + pos_embed          (N, 1+L, D), pos_embed trainable
    x = blocks(x)                                    decayed: a_k x + DropPath(f_k(x)) per sub-layer
    logits = head(fc_norm(mean(x[:, 1:], axis=1)))   (N, num_classes), cls token left out

The blocks are the pre-training ``MAEBlock`` with the pre-trained model's ``residual`` spec (the
same object: identity coefficients rebuilt from it as module constants, as in pre-training); drop
path rate ``linspace(0, drop_path, depth)[j]`` in block ``j``, on the branches only. There is no
final norm: upstream deletes the pretrained one with global pooling, and the decayed encoder has
none, so both give the raw last-block patch tokens to a fresh ``fc_norm``. Parameter names follow
timm's (``cls_token``, ``pos_embed``, ``patch_embed.proj``, ``blocks.j.*``, ``fc_norm``, ``head``),
so the layer-wise learning-rate rule reads them directly (``decay_jax.train.finetune_optim``).
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import validate
from decay_jax.models import fields, layers, stack
from decay_jax.models import mae as mae_lib
from decay_jax.models import residual as residual_lib
from decay_jax.models.blocks import MAEBlock
from decay_jax.models.layers import Dtype
from decay_jax.models.residual import Residual

HEAD_INIT_STD = 2e-5  # upstream main_finetune.py: trunc_normal_(head.weight, std=2e-5)


def drop_path_rates(depth: int, drop_path: float) -> np.ndarray:
  """timm's per-block rates, float32 ``linspace(0, drop_path, depth)``: block 0 never drops
  (``Residual.drop_path_rates``, the one rule of every model)."""
  return np.asarray(stack.drop_rates(Residual(drop_path=drop_path), depth))


class ViTClassifier(residual_lib.HasResidual, fields.PatchGrid, nn.Module):
  """Decayed ViT encoder + patch-token mean + ``fc_norm`` + ``head``. Input ``(N, H, W, C)``,
  output logits ``(N, num_classes)`` float32.

  ``residual`` (``residual.Residual``, default ``alpha_min=1``, ``drop_path=0.1``) is the blocks'
  update ``x <- alpha_k x + DropPath(f_k(x))``; ``shortcut_form='learnable'`` is not allowed here
  yet. ``drop_path`` (the largest rate) is the spec's field, as in pre-training: the constructor
  and ``model.json`` still take it flat (``ViTClassifier(drop_path=0.1)``), and ``from_mae`` sets
  the fine-tuning rate on the pre-trained spec.

  ``train`` switches drop path on: its uniform draws are ``drop_u (depth, N, 2)`` (attention and
  MLP branch of every block) when given, else they come from the ``'dropout'`` RNG; evaluation uses
  the same parameters with ``train=False``.
  """
  num_classes: int
  img_size: int = 224
  patch_size: int = 16
  in_chans: int = 3
  dim: int = 768
  depth: int = 12
  num_heads: int = 12
  mlp_ratio: float = 4.0
  residual: Residual = Residual(drop_path=0.1)
  dtype: Dtype = jnp.float32
  attention_impl: Optional[str] = None
  remat_policy: str = "none"
  train: bool = False

  def __post_init__(self):
    fields.check_once(self, validate_vit_fields)
    super().__post_init__()

  @nn.compact
  def __call__(self, imgs, drop_u=None):
    x = layers.PatchEmbed(self.dim, self.patch_size, dtype=self.dtype, name="patch_embed")(imgs)
    x = x.astype(jnp.float32)
    cls_token = self.param("cls_token", layers.normal(0.02), (1, 1, self.dim))
    pos_embed = self.param(
        "pos_embed", lambda _, shape: jnp.asarray(layers.sincos_2d(self.dim, self.grid, True))[None],
        (1, self.num_patches + 1, self.dim))
    x = jnp.concatenate([jnp.broadcast_to(cls_token, (x.shape[0], 1, self.dim)), x], axis=1)
    x = x + pos_embed
    blocks = stack.scan(MAEBlock, self.depth, self.remat_policy)(
        num_heads=self.num_heads, mlp_ratio=self.mlp_ratio,
        residual=stack.blocks_residual(self.residual, self.depth), dtype=self.dtype,
        attention_impl=self.attention_impl, stochastic_depth=self.train,
        name="blocks")
    stream = stack.create(self, self.residual, self.depth, self.dim)
    x, _ = blocks(stack.expand(self.residual, x),
                  stack.inputs(self.residual, stream, drop_u=drop_u))
    x = stack.reduce(self.residual, x)  # hyper-connections: the streams' sum, as MAE's features
    pooled = layers.layer_norm("fc_norm")(x[:, 1:].mean(axis=1))
    head = nn.Dense(self.num_classes, dtype=self.dtype, name="head",
                    kernel_init=nn.initializers.truncated_normal(HEAD_INIT_STD, lower=-2e5,
                                                                 upper=2e5),
                    bias_init=layers.zeros)
    return head(pooled).astype(jnp.float32)


def validate_vit_fields(m) -> None:
  """One-line errors for bad fields, raised at construction (before any compilation)."""
  fields.check_positive_ints(m, ("num_classes", "img_size", "patch_size", "in_chans", "dim",
                                 "depth", "num_heads"))
  fields.check_patches(m)
  if m.dim % m.num_heads or m.dim % 4:
    raise ValueError(f"dim={m.dim} is not allowed; it must be divisible by num_heads="
                     f"{m.num_heads} and by 4 (2-D sin-cos positions)")
  residual_lib.check_field(m)
  if m.residual.shortcut_form == "learnable":
    raise ValueError("shortcut_form='learnable' is not allowed for fine-tuning yet")
  fields.check_execution(m)


def vit(preset: str, num_classes: int, **overrides) -> ViTClassifier:
  """A classifier of an MAE preset's encoder sizes (``mae.MAE_PRESETS``; the decoder's are unused),
  for training from scratch or shaping programs; fine-tuning builds it with ``from_mae``."""
  validate.check_choice("preset", preset, tuple(mae_lib.MAE_PRESETS))
  sizes = {k: v for k, v in mae_lib.MAE_PRESETS[preset].items() if not k.startswith("decoder_")}
  return ViTClassifier(num_classes=num_classes, **dict(sizes, **overrides))


def from_mae(mae_model, num_classes: int, drop_path: float, **overrides) -> ViTClassifier:
  """The classifier over a pre-trained MAE's encoder: same sizes, same ``residual`` spec."""
  keep = ("img_size", "patch_size", "in_chans", "dim", "depth", "num_heads", "mlp_ratio",
          "residual", "dtype", "attention_impl", "remat_policy")
  kwargs = {k: getattr(mae_model, k) for k in keep}
  kwargs.update(overrides)
  return ViTClassifier(num_classes=num_classes, drop_path=drop_path, **kwargs)


def _cubic_weights(t: np.ndarray, a: float = -0.75) -> np.ndarray:
  """torch's cubic convolution weights (A = -0.75) for offsets -1, 0, 1, 2 at fraction ``t``."""
  def near(x):  # |x| <= 1
    return ((a + 2) * x - (a + 3)) * x * x + 1
  def far(x):  # 1 < |x| < 2
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
  return np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1)


def _bicubic_matrix(n_in: int, n_out: int) -> np.ndarray:
  """``(n_out, n_in)`` matrix of torch ``interpolate(mode='bicubic', align_corners=False)`` along
  one axis: source ``(o + 0.5) n_in / n_out - 0.5``, four taps, indices clamped to the edges."""
  src = (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5
  base = np.floor(src)
  w = _cubic_weights(src - base)
  m = np.zeros((n_out, n_in))
  for k in range(4):
    idx = np.clip(base.astype(int) - 1 + k, 0, n_in - 1)
    np.add.at(m, (np.arange(n_out), idx), w[:, k])
  return m


def interpolate_pos_embed(table: np.ndarray, new_grid: int) -> np.ndarray:
  """Upstream ``interpolate_pos_embed``: ``table (1+g*g, D)`` (cls row first) to a ``new_grid``
  grid; the cls row is kept and the patch rows are resized bicubically as torch does (A = -0.75,
  half-pixel centres, clamped edges, no antialiasing); identity when the grid is unchanged."""
  table = np.asarray(table, np.float64)
  grid = int(round(np.sqrt(table.shape[0] - 1)))
  if grid * grid != table.shape[0] - 1:
    raise ValueError(f"pos_embed with {table.shape[0]} rows is not allowed; it must be 1 + a square")
  if grid == new_grid:
    return table.astype(np.float32)
  m = _bicubic_matrix(grid, new_grid)
  patches = table[1:].reshape(grid, grid, -1)
  resized = np.einsum("ai,bj,ijd->abd", m, m, patches).reshape(new_grid * new_grid, -1)
  return np.concatenate([table[:1], resized]).astype(np.float32)


def init_from_mae(params, mae_model, mae_params) -> dict:
  """Classifier parameters from a pre-trained MAE, over the classifier's freshly initialised
  ``params``: the encoder's (``patch_embed``, ``cls_token``, ``blocks`` and, with
  hyper-connections, its ``hyper_*`` weights) copied; ``pos_embed`` =
  the MAE's fixed sin-cos table, interpolated to this grid (``interpolate_pos_embed``) and now
  trainable; ``fc_norm`` (1, 0) and ``head`` (N(0, 2e-5^2) weights, zero bias) kept as initialised,
  as upstream's loader leaves them (docs/finetune.md 3.2). The decoder, skip layers and decoder
  tokens of pre-training are not used.
  """
  out = dict(params)
  hyper = sorted(name for name in params if name.startswith("hyper_"))
  for name in ("patch_embed", "cls_token", "blocks", *hyper):
    src, dst = mae_params[name], params[name]
    if (jax.tree_util.tree_structure(src) != jax.tree_util.tree_structure(dst)
        or any(a.shape != b.shape for a, b in zip(jax.tree_util.tree_leaves(src),
                                                  jax.tree_util.tree_leaves(dst)))):
      raise ValueError(f"the pre-trained '{name}' does not fit this classifier (sizes differ)")
    out[name] = jax.tree_util.tree_map(jnp.asarray, src)
  grid = int(round(np.sqrt(params["pos_embed"].shape[1] - 1)))
  out["pos_embed"] = jnp.asarray(interpolate_pos_embed(mae_model.pos_embed(), grid))[None]
  return out
