"""A profiler window over train steps: ``config.profile_steps = "START,COUNT"``.

Steps ``START .. START+COUNT-1`` (the trainer's step numbers; the bench's timed steps from 0) run
under ``jax.profiler``; the trace lands in ``LOGDIR/plugins/profile/<time>/``:

  ``<host>.xplane.pb``         what TensorBoard's profile plugin opens (``tensorboard --logdir=LOGDIR``),
  ``perfetto_trace.json.gz``   what https://ui.perfetto.dev opens, and what
                               ``python -m decay_jax.cli.trace_table`` reads,
  ``train_step.hlo.txt``       the compiled step's HLO, whose op metadata (the Flax module path
                               of every op) lets the table sort the trace's ops into categories.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import jax
from absl import logging

from decay_jax import paths

HLO_FILE = "train_step.hlo.txt"
TRACE_FILE = "perfetto_trace.json.gz"


def newest_run(logdir: str) -> Optional[str]:
  """The newest ``LOGDIR/plugins/profile/<time>`` directory (local or gs://), or None."""
  root = paths.resolve(logdir) / "plugins" / "profile"
  # The profiler names runs YYYY_MM_DD_HH_MM_SS, so the largest name is the newest.
  runs = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []
  return paths.join(str(root), runs[-1]) if runs else None


class StepProfiler:
  """Starts a trace before step START and stops it after step START+COUNT-1 has finished.

  ``hlo_text``: returns the compiled step's HLO text, written beside the trace. Use as::

      profiler.before(step); state, m = step_fn(state, batch); profiler.after(step, m)

  ``close()`` stops a trace still open (a run that ended or failed inside the window).
  """

  def __init__(self, steps: Optional[Tuple[int, int]], logdir: str,
               hlo_text: Callable[[], str]):
    self.steps, self.logdir, self._hlo_text = steps, logdir, hlo_text
    self.active = False
    self.run_dir: Optional[str] = None

  def before(self, step: int) -> None:
    if self.steps is not None and step == self.steps[0] and not self.active:
      jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
      self.active = True

  def after(self, step: int, outputs) -> None:
    if self.active and step >= self.steps[0] + self.steps[1] - 1:
      jax.block_until_ready(outputs)  # the window's last step is in the trace, not after it
      self.close()

  def close(self) -> None:
    if not self.active:
      return
    jax.profiler.stop_trace()
    self.active = False
    self.run_dir = newest_run(self.logdir)
    if self.run_dir is not None and jax.process_index() == 0:
      paths.write_text(paths.join(self.run_dir, HLO_FILE), self._hlo_text())
      logging.info("profile of steps %d-%d: %s (table: python -m decay_jax.cli.trace_table %s)",
                   self.steps[0], self.steps[0] + self.steps[1] - 1, self.run_dir, self.run_dir)
