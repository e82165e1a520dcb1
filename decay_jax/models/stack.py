"""The residual stack: the stream across a model's depth, and the one sublayer update.

A model of ``depth`` blocks keeps a float32 residual stream ``x (N, T, C)`` (with
hyper-connections, ``n`` streams ``(N, T, n, C)``). Sublayer ``s`` of block ``l`` (``s = 0``
attention, ``1`` MLP; ``SUBLAYERS``) updates it through the model's ``residual.Residual`` spec::

    x_in, conn = read(x)                          the stream, or A_m^T H (hyper-connections)
    h = g * branch_scale * drop(f(norm(x_in)))    norm: pre-norm, or the identity (post, DeepNorm)
    x <- add(alpha_{l,s} x, h)                    alpha x + h, or norm(a' alpha x + h) ...

This module is the only caller of the spec's per-sublayer methods (``read``, ``branch_input``,
``branch``, ``add``, ``shortcut``, ``scale_branch``, ``scaled_init``, ``inject``) and of its
per-stack ones (``coefficients``, ``hyper_weights``, ``at_depth``, ``drop_path_rates``,
``expand``, ``reduce``); ``tests/test_layout.py`` checks it. So a block defines only its branches
``f`` (norm + attention, norm + MLP; SiT's modulation and gate inside ``f``; U-ViT's and SiT's
long skips through ``inject`` / ``streams``), and a new residual form changes the spec, not the
blocks.

The pieces:

* ``create(module, residual, depth, dim) -> Stream``: in a model's ``setup``, the identity
  coefficients ``alpha (depth, 2)`` (constants, or the trainable ``alpha``) and the
  hyper-connection weights ``hyper_*`` (``(depth, 2, ...)``, or None): the parameter names of
  every checkpoint so far.
* ``inputs(residual, stream, part, drop_u, skip) -> BlockInputs``: what blocks ``part`` are
  scanned over: their ``alpha``, drop-path rates (timm's ``linspace(0, drop_path, depth)``) and
  draws ``drop_u (depth, N, 2)`` (training; None: no drop path), hyper weights and long-skip
  sources.
* ``scan(block_cls, length, remat_policy, broadcast)``: ``nn.scan`` over stacked copies of a
  block (``__call__(x, inputs, *context) -> (x, output)``), context arguments broadcast.
* ``sublayer(module, residual, s, x, state, norm, f)``: the update above.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from decay_jax.models import layers
from decay_jax.models.residual import Residual

SUBLAYERS = ("attn", "mlp")


class Stream(NamedTuple):
  """A model's stack parameters: ``alpha (depth, 2)`` float32 and the hyper-connection weights
  (a dict of ``(depth, 2, ...)`` arrays, or None)."""
  alpha: Any
  hyper: Any = None


class BlockInputs(NamedTuple):
  """What one block reads besides the stream (scanned: each field with a leading block axis).

  ``alpha (2,)`` its identity coefficients (attention, MLP), ``skip`` the long-skip source
  ``(N, T, C)`` (decoder blocks of SiT and U-ViT; None), ``drop_rate ()`` its drop-path rate,
  ``drop_u (N, 2)`` the uniform draws of training (None: no drop path unless the block draws
  its own), ``hyper`` its hyper-connection weights ``(2, ...)`` (None: one stream).
  """
  alpha: Any
  skip: Any = None
  drop_rate: Any = None
  drop_u: Any = None
  hyper: Any = None


# ----- the stack across depth -------------------------------------------------------------------
def blocks_residual(residual: Residual, depth: int) -> Residual:
  """The spec the blocks of a ``depth``-block model take: resolved for that depth (CaiT's
  LayerScale init, ReZero's 0, DeepNorm's constants)."""
  return residual.at_depth(depth)


def create(module: nn.Module, residual: Residual, depth: int, dim: int) -> Stream:
  """The stack parameters of ``module``'s ``depth`` blocks of width ``dim`` (from its ``setup``
  or a compact method: the one place ``alpha`` and ``hyper_*`` are created)."""
  return Stream(residual.coefficients(module, depth),
                residual.hyper_weights(module, depth, dim))


def drop_rates(residual: Residual, depth: int):
  """timm's per-block drop-path rates ``(depth,)`` float32; block 0 never drops."""
  return jnp.asarray(residual.drop_path_rates(depth))


def inputs(residual: Residual, stream: Stream, part=slice(None), drop_u=None,
           skip=None) -> BlockInputs:
  """The inputs of blocks ``part`` (a slice: stacked for a scan; an int: one block) of the
  stack ``stream``. ``drop_u (depth, N, 2)`` the drop-path draws of all blocks, or None."""
  depth = stream.alpha.shape[0]
  hyper = None if stream.hyper is None else {k: v[part] for k, v in stream.hyper.items()}
  return BlockInputs(stream.alpha[part], skip, drop_rates(residual, depth)[part],
                     None if drop_u is None else drop_u[part], hyper)


# the inputs of a plain ``x + f(x)`` block outside any stack (MAE's decoder blocks)
PLAIN = BlockInputs((1.0, 1.0))


