"""The generation metrics beside FID (docs/generation_metrics.md): ADM's improved precision/recall
and prdc's density/coverage against numpy transcriptions of their definitions (and against the
``prdc`` package), on features with known answers; sFID's spatial feature against pytorch-fid's
``Mixed_6d.branch1x1``; ADM-layout reference batches; ``decay_jax.cli.fid`` printing all of it."""

import json

import numpy as np
import pytest
import torch

import torch_reference_external as ref_lib
from parity import nhwc
from decay_jax.cli import fid
from decay_jax.evals import generation as gen
from decay_jax.evals import manifold
from decay_jax.io import convert_external as ce
from decay_jax.models import inception as inception_lib
from decay_jax.train import checkpoint


# ------------------------------------------------------------------------------------------------
# Independent transcriptions (float64, the whole distance matrix at once)
# ------------------------------------------------------------------------------------------------


def sq_dists(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)


def adm_precision_recall(ref, samples, k=3):
  """ADM evaluator.py: radius = column k of the sorted squared self-distances (self at column 0),
  precision = samples inside any reference ball, recall = references inside any sample ball, <=."""
  r_ref = np.sort(sq_dists(ref, ref), axis=1)[:, k]
  r_samples = np.sort(sq_dists(samples, samples), axis=1)[:, k]
  d = sq_dists(ref, samples)
  return (d <= r_ref[:, None]).any(axis=0).mean(), (d <= r_samples[None, :]).any(axis=1).mean()


def naeem_density_coverage(ref, samples, k=5):
  """prdc.compute_prdc: Euclidean distances, radius = (k+1)-th smallest of the row, strict <."""
  r = np.sort(np.sqrt(sq_dists(ref, ref)), axis=1)[:, k]
  d = np.sqrt(sq_dists(ref, samples))
  return (d < r[:, None]).sum(axis=0).mean() / k, (d.min(axis=1) < r).mean()


def features(seed, n, d=32, shift=0.0, scale=1.0):
  return (np.random.default_rng(seed).standard_normal((n, d)) * scale + shift).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# Precision, recall, density, coverage
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shift,scale", [(0.0, 1.0), (0.3, 1.3), (0.8, 0.6)])
def test_manifold_metrics_equal_their_definitions(shift, scale):
  ref, samples = features(0, 120), features(1, 80, shift=shift, scale=scale)
  want_p, want_r = adm_precision_recall(ref, samples)
  want_d, want_c = naeem_density_coverage(ref, samples)
  for batch in (manifold.BATCH, 40):  # one block, and blocks that split rows and columns
    pr = manifold.precision_recall(ref, samples, half=False, batch=batch)
    dc = manifold.density_coverage(ref, samples, batch=batch)
    assert (pr["precision"], pr["recall"]) == (want_p, want_r)
    assert dc["density"] == pytest.approx(want_d, abs=1e-12)
    assert dc["coverage"] == want_c
  assert 0 < want_p < 1 and 0 < want_c < 1 or shift == 0.0  # the comparisons are not vacuous
  # ADM's default: float16 distances (float32 where a block overflows): the same decisions here.
  assert manifold.precision_recall(ref, samples) == pr


def test_density_coverage_equal_prdc():
  prdc = pytest.importorskip("prdc")
  ref, samples = features(2, 120), features(3, 90, shift=0.4)
  want = prdc.compute_prdc(real_features=ref, fake_features=samples, nearest_k=5)
  got = manifold.density_coverage(ref, samples, k=5, batch=50)
  assert got["density"] == pytest.approx(float(want["density"]), abs=1e-12)
  assert got["coverage"] == float(want["coverage"])


def test_known_answers():
  ref = features(4, 80)
  same = manifold.precision_recall(ref, ref.copy())
  assert same == {"precision": 1.0, "recall": 1.0}
  assert manifold.density_coverage(ref, ref.copy())["coverage"] == 1.0
  far = features(5, 60, shift=100.0)  # a disjoint cluster
  assert manifold.precision_recall(ref, far) == {"precision": 0.0, "recall": 0.0}
  assert manifold.density_coverage(ref, far) == {"density": 0.0, "coverage": 0.0}
  mu, sigma = gen.statistics(ref)
  assert abs(gen.frechet_distance(mu, sigma, mu, sigma)) < 1e-10


