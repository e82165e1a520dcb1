"""Decay schedules: official values (against the PyTorch reference), paper convention, ablations."""

import math

import numpy as np
import pytest
import torch

import torch_reference as ref
from decay_jax.cli import schedules as schedules_cli
from decay_jax.models import schedules

DEPTHS = (12, 24, 28, 32)
ALPHA_MINS = (0.6, 0.7, 0.8)


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("alpha_min", ALPHA_MINS)
def test_matches_official_tables(depth, alpha_min):
  with torch.device("meta"):
    mae = ref.MaskedAutoencoderViT(img_size=16, patch_size=8, embed_dim=16, depth=depth,
                                   num_heads=2, decoder_embed_dim=8, decoder_depth=1,
                                   decoder_num_heads=1, min_decay=alpha_min)
    sit = ref.SiT(input_size=4, patch_size=2, hidden_size=16, depth=depth, num_heads=2,
                  num_classes=3, min_sigma=alpha_min)
  ours = schedules.decay_schedule(depth, alpha_min)
  official_mae = np.array([b.decay for b in mae.blocks], np.float64)
  official_sit = np.array([b.sigma for b in list(sit.enc_blocks) + list(sit.dec_blocks)])
  np.testing.assert_array_equal(ours, official_mae)  # same construction: bit-identical
  np.testing.assert_allclose(ours, official_sit, rtol=0, atol=1e-15)  # linspace(1, a): 1 ulp
  assert ours[0, 0] == 1.0 and ours[-1, 1] == alpha_min
  k = np.arange(2 * depth)
  np.testing.assert_allclose(ours.reshape(-1), 1 - k * (1 - alpha_min) / (2 * depth - 1),
                             rtol=0, atol=1e-15)


def test_spec_values():
  a = schedules.decay_schedule(12, 0.7)
  np.testing.assert_allclose(a[0], [1.0, 0.986957], atol=1e-6)
  np.testing.assert_allclose(a[5], [0.869565, 0.856522], atol=1e-6)
  np.testing.assert_allclose(a[11], [0.713043, 0.7], atol=1e-6)
  assert schedules.alpha_eff(12, 0.7) == pytest.approx(0.017646, abs=1e-6)
  s = schedules.decay_schedule(28, 0.8)
  np.testing.assert_allclose(s[13], [0.905455, 0.901818], atol=1e-6)
  np.testing.assert_allclose(s[14], [0.898182, 0.894545], atol=1e-6)
  assert np.prod(s[:14]) == pytest.approx(0.2410, abs=1e-4)
  assert schedules.alpha_eff(28, 0.8) == pytest.approx(0.002430, abs=1e-6)


def test_block_convention_is_the_paper_equation():
  a = schedules.decay_schedule(12, 0.6, convention="block")
  l = np.arange(1, 13)
  np.testing.assert_allclose(a[:, 0], 1 - l * 0.4 / 12, atol=1e-15)
  np.testing.assert_array_equal(a[:, 1], np.ones(12))
  assert a[-1, 0] == pytest.approx(0.6, abs=1e-15)
  assert schedules.alpha_eff(12, 0.6, "block") == pytest.approx(np.prod(1 - l * 0.4 / 12))


@pytest.mark.parametrize("convention", schedules.CONVENTIONS)
def test_cosine_has_the_linear_endpoints_and_decreases(convention):
  cos = schedules.decay_schedule(24, 0.7, convention, "cosine")
  lin = schedules.decay_schedule(24, 0.7, convention, "linear")
  col = 0 if convention == "block" else slice(None)
  flat_c, flat_l = cos[:, col].reshape(-1), lin[:, col].reshape(-1)
  u = (1 - flat_l) / 0.3  # normalised position of each coefficient
  assert flat_c[-1] == pytest.approx(0.7, abs=1e-12)
  assert np.all(np.diff(flat_c) < 0)
  np.testing.assert_allclose(flat_c, 0.7 + 0.3 * 0.5 * (1 + np.cos(np.pi * u)), atol=1e-12)
  # Slower than the line at first, faster after the midpoint.
  early, late = (u > 1e-9) & (u < 0.5 - 1e-9), (u > 0.5 + 1e-9) & (u < 1 - 1e-9)
  assert np.all(flat_c[early] > flat_l[early])
  assert np.all(flat_c[late] < flat_l[late])


