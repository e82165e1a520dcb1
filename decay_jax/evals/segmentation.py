"""Unsupervised semantic segmentation by deep spectral methods (``--evals=segmentation``).

The frozen MAE encoder's patch tokens of one block (default: the last) for every image of a
segmentation set (``data.segmentation``: a folder of images and PNG masks, or the synthetic set),
then the steps of ``evals.spectral`` (Melas-Kyriazi et al., CVPR 2022; docs/segmentation.md):
per image the eigenvectors of the feature affinity's Laplacian, segments by KMeans of them, the
border rule for the background; over the set the segments' features in ``clusters`` clusters,
each predicted label matched to a class, mIoU over the pooled pixels.

Patch labels become pixel labels by repeating each over its ``patch x patch`` pixels; the masks
are at the model's input size (``data.segmentation`` resizes them).
"""

from __future__ import annotations

from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import validate
from decay_jax.data import augment
from decay_jax.data import segmentation as seg_data
from decay_jax.evals import features, spectral

FEATURES = ("tokens", "keys")
SEGMENT_FEATURES = ("mean", "crop")
DEFAULTS = dict(data=seg_data.SYNTHETIC, images=200, block=-1, feature="tokens", eigs=5,
                segments=4, segment_feature="mean", erode=2, dilate=3, clusters=0,
                lam=0.0, background=True, classes=0, ignore=seg_data.IGNORE, seed=0, batch=256)
PICTURE_IMAGES = 8


def check_settings(s: Dict) -> Dict:
  """The settings (``DEFAULTS`` keys, the ``--seg_*`` flags) checked; returns a full copy."""
  s = dict(DEFAULTS, **s)
  validate.check_int("seg_images", s["images"], 1 if s["data"] == seg_data.SYNTHETIC else 0)
  validate.check_choice("seg_feature", s["feature"], FEATURES)
  validate.check_choice("seg_segment_feature", s["segment_feature"], SEGMENT_FEATURES)
  validate.check_int("seg_erode", s["erode"], 0)
  validate.check_int("seg_dilate", s["dilate"], 0)
  validate.check_int("seg_eigs", s["eigs"], 2)
  validate.check_int("seg_segments", s["segments"], 1)
  validate.check_int("seg_clusters", s["clusters"], 0)
  validate.check_int("seg_classes", s["classes"], 0)
  validate.check_int("seg_ignore", s["ignore"], 0, 255)
  validate.check_int("seg_batch", s["batch"], 1)
  validate.check_range("seg_lambda", s["lam"], 0.0)
  if s["data"] == seg_data.SYNTHETIC and s["classes"] > seg_data.MAX_SYNTHETIC_CLASSES:
    raise validate.not_allowed("seg_classes", s["classes"], "the synthetic set has at most "
                               f"{seg_data.MAX_SYNTHETIC_CLASSES} classes (background included)")
  if s["classes"] and s["ignore"] < s["classes"]:
    raise validate.not_allowed("seg_ignore", s["ignore"], f"it is one of the {s['classes']} "
                               "classes; use a label outside them (255)")
  return s


def load(s: Dict, image_size: int, channels: int, patch: int) -> Dict:
  """The images and masks of the settings' set, and ``num_classes``."""
  if s["data"] == seg_data.SYNTHETIC:
    data = seg_data.synthetic(s["images"], image_size, channels, patch, s["classes"] or 4,
                              s["seed"])
    data["num_classes"] = s["classes"] or 4
  else:
    data = seg_data.read_folder(s["data"], image_size, channels, s["images"],
                                s["classes"] or None, s["ignore"])
    labels = np.unique(data["mask"])
    data["num_classes"] = s["classes"] or int(labels[labels != s["ignore"]].max(initial=0)) + 1
  return data


def patch_features(model, params, images: np.ndarray, mesh, data_cfg, block: int,
                   batch: int, feature: str = "tokens") -> np.ndarray:
  """``(N, P, D)`` float32 patch features (cls left out) of ``block``: its output tokens, or the
  ``keys`` of its attention (heads concatenated, the reference's ``which_features='k'``)."""
  depth = features.num_blocks(model)
  validate.check_int("seg_block", block, -depth, depth - 1)
  grid = images.shape[1] // model.patch_size

  def fn(params, imgs):
    if feature == "keys":
      _, kept = model.apply({"params": params}, imgs, method=model.features, mutable=["keys"])
      (stacked,) = jax.tree_util.tree_leaves(kept["keys"])  # the scanned blocks' (depth, N, T, C)
      return stacked[block][:, -grid * grid:, :].astype(jnp.float32)
    tokens = model.apply({"params": params}, imgs, method=model.features)[block]
    return tokens[:, -grid * grid:, :]

  return features.extract(features.on_pixels(fn, data_cfg), params, images, mesh, batch)


def crop_features(model, params, images: np.ndarray, boxes, mesh, data_cfg, block: int,
                  batch: int) -> np.ndarray:
  """``(M, D)``: the cls token of ``block``'s output for each crop ``boxes[m] = (image index,
  (ymin, xmin, ymax, xmax) in patches)`` of ``images``, resized (bicubic) to the model's input
  size. The reference feeds the crop at its own size (DINO interpolates its position embeddings;
  our encoders have one input size) and takes the model's output, DINO's cls token."""
  p, size = int(model.patch_size), images.shape[1]
  crops = np.stack([augment.eval_resize_one(images[i][y0 * p:y1 * p, x0 * p:x1 * p], size, "resize")
                    for i, (y0, x0, y1, x1) in boxes])

  def fn(params, imgs):
    return model.apply({"params": params}, imgs, method=model.features)[block][:, 0]

  return features.extract(features.on_pixels(fn, data_cfg), params, crops, mesh, batch)