def test_float16_block_falls_back_to_float32_where_it_overflows():
  u, v = features(6, 20) * 300.0, features(7, 30) * 300.0  # |u|^2 ~ 3e6 > float16's 65504
  d16 = np.asarray(manifold.sq_distances(u, v, half=True))
  np.testing.assert_array_equal(d16, np.asarray(manifold.sq_distances(u, v, half=False)))
  small = np.asarray(manifold.sq_distances(u / 300, v / 300, half=True))
  assert np.array_equal(small, small.astype(np.float16))  # kept in float16 when finite
  np.testing.assert_allclose(small, sq_dists(u / 300, v / 300), rtol=3e-3, atol=0.1)


def test_bad_features_are_one_line_errors():
  with pytest.raises(ValueError, match="reference features have 32 dims and sample features 16"):
    manifold.precision_recall(features(0, 10), features(1, 10, d=16))
  with pytest.raises(ValueError, match="sample: 4 images are not allowed.*at least 6"):
    manifold.density_coverage(features(0, 10), features(1, 4))


# ------------------------------------------------------------------------------------------------
# sFID's feature, reference batches, the command
# ------------------------------------------------------------------------------------------------


IMAGES = np.random.default_rng(9).integers(0, 256, (16, 24, 24, 3), dtype=np.uint8)
BATCH = 8  # one image per fake CPU device: every forward below is the same compiled program


@pytest.fixture(scope="module")
def inception(tmp_path_factory):
  """pytorch-fid's network at random weights, its conversion, and that saved for the command."""
  tmodel = ref_lib.randomize_inception_(ref_lib.FIDInception(), seed=1)
  fmodel = inception_lib.FIDInceptionV3()
  params, _ = ce.inception_from_torch(tmodel.state_dict(), fmodel)
  directory = str(tmp_path_factory.mktemp("inception"))
  checkpoint.save_params(directory, params, fmodel)
  return dict(tmodel=tmodel, fmodel=fmodel, params=params, dir=directory)


