"""Unsupervised segmentation by deep spectral methods (decay_jax/evals/spectral.py, segmentation.py,
decay_jax/data/segmentation.py): oracle and random features on the synthetic set, the matching and
the pooled IoU against a numpy transcription of the reference's eval code, one-line errors for bad
folders, and `python -m decay_jax.cli.evaluate --evals=segmentation` on a tiny trained MAE run."""

import itertools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from PIL import Image

from decay_jax.data import segmentation as seg_data
from decay_jax.evals import registry, segmentation, spectral
from decay_jax.train import trainer
from decay_jax.train.tasks.mae import MAETask
from decay_jax.train import tasks
from tests import testing_configs

REPO = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
N = 60


def _run(feats, data, **settings):
  s = segmentation.check_settings(settings)
  out = segmentation.segment(feats, data["image"], 4, 4, s)
  preds = segmentation.to_pixels(out["labels"], 4)
  return spectral.miou(preds, data["mask"], out["n_preds"], 4)


def test_synthetic_set_is_deterministic_with_exact_masks():
  a, b = seg_data.synthetic(8, seed=3), seg_data.synthetic(8, seed=3)
  assert np.array_equal(a["image"], b["image"]) and np.array_equal(a["mask"], b["mask"])
  m = a["mask"].reshape(8, 7, 4, 7, 4)
  assert (m == m[:, :, :1, :, :1]).all()  # constant on every 4x4 patch
  assert (a["mask"][:, [0, -1], :] == 0).all() and (a["mask"][:, :, [0, -1]] == 0).all()


def test_oracle_features_give_miou_one():
  # One-hot class per patch, plus one constant channel: exactly one-hot features make W block
  # diagonal, so the zero eigenvalue repeats and eigenvector 0 is not the constant vector that
  # the method drops. One shape per image, K = 2 (eigenvector 1), two segments per image.
  data = seg_data.synthetic(N, seed=0, max_shapes=1)
  m = data["mask"][:, ::4, ::4].reshape(N, 49)
  oracle = np.concatenate([np.eye(4)[m], np.ones((N, 49, 1))], axis=-1)
  for background in (True, False):
    r = _run(oracle, data, eigs=2, segments=2, background=background)
    assert r["miou"] == pytest.approx(1.0) and r["pixels"] == N * 28 * 28


def test_random_features_give_chance():
  # Chance: uniformly random patch labels scored the same way; on this set (background ~80% of
  # the pixels, 4 classes) it is 0.11 (three seeds 0.110-0.115). Random features land near it.
  data = seg_data.synthetic(N, seed=1)
  rng = np.random.default_rng(0)
  chance = np.mean([spectral.miou(segmentation.to_pixels(rng.integers(0, 4, (N, 7, 7)), 4),
                                  data["mask"], 4, 4)["miou"] for _ in range(3)])
  r = _run(rng.normal(size=(N, 49, 32)), data, background=False)
  assert 0.08 < chance < 0.15 and abs(r["miou"] - chance) < 0.06, (r["miou"], chance)


def _np_get_iou(preds, targets, c1, c2):  # semantic-segmentation/eval_utils.py get_iou
  a, b = preds == c1, targets == c2
  tp, fp, fn = np.sum(a & b), np.sum(~a & b), np.sum(a & ~b)
  return float(tp) / max(float(tp + fp + fn), 1e-8)


def _np_evaluate(preds, targets, n_preds, n_classes):  # eval.py evaluate, brute-force matching
  iou = np.array([[_np_get_iou(preds, targets, p, t) for t in range(n_classes)]
                  for p in range(n_preds)])
  if n_preds == n_classes:
    perm = max(itertools.permutations(range(n_classes)),
               key=lambda q: sum(iou[p, q[p]] for p in range(n_preds)))
    match = list(perm)
  else:
    match = list(np.argmax(iou, axis=1))
  re = np.zeros_like(preds)
  for p, t in enumerate(match):
    re[preds == p] = t
  jac = [_np_get_iou(re, targets, c, c) for c in range(n_classes)]
  return float(np.mean(jac)), jac, match


def test_sparse_and_dense_eigensolvers_agree(monkeypatch):
  """Above DENSE_MAX patches the reference's shift-invert eigsh runs, below it the dense solver of
  the same pencil: the same eigenvalues and eigenvectors (up to sign)."""
  feats = np.random.default_rng(0).normal(size=(300, 16)) + 0.3  # mostly positive affinities
  dense = spectral.laplacian_eigs(feats, 5)
  monkeypatch.setattr(spectral, "DENSE_MAX", 100)
  sparse = spectral.laplacian_eigs(feats, 5)
  np.testing.assert_allclose(sparse[0], dense[0], atol=1e-8)
  assert abs(dense[0][0]) < 1e-8  # the constant vector of the Laplacian
  for a, b in zip(sparse[1][1:], dense[1][1:]):  # eigenvectors up to sign (the sign rule ties)
    assert min(np.abs(a - b).max(), np.abs(a + b).max()) < 1e-6


