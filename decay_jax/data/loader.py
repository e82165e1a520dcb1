"""The Grain input pipeline: exactly resumable training streams and evaluation arrays.

Every source is random access (``records[i] -> (pixels, label)``), so the training stream is a pure
function of the step. The order is the concatenation of per-epoch permutations drawn from
``(seed, epoch)``; global step ``s`` consumes the global positions ``[s B, (s + 1) B)``, process
``p`` of ``P`` the slice ``[s B + p B / P, s B + (p + 1) B / P)``, and the example at global
position ``g = epoch * N + offset`` is augmented with draws seeded by ``(seed, g)``. Hence a stream
started at step ``s`` yields exactly what an uninterrupted one yields at step ``s``, whatever the
process count, worker count or thread count.

Grain runs it: a ``MapDataset`` over this process's positions, mapped to augmented uint8 examples
and batched (each batch is built by one thread of one worker, so workers never reorder anything),
read by ``num_threads`` threads in each of ``num_workers`` processes (``mp_prefetch``). A worker
stacks each batch straight into shared memory, which the training process maps without a copy,
and the batch stays uint8: the training process does no per-pixel work (the jitted step
normalises on the devices, ``decay_jax.data.on_device``). The workers start without re-importing
the command's ``__main__`` module (``light_worker_spawn``), so they hold only what reading and
augmenting import. ``TrainStream.get_state()`` is Grain's iterator state plus the
facts it is valid for; the trainer saves it in each checkpoint and hands it back on resume.

Anything that fails while reading (a record in a thread or a worker process, a worker that died)
stops the stream with one ``InputError`` line naming the dataset, the step and, where one is to
blame, the file; the workers ignore Ctrl-C (the training process closes them) and end when their
training process has been killed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import grain
from absl import flags
import numpy as np

from decay_jax import validate
from decay_jax.data import augment
from decay_jax.data import config as data_config

# MapDataset needs a length: a stream this long never ends in practice (2**48 examples).
_ENDLESS = 1 << 48
# Independent SeedSequence streams derived from the user seed (image order, crop and flip,
# RandAugment).
IMAGE_ORDER_STREAM = 0
IMAGE_AUGMENT_STREAM = 1
RAND_AUGMENT_STREAM = 2
_EVAL_CHUNK = 256


class EpochOrder:
  """Global position -> record index: epoch ``g // n`` is a permutation drawn from (seed, epoch)."""

  def __init__(self, seed: int, n: int, stream: int):
    self.seed, self.n, self.stream = augment.seed_words(seed), n, stream
    self._cache: Dict[int, np.ndarray] = {}

  def __getstate__(self):
    return {"seed": self.seed, "n": self.n, "stream": self.stream, "_cache": {}}

  def permutation(self, epoch: int) -> np.ndarray:
    perm = self._cache.get(epoch)
    if perm is None:
      perm = np.random.default_rng([self.seed, self.stream, epoch]).permutation(self.n)
      self._cache = {e: p for e, p in self._cache.items() if e >= epoch - 1}  # threads: 2 epochs
      self._cache[epoch] = perm
    return perm

  def __call__(self, position: int) -> int:
    epoch, offset = divmod(int(position), self.n)
    return int(self.permutation(epoch)[offset])

  def records(self, positions: np.ndarray) -> np.ndarray:
    """``self(g)`` for every global position of ``positions``, one permutation lookup per epoch."""
    epochs, offsets = np.divmod(positions, self.n)
    out = np.empty(len(positions), np.int64)
    for epoch in np.unique(epochs):
      hit = epochs == epoch
      out[hit] = self.permutation(int(epoch))[offsets[hit]]
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where this process's stream lies in the global one (see the module docstring)."""
  global_batch: int
  process_index: int
  process_count: int
  start_step: int

  @property
  def local_batch(self) -> int:
    return self.global_batch // self.process_count

  def position(self, j: int) -> int:
    """Global position of this process's ``j``-th example counted from ``start_step``."""
    step, i = divmod(int(j), self.local_batch)
    return ((self.start_step + step) * self.global_batch
            + self.process_index * self.local_batch + i)


