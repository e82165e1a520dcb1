"""Linear probes on frozen features: the official protocol, upstream MAE's protocol, a fast probe.

Every probe trains ``H`` independent linear heads at once on features ``x (N, H, D)`` (one head per
feature choice, or per encoder block): logits ``(N, H, C) = x_h W_h + b_h``. The loss is the sum
over heads of each head's mean cross-entropy, and the optimiser is ``vmap``-ed over the head axis,
so every head sees exactly its own gradient, its own trust ratio and its own statistics: training
them together equals training them one by one.

Protocols:

``official`` (docs/official_code.md 3.1, the released ``misc.eval_model``): precomputed features, no
  augmentation; ``nn.Linear(D, C)`` with PyTorch's default init ``U(+-1/sqrt(D))`` for weight and
  bias; ``torch.optim.AdamW(lr=1e-2)`` with torch defaults (betas 0.9/0.999, eps 1e-8) and weight
  decay 0.01 on weight and bias; 200 epochs; each epoch a fresh permutation truncated to a multiple
  of the batch (256); the learning rate is set per epoch: epoch 0 trains at ``lr``, epoch
  ``e >= 1`` at ``lr * 0.5 * (1 + cos(pi (e - 1) / epochs))`` (the value set after epoch ``e - 1``;
  it never reaches 0). The reported accuracy is the one after the last epoch.

``official_std`` (ours): the ``official`` recipe on features standardised per dimension with the
  training set's mean and standard deviation (``standardize``: the statistics a BatchNorm without
  affine parameters would freeze at, as upstream MAE's probe has in front of its head). The released
  probe reads raw features, so its accuracy depends on their offset and scale: a network whose
  pooled features share a large common vector across images and vary little around it scores far
  lower there than with the same features standardised (a ``study`` arm: 25.30% raw, 40.70%
  standardised). This variant is invariant to any per-dimension affine map of the features.

``mae`` (docs/official_code.md 3.2, upstream ``main_linprobe.py``): ``BatchNorm1d(D, affine=False,
  eps=1e-6)`` then ``Linear(D, C)`` with weight ``N(0, 0.01^2)`` (timm's trunc_normal truncates at
  +-2 absolute, i.e. 200 std: a plain normal) and zero bias; batch statistics while training,
  running statistics (momentum 0.1, unbiased variance) at evaluation; LARS (momentum 0.9, trust
  coefficient 0.001, weight decay 0, no adaptation or decay for tensors of ndim <= 1);
  ``lr = blr * batch / 256`` with blr 0.1; per-iteration warmup (10 epochs, from 0) then half-cycle
  cosine to 0 over 90 epochs; batch 16384; evaluated after every epoch, the maximum is reported
  (``top1``) together with the last (``top1_last``). Features are recomputed from augmented images
  every step by the evaluator (``augment``) or precomputed. BatchNorm statistics are over the global
  batch (upstream: per GPU, 512 examples).

``fast`` (ours, for the per-block curves): each feature dimension standardised with the training
  set's mean and standard deviation (a BatchNorm frozen at its data statistics), zero-initialised
  heads, AdamW (0.9, 0.999, eps 1e-8, weight decay 0 by default) with a per-step cosine decay from
  ``lr`` (1e-3) to 0, 10 epochs, batch 256. Cheap enough to run on every block.

Torch LARS (upstream ``util/lars.py``) keeps its momentum buffer in un-scaled units and multiplies
the *current* learning rate at every step (``mu <- m mu + g'; p <- p - lr_t mu``); ``optax.lars``
scales by the learning rate before the momentum trace, which differs whenever the rate changes
(warmup, cosine). :func:`lars` chains the same optax transforms in upstream's order.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Dict, Iterable, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decay_jax import validate
from decay_jax.evals import knn

HIGHEST = jax.lax.Precision.HIGHEST
_EVAL_CHUNK = 4096


# ----------------------------------------------------------------------------------------------
# Checks and shared pieces


def _check_positive(field: str, value, integer: bool = True):
  if integer:
    return validate.check_int(field, value, 1)
  return validate.check_range(field, value, 0.0, low_open=True)


def _as_heads(field: str, x) -> jax.Array:
  """(N, D) -> (N, 1, D); (N, H, D) unchanged; float32."""
  x = jnp.asarray(x, jnp.float32)
  if x.ndim == 2:
    x = x[:, None, :]
  if x.ndim != 3 or min(x.shape) < 1:
    raise ValueError(f"{field} has shape {x.shape}; it must be (N, D) or (N, H, D) with sizes >= 1")
  return x


def _check_labels(field: str, y, n: int, num_classes: int) -> jax.Array:
  return jnp.asarray(knn._labels(field, y, n, num_classes))


def _check_batch(batch_size: int, n: int) -> int:
  _check_positive("batch_size", batch_size)
  if batch_size > n:
    raise ValueError(f"batch_size={batch_size} is not allowed; it must be at most the {n} "
                     "training examples (each epoch drops the last incomplete batch)")
  return int(batch_size)


def logits(params, x):
  """``x (B, H, D)``, ``w (H, D, C)``, ``b (H, C)`` -> ``(B, H, C)`` float32."""
  return jnp.einsum("bhd,hdc->bhc", x, params["w"], precision=HIGHEST) + params["b"]


def cross_entropy(lg, y):
  """Sum over heads of the mean (over the batch) cross-entropy. ``lg (B, H, C)``, ``y (B,)``."""
  logp = jax.nn.log_softmax(lg, axis=-1)
  nll = -jnp.take_along_axis(logp, y[:, None, None], axis=-1)[..., 0]  # (B, H)
  return nll.mean(axis=0).sum()


@jax.jit
def _correct(lg, y):
  """Top-1 and top-5 hit counts per head: ``(H,)`` int32 each (top-5 = top-1 if C < 5)."""
  k = min(5, lg.shape[-1])
  top = jax.lax.top_k(lg, k)[1]  # (B, H, k)
  hit = top == y[:, None, None]
  return hit[..., 0].sum(axis=0), hit.any(axis=-1).sum(axis=0)


def accuracy(logit_fn: Callable, x, y) -> Dict[str, np.ndarray]:
  """Top-1/top-5 accuracy of every head, in chunks of rows.

  Args:
    logit_fn: ``(B, H, D) -> (B, H, C)``.
    x: (M, H, D) features.
    y: (M,) labels.

  Returns:
    ``{'top1': (H,), 'top5': (H,)}`` float64 fractions (top-5 is present only when C >= 5).
  """
  top1 = top5 = 0
  num_classes = None
  for start in range(0, x.shape[0], _EVAL_CHUNK):
    lg = logit_fn(x[start:start + _EVAL_CHUNK])
    num_classes = lg.shape[-1]
    c1, c5 = _correct(lg, y[start:start + _EVAL_CHUNK])
    top1, top5 = top1 + np.asarray(c1), top5 + np.asarray(c5)
  out = {"top1": np.asarray(top1, np.float64) / x.shape[0]}
  if num_classes >= 5:
    out["top5"] = np.asarray(top5, np.float64) / x.shape[0]
  return out


def _head_keys(seed: int, num_heads: int):
  """One initialisation key per head: head ``h`` gets ``fold_in(fold_in(key(seed), 1), h)``."""
  base = jax.random.fold_in(jax.random.key(seed), 1)
  return jax.vmap(lambda h: jax.random.fold_in(base, h))(jnp.arange(num_heads))


def _vmap_tx(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """Applies ``tx`` to every head separately (leaves carry a leading head axis)."""
  return optax.GradientTransformation(jax.vmap(tx.init), jax.vmap(tx.update))


def _fit(params, x, y, tx, *, epochs: int, batch_size: int, seed: int):
  """Plain minibatch training of the heads: a fresh permutation per epoch, last batch dropped.

  Returns the trained params and the mean loss of every epoch ``(epochs,)``.
  """
  n = x.shape[0]
  steps = n // batch_size
  tx = _vmap_tx(tx)
  key = jax.random.key(seed)

  @jax.jit
  def run(params, x, y):
    def epoch_body(carry, epoch):
      perm = jax.random.permutation(jax.random.fold_in(key, epoch), n)
      idx = perm[:steps * batch_size].reshape(steps, batch_size)

      def step_body(carry, rows):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(logits(p, x[rows]), y[rows]))(
            params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

      carry, losses = jax.lax.scan(step_body, carry, idx)
      return carry, losses.mean()

    (params, _), losses = jax.lax.scan(epoch_body, (params, tx.init(params)), jnp.arange(epochs))
    return params, losses

  return run(params, x, y)


def _result(acc: Dict[str, np.ndarray], losses) -> Dict[str, list]:
  out = {k: v.tolist() for k, v in acc.items()}
  out["final_loss"] = float(np.asarray(losses)[-1])
  return out


# ----------------------------------------------------------------------------------------------
# The official protocol (docs/official_code.md 3.1)


def official_lr_table(epochs: int, lr: float = 1e-2) -> np.ndarray:
  """Learning rate of each epoch: ``lr`` at epoch 0, ``lr/2 (1 + cos(pi (e-1)/epochs))`` after."""
  e = np.arange(epochs, dtype=np.float64)
  table = lr * 0.5 * (1.0 + np.cos(np.pi * (e - 1.0) / epochs))
  table[0] = lr
  return table


def official_probe(train_x, train_y, test_x, test_y, num_classes: int, *, epochs: int = 200,
                   lr: float = 1e-2, weight_decay: float = 0.01, batch_size: int = 256,
                   seed: int = 0, standardize_features: bool = False) -> Dict[str, list]:
  """The released code's linear probe (module docstring), on precomputed features.

  Args:
    train_x: (N, D) or (N, H, D) training features (H heads trained independently).
    train_y: (N,) integer labels in [0, num_classes).
    test_x: (M, D) or (M, H, D) test features.
    test_y: (M,) labels.
    num_classes: C.
    epochs, lr, weight_decay, batch_size: the protocol's 200, 1e-2, 0.01, 256.
    seed: permutations and initialisation.
    standardize_features: the ``official_std`` variant: first scale both feature sets per (head,
      dimension) by the training set's mean and standard deviation (``standardize``).

  Returns:
    ``{'top1': [H], 'top5': [H] (C >= 5), 'final_loss': mean loss of the last epoch, summed over
    heads}``.

  Raises:
    ValueError: one line naming the bad field.
  """
  x, qx = _as_heads("train_x", train_x), _as_heads("test_x", test_x)
  y, qy = (_check_labels("train_y", train_y, x.shape[0], num_classes),
           _check_labels("test_y", test_y, qx.shape[0], num_classes))
  epochs = _check_positive("epochs", epochs)
  batch_size = _check_batch(batch_size, x.shape[0])
  if standardize_features:
    x, qx = standardize(x, qx)
  _, h, d = x.shape
  bound = 1.0 / math.sqrt(d)

  def init(key):  # per head, so a head's start does not depend on how many heads train with it
    kw, kb = jax.random.split(key)
    return {"w": jax.random.uniform(kw, (d, num_classes), jnp.float32, -bound, bound),
            "b": jax.random.uniform(kb, (num_classes,), jnp.float32, -bound, bound)}

  params = jax.vmap(init)(_head_keys(seed, h))
  steps = x.shape[0] // batch_size
  table = jnp.asarray(official_lr_table(epochs, lr), jnp.float32)
  schedule = lambda count: table[jnp.minimum(count // steps, epochs - 1)]
  tx = optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
  params, losses = _fit(params, x, y, tx, epochs=epochs, batch_size=batch_size, seed=seed)
  acc = accuracy(jax.jit(functools.partial(logits, params)), qx, qy)
  return _result(acc, losses)


# ----------------------------------------------------------------------------------------------
# The fast probe (ours; per-block curves)


def standardize(train_x, test_x, eps: float = 1e-6):
  """Both ``(N, H, D)`` arrays scaled per (head, dimension) by the training mean and std."""
  mean = train_x.mean(axis=0, keepdims=True)
  std = jnp.sqrt(train_x.var(axis=0, keepdims=True) + eps)
  return (train_x - mean) / std, (test_x - mean) / std


def fast_probe(train_x, train_y, test_x, test_y, num_classes: int, *, epochs: int = 10,
               lr: float = 1e-3, weight_decay: float = 0.0, batch_size: int = 256,
               seed: int = 0) -> Dict[str, list]:
  """Standardised features, zero-initialised heads, AdamW with per-step cosine decay.

  Arguments and return value as :func:`official_probe`.
  """
  x, qx = _as_heads("train_x", train_x), _as_heads("test_x", test_x)
  y, qy = (_check_labels("train_y", train_y, x.shape[0], num_classes),
           _check_labels("test_y", test_y, qx.shape[0], num_classes))
  epochs = _check_positive("epochs", epochs)
  batch_size = _check_batch(batch_size, x.shape[0])
  x, qx = standardize(x, qx)
  _, h, d = x.shape
  params = {"w": jnp.zeros((h, d, num_classes)), "b": jnp.zeros((h, num_classes))}
  total = epochs * (x.shape[0] // batch_size)
  tx = optax.adamw(optax.cosine_decay_schedule(lr, total), b1=0.9, b2=0.999, eps=1e-8,
                   weight_decay=weight_decay)
  params, losses = _fit(params, x, y, tx, epochs=epochs, batch_size=batch_size, seed=seed)
  acc = accuracy(jax.jit(functools.partial(logits, params)), qx, qy)
  return _result(acc, losses)


# ----------------------------------------------------------------------------------------------
# Upstream MAE's protocol (docs/official_code.md 3.2)


def lars(learning_rate, momentum: float = 0.9, trust_coefficient: float = 0.001,
         weight_decay: float = 0.0) -> optax.GradientTransformation:
  """Upstream MAE's LARS: ``g' = q (g + wd p)`` for ndim > 1 (q the trust ratio
  ``tc ||p|| / ||g + wd p||``, 1 if either norm is 0), ``g' = g`` otherwise;
  ``mu <- momentum mu + g'``; ``p <- p - lr_t mu``."""
  mask = lambda tree: jax.tree_util.tree_map(lambda a: a.ndim > 1, tree)
  return optax.chain(
      optax.add_decayed_weights(weight_decay, mask),
      optax.masked(optax.scale_by_trust_ratio(trust_coefficient=trust_coefficient), mask),
      optax.trace(decay=momentum),
      optax.scale_by_learning_rate(learning_rate))


