"""InceptionV3 in the FID variant (pytorch-fid's ``fid_inception_v3``), in Flax, for inference.

This is the network behind FID as pytorch-fid computes it: torchvision's ``Inception3`` layout with
the weights ported from TensorFlow's 2015-12-05 Inception graph (the graph ADM's evaluator runs),
and the graph's own quirks patched in: the average pools inside Mixed_5*/6*/7b ignore the padded
zeros (``count_include_pad=False``), and Mixed_7c pools with a 3x3 *max* pool. Parameter names
mirror pytorch-fid's state_dict (``pt_inception-2015-12-05-6726825d.pth``), so
``convert_external.inception_from_torch`` is a renaming; the 1008-way ``fc`` gives the logits of the
Inception Score.

Input: images ``(N, H, W, 3)`` float in [0, 1] (uint8 / 255), any size. As pytorch-fid's
``InceptionV3(resize_input=True, normalize_input=True)``: bilinear resize to 299x299
(``align_corners=False``, no antialiasing), ``2x - 1``, then the blocks. Output:
``{'pool': (N, 2048) final average pool (the FID feature), 'spatial': (N, 2023), 'logits':
(N, 1008)}``. BatchNorm is eval-mode (running statistics, eps 1e-3).

``spatial`` is the sFID feature of ADM's evaluator (guided-diffusion ``evaluations/evaluator.py``:
``FID_SPATIAL_NAME = "mixed_6/conv:0"``, then ``spatial[..., :7]`` and a reshape to ``(N, -1)``).
In the TF graph the seventh mixed block is ``mixed_6`` (``mixed``, ``mixed_1``, ``mixed_2`` are
Mixed_5b-d, ``mixed_3`` is Mixed_6a, ``mixed_4``-``mixed_7`` are Mixed_6b-e), and ``mixed_6/conv``
is its first branch, the 1x1 conv + BatchNorm + ReLU that torchvision names ``Mixed_6d.branch1x1``
(192 channels at 17x17). That branch is the first slice of the block's concatenated output, so
the feature is ``Mixed_6d``'s output ``[..., :7]`` flattened in (row, column, channel) order, the
order of TF's NHWC reshape: ``17 * 17 * 7 = 2023`` values (for the 299x299 input).
"""

from __future__ import annotations

from typing import Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from decay_jax.models.layers import Dtype

SIZE = 299
POOL_DIM = 2048
SPATIAL_BLOCK = "Mixed_6d"  # TF graph: mixed_6 (its branch ``conv`` is channels [:192])
SPATIAL_CHANNELS = 7        # ADM: spatial[..., :7]
SPATIAL_DIM = 17 * 17 * SPATIAL_CHANNELS
NUM_LOGITS = 1008
BN_EPS = 1e-3


def resize_bilinear(x, size: int = SIZE):
  """``F.interpolate(x, (size, size), mode='bilinear', align_corners=False)`` on NHWC."""
  n, _, _, c = x.shape
  return jax.image.resize(x, (n, size, size, c), method="bilinear", antialias=False)


class FrozenBatchNorm(nn.Module):
  """Eval-mode BatchNorm2d: ``(x - mean) / sqrt(var + eps) * scale + bias``."""

  @nn.compact
  def __call__(self, x):
    c = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (c,))
    bias = self.param("bias", nn.initializers.zeros, (c,))
    mean = self.param("mean", nn.initializers.zeros, (c,))
    var = self.param("var", nn.initializers.ones, (c,))
    x = x.astype(jnp.float32)
    return (x - mean) * (scale * jax.lax.rsqrt(var + BN_EPS)) + bias


class BasicConv(nn.Module):
  """Conv (no bias) -> BatchNorm -> ReLU (torchvision's ``BasicConv2d``)."""
  features: int
  kernel: Tuple[int, int] = (1, 1)
  stride: int = 1
  padding: Tuple[int, int] = (0, 0)
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    ph, pw = self.padding
    x = nn.Conv(self.features, self.kernel, (self.stride, self.stride),
                padding=((ph, ph), (pw, pw)), use_bias=False, dtype=self.dtype, name="conv")(x)
    return nn.relu(FrozenBatchNorm(name="bn")(x)).astype(self.dtype)