@dataclasses.dataclass(frozen=True)
class AugmentSpec:
  """The fields of the data config the image augmentation reads (picklable for workers)."""
  image_size: int
  crop_scale: Tuple[float, float]
  crop_ratio: Tuple[float, float]
  flip: bool
  normalize: str
  eval_resize: str
  rand_augment: str = ""
  jpeg_draft: bool = True

  @classmethod
  def of(cls, cfg) -> "AugmentSpec":
    return cls(int(cfg.image_size), tuple(cfg.crop_scale), tuple(cfg.crop_ratio), bool(cfg.flip),
               str(cfg.normalize), str(cfg.eval_resize), str(cfg.get("rand_augment", "")),
               bool(cfg.get("jpeg_draft", True)))


class ImageTrainExample:
  """``j -> {'image': uint8 (S, S, C), 'label': int32}``: MAE's crop and flip of one record, then
  RandAugment where ``spec.rand_augment`` asks for it (its draws seeded by seed and position).

  Records that offer ``crop_resized`` (image folders) crop and resize while decoding, from the
  same draws (the same box, decoded no larger than it needs: ``decay_jax.data.folder``); others
  (npz, TFDS, embedded) hand over the whole image for ``augment.augment_batch``."""

  def __init__(self, records, layout: Layout, seed: int, spec: AugmentSpec):
    self.records, self.layout, self.spec, self.seed = records, layout, spec, seed
    self.order = EpochOrder(seed, len(records), IMAGE_ORDER_STREAM)
    self.rand_augment = data_config.rand_augment_params(spec.rand_augment)

  def __call__(self, j: int) -> Dict[str, np.ndarray]:
    position = self.layout.position(j)
    uniforms = augment.example_uniforms(position, self.seed)
    spec = self.spec
    crop_resized = getattr(self.records, "crop_resized", None)
    if crop_resized is not None:
      out, label = crop_resized(self.order(position), uniforms, spec.image_size, spec.crop_scale,
                                spec.crop_ratio, spec.flip, spec.jpeg_draft)
    else:
      image, label = self.records[self.order(position)]
      out = augment.augment_batch(image[None], uniforms[None], spec.image_size, spec)[0]
    if self.rand_augment is not None:
      out = augment.rand_augment_one(out, self.spec.normalize, self.rand_augment,
                                     augment.example_rng(position, self.seed, RAND_AUGMENT_STREAM))
    return {"image": out, "label": np.int32(label)}


@dataclasses.dataclass(frozen=True)
class Parallelism:
  """How many workers, threads and prefetched batches (none of them changes a value)."""
  num_workers: int = 0
  num_threads: int = 2
  prefetch: int = 2

  @classmethod
  def of(cls, cfg) -> "Parallelism":
    return cls(int(cfg.num_workers), int(cfg.num_threads), int(cfg.prefetch))


# Grain's report of a worker process that ended without sending an exception (killed, crashed).
_WORKER_DIED = re.compile(r"Worker process was terminated unexpectedly with exit code (-?\d+)")


def _worker_death(code: int) -> str:
  if code >= 0:
    return f"an input worker process died (exit status {code})"
  try:
    name = signal.Signals(-code).name
  except ValueError:
    name = f"signal {-code}"
  advice = (": out of memory? fewer data.num_workers or a smaller data.prefetch need less"
            if -code == signal.SIGKILL else "")
  return f"an input worker process died (killed by {name}{advice})"


def one_line(e: BaseException) -> str:
  """An exception as one short line: our own ValueErrors as they are, a dead Grain worker as such,
  others with their type."""
  text = " ".join(str(e).split())
  died = _WORKER_DIED.search(text) if isinstance(e, RuntimeError) else None
  if died:
    return _worker_death(int(died.group(1)))
  if len(text) > 300:
    text = text[:297] + "..."
  if isinstance(e, ValueError) and text:
    return text
  return f"the input pipeline failed ({type(e).__name__}: {text})" if text else (
      f"the input pipeline failed ({type(e).__name__})")