def test_matching_and_pooled_iou_match_numpy():
  rng = np.random.default_rng(5)
  masks = rng.integers(0, 3, size=(4, 6, 6)).astype(np.uint8)
  preds = (masks + 1) % 3  # a permutation of the classes ...
  preds[0, :2] = rng.integers(0, 3, size=(2, 6))  # ... with some noise
  masks[1, 0, :] = 255  # ignored pixels
  for n_preds in (3, 5):  # Hungarian, then majority vote
    p = preds if n_preds == 3 else np.where(preds == 2, rng.integers(2, 5, preds.shape), preds)
    got = spectral.miou(p, masks, n_preds, 3)
    valid = masks != 255
    want, jac, match = _np_evaluate(p[valid], masks[valid], n_preds, 3)
    assert got["miou"] == pytest.approx(want) and np.allclose(got["iou"], jac)
    assert got["matching"] == [int(m) for m in match] and got["pixels"] == valid.sum()


def _folder(root, size=(12, 12), mask_size=(12, 12), label=1, with_mask=True):
  os.makedirs(root / "images", exist_ok=True)
  os.makedirs(root / "masks", exist_ok=True)
  Image.fromarray(np.zeros(size[::-1] + (3,), np.uint8)).save(root / "images" / "a.jpg")
  if with_mask:
    m = np.zeros(mask_size[::-1], np.uint8)
    m[0, 0] = label
    Image.fromarray(m).save(root / "masks" / "a.png")


