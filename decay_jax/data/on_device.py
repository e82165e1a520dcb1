"""Images become model inputs on the devices, inside the jitted programs that consume them.

The input pipeline ships uint8 pixels (a quarter of float32's bytes, and no per-pixel work in the
training process); ``to_model_input`` turns them into the float32 the models take, as the host
did before: ``x = pixel / 255``, then ``(x - mean) / std`` per channel (torchvision's ``ToTensor``
then ``Normalize``; ``decay_jax.data.augment.normalize_uint8`` is the same on the host). Arrays that
are already floating point (VAE latents, tests that feed normalised images) pass unchanged, so a
step or an evaluator can take either.
"""

from __future__ import annotations

from typing import Dict, Sequence

import jax.numpy as jnp

from decay_jax.data import latents


def to_model_input(images, mean: Sequence[float], std: Sequence[float]):
  """uint8 ``(..., C)`` pixels -> float32 ``(pixel / 255 - mean) / std``; floats pass unchanged.

  Args:
    images: ``(..., C)`` uint8 pixels, or an already normalised floating array.
    mean, std: per-channel statistics of ``x = pixel / 255`` (length C, or 1 to broadcast).

  Returns:
    float32 ``(..., C)`` (a floating input is returned as it is).
  """
  if jnp.issubdtype(images.dtype, jnp.floating):
    return images
  x = images.astype(jnp.float32) / jnp.float32(255.0)
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def batch_to_model(batch: Dict[str, object], mean, std) -> Dict[str, object]:
  """``batch`` with its ``'image'`` through ``to_model_input`` (other entries unchanged)."""
  if "image" not in batch:
    return batch
  return dict(batch, image=to_model_input(batch["image"], mean, std))


class DevicePrefetch:
  """A training stream with its next ``size`` batches already on the devices.

  ``put(host_batch) -> device batch`` (e.g. ``sharding.global_batch_from_local``) starts each
  host-to-device copy ``size`` steps before the step that consumes it, so the copies overlap the
  steps in flight (JAX's transfers are asynchronous) instead of sitting between them.

  ``get_state()`` is the stream's state just after the last batch *handed out* (not after the
  prefetched ones), recorded when that batch was read, so a checkpoint resumes at the right
  batch; an error of the stream is raised when the caller reaches the batch it stopped at, after
  the good batches before it have been handed out. ``restored`` and ``close()`` are the stream's.
  """

  def __init__(self, stream, put, size: int = 2):
    if size < 1:
      raise ValueError(f"device prefetch size={size} is not allowed; it must be >= 1")
    self._stream, self._put, self._size = stream, put, size
    self._queue = []  # [(device batch, stream state after it) or (None, exception)]
    self._state = stream.get_state()
    self.restored = getattr(stream, "restored", False)

  def _fill(self) -> None:
    while len(self._queue) < self._size and not (self._queue and self._queue[-1][0] is None):
      try:
        batch = self._put(next(self._stream))
      except Exception as e:  # pylint: disable=broad-except  (raised when its turn comes)
        self._queue.append((None, e))
        return
      self._queue.append((batch, self._stream.get_state()))

  def __iter__(self):
    return self

  def __next__(self):
    self._fill()
    batch, after = self._queue.pop(0)
    if batch is None:
      self._queue.insert(0, (None, after))  # every later call fails the same way
      raise after
    self._state = after
    self._fill()  # the next copies start now, while the caller runs this batch's step
    return batch

  def get_state(self):
    return self._state

  def close(self) -> None:
    self._queue = []
    self._stream.close()


def stream_dtype(data_cfg):
  """The dtype of ``'image'`` in the training stream of ``data_cfg``: float32 for VAE latents
  (``latents:``), uint8 pixels for every image source."""
  return jnp.float32 if latents.path_of(data_cfg.dataset) is not None else jnp.uint8