def warmup_cosine(peak: float, steps_per_epoch: int, epochs: float, warmup_epochs: float,
                  min_lr: float = 0.0) -> Callable:
  """Upstream ``lr_sched.adjust_learning_rate`` on the fractional epoch ``step / steps_per_epoch``:
  linear from 0 during warmup, then ``min + (peak - min) (1 + cos(pi (e - w) / (E - w))) / 2``."""

  def schedule(count):
    e = count / steps_per_epoch
    warm = peak * e / max(warmup_epochs, 1e-12)
    frac = (e - warmup_epochs) / max(epochs - warmup_epochs, 1e-12)
    cos = min_lr + (peak - min_lr) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    return jnp.where(e < warmup_epochs, warm, cos)

  return schedule


def batch_norm(x, stats, train: bool, eps: float = 1e-6, momentum: float = 0.1):
  """``BatchNorm1d(affine=False)`` over the batch axis of ``x (B, H, D)``.

  Training normalises with the batch's biased variance and moves the running statistics towards
  the batch mean and *unbiased* variance (as torch); evaluation uses the running statistics.
  Returns ``(normalised x, new stats)``.
  """
  if not train:
    return (x - stats["mean"]) * jax.lax.rsqrt(stats["var"] + eps), stats
  mean, var = x.mean(axis=0), x.var(axis=0)
  n = x.shape[0]
  unbiased = var * n / max(n - 1, 1)
  new = {"mean": (1 - momentum) * stats["mean"] + momentum * mean,
         "var": (1 - momentum) * stats["var"] + momentum * unbiased}
  return (x - mean) * jax.lax.rsqrt(var + eps), new


