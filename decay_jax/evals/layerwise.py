"""Per-block probes: KNN and the fast linear probe on every encoder block's output.

The features of all blocks come from one forward pass (``features.pooled_fn`` with every block);
the fast linear probe then trains one head per block in one compiled program, and the weighted KNN
(``evals.knn``) runs once per block. The result is a curve over depth, summarised as the best block
against the last block: decayed shortcuts are meant to move the best representation to the end of
the encoder, whereas residual networks often peak in the middle.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import jax
import numpy as np

from decay_jax.evals import knn, linear_probe


def _best(values: Sequence[float]) -> Dict[str, float]:
  """Index (0-based block) and value of the best entry, and the last entry."""
  values = np.asarray(values, np.float64)
  i = int(np.argmax(values))
  return {"best_block": i, "best": float(values[i]), "last": float(values[-1]),
          "gap": float(values[i] - values[-1])}


def layer_curves(train: np.ndarray, train_y, test: np.ndarray, test_y, num_classes: int, *,
                 k: int = 20, temperature: float = 0.07, probe_epochs: int = 10,
                 probe_lr: float = 1e-3, probe_batch_size: int = 256, seed: int = 0,
                 heldout_fraction: float = 0.0,
                 devices: Optional[Sequence[jax.Device]] = None) -> Dict[str, object]:
  """KNN and fast-linear-probe accuracy of every block.

  With ``heldout_fraction > 0`` the block is also chosen without looking at the test set: the
  same probes are fit on the rest of the training set and scored on that held-out fraction (a
  seeded permutation); ``selected[probe]`` gives the chosen block, its held-out score and its
  test score from the curve.

  Args:
    train: (N, L, D) pooled training features of L blocks.
    train_y: (N,) labels in [0, num_classes).
    test: (M, L, D) pooled test features.
    test_y: (M,) labels.
    num_classes: C.
    k, temperature: weighted-KNN settings (``evals.knn``).
    probe_epochs, probe_lr, probe_batch_size: the fast probe (``linear_probe.fast_probe``).
    seed: the probe's permutations.
    devices: devices for the KNN search (default all local).

  Returns:
    JSON-able dict of per-block lists ``knn_top1``, ``knn_top5`` (C >= 5), ``linear_top1``,
    ``linear_top5`` (C >= 5), and summaries ``knn`` / ``linear``: ``{best_block, best, last, gap}``
    (blocks are 0-based; ``gap = best - last``).
  """
  train, test = np.asarray(train, np.float32), np.asarray(test, np.float32)
  if train.ndim != 3 or test.ndim != 3 or train.shape[1:] != test.shape[1:]:
    raise ValueError(f"train {train.shape} and test {test.shape} features must be (N, L, D) and "
                     "(M, L, D) with the same L and D")
  out: Dict[str, object] = {"knn_top1": [], "knn_top5": []}
  for layer in range(train.shape[1]):
    res = knn.knn_accuracy(train[:, layer], train_y, test[:, layer], test_y, num_classes, k=k,
                           temperature=temperature, devices=devices)
    out["knn_top1"].append(res["top1"])
    if "top5" in res:
      out["knn_top5"].append(res["top5"])
  if not out["knn_top5"]:
    del out["knn_top5"]
  probe = linear_probe.fast_probe(train, train_y, test, test_y, num_classes, epochs=probe_epochs,
                                  lr=probe_lr, batch_size=probe_batch_size, seed=seed)
  out["linear_top1"] = probe["top1"]
  if "top5" in probe:
    out["linear_top5"] = probe["top5"]
  out["knn"] = _best(out["knn_top1"])
  out["linear"] = _best(out["linear_top1"])
  if heldout_fraction > 0:
    order = np.random.default_rng(seed).permutation(train.shape[0])
    cut = train.shape[0] - max(1, int(round(heldout_fraction * train.shape[0])))
    fit, held = order[:cut], order[cut:]
    train_y = np.asarray(train_y)
    inner = layer_curves(train[fit], train_y[fit], train[held], train_y[held], num_classes, k=k,
                         temperature=temperature, probe_epochs=probe_epochs, probe_lr=probe_lr,
                         probe_batch_size=probe_batch_size, seed=seed, devices=devices)
    out["selected"] = {
        probe: {"block": inner[probe]["best_block"], "heldout": inner[probe]["best"],
                "test": out[f"{probe}_top1"][inner[probe]["best_block"]]}
        for probe in ("knn", "linear")}
    out.update(heldout_fraction=heldout_fraction, num_heldout=int(held.size))
  out.update(k=k, temperature=temperature, probe_epochs=probe_epochs, probe_lr=probe_lr,
             probe_batch_size=probe_batch_size, num_train=int(train.shape[0]),
             num_test=int(test.shape[0]))
  return out
