"""The jitted training step and the sharded creation of the train state.

Train state (a plain dict, checkpointed as is): ``params``, ``opt_state``, ``step`` (int32),
``rng`` (raw key data), ``frozen`` when the task reads a frozen network (``Task.frozen_params``,
REPA's encoder: passed to ``prepare`` in the batch, never updated) and, when an EMA decay is set,
``ema`` (the exponential moving average of the parameters, an exact copy at step 0, then
``ema <- d * ema + (1 - d) * params`` after every optimiser step, as the official SiT
``update_ema``). The RNG of step ``s`` is ``fold_in(rng, s)``, so a resumed run draws the same
masks and noise as an uninterrupted one. Gradient accumulation runs inside the step as a
``lax.scan`` over microbatches: one call consumes the whole effective batch, and memory holds the
activations of one microbatch only.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from decay_jax import sharding as shd
from decay_jax.data import on_device


def abstract_state(task, tx, seed: int, ema: bool = False):
  """Shapes and dtypes of the train state, without allocating it."""
  frozen = task.frozen_params()  # read here, outside the trace
  return jax.eval_shape(lambda: init_state(task, tx, seed, ema, frozen))


def init_state(task, tx, seed: int, ema: bool = False, frozen=None) -> Dict[str, Any]:
  """The state at step 0; ``frozen`` (``task.frozen_params()``, read outside any trace) enters
  as zeros of its shapes: ``setup.TrainSetup.init_state`` puts the weights in afterwards."""
  rng = jax.random.key(seed)
  params = task.model.init(jax.random.fold_in(rng, 0), *task.init_inputs(1))["params"]
  state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
           "rng": jax.random.key_data(jax.random.fold_in(rng, 1))}
  if ema:
    state["ema"] = jax.tree_util.tree_map(jnp.copy, params)
  if frozen is not None:
    state["frozen"] = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), frozen)
  return state


def state_shardings(abstract, tx, mesh):
  """FSDP shardings for params (and their EMA) and the parameter-shaped optimiser state."""
  params = shd.param_shardings(abstract["params"], mesh)
  repl = shd.replicated(mesh)
  opt = optax.tree_map_params(tx, lambda _, s: s, abstract["opt_state"], params,
                              transform_non_params=lambda _: repl)
  out = {"params": params, "opt_state": opt, "step": repl, "rng": repl}
  if "ema" in abstract:
    out["ema"] = params
  if "frozen" in abstract:
    out["frozen"] = shd.param_shardings(abstract["frozen"], mesh)
  return out


def copy_params(params, shardings):
  """A copy of ``params`` in new buffers placed by ``shardings`` (the state is donated leaf by leaf,
  so the EMA never shares a buffer with the parameters)."""
  return jax.jit(lambda p: jax.tree_util.tree_map(jnp.copy, p), out_shardings=shardings)(params)


def ema_update(ema, params, decay: float):
  """``decay * ema + (1 - decay) * params`` leaf by leaf (official ``update_ema``)."""
  return jax.tree_util.tree_map(lambda e, p: e * decay + p * (1.0 - decay), ema, params)


def _split_microbatches(batch, accum: int):
  """``(B, ...) -> (accum, B/accum, ...)`` interleaved, so each device keeps an equal share of every
  microbatch (a contiguous split would put whole microbatches on a few devices)."""
  def split(x):
    x = x.reshape((x.shape[0] // accum, accum) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree_util.tree_map(split, batch)


def make_train_step(task, tx, schedule: Callable, accum_steps: int = 1, ema_decay: float = 0.0):
  """``step(state, batch) -> (state, metrics)``; metrics are float32 scalars (means over the batch).

  ``batch['image']``: uint8 pixels (normalised here with the task's ``mean``/``std``) or an
  already floating array (latents), ``(B, H, W, C)``.
  """

  def grads_of(params, batch):
    (loss, metrics), grads = jax.value_and_grad(task.loss, has_aux=True)(params, batch)
    return grads, metrics

  def step(state, batch):
    params = state["params"]
    rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
    # The input arrives as uint8 pixels (a quarter of float32's bytes over the host-to-device
    # link, no per-pixel work on the host); the step makes them the model's float input.
    if task.keeps_pixels and "repa_pixels" not in batch and batch["image"].dtype == jnp.uint8:
      batch = dict(batch, repa_pixels=batch["image"])  # the frozen encoder's own preprocessing
    batch = on_device.batch_to_model(batch, task.mean, task.std)
    if "frozen" in state:  # a frozen network's weights (REPA's encoder), for the task's prepare
      batch = dict(batch, frozen=state["frozen"])
    # Every random number of the step, drawn for the whole batch: microbatch i then holds the
    # examples (and draws) it would hold in one big batch.
    batch = task.prepare(batch, rng)
    if accum_steps == 1:
      grads, metrics = grads_of(params, batch)
    else:
      micro = _split_microbatches(batch, accum_steps)

      def body(carry, mb):
        return jax.tree_util.tree_map(jnp.add, carry, grads_of(params, mb)), None

      zeros = jax.eval_shape(grads_of, params, jax.tree_util.tree_map(lambda x: x[0], micro))
      zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
      (grads, metrics), _ = jax.lax.scan(body, zeros, micro)
      grads, metrics = jax.tree_util.tree_map(lambda x: x / accum_steps, (grads, metrics))
    # The scope names the optimiser's ops in the compiled program, so a profile's table
    # (decay_jax.cli.trace_table) can count them apart from the model's.
    with jax.named_scope("optimizer"):
      updates, opt_state = tx.update(grads, state["opt_state"], params)
      new_params = optax.apply_updates(params, updates)
      metrics = dict(metrics)
      metrics["grad_norm"] = optax.tree.norm(grads)
      metrics["param_norm"] = optax.tree.norm(new_params)
      metrics["update_norm"] = optax.tree.norm(updates)
      metrics["lr"] = schedule(state["step"])
      new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1,
                   "rng": state["rng"]}
      if "ema" in state:
        new_state["ema"] = ema_update(state["ema"], new_params, ema_decay)
      if "frozen" in state:
        new_state["frozen"] = state["frozen"]
    return new_state, jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), metrics)

  return step


# Steps dispatched ahead of the device. XLA:CPU's asynchronous dispatch would otherwise let Python
# run dozens of steps ahead, so the trainer's progress rate and ETA swung between 2x too fast and
# 0; two in flight keep the host's next-batch work overlapped while progress follows the device.
MAX_IN_FLIGHT = 2


def bound_in_flight(step_outputs) -> None:
  """Waits until at most ``MAX_IN_FLIGHT`` of the steps whose outputs are listed (oldest first)
  are unfinished: the dispatch discipline of the trainer, which ``cli.bench`` times too."""
  if len(step_outputs) > MAX_IN_FLIGHT:
    jax.block_until_ready(step_outputs[-MAX_IN_FLIGHT - 1])


def jit_train_step(step_fn, shardings, mesh):
  """Jit with the state donated and its sharding pinned; the batch arrives split over devices."""
  return jax.jit(step_fn, in_shardings=(shardings, shd.batch_sharding(mesh)),
                 out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=(0,))
