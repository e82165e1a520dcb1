"""Training data kept on the devices (``data.on_device=True``): the crop and flip drawn in one jit.

For a source that fits in device memory (``embedded_mnist``, ``npz:``), the uint8 train split
``(N, H, W, C)`` and its int32 labels are put on every device once (replicated over the mesh; on
several hosts every process holds its copy), and each global batch is built there by one jitted
program. The host computes only the step's record indices; nothing per pixel.

The stream is the host path's rule with other random numbers:

  order: global step ``s`` takes the global positions ``g in [s B, (s + 1) B)`` and the record
      ``loader.EpochOrder(seed)(g)``, exactly as ``loader`` does (same records, same labels).
  draws: example ``g`` draws ``u = uniform(k_g, (augment.NUM_UNIFORMS,), float64)``, laid out as
      ``augment.example_uniforms`` (areas, log-ratios, top, left, flip), with the threefry key
      ``k_g = fold_in(key(0), seed_lo, seed_hi, 1, g_hi, g_lo)`` (one ``fold_in`` per 32-bit
      word: the seed as ``augment.seed_words`` maps it to 64 bits, the augmentation stream 1 of
      ``loader``, the 64-bit position), instead of numpy's ``SeedSequence([seed, 1, g])``. So
      the batches are another sample of the same distribution, not the host path's images.
  box: ``augment.crop_params`` itself, in ``jax.numpy`` (torchvision's RandomResizedCrop:
      10 attempts ``area ~ U(scale) H W``, ``log r ~ U(log ratio)``, ``w = round(sqrt(area r))``,
      ``h = round(sqrt(area / r))`` half to even, the first that fits placed at
      ``top = floor(u (H - h + 1))``, else the centre crop clamped to the ratio range), computed in
      float64 (the program runs under ``jax.enable_x64``), so the same ``u`` give the same boxes.
  resize: ``pil_bicubic_tables`` + ``resize_box``: Pillow's 8-bit bicubic resampling of the box to
      ``S x S`` in integer arithmetic: Keys' cubic (``a = -0.5``), support ``2 max(n / S, 1)``
      (antialiased when shrinking), weights normalised over the box and rounded to 22-bit fixed
      point in float64 as Pillow does, two passes with the first rounded to uint8, in Pillow
      13's order (``vertical_first``). Equal bit for bit to ``augment``'s crop then
      ``Image.resize`` (every box ``tests/test_resident.py`` tries, every pixel), where
      ``jax.image.scale_and_translate(..., 'cubic', antialias=True)`` would weigh in pixels
      outside the box (Pillow sees only the crop), keep float weights and round once.
  flip: mirrored where ``u[-1] < 0.5``.

Only the draws and box formulas need float64 (23 numbers per example): ``jax.enable_x64`` is on
while the program is traced and called, and every array in or out of it is 32-bit or less.

``ResidentStream`` has ``loader.TrainStream``'s interface; its batches are global ``jax.Array``s
``{'image': uint8 (B, S, S, C), 'label': int32 (B,)}`` split like ``sharding.batch_sharding``.
It is a pure function of (seed, step), so its state is the next step and what identifies it.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from decay_jax import sharding as shd
from decay_jax import validate
from decay_jax.data import augment
from decay_jax.data import config
from decay_jax.data import loader
from decay_jax.data import npz

# Pillow's fixed point: 32 bits - 8 for the pixel - 2 for the filter's overshoot (Resample.c).
PIL_PRECISION_BITS = 22
_PIL_BICUBIC_A = -0.5
_PIL_BICUBIC_SUPPORT = 2.0
KIND = "on_device"  # get_state()['kind']: tells this stream's state from a Grain stream's


# ------------------------------------------------------------------------------------------------
# RandomResizedCrop boxes and Pillow's bicubic, written for numpy and jax.numpy alike.


def _pil_bicubic(x: np.ndarray) -> np.ndarray:
  """Pillow's ``bicubic_filter`` (Keys, a = -0.5) in float64, operation for operation."""
  a = _PIL_BICUBIC_A
  x = np.abs(x)
  near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
  far = (((x - 5) * x + 8) * x - 4) * a
  return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@functools.lru_cache(maxsize=8)
