"""Deep spectral segmentation (Melas-Kyriazi et al., CVPR 2022) in numpy, scipy and scikit-learn.

Each step follows ``lukemelas/deep-spectral-segmentation`` (read for this module; the function
named in brackets); docs/segmentation.md lists every choice and where ours differs:

``laplacian_eigs``   per image: L2-normalised patch features ``f``, ``W = f f^T`` with negatives
                     zeroed, divided by its maximum, plus ``lam`` times the colour KNN affinity of
                     the image at patch resolution; ``D = diag(W 1)`` (sums below 1e-12 set to 1);
                     the ``K`` eigenvectors of ``(D - W) v = mu D v`` nearest 0 by
                     ``eigsh(D - W, k=K, sigma=0, which='LM', M=D)`` (``which='SM'`` if that
                     fails; up to ``DENSE_MAX`` patches, or where that fails, the dense
                     ``scipy.linalg.eigh`` of the same pencil); every eigenvector whose share of positive entries lies in (0.5, 1)
                     is negated (``extract.py: _extract_eig``).
``knn_affinity``     the colour affinity: for (r, g, b, 2.0 x, 2.0 y) 20 nearest neighbours and for
                     (r, g, b, 0.1 x, 0.1 y) 10, symmetric 0/1 entries summed
                     (``extract_utils.py: knn_affinity``; scipy's kd-tree in place of pymatting's).
``image_segments``   KMeans of eigenvectors 1..K-1 into ``n_segments`` per image; the segment with
                     the most border patches becomes segment 0, the background
                     (``_extract_multi_region_segmentations``, ``get_border_fraction``).
``segment_boxes``    the reference's segment features come from crops: each segment's mask eroded
                     ``erode`` and dilated ``dilate`` times (a 3x3 cross; an erosion that would
                     empty it is skipped; erosion treats outside the map as inside, as skimage's
                     ``binary_erosion``), its bounding box in patches (``extract.py: _extract_bbox``,
                     ``extract_utils.erode_or_dilate_mask``).
``cluster``          the segments' L2-normalised features over the dataset by MiniBatchKMeans
                     (batch 4096, max_iter 5000, ``random_state`` seed; ``extract_bbox_clusters``).
``match``, ``miou``  pooled valid pixels, the IoU matrix of predicted labels and classes, Hungarian
                     matching (``linear_sum_assignment(N - IoU)``) when there are as many labels as
                     classes, else each label to its highest-IoU class; per-class IoU
                     ``tp / max(tp + fp + fn, 1e-8)`` and their mean over all classes
                     (``semantic-segmentation/eval.py: evaluate``, ``eval_utils.py``).
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence, Tuple

import numpy as np
import scipy.linalg
import scipy.sparse
from scipy.sparse.csgraph import connected_components
from scipy.optimize import linear_sum_assignment
from scipy.sparse.linalg import eigsh
from scipy.spatial import cKDTree

KNN_NEIGHBOURS = (20, 10)  # extract_utils.knn_affinity defaults
KNN_DISTANCE_WEIGHTS = (2.0, 0.1)
MINIBATCH_SIZE = 4096  # extract_bbox_clusters
MINIBATCH_MAX_ITER = 5000
DENSE_MAX = 1024  # patches per image solved by the dense generalised eigensolver (laplacian_eigs)


def l2_normalise(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
  """Rows of ``x`` divided by their norm (``F.normalize(p=2, dim=-1)``: eps 1e-12)."""
  x = np.asarray(x, np.float64)
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def knn_affinity(image: np.ndarray, n_neighbors: Sequence[int] = KNN_NEIGHBOURS,
                 distance_weights: Sequence[float] = KNN_DISTANCE_WEIGHTS) -> np.ndarray:
  """Dense ``(h w, h w)`` colour affinity of an ``(h, w, c)`` image in [0, 1] (grey: c = 1, the
  value repeated as r, g, b)."""
  h, w = image.shape[:2]
  rgb = np.broadcast_to(image.reshape(h * w, -1), (h * w, 3)) if image.shape[-1] == 1 else \
      image.reshape(h * w, 3)
  n = h * w
  x, y = np.tile(np.linspace(0, 1, w), h), np.repeat(np.linspace(0, 1, h), w)
  out = np.zeros((n, n), np.float64)
  for k, weight in zip(n_neighbors, distance_weights):
    f = np.concatenate([rgb, weight * x[:, None], weight * y[:, None]], axis=1)
    k = min(k, n)
    _, neighbours = cKDTree(f).query(f, k=k)
    i = np.repeat(np.arange(n), k)
    j = neighbours.reshape(-1)
    np.add.at(out, (i, j), 1.0)  # csr_matrix((ones, (ij, ji))) sums duplicates
    np.add.at(out, (j, i), 1.0)
  return out


def laplacian_eigs(feats: np.ndarray, k: int, image_lr: Optional[np.ndarray] = None,
                   lam: float = 0.0) -> Tuple[np.ndarray, np.ndarray]:
  """``(eigenvalues (K,), eigenvectors (K, P))`` of one image's patch features ``(P, D)``."""
  f = l2_normalise(feats)
  w = f @ f.T
  w = w * (w > 0)
  w = w / w.max() if w.max() > 0 else w
  if lam > 0 and image_lr is not None:
    w = w + lam * knn_affinity(image_lr)
  d = w.sum(axis=1)
  d[d < 1e-12] = 1.0  # extract_utils.get_diagonal
  dm = scipy.sparse.diags(d)
  lap = np.diag(d) - w
  k = min(k, w.shape[0] - 1)
  values = None
  # Up to DENSE_MAX patches the dense solver gives the same eigenpairs exactly and at once: the
  # reference's sparse shift-invert at sigma = 0 factorises the singular D - W, which LAPACK
  # reports on stderr (DLASCL) for many images before the fallback below solves it densely anyway.
  if w.shape[0] > DENSE_MAX and connected_components(scipy.sparse.csr_matrix(w > 0),
                                                     directed=False)[0] == 1:
    try:
      with warnings.catch_warnings():  # L is singular by construction (the constant vector)
        warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
        values, vectors = eigsh(lap, k=k, sigma=0, which="LM", M=dm)
    except Exception:  # the reference's fallback (a singular shift-invert factorisation)
      try:
        values, vectors = eigsh(lap, k=k, which="SM", M=dm)
      except Exception:
        values = None
  if values is None or not (np.all(np.isfinite(values)) and np.all(np.isfinite(vectors))):
    # A disconnected graph (exactly block-diagonal W, e.g. one-hot features) makes the
    # shift-invert factorisation exactly singular: the same problem, solved densely.
    values, vectors = scipy.linalg.eigh(lap, np.diag(d), subset_by_index=[0, k - 1])
  order = np.argsort(values)
  values, vectors = values[order], vectors[:, order].T
  for i in range(vectors.shape[0]):  # sign ambiguity
    if 0.5 < np.mean(vectors[i] > 0) < 1.0:
      vectors[i] = -vectors[i]
  return values, vectors


