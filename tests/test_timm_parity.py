"""Parity against timm's own code (timm 1.0.31, requirements-test-nodeps.txt; imported without
torchvision by tests/timm_import.py; nothing is fetched at run time):

1. timm's ``VisionTransformer`` built as upstream MAE's fine-tuning model (global average pool over
   the patch tokens + ``fc_norm``) with random weights: its state_dict converts into
   ``models.vit.ViTClassifier`` (alpha 1) key for key, and the logits agree to 1e-5 in fp32.
2. timm's ``Mixup`` (mode 'batch', the recipe's settings) against ``data.mixup.mix_group`` fed the
   switch, lambda and box centre timm drew.
3. Every op of timm's 'rand-m9-mstd0.5-inc1' against ``data.randaugment`` at fixed magnitudes and
   signs (bit-exact: both call Pillow), the parsed policy, and the draws (op choice, probability,
   magnitude N(9, 0.5) clipped to [0, 10], sign) fed identically to both and sampled freely.
4. timm's ``RandomErasing(mode='pixel')`` against ``data.mixup.random_erasing`` fed the same draws
   (through a scripted stand-in for ``jax.random``), and the statistics of both with real RNGs.

Two differences from timm 1.0.31 are deliberate (ours follows timm 0.3.2, which upstream MAE pins;
docs/finetune.md) and are asserted as such, not as equality:
- CutMix box: timm 1.0.31 ends the box at ``c + ceil(cut / 2)``, 0.3.2 and ours at
  ``c + floor(cut / 2)``: for an odd cut side ours is one row (column) shorter at the high edge.
- PosterizeIncreasing at magnitude 10 keeps 0 bits: Pillow 13 refuses ``posterize(img, 0)`` (timm
  raises ValueError), ours returns the black image that older Pillow's mask arithmetic gave.
"""

import math
import random
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from PIL import Image

import timm_import
import torch_reference as ref
from decay_jax.data import config as data_config
from decay_jax.data import mixup
from decay_jax.data import randaugment as ra
from decay_jax.io import official, rules
from decay_jax.models import vit
from decay_jax.models.residual import Residual
from parity import nhwc

timm = timm_import.import_timm()
from timm.data import IMAGENET_DEFAULT_MEAN  # noqa: E402
from timm.data import auto_augment as taa  # noqa: E402
from timm.data import mixup as tmix  # noqa: E402
from timm.data import random_erasing as terase  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402


def test_the_reference_is_timm_1_0_31_without_torchvision():
  assert timm.__version__ == "1.0.31"
  assert not any(n == "torchvision" or n.startswith("torchvision.") for n in sys.modules)


# ------------------------------------------------------------------------------------------------
# 1. VisionTransformer forward

TINY = dict(img_size=32, patch_size=4, num_classes=10, depth=4, num_heads=4)


def timm_classifier(drop_path, seed=1):
  """Upstream MAE's ``models_vit.vit_*(global_pool=True)`` in timm 1.0 terms: tiny, random weights
  (``seed``), evaluation mode."""
  model = VisionTransformer(**TINY, embed_dim=64, mlp_ratio=4.0, qkv_bias=True, class_token=True,
                            global_pool="avg", drop_path_rate=drop_path)
  return ref.randomize_(model, seed=seed, scale=0.1).eval()


