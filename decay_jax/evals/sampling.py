"""Sampling at scale: a chunked, resumable sampler of a diffusion model (``decay_jax.cli.sample``).

Example ``j`` (0-based over the whole run) draws its noise and its class label from
``fold_in(key(seed), j)`` only (``example_inputs``). Chunk ``i`` holds examples
``[i C, (i + 1) C)`` (``C`` the chunk size) and is drawn by one sampling call of ``C`` examples,
split over the batch axes of the mesh (every device of every process); its SDE draws come from
``fold_in(key(seed), 10_000_000 + i C)`` (one key for the whole chunk, as the samplers take one).
So a chunk's images depend only on (weights, sampler, seed, ``C``, ``i``): never on how many chunks
were done before, nor on ``--num`` (the last chunk is drawn whole and cut at the end). With JAX's
partitionable threefry (the default) a draw gives the same numbers on any sharding; per-example
samplers (ODE Euler/Heun) then give the same images for any device count and any ``C`` up to
XLA's float round-off, while the SDE draws and dopri5's step sizes (its error norm is taken over
the batch) depend on ``C``, which the run keeps fixed.

Layout of ``OUT/chunks/``: ``manifest.json`` (what the chunks were drawn with: weights and their
digest, sampler, seed, labels, chunk size, shapes) and ``chunk_000123.npz`` (uint8 ``images``
``(C, H, W, 3)`` where the run makes pixels, raw ``latents`` for latent models, int32 ``labels``
``(C,)`` and the chunk's ``index``). Each chunk is written under a temporary name and renamed
(local disk) or uploaded whole (object stores), so a killed run never leaves half a chunk under a
trusted name; every chunk found is read back in full (the zip CRC, the shapes, dtypes and index)
before it is trusted, and a damaged one is named in one line and drawn again. A rerun with
another manifest stops with one line instead of mixing two samplings.

Several processes: every process runs every chunk's program (its devices hold their share of the
batch); the chunk is gathered to each process and **process 0 alone** reads and writes ``OUT``
(which chunks exist is decided there and broadcast), so ``OUT`` need not be a shared filesystem.
At the end process 0 streams the chunks into the ADM-layout ``.npz`` files (``assemble``).

``DECAY_JAX_SAMPLE_CHUNK_SLEEP`` (seconds, for tests): sleep after each chunk is written, so that
a test can kill the process between two chunks.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile
import time
import zipfile
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from decay_jax import paths, plots, validate
from decay_jax import sharding as shd
from decay_jax.data import latents as latents_lib
from decay_jax.evals import generation

CHUNKS = "chunks"
MANIFEST = "manifest.json"
FORMAT = "decay-jax-sample-chunks/v1"
SDE_KEY_OFFSET = 10_000_000  # chunk i's SDE key: fold_in(key(seed), SDE_KEY_OFFSET + first example)
SLEEP_ENV = "DECAY_JAX_SAMPLE_CHUNK_SLEEP"
LABELS = ("uniform", "cycle")
_CHUNK = re.compile(r"^chunk_(\d{6,})\.npz$")

# key in a chunk -> what the key holds (``expect`` maps these keys to ``(shape, dtype)``)
Expect = Dict[str, Tuple[Tuple[int, ...], str]]


class ChunkError(ValueError):
  """A chunk file that cannot be trusted (unreadable, wrong keys, shapes, dtypes or index)."""


def _say(text: str) -> None:
  print(text, flush=True)


def chunk_name(i: int) -> str:
  return f"chunk_{i:06d}.npz"


def num_chunks(num: int, size: int) -> int:
  return -(-num // size)


# ------------------------------------------------------------------------------------------------
# The draws and the per-chunk program
# ------------------------------------------------------------------------------------------------


def example_inputs(base, indices, shape: Tuple[int, ...], classes: int, labels: str = "uniform"):
  """``(noise (N,) + shape, labels (N,) int32)`` of examples ``indices``, each from
  ``fold_in(base, index)`` only. ``uniform``: labels uniform in ``[0, classes)``, independently per
  example, as ADM's ``scripts/image_sample.py`` (``th.randint(0, NUM_CLASSES, (batch,))``) and
  SiT's ``sample_ddp.py``; ``cycle``: ``index % classes``."""
  keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(indices)
  noise = jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, 0), shape))(keys)
  if labels == "uniform":
    y = jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 1), (), 0, classes))(keys)
  else:
    y = indices % classes
  return noise, y.astype(jnp.int32)