def test_folder_reads_and_bad_input_is_one_line(tmp_path):
  _folder(tmp_path / "ok", size=(16, 12), mask_size=(16, 12), label=255)
  d = seg_data.read_folder(str(tmp_path / "ok"), 8, 1, num_classes=4)
  assert d["image"].shape == (1, 8, 8, 1) and d["mask"].shape == (1, 8, 8) and d["names"] == ["a"]
  cases = {"size": ({"mask_size": (10, 12)}, "masks/a.png: mask size (10, 12) differs"),
           "missing": ({"with_mask": False}, "masks/a.png: missing"),
           "label": ({"label": 7}, "masks/a.png: label 7 is neither a class")}
  for name, (kw, text) in cases.items():
    _folder(tmp_path / name, **kw)
    with pytest.raises(ValueError) as e:
      seg_data.read_folder(str(tmp_path / name), 8, 1, num_classes=4)
    assert text in str(e.value) and "\n" not in str(e.value)
  with pytest.raises(ValueError, match=r"^seg_ignore=2 is not allowed; it is one of the 4"):
    segmentation.check_settings({"classes": 4, "ignore": 2})
  with pytest.raises(ValueError, match="no folder"):
    seg_data.read_folder(str(tmp_path / "nothing"), 8, 1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A micro/4 MAE on the embedded digits at 28 px (7 x 7 patches), trained for 2 steps."""
  cfg = testing_configs.load_config("mae_cpu_mnist")
  testing_configs.override(cfg, **{
      "model.preset": "micro/4", "batch_size": 16, "num_train_steps": 2, "warmup_epochs": 0.0,
      "picture_every_steps": 0, "checkpoint.every_steps": 2, "checkpoint.async_save": False,
      "mesh.data": 1, **{f"evals.{n}.enabled": False for n in ("rank", "knn", "linear", "layers")}})
  root = tmp_path_factory.mktemp("segmentation")
  workdir = str(root / "mae")
  trainer.train_and_evaluate(cfg, workdir, evaluators=registry.build)
  return root, workdir


def test_key_features_are_the_blocks_attention_keys(run):
  """``--seg_feature=keys``: block b's keys are its qkv Dense's middle third on norm1 of block
  b-1's output (heads concatenated, cls left out), as the reference reads them from ``attn.qkv``."""
  from decay_jax import sharding as shd
  from decay_jax.train import pretrained
  _, workdir = run
  mesh = shd.make_mesh(1, 1)
  model, params = pretrained.load(workdir, mesh, MAETask)
  data_cfg = tasks.run_config(workdir).data
  images = seg_data.synthetic(4, 28, 1, 4, 4, 0)["image"]
  keys = segmentation.patch_features(model, params, images, mesh, data_cfg, 1, 4, "keys")
  tokens = segmentation.patch_features(model, params, images, mesh, data_cfg, 0, 4, "tokens")
  blk = jax.tree_util.tree_map(lambda a: np.asarray(a)[1], params["blocks"])
  x = tokens.astype(np.float64)  # block 0's output, patch tokens (cls has its own row)
  x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
  x = x * blk["norm1"]["scale"] + blk["norm1"]["bias"]
  c = model.dim
  want = x @ blk["attn"]["qkv"]["kernel"][:, c:2 * c] + blk["attn"]["qkv"]["bias"][c:2 * c]
  assert keys.shape == (4, 49, c)
  np.testing.assert_allclose(keys, want, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="seg_feature='values' is not allowed"):
    segmentation.check_settings({"feature": "values"})


def test_segment_boxes_follow_the_reference():
  """``_extract_bbox``: erode 2 (a step that would empty the mask skipped; outside the map counts
  as inside, skimage's rule), dilate 3, a cross each time; the box in patches, max exclusive."""
  seg = np.zeros((7, 7), np.int64)
  seg[2:5, 2:5] = 1  # eroded once to its centre (3, 3), the second erosion skipped
  seg[0:2, :] = 2    # on the border: row 0 survives one erosion, the second would empty it
  ids, boxes = spectral.segment_boxes(seg, skip_background=True, erode=2, dilate=3)
  assert ids == [1, 2]
  assert boxes[0] == (0, 0, 7, 7)  # the centre dilated 3 times: a diamond of radius 3
  assert boxes[1] == (0, 0, 4, 7)  # row 0 dilated 3 times: rows 0-3
  ids, boxes = spectral.segment_boxes(seg, skip_background=False, erode=0, dilate=0)
  assert ids == [0, 1, 2] and boxes == [(2, 0, 7, 7), (2, 2, 5, 5), (0, 0, 2, 7)]


def test_crop_features_are_the_cls_of_resized_crops(run):
  """``--seg_segment_feature=crop``: the cls token of the segment box's crop at the model's size;
  the whole pipeline then runs with them."""
  from decay_jax import sharding as shd
  from decay_jax.data import augment, on_device
  from decay_jax.train import pretrained
  _, workdir = run
  mesh = shd.make_mesh(1, 1)
  model, params = pretrained.load(workdir, mesh, MAETask)
  data_cfg = tasks.run_config(workdir).data
  images = seg_data.synthetic(6, 28, 1, 4, 4, 0)["image"]
  got = segmentation.crop_features(model, params, images, [(2, (1, 2, 4, 6))], mesh, data_cfg,
                                   -1, 4)
  crop = augment.eval_resize_one(images[2][4:16, 8:24], 28, "resize")
  mean, std = augment.normalization(data_cfg, 1)
  x = on_device.to_model_input(crop[None], mean, std)
  want = model.apply({"params": params}, x, method=model.features)[-1][:, 0]
  np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
  sec = segmentation.evaluate(model, params, mesh, data_cfg,
                              {"images": 6, "segment_feature": "crop", "batch": 4})
  assert 0.0 <= sec["miou"] <= 1.0 and sec["num_segments"] > 0
  assert "cls token of each segment's box (eroded 2, dilated 3)" in "\n".join(
      segmentation.markdown("mae", sec, None))


def _evaluate(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "decay_jax.cli.evaluate", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


def test_evaluate_writes_table_and_picture(run, tmp_path):
  root, workdir = run
  out = str(root / "report")
  proc = _evaluate(f"--workdir={workdir}", "--evals=segmentation", "--seg_images=24",
                   f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rec = json.load(open(os.path.join(out, "evaluation.json")))["models"][0]
  sec = rec["sections"]["segmentation"]
  assert 0.0 <= sec["miou"] <= 1.0 and len(sec["iou"]) == 4 and sec["num_images"] == 24
  assert sec["pixels"] == 24 * 28 * 28 and sec["settings"]["block"] == -1
  md = open(os.path.join(out, "report.md")).read()
  assert "## Unsupervised segmentation: mae" in md and "(segmentation_mae.png)" in md
  png = Image.open(os.path.join(out, "segmentation_mae.png"))
  assert png.size[0] > png.size[1] > 0
  _folder(tmp_path / "bad", mask_size=(10, 12))
  proc = _evaluate(f"--workdir={workdir}", "--evals=segmentation", f"--seg_data={tmp_path / 'bad'}",
                   f"--out={tmp_path / 'o'}")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert "masks/a.png: mask size (10, 12) differs" in proc.stderr.strip().splitlines()[-1]