class OneLineErrors:
  """``fn`` with any exception it raises turned into a plain one-line ``ValueError``.

  Grain hands an exception raised in a worker process to the training process by pickling it; one
  that cannot be pickled (an attribute holding a lock or a file) is printed by the worker's queue
  thread and lost, and the training process then waits for ever; one whose class cannot be rebuilt
  from its arguments arrives as an unrelated TypeError. A plain ValueError always arrives, and it
  reads the same whatever the worker and thread counts.
  """

  def __init__(self, fn: Callable[[int], Any]):
    self.fn = fn

  def __call__(self, index: int) -> Any:
    try:
      return self.fn(index)
    # SystemExit too: sys.exit() in a worker would end it with only an exit status to show.
    except (Exception, SystemExit) as e:  # pylint: disable=broad-except
      raise ValueError(one_line(e)) from None


def dataset_and_split(source: str) -> Tuple[str, str]:
  """``'imagefolder:/data:train[:800]'`` -> ``('imagefolder:/data', 'train[:800]')``."""
  head = source[:source.rfind("[")] if source.endswith("]") else source
  cut = head.rfind(":")
  return source[:cut], source[cut + 1:]


def _watch_parent() -> None:
  """Ends this worker process when the training process has died (its sentinel pipe closes)."""
  parent = multiprocessing.parent_process()
  if parent is not None:
    multiprocessing.connection.wait([parent.sentinel])
    os._exit(0)  # no clean-up to wait for: the resource tracker frees the shared memory


def worker_init(worker_index: int, worker_count: int) -> None:
  """Runs first in each Grain worker process.

  Ctrl-C reaches every process of the terminal's process group: the training process handles it
  (closing the stream stops its workers), the workers ignore it instead of each printing a
  KeyboardInterrupt traceback. And a worker whose training process was killed (SIGKILL, the
  out-of-memory killer) exits at once instead of waiting for ever on its full queue.
  """
  del worker_index, worker_count
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  threading.Thread(target=_watch_parent, name="decay_jax-parent-watch", daemon=True).start()


def _start_quiet_resource_tracker() -> None:
  """Starts multiprocessing's resource tracker (if not running yet) without its exit-time
  "leaked shared_memory objects" warning: batches still buffered in shared memory when a stream
  is closed are unlinked by the tracker itself, which is all that warning reports."""
  from multiprocessing import resource_tracker  # pylint: disable=g-import-not-at-top
  previous = os.environ.get("PYTHONWARNINGS")
  os.environ["PYTHONWARNINGS"] = "ignore::UserWarning:multiprocessing.resource_tracker"
  try:
    resource_tracker.ensure_running()
  finally:
    if previous is None:
      del os.environ["PYTHONWARNINGS"]
    else:
      os.environ["PYTHONWARNINGS"] = previous


# multiprocessing names Grain 0.2.18's worker processes so (process_prefetch.py).
_GRAIN_WORKER_NAME = "grain-process-prefetch"


def light_worker_spawn() -> None:
  """Grain's worker processes start without re-importing the command's ``__main__`` module.

  Grain spawns its workers, and spawn re-imports the parent's ``__main__`` in each child (by
  module name for ``python -m``, by path for a script): for a training command that is jax,
  flax, optax, orbax, clu, TensorFlow and the whole trainer, about 700 MB per worker, for code
  the worker never runs (google/grain#802). A worker needs only the pickled dataset, whose
  classes import by reference (this module, the sources, Pillow, numpy; Grain itself imports
  jax). So the preparation data of processes Grain names as its workers leaves the main module
  out; every other process this program spawns is started as multiprocessing always does.
  Idempotent.
  """
  from multiprocessing import spawn  # pylint: disable=g-import-not-at-top
  if getattr(spawn.get_preparation_data, "_without_main_for_grain", False):
    return
  original = spawn.get_preparation_data

  def get_preparation_data(name):
    data = original(name)
    if str(name).startswith(_GRAIN_WORKER_NAME):
      data.pop("init_main_from_name", None)
      data.pop("init_main_from_path", None)
    return data

  get_preparation_data._without_main_for_grain = True  # pylint: disable=protected-access
  spawn.get_preparation_data = get_preparation_data