def test_alpha_min_one_is_the_standard_network():
  for conv in schedules.CONVENTIONS:
    for shape in schedules.SHAPES:
      np.testing.assert_array_equal(schedules.decay_schedule(12, 1.0, conv, shape), np.ones((12, 2)))


def test_shortcut_forms():
  base = schedules.decay_schedule(12, 0.6)
  sc = schedules.shortcuts(12, 0.6, form="attn_only")
  np.testing.assert_array_equal(sc.alphas[:, 0], base[:, 0])
  np.testing.assert_array_equal(sc.alphas[:, 1], 1.0)
  sc = schedules.shortcuts(12, 0.6, form="mlp_only")
  np.testing.assert_array_equal(sc.alphas[:, 0], 1.0)
  np.testing.assert_array_equal(sc.alphas[:, 1], base[:, 1])
  sc = schedules.shortcuts(12, 0.6, form="sqrt_half_both")
  assert sc.branch_scale == math.sqrt(0.5) and np.all(sc.alphas == math.sqrt(0.5))
  sc = schedules.shortcuts(12, 0.6, form="sqrt_half_f")
  assert sc.branch_scale == math.sqrt(0.5) and np.all(sc.alphas == 1.0)
  sc = schedules.shortcuts(12, 0.6, form="learnable")
  assert sc.learnable and np.array_equal(sc.alphas, base)
  assert schedules.shortcuts(12, 0.6).alpha_eff == pytest.approx(np.prod(base))


@pytest.mark.parametrize("depth,convention,shape", [(12, "sublayer", "linear"),
                                                    (28, "sublayer", "cosine"),
                                                    (24, "block", "linear")])
def test_inverse_alpha_eff(depth, convention, shape):
  for a in (0.55, 0.7, 0.95, 1.0):
    target = schedules.alpha_eff(depth, a, convention, shape)
    assert schedules.alpha_min_for(target, depth, convention, shape) == pytest.approx(a, abs=1e-9)
  with pytest.raises(ValueError, match="target_alpha_eff=1e-300 is below the smallest reachable"):
    schedules.alpha_min_for(1e-300, depth, convention, shape)


@pytest.mark.parametrize("call,match", [
    (lambda: schedules.decay_schedule(12, 1.5), r"alpha_min=1.5 is not allowed; it must be a number in \(0, 1\]"),
    (lambda: schedules.decay_schedule(0, 0.7), "depth=0 is not allowed"),
    (lambda: schedules.decay_schedule(12, 0.7, convention="layer"), "convention='layer' is not allowed; choose one of 'sublayer', 'block'"),
    (lambda: schedules.decay_schedule(12, 0.7, shape="exp"), "shape='exp' is not allowed"),
    (lambda: schedules.shortcuts(12, 0.7, form="rezero"), "shortcut_form='rezero' is not allowed"),
])
def test_bad_input_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_command_line(tmp_path, capsys):
  png = tmp_path / "schedule.png"
  assert schedules_cli.main(["--depth", "12", "--alpha-min", "0.6", "--plot", str(png)]) == 0
  out = capsys.readouterr().out
  assert "    0    1.000000    0.982609" in out  # 1 - 0.4/23
  assert "   11    0.617391    0.600000" in out  # 1 - 22 * 0.4/23, then alpha_min
  assert f"alpha_eff (product of all 24 coefficients) = {schedules.alpha_eff(12, 0.6):.6g}" in out
  assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
  assert schedules_cli.main(["--depth", "12", "--target-alpha-eff", "0.0176"]) == 0
  assert "alpha_min = 0.69" in capsys.readouterr().out
  assert schedules_cli.main(["--depth", "12", "--alpha-min", "2"]) == 2
  assert "error: alpha_min=2.0 is not allowed" in capsys.readouterr().err