def expand(residual: Residual, x):
  """The stream as the blocks carry it: ``x``, or ``n`` copies ``(N, T, n, C)``."""
  return residual.expand(x)


def reduce(residual: Residual, x):
  """A block's output as the model reads it (skips, features): ``x``, or the streams' sum."""
  return residual.reduce(x)


def streams(residual: Residual) -> int:
  """The number of streams the blocks carry: 0 for one plain stream, else ``hyper_rate``."""
  return residual.hyper_rate if residual.hyper else 0


def inject(residual: Residual, x, v):
  """``x + v`` for a side input ``v (N, T, C)`` (a long skip), added to every stream."""
  return residual.inject(x, v)


def scan(block_cls, length: int, remat_policy: str = "none", broadcast: int = 0):
  """``nn.scan`` over ``length`` stacked copies of ``block_cls``: the stream is the carry, the
  ``BlockInputs`` are scanned, ``broadcast`` further arguments (SiT's conditioning) are the same
  for every block."""
  return layers.scan_blocks(block_cls, length, (0,) + (nn.broadcast,) * broadcast,
                            remat_policy)


# ----- the initialisers of a block's branch layers --------------------------------------------------
def branch_init(residual: Residual, init: Callable, value_only: bool = False) -> Callable:
  """A branch layer's initialiser under the form (DeepNorm scales it; ``value_only``: the value
  third of a fused qkv kernel)."""
  return residual.scaled_init(init, value_only)


def start_init(residual: Residual, init: Callable, zero: bool = True) -> Callable:
  """Zeros where the model starts its branches at zero (``zero``: the official MAE's
  ``attn.proj`` / ``mlp.fc2``, DiT's adaLN-Zero) and the form allows it, else ``init``."""
  return layers.zeros if (zero and residual.zero_branch_init) else init


def output_init(residual: Residual, init: Callable, zero: bool = True) -> Callable:
  """The init of a branch's last layer (``attn.proj``, ``mlp.fc2``): ``start_init``, then as
  ``branch_init``."""
  return residual.scaled_init(start_init(residual, init, zero))


# ----- one sublayer -----------------------------------------------------------------------------
def sublayer(module: nn.Module, residual: Residual, s: int, x, state: BlockInputs, norm,
             f: Callable, random_drop: bool = False):
  """Sublayer ``s`` of ``module``'s block on the stream ``x``: read -> branch -> gain -> add.

  ``norm`` the sublayer's norm module (where the form places it), ``f`` the branch on the
  normalised input (``(N, T, C) -> (N, T, C)``). Drop path with ``state.drop_u[:, s]`` where
  given, with draws from the 'dropout' RNG where ``random_drop`` (fine-tuning), else none. With
  ``'intermediates'`` mutable it sows ``<name>_norms (N, 2)``: the mean token norm of the added
  branch and of the scaled identity.
  """
  name = SUBLAYERS[s]
  alpha = state.alpha[s]
  x_in, conn = residual.read(x, state.hyper, s)
  h = f(residual.branch_input(norm, x_in))
  if state.drop_u is not None:
    h = drop_path(module, h, state.drop_rate, state.drop_u[:, s])
  elif random_drop:
    h = drop_path(module, h, state.drop_rate)
  h = residual.branch(module, name, h)
  sow_branch_norms(module, f"{name}_norms", x_in, residual.shortcut(alpha), h)
  return residual.add(x, alpha, h, norm, conn)


def scaled_branch(residual: Residual, h):
  """``branch_scale * h``: a branch as a value, without an identity (routing's 'attnres')."""
  return residual.scale_branch(h)


def sow_branch_norms(module: nn.Module, name: str, x, alpha, branch) -> None:
  """Records ``(mean_t ||branch_t||, mean_t ||alpha x_t||)`` per example, ``(N, 2)``, where
  ``branch`` is what is added (``g * branch_scale * f(x)``).

  Only when the caller made ``'intermediates'`` mutable (``decay_jax.evals.branches``); otherwise
  nothing is computed, so training and the parity tests see exactly the same program.
  """
  if not module.is_mutable_collection("intermediates"):
    return
  f = jnp.linalg.norm(branch.astype(jnp.float32), axis=-1).mean(axis=-1)
  ident = jnp.linalg.norm((alpha * x).astype(jnp.float32), axis=-1).mean(axis=-1)
  module.sow("intermediates", name, jnp.stack([f, ident], axis=-1))


def drop_path(module: nn.Module, branch, rate, u=None):
  """Stochastic depth on a residual branch ``(N, T, C)`` (timm ``DropPath``): per example, the
  whole branch is kept with probability ``1 - rate`` (``keep = floor(1 - rate + U[0, 1))``) and
  then scaled by ``1 / (1 - rate)``. ``u (N,)`` are the uniform draws; without them, one draw per
  call from the ``'dropout'`` RNG. ``rate`` 0 keeps every example unchanged."""
  keep_prob = 1.0 - rate
  if u is None:
    u = jax.random.uniform(module.make_rng("dropout"), branch.shape[:1])
  u = u.reshape(branch.shape[:1] + (1,) * (branch.ndim - 1))
  return branch * (jnp.floor(keep_prob + u) / keep_prob).astype(branch.dtype)