def border_fraction(segmap: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """Segment ids and their share of the border cells (corners counted twice, as the reference)."""
  counts = {int(i): 0 for i in np.unique(segmap)}
  for border in (segmap[:, 0], segmap[:, -1], segmap[0, :], segmap[-1, :]):
    for idx, count in zip(*np.unique(border, return_counts=True)):
      counts[int(idx)] += int(count)
  return np.array(list(counts)), np.array(list(counts.values())) / (2 * sum(segmap.shape))


def _kmeans(points: np.ndarray, n: int, seed: int) -> np.ndarray:
  from sklearn.cluster import KMeans
  n = min(n, len(np.unique(points, axis=0)))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return KMeans(n_clusters=max(n, 1), random_state=seed, n_init="auto").fit_predict(points)


def image_segments(eigvecs: np.ndarray, grid: Tuple[int, int], n_segments: int,
                   background: bool = True, seed: int = 0) -> np.ndarray:
  """``(h, w)`` segment ids from the eigenvectors ``(K, h w)``; with ``background`` the segment
  touching the border most is 0."""
  seg = _kmeans(eigvecs[1:].T, n_segments, seed).reshape(grid)
  if background:
    ids, fractions = border_fraction(seg)
    bg = ids[np.argmax(fractions)]
    seg = np.where(seg == bg, 0, np.where(seg == 0, bg, seg))
  return seg


def segment_features(feats: np.ndarray, seg: np.ndarray, skip_background: bool):
  """``(segment ids, (S, D) mean L2-normalised patch feature per segment)``."""
  f, flat = l2_normalise(feats), seg.reshape(-1)
  ids = [int(i) for i in np.unique(flat) if not (skip_background and i == 0)]
  return ids, np.stack([f[flat == i].mean(0) for i in ids]) if ids else np.zeros((0, f.shape[1]))


def _morph(mask: np.ndarray, times: int, erode: bool) -> np.ndarray:
  """``extract_utils.erode_or_dilate_mask``: ``times`` steps, a step that empties the mask skipped."""
  import scipy.ndimage as ndi
  cross = ndi.generate_binary_structure(2, 1)
  for _ in range(times):
    new = (ndi.binary_erosion(mask, cross, border_value=1) if erode else
           ndi.binary_dilation(mask, cross, border_value=0))
    if new.sum() > 0:
      mask = new
  return mask


def segment_boxes(seg: np.ndarray, skip_background: bool, erode: int = 2,
                  dilate: int = 3) -> Tuple[list, list]:
  """``(segment ids, boxes)`` of a patch-level segment map ``seg (h, w)``: per segment (0 left
  out with ``skip_background``) the bounding box ``(ymin, xmin, ymax, xmax)`` (max exclusive) of
  its mask eroded ``erode`` then dilated ``dilate`` times (``extract.py: _extract_bbox``)."""
  ids, boxes = [], []
  for i in np.unique(seg):
    if skip_background and i == 0:
      continue
    mask = _morph(_morph(seg == i, erode, True), dilate, False)
    ys, xs = np.nonzero(mask)
    ids.append(int(i))
    boxes.append((int(ys.min()), int(xs.min()), int(ys.max()) + 1, int(xs.max()) + 1))
  return ids, boxes


def cluster(features: np.ndarray, n_clusters: int, seed: int = 0) -> np.ndarray:
  """Cluster id per row of ``features`` (L2-normalised first) by MiniBatchKMeans."""
  from sklearn.cluster import MiniBatchKMeans
  x = l2_normalise(features)
  n = min(n_clusters, len(np.unique(x, axis=0)))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return MiniBatchKMeans(n_clusters=n, batch_size=MINIBATCH_SIZE, max_iter=MINIBATCH_MAX_ITER,
                           random_state=seed, n_init="auto").fit_predict(x)


def iou_matrix(preds: np.ndarray, targets: np.ndarray, n_preds: int, n_classes: int) -> np.ndarray:
  """``(n_preds, n_classes)`` IoU of predicted label p and class t over the given pixels."""
  joint = np.bincount(preds.astype(np.int64) * n_classes + targets.astype(np.int64),
                      minlength=n_preds * n_classes).reshape(n_preds, n_classes).astype(np.float64)
  union = joint.sum(1, keepdims=True) + joint.sum(0, keepdims=True) - joint
  return joint / np.maximum(union, 1e-8)


def match(preds: np.ndarray, targets: np.ndarray, n_preds: int, n_classes: int) -> np.ndarray:
  """Class of every predicted label ``(n_preds,)``: Hungarian on the IoU matrix when
  ``n_preds == n_classes``, otherwise majority vote (highest IoU)."""
  iou = iou_matrix(preds, targets, n_preds, n_classes)
  if n_preds == n_classes:
    rows, cols = linear_sum_assignment(targets.shape[0] - iou)
    out = np.zeros(n_preds, np.int64)
    out[rows] = cols
    return out
  return np.argmax(iou, axis=1)


def miou(preds: np.ndarray, masks: np.ndarray, n_preds: int, n_classes: int,
         ignore: int = 255) -> dict:
  """mIoU of predicted label maps against class masks (same shapes), pixels pooled over the set
  and ``ignore`` pixels dropped: ``{"miou", "iou" (per class), "matching", "pixels"}``."""
  valid = masks != ignore
  p, t = preds[valid].astype(np.int64), masks[valid].astype(np.int64)
  mapping = match(p, t, n_preds, n_classes)
  mapped = mapping[p]
  tp = np.bincount(t[mapped == t], minlength=n_classes).astype(np.float64)
  fp = np.bincount(mapped, minlength=n_classes) - tp
  fn = np.bincount(t, minlength=n_classes) - tp
  iou = tp / np.maximum(tp + fp + fn, 1e-8)
  return {"miou": float(np.mean(iou)), "iou": iou.tolist(), "matching": mapping.tolist(),
          "pixels": int(valid.sum())}