def pil_bicubic_tables(max_len: int, size: int) -> Tuple[np.ndarray, np.ndarray]:
  """Pillow's 8-bit bicubic coefficients for resizing a line of ``n`` pixels to ``size``.

  Pillow's ``precompute_coeffs`` + ``normalize_coeffs_8bpc`` for the box ``(0, n)``, in float64
  and the same order of operations: output pixel ``i`` has the centre ``c = (i + 0.5) n / size``,
  the support ``s = 2 f`` with ``f = max(n / size, 1)``, the taps ``x in [trunc(c - s + 0.5),
  trunc(c + s + 0.5))`` clipped to ``[0, n)``, the weights ``K((x - c + 0.5) / f)`` divided by
  their sum, then ``trunc(w 2^22 +- 0.5)``.

  Returns:
    ``(coef, start)``: int32 (max_len + 1, size, K) and int32 (max_len + 1, size): tap ``t`` of
    output pixel ``i`` of a line of ``n`` reads input pixel ``start[n, i] + t`` with weight
    ``coef[n, i, t]`` (0 past the taps); ``K = 2 ceil(2 max(max_len / size, 1)) + 1``. Row 0 is
    unused.
  """
  taps = int(math.ceil(_PIL_BICUBIC_SUPPORT * max(max_len / size, 1.0))) * 2 + 1
  coef = np.zeros((max_len + 1, size, taps), np.int32)
  start = np.zeros((max_len + 1, size), np.int32)
  out = np.arange(size, dtype=np.float64)
  for n in range(1, max_len + 1):
    scale = float(n) / size
    filterscale = max(scale, 1.0)
    support = _PIL_BICUBIC_SUPPORT * filterscale
    center = 0.0 + (out + 0.5) * scale
    ss = 1.0 / filterscale
    xmin = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    xmax = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), n) - xmin
    weights = np.zeros((size, taps))
    total = np.zeros(size)
    for t in range(taps):  # summed tap by tap, as Pillow's loop (order matters in float64)
      w = np.where(t < xmax, _pil_bicubic(((t + xmin).astype(np.float64) - center + 0.5) * ss),
                   0.0)
      weights[:, t] = w
      total = total + w
    weights = np.where(total[:, None] != 0.0, weights / np.where(total == 0.0, 1.0, total)[:, None],
                       weights)
    fixed = weights * (1 << PIL_PRECISION_BITS)
    coef[n] = np.trunc(np.where(weights < 0, fixed - 0.5, fixed + 0.5)).astype(np.int32)
    start[n] = xmin
  for array in (coef, start):
    array.setflags(write=False)
  return coef, start


def _line_matrix(coef, start, offset, length: int):
  """Dense (size, length) int32 weights of one pass: row i holds ``coef[i, t]`` at column
  ``offset + start[i] + t`` (the box's pixels), 0 elsewhere."""
  target = offset + start[:, None] + jnp.arange(coef.shape[1], dtype=jnp.int32)  # (size, K)
  columns = jnp.arange(length, dtype=jnp.int32)
  hit = target[:, :, None] == columns  # (size, K, length)
  return jnp.sum(jnp.where(hit, coef[:, :, None], 0), axis=1, dtype=jnp.int32)


def _fixed_point_to_uint8(acc):
  """Pillow's ``clip8``: ``(acc + 2^21) >> 22`` clipped to [0, 255]."""
  shifted = jnp.right_shift(acc + (1 << (PIL_PRECISION_BITS - 1)), PIL_PRECISION_BITS)
  return jnp.clip(shifted, 0, 255)


def vertical_first(h, w, size: int):
  """Whether Pillow (13) runs the vertical pass first: ``h > S`` and ``h - S > 2 (w - S)``.

  Pillow 13 resizes vertically first when the height shrinks much more than the width
  (python-pillow/Pillow#9549); this condition reproduces its choice for every box of the
  exhaustive comparison in ``tests/test_resident.py`` (square outputs). Earlier Pillow always
  ran the horizontal pass first.
  """
  return (h > size) & (h - size > 2 * (w - size))


def resize_box(image, top, left, h, w, coef, start):
  """Pillow's bicubic resize of ``image[top:top + h, left:left + w]`` to ``S x S``, exactly.

  Args:
    image: uint8 (H, W, C), the whole image.
    top, left, h, w: int32 scalars, the box.
    coef, start: ``pil_bicubic_tables(max(H, W), S)`` as device arrays.

  Returns:
    int32 (S, S, C) in [0, 255]. With ``Mx`` (S, W) and ``My`` (S, H) the box's fixed-point
    weights placed in the image's columns and rows (zero outside the box, so no pixel outside it
    counts) and ``clip8(a) = clip((a + 2^21) >> 22, 0, 255)``: ``clip8(My clip8(x Mx^T))``, or
    ``clip8(clip8(My x) Mx^T)`` where ``vertical_first`` (only possible when ``H > S``).
  """
  height, width = image.shape[0], image.shape[1]
  size = coef.shape[1]
  mx = _line_matrix(coef[w], start[w], left, width)  # (S, W)
  my = _line_matrix(coef[h], start[h], top, height)  # (S, H)
  pixels = image.astype(jnp.int32)
  dot = functools.partial(jnp.einsum, preferred_element_type=jnp.int32)
  out = _fixed_point_to_uint8(dot("iy,yjc->ijc", my,
                                  _fixed_point_to_uint8(dot("jx,yxc->yjc", mx, pixels))))
  if height > size:  # else h <= S always and Pillow's order is always horizontal first
    other = _fixed_point_to_uint8(dot("jx,ixc->ijc", mx,
                                      _fixed_point_to_uint8(dot("iy,yxc->ixc", my, pixels))))
    out = jnp.where(vertical_first(h, w, size), other, out)
  return out