def test_spatial_feature_is_mixed_6d_branch1x1(inception):
  captured = {}

  def keep(module, inputs, output):
    captured["x"] = output.detach().numpy()

  hook = inception["tmodel"].Mixed_6d.branch1x1.register_forward_hook(keep)
  x = IMAGES[:BATCH]
  with torch.no_grad():
    inception["tmodel"](torch.from_numpy(x.transpose(0, 3, 1, 2) / np.float32(255)))
  hook.remove()
  out = gen.inception_activations(inception["fmodel"], inception["params"], x, BATCH)
  assert out["spatial"].shape == (BATCH, inception_lib.SPATIAL_DIM) == (BATCH, 2023)
  # the same images as a stream of uneven chunks, re-batched to the compiled batch
  cut = [1, BATCH // 2 + 1]
  stream = gen.ImageStream(BATCH, iter(np.split(x, cut)))
  streamed = gen.inception_activations(inception["fmodel"], inception["params"], stream, BATCH)
  for key in out:
    np.testing.assert_array_equal(streamed[key], out[key])
  with pytest.raises(ValueError, match=f"{BATCH - 1} images were read, {BATCH} were announced"):
    gen.inception_activations(inception["fmodel"], inception["params"],
                              gen.ImageStream(BATCH, iter([x[:-1]])), BATCH)
  want = nhwc(captured["x"])[..., :7].reshape(BATCH, -1)  # TF: spatial[..., :7], reshape([N, -1])
  scale = np.abs(want).max()
  assert scale > 0.5
  np.testing.assert_allclose(out["spatial"], want, atol=1e-5 * scale, rtol=0)


def test_reference_batch_layout_reads_back(tmp_path, capsys):
  rng = np.random.default_rng(8)
  images = rng.integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
  a, b = rng.standard_normal((2, 30, 4)), rng.standard_normal((30, 3))
  stats = dict(zip(("mu", "sigma"), gen.statistics(a[0])))
  stats.update(zip(("mu_s", "sigma_s"), gen.statistics(b)))
  path = str(tmp_path / "ref.npz")
  gen.save_batch(path, stats, images)
  with np.load(path) as f:  # what ADM's evaluator reads
    assert sorted(f.keys()) == ["arr_0", "mu", "mu_s", "sigma", "sigma_s"]
    assert f["arr_0"].dtype == np.uint8 and f["mu"].dtype == np.float64
  got, has_images = gen.read_batch(path)
  assert has_images and sorted(got) == sorted(stats)
  for k in stats:
    np.testing.assert_array_equal(got[k], stats[k])
  np.testing.assert_array_equal(gen.load_images(path), images)
  # FID 0 and sFID 0 against itself through the command (statistics only: no network needed).
  out = tmp_path / "self.json"
  assert fid.main([f"--samples={path}", f"--ref={path}", f"--out={out}"]) == 0
  res = json.loads(out.read_text())
  assert abs(res["fid"]) < 1e-12 and abs(res["sfid"]) < 1e-12
  assert "not computed: inception_score, precision, recall" in capsys.readouterr().out
  stats["mu"] = stats["mu"] + 1.0
  gen.save_batch(str(tmp_path / "shifted.npz"), stats)
  assert fid.main([f"--samples={tmp_path / 'shifted.npz'}", f"--ref={path}", f"--out={out}"]) == 0
  assert json.loads(out.read_text())["fid"] == pytest.approx(4.0)  # |mu_1 - mu_2|^2, 4 dims
  np.savez(tmp_path / "bad.npz", mu=np.zeros(4), sigma=np.eye(4), mu_s=np.zeros(3))
  with pytest.raises(ValueError, match="bad.npz: has mu_s but no sigma_s"):
    gen.read_batch(str(tmp_path / "bad.npz"))
  assert list(gen.subset(10, 20)) == list(range(10))
  picked = gen.subset(1000, 10)
  assert len(set(picked)) == 10 and list(picked) == sorted(picked) and picked[-1] > 100


def test_command_prints_all_metrics_and_writes_a_reference(tmp_path, capsys, inception,
                                                           monkeypatch):
  # A 2048-d Frechet distance costs ~9 s on one core; its maths are tested in test_inception_fid.
  # Here a recorder checks what reaches it: the statistics of the right features (or file).
  calls, acts = [], []

  def frechet(mu1, sigma1, mu2, sigma2):
    calls.append((mu1, sigma1, mu2, sigma2))
    return float(np.abs(mu1 - mu2).sum() + np.abs(sigma1 - sigma2).sum())

  def activations(*args, **kwargs):
    acts.append(real_activations(*args, **kwargs))
    return acts[-1]

  real_activations = gen.inception_activations
  monkeypatch.setattr(gen, "frechet_distance", frechet)
  monkeypatch.setattr(gen, "inception_activations", activations)
  np.savez(tmp_path / "samples.npz", arr_0=IMAGES[:BATCH])
  np.savez(tmp_path / "other.npz", arr_0=IMAGES[BATCH:])
  ref, out = tmp_path / "ref.npz", tmp_path / "metrics.json"
  assert fid.main([f"--samples={tmp_path / 'samples.npz'}", f"--ref={tmp_path / 'other.npz'}",
                   f"--inception={inception['dir']}", f"--batch_size={BATCH}", f"--out={out}",
                   f"--save_stats={ref}", "--save_images=7"]) == 0
  printed = capsys.readouterr().out.strip().splitlines()
  assert f"wrote the reference batch of {tmp_path / 'samples.npz'} to {ref}" in "\n".join(printed)
  for key in ("fid", "sfid", "inception_score", "precision", "recall", "density", "coverage"):
    assert f" {key}=" in printed[-1], printed
  sample_acts, ref_acts = acts
  res = json.loads(out.read_text())
  assert res["num_samples"] == res["num_ref"] == BATCH and res["fid"] > 0 and res["sfid"] > 0
  for call, feature in zip(calls, ("pool", "spatial")):
    np.testing.assert_allclose(call[0], sample_acts[feature].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(call[2], ref_acts[feature].mean(0), rtol=1e-5, atol=1e-6)
  assert res["inception_score"] == pytest.approx(gen.inception_score(sample_acts["logits"]))
  want = manifold.precision_recall(ref_acts["pool"], sample_acts["pool"])
  want.update(manifold.density_coverage(ref_acts["pool"], sample_acts["pool"]))
  assert {k: res[k] for k in want} == want
  # The reference batch written: ADM's keys and shapes, the samples' statistics, 7 of its images.
  with np.load(ref) as f:
    assert f["arr_0"].shape == (7, 24, 24, 3) and f["mu_s"].shape == (2023,)
    assert f["sigma"].shape == (2048, 2048) and f["sigma_s"].shape == (2023, 2023)
    np.testing.assert_array_equal(f["mu"], calls[0][0])
    np.testing.assert_array_equal(f["sigma_s"], calls[1][1])
  # Against itself: the file's statistics on both sides, P/R and coverage 1 from arr_0's features.
  side = gen.describe(str(ref), inception["fmodel"], inception["params"], BATCH)
  assert side["n"] == 7
  got, missing = gen.compare(side, side)
  assert not missing and got["fid"] == got["sfid"] == 0.0
  np.testing.assert_array_equal(calls[-1][0], side["mu_s"])
  assert got["precision"] == got["recall"] == got["coverage"] == 1.0


def test_a_dataset_split_is_a_reference(tmp_path, capsys, inception, monkeypatch):
  """``--samples=dataset:NAME --split=SPLIT``: the split's first images, ADM's centre crop
  (``data.eval_resize='adm'``, 28 -> 24 px: the fixture's compiled size), grey repeated to RGB,
  written as an ADM reference batch of their features' statistics."""
  from decay_jax.data import pipeline
  seen, real_activations = [], gen.inception_activations

  def activations(model, params, images, *args, **kwargs):
    assert isinstance(images, gen.ImageStream) and images.n == 8  # read as consumed
    chunks = [np.array(c) for c in images.chunks]
    images = gen.ImageStream(images.n, iter(chunks))
    seen.append((np.concatenate(chunks), real_activations(model, params, images, *args,
                                                           **kwargs)))
    return seen[-1][1]

  monkeypatch.setattr(gen, "inception_activations", activations)
  ref = tmp_path / "digits.npz"
  assert fid.main(["--samples=dataset:embedded_mnist", "--split=test", "--image_size=24",
                   "--max_images=8", f"--inception={inception['dir']}", f"--batch_size={BATCH}",
                   f"--save_stats={ref}", "--save_images=5"]) == 0
  cfg = pipeline.default_data_config()
  cfg.update(max_eval_examples=8, eval_resize="adm", image_size=24)
  digits = np.repeat(pipeline.load_eval_arrays(cfg, "test")["image"], 3, axis=-1)
  (images, acts), = seen
  np.testing.assert_array_equal(images, digits)
  with np.load(ref) as f:
    assert f["arr_0"].shape == (5, 24, 24, 3)
    assert all(any((im == d).all() for d in digits) for im in f["arr_0"])
    np.testing.assert_allclose(f["mu"], acts["pool"].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f["sigma_s"], np.cov(acts["spatial"], rowvar=False), rtol=1e-4,
                               atol=1e-6)
  capsys.readouterr()
  for args, why in ((["--samples=dataset:", "--image_size=28"], "write dataset:NAME"),
                    (["--samples=dataset:embedded_mnist"], "--image_size is required")):
    assert fid.main([*args, f"--save_stats={ref}", f"--inception={inception['dir']}"]) == 2
    err = capsys.readouterr().err.strip()
    assert why in err and "\n" not in err, err


def test_command_bad_input_is_one_line(tmp_path, capsys):
  np.savez(tmp_path / "a.npz", mu=np.zeros(20), sigma=np.eye(20))
  np.savez(tmp_path / "b.npz", mu=np.zeros(8), sigma=np.eye(8))
  assert fid.main([f"--samples={tmp_path / 'a.npz'}", f"--ref={tmp_path / 'b.npz'}"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: mu of ") and "20 dims" in err and "b.npz 8" in err
  np.savez(tmp_path / "c.npz", images=np.zeros((2, 4, 4, 3), np.uint8))
  (tmp_path / "e.npz").write_bytes(b"not a zip")
  for bad, why in (("c.npz", "neither mu/sigma nor arr_0"), ("e.npz", "not a readable")):
    assert fid.main([f"--samples={tmp_path / bad}", f"--ref={tmp_path / 'a.npz'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert why in err and bad in err and "\n" not in err, err
  np.savez(tmp_path / "d.npz", arr_0=np.zeros((2, 4, 4, 3), np.float32))
  with pytest.raises(ValueError, match="d.npz: arr_0 must be uint8"):
    gen.load_images(str(tmp_path / "d.npz"))
