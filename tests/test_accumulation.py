"""Gradient accumulation: ``accum_steps=4`` at batch B is one step at batch B, for MAE, SiT and
U-ViT pre-training and for fine-tuning (Mixup/CutMix groups, random erasing and drop path included).

Every random number of a step is drawn for the whole batch before the microbatch split
(``task.prepare``), so the two programs differ only in the order of the sums over examples. Each
case takes one plain SGD step (lr 1: the parameter change is the gradient itself, which AdamW's
sign-like first step would hide), then applies the task's own optimiser to both gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decay_jax.data import pipeline
from decay_jax.train import step as step_lib
from decay_jax.train import setup
from decay_jax.train import tasks
from testing_configs import load_config, override

BATCH, ACCUM = 32, 4

CASES = {
    "mae": ("mae_cpu_mnist", {"model.preset": "micro/4"}),
    "sit": ("sit_cpu_mnist", {"model.preset": "micro/4", "model.class_dropout_prob": 0.3}),
    "uvit": ("uvit_cpu_mnist", {"model.preset": "tiny/4", "model.conditional": True,
                                "diffusion.class_dropout_prob": 0.3}),
    # Erasing, both mixing modes (switch 0.5) in groups of 8 and drop path 0.3 all on.
    "finetune": ("finetune_cpu_mnist", {"model.preset": "micro/4", "model.drop_path": 0.3,
                                        "mixup.group": 8, "mixup.erase_prob": 0.5}),
}


def _setup(name):
  config_name, overrides = CASES[name]
  config = override(load_config(config_name), **dict(
      {"data.image_size": 16, "batch_size": BATCH, "model.alpha_min": 0.6}, **overrides))
  info = dict(pipeline.dataset_info(config.data), image_size=16)
  model = tasks.build_model(config, info)
  task = setup.make_task(config, model, info)
  images = jax.random.normal(jax.random.key(7), (BATCH, 16, 16, info["channels"]))
  batch = {"image": images, "label": jnp.arange(BATCH, dtype=jnp.int32) % 10}
  return config, task, batch


def _one_step(task, tx, params, batch, accum):
  state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
           "rng": jax.random.key_data(jax.random.key(3))}
  step = step_lib.make_train_step(task, tx, lambda s: jnp.float32(1.0), accum_steps=accum)
  new_state, metrics = jax.jit(step)(state, batch)
  return new_state["params"], metrics


def _compare(one, four, rel, what):
  scale = max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(one))
  assert scale > 0, what
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(one), jax.tree_util.tree_leaves(four)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=rel * scale,
                               err_msg=f"{what} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_four_microbatches_equal_one_batch(name):
  config, task, batch = _setup(name)
  before = jax.jit(lambda: task.model.init(jax.random.key(0), *task.init_inputs(1))["params"])()
  one, m_one = _one_step(task, optax.sgd(1.0), before, batch, 1)
  four, m_four = _one_step(task, optax.sgd(1.0), before, batch, ACCUM)
  grads_one = jax.tree_util.tree_map(jnp.subtract, before, one)
  grads_four = jax.tree_util.tree_map(jnp.subtract, before, four)
  # float32: four microbatch sums instead of one sum over 32 examples reorder the additions.
  _compare(grads_one, grads_four, 1e-5, f"{name}: gradient")
  assert float(m_four["loss"]) == pytest.approx(float(m_one["loss"]), rel=1e-5)
  # The task's own optimiser step from either gradient. AdamW's first update is about
  # lr g / (|g| + eps): entries with |g| near eps = 1e-8 turn float32 reordering into percent-size
  # differences, so the step is compared where |g| > 1e-6 (1e-5 of lr), entry by entry.
  tx, _ = task.make_optimizer(config, total_steps=10, warmup_steps=0)
  def update(g):  # at step 1: U-ViT's warmup makes the step-0 learning rate 0
    zeros = jax.tree_util.tree_map(jnp.zeros_like, g)
    return tx.update(g, tx.update(zeros, tx.init(before), before)[1], before)[0]

  update = jax.jit(update)
  updates = [update(g) for g in (grads_one, grads_four)]
  well_conditioned = jax.tree_util.tree_map(lambda g: jnp.abs(g) > 1e-6, grads_one)
  assert sum(int(m.sum()) for m in jax.tree_util.tree_leaves(well_conditioned)) > 100
  _compare(*(jax.tree_util.tree_map(lambda u, m: jnp.where(m, u, 0.0), u, well_conditioned)
             for u in updates), 1e-5, f"{name}: optimiser step")


def test_microbatches_hold_every_draw_of_their_examples():
  # The split is interleaved (example j goes to microbatch j % accum), and it moves the prepared
  # draws with their examples: microbatch 1 holds examples 1, 5, 9, ... and their noise.
  _, task, batch = _setup("sit")
  prepared = task.prepare(batch, jax.random.key(0))
  micro = step_lib._split_microbatches(prepared, ACCUM)  # pylint: disable=protected-access
  for key in ("image", "label", "t", "x0", "drop"):
    np.testing.assert_array_equal(micro[key][1], prepared[key][1::ACCUM], err_msg=key)
  assert 0 < int(prepared["drop"].sum()) < BATCH  # class_dropout_prob 0.3 drops some labels