def _avg_pool_same(x):
  """3x3 stride-1 average pool, padding 1, padded zeros not counted (the TF graph's pool)."""
  return nn.avg_pool(x, (3, 3), (1, 1), padding=((1, 1), (1, 1)), count_include_pad=False)


def _max_pool(x, stride: int = 2, pad: int = 0):
  return nn.max_pool(x, (3, 3), (stride, stride), padding=((pad, pad), (pad, pad)))


class InceptionA(nn.Module):
  pool_features: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    conv = lambda f, k, name, pad=(0, 0): BasicConv(f, k, 1, pad, self.dtype, name=name)
    b1 = conv(64, (1, 1), "branch1x1")(x)
    b5 = conv(64, (5, 5), "branch5x5_2", (2, 2))(conv(48, (1, 1), "branch5x5_1")(x))
    b3 = conv(64, (1, 1), "branch3x3dbl_1")(x)
    b3 = conv(96, (3, 3), "branch3x3dbl_3", (1, 1))(conv(96, (3, 3), "branch3x3dbl_2", (1, 1))(b3))
    bp = conv(self.pool_features, (1, 1), "branch_pool")(_avg_pool_same(x))
    return jnp.concatenate([b1, b5, b3, bp], axis=-1)


class InceptionB(nn.Module):
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    b3 = BasicConv(384, (3, 3), 2, (0, 0), self.dtype, name="branch3x3")(x)
    d = BasicConv(64, (1, 1), 1, (0, 0), self.dtype, name="branch3x3dbl_1")(x)
    d = BasicConv(96, (3, 3), 1, (1, 1), self.dtype, name="branch3x3dbl_2")(d)
    d = BasicConv(96, (3, 3), 2, (0, 0), self.dtype, name="branch3x3dbl_3")(d)
    return jnp.concatenate([b3, d, _max_pool(x)], axis=-1)


class InceptionC(nn.Module):
  channels_7x7: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    c7 = self.channels_7x7
    conv = lambda f, k, name, pad=(0, 0): BasicConv(f, k, 1, pad, self.dtype, name=name)
    row, col = ((1, 7), (0, 3)), ((7, 1), (3, 0))  # (kernel, padding) of the factorised 7x7
    b1 = conv(192, (1, 1), "branch1x1")(x)
    b7 = conv(c7, (1, 1), "branch7x7_1")(x)
    b7 = conv(c7, row[0], "branch7x7_2", row[1])(b7)
    b7 = conv(192, col[0], "branch7x7_3", col[1])(b7)
    d = conv(c7, (1, 1), "branch7x7dbl_1")(x)
    for i, (f, (k, p)) in enumerate(((c7, col), (c7, row), (c7, col), (192, row)), start=2):
      d = conv(f, k, f"branch7x7dbl_{i}", p)(d)
    bp = conv(192, (1, 1), "branch_pool")(_avg_pool_same(x))
    return jnp.concatenate([b1, b7, d, bp], axis=-1)


class InceptionD(nn.Module):
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    b3 = BasicConv(192, (1, 1), 1, (0, 0), self.dtype, name="branch3x3_1")(x)
    b3 = BasicConv(320, (3, 3), 2, (0, 0), self.dtype, name="branch3x3_2")(b3)
    b7 = BasicConv(192, (1, 1), 1, (0, 0), self.dtype, name="branch7x7x3_1")(x)
    b7 = BasicConv(192, (1, 7), 1, (0, 3), self.dtype, name="branch7x7x3_2")(b7)
    b7 = BasicConv(192, (7, 1), 1, (3, 0), self.dtype, name="branch7x7x3_3")(b7)
    b7 = BasicConv(192, (3, 3), 2, (0, 0), self.dtype, name="branch7x7x3_4")(b7)
    return jnp.concatenate([b3, b7, _max_pool(x)], axis=-1)


