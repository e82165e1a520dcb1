"""Training progress on the console: steps/s, % done and ETA about once a minute.

Our equivalent of clu's ``periodic_actions.ReportProgress`` (clu's module imports its metric
writers, hence TensorFlow), with the same rule and numbers: the first call only starts the clock;
after that a report is due when more than ``every_secs`` (60 s) have passed since the last one, and
at the last step. A report logs one line::

    progress: 2.5 steps/s, 40.0% (400/1000), ETA: 4m (3m : 12.5% eval)

and writes ``steps_per_sec`` (steps since the last report over the wall time since it) and
``uptime`` (seconds since this object was made; the study adds it up over resumes) to the writer.
As in clu, the rate and ETA are over wall time, evaluations included; ``timed(name)`` measures the
sections run inside it (evaluations) and the line shows their share of the total time.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import time
from typing import Optional

import jax
import jax.numpy as jnp
from absl import logging

EVERY_SECS = 60.0


def format_secs(secs: float) -> str:
  """``123456.7`` -> ``"1d10h17m"`` (clu's format: minutes always shown, days and hours if any)."""
  s = ""
  days = int(secs / (3600 * 24))
  secs -= days * 3600 * 24
  if days:
    s += f"{days}d"
  hours = int(secs / 3600)
  secs -= hours * 3600
  if hours:
    s += f"{hours}h"
  return s + f"{int(secs / 60)}m"


@jax.jit
def _barrier(x):
  """A tiny program queued behind everything dispatched before it (see ``timed``)."""
  return x * x


class ReportProgress:
  """Call ``report(step)`` after every training step; ``with report.timed("eval"): ...`` around
  other work whose share of the time the line should show."""

  def __init__(self, *, num_train_steps: Optional[int] = None, writer=None,
               every_secs: Optional[float] = EVERY_SECS):
    if num_train_steps is not None and num_train_steps < 0:
      num_train_steps = None
    self._num_train_steps = num_train_steps
    self._writer = writer
    self._every_secs = every_secs
    self._previous_step: Optional[int] = None
    self._previous_time: Optional[float] = None
    self._time_per_part = collections.defaultdict(float)
    self._t0 = time.monotonic()
    # One thread: the start and stop of each timed section are measured in order.
    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                           thread_name_prefix="progress")

  def __call__(self, step: int, t: Optional[float] = None) -> bool:
    """Reports if due; returns whether it did. The first call never reports."""
    t = time.monotonic() if t is None else t
    if self._previous_step is None:
      self._previous_step, self._previous_time = step, t
      return False
    if step == self._previous_step or not self._due(step, t):
      return False
    self._report(step, t)
    self._previous_step, self._previous_time = step, t
    return True

  def _due(self, step: int, t: float) -> bool:
    if self._every_secs is not None and t - self._previous_time > self._every_secs:
      return True
    return step == self._num_train_steps

  def message(self, step: int, t: float) -> str:
    """The line's text (without ``progress: ``) for a report at ``step``, time ``t``."""
    steps_per_sec = (step - self._previous_step) / (t - self._previous_time)
    message = f"{steps_per_sec:.1f} steps/s"
    if self._num_train_steps:
      eta_seconds = (self._num_train_steps - step) / steps_per_sec
      message += (f", {100 * step / self._num_train_steps:.1f}% ({step}/{self._num_train_steps}), "
                  f"ETA: {format_secs(eta_seconds)}")
    if self._time_per_part:
      total = time.monotonic() - self._t0
      message += " ({} : {})".format(format_secs(total), ", ".join(
          f"{100 * dt / total:.1f}% {name}" for name, dt in sorted(self._time_per_part.items())))
    return message

  def _report(self, step: int, t: float):
    logging.info("progress: %s", self.message(step, t))
    if self._writer is not None:
      steps_per_sec = (step - self._previous_step) / (t - self._previous_time)
      self._writer.write_scalars(step, {"steps_per_sec": steps_per_sec,
                                        "uptime": time.monotonic() - self._t0})

  @contextlib.contextmanager
  def timed(self, name: str, wait_jax_async_dispatch: bool = True):
    """Adds the time of the block to the part ``name``.

    With ``wait_jax_async_dispatch`` (clu's default), the time is that of the device work: a tiny
    program is queued before the block and another after it, and a background thread takes the
    time at which each has finished; so the block's time starts when the last step before it is
    done and ends when the last computation it dispatched is, and the loop is never blocked.
    Without, the Python wall time of the block.
    """
    if not wait_jax_async_dispatch:
      start = time.monotonic()
      yield
      self._time_per_part[name] += time.monotonic() - start
      return

    def start_measurement(barrier) -> float:
      barrier.block_until_ready()
      return time.monotonic()

    def stop_measurement(start: concurrent.futures.Future, barrier):
      barrier.block_until_ready()
      self._time_per_part[name] += time.monotonic() - start.result()

    started = self._executor.submit(start_measurement, _barrier(jnp.array(0.0)))
    yield
    self._executor.submit(stop_measurement, started, _barrier(jnp.array(0.0)))
