"""Fine-tuning protocol, the checks of docs/finetune.md's CPU recipe: layer ids and lr scales, the
weight-decay groups, the per-step schedule, one AdamW step against torch's with its parameter
groups, drop path, loading a pre-trained MAE, pos-embed interpolation against torch's bicubic.

The tiny model of the recipe: 32-pixel images, patch 4, width 64, depth 4, 4 heads, 10 classes,
alpha_min 0.7, drop path 0.1, layer decay 0.75."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from decay_jax.io import official, rules
from decay_jax.models import blocks, stack
from decay_jax.models import mae as mae_lib
from decay_jax.models import vit
from decay_jax.models.residual import Residual
from decay_jax.train import finetune_optim as fo
from decay_jax.train import optim
from decay_jax.train.tasks.mae import MAETask
from decay_jax.train import tasks
from ml_collections import ConfigDict

TINY = dict(num_classes=10, img_size=32, patch_size=4, dim=64, depth=4, num_heads=4,
            drop_path=0.1, residual=Residual(alpha_min=0.7))


@pytest.fixture(scope="module")
def tiny():
  model = vit.ViTClassifier(**TINY)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((2, 32, 32, 3)))["params"]
  return model, params


def fresh_params(model, seed):
  """The classifier's own initialisation (the trainer's fresh state) at ``seed``."""
  x = jnp.zeros((1, model.img_size, model.img_size, model.in_chans))
  return jax.jit(model.init)(jax.random.key(seed), x)["params"]


def by_torch_name(model, tree):
  """``{torch name: value}`` of a parameter-shaped tree (block leaves sliced per layer)."""
  flat = {tuple(getattr(k, "key", k) for k in path): v
          for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
  out = {}
  for r in official.vit_rules(model):
    v = np.asarray(flat[r.path])
    out[r.torch_key] = v[r.layer] if r.layer is not None and v.ndim else v
  return out


def test_layer_ids_scales_and_weight_decay_groups_of_the_tiny_model(tiny):
  model, params = tiny
  scales = by_torch_name(model, fo.lr_scales(params, 4, 0.75))
  decay = by_torch_name(model, fo.weight_decay_mask(params))
  expected_ids = {"cls_token": 0, "pos_embed": 0, "patch_embed.proj.weight": 0,
                  "patch_embed.proj.bias": 0, "fc_norm.weight": 5, "fc_norm.bias": 5,
                  "head.weight": 5, "head.bias": 5}
  expected_ids.update({f"blocks.{j}.{leaf}": j + 1 for j in range(4) for leaf in (
      "norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
      "attn.proj.bias", "norm2.weight", "norm2.bias", "mlp.fc1.weight", "mlp.fc1.bias",
      "mlp.fc2.weight", "mlp.fc2.bias")})
  assert set(scales) == set(expected_ids) and len(scales) == 4 + 12 * 4 + 4
  spec_scales = [0.2373047, 0.3164063, 0.421875, 0.5625, 0.75, 1.0]  # ids 0..5
  for name, i in expected_ids.items():
    assert float(np.ravel(scales[name])[0]) == pytest.approx(spec_scales[i], rel=1e-6), name
    # Upstream: no decay for 1-D tensors (biases, LayerNorm) and for cls_token / pos_embed.
    torch_rank = 1 if name.endswith(".bias") or "norm" in name else 2
    assert bool(decay[name]) == (torch_rank >= 2 and name not in ("cls_token", "pos_embed")), name


def test_vit_b16_has_the_specs_fourteen_layer_scales():
  model = vit.ViTClassifier(num_classes=1000)
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))["params"]
  n = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
  assert n == 86_567_656  # encoder 85,645,824 + pos_embed 151,296 + fc_norm 1,536 + head 769,000
  scales = by_torch_name(model, fo.lr_scales(params, 12, 0.65))
  got = [float(np.ravel(scales[k])[0]) for k in
         ["pos_embed"] + [f"blocks.{j}.attn.qkv.weight" for j in range(12)] + ["head.weight"]]
  spec = [0.00369721, 0.00568801, 0.00875078, 0.0134627, 0.0207119, 0.0318645, 0.0490223,
          0.0754189, 0.116029, 0.178506, 0.274625, 0.4225, 0.65, 1.0]
  np.testing.assert_allclose(got, spec, rtol=2e-5)


def test_schedule_per_step_of_the_tiny_recipe():
  """2 epochs of 10 steps, warmup 1 epoch, lr 1e-3, min_lr 1e-6 (the spec's values)."""
  cfg = ConfigDict(dict(lr=1e-3, min_lr=1e-6, schedule="warmup_cosine"))
  schedule = optim.lr_schedule(cfg, 16, total_steps=20, warmup_steps=10)
  got = np.array([float(schedule(s)) for s in range(20)])
  spec = [0, 1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 6e-4, 7e-4, 8e-4, 9e-4, 1e-3, 9.75553e-4, 9.04604e-4,
          7.94099e-4, 6.54854e-4, 5.005e-4, 3.46146e-4, 2.06901e-4, 9.6396e-5, 2.54473e-5]
  np.testing.assert_allclose(got, spec, rtol=1e-5, atol=1e-12)
  # ViT-B/16 (1,251 steps per epoch, 100 epochs, warmup 5, lr 2e-3): the spec's epoch checks.
  cfg.lr = 2e-3
  s = 1251
  vit_b = optim.lr_schedule(cfg, 1024, total_steps=100 * s, warmup_steps=5 * s)
  for step, lr in [(0, 0.0), (int(2.5 * s) + 0.5, 1e-3), (5 * s, 2e-3), (52.5 * s, 1.0005e-3),
                   (100 * s - 1, 1.0000004e-6)]:
    assert float(vit_b(step)) == pytest.approx(lr, rel=1e-4, abs=1e-12), step


def test_one_step_equals_torch_adamw_with_upstreams_parameter_groups(tiny):
  model, params = tiny
  rng = np.random.default_rng(0)
  grads = jax.tree_util.tree_map(lambda p: rng.standard_normal(p.shape).astype(np.float32),
                                 params)
  lr, wd = 1e-3, 0.05
  tx = fo.make_optimizer(params, 4, lambda step: lr, layer_decay=0.75, weight_decay=wd)
  state = tx.init(params)
  updates, _ = tx.update(grads, state, params)
  new = jax.tree_util.tree_map(lambda p, u: p + u, params, updates)

  p_np, g_np = by_torch_name(model, params), by_torch_name(model, grads)
  scales = by_torch_name(model, fo.lr_scales(params, 4, 0.75))
  decay = by_torch_name(model, fo.weight_decay_mask(params))
  tensors = {k: torch.nn.Parameter(torch.tensor(v, dtype=torch.float32)) for k, v in p_np.items()}
  groups = {}
  for k in tensors:  # upstream param_groups_lrd: one group per (layer scale, decay or not)
    key = (float(np.ravel(scales[k])[0]), bool(decay[k]))
    groups.setdefault(key, []).append(tensors[k])
  opt = torch.optim.AdamW([{"params": ps, "lr": lr * s, "weight_decay": wd if d else 0.0}
                           for (s, d), ps in groups.items()], lr=lr, betas=(0.9, 0.999), eps=1e-8)
  assert len(groups) == 2 * 6  # ids 0..5, each with decayed and undecayed tensors
  for k, t in tensors.items():
    t.grad = torch.tensor(g_np[k])
  opt.step()
  want = {k: t.detach().numpy() for k, t in tensors.items()}
  got = by_torch_name(model, new)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_drop_path_rates_eval_identity_and_training_statistics(tiny):
  model, params = tiny
  rates = vit.drop_path_rates(4, 0.1)
  assert rates.dtype == np.float32
  np.testing.assert_allclose(rates, [0, 0.0333333, 0.0666667, 0.1], rtol=2e-6)  # spec: 6 digits
  x = jax.random.normal(jax.random.key(1), (4, 32, 32, 3))
  no_drop = vit.ViTClassifier(**dict(TINY, drop_path=0.0))
  np.testing.assert_array_equal(model.apply({"params": params}, x),
                                no_drop.apply({"params": params}, x))
  # A branch of ones: each example is zero or exactly 1/(1-p), zero with probability p.
  p = 0.3

  class Probe(blocks.nn.Module):
    @blocks.nn.compact
    def __call__(self, branch):
      return stack.drop_path(self, branch, p)

  out = np.asarray(Probe().apply({}, jnp.ones((20000, 3, 2)), rngs={"dropout": jax.random.key(2)}))
  per_example = out[:, 0, 0]
  assert set(np.unique(out)) <= {0.0, np.float32(1 / (1 - p))}
  assert (out == per_example[:, None, None]).all()  # one draw for all tokens of an example
  assert np.mean(per_example == 0) == pytest.approx(p, abs=0.015)
  # In a block the attention and MLP branches draw independently: with p = 0.5 both are dropped
  # for a quarter of the examples (the sown branch norms are zero exactly when dropped).
  block = blocks.MAEBlock(2, stochastic_depth=True)
  xb = jax.random.normal(jax.random.key(3), (4000, 5, 8))
  variables = block.init(jax.random.key(4), xb[:2], stack.BlockInputs((1.0, 1.0), drop_rate=0.0))
  # attn.proj and mlp.fc2 start at zero (the official init): random weights make both branches live.
  leaves, tree = jax.tree_util.tree_flatten(variables)
  variables = jax.tree_util.tree_unflatten(tree, [
      jax.random.normal(jax.random.key(10 + i), l.shape) for i, l in enumerate(leaves)])
  _, inter = block.apply(variables, xb, stack.BlockInputs((1.0, 1.0), drop_rate=0.5),
                         rngs={"dropout": jax.random.key(5)}, mutable=["intermediates"])
  attn = np.asarray(inter["intermediates"]["attn_norms"][0])[:, 0] == 0
  mlp = np.asarray(inter["intermediates"]["mlp_norms"][0])[:, 0] == 0
  assert attn.mean() == pytest.approx(0.5, abs=0.03) and mlp.mean() == pytest.approx(0.5, abs=0.03)
  assert (attn & mlp).mean() == pytest.approx(0.25, abs=0.03)


def test_init_from_a_pretrained_mae_copies_the_encoder_and_makes_the_head_fresh():
  mae = mae_lib.mae("micro/4", residual=Residual(alpha_min=0.6))
  x = jnp.zeros((1, 16, 16, 3))
  mae_params = jax.jit(mae.init)(jax.random.key(0), x, jnp.zeros((1, 16)))["params"]
  model = vit.from_mae(mae, num_classes=10, drop_path=0.1)
  assert (model.alpha_min, model.depth, model.dim) == (0.6, 4, 32)
  np.testing.assert_array_equal(model.shortcuts.alphas, mae.shortcuts.alphas)
  params = vit.init_from_mae(fresh_params(model, 1), mae, mae_params)
  for name in ("patch_embed", "cls_token", "blocks"):
    for a, b in zip(jax.tree_util.tree_leaves(params[name]),
                    jax.tree_util.tree_leaves(mae_params[name])):
      np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(params["pos_embed"][0], mae.pos_embed())
  np.testing.assert_array_equal(params["fc_norm"]["scale"], 1.0)
  np.testing.assert_array_equal(params["fc_norm"]["bias"], 0.0)
  np.testing.assert_array_equal(params["head"]["bias"], 0.0)
  big = vit.ViTClassifier(num_classes=1000, dim=256, num_heads=4, depth=1)
  w = np.asarray(jax.jit(big.init)(jax.random.key(2), jnp.zeros((1, 224, 224, 3)))
                 ["params"]["head"]["kernel"])
  assert w.std() == pytest.approx(2e-5, rel=0.02) and abs(w.mean()) < 1e-7
  # A classifier whose sizes differ from the checkpoint's is refused in one line.
  other = vit.from_mae(mae, num_classes=10, drop_path=0.1, dim=64, num_heads=4)
  with pytest.raises(ValueError, match="the pre-trained 'patch_embed' does not fit"):
    vit.init_from_mae(fresh_params(other, 1), mae, mae_params)
  # At a larger image size the positions are the pre-training table, interpolated.
  at32 = vit.from_mae(mae, num_classes=10, drop_path=0.1, img_size=32)
  p32 = vit.init_from_mae(fresh_params(at32, 1), mae, mae_params)
  np.testing.assert_array_equal(p32["pos_embed"][0], vit.interpolate_pos_embed(mae.pos_embed(), 8))


def test_pos_embed_interpolation_is_torchs_bicubic():
  rng = np.random.default_rng(0)
  table = rng.standard_normal((1 + 8 * 8, 12)).astype(np.float32)
  np.testing.assert_array_equal(vit.interpolate_pos_embed(table, 8), table)
  for new in (16, 5, 11):
    patches = torch.tensor(table[1:]).reshape(1, 8, 8, 12).permute(0, 3, 1, 2)
    want = torch.nn.functional.interpolate(patches.double(), size=(new, new), mode="bicubic",
                                           align_corners=False)
    want = want.permute(0, 2, 3, 1).reshape(new * new, 12).numpy()
    got = vit.interpolate_pos_embed(table, new)
    np.testing.assert_array_equal(got[0], table[0])  # the cls row is kept
    np.testing.assert_allclose(got[1:], want, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="pos_embed with 11 rows is not allowed"):
    vit.interpolate_pos_embed(table[:11], 4)


# ------------------------------------------------------------------------------------------------
# Mixup / CutMix (timm's Mixup in 'batch' mode, per group), label smoothing


def timm_like_mix(x, y, lam, use_cutmix, cy, cx, num_classes, smoothing):
  """The spec's steps in numpy, torch layout semantics on NHWC: the reference for one group."""
  x = x.copy()
  h, w = x.shape[1:3]
  if use_cutmix:
    ratio = np.sqrt(1 - lam)
    cut_h, cut_w = int(h * ratio), int(w * ratio)
    y0, y1 = np.clip(cy - cut_h // 2, 0, h), np.clip(cy + cut_h // 2, 0, h)
    x0, x1 = np.clip(cx - cut_w // 2, 0, w), np.clip(cx + cut_w // 2, 0, w)
    x[:, y0:y1, x0:x1] = x[::-1][:, y0:y1, x0:x1].copy()
    lam = 1 - (y1 - y0) * (x1 - x0) / (h * w)
  else:
    x = x * lam + x[::-1] * (1 - lam)
  off = smoothing / num_classes
  one = np.full((len(y), num_classes), off)
  one[np.arange(len(y)), y] = 1 - smoothing + off
  return x, lam * one + (1 - lam) * one[::-1], lam


@pytest.mark.parametrize("lam,use_cutmix,cy,cx", [
    (0.37, True, 5, 9), (0.37, False, 0, 0), (0.9, True, 0, 15), (0.05, True, 15, 0),
    (1.0, True, 7, 7), (1.0, False, 3, 3), (0.5, True, 8, 8)])
def test_mix_group_equals_the_specs_mixup_and_cutmix(lam, use_cutmix, cy, cx):
  from decay_jax.data import mixup
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 16, 16, 3)).astype(np.float32)
  y = rng.integers(0, 10, 8)
  want_x, want_t, want_lam = timm_like_mix(x, y, lam, use_cutmix, cy, cx, 10, 0.1)
  got_x, got_t = mixup.mix_group(jnp.asarray(x), mixup.smooth_one_hot(jnp.asarray(y), 10, 0.1),
                                 jnp.float32(lam), jnp.asarray(use_cutmix), cy, cx)
  if use_cutmix:
    np.testing.assert_array_equal(got_x, want_x)
  else:
    np.testing.assert_allclose(got_x, want_x, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got_t, want_t, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(got_t).sum(-1), 1.0, rtol=1e-6)
  if use_cutmix:
    (y0, y1, x0, x1), corrected = mixup.cutmix_box(16, 16, jnp.float32(lam), cy, cx)
    assert float(corrected) == pytest.approx(want_lam, abs=1e-7)


def test_smoothing_and_per_group_draws():
  from decay_jax.data import mixup
  t = np.asarray(mixup.smooth_one_hot(jnp.array([3]), 10, 0.1))[0]
  assert t[3] == pytest.approx(0.91) and np.delete(t, 3) == pytest.approx(0.01)
  t = np.asarray(mixup.smooth_one_hot(jnp.array([0]), 1000, 0.1))[0]
  assert t[0] == pytest.approx(0.9001) and t[1] == pytest.approx(1e-4)
  # 4096 groups of 2 constant images (0 and 1): the mixed first image's mean is 1 - lam (Mixup) or
  # the box's share (CutMix), so it reveals each group's own draw.
  groups = 4096
  images = jnp.tile(jnp.stack([jnp.zeros((8, 8, 1)), jnp.ones((8, 8, 1))]), (groups, 1, 1, 1))
  labels = jnp.tile(jnp.array([0, 1]), groups)
  mixed, targets = mixup.mixup_cutmix(jax.random.key(0), images, labels, 2, group=2)
  share = np.asarray(mixed[0::2]).mean(axis=(1, 2, 3))  # partner's share in example 0
  lam_t = np.asarray(targets[0::2, 0])  # target weight of its own label, smoothed
  lam = (lam_t - 0.05) / 0.9  # undo the smoothing (on 0.95, off 0.05)
  np.testing.assert_allclose(share, 1 - lam, atol=2e-6)  # the targets carry the mixed share
  binary = np.isclose(share * 64, np.round(share * 64), atol=1e-4)  # CutMix shares are k / 64
  assert 0.45 < binary.mean() < 0.56 and len(np.unique(lam)) > 500
  # Mixup's lam ~ Beta(0.8, 0.8), mean 0.5; CutMix's corrected lam is larger (the box is floored
  # and clipped at the borders, and lam = 1 - its area).
  assert 0.47 < lam[~binary].mean() < 0.53 and lam[binary].mean() > 0.55
  with pytest.raises(ValueError, match="batch 6 is not allowed; it must be a multiple of the "
                                       "mixup group 4"):
    mixup.mixup_cutmix(jax.random.key(0), images[:6], labels[:6], 2, group=4)
  logits = jnp.array([[2.0, -1.0], [0.5, 0.5]])
  want = -(np.asarray(targets[:2]) * np.asarray(jax.nn.log_softmax(logits))).sum(-1).mean()
  assert float(mixup.soft_cross_entropy(logits, targets[:2])) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("alpha_min", [1.0, 0.7])
def test_forward_matches_the_torch_reference_classifier(alpha_min):
  """Logits of upstream's global-pool ViT with the decayed blocks (tests/torch_reference.py), random
  weights, converted by name: at alpha 1 the standard timm ViT, at 0.7 the decayed one."""
  import torch_reference as ref
  torch.manual_seed(0)
  tm = ref.randomize_(ref.VisionTransformerClassifier(min_decay=alpha_min), seed=1, scale=0.1)
  tm.eval()
  model = vit.ViTClassifier(**dict(TINY, residual=Residual(alpha_min=alpha_min)))
  params, report = official.vit_from_torch(tm.state_dict(), model)
  assert len(report.loaded) == len(tm.state_dict()) == 4 + 12 * 4 + 4
  x = np.random.default_rng(2).standard_normal((3, 32, 32, 3)).astype(np.float32)
  with torch.no_grad():
    want = tm(torch.tensor(x).permute(0, 3, 1, 2)).numpy()
  got = np.asarray(jax.jit(model.apply)({"params": params}, x))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  back = rules.to_torch(params, official.vit_rules(model))
  assert list(back) == list(tm.state_dict())


# ------------------------------------------------------------------------------------------------
# End to end: a tiny MAE pre-trained by the trainer, then fine-tuned from its workdir


def tiny_overrides(c, steps):
  from testing_configs import override
  return override(c, **{"data.image_size": 16, "num_train_steps": steps, "batch_size": 32,
                        "picture_every_steps": 0, "checkpoint.async_save": False,
                        "checkpoint.every_steps": steps, "log_every_steps": 2, "mesh.data": 1,
                        "tensorboard": False})


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
  from decay_jax.evals import registry
  from decay_jax.train import trainer
  from testing_configs import load_config, override
  root = tmp_path_factory.mktemp("finetune")
  pre = tiny_overrides(load_config("mae_cpu_mnist"), 4)
  override(pre, **{"model.preset": "micro/4", "evals.knn.enabled": False,
                   "evals.rank.enabled": False})
  trainer.train_and_evaluate(pre, str(root / "pre"))
  ft = tiny_overrides(load_config("finetune_cpu_mnist"), 6)
  override(ft, **{"init_from": str(root / "pre"), "evals.accuracy.every_steps": 3,
                  "evals.accuracy.max_eval_examples": 200})
  results = trainer.train_and_evaluate(ft, str(root / "ft"), evaluators=registry.build)
  return root, ft, results


def test_finetuning_a_pretrained_workdir_trains_and_reports_accuracy(finetuned):
  import json
  from decay_jax import sharding as shd
  from decay_jax.train import checkpoint as ckpt_lib
  from decay_jax.train import pretrained
  root, ft, results = finetuned
  assert results["step"] == 6 and np.isfinite(results["loss"])
  assert 0 <= results["accuracy/top1"] <= results["accuracy/top5"] <= 1
  curve = [json.loads(l) for l in (root / "ft" / "metrics.jsonl").read_text().splitlines()]
  top1 = [r["accuracy/top1"] for r in curve if "accuracy/top1" in r]
  assert len(top1) == 2 and results["accuracy/top1_best"] == max(top1)
  saved = json.loads((root / "ft" / "results.json").read_text())
  assert saved["accuracy/top1_best"] == results["accuracy/top1_best"]
  # The classifier took the pre-trained encoder's sizes and decay schedule.
  mesh = shd.make_mesh(1, 1)
  mae_model, mae_params = pretrained.load(str(root / "pre"), mesh, MAETask)
  assert (mae_model.alpha_min, mae_model.depth, mae_model.in_chans) == (0.6, 4, 1)
  params, _ = ckpt_lib.restore_run_params(str(root / "ft"), mesh)
  assert set(params) == {"patch_embed", "cls_token", "pos_embed", "blocks", "fc_norm", "head"}
  assert params["head"]["kernel"].shape == (32, 10)
  # A params directory works as init_from too (what `decay_jax.cli.convert mae` writes).
  ckpt_lib.save_params(str(root / "params"), mae_params, mae_model)
  again, again_params = pretrained.load(str(root / "params"), mesh, MAETask)
  assert again.alpha_min == 0.6
  for a, b in zip(jax.tree_util.tree_leaves(again_params), jax.tree_util.tree_leaves(mae_params)):
    np.testing.assert_array_equal(a, b)


def test_an_mae_workdir_is_a_repa_encoder(finetuned):
  """``repa.encoder`` takes an MAE training workdir as it is (its trained weights, as init_from):
  the tokens are those of the same weights read by ``pretrained.load``."""
  from decay_jax import sharding as shd
  from decay_jax.train import pretrained
  from decay_jax.train import repa as repa_lib
  root, _, _ = finetuned
  encoder, params = repa_lib.load_encoder(str(root / "pre"), "half", MAETask)
  model, expected = pretrained.load(str(root / "pre"), shd.make_mesh(1, 1), MAETask)
  pixels = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 1)).astype(np.uint8)
  got = encoder.tokens(params, pixels)
  want = repa_lib.encoder_for(model, "half").tokens(expected, pixels)
  assert got.shape == (2, 16, 32)  # 4x4 patch tokens of the last block, class token dropped
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match="encoder_normalize='imagenet' is not allowed"):
    repa_lib.load_encoder(str(root / "pre"), "imagenet", MAETask)