class InceptionE(nn.Module):
  """``pool='avg'``: FIDInceptionE_1 (Mixed_7b); ``pool='max'``: FIDInceptionE_2 (Mixed_7c)."""
  pool: str = "avg"
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    conv = lambda f, k, name, pad=(0, 0): BasicConv(f, k, 1, pad, self.dtype, name=name)
    b1 = conv(320, (1, 1), "branch1x1")(x)
    b3 = conv(384, (1, 1), "branch3x3_1")(x)
    b3 = jnp.concatenate([conv(384, (1, 3), "branch3x3_2a", (0, 1))(b3),
                          conv(384, (3, 1), "branch3x3_2b", (1, 0))(b3)], axis=-1)
    d = conv(384, (3, 3), "branch3x3dbl_2", (1, 1))(conv(448, (1, 1), "branch3x3dbl_1")(x))
    d = jnp.concatenate([conv(384, (1, 3), "branch3x3dbl_3a", (0, 1))(d),
                         conv(384, (3, 1), "branch3x3dbl_3b", (1, 0))(d)], axis=-1)
    pooled = _avg_pool_same(x) if self.pool == "avg" else _max_pool(x, stride=1, pad=1)
    bp = conv(192, (1, 1), "branch_pool")(pooled)
    return jnp.concatenate([b1, b3, d, bp], axis=-1)


class FIDInceptionV3(nn.Module):
  """pytorch-fid's ``InceptionV3([3])`` plus the 1008-way logits. See the module docstring."""
  resize: bool = True
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, images):
    x = images.astype(jnp.float32)
    if self.resize:
      x = resize_bilinear(x)
    x = (2.0 * x - 1.0).astype(self.dtype)
    conv = lambda f, k, name, stride=1, pad=(0, 0): BasicConv(f, k, stride, pad, self.dtype,
                                                              name=name)
    x = conv(32, (3, 3), "Conv2d_1a_3x3", 2)(x)
    x = conv(32, (3, 3), "Conv2d_2a_3x3")(x)
    x = _max_pool(conv(64, (3, 3), "Conv2d_2b_3x3", 1, (1, 1))(x))
    x = conv(80, (1, 1), "Conv2d_3b_1x1")(x)
    x = _max_pool(conv(192, (3, 3), "Conv2d_4a_3x3")(x))
    for name, pool_features in (("Mixed_5b", 32), ("Mixed_5c", 64), ("Mixed_5d", 64)):
      x = InceptionA(pool_features, self.dtype, name=name)(x)
    x = InceptionB(self.dtype, name="Mixed_6a")(x)
    for name, c7 in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)):
      x = InceptionC(c7, self.dtype, name=name)(x)
      if name == SPATIAL_BLOCK:
        spatial = x[..., :SPATIAL_CHANNELS].astype(jnp.float32).reshape(x.shape[0], -1)
    x = InceptionD(self.dtype, name="Mixed_7a")(x)
    x = InceptionE("avg", self.dtype, name="Mixed_7b")(x)
    x = InceptionE("max", self.dtype, name="Mixed_7c")(x)
    pool = x.astype(jnp.float32).mean(axis=(1, 2))
    logits = nn.Dense(NUM_LOGITS, dtype=jnp.float32, name="fc")(pool)
    return {"pool": pool, "spatial": spatial, "logits": logits}


def check_loaded(model, directory: str, what: str = "inception"):
  """One-line ``ValueError`` unless ``model`` (loaded from ``directory``) is the FID Inception."""
  if not isinstance(model, FIDInceptionV3):
    raise ValueError(f"{what}={directory!r} is not allowed; it holds a {type(model).__name__}, "
                     "not the FID Inception (convert pt_inception-2015-12-05-6726825d.pth with "
                     "decay_jax.cli.convert_external inception)")