def chunk_program(sample_fn: Callable, mesh, seed: int, size: int, shape: Tuple[int, ...],
                  classes: int, labels: str = "uniform", decode: Optional[Callable] = None):
  """``program(params, decode_params, i) -> {'out', 'labels'[, 'latents']}``: chunk ``i``'s
  ``size`` examples sampled by ``sample_fn(params, noise, labels, rng)`` with the batch split over
  ``mesh``; with ``decode(decode_params, z)`` (a VAE), ``out`` is decoded and ``latents`` the raw
  sample. ``size`` must be divisible by the mesh size."""
  sharding = shd.batch_sharding(mesh)
  base = jax.random.key(seed)

  def program(params, decode_params, i):
    first = i * size
    noise, y = example_inputs(base, first + jnp.arange(size), shape, classes, labels)
    noise = jax.lax.with_sharding_constraint(noise, sharding)
    y = jax.lax.with_sharding_constraint(y, sharding)
    z = sample_fn(params, noise, y, jax.random.fold_in(base, SDE_KEY_OFFSET + first))
    if decode is None:
      return {"out": z, "labels": y}
    return {"out": decode(decode_params, z), "labels": y, "latents": z}

  return jax.jit(program, out_shardings=sharding)


def to_host(x) -> np.ndarray:
  """A global array as numpy on this process (gathered from all processes when it is split)."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check_sampler(c, modes: Dict[str, Tuple[str, ...]], prefix: str = "") -> None:
  """One-line errors for a sampler section ``c`` (``config.sample``'s fields) of a task with the
  samplers ``modes`` (``{mode: methods}``, the task's ``sampler_modes``: U-ViT's DPM-Solver and
  Euler, SiT's ODE and SDE); ``prefix`` names its place in errors (``evals.generation.sample.``;
  empty: the sample command's flags)."""
  validate.check_choice(prefix + "mode", c.mode, tuple(modes))
  validate.check_choice(prefix + "method", c.method.lower(), modes[c.mode])
  if c.num_steps < 2:
    raise ValueError(f"{prefix + 'num_steps' if prefix else 'steps'}={c.num_steps} is not "
                     "allowed; it must be >= 2")


def round_chunk(batch: int, devices: int) -> int:
  """``batch`` rounded down to a multiple of ``devices`` (at least ``devices``): one chunk is
  split over every device."""
  return batch if batch % devices == 0 else max(devices, (batch // devices) * devices)


def to_pixels(x, official: bool, mean=(0.0,), std=(1.0,)) -> np.ndarray:
  """uint8 ``(N, H, W, 3)`` of samples ``x``: the official ``clip(127.5 x + 128)`` rounding
  (``official``: decoded VAE output, or data normalised to [-1, 1]), else ``plots.to_uint8`` with
  the data's ``mean`` and ``std``; one channel is repeated to three (what FID reads)."""
  x = generation.to_uint8_official(x) if official else plots.to_uint8(np.asarray(x), mean, std)
  return np.repeat(x, 3, axis=-1) if x.shape[-1] == 1 else x


def vae_decoder(vae) -> Callable:
  """``decode(vae_params, z)``: ``vae.decode(z / scaling_factor)``, the official FID sampler's."""
  return lambda p, z: vae.apply({"params": p}, z / vae.scaling_factor, method=vae.decode)


def load_vae(directory: str, dataset: str, model, load_params: Callable, what: str = "vae"):
  """``(vae, params)`` of a converted VAE that fits the latents of the run (``data.dataset``
  ``dataset``, the diffusion ``model``): channels and scale; ``load_params(directory, what) ->
  (module, params)`` reads it (``train.checkpoint.load_params``)."""
  if not dataset.startswith(latents_lib.PREFIX):
    raise ValueError(f"{what}={directory!r} is not allowed; the run trained on {dataset!r}, not "
                     "on latents")
  if not paths.exists(paths.join(directory, "model.json")):
    raise ValueError(f"{what}={directory!r} is not allowed; it is not a converted VAE directory")
  vae, params = load_params(directory, "vae")
  channels = model.in_chans if hasattr(model, "in_chans") else model.in_channels
  if type(vae).__name__ != "AutoencoderKL" or vae.latent_channels != channels:
    raise ValueError(f"{what}={directory!r} is not allowed; it is not a VAE with "
                     f"{channels} latent channels")
  meta = paths.join(latents_lib.path_of(dataset), "meta.json")
  if paths.exists(meta):
    scale = paths.read_json(meta).get("scale")
    if scale is not None and abs(scale - vae.scaling_factor) > 1e-9:
      raise ValueError(f"{what}={directory!r} is not allowed; its scaling_factor "
                       f"{vae.scaling_factor} differs from the latents' scale {scale}")
  return vae, params


# ------------------------------------------------------------------------------------------------
# Chunk files
# ------------------------------------------------------------------------------------------------


def write_chunk(path: str, arrays: Dict[str, np.ndarray]) -> None:
  """``np.savez`` of ``arrays`` to ``path``, whole: a temporary name renamed into place on local
  disk (a kill leaves at most a ``.tmp`` file), one upload on an object store."""
  buf = io.BytesIO()
  np.savez(buf, **arrays)
  target = paths.resolve(path)
  if paths.is_uri(target):
    target.write_bytes(buf.getvalue())
    return
  target.parent.mkdir(parents=True, exist_ok=True)
  tmp = target.parent / f".{target.name}.tmp"
  with open(tmp, "wb") as f:
    f.write(buf.getbuffer())
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, target)


def read_chunk(path: str, index: int, expect: Expect) -> Dict[str, np.ndarray]:
  """Chunk ``index``'s arrays, each read in full (a stored zip member's CRC is checked when its
  last byte is read) and checked against ``expect``; ``ChunkError`` says what is wrong."""
  try:
    with paths.load_numpy(path) as f:
      missing = sorted(set(expect) - set(f.keys()))
      if missing or "index" not in f:
        raise ChunkError(f"no {', '.join(missing or ['index'])} in it")
      found = int(np.asarray(f["index"]))
      arrays = {k: np.asarray(f[k]) for k in expect}
  except ChunkError:
    raise
  except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile) as e:
    raise ChunkError(f"unreadable: {' '.join(str(e).split())[:100]}") from e
  if found != index:
    raise ChunkError(f"its index is {found}, not {index}")
  for k, (shape, dtype) in expect.items():
    a = arrays[k]
    if tuple(a.shape) != tuple(shape) or a.dtype != np.dtype(dtype):
      raise ChunkError(f"{k} is {a.dtype} {tuple(a.shape)}, not {dtype} {tuple(shape)}")
  return arrays


def expected(size: int, keys: Dict[str, Tuple[Tuple[int, ...], str]]) -> Expect:
  """``expect`` of chunks of ``size`` examples from per-example ``{key: (shape, dtype)}``."""
  return {k: ((size,) + tuple(shape), dtype) for k, (shape, dtype) in keys.items()}


def _differences(saved: dict, now: dict) -> List[str]:
  return [f"{k}: {saved.get(k)!r} != {now.get(k)!r}" for k in sorted(set(saved) | set(now))
          if saved.get(k) != now.get(k)]


def prepare(out_dir: str, manifest: dict, total: int, expect: Expect,
            log: Callable[[str], None] = _say) -> List[int]:
  """The chunks among ``0 .. total - 1`` still to draw: those missing or damaged in
  ``out_dir/chunks`` (named in one line each). Writes the manifest of a new run; raises
  ``ValueError`` (one line) when the directory holds chunks of another manifest."""
  folder = paths.join(out_dir, CHUNKS)
  manifest = dict(manifest, format=FORMAT)
  where = paths.join(folder, MANIFEST)
  names = ({p.name for p in paths.resolve(folder).iterdir()} if paths.exists(folder) else set())
  if MANIFEST in names:
    try:
      saved = paths.read_json(where)
    except ValueError as e:
      raise ValueError(f"{where} is not allowed; it is not JSON ({e}); delete {folder} to start "
                       "over") from None
    diff = _differences(saved if isinstance(saved, dict) else {}, manifest)
    if diff:
      raise ValueError(f"--out={out_dir!r} holds chunks of another sampling ({'; '.join(diff[:3])}"
                       f"); rerun with the same flags to finish it, or delete {folder} or pass "
                       "another --out")
  elif any(_CHUNK.match(n) for n in names):
    raise ValueError(f"{folder} holds chunk files but no {MANIFEST}; delete it or pass another "
                     "--out")
  else:
    paths.write_json(where, manifest)
  if not paths.is_uri(folder):
    for n in names:
      if n.startswith(".chunk_") and n.endswith(".tmp"):  # a write a kill interrupted
        (paths.resolve(folder) / n).unlink(missing_ok=True)
  todo = []
  for i in range(total):
    path = paths.join(folder, chunk_name(i))
    if chunk_name(i) not in names:
      todo.append(i)
      continue
    try:
      read_chunk(path, i, expect)
    except ChunkError as e:
      log(f"chunk {path} is damaged ({e}); drawing it again")
      todo.append(i)
  return todo


def _share(todo: Optional[List[int]], total: int, error: str) -> List[int]:
  """Process 0's list of chunks to draw, on every process (``None`` there: it failed)."""
  if jax.process_count() == 1:
    return todo
  mask = np.zeros(total + 1, np.int32)
  if todo is None:
    mask[-1] = 1
  else:
    mask[todo] = 1
  mask = np.asarray(multihost_utils.broadcast_one_to_all(mask))
  if mask[-1]:
    raise ValueError(error)
  return [int(i) for i in np.flatnonzero(mask[:-1])]


def sample(out_dir: str, manifest: dict, num: int, size: int, make_chunk: Callable[[int], Dict],
           expect: Expect, log: Callable[[str], None] = _say) -> Dict[str, int]:
  """Draws the chunks of ``num`` examples (``size`` per chunk) that ``out_dir/chunks`` lacks with
  ``make_chunk(i) -> {key: numpy array}`` (called on every process, in the same order) and writes
  them (process 0). Prints progress and ETA. Returns ``{'chunks', 'reused', 'drawn'}``."""
  total = num_chunks(num, size)
  lead = jax.process_index() == 0
  todo, error = None, f"--out={out_dir!r}: process 0 could not use it (see its error line)"
  if lead:
    try:
      todo = prepare(out_dir, manifest, total, expect, log)
    except ValueError as e:
      if jax.process_count() == 1:
        raise
      error = str(e)
      _share(None, total, error)
  todo = _share(todo, total, error)
  count = lambda i: min(size, num - i * size)
  already = num - sum(count(i) for i in todo)
  if lead:
    log(f"sampling {num} examples in {total} chunks of {size} into {paths.join(out_dir, CHUNKS)}: "
        f"{total - len(todo)} chunks already there, {len(todo)} to draw")
  sleep = float(os.environ.get(SLEEP_ENV, "0") or 0)
  done, progress, t0 = already, None, time.perf_counter()
  for i in todo:
    arrays = make_chunk(i)
    if lead:
      write_chunk(paths.join(out_dir, CHUNKS, chunk_name(i)), dict(arrays, index=np.int64(i)))
    done += count(i)
    if lead and progress is None:  # the first chunk includes compilation: rates start after it
      log(f"sampled: {done}/{num} images (first chunk, with compilation: "
          f"{time.perf_counter() - t0:.1f} s)")
      progress, first = generation.Progress("sampled", num, "images"), done
    elif lead:
      progress.update(done, first)
    if sleep:
      time.sleep(sleep)
  return {"chunks": total, "reused": total - len(todo), "drawn": len(todo)}


# ------------------------------------------------------------------------------------------------
# The final .npz files (ADM's layout), streamed from the chunks
# ------------------------------------------------------------------------------------------------


class _NpzStream:
  """An ``.npz`` written member by member; the first member's data arrives in parts (so 50,000
  images never sit in host memory at once), the others whole at ``close``."""

  def __init__(self, path: str, shape: Tuple[int, ...], dtype):
    self.path, self.target = path, paths.resolve(path)
    if paths.is_uri(self.target):
      self.tmp = tempfile.NamedTemporaryFile(suffix=".npz", delete=False).name
    else:
      self.target.parent.mkdir(parents=True, exist_ok=True)
      self.tmp = os.fspath(self.target.parent / f".{self.target.name}.tmp")
    self.zip = zipfile.ZipFile(self.tmp, "w", zipfile.ZIP_STORED, allowZip64=True)
    self.shape, self.dtype = tuple(shape), np.dtype(dtype)
    self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
    self.member = None

  def open(self, name: str) -> None:
    self.member = self.zip.open(f"{name}.npy", "w", force_zip64=self.nbytes > 2**31 - 2**20)
    np.lib.format.write_array_header_1_0(self.member, {
        "descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
        "shape": self.shape})

  def write(self, part: np.ndarray) -> None:
    self.member.write(np.ascontiguousarray(part, self.dtype).tobytes())

  def close(self, others: Dict[str, np.ndarray]) -> None:
    self.member.close()
    for name, value in others.items():
      with self.zip.open(f"{name}.npy", "w") as f:
        np.lib.format.write_array(f, np.asarray(value), allow_pickle=False)
    self.zip.close()
    if paths.is_uri(self.target):
      with open(self.tmp, "rb") as src, self.target.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
      os.unlink(self.tmp)
    else:
      os.replace(self.tmp, self.target)


def assemble(out_dir: str, num: int, size: int, expect: Expect,
             outputs: Dict[str, Sequence[Tuple[str, str]]], keep: int = 0) -> Dict[str, np.ndarray]:
  """Writes ``out_dir/NAME`` for each ``NAME: [(npz key, chunk key), ...]`` of ``outputs`` from the
  chunks' first ``num`` examples, in one pass over the chunks: the first pair's array streamed,
  the others collected. Returns the first ``keep`` examples of each chunk key (for a grid).
  A chunk damaged since ``sample`` read it raises ``ValueError`` (a rerun draws it again)."""
  total = num_chunks(num, size)
  streams, kept = {}, {}
  collected = {ck: [] for pairs in outputs.values() for _, ck in pairs[1:]}  # small: labels
  for name, pairs in outputs.items():
    key, chunk_key = pairs[0]
    shape, dtype = expect[chunk_key]
    streams[name] = _NpzStream(paths.join(out_dir, name), (num,) + tuple(shape[1:]), dtype)
    streams[name].open(key)
  for i in range(total):
    path = paths.join(out_dir, CHUNKS, chunk_name(i))
    try:
      arrays = read_chunk(path, i, expect)
    except ChunkError as e:
      raise ValueError(f"chunk {path} is damaged ({e}); rerun the same command to draw it "
                       "again") from None
    n = min(size, num - i * size)
    for name, pairs in outputs.items():
      streams[name].write(arrays[pairs[0][1]][:n])
    for k, parts in collected.items():
      parts.append(arrays[k][:n])
    for k, v in arrays.items():
      if len(kept.get(k, ())) < keep:
        v = v[:n]
        kept[k] = np.concatenate([kept[k], v[:keep - len(kept[k])]]) if k in kept else v[:keep]
  for name, pairs in outputs.items():
    streams[name].close({key: np.concatenate(collected[ck]) for key, ck in pairs[1:]})
  return kept


def remove_chunks(out_dir: str) -> None:
  """Deletes ``out_dir/chunks`` (after the final files are written)."""
  folder = paths.resolve(paths.join(out_dir, CHUNKS))
  if folder.exists():
    folder.rmtree()