@pytest.mark.parametrize("drop_path", [0.0, 0.1])
def test_vit_classifier_equals_timms_vision_transformer_at_alpha_one(drop_path):
  tm = timm_classifier(drop_path)
  assert isinstance(tm.norm, torch.nn.Identity) and tm.fc_norm.eps == 1e-6  # upstream's layout
  state = tm.state_dict()
  model = vit.ViTClassifier(**TINY, dim=64, drop_path=drop_path,
                            residual=Residual(alpha_min=1.0))
  assert np.all(np.asarray(model.shortcuts.alphas) == 1.0)
  # timm's keys, in timm's order, are the converter's names unchanged.
  assert list(state) == [r.torch_key for r in official.vit_rules(model)]
  params, report = official.vit_from_torch(state, model)
  assert len(report.loaded) == len(state) == 4 + 12 * 4 + 4 and not report.left_at_init
  x = np.random.default_rng(2).standard_normal((3, 3, 32, 32)).astype(np.float32)
  with torch.no_grad():
    want = tm(torch.from_numpy(x)).numpy()
  got = np.asarray(jax.jit(model.apply)({"params": params}, nhwc(x)))  # train=False: no drop path
  assert np.abs(want).max() > 0.1 and np.std(want) > 0.01  # logits that can tell models apart
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # And back: our parameters load strictly into another timm model and give the first one's logits.
  back = timm_classifier(drop_path, seed=7)
  back.load_state_dict({k: torch.from_numpy(np.array(v))
                        for k, v in rules.to_torch(params, official.vit_rules(model)).items()},
                       strict=True)
  with torch.no_grad():
    np.testing.assert_array_equal(back(torch.from_numpy(x)).numpy(), want)


# ------------------------------------------------------------------------------------------------
# 2. Mixup / CutMix

MIXUP = dict(mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, mode="batch",
             correct_lam=True, label_smoothing=0.1, num_classes=1000)
BATCH, H, W = 32, 24, 32  # H != W: a swapped axis would show


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(3)
  return (rng.standard_normal((BATCH, 3, H, W)).astype(np.float32),
          rng.integers(0, 1000, BATCH))


def timm_mixup(seed, x, y, monkeypatch):
  """timm's ``Mixup`` on (NCHW ``x``, ``y``) after ``np.random.seed(seed)``, and what it drew: the
  (lam, use_cutmix) of ``_params_per_batch``, and for CutMix the box ``rand_bbox`` returned with
  the centre (cy, cx) it drew, replayed from numpy's state on entry."""
  np.random.seed(seed)
  drawn = {}
  mixer = tmix.Mixup(**MIXUP)
  params = mixer._params_per_batch

  def recorded_params():
    drawn["lam"], drawn["use_cutmix"] = params()
    return drawn["lam"], drawn["use_cutmix"]

  rand_bbox = tmix.rand_bbox

  def recorded_bbox(img_shape, lam, margin=0.0, count=None):
    before = np.random.get_state()
    box = rand_bbox(img_shape, lam, margin, count)
    replay = np.random.RandomState()
    replay.set_state(before)
    drawn["cy"], drawn["cx"] = replay.randint(0, img_shape[-2]), replay.randint(0, img_shape[-1])
    after, replayed = np.random.get_state(), replay.get_state()
    assert after[2] == replayed[2] and np.array_equal(after[1], replayed[1])  # same two draws
    drawn["box"] = tuple(int(v) for v in box)
    return box

  with monkeypatch.context() as patch:
    patch.setattr(mixer, "_params_per_batch", recorded_params)
    patch.setattr(tmix, "rand_bbox", recorded_bbox)
    out, target = mixer(torch.from_numpy(x.copy()), torch.from_numpy(y))
  return out.numpy(), target.numpy(), drawn


