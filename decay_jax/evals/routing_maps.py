"""Routing weights of a routed SiT per time bin: the heat-map training draws, from a checkpoint.

Training draws the mean routing weights of every routed sublayer next to its samples
(``train.tasks.sit.routing_picture``: rows = sublayers, columns = candidates ``x, x0, x1, ...``,
one panel per time). Here the same weights (``models.routing.weights_from_state``) are measured on
evaluation images for ``bins`` equal bins of SiT's time ``t`` in [0, 1] (t = 1 data): each image
of each bin is noised with the run's transport path at a time drawn uniformly in the bin (a seeded
draw; the noise from the image's fingerprint, ``diffusion_probe.fingerprint_keys``), with its own
label, and the weights are averaged over the tokens and the images of the bin.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import validate
from decay_jax.data import on_device, pipeline
from decay_jax.diffusion import transport as transport_lib
from decay_jax.evals import diffusion_probe
from decay_jax.models import routing

DEFAULTS = {"bins": 4, "images": 256, "batch": 128, "seed": 0}


def check_settings(bins: int, images: int) -> None:
  validate.check_int("routing_bins", bins, 1)
  validate.check_int("routing_images", images, 1)


def bin_edges(bins: int) -> List[List[float]]:
  """``[[lo, hi], ...]`` of ``bins`` equal bins of [0, 1]."""
  edges = np.linspace(0.0, 1.0, bins + 1)
  return [[float(edges[i]), float(edges[i + 1])] for i in range(bins)]


def routing_section(model, params, arrays: Dict[str, np.ndarray], data_cfg, transport_cfg,
                    bins: int = DEFAULTS["bins"], batch: int = DEFAULTS["batch"],
                    seed: int = DEFAULTS["seed"]) -> Dict[str, object]:
  """The JSON section: per bin ``{'t': [lo, hi], 'rows': [{'sublayer', 'candidates', 'weights'}]}``.

  Args:
    model: a ``SiT`` with ``residual_routing`` in ``routing.ROUTED`` (not the probe view).
    params: its parameters.
    arrays: ``{'image': (N, H, W, C), 'label': (N,)}`` (``evaluators.load_split``).
    data_cfg: the data config of the images (their normalisation).
    transport_cfg: the run's ``config.transport`` (its path).
  """
  if getattr(model, "residual_routing", "none") not in routing.ROUTED:
    raise ValueError("--evals=routing is not allowed on this model; it needs a SiT run with "
                     f"residual_routing in {', '.join(routing.ROUTED)}")
  transport = transport_lib.Transport(**dict(transport_cfg))
  cfg = data_cfg.copy_and_resolve_references()

  @jax.jit
  def state(p, images, t, y):
    mean, std = pipeline.normalization(cfg, images.shape[-1])
    x1 = on_device.to_model_input(images, mean, std).astype(jnp.float32)
    eps = jax.vmap(lambda k: jax.random.normal(k, x1.shape[1:]))(
        diffusion_probe.fingerprint_keys(x1))
    _, xt, _ = transport.plan(x1, eps, t)
    return model.apply({"params": p}, xt, t, y, mutable=["intermediates"])[1]

  images, labels = arrays["image"], np.asarray(arrays["label"], np.int32)
  n = images.shape[0]
  rng = np.random.default_rng(seed)
  out = []
  for lo, hi in bin_edges(bins):
    times = rng.uniform(lo, hi, size=n).astype(np.float32)
    total = None
    for start in range(0, n, batch):
      sl = slice(start, start + batch)
      rows = routing.weights_from_state(model, state(params, images[sl], times[sl], labels[sl]))
      count = min(batch, n - start)
      weighted = [count * np.asarray(w, np.float64) for _, _, w in rows]
      total = weighted if total is None else [a + b for a, b in zip(total, weighted)]
    out.append({"t": [lo, hi], "rows": [
        {"sublayer": label, "candidates": list(cols), "weights": (w / n).tolist()}
        for (label, cols, _), w in zip(rows, total)]})
  return {"bins": out, "num_images": int(n), "variant": model.residual_routing,
          "decay": model.routing_decay, "alpha_min": float(model.residual.alpha_min)}


def panels(section: Dict[str, object]) -> Sequence:
  """``plots.weight_heatmap`` panels of a section: one per bin."""
  return [(f"t in [{b['t'][0]:.2f}, {b['t'][1]:.2f})",
           [(r["sublayer"], r["candidates"], np.asarray(r["weights"])) for r in b["rows"]])
          for b in section["bins"]]
