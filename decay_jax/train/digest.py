"""Digests of array trees, computed where the arrays live: what a checkpoint records at save and
checks at restore (``decay_jax.train.checkpoint``).

Each array is read as unsigned 32-bit words (its bit patterns: 4-byte dtypes as they are, 2- and
1-byte dtypes widened, 8-byte dtypes as two words) and reduced on its devices to two sums mod 2^32:
the plain sum of the words and their sum weighted by ``2 * i + 1`` (``i`` the word's position in
the row-major array). Any change of a single word changes both (the weights are odd, so invertible
mod 2^32); the weights also catch words that moved (all but rare swaps). Sums of integers mod 2^32
do not depend on the order of the additions, so the digest of an array is the same bit for bit on
any sharding or device count. One jitted program reduces the whole tree (every shard where it
lives; only a few bytes per array come back to the host), together with whether each
floating-point array is finite.

Neither orbax nor tensorstore can be asked for this: orbax's zarr3 layout checksums (crc32c) only
the shard index, and the chunks themselves are stored (zstd-compressed) without a checksum, so a
bit flipped inside a chunk reads back without an error.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

# The name recorded with the digests: a future change of the arithmetic changes it, and a reader
# that does not know the recorded name cannot check (it says so) rather than report damage.
FORMAT = "u32-sum+odd-weighted-sum/v1"


def _words(x: jax.Array) -> jax.Array:
  """The bit patterns of ``x`` as uint32 (8-byte dtypes: two words per element, last axis)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):  # typed PRNG keys
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = np.dtype(x.dtype).itemsize
  if size == 4:
    return lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    return lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(jnp.uint32)
  if size == 8:
    return lax.bitcast_convert_type(x, jnp.uint32)  # shape + (2,)
  raise TypeError(f"no digest for dtype {x.dtype}")


def _positions(shape: Tuple[int, ...]) -> jax.Array:
  """The row-major position of every element, mod 2^32, built per shard from iotas (no gather)."""
  if not shape:
    return jnp.zeros((), jnp.uint32)
  index, stride = jnp.zeros(shape, jnp.uint32), 1
  for axis in reversed(range(len(shape))):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
    stride *= shape[axis]
  return index


def _one(x: jax.Array) -> jax.Array:
  words = _words(x)
  weights = _positions(words.shape) * jnp.uint32(2) + jnp.uint32(1)
  finite = (jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
            else jnp.bool_(True))
  return jnp.stack([jnp.sum(words * weights, dtype=jnp.uint32), jnp.sum(words, dtype=jnp.uint32),
                    finite.astype(jnp.uint32)])


def _all(leaves: List[jax.Array]) -> jax.Array:
  return jnp.stack([_one(x) for x in leaves]) if leaves else jnp.zeros((0, 3), jnp.uint32)


@functools.lru_cache(maxsize=None)
def _program(out_sharding):
  return jax.jit(_all, out_shardings=out_sharding)


def _replicated(leaves) -> Any:
  """A replicated sharding on the mesh of the tree's (first) named sharding, so that every process
  of a multi-host run gets the whole result; None: let jit choose (one device, numpy leaves)."""
  for x in leaves:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return NamedSharding(sharding.mesh, PartitionSpec())
  return None


def compute(tree: Any) -> Tuple[Dict[str, List[int]], bool]:
  """``({path: [weighted sum, sum]}, all floating-point arrays finite)`` of ``tree``'s arrays.

  Paths are ``jax.tree_util.keystr`` of each leaf (``['params']['blocks']...``), so a digest of a
  subtree wrapped in the same keys (``{'params': ...}``) matches the whole tree's entries.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  keys = [jax.tree_util.keystr(path) for path, _ in flat]
  leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in flat]
  sums = np.asarray(jax.device_get(_program(_replicated(leaves))(leaves)))
  out = {k: [int(row[0]), int(row[1])] for k, row in zip(keys, sums)}
  return out, bool(np.all(sums[:, 2] == 1)) if len(sums) else True


def record(digests: Dict[str, List[int]]) -> Dict[str, Any]:
  """The JSON a checkpoint stores: the format name and the digests."""
  return {"format": FORMAT, "arrays": digests}


def differences(recorded: Dict[str, Any], tree: Any, subtree: bool = False) -> List[str]:
  """The paths whose digest in ``tree`` differs from ``recorded`` (``record``'s JSON); with
  ``subtree``, only the recorded paths present in ``tree`` are compared (a partial restore), else
  an array missing on either side counts as a difference. Raises ``ValueError`` for a record it
  cannot read (another format, not a mapping)."""
  if not isinstance(recorded, dict) or recorded.get("format") != FORMAT:
    found = recorded.get("format") if isinstance(recorded, dict) else recorded
    raise ValueError(f"digest format {found!r} is not {FORMAT!r}")
  saved = recorded["arrays"]
  now, _ = compute(tree)
  if subtree:
    return [k for k, v in now.items() if k not in saved or list(saved[k]) != v]
  return sorted(k for k in set(saved) | set(now) if k not in saved or k not in now
                or list(saved[k]) != now[k])
