"""PyTorch reference of pytorch-fid's FID Inception (``pytorch_fid.inception.InceptionV3([3])`` on
``fid_inception_v3()``), for the parity tests.

Why a transcription: pytorch-fid builds on torchvision's ``Inception3``, and torchvision's PyPI
wheels are CUDA builds that do not import next to the CPU torch 2.13.0 wheel we test with. This file
reproduces torchvision 0.28.0's ``inception.py`` (BasicConv2d, InceptionA-E, Inception3 with
``num_classes=1008, aux_logits=False``) and pytorch-fid 0.3.0's patches (FIDInceptionA/C/E_1: average
pools with ``count_include_pad=False``; FIDInceptionE_2: 3x3 max pool) line by line, with the same
module names, so its state_dict has the keys of ``pt_inception-2015-12-05-6726825d.pth``.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicConv2d(nn.Module):
  def __init__(self, in_channels, out_channels, **kwargs):
    super().__init__()
    self.conv = nn.Conv2d(in_channels, out_channels, bias=False, **kwargs)
    self.bn = nn.BatchNorm2d(out_channels, eps=0.001)

  def forward(self, x):
    return F.relu(self.bn(self.conv(x)))


def _tf_avg_pool(x):
  return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class FIDInceptionA(nn.Module):
  def __init__(self, in_channels, pool_features):
    super().__init__()
    self.branch1x1 = BasicConv2d(in_channels, 64, kernel_size=1)
    self.branch5x5_1 = BasicConv2d(in_channels, 48, kernel_size=1)
    self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
    self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, kernel_size=1)
    self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
    self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
    self.branch_pool = BasicConv2d(in_channels, pool_features, kernel_size=1)

  def forward(self, x):
    b1 = self.branch1x1(x)
    b5 = self.branch5x5_2(self.branch5x5_1(x))
    b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
    bp = self.branch_pool(_tf_avg_pool(x))
    return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
  def __init__(self, in_channels):
    super().__init__()
    self.branch3x3 = BasicConv2d(in_channels, 384, kernel_size=3, stride=2)
    self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, kernel_size=1)
    self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
    self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, stride=2)

  def forward(self, x):
    b3 = self.branch3x3(x)
    d = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
    return torch.cat([b3, d, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class FIDInceptionC(nn.Module):
  def __init__(self, in_channels, channels_7x7):
    super().__init__()
    c7 = channels_7x7
    self.branch1x1 = BasicConv2d(in_channels, 192, kernel_size=1)
    self.branch7x7_1 = BasicConv2d(in_channels, c7, kernel_size=1)
    self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
    self.branch7x7_3 = BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
    self.branch7x7dbl_1 = BasicConv2d(in_channels, c7, kernel_size=1)
    self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
    self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
    self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
    self.branch7x7dbl_5 = BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
    self.branch_pool = BasicConv2d(in_channels, 192, kernel_size=1)

  def forward(self, x):
    b1 = self.branch1x1(x)
    b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
    d = self.branch7x7dbl_1(x)
    for layer in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4,
                  self.branch7x7dbl_5):
      d = layer(d)
    bp = self.branch_pool(_tf_avg_pool(x))
    return torch.cat([b1, b7, d, bp], 1)


class InceptionD(nn.Module):
  def __init__(self, in_channels):
    super().__init__()
    self.branch3x3_1 = BasicConv2d(in_channels, 192, kernel_size=1)
    self.branch3x3_2 = BasicConv2d(192, 320, kernel_size=3, stride=2)
    self.branch7x7x3_1 = BasicConv2d(in_channels, 192, kernel_size=1)
    self.branch7x7x3_2 = BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
    self.branch7x7x3_3 = BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
    self.branch7x7x3_4 = BasicConv2d(192, 192, kernel_size=3, stride=2)

  def forward(self, x):
    b3 = self.branch3x3_2(self.branch3x3_1(x))
    b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
    return torch.cat([b3, b7, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class FIDInceptionE(nn.Module):
  """``max_pool=False``: FIDInceptionE_1 (Mixed_7b); ``True``: FIDInceptionE_2 (Mixed_7c)."""

  def __init__(self, in_channels, max_pool):
    super().__init__()
    self.max_pool = max_pool
    self.branch1x1 = BasicConv2d(in_channels, 320, kernel_size=1)
    self.branch3x3_1 = BasicConv2d(in_channels, 384, kernel_size=1)
    self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
    self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
    self.branch3x3dbl_1 = BasicConv2d(in_channels, 448, kernel_size=1)
    self.branch3x3dbl_2 = BasicConv2d(448, 384, kernel_size=3, padding=1)
    self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
    self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
    self.branch_pool = BasicConv2d(in_channels, 192, kernel_size=1)

  def forward(self, x):
    b1 = self.branch1x1(x)
    b3 = self.branch3x3_1(x)
    b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
    d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
    d = torch.cat([self.branch3x3dbl_3a(d), self.branch3x3dbl_3b(d)], 1)
    if self.max_pool:
      pooled = F.max_pool2d(x, kernel_size=3, stride=1, padding=1)
    else:
      pooled = _tf_avg_pool(x)
    return torch.cat([b1, b3, d, self.branch_pool(pooled)], 1)


class FIDInception(nn.Module):
  """``forward(x)``: x ``(N, 3, H, W)`` in [0, 1] -> ``(pool (N, 2048), logits (N, 1008))``."""

  def __init__(self):
    super().__init__()
    self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
    self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
    self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
    self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
    self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
    self.Mixed_5b = FIDInceptionA(192, pool_features=32)
    self.Mixed_5c = FIDInceptionA(256, pool_features=64)
    self.Mixed_5d = FIDInceptionA(288, pool_features=64)
    self.Mixed_6a = InceptionB(288)
    self.Mixed_6b = FIDInceptionC(768, channels_7x7=128)
    self.Mixed_6c = FIDInceptionC(768, channels_7x7=160)
    self.Mixed_6d = FIDInceptionC(768, channels_7x7=160)
    self.Mixed_6e = FIDInceptionC(768, channels_7x7=192)
    self.Mixed_7a = InceptionD(768)
    self.Mixed_7b = FIDInceptionE(1280, max_pool=False)
    self.Mixed_7c = FIDInceptionE(2048, max_pool=True)
    self.fc = nn.Linear(2048, 1008)

  def forward(self, x):
    # pytorch-fid InceptionV3: resize_input, normalize_input, blocks 0-3.
    x = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)
    x = 2 * x - 1
    x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
    x = F.max_pool2d(x, kernel_size=3, stride=2)
    x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
    x = F.max_pool2d(x, kernel_size=3, stride=2)
    for name in ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e", "7a", "7b", "7c"):
      x = getattr(self, f"Mixed_{name}")(x)
    pool = F.adaptive_avg_pool2d(x, (1, 1)).flatten(1)
    return pool, self.fc(pool)


def randomize_inception_(model: FIDInception, seed: int) -> FIDInception:
  """He-normal convs and non-trivial BatchNorm statistics, so activations stay O(1) in depth."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for m in model.modules():
      if isinstance(m, nn.Conv2d):
        fan_in = m.weight[0].numel()
        m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (2.0 / fan_in) ** 0.5)
      elif isinstance(m, nn.BatchNorm2d):
        n = m.num_features
        m.weight.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
        m.bias.copy_(torch.randn(n, generator=g) * 0.1)
        m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
        m.running_var.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
      elif isinstance(m, nn.Linear):
        m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.05)
        m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
  return model.eval()