def segment(feats: np.ndarray, images: np.ndarray, patch: int, num_classes: int,
            s: Dict, crops=None) -> Dict:
  """Patch-level predicted labels ``(N, h, w)`` from patch features ``(N, P, D)``: per-image
  segments, then segment clusters over the set (label 0 the background with ``background``).
  A segment's feature is the mean of its patch features, or with ``segment_feature='crop'``
  ``crops(boxes)`` of its box (``crop_features`` of ``[(image index, box)]``)."""
  from PIL import Image
  n, p, _ = feats.shape
  grid = int(round(np.sqrt(p)))
  segs, seg_ids, seg_feats = [], [], []
  for i in range(n):
    image_lr = None
    if s["lam"] > 0:
      img = images[i][..., 0] if images.shape[-1] == 1 else images[i]
      small = Image.fromarray(img).resize((grid, grid), Image.BILINEAR)
      image_lr = np.asarray(small, np.float64).reshape(grid, grid, -1) / 255.0
    _, vecs = spectral.laplacian_eigs(feats[i], s["eigs"], image_lr, s["lam"])
    seg = spectral.image_segments(vecs, (grid, grid), s["segments"], s["background"],
                                  s["seed"])
    if s["segment_feature"] == "crop":
      ids, boxes = spectral.segment_boxes(seg, s["background"], s["erode"], s["dilate"])
      seg_feats += [(i, box) for box in boxes]
    else:
      ids, f = spectral.segment_features(feats[i], seg, s["background"])
      seg_feats.append(f)
    segs.append(seg)
    seg_ids.append(ids)
  offset = 1 if s["background"] else 0
  clusters = s["clusters"] or num_classes - offset
  if s["segment_feature"] == "crop":
    all_feats = crops(seg_feats) if seg_feats else np.zeros((0, 1), np.float32)
  else:
    all_feats = np.concatenate(seg_feats, axis=0)
  assigned = (spectral.cluster(all_feats, clusters, s["seed"]) if len(all_feats)
              else np.zeros(0, np.int64))
  labels, start = np.zeros((n, grid, grid), np.int64), 0
  for i, (seg, ids) in enumerate(zip(segs, seg_ids)):
    for sid, c in zip(ids, assigned[start:start + len(ids)]):
      labels[i][seg == sid] = c + offset
    start += len(ids)
  return {"labels": labels, "segments": np.stack(segs), "n_preds": clusters + offset,
          "num_segments": len(all_feats)}


def to_pixels(labels: np.ndarray, patch: int) -> np.ndarray:
  """``(N, h, w)`` patch labels -> ``(N, h patch, w patch)``."""
  return np.repeat(np.repeat(labels, patch, axis=1), patch, axis=2)


def evaluate(model, params, mesh, data_cfg, settings: Dict) -> Dict:
  """The ``segmentation`` section of a model's record, and its picture rows under ``_picture``
  (image, ground truth, segments, predicted classes, for the first images)."""
  s = check_settings(settings)
  patch, size = int(model.patch_size), int(data_cfg.image_size)
  data = load(s, size, int(model.in_chans), patch)
  num_classes = data["num_classes"]
  feats = patch_features(model, params, data["image"], mesh, data_cfg, s["block"], s["batch"],
                         s["feature"])
  crops = lambda boxes: crop_features(model, params, data["image"], boxes, mesh, data_cfg,
                                      s["block"], s["batch"])
  out = segment(feats, data["image"], patch, num_classes, s, crops)
  preds = to_pixels(out["labels"], patch)
  masks = data["mask"][:, :preds.shape[1], :preds.shape[2]]
  result = spectral.miou(preds, masks, out["n_preds"], num_classes, s["ignore"])
  k = min(PICTURE_IMAGES, len(preds))
  mapped = np.asarray(result["matching"])[preds[:k]]
  return dict(result, num_images=int(len(preds)), num_classes=num_classes,
              num_segments=out["num_segments"], n_preds=out["n_preds"],
              settings={key: s[key] for key in DEFAULTS},
              _picture={"image": data["image"][:k], "mask": masks[:k],
                        "segments": to_pixels(out["segments"][:k], patch), "pred": mapped,
                        "ignore": s["ignore"]})


def markdown(name: str, sec: Dict, png: Optional[str]) -> list:
  """Report lines of one model's section."""
  s = sec["settings"]
  what = "attention keys" if s.get("feature") == "keys" else "tokens"
  seg_feature = (f"the cls token of each segment's box (eroded {s['erode']}, dilated "
                 f"{s['dilate']}) cropped" if s.get("segment_feature") == "crop"
                 else "their mean patch feature")
  lines = [f"## Unsupervised segmentation: {name}", "",
           f"Deep spectral segmentation (docs/segmentation.md) of block {s['block']}'s patch "
           f"{what} on {sec['num_images']} images of `{s['data']}` ({sec['num_classes']} "
           f"classes, {sec['pixels']} valid pixels): K={s['eigs']} eigenvectors, "
           f"{s['segments']} segments per image, background by the border rule: "
           f"{s['background']}, segments clustered by {seg_feature}, {sec['n_preds']} "
           f"predicted labels, colour lambda {s['lam']:g}, seed {s['seed']}.", "",
           f"**mIoU {100 * sec['miou']:.2f}%**", "",
           "| class | " + " | ".join(str(i) for i in range(len(sec["iou"]))) + " |",
           "|---|" + "---:|" * len(sec["iou"]),
           "| IoU | " + " | ".join(f"{100 * v:.1f}%" for v in sec["iou"]) + " |", ""]
  if png:
    lines += [f"![segmentation of {name}]({png})", "",
              "Rows: image, ground truth (grey: ignored), segments per image (0 background), "
              "predicted classes after matching.", ""]
  return lines