# ------------------------------------------------------------------------------------------------
# Keys and the batch program.


def position_words(positions: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """Global positions (int64) -> their high and low 32-bit words (uint32 each)."""
  positions = np.asarray(positions, np.uint64)
  return (positions >> np.uint64(32)).astype(np.uint32), (
      positions & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def seed_salt(seed: int) -> np.ndarray:
  """uint32 (3,): the seed's low and high words (``augment.seed_words``) and the stream 1."""
  words = augment.seed_words(seed)
  return np.asarray([words & 0xFFFFFFFF, words >> 32, loader.IMAGE_AUGMENT_STREAM], np.uint32)


def example_uniforms(salt, high, low):
  """float64 (L, NUM_UNIFORMS): the draws of the examples at positions ``high 2^32 + low``.

  Run under ``jax.enable_x64(True)``. ``salt``: ``seed_salt(seed)``; ``high``, ``low``: uint32
  (L,). The key of one example is ``fold_in`` of ``key(0)`` with the five words in turn.
  """
  base = jax.random.key(0, impl="threefry2x32")
  for i in range(3):
    base = jax.random.fold_in(base, salt[i])

  def one(hi, lo):
    key = jax.random.fold_in(jax.random.fold_in(base, hi), lo)
    return jax.random.uniform(key, (augment.NUM_UNIFORMS,), jnp.float64)

  return jax.vmap(one)(high, low)


def example_boxes(uniforms, height: int, width: int, scale: Tuple[float, float],
                  ratio: Tuple[float, float]):
  """``augment.crop_params`` (in ``jax.numpy``) of float64 (L, NUM_UNIFORMS) draws as int32 (L,) ``(top, left, h, w)``.

  One example at a time (a batch of 1 under vmap): the gathers of the first fitting attempt then
  stay on each device's own examples (the batch-wide fancy indexing made XLA all-gather them).
  """
  boxes = jax.vmap(lambda u: augment.crop_params(u[None], height, width, scale, ratio, xp=jnp))(
      uniforms)
  return tuple(v[:, 0].astype(jnp.int32) for v in boxes)


def _batch(images, labels, coef, start, salt, rows, *, scale, ratio, flip):
  """The global batch: ``rows`` uint32 (B, 3) = (record, position high, position low)."""
  uniforms = example_uniforms(salt, rows[:, 1], rows[:, 2])
  top, left, h, w = example_boxes(uniforms, images.shape[1], images.shape[2], scale, ratio)
  records = rows[:, 0].astype(jnp.int32)
  resize = functools.partial(resize_box, coef=coef, start=start)
  out = jax.vmap(resize)(images[records], top, left, h, w)
  if flip:
    mirrored = (uniforms[:, -1] < 0.5)[:, None, None, None]
    out = jnp.where(mirrored, out[:, :, ::-1], out)
  return {"image": out.astype(jnp.uint8), "label": labels[records].astype(jnp.int32)}


@functools.lru_cache(maxsize=16)
def batch_program(mesh, scale: Tuple[float, float], ratio: Tuple[float, float], flip: bool):
  """The jitted ``_batch`` for ``mesh`` (one compile per mesh, crop settings and shapes; the
  output size is the tables'); call it under ``jax.enable_x64(True)``. Its output is split like
  ``sharding.batch_sharding(mesh)``."""
  fn = functools.partial(_batch, scale=scale, ratio=ratio, flip=flip)
  return jax.jit(fn, out_shardings=shd.batch_sharding(mesh))


def _replicated(array: np.ndarray, mesh):
  """A copy of ``array`` on every device of ``mesh`` (each process supplies its own devices')."""
  array = np.ascontiguousarray(array)
  return jax.make_array_from_callback(array.shape, shd.replicated(mesh), lambda idx: array[idx])


# ------------------------------------------------------------------------------------------------
# The stream.


class ResidentStream:
  """Global training batches built on the devices from a resident copy of the train split.

  ``next(stream)`` -> ``{'image': uint8 (B, S, S, C), 'label': int32 (B,)}`` as ``jax.Array``s
  split like ``sharding.batch_sharding(mesh)`` (the same global batch in every process).
  ``get_state()`` -> ``{'kind': 'on_device', 'source', 'seed', 'global_batch', 'next_step'}``;
  ``restore(state)`` takes one back (see ``matches``). ``restored``, ``next_step`` and
  ``close()`` as ``loader.TrainStream``'s.
  """

  def __init__(self, images: np.ndarray, labels: np.ndarray, spec: loader.AugmentSpec,
               global_batch: int, seed: int, start_step: int, mesh, source: str):
    self.seed, self.global_batch, self.source, self.mesh = seed, global_batch, source, mesh
    self.next_step = start_step
    self.restored = False
    self._order = loader.EpochOrder(seed, len(labels), loader.IMAGE_ORDER_STREAM)
    self._layout = loader.Layout(global_batch, 0, 1, 0)  # the whole global batch, from step 0
    self._sharding = shd.batch_sharding(mesh)
    coef, start = pil_bicubic_tables(max(images.shape[1], images.shape[2]), spec.image_size)
    self._arrays = tuple(_replicated(a, mesh) for a in (
        images, labels.astype(np.int32), coef, start, seed_salt(seed)))
    self._program = batch_program(mesh, tuple(spec.crop_scale), tuple(spec.crop_ratio),
                                  bool(spec.flip))
    self._closed = False

  def identity(self) -> dict:
    return {"kind": KIND, "source": self.source, "seed": self.seed,
            "global_batch": self.global_batch}

  def matches(self, state) -> bool:
    """Whether ``state`` was saved by a stream like this one and resumes at ``next_step``."""
    return (isinstance(state, dict) and state.get("next_step") == self.next_step
            and {k: state.get(k) for k in self.identity()} == self.identity())

  def get_state(self) -> dict:
    return dict(self.identity(), next_step=self.next_step)

  def restore(self, state: dict) -> None:
    """Continues at ``state['next_step']`` (the batches are a function of the step alone)."""
    self.next_step = int(state["next_step"])
    self.restored = True

  def rows(self, step: int) -> np.ndarray:
    """uint32 (B, 3): each example's record and position words at global step ``step``."""
    first = self._layout.position(step * self._layout.local_batch)
    positions = first + np.arange(self.global_batch, dtype=np.int64)
    high, low = position_words(positions)
    return np.stack([self._order.records(positions).astype(np.uint32), high, low], axis=1)

  def __iter__(self):
    return self

  def __next__(self) -> Dict[str, jax.Array]:
    if self._closed:
      raise validate.InputError(f"dataset={loader.dataset_and_split(self.source)[0]!r}: the "
                                "input stream was closed")
    rows = self.rows(self.next_step)
    rows = jax.make_array_from_callback(rows.shape, self._sharding, lambda idx: rows[idx])
    with jax.enable_x64(True):  # float64 box formulas; every array in and out is 32-bit or less
      batch = self._program(*self._arrays, rows)
    self.next_step += 1
    return batch

  def close(self) -> None:
    """Frees the device copies; idempotent."""
    self._closed, self._arrays = True, ()


def check_config(data_cfg: ml_collections.ConfigDict, mesh) -> None:
  """One-line errors for ``on_device=True`` where it cannot run."""
  dataset = data_cfg.dataset
  if not (dataset == config.EMBEDDED_MNIST or dataset.startswith(config.NPZ_PREFIX)):
    raise validate.not_allowed("on_device", True, f"dataset={dataset!r} is not an npz or "
                               "embedded_mnist source (only those are put on the devices)")
  if data_cfg.get("rand_augment", ""):
    raise validate.not_allowed("on_device", True, "rand_augment runs on the host only; set "
                               "rand_augment='' or on_device=False")
  if mesh is None:
    raise validate.not_allowed("on_device", True, "the stream needs the device mesh "
                               "(make_train_iterator(..., mesh=mesh))")


def train_stream(source, global_batch: int, seed: int, start_step: int,
                 state: Optional[dict], mesh) -> ResidentStream:
  """A ``ResidentStream`` of ``source`` (a ``sources.NpzSource``) from ``start_step``; ``state``
  (an earlier stream's ``get_state()``) is taken where it ``matches``."""
  if global_batch % mesh.size:
    raise validate.not_allowed("global_batch", global_batch, "data.on_device=True splits it "
                               f"over the mesh's {mesh.size} devices; use a multiple")
  records = source.records(source.cfg.train_split, "train_split")
  arrays = npz.load(records.path)
  images = arrays["x_" + records.name][records.indices]
  labels = arrays["y_" + records.name][records.indices]
  name = f"{source.cfg.dataset}:{source.cfg.train_split}"
  stream = ResidentStream(images, labels, source.spec, global_batch, seed, start_step, mesh, name)
  if stream.matches(state):
    stream.restore(state)
  return stream