def test_init_from_anything_else_is_one_line(finetuned, tmp_path):
  from decay_jax.train import checkpoint as ckpt_lib
  from decay_jax.train import pretrained
  from decay_jax.train import setup
  root, ft, _ = finetuned
  with pytest.raises(ckpt_lib.CheckpointError, match="init_from=.* is not allowed; it is neither "
                                                     "a pre-training workdir"):
    pretrained.load(str(tmp_path), None, MAETask)
  bad = ft.copy_and_resolve_references()
  bad.mixup.group = 12
  with pytest.raises(ValueError, match="mixup.group=12 is not allowed; it must divide "
                                       "batch_size = 32"):
    setup.check_config(bad)
  rgb = ft.copy_and_resolve_references()
  rgb.data.dataset = "cifar10"
  from decay_jax import sharding as shd
  mae_model, _ = pretrained.load(str(root / "pre"), shd.make_mesh(1, 1), MAETask)
  with pytest.raises(ValueError, match="data.dataset='cifar10' is not allowed; it has 3 channels; "
                                       "the pre-trained encoder takes 1"):
    tasks.build_model(rgb, {"image_size": 16, "channels": 3, "num_classes": 10}, mae_model)


def test_random_erasing_rate_area_and_noise():
  from decay_jax.data import mixup
  n, h, w = 10000, 16, 16
  images = jnp.full((n, h, w, 1), 7.0)
  out = np.asarray(mixup.random_erasing(jax.random.key(0), images))
  erased = (out != 7.0)[..., 0]
  frac = erased.mean(axis=(1, 2))
  hit = frac > 0
  assert hit.mean() == pytest.approx(0.25, abs=0.015)
  # Each erased region is one box of 2%..33% of the image (up to the rounding of its sides).
  assert frac[hit].min() >= 0.02 * 0.6 and frac[hit].max() <= 1 / 3 * 1.4
  for i in np.nonzero(hit)[0][:50]:
    rows, cols = np.nonzero(erased[i])
    box = erased[i, rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    assert box.all() and erased[i].sum() == box.size
  noise = out[hit][erased[hit]]
  assert abs(noise.mean()) < 0.02 and noise.std() == pytest.approx(1.0, abs=0.02)
  none = np.asarray(mixup.random_erasing(jax.random.key(1), images, prob=0.0))
  np.testing.assert_array_equal(none, images)


def test_an_alpha_of_zero_turns_that_mode_off():
  from decay_jax.data import mixup
  x = jax.random.normal(jax.random.key(0), (64, 8, 8, 1))
  y = jnp.arange(64) % 4
  same, t = mixup.mixup_cutmix(jax.random.key(1), x, y, 4, group=2, mixup_alpha=0.0,
                               cutmix_alpha=0.0, smoothing=0.0)
  np.testing.assert_array_equal(same, x)
  np.testing.assert_array_equal(t, jax.nn.one_hot(y, 4))
  # Mixup only: every group blends (no image keeps a pixel of its own exactly, no box).
  blended, _ = mixup.mixup_cutmix(jax.random.key(2), x, y, 4, group=2, cutmix_alpha=0.0)
  assert not np.any(np.isclose(np.asarray(blended), np.asarray(x)).all(axis=(1, 2, 3)))
  # CutMix only: every pixel is its own or its partner's.
  cut, _ = mixup.mixup_cutmix(jax.random.key(3), x, y, 4, group=2, mixup_alpha=0.0)
  partner = np.asarray(x).reshape(32, 2, 8, 8, 1)[:, ::-1].reshape(64, 8, 8, 1)
  assert np.all((np.asarray(cut) == np.asarray(x)) | (np.asarray(cut) == partner))


def test_an_official_decayed_checkpoint_loads_its_encoder_only():
  """The spec's loading check on an official-layout state_dict (skip.*, decoder_*, no norm):
  converted (``decay_jax.cli.convert mae`` does this), then the classifier takes exactly the encoder
  (4 + 12 x depth tensors), the schedule of ``min_decay``, and starts fc_norm and head fresh."""
  import torch_reference as ref
  kw = dict(img_size=16, patch_size=4, in_chans=3, embed_dim=32, depth=4, num_heads=2,
            decoder_embed_dim=16, decoder_depth=3, decoder_num_heads=2, min_decay=0.6)
  torch.manual_seed(0)
  sd = ref.randomize_(ref.MaskedAutoencoderViT(**kw), seed=1, scale=0.1).state_dict()
  assert any(k.startswith("skip.") for k in sd) and any(k.startswith("decoder_") for k in sd)
  assert not any(k.startswith("norm.") for k in sd)
  mae = mae_lib.MaskedAutoencoder(img_size=16, patch_size=4, dim=32, depth=4, num_heads=2,
                                  decoder_dim=16, decoder_depth=3, decoder_num_heads=2,
                                  residual=Residual(alpha_min=0.6))
  mae_params, _ = official.mae_from_torch(sd, mae)
  model = vit.from_mae(mae, num_classes=10, drop_path=0.1)
  params = vit.init_from_mae(fresh_params(model, 0), mae, mae_params)
  loaded = by_torch_name(model, params)
  as_torch = rules.to_torch(params, official.vit_rules(model))  # torch layout, torch names
  encoder = [k for k in loaded if k == "cls_token" or k.startswith(("patch_embed.", "blocks."))]
  assert len(encoder) + 1 == 4 + 12 * 4  # + pos_embed, the checkpoint's sin-cos table
  for k in encoder:
    np.testing.assert_array_equal(as_torch[k], sd[k].numpy(), err_msg=k)
  np.testing.assert_allclose(loaded["pos_embed"], sd["pos_embed"].numpy(), atol=1e-6)
  np.testing.assert_array_equal(loaded["fc_norm.weight"], 1.0)
  np.testing.assert_array_equal(loaded["fc_norm.bias"], 0.0)
  np.testing.assert_array_equal(loaded["head.bias"], 0.0)
  assert 0 < np.abs(loaded["head.weight"]).max() < 2e-4
  np.testing.assert_allclose(model.shortcuts.alphas, 1 - np.linspace(0, 1, 8).reshape(4, 2) * 0.4,
                             rtol=1e-6)