class MaeProbe:
  """BatchNorm + linear heads trained with LARS and warmup-cosine (upstream ``main_linprobe``).

  ``state = probe.init()``; ``state, loss = probe.step(state, x (B, H, D), y (B,))`` once per
  iteration; ``probe.evaluate(state, x, y)`` with the running statistics.
  """

  def __init__(self, num_heads: int, dim: int, num_classes: int, *, steps_per_epoch: int,
               epochs: int = 90, warmup_epochs: float = 10, blr: float = 0.1,
               batch_size: int = 16384, momentum: float = 0.9, trust_coefficient: float = 0.001,
               weight_decay: float = 0.0, seed: int = 0):
    self.shape = (int(num_heads), int(dim), int(num_classes))
    self.seed = seed
    self.steps_per_epoch = _check_positive("steps_per_epoch", steps_per_epoch)
    self.epochs = _check_positive("epochs", epochs)
    self.lr = blr * _check_positive("batch_size", batch_size) / 256.0
    self.schedule = warmup_cosine(self.lr, steps_per_epoch, epochs, warmup_epochs)
    self.tx = _vmap_tx(lars(self.schedule, momentum, trust_coefficient, weight_decay))
    self.step = jax.jit(self._step)
    self._logits = jax.jit(self._eval_logits)

  def init(self):
    h, d, c = self.shape
    w = jax.vmap(lambda k: 0.01 * jax.random.normal(k, (d, c)))(_head_keys(self.seed, h))
    params = {"w": w, "b": jnp.zeros((h, c))}
    return {"params": params, "opt_state": self.tx.init(params),
            "stats": {"mean": jnp.zeros((h, d)), "var": jnp.ones((h, d))}}

  def _step(self, state, x, y):
    def loss_fn(params):
      xn, stats = batch_norm(x, state["stats"], train=True)
      return cross_entropy(logits(params, xn), y), stats

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
            "stats": stats}, loss

  @staticmethod
  def _eval_logits(state, x):
    return logits(state["params"], batch_norm(x, state["stats"], train=False)[0])

  def evaluate(self, state, x, y) -> Dict[str, np.ndarray]:
    return accuracy(functools.partial(self._logits, state), _as_heads("x", x), jnp.asarray(y))