def stream_identity(layout: Layout, seed: int, parallel: Parallelism, source: str) -> dict:
  """What a saved stream state must agree on to be restored (all but the start step)."""
  return {"layout": dict(dataclasses.asdict(layout), start_step=None), "seed": seed,
          "num_workers": parallel.num_workers, "source": source}


def resume_layout(state: Any, layout: Layout, seed: int, parallel: Parallelism,
                  source: str) -> Optional[Layout]:
  """The layout of the stream that saved ``state``, if Grain can restore it at ``layout.start_step``.

  A state qualifies when it was saved by a stream of the same source, seed, batch layout and
  worker count and its next step is ``layout.start_step``; otherwise None (the caller starts a
  fresh stream at ``start_step``, which yields the same batches).
  """
  if not isinstance(state, dict) or not isinstance(state.get("grain"), dict):
    return None
  saved = {k: state.get(k) for k in ("layout", "seed", "num_workers", "source")}
  try:
    saved_layout = Layout(**saved["layout"])
  except TypeError:
    return None
  saved["layout"] = dict(saved["layout"], start_step=None)
  if (json.loads(json.dumps(saved)) != stream_identity(layout, seed, parallel, source)
      or state.get("next_step") != layout.start_step):
    return None
  return saved_layout


@contextlib.contextmanager
def sigint_deferred():
  """Holds Ctrl-C back for the body and raises it after, where nothing can swallow it.

  A ``KeyboardInterrupt`` raised inside a ``__del__`` is printed ("Exception ignored in") and
  dropped: the interrupt is lost. Grain's shared-memory batches free themselves in ``__del__``,
  so releasing one is such a place. Only the main thread runs Python signal handlers; elsewhere,
  or when Ctrl-C is not handled by a Python function (ignored, default), the body runs as is.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  handler = signal.getsignal(signal.SIGINT)
  if not callable(handler):
    yield
    return
  caught = []
  signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, handler)
    if caught:
      handler(*caught[0])


class TrainStream:
  """An endless iterator of training batches with a saveable state.

  ``get_state()`` returns ``{'layout', 'seed', 'num_workers', 'source', 'next_step', 'grain'}``
  (JSON-serialisable; ``grain`` is Grain's own iterator state); ``resume_layout`` and
  ``restore`` take such a state back.
  """

  def __init__(self, example: Callable[[int], dict], layout: Layout, seed: int,
               parallel: Parallelism, source: str):
    self.layout, self.seed, self.parallel, self.source = layout, seed, parallel, source
    dataset = grain.MapDataset.range(_ENDLESS).map(OneLineErrors(example)).batch(
        layout.local_batch)
    if parallel.num_workers > 0:
      # The worker stacks the batch into shared memory itself (Grain would otherwise stack it,
      # then copy it there); Grain enables this only for a batch right before mp_prefetch.
      dataset.enable_shared_memory_output()
    stream = dataset.to_iter_dataset(grain.ReadOptions(
        num_threads=parallel.num_threads, prefetch_buffer_size=parallel.prefetch))
    if parallel.num_workers > 0:
      # Grain's workers read absl flags; a library caller (a test, a notebook) has parsed none.
      if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
      _start_quiet_resource_tracker()
      light_worker_spawn()
      stream = stream.mp_prefetch(
          grain.MultiprocessingOptions(num_workers=parallel.num_workers,
                                       per_worker_buffer_size=parallel.prefetch),
          worker_init_fn=worker_init)
    self._iterator = iter(stream)
    self.next_step = layout.start_step
    self.restored = False  # whether Grain's iterator came from a saved state
    self._failure: Optional[validate.InputError] = None
    # The last two batches handed out: a batch read from shared memory frees itself when its last
    # reference goes, and that reference is then this stream's, dropped under
    # ``sigint_deferred`` (a ``for batch in stream`` loop still holds the previous batch while
    # asking for the next; so two).
    self._held = collections.deque()

  def get_state(self) -> dict:
    identity = stream_identity(self.layout, self.seed, self.parallel, self.source)
    identity["layout"]["start_step"] = self.layout.start_step
    return dict(identity, next_step=self.next_step, grain=self._iterator.get_state())

  def restore(self, state: dict) -> None:
    """Positions Grain's iterator at ``state`` (whose layout is this stream's; nothing read yet)."""
    self._iterator.set_state(state["grain"])
    self.next_step = int(state["next_step"])
    self.restored = True

  def __iter__(self):
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    if self._failure is not None:
      raise self._failure
    if len(self._held) == 2:
      with sigint_deferred():  # raised before reading: the stream's state stays consistent
        self._held.popleft()
    try:
      batch = next(self._iterator)
    except Exception as e:  # pylint: disable=broad-except  (a record, a thread or a worker failed)
      self._failure = validate.InputError(f"dataset={dataset_and_split(self.source)[0]!r}, "
                                          f"step {self.next_step}: {one_line(e)}")
      self.close()  # the other workers stop now, not when the caller gets round to it
      raise self._failure from None
    self.next_step += 1
    self._held.append(batch)
    return batch

  def close(self) -> None:
    """Stops the workers and threads; idempotent, and never raises (a worker may be dead)."""
    iterator, self._iterator = self._iterator, None
    if self._failure is None:
      self._failure = validate.InputError(f"dataset={dataset_and_split(self.source)[0]!r}: the "
                                          "input stream was closed")
    close = getattr(iterator, "close", None)
    if close is not None:
      try:
        close()
      except Exception:  # pylint: disable=broad-except
        pass
    with sigint_deferred():
      self._held.clear()


def eval_batches(example: Callable[[int], dict], n: int, parallel: Parallelism):
  """The examples ``0 .. n-1`` in order, in batches of up to 256, read by Grain threads."""
  dataset = grain.MapDataset.range(n).map(OneLineErrors(example)).batch(_EVAL_CHUNK)
  return dataset.to_iter_dataset(grain.ReadOptions(
      num_threads=parallel.num_threads, prefetch_buffer_size=parallel.prefetch))


class ImageEvalExample:
  """``i -> {'image': uint8 (S, S, C), 'label': int32}``: the evaluation resize of record ``i``."""

  def __init__(self, records, spec: AugmentSpec):
    self.records, self.spec = records, spec

  def __call__(self, i: int) -> Dict[str, np.ndarray]:
    image, label = self.records[i]
    return {"image": augment.eval_resize_one(image, self.spec.image_size, self.spec.eval_resize),
            "label": np.int32(label)}


def eval_stream(records, spec: AugmentSpec, n: int, parallel: Parallelism,
                source: Optional[str] = None) -> Iterator[Dict[str, np.ndarray]]:
  """The first n records, resized, in order: chunks ``{'image': uint8 (m, S, S, C), 'label':
  int32 (m,)}`` of up to 256, so that a consumer (a 50,000-image reference batch) never holds
  them all. ``source`` (e.g. ``"imagefolder:/data:test"``) names the dataset and split in errors.
  """
  try:
    for part in eval_batches(ImageEvalExample(records, spec), n, parallel):
      yield {"image": part["image"], "label": np.asarray(part["label"], np.int32)}
  except Exception as e:  # pylint: disable=broad-except
    where = ""
    if source is not None:
      dataset, split = dataset_and_split(source)
      where = f"dataset={dataset!r}, split {split!r}: "
    raise validate.InputError(where + one_line(e)) from None


def gather(chunks) -> Dict[str, np.ndarray]:
  """``{'image': uint8 (n, S, S, C), 'label': int32 (n,)}``: the chunks of ``eval_stream`` in one.

  The pixels stay uint8 (a quarter of float32's host memory); the evaluators normalise them on
  the devices (``decay_jax.data.on_device.to_model_input``).
  """
  parts = list(chunks)
  images = np.concatenate([p["image"] for p in parts])
  labels = np.concatenate([p["label"] for p in parts]).astype(np.int32)
  return {"image": images, "label": labels}
