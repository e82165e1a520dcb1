"""Metric writers: everything to TensorBoard and ``metrics.jsonl``, a compact line to the console.

``metrics.jsonl`` holds one JSON object per write, ``{"step": int, <scalar name>: float, ...}``,
appended across resumes, so curves (loss, KNN accuracy over training) can be read back without
TensorBoard: ``read_scalars(workdir, key)``.
"""

from __future__ import annotations

import json
import math
from typing import List, Tuple

from absl import logging
from clu import metric_writers

from decay_jax import paths

# The console line of a write, in this order; the rest (per-block curves, evaluations: each
# evaluation logs its own summary line, see train.evaluation) is in TensorBoard and metrics.jsonl.
CONSOLE_KEYS = ("loss", "lr", "grad_norm", "examples_per_sec", "model_tflops_per_sec_per_device",
                "mfu", "steps_per_sec")
JSONL = "metrics.jsonl"


def console_line(scalars, keys=CONSOLE_KEYS) -> str:
  """``loss=0.4736, lr=0.000475, ...``: the ``keys`` present, in that order, at 4 digits."""
  return ", ".join(f"{k}={float(scalars[k]):.4g}" for k in keys if k in scalars)


class _ScalarsOnly(metric_writers.MetricWriter):
  """A writer of scalars only: every other kind of summary is TensorBoard's alone."""

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


class ConsoleWriter(_ScalarsOnly):
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


class JsonlWriter(_ScalarsOnly):
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


def make_writer(workdir: str, is_main: bool, tensorboard: bool = True
                ) -> metric_writers.MetricWriter:
  """TensorBoard events (scalars and images; ``tensorboard``) and metrics.jsonl in ``workdir`` (main
  process only) plus one short console line per scalar write (no images), asynchronously.

  TensorBoard's writer goes through TensorFlow's own file system, whose GCS client always talks to
  storage.googleapis.com; ``tensorboard=False`` (``--config.tensorboard=false``) leaves it out, e.g.
  for a workdir on an S3 store or a GCS emulator.
  """
  writers = [ConsoleWriter()]
  if is_main:
    writers.append(JsonlWriter(workdir))
    if tensorboard:
      writers.append(metric_writers.SummaryWriter(workdir))
  return metric_writers.AsyncMultiWriter(writers)