def test_mixup_and_cutmix_equal_timms_for_the_same_draws(batch, monkeypatch):
  x, y = batch
  seen = set()
  for seed in range(16):
    want_x, want_t, drawn = timm_mixup(seed, x, y, monkeypatch)
    lam, use_cutmix = drawn["lam"], drawn["use_cutmix"]
    cy, cx = (drawn["cy"], drawn["cx"]) if use_cutmix else (0, 0)
    got_x, got_t = mixup.mix_group(nhwc(x), mixup.smooth_one_hot(jnp.asarray(y), 1000, 0.1),
                                   jnp.float32(lam), jnp.asarray(use_cutmix), cy, cx)
    got_x, got_t = np.asarray(got_x).transpose(0, 3, 1, 2), np.asarray(got_t)
    where = f"seed {seed}: lam {lam}, cutmix {use_cutmix}, centre {(cy, cx)}"
    np.testing.assert_allclose(got_t.sum(-1), 1.0, rtol=1e-6, err_msg=where)
    if not use_cutmix:
      seen.add("mixup")
      assert 0.0 < lam < 1.0, where
      np.testing.assert_allclose(got_x, want_x, rtol=1e-6, atol=1e-6, err_msg=where)
      np.testing.assert_allclose(got_t, want_t, rtol=1e-6, atol=1e-6, err_msg=where)
      continue
    box, corrected = mixup.cutmix_box(H, W, jnp.float32(lam), cy, cx)
    (y0, y1, x0, x1), our_lam = (int(v) for v in box), float(corrected)
    yl, yh, xl, xh = drawn["box"]
    cut_h, cut_w = int(H * np.sqrt(1 - lam)), int(W * np.sqrt(1 - lam))
    assert (y0, x0) == (yl, xl), where  # the low edges agree in every timm version
    # timm 0.3.2 (ours): c + floor(cut / 2); timm 1.0.31: c + ceil(cut / 2).
    assert (y1, x1) == (min(H, cy + cut_h // 2), min(W, cx + cut_w // 2)), where
    assert (yh, xh) == (min(H, cy + (cut_h + 1) // 2), min(W, cx + (cut_w + 1) // 2)), where
    assert our_lam == pytest.approx(1 - (y1 - y0) * (x1 - x0) / (H * W), abs=1e-7), where
    flipped = x[::-1]
    if (y1, x1) == (yh, xh):
      seen.add("cutmix, same box")
      np.testing.assert_array_equal(got_x, want_x, err_msg=where)
      np.testing.assert_allclose(got_t, want_t, rtol=1e-6, atol=1e-6, err_msg=where)
    else:
      seen.add("cutmix, odd side")
      # Where timm 1.0.31's box reaches one row / column further, ours keeps the image's own pixel;
      # everywhere else the two are the same; the targets are timm's for our box's lam.
      strip = np.zeros((H, W), bool)
      strip[yl:yh, xl:xh] = True
      strip[y0:y1, x0:x1] = False
      assert strip.sum() == (yh - yl) * (xh - xl) - (y1 - y0) * (x1 - x0) > 0, where
      np.testing.assert_array_equal(got_x, np.where(strip, x, want_x), err_msg=where)
      assert not np.array_equal(np.where(strip, x, want_x), want_x), where
      np.testing.assert_array_equal(got_x[..., y0:y1, x0:x1], flipped[..., y0:y1, x0:x1])
      want_t = tmix.mixup_target(torch.from_numpy(y), 1000, our_lam, 0.1).numpy()
      np.testing.assert_allclose(got_t, want_t, rtol=1e-6, atol=1e-6, err_msg=where)
  assert seen == {"mixup", "cutmix, same box", "cutmix, odd side"}


# ------------------------------------------------------------------------------------------------
# 3. RandAugment rand-m9-mstd0.5-inc1

POLICY = "rand-m9-mstd0.5-inc1"
FILL = ra.fill_color(IMAGENET_DEFAULT_MEAN)


@pytest.fixture(scope="module")
def timm_rand_augment():
  """As timm's ``transforms_factory`` builds it for upstream MAE (input 224, bicubic)."""
  hparams = dict(translate_const=int(224 * 0.45),
                 img_mean=tuple(min(255, round(255 * m)) for m in IMAGENET_DEFAULT_MEAN),
                 interpolation=Image.BICUBIC)
  return taa.rand_augment_transform(POLICY, hparams)


@pytest.fixture(scope="module")
def image():
  rng = np.random.default_rng(0)
  base = rng.integers(30, 220, (24, 20, 3))
  base[:, :, 1] = base[:, :, 1] // 2 + 40  # channels with different ranges
  base[:3, :5, 2] = 255  # a saturated corner (solarize, posterize, enhance clipping)
  return Image.fromarray(base.astype(np.uint8), "RGB")


class Script:
  """Scripted draws, in list order, standing in for Python's ``random`` module inside timm
  (``random``, ``gauss``) and for the ``numpy.random.Generator`` of ``ra.rand_augment``
  (``choice``, ``random``, ``normal``); the (mu, sigma) each side asks for are recorded."""

  def __init__(self, uniforms=(), gausses=(), choices=()):
    self.uniforms, self.gausses, self.choices = list(uniforms), list(gausses), list(choices)
    self.gauss_args = []

  def random(self):
    return self.uniforms.pop(0)

  def gauss(self, mu, sigma):
    self.gauss_args.append((mu, sigma))
    return self.gausses.pop(0)

  normal = gauss

  def choice(self, n, size, replace):
    assert (n, size, replace) == (len(ra.OPS), 2, True)
    return np.asarray(self.choices.pop(0))


def test_policy_fill_and_signed_ops_equal_timms(timm_rand_augment, monkeypatch):
  t = timm_rand_augment
  params = data_config.rand_augment_params(POLICY)
  assert [op.name for op in t.ops] == list(ra.OPS) == taa._RAND_INCREASING_TRANSFORMS
  assert (t.num_layers, t.choice_weights) == (params["num_ops"], None) == (2, None)
  for op in t.ops:
    assert (op.prob, op.magnitude, op.magnitude_std) == (0.5, params["magnitude"],
                                                          params["magnitude_std"]), op.name
    assert op.kwargs == dict(fillcolor=FILL, resample=Image.BICUBIC), op.name
    assert op.magnitude_max is None  # clipped to [0, _LEVEL_DENOM = 10] as ours (ra.MAX_LEVEL)
  assert FILL == (124, 116, 104) and taa._LEVEL_DENOM == ra.MAX_LEVEL
  signed = set()
  for op in t.ops:  # an op is signed when its level function reads the coin
    monkeypatch.setattr(taa, "random", Script([0.9, 0.1]))
    if op.level_fn is not None and op.level_fn(9.0, op.hparams) != op.level_fn(9.0, op.hparams):
      signed.add(op.name)
  assert signed == set(ra.SIGNED)


MAGNITUDES = [(0.0, 0.0), (4.5, 4.5), (9.0, 9.0), (9.7, 9.7), (10.0, 10.0), (11.0, 10.0),
              (-1.0, 0.0)]  # (drawn, after the clip to [0, 10])


@pytest.mark.parametrize("name", ra.OPS)
def test_every_op_equals_timms_bit_for_bit(name, timm_rand_augment, image, monkeypatch):
  """timm's ``AugmentOp`` (its probability test, magnitude clip, level function, sign coin, op with
  its fill and resampling) against ``ra.level_arg`` + ``ra.apply_op``, for both signs."""
  op = next(o for o in timm_rand_augment.ops if o.name == name)
  source = np.asarray(image)
  changed = 0
  for drawn, m in MAGNITUDES:
    for negate in (False, True):
      where = f"{name} at magnitude {drawn} (clipped {m}), negate {negate}"
      coin = 0.9 if negate else 0.1  # timm negates when random() > 0.5
      arg = ra.level_arg(name, m, negate)
      if op.level_fn is None:
        assert arg is None, where
      else:
        monkeypatch.setattr(taa, "random", Script([coin]))
        want_arg = op.level_fn(m, op.hparams)
        # Exact, but for timm 1.0's floor max(0.1, 1 - 0.9) = 0.1 of the enhance factors, which
        # ours computes as 0.09999999999999998 (the same C float in Pillow's blend).
        assert len(want_arg) == 1 and arg == pytest.approx(want_arg[0], rel=0, abs=1e-15), where
      ours = np.asarray(ra.apply_op(image.copy(), name, arg, FILL))
      # The whole AugmentOp: 0.0 <= 0.5 runs it, then the magnitude, then (signed ops) the coin.
      run = Script([0.0, coin], [drawn])
      monkeypatch.setattr(taa, "random", run)
      if name == "PosterizeIncreasing" and m == 10.0:  # 0 bits: see the module docstring
        with pytest.raises(ValueError, match="bits must be between or equal to 1 and 8"):
          op(image.copy())
        np.testing.assert_array_equal(ours, np.zeros_like(source), err_msg=where)
        continue
      want = np.asarray(op(image.copy()))
      assert run.gauss_args == [(9, 0.5)], where  # timm drew the magnitude from N(9, 0.5)
      assert run.uniforms == ([] if name in ra.SIGNED else [coin]), where
      assert ours.dtype == want.dtype == np.uint8 and ours.shape == want.shape, where
      np.testing.assert_array_equal(ours, want, err_msg=where)
      changed += not np.array_equal(want, source)
  assert changed >= 6  # the comparisons were not all of unchanged images


def draws(seed, images):
  """A scripted stream for ``images`` RandAugment calls: op pairs, uniforms (30% of them the
  edge 0.5) and magnitudes (a tenth below 0, clipped to 0); magnitudes stay below 10, where timm
  1.0.31 with Pillow 13 fails on PosterizeIncreasing (module docstring)."""
  rng = np.random.default_rng(seed)
  choices = [rng.integers(0, len(ra.OPS), 2) for _ in range(images)]
  uniforms = np.where(rng.random(6 * images) < 0.3, 0.5, rng.random(6 * images))
  gausses = np.minimum(9.0 + 0.5 * rng.standard_normal(4 * images), 9.99)
  gausses[rng.random(4 * images) < 0.1] = -0.5
  return choices, [float(u) for u in uniforms], [float(g) for g in gausses]


def test_rand_augment_draws_equal_timms_for_the_same_stream(timm_rand_augment, image, monkeypatch):
  """Both pipelines fed one scripted stream: the same images, and the same number of draws taken
  (op pair; per op the probability, the magnitude and for signed ops the sign, in that order)."""
  images = 120
  choices, uniforms, gausses = draws(0, images)
  theirs = Script(uniforms, gausses)
  monkeypatch.setattr(taa, "random", theirs)
  pairs = iter(choices)

  def choice(ops, n, replace, p):  # timm's np.random.choice(self.ops, 2, replace=True, p=None)
    assert (n, replace, p) == (2, True, None)
    return [ops[i] for i in next(pairs)]

  monkeypatch.setattr(taa.np.random, "choice", choice)
  ours = Script(uniforms, gausses, choices)
  src = image.resize((16, 12))
  differ = 0
  for i in range(images):
    want = np.asarray(timm_rand_augment(src.copy()))
    got = np.asarray(ra.rand_augment(src.copy(), ours, FILL))
    np.testing.assert_array_equal(got, want, err_msg=f"image {i}")
    assert (len(ours.uniforms), len(ours.gausses)) == (len(theirs.uniforms),
                                                       len(theirs.gausses)), f"image {i}"
    differ += not np.array_equal(want, np.asarray(src))
  assert set(theirs.gauss_args) == set(ours.gauss_args) == {(9, 0.5)}
  used = 6 * images - len(ours.uniforms)
  assert 120 < used and 60 < len(theirs.gauss_args) and 50 < differ < images


def test_rand_augment_samples_the_same_distribution(timm_rand_augment, image, monkeypatch):
  """Free-running RNGs (Python's and numpy's for timm, a seeded Generator for ours), ops recorded
  instead of run: ops per image, op frequencies, magnitudes and signs agree in distribution."""
  trials = 3000
  timm_calls, our_calls = [], []
  t = timm_rand_augment
  for op in t.ops:
    monkeypatch.setattr(op, "aug_fn", lambda img, *args, _n=op.name, **kw: (
        timm_calls.append((_n, args[0] if args else None)) or img))
  random.seed(0)
  np.random.seed(0)
  for _ in range(trials):
    t(image)
  monkeypatch.setattr(ra, "apply_op", lambda img, name, arg, fill: our_calls.append((name, arg))
                      or img)
  rng = np.random.default_rng(0)
  for _ in range(trials):
    ra.rand_augment(image, rng, FILL)
  for calls in (timm_calls, our_calls):  # 2 ops x 0.5: one per image; sd of the rate ~0.013
    assert len(calls) / trials == pytest.approx(1.0, abs=0.05)
  assert len(our_calls) / len(timm_calls) == pytest.approx(1.0, abs=0.07)
  for name in ra.OPS:  # 1/15 of the ops each (~200 of 3000; sd ~14)
    n_timm = sum(n == name for n, _ in timm_calls)
    n_ours = sum(n == name for n, _ in our_calls)
    assert 130 < n_timm < 270 and 130 < n_ours < 270, (name, n_timm, n_ours)
  rot = {k: np.array([a for n, a in calls if n == "Rotate"])
         for k, calls in (("timm", timm_calls), ("ours", our_calls))}
  for k, r in rot.items():  # |angle| = 3 m: mean 27, sd 1.5 (the clip at 30 barely binds)
    assert np.mean(r < 0) == pytest.approx(0.5, abs=0.12), k
    assert np.mean(np.abs(r)) == pytest.approx(27.0, abs=0.4), k
    assert np.std(np.abs(r)) == pytest.approx(1.5, abs=0.35), k
    assert np.abs(r).max() <= 30.0, k
  assert np.mean(np.abs(rot["timm"])) == pytest.approx(np.mean(np.abs(rot["ours"])), abs=0.5)


# ------------------------------------------------------------------------------------------------
# 4. Random erasing

ERASE_P, EH, EW, ERASE_N = 0.25, 12, 20, 96
LOG_ASPECT = (math.log(0.3), math.log(1 / 0.3))


class ScriptedErasingRandom:
  """Python's ``random`` inside timm's ``RandomErasing._erase``, per example ``i`` in order:
  ``random()`` -> apply[i]; per try ``t`` ``uniform(area bounds)`` -> area[i, t] and
  ``uniform(log-aspect bounds)`` -> log_aspect[i, t]; ``randint(0, b)`` -> floor(f (b + 1)) for the
  top, then the left fraction."""

  def __init__(self, apply, area, log_aspect, top, left):
    self.apply, self.area, self.log_aspect, self.top, self.left = apply, area, log_aspect, top, left
    self.i, self.bounds = -1, set()

  def random(self):
    self.i += 1
    self.t, self.places = 0, [self.top[self.i], self.left[self.i]]
    return self.apply[self.i]

  def uniform(self, a, b):
    self.bounds.add((a, b))
    if (a, b) == (0.02, 1 / 3):
      return self.area[self.i, self.t]
    self.t += 1
    return self.log_aspect[self.i, self.t - 1]

  def randint(self, a, b):
    assert a == 0
    return int(math.floor(self.places.pop(0) * (b + 1)))


class ScriptedJaxRandom:
  """``jax.random`` inside ``mixup.random_erasing``: its six streams (split in the order apply,
  area, aspect, top, left, noise) return the scripted arrays; ``normal`` returns ``noise``."""

  def __init__(self, apply, area, log_aspect, top, left, noise):
    self.streams = dict(apply=apply, area=area, aspect=log_aspect, top=top, left=left)
    self.noise, self.bounds = noise, {}

  def split(self, key, n):
    assert n == 6
    return ["apply", "area", "aspect", "top", "left", "noise"]

  def uniform(self, key, shape, minval=0.0, maxval=1.0):
    self.bounds[key] = (float(minval), float(maxval))
    value = jnp.asarray(self.streams[key], jnp.float32)
    assert value.shape == tuple(shape), key
    return value

  def normal(self, key, shape, dtype):
    assert key == "noise" and tuple(shape) == self.noise.shape
    return jnp.asarray(self.noise, dtype)


def test_random_erasing_equals_timms_for_the_same_draws(monkeypatch):
  rng = np.random.default_rng(5)
  apply = np.where(rng.random(ERASE_N) < 0.15, ERASE_P, rng.random(ERASE_N) * 0.5)  # 0.25: erases
  apply[:4] = 0.1  # applied, but no try fits (below)
  area = rng.uniform(0.02, 1 / 3, (ERASE_N, 10))
  log_aspect = rng.uniform(*LOG_ASPECT, (ERASE_N, 10))
  area[:4], log_aspect[:4] = 0.33, LOG_ASPECT[1] * 0.99  # 16 x 5 boxes: never fit 12 rows
  top, left = rng.random(ERASE_N), rng.random(ERASE_N)
  x = rng.uniform(5.0, 6.0, (ERASE_N, 3, EH, EW)).astype(np.float32)  # N(0, 1) noise never matches
  theirs = ScriptedErasingRandom(apply, area, log_aspect, top, left)
  monkeypatch.setattr(terase, "random", theirs)
  torch.manual_seed(0)
  eraser = terase.RandomErasing(probability=ERASE_P, mode="pixel", max_count=1, device="cpu")
  want = eraser(torch.from_numpy(x.copy())).numpy()
  assert theirs.i == ERASE_N - 1 and theirs.bounds == {(0.02, 1 / 3), LOG_ASPECT}
  erased = (want != x).any(axis=1)
  # Our noise: timm's values inside timm's boxes, a value no box may show elsewhere.
  noise = np.where(erased[:, None], want, np.float32(1e6))
  ours = ScriptedJaxRandom(apply, area, log_aspect, top, left, nhwc(noise))
  monkeypatch.setattr(mixup, "jax", types.SimpleNamespace(random=ours))
  got = np.asarray(mixup.random_erasing(None, nhwc(x), prob=ERASE_P)).transpose(0, 3, 1, 2)
  np.testing.assert_array_equal(got, want)
  assert ours.bounds["area"] == pytest.approx((0.02, 1 / 3), abs=1e-7)
  assert ours.bounds["aspect"] == pytest.approx(LOG_ASPECT, abs=1e-6)
  # The script reached every branch: skipped, no try fits, the first try fits, a later try fits.
  hit = erased.any(axis=(1, 2))
  first_fits = np.array([round(math.sqrt(area[i, 0] * EH * EW * math.exp(log_aspect[i, 0]))) < EH
                         and round(math.sqrt(area[i, 0] * EH * EW / math.exp(log_aspect[i, 0])))
                         < EW for i in range(ERASE_N)])
  applied = apply <= ERASE_P
  assert applied[:4].all() and not hit[:4].any()
  assert (~applied).sum() >= 10 and not hit[~applied].any() and 20 < hit.sum()
  assert (hit & first_fits).sum() >= 5 and (hit & ~first_fits).sum() >= 3
  for i in np.nonzero(hit)[0]:  # one rectangle each
    rows, cols = np.nonzero(erased[i])
    assert erased[i].sum() == (np.ptp(rows) + 1) * (np.ptp(cols) + 1), i


def test_random_erasing_statistics_equal_timms():
  """Free-running RNGs: erase rate, the erased area and the aspect (log h / w) distribution."""
  n = 4000
  random.seed(0)
  torch.manual_seed(0)
  x = np.full((n, 1, EH, EW), 7.0, np.float32)
  eraser = terase.RandomErasing(probability=ERASE_P, mode="pixel", max_count=1, device="cpu")
  theirs = eraser(torch.from_numpy(x.copy())).numpy()[:, 0] != 7.0
  ours = np.asarray(mixup.random_erasing(jax.random.key(0), nhwc(x)))[..., 0] != 7.0

  def stats(mask):
    hit = mask.any(axis=(1, 2))
    frac = mask[hit].mean(axis=(1, 2))
    aspect = mask[hit].any(axis=2).sum(1) / mask[hit].any(axis=1).sum(1)
    return hit.mean(), frac.mean(), np.log(aspect).mean(), np.log(aspect).std()

  (rate_t, frac_t, asp_t, spread_t), (rate_o, frac_o, asp_o, spread_o) = stats(theirs), stats(ours)
  assert rate_t == pytest.approx(ERASE_P, abs=0.025) and rate_o == pytest.approx(rate_t, abs=0.035)
  assert frac_o == pytest.approx(frac_t, rel=0.08)  # ~1000 boxes each; sd of the mean ~3%
  # log(h / w): ~1000 boxes each, sd 0.66, so the means' sd is ~0.02 each.
  assert asp_o == pytest.approx(asp_t, abs=0.08) and spread_o == pytest.approx(spread_t, rel=0.1)
