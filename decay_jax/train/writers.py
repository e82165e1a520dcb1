"""Metric writers: everything to TensorBoard and ``metrics.jsonl``, a compact line to the console.

``metrics.jsonl`` holds one JSON object per write, ``{"step": int, <scalar name>: float, ...}``,
appended across resumes, so curves (loss, KNN accuracy over training) can be read back without
TensorBoard: ``read_scalars(workdir, key)``.

Nothing here imports TensorFlow: the console and JSONL writers and the asynchronous fan-out are our
own; clu's TensorBoard ``SummaryWriter`` (which imports TensorFlow, about 3 s and hundreds of MB) is
imported by ``make_writer`` only when TensorBoard is on.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
from typing import List, Sequence, Tuple

from absl import logging

from decay_jax import paths

# The console line of a write, in this order; the rest (per-block curves, evaluations: each
# evaluation logs its own summary line, see train.evaluation) is in TensorBoard and metrics.jsonl.
CONSOLE_KEYS = ("loss", "lr", "grad_norm", "examples_per_sec", "model_tflops_per_sec_per_device",
                "mfu", "steps_per_sec")
JSONL = "metrics.jsonl"


def console_line(scalars, keys=CONSOLE_KEYS) -> str:
  """``loss=0.4736, lr=0.000475, ...``: the ``keys`` present, in that order, at 4 digits."""
  return ", ".join(f"{k}={float(scalars[k]):.4g}" for k in keys if k in scalars)


class Writer:
  """clu's ``MetricWriter`` interface (the trainer calls write_scalars, write_images and flush;
  the others are there for completeness), every method doing nothing. clu's ``SummaryWriter`` has
  the same methods, so it joins the fan-out as it is."""

  def write_scalars(self, step, scalars):
    pass

  def write_summaries(self, step, values, metadata=None):
    pass

  def write_images(self, step, images):
    pass

  def write_videos(self, step, videos):
    pass

  def write_audios(self, step, audios, *, sample_rate):
    pass

  def write_texts(self, step, texts):
    pass

  def write_histograms(self, step, arrays, num_buckets=None):
    pass

  def write_hparams(self, hparams):
    pass

  def flush(self):
    pass

  def close(self):
    pass


class WriterError(RuntimeError):
  """A write that ran in the background failed (raised by the next write, flush or close)."""


class AsyncMultiWriter(Writer):
  """Every call goes to each of ``writers`` on a thread of its own (one single-thread executor per
  writer, as clu's ``AsyncMultiWriter``): the caller does not wait for TensorBoard or the disk, a
  slow writer does not hold back the others, and each writer sees its calls in order.

  A failed background write is logged when it happens and raised as ``WriterError`` by the next
  ``write_*``, ``flush`` or ``close``. ``flush`` waits for every pending write, then flushes each
  writer; ``close`` flushes, closes the writers and stops the threads.
  """

  def __init__(self, writers: Sequence):
    self._writers = tuple(writers)
    self._pools = [concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=f"writer_{type(w).__name__}") for w in self._writers]
    self._pending: List[concurrent.futures.Future] = []

  @staticmethod
  def _logged(fn, *args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except Exception:
      logging.exception("metric writer %s failed", getattr(fn, "__qualname__", fn))
      raise

  def _submit(self, method: str, *args, **kwargs):
    for w, pool in zip(self._writers, self._pools):
      self._pending.append(pool.submit(self._logged, getattr(w, method), *args, **kwargs))
    self._raise_failed(wait=False)  # an earlier write's failure (this one is queued all the same)

  def _raise_failed(self, wait: bool):
    """Forgets the finished writes (all of them with ``wait``); raises the first that failed."""
    if wait:
      concurrent.futures.wait(self._pending)
    failed = [f.exception() for f in self._pending if f.done() and f.exception() is not None]
    self._pending = [f for f in self._pending if not f.done()]
    if failed:
      raise WriterError(f"writing metrics failed: {failed[0]!r}") from failed[0]

  def write_scalars(self, step, scalars):
    self._submit("write_scalars", step, scalars)

  def write_summaries(self, step, values, metadata=None):
    self._submit("write_summaries", step, values, metadata)

  def write_images(self, step, images):
    self._submit("write_images", step, images)

  def write_videos(self, step, videos):
    self._submit("write_videos", step, videos)

  def write_audios(self, step, audios, *, sample_rate):
    self._submit("write_audios", step, audios, sample_rate=sample_rate)

  def write_texts(self, step, texts):
    self._submit("write_texts", step, texts)

  def write_histograms(self, step, arrays, num_buckets=None):
    self._submit("write_histograms", step, arrays, num_buckets)

  def write_hparams(self, hparams):
    self._submit("write_hparams", hparams)

  def flush(self):
    try:
      self._raise_failed(wait=True)
    finally:
      for w in self._writers:
        w.flush()

  def close(self):
    try:
      self.flush()
    finally:
      for w in self._writers:
        w.close()
      for pool in self._pools:
        pool.shutdown(wait=True)


class ConsoleWriter(Writer):
  """The console part of the writer: one short line of headline scalars per scalar write.

  clu's LoggingWriter logs every scalar of a write (6 digits, sorted by name: the rank pass alone
  is 48 values) and a ``Got images: {...}`` line per picture. This writer logs only
  ``CONSOLE_KEYS`` at 4 significant digits and nothing for images, histograms, texts, ...: those
  go to TensorBoard (and scalars to metrics.jsonl) only.
  """

  def write_scalars(self, step, scalars):
    line = console_line(scalars)
    if line:
      logging.info("[%d] %s", step, line)

  def flush(self):
    logging.flush()

  def close(self):
    self.flush()


class JsonlWriter(Writer):
  """Appends scalars to ``workdir/metrics.jsonl``; other summaries are left to TensorBoard.

  On local disk the file is opened for appending, line-buffered, so a run in progress can be read
  back (study --report_only, plots) at any time. Object stores have no append: there the file is
  read once (a resumed run continues it) and rewritten whole at every write, which keeps the same
  guarantee at the cost of one small upload per log step.
  """

  def __init__(self, workdir: str):
    path = paths.resolve(workdir) / JSONL
    self._uri = paths.is_uri(path)
    self._path = path
    if self._uri:
      self._lines = path.read_text().splitlines(keepends=True) if path.exists() else []
      self._file = None
    else:
      path.parent.mkdir(parents=True, exist_ok=True)
      self._file = open(path, "a", encoding="utf-8", buffering=1)

  def write_scalars(self, step, scalars):
    row = {"step": int(step)}
    for k, v in scalars.items():
      v = float(v)
      row[k] = v if math.isfinite(v) else str(v)  # JSON has no NaN/inf
    line = json.dumps(row) + "\n"
    if self._uri:
      self._lines.append(line)
      self._path.write_text("".join(self._lines))
    else:
      self._file.write(line)

  def flush(self):
    if self._file is not None:
      self._file.flush()

  def close(self):
    if self._file is not None:
      self._file.close()


def read_rows(workdir: str) -> List[dict]:
  """Every write of ``metrics.jsonl`` in order (``[]`` without the file); a line cut by a crash
  is skipped."""
  path = paths.resolve(workdir) / JSONL
  if not path.exists():
    return []
  rows = []
  with path.open("r") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return rows


def read_scalars(workdir: str, key: str) -> List[Tuple[int, float]]:
  """``[(step, value)]`` of one scalar from ``metrics.jsonl``, the last write winning per step."""
  by_step = {row["step"]: float(row[key]) for row in read_rows(workdir) if key in row}
  return sorted(by_step.items())


def make_writer(workdir: str, is_main: bool, tensorboard: bool = True) -> AsyncMultiWriter:
  """TensorBoard events (scalars and images; ``tensorboard``) and metrics.jsonl in ``workdir`` (main
  process only) plus one short console line per scalar write (no images), asynchronously.

  TensorBoard's writer goes through TensorFlow's own file system, whose GCS client always talks to
  storage.googleapis.com; ``tensorboard=False`` (``--config.tensorboard=false``) leaves it out, e.g.
  for a workdir on an S3 store or a GCS emulator, and TensorFlow is then never imported.
  """
  writers = [ConsoleWriter()]
  if is_main:
    writers.append(JsonlWriter(workdir))
    if tensorboard:
      # Imports TensorFlow (clu.metric_writers' __init__ does, whichever submodule is asked for).
      from clu.metric_writers import SummaryWriter  # pylint: disable=import-outside-toplevel
      writers.append(SummaryWriter(workdir))
  return AsyncMultiWriter(writers)