def epoch_batches(train_x, train_y, batch_size: int, seed: int = 0
                  ) -> Callable[[int], Iterator[Tuple[jax.Array, jax.Array]]]:
  """Batches of precomputed features: ``batches(epoch)`` yields ``N // batch_size`` pairs
  ``(x (B, H, D), y (B,))`` in a permutation drawn from ``(seed, epoch)``."""
  x, y = _as_heads("train_x", train_x), jnp.asarray(train_y, jnp.int32)
  batch_size = _check_batch(batch_size, x.shape[0])
  steps = x.shape[0] // batch_size
  take = jax.jit(lambda x, y, rows: (x[rows], y[rows]))

  def batches(epoch: int):
    perm = jax.random.permutation(jax.random.fold_in(jax.random.key(seed), epoch), x.shape[0])
    for rows in perm[:steps * batch_size].reshape(steps, batch_size):
      yield take(x, y, rows)

  return batches


def mae_probe(batches: Callable[[int], Iterable], test_x, test_y, num_classes: int, *,
              steps_per_epoch: int, epochs: int = 90, warmup_epochs: float = 10,
              blr: float = 0.1, batch_size: int = 16384, momentum: float = 0.9,
              trust_coefficient: float = 0.001, weight_decay: float = 0.0, seed: int = 0,
              on_epoch: Optional[Callable[[int, dict], None]] = None) -> Dict[str, list]:
  """Upstream MAE's linear probe (module docstring).

  Args:
    batches: ``batches(epoch)`` yields ``steps_per_epoch`` pairs ``(x (B, H, D), y (B,))``: from
      :func:`epoch_batches` (precomputed) or from augmented images (the evaluator).
    test_x: (M, H, D) test features (no augmentation).
    test_y: (M,) labels.
    num_classes: C.
    steps_per_epoch: iterations per epoch (the schedule's unit).
    epochs, warmup_epochs, blr, batch_size, momentum, trust_coefficient, weight_decay: the
      protocol's 90, 10, 0.1, 16384, 0.9, 0.001, 0.
    seed: head initialisation.
    on_epoch: optional ``callback(epoch, accuracies)`` (progress logging).

  Returns:
    ``{'top1': [H] best over epochs (upstream's number), 'top1_last': [H], 'top5': [H] at the best
    epoch of each head, 'best_epoch': [H], 'lr': peak lr, 'final_loss': last step's loss}``.
  """
  qx = _as_heads("test_x", test_x)
  qy = _check_labels("test_y", test_y, qx.shape[0], num_classes)
  h, d = qx.shape[1:]
  probe = MaeProbe(h, d, num_classes, steps_per_epoch=steps_per_epoch, epochs=epochs,
                   warmup_epochs=warmup_epochs, blr=blr, batch_size=batch_size, momentum=momentum,
                   trust_coefficient=trust_coefficient, weight_decay=weight_decay, seed=seed)
  state = probe.init()
  best = {"top1": np.full(h, -1.0), "top5": np.zeros(h), "best_epoch": np.zeros(h, np.int64)}
  loss = None
  for epoch in range(epochs):
    for x, y in batches(epoch):
      state, loss = probe.step(state, x, y)
    acc = probe.evaluate(state, qx, qy)
    better = acc["top1"] > best["top1"]
    best["top1"] = np.where(better, acc["top1"], best["top1"])
    best["top5"] = np.where(better, acc.get("top5", acc["top1"]), best["top5"])
    best["best_epoch"] = np.where(better, epoch, best["best_epoch"])
    if on_epoch is not None:
      on_epoch(epoch, acc)
  out = {"top1": best["top1"].tolist(), "top1_last": acc["top1"].tolist(),
         "best_epoch": best["best_epoch"].tolist(), "lr": probe.lr,
         "final_loss": None if loss is None else float(loss)}
  if "top5" in acc:
    out["top5"] = best["top5"].tolist()
  return out
