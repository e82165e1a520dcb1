"""Metric writers: everything to TensorBoard, a compact line to the console (clu writers)."""

from __future__ import annotations

from clu import metric_writers

CONSOLE_KEYS = ("loss", "lr", "grad_norm", "examples_per_sec", "model_tflops_per_sec_per_device",
                "mfu", "knn/top1", "knn/top5", "steps_per_sec")


class ConsoleWriter(metric_writers.LoggingWriter):
  """Logs only the headline scalars; per-block curves (keys with '/') stay in TensorBoard."""

  def write_scalars(self, step, scalars):
    kept = {k: v for k, v in scalars.items() if k in CONSOLE_KEYS}
    if kept:
      super().write_scalars(step, kept)


def make_writer(workdir: str, is_main: bool) -> metric_writers.MetricWriter:
  """TensorBoard events in ``workdir`` (main process only) plus console lines, asynchronously."""
  writers = [ConsoleWriter()]
  if is_main:
    writers.append(metric_writers.SummaryWriter(workdir))
  return metric_writers.AsyncMultiWriter(writers)
