"""Frozen-encoder features for the evaluators: sharded extraction and pooled feature choices.

A *feature choice* names how the tokens of one encoder block become one vector per image:
``'mean'`` (mean of all tokens, cls included: the official probe's feature), ``'cls'`` (token 0) or
``'patch_mean'`` (mean of the patch tokens), optionally followed by ``'_ln'`` for a parameter-free
LayerNorm after pooling (the decayed MAE has no final LayerNorm; upstream MAE probes one, so the
``_ln`` variants stand in for it). Examples: ``'mean'``, ``'cls_ln'``, ``'patch_mean_ln'``.

Images reach every feature function as the data pipeline's uint8 pixels and become the model's
float32 input on the devices (``on_pixels``): host arrays and transfers stay a quarter of float32's
size, and no evaluator normalises on the host.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import sharding as shd
from decay_jax.data import on_device
from decay_jax.data import pipeline
from decay_jax.evals import knn

LN_SUFFIX = "_ln"
FEATURE_CHOICES = tuple(p + s for s in ("", LN_SUFFIX) for p in knn.POOL_MODES)


def num_blocks(model) -> int:
  """Blocks whose outputs ``model.features`` returns (a probed U-ViT: ``2K + 1``; MAE: depth)."""
  return getattr(model, "feature_blocks", None) or model.depth


def parse_choice(name: str) -> Tuple[str, bool]:
  """``'cls_ln'`` -> ``('cls', True)``; raises a one-line ValueError for unknown names."""
  if name not in FEATURE_CHOICES:
    raise ValueError(f"feature={name!r} is not allowed; choose one of "
                     f"{', '.join(map(repr, FEATURE_CHOICES))}")
  if name.endswith(LN_SUFFIX):
    return name[:-len(LN_SUFFIX)], True
  return name, False


def parse_choices(spec: str, field: str = "features") -> Tuple[str, ...]:
  """A comma-separated list of feature choices, e.g. ``'mean,cls_ln'``, checked, in order."""
  names = tuple(s.strip() for s in str(spec).split(",") if s.strip())
  if not names:
    raise ValueError(f"{field}={spec!r} is not allowed; give at least one of "
                     f"{', '.join(map(repr, FEATURE_CHOICES))}")
  for n in names:
    if n not in FEATURE_CHOICES:
      raise ValueError(f"{field}={spec!r} is not allowed; {n!r} is not one of "
                       f"{', '.join(map(repr, FEATURE_CHOICES))}")
  return names


def on_pixels(fn, data_cfg):
  """``fn(params, model_input)`` as a function of the data config's images, normalised on device.

  Args:
    fn: a jittable function of ``(params, images (B, H, W, C) float32)`` (the model's input).
    data_cfg: the data config whose ``normalize`` the images were loaded with.

  Returns:
    ``wrapped(params, images (B, H, W, C))``: uint8 pixels go through
    ``on_device.to_model_input`` with ``pipeline.normalization(data_cfg, C)`` inside the same
    jitted program, so they travel to the devices as uint8; floating images (latents, arrays
    normalised by the caller) reach ``fn`` unchanged.
  """
  cfg = data_cfg.copy_and_resolve_references()  # later edits of the caller's config change nothing

  def wrapped(params, images):
    mean, std = pipeline.normalization(cfg, images.shape[-1])
    return fn(params, on_device.to_model_input(images, mean, std))

  return wrapped


def extract(fn, params, images: np.ndarray, mesh, batch_size: int, post=None):
  """Applies ``fn(params, images) -> pytree of (n, ...)`` in sharded batches; numpy for all rows.

  The last batch is padded (and the padding dropped) so one compiled program serves every batch;
  each process feeds its slice of every batch and gets every row back.

  Args:
    fn: a jittable function of ``(params, images (B, H, W, C))`` returning arrays with leading B
      (or, with ``post``, anything ``post`` takes).
    params: the parameters (any sharding).
    images: (N, H, W, C) host array (uint8 pixels for an ``on_pixels`` function; its batches are
      sent in this dtype).
    mesh: the device mesh; batches are split over all its devices.
    batch_size: images per call, rounded down to a multiple of the device count.
    post: optional jittable function applied on device to ``fn``'s output as a second compiled
      program, returning arrays with leading B (the rank evaluator's SVD of the tokens, which
      never leave the devices: fetching them would cost T x D floats per image). On CPU it runs
      on one device: XLA's SVD partitioned over several CPU devices hangs (jax 0.10.2, in the
      encoder's program and sometimes as a program of its own). On accelerators it stays
      partitioned, so a multi-host mesh needs no gather.

  Returns:
    The pytree of ``fn`` (or ``post``) with numpy leaves of leading size N.
  """
  n = images.shape[0]
  per = mesh.size
  batch_size = max(per, (batch_size // per) * per)
  jitted = jax.jit(fn)
  if post is None:
    post_fn = lambda out: out
  elif mesh.devices.flat[0].platform == "cpu" and mesh.size > 1:
    # A partitioned SVD hangs on several CPU devices (see ``post`` above): one device does it.
    one = mesh.devices.flat[0]
    post_jit = jax.jit(post)
    post_fn = lambda out: post_jit(jax.device_put(out, one))
  else:
    post_fn = jax.jit(post)
  pc, pi = jax.process_count(), jax.process_index()
  outs = []
  for start in range(0, n, batch_size):
    chunk = images[start:start + batch_size]
    valid = chunk.shape[0]
    if valid < batch_size:
      chunk = np.concatenate([chunk, np.zeros((batch_size - valid,) + chunk.shape[1:],
                                              chunk.dtype)], axis=0)
    local = chunk.reshape((pc, batch_size // pc) + chunk.shape[1:])[pi]
    out = post_fn(jitted(params, shd.global_batch_from_local(local, mesh)))
    if pc > 1:
      from jax.experimental import multihost_utils
      out = multihost_utils.process_allgather(out, tiled=True)
    outs.append(jax.tree_util.tree_map(lambda a: np.asarray(jax.device_get(a))[:valid], out))
  return jax.tree_util.tree_map(lambda *a: np.concatenate(a, axis=0), *outs)


def pool_all(tokens, choices: Sequence[str]):
  """Pools block outputs into every feature choice.

  Args:
    tokens: (L, N, T, D) outputs of L blocks (cls at token 0).
    choices: feature choice names (see the module docstring), P of them.

  Returns:
    (N, L, P, D) float32.
  """
  n_layers, n, t, d = tokens.shape
  flat = tokens.reshape(n_layers * n, t, d)
  pooled = [knn.pool_tokens(flat, *parse_choice(c)) for c in choices]  # each (L*N, D)
  return jnp.stack(pooled, axis=1).reshape(n_layers, n, len(choices), d).transpose(1, 0, 2, 3)


def pooled_fn(model, choices: Sequence[str], layers: Optional[Sequence[int]] = None):
  """``fn(params, images (N, H, W, C) float32) -> (N, L, P, D)``: the chosen blocks (all if None),
  every choice (``on_pixels(fn, data_cfg)`` takes uint8 pixels).

  One forward of the unmasked encoder serves all blocks and all choices.
  """
  choices = tuple(choices)
  for c in choices:
    parse_choice(c)
  layers = None if layers is None else tuple(int(i) for i in layers)

  def fn(params, images):
    tokens = model.apply({"params": params}, images, method=model.features)
    if layers is not None:
      tokens = tokens[np.asarray(layers)]
    return pool_all(tokens, choices)

  return fn


class FeatureCache:
  """Pooled features shared by the evaluators of one evaluation, from as few passes as possible.

  Evaluators first declare what they will need (:meth:`want`: images, blocks, choices); the first
  :meth:`pooled` call on an image array then extracts every declared ``(block, choice)`` pair of
  that array in one forward pass, and later calls are served from memory. Arrays are identified by
  object identity and kept alive by the cache, so use one cache per set of parameters and drop it
  afterwards. Without declarations it simply memoises each request.

  The image arrays are ``data_cfg``'s uint8 pixels ``(N, H, W, C)`` (``evaluators.load_split``),
  normalised on device (``on_pixels``); floating arrays are taken as the model's input.
  """

  def __init__(self, model, params, mesh, batch_size: int, data_cfg):
    self.model, self.params, self.mesh, self.batch_size = model, params, mesh, batch_size
    self.data_cfg = data_cfg
    self._wanted = {}  # id(images) -> (images, set of (block, choice))
    self._store = {}  # id(images) -> (images, {(block, choice): (N, D) array})

  def _pairs(self, layers, choices):
    depth = num_blocks(self.model)
    blocks = range(depth) if layers is None else [int(l) % depth for l in layers]
    for c in choices:
      parse_choice(c)
    return [(l, c) for l in blocks for c in choices]

  def want(self, images: np.ndarray, choices: Sequence[str],
           layers: Optional[Sequence[int]] = None) -> None:
    """Declares that ``pooled(images, choices, layers)`` will be asked for."""
    entry = self._wanted.setdefault(id(images), (images, set()))
    entry[1].update(self._pairs(layers, choices))

  def pooled(self, images: np.ndarray, choices: Sequence[str],
             layers: Optional[Sequence[int]] = None) -> np.ndarray:
    """``(N, L, P, D)`` features of the blocks ``layers`` (None: all) and the ``choices``."""
    pairs = self._pairs(layers, choices)
    _, store = self._store.setdefault(id(images), (images, {}))
    missing = [p for p in pairs if p not in store]
    if missing:
      wanted = self._wanted.get(id(images), (None, set()))[1]
      todo = sorted(set(missing) | (wanted - set(store)))
      model = self.model

      def fn(params, imgs):
        tokens = model.apply({"params": params}, imgs, method=model.features)
        return [knn.pool_tokens(tokens[l], *parse_choice(c)) for l, c in todo]

      fn = on_pixels(fn, self.data_cfg)
      for pair, feats in zip(todo, extract(fn, self.params, images, self.mesh, self.batch_size)):
        store[pair] = feats
    blocks = list(dict.fromkeys(l for l, _ in pairs))
    return np.stack([np.stack([store[(l, c)] for c in choices], axis=1) for l in blocks], axis=1)
