"""Figure helpers shared by reports and studies: headless matplotlib, one way to label and save;
image grids of uint8 pictures (training pictures, samples)."""

from __future__ import annotations

import contextlib
import io
from typing import Optional, Tuple

import numpy as np

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


def to_uint8(images, mean, std) -> np.ndarray:
  """Normalised ``(N, H, W, C)`` -> uint8 RGB for pictures (grey images get 3 channels)."""
  x = np.asarray(images, np.float32) * np.asarray(std) + np.asarray(mean)
  x = np.clip(np.round(x * 255.0), 0, 255).astype(np.uint8)
  return np.repeat(x, 3, axis=-1) if x.shape[-1] == 1 else x


def image_grid(rows, pad: int = 2) -> np.ndarray:
  """Rows of equally sized uint8 images ``[(N, H, W, 3), ...]`` -> one ``(R*(H+pad), N*(W+pad), 3)``
  on white."""
  r, (n, h, w, c) = len(rows), rows[0].shape
  out = np.full((r * (h + pad) + pad, n * (w + pad) + pad, c), 255, np.uint8)
  for i, row in enumerate(rows):
    for j, im in enumerate(row):
      out[pad + i * (h + pad):pad + i * (h + pad) + h, pad + j * (w + pad):pad + j * (w + pad) + w] = im
  return out


def weight_heatmap(panels, title: str = "") -> np.ndarray:
  """uint8 RGB picture of weights over candidates (the routing weights of
  ``models.routing.routing_weights``): one panel per ``(panel title, [(row label, candidate
  labels, weights)])``; rows are sublayers, columns the candidates any row uses ("x", "x0", "x1",
  ..., "null"), blank where not a candidate."""
  import matplotlib
  matplotlib.use("Agg")  # no display on servers and in CI
  import matplotlib.pyplot as plt
  from PIL import Image

  rows = panels[0][1]
  cols = []
  for _, c, _ in rows:
    cols += [k for k in c if k not in cols]
  order = {"x": -2, "null": 10 ** 6}
  cols.sort(key=lambda k: order.get(k, int(k[1:]) if k[1:].isdigit() else 0))
  fig, axes = plt.subplots(1, len(panels), figsize=(1.2 + 0.42 * len(cols) * len(panels),
                                                    1.4 + 0.26 * len(rows)), squeeze=False)
  for p, (ax, (ptitle, weights)) in enumerate(zip(axes[0], panels)):
    mat = np.full((len(rows), len(cols)), np.nan)
    for r, (_, c, w) in enumerate(weights):
      for k, v in zip(c, w):
        mat[r, cols.index(k)] = v
    im = ax.imshow(mat, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(cols)), cols, fontsize=7, rotation=90 if len(cols) > 12 else 0)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows] if p == 0 else [], fontsize=7)
    ax.set_title(ptitle, fontsize=8)
    if len(cols) <= 16:
      for (r, k), v in np.ndenumerate(mat):
        if np.isfinite(v):
          ax.text(k, r, f"{v:.2f}", ha="center", va="center", fontsize=5,
                  color="white" if v < 0.6 else "black")
  fig.colorbar(im, ax=axes[0].tolist(), fraction=0.03)
  if title:
    fig.suptitle(title, fontsize=9)
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
  plt.close(fig)
  return np.asarray(Image.open(buf).convert("RGB"))


def side_by_side(left: np.ndarray, right: np.ndarray, pad: int = 8) -> np.ndarray:
  """Two uint8 pictures in one, the left one enlarged (nearest) towards the right one's height."""
  scale = max(1, right.shape[0] // left.shape[0])
  left = np.repeat(np.repeat(left, scale, axis=0), scale, axis=1)
  h = max(left.shape[0], right.shape[0])
  canvas = np.full((h, left.shape[1] + pad + right.shape[1], 3), 255, np.uint8)
  canvas[:left.shape[0], :left.shape[1]] = left
  canvas[:right.shape[0], left.shape[1] + pad:] = right
  return canvas


def save_picture(path: str, picture: np.ndarray) -> None:
  """Writes a uint8 RGB picture ``(H, W, 3)`` as the PNG ``path`` (local or gs://)."""
  from PIL import Image
  buf = io.BytesIO()
  Image.fromarray(np.asarray(picture, np.uint8)).save(buf, format="PNG")
  paths.write_bytes(path, buf.getvalue())


def matrix_panels(path: str, panels, title: str = "", vmin: float = 0.0,
                  vmax: float = 1.0) -> None:
  """Heat-maps of matrices side by side, written to the PNG ``path`` (the CKA maps of
  ``decay_jax.evals.cka``): ``panels`` is ``[(panel title, matrix (R, C), row labels, column
  labels, row axis name, column axis name)]``; row 0 at the bottom, values written in the cells
  of small matrices."""
  cols = min(len(panels), 3)
  rows = -(-len(panels) // cols)
  with figure(path, rows, cols, size=(4.2 * cols, 3.8 * rows)) as (fig, axes):
    im = None
    for ax, (ptitle, mat, rlabels, clabels, rname, cname) in zip(axes.flat, panels):
      mat = np.asarray(mat, np.float64)
      im = ax.imshow(mat, vmin=vmin, vmax=vmax, cmap="magma", origin="lower", aspect="auto")
      ax.set_xticks(range(len(clabels)), clabels, fontsize=7)
      ax.set_yticks(range(len(rlabels)), rlabels, fontsize=7)
      ax.set_xlabel(cname, fontsize=8)
      ax.set_ylabel(rname, fontsize=8)
      ax.set_title(ptitle, fontsize=9)
      if mat.size <= 256:
        for (r, c), v in np.ndenumerate(mat):
          ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=5,
                  color="white" if v < 0.6 else "black")
    for ax in list(axes.flat)[len(panels):]:
      ax.axis("off")
    if im is not None:
      fig.colorbar(im, ax=axes.ravel().tolist(), fraction=0.03)
    if title:
      fig.suptitle(title, fontsize=10)


def label_colours(labels, ignore: int = 255) -> np.ndarray:
  """Integer label maps ``(..., H, W)`` -> uint8 RGB ``(..., H, W, 3)`` (tab20 colours, label
  ``ignore`` grey): segmentation masks and predictions."""
  import matplotlib
  palette = np.round(np.asarray(matplotlib.colormaps["tab20"].colors) * 255).astype(np.uint8)
  labels = np.asarray(labels)
  out = palette[np.where(labels == ignore, 0, labels) % len(palette)]
  out[labels == ignore] = 128
  return out


def enlarge(picture: np.ndarray, scale: int) -> np.ndarray:
  """A uint8 picture ``(H, W, C)`` enlarged ``scale`` times (nearest)."""
  return np.repeat(np.repeat(picture, scale, axis=0), scale, axis=1)
