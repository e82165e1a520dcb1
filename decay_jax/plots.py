"""Figure helpers shared by reports and studies: headless matplotlib, one way to label and save."""

from __future__ import annotations

import contextlib
import io
from typing import Optional, Tuple

from decay_jax import paths


@contextlib.contextmanager
def figure(path: str, rows: int = 1, cols: int = 1, size: Tuple[float, float] = (10, 3.8),
           dpi: int = 120, **subplots_kw):
  """Yields ``(fig, axes)`` with ``axes`` always a (rows, cols) array; writes the PNG ``path`` when
  the block ends without an exception, and always frees the figure."""
  import matplotlib
  matplotlib.use("Agg")  # no display on servers and in CI
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False, **subplots_kw)
  try:
    yield fig, axes
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    paths.write_bytes(path, buf.getvalue())  # local or gs://
  finally:
    plt.close(fig)


def style(ax, title: Optional[str] = None, xlabel: Optional[str] = None,
          ylabel: Optional[str] = None, legend: Optional[float] = None,
          title_size: Optional[float] = None, which: str = "major") -> None:
  """Title, axis labels, a light grid and (``legend`` = font size) a legend."""
  if title:
    ax.set_title(title, fontsize=title_size)
  if xlabel:
    ax.set_xlabel(xlabel)
  if ylabel:
    ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3, which=which)
  if legend:
    ax.legend(fontsize=legend)
