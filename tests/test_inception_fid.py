"""FID Inception parity with pytorch-fid's network (float32, random weights), the resize, and the
metric maths: Frechet distance against scipy's sqrtm formula, FID 0 for identical sets, Inception
Score on known distributions, statistics files and the ``decay_jax.cli.fid`` command."""

import json

import jax
import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F

import torch_reference_external as ref
from parity import nhwc
from decay_jax.io import convert_external as ce, rules
from decay_jax.cli import fid
from decay_jax.evals import generation as gen
from decay_jax.models import inception as inception_lib

# Pool features and logits, relative to the largest reference entry (fp32 through ~95 convs;
# measured 3e-7 and 7e-7).
RTOL = 1e-5


@pytest.fixture(scope="module")
def pair():
  tmodel = ref.randomize_inception_(ref.FIDInception(), seed=0)
  fmodel = inception_lib.FIDInceptionV3()
  params, report = ce.inception_from_torch(tmodel.state_dict(), fmodel)
  return dict(tmodel=tmodel, fmodel=fmodel, params=params, report=report)


def pytorch_fid_frechet(mu1, sigma1, mu2, sigma2):
  """pytorch-fid 0.3.0's ``calculate_frechet_distance`` (scipy sqrtm of the product)."""
  covmean = scipy.linalg.sqrtm(sigma1.dot(sigma2))
  covmean = covmean.real
  diff = mu1 - mu2
  return diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean)


def test_features_and_logits_match_pytorch_fid(pair):
  x = np.random.default_rng(0).uniform(0, 1, (2, 3, 40, 48)).astype(np.float32)  # resized to 299
  with torch.no_grad():
    pool, logits = pair["tmodel"](torch.from_numpy(x))
  out = jax.jit(lambda p, x: pair["fmodel"].apply({"params": p}, x))(pair["params"], nhwc(x))
  assert out["pool"].shape == (2, 2048) and out["logits"].shape == (2, 1008)
  for got, want in ((out["pool"], pool.numpy()), (out["logits"], logits.numpy())):
    scale = np.abs(want).max()
    assert scale > 0.5  # activations survived the depth: the comparison is not vacuous
    np.testing.assert_allclose(np.asarray(got), want, atol=RTOL * scale, rtol=0)


def test_every_key_of_the_weights_file_layout_is_mapped(pair):
  sd = pair["tmodel"].state_dict()
  tracked = [k for k in sd if k.endswith("num_batches_tracked")]
  assert len(pair["report"].loaded) == len(sd) - len(tracked) == 472
  assert set(pair["report"].ignored) == set(tracked)
  back = ce.inception_to_torch(pair["params"], pair["fmodel"])
  for k, v in back.items():
    np.testing.assert_array_equal(v, sd[k].numpy(), err_msg=k)
  with pytest.raises(rules.ConversionError, match="missing key.*Mixed_7c.branch_pool.bn.running_var"):
    ce.inception_from_torch({k: v for k, v in sd.items()
                             if k != "Mixed_7c.branch_pool.bn.running_var"}, pair["fmodel"])


@pytest.mark.parametrize("shape", [(17, 23), (320, 410)])
def test_resize_is_torch_bilinear(shape):
  x = np.random.default_rng(1).uniform(0, 1, (1, 3) + shape).astype(np.float32)
  want = F.interpolate(torch.from_numpy(x), size=(299, 299), mode="bilinear",
                       align_corners=False).numpy()
  got = inception_lib.resize_bilinear(nhwc(x))
  np.testing.assert_allclose(np.asarray(got), np.asarray(nhwc(want)), atol=2e-6, rtol=0)


def random_stats(rng, d, n):
  a = rng.standard_normal((n, d)) @ rng.standard_normal((d, d)) * 0.3
  return gen.statistics(a + rng.standard_normal(d))


def test_frechet_distance_equals_scipy():
  rng = np.random.default_rng(2)
  (mu1, s1), (mu2, s2) = random_stats(rng, 64, 500), random_stats(rng, 64, 300)
  want = pytorch_fid_frechet(mu1, s1, mu2, s2)
  got = gen.frechet_distance(mu1, s1, mu2, s2)
  assert want > 1.0
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # Diagonal covariances: closed form |mu1 - mu2|^2 + sum (sqrt(a) - sqrt(b))^2.
  a, b = rng.uniform(0.1, 2, 10), rng.uniform(0.1, 2, 10)
  np.testing.assert_allclose(gen.frechet_distance(mu1[:10], np.diag(a), mu2[:10], np.diag(b)),
                             ((mu1[:10] - mu2[:10]) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum(),
                             rtol=1e-10)


def test_identical_sets_give_zero_and_inception_score():
  rng = np.random.default_rng(3)
  acts = rng.standard_normal((100, 256)) ** 2  # fewer samples than dims: singular covariance
  mu, sigma = gen.statistics(acts)
  assert abs(gen.frechet_distance(mu, sigma, mu, sigma)) < 1e-12 * np.trace(sigma)
  assert gen.frechet_distance(mu, sigma, mu + 0.1, sigma) == pytest.approx(256 * 0.01, rel=1e-6)
  assert gen.inception_score(np.zeros((50, 1008))) == pytest.approx(1.0)  # no information
  confident = np.full((40, 1008), -1e4)
  confident[np.arange(40), np.arange(40) % 8] = 0.0  # 8 classes, equally often, certain
  assert gen.inception_score(confident) == pytest.approx(8.0, rel=1e-6)
  assert gen.inception_score(confident, split_size=8) == pytest.approx(8.0, rel=1e-6)


def test_statistics_files_and_command(tmp_path, capsys):
  rng = np.random.default_rng(4)
  mu, sigma = random_stats(rng, 32, 100)
  gen.save_stats(str(tmp_path / "a.npz"), mu, sigma)
  got = gen.load_stats(str(tmp_path / "a.npz"))
  np.testing.assert_array_equal(got[0], mu)
  np.testing.assert_array_equal(got[1], sigma)
  np.savez(tmp_path / "images.npz", arr_0=np.zeros((3, 8, 8, 3), np.uint8))
  assert gen.load_stats(str(tmp_path / "images.npz")) is None
  mu2, sigma2 = random_stats(rng, 32, 100)
  np.savez(tmp_path / "b.npz", mu=mu2, sigma=sigma2)  # ADM's reference-batch keys
  out = tmp_path / "fid.json"
  assert fid.main([f"--samples={tmp_path / 'a.npz'}", f"--ref={tmp_path / 'b.npz'}",
                   f"--out={out}"]) == 0
  assert json.loads(out.read_text())["fid"] == pytest.approx(
      pytorch_fid_frechet(mu, sigma, mu2, sigma2), rel=1e-6)
  assert fid.main([f"--samples={tmp_path / 'images.npz'}", f"--ref={tmp_path / 'b.npz'}"]) == 2
  assert "--inception is required" in capsys.readouterr().err
  assert fid.main([f"--samples={tmp_path / 'nope.npz'}", f"--ref={tmp_path / 'b.npz'}"]) == 2
  assert capsys.readouterr().err.strip() == (
      f"error: --samples={str(tmp_path / 'nope.npz')!r} is not allowed; no such file or folder")
