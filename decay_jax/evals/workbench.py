"""The evaluation workbench of ``decay_jax.cli.evaluate``: ablated models, CKA maps, routing maps.

``Workbench`` runs, for each model the command loads, the evaluators of ``evals.registry`` (through
``suite.evaluate_model``) and the workbench's own:

  ``cka``      minibatch CKA between every pair of blocks of the model (``evals.cka``); with
               several models (ablations included) also between the blocks of every pair of them
               evaluated on the same images
  ``routing``  the routing weights of a routed SiT per bin of time (``evals.routing_maps``)
  ``segmentation`` unsupervised segmentation by deep spectral methods (``evals.segmentation``)

and, with ``ablate``, the same evaluators on every ablation of the model (``evals.ablation``),
each one more record named ``NAME[entry]``. ``finish`` writes the workbench's plots and returns the
Markdown and JSON that ``report.write`` adds to the report.

SiT runs are read through their probe view (``evals.sit_probe``: block outputs at noise level
``probe_t``); their evaluators are cka and routing, and the probes when ``--config`` gives their
``config.evals`` sections.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import numpy as np
from absl import logging

from decay_jax import paths, plots, validate
from decay_jax.evals import (ablation, cka, diffusion_probe, evaluators, registry, report,
                             routing_maps, segmentation, sit_probe, suite)
from decay_jax.models import factory, routing
from decay_jax.models import sit as sit_lib

EVALS = ("cka", "routing", "segmentation")
CKA_WITHIN_PNG = "cka_within.png"
CKA_BETWEEN_PNG = "cka_between.png"


def run_model(config, params, probe_t: float = diffusion_probe.PROBE_T):
  """``suite.run_model`` for MAE and U-ViT runs; a SiT run as its probe view at ``probe_t``."""
  if "transport" not in config:  # SiT runs carry a transport section
    return suite.run_model(config, params, probe_t)
  embed = params["x_embedder"]
  channels = int(embed.get("proj", embed)["kernel"].shape[2])
  model = factory.build_model(config, {"image_size": config.data.image_size, "channels": channels},
                              factory.sit)
  return sit_probe.probed_sit(model, probe_t, config.transport.path_type)


def checkpoint_model(model, probe_t: float = diffusion_probe.PROBE_T):
  """A converted checkpoint's model as the evaluators read it: a SiT as its probe view (linear
  path), anything else unchanged."""
  if isinstance(model, sit_lib.SiT) and not isinstance(model, sit_probe.ProbedSiT):
    return sit_probe.probed_sit(model, probe_t)
  return model


def applicable(model, names: Sequence[str], explicit: bool, label: str) -> List[str]:
  """The evaluators of ``names`` (``finetune`` included) that run on ``model``: one-line errors
  for impossible ones given explicitly (``explicit``), the others left out."""
  out = list(names)
  if isinstance(model, diffusion_probe.ProbedUViT):  # rank and branch ratios read MAE blocks
    if (explicit and "rank" in out) or "finetune" in out:
      raise ValueError(f"{label} is a U-ViT run: its evaluators are knn, linear and layers "
                       "(--evals=knn,linear,layers)")
    out = [n for n in out if n != "rank"]
  if isinstance(model, sit_lib.SiT):
    if (explicit and "rank" in out) or "finetune" in out:
      raise ValueError(f"{label} is a SiT run: its evaluators are cka, routing (routed runs) and "
                       "knn, linear and layers with --config (--evals=cka,routing)")
    if not explicit:  # a SiT run's config has no probe sections by default
      out = ["cka"] + (["routing"] if model.residual_routing in routing.ROUTED else [])
  if "segmentation" in out and isinstance(model, (diffusion_probe.ProbedUViT, sit_lib.SiT)):
    raise ValueError(f"--evals=segmentation is not allowed on {label}; it reads the patch tokens "
                     "of an MAE encoder")
  if "routing" in out and getattr(model, "residual_routing", "none") not in routing.ROUTED:
    raise ValueError(f"--evals=routing is not allowed on {label}; it needs a SiT run with "
                     f"residual_routing in {', '.join(routing.ROUTED)}")
  return out


class Workbench:
  """Settings of the workbench evaluators, and the CKA kernels of the models seen so far."""

  def __init__(self, cka_images: int = cka.DEFAULTS["images"],
               cka_batch: int = cka.DEFAULTS["batch"], cka_feature: str = cka.DEFAULTS["feature"],
               routing_bins: int = routing_maps.DEFAULTS["bins"],
               routing_images: int = routing_maps.DEFAULTS["images"], ablate: str = "",
               seg: Optional[dict] = None):
    cka.check_settings(cka_images, cka_batch, cka_feature)
    self.seg = segmentation.check_settings(seg or {})
    self.seg_pictures: Dict[str, dict] = {}  # record name -> picture rows
    routing_maps.check_settings(routing_bins, routing_images)
    ablation.parse(ablate)  # checks the flag before any model is loaded
    self.cka_images, self.cka_batch, self.cka_feature = cka_images, cka_batch, cka_feature
    self.routing_bins, self.routing_images, self.ablate = routing_bins, routing_images, ablate
    self.kernels: Dict[str, tuple] = {}  # record name -> (images key, (batches, L, n, n))

  def variants(self, name: str, model, params):
    """``[(name, model, params, ablation info or None)]``: the model, then its ablations."""
    return [(name, model, params, None)] + ablation.variants(name, model, params, self.ablate)

  def evaluate(self, name: str, model, params, data_cfg, evals_cfg, names: Sequence[str], mesh,
               source: dict, run_cfg=None, info: Optional[dict] = None) -> dict:
    """The record of one model: registry evaluators of ``names``, then cka and routing."""
    names = list(names)
    frozen = [n for n in names if n in registry.EVALUATORS]
    if frozen:
      record = suite.evaluate_model(name, model, params, data_cfg, evals_cfg, frozen, mesh,
                                    source)
    else:
      record = {"name": name, "source": source, "model": factory.summary(model),
                "data": data_cfg.to_dict(), "sections": {}, "seconds": {}, "settings": {}}
    if info is not None:
      record["ablation"] = info
      record["model"].update(alphas=info["alphas"], alpha_eff=info["alpha_eff"])
    if "cka" in names:
      t0 = time.perf_counter()
      logging.info("[%s] cka ...", name)
      images = evaluators.load_split(data_cfg, data_cfg.eval_split, self.cka_images)["image"]
      if images.shape[0] < self.cka_images:
        raise validate.not_allowed("cka_images", self.cka_images,
                                   f"the evaluation split has {images.shape[0]} images")
      kernels = cka.block_kernels(model, params, images, mesh, data_cfg, self.cka_batch,
                                  self.cka_feature)
      self.kernels[name] = (data_cfg.to_json(), kernels)
      record["sections"]["cka"] = cka.section(kernels, self.cka_feature, cka.block_labels(model))
      record["seconds"]["cka"] = time.perf_counter() - t0
    if "routing" in names:
      t0 = time.perf_counter()
      logging.info("[%s] routing ...", name)
      arrays = evaluators.load_split(data_cfg, data_cfg.eval_split, self.routing_images)
      record["sections"]["routing"] = routing_maps.routing_section(
          model, params, arrays, data_cfg, run_cfg.transport, self.routing_bins)
      record["seconds"]["routing"] = time.perf_counter() - t0
    if "segmentation" in names:
      t0 = time.perf_counter()
      logging.info("[%s] segmentation ...", name)
      sec = segmentation.evaluate(model, params, mesh, data_cfg, self.seg)
      self.seg_pictures[name] = sec.pop("_picture")
      record["sections"]["segmentation"] = sec
      record["seconds"]["segmentation"] = time.perf_counter() - t0
    return record

  def between(self) -> List[dict]:
    """CKA maps between the blocks of every pair of models evaluated on the same images."""
    out, names = [], list(self.kernels)
    for i, a in enumerate(names):
      for b in names[i + 1:]:
        (key_a, ka), (key_b, kb) = self.kernels[a], self.kernels[b]
        if key_a == key_b and ka.shape[0] == kb.shape[0] and ka.shape[2] == kb.shape[2]:
          out.append(cka.between(a, ka, b, kb))
    return out

  def finish(self, out_dir: str, records: Sequence[dict]):
    """Writes the workbench plots; returns ``(markdown lines, extra JSON)`` for ``report.write``."""
    extra: Dict[str, object] = {}
    pairs = self.between()
    lines = _ablation_md(out_dir, records, {(p["a"], p["b"]): p["matrix"] for p in pairs})
    within = [r for r in records if "cka" in r["sections"]]
    if within:
      plots.matrix_panels(paths.join(out_dir, CKA_WITHIN_PNG), [
          (r["name"], r["sections"]["cka"]["matrix"], r["sections"]["cka"]["blocks"],
           r["sections"]["cka"]["blocks"], "block", "block") for r in within],
          "minibatch CKA between blocks")
      s = within[0]["sections"]["cka"]
      lines += ["## CKA between blocks", "",
                "Minibatch linear CKA (unbiased HSIC; docs/workbench.md), feature "
                f"`{s['feature']}`,"
                f" {s['num_images']} evaluation images in minibatches of {s['batch']}.", "",
                f"![CKA between blocks]({CKA_WITHIN_PNG})", ""]
      lines += [_diagonal_line(r["name"], r["sections"]["cka"]["matrix"]) for r in within] + [""]
    if pairs:
      extra["cka_between"] = pairs
      blocks = {r["name"]: r["sections"]["cka"]["blocks"] for r in within}
      plots.matrix_panels(paths.join(out_dir, CKA_BETWEEN_PNG), [
          (f"{p['a']} vs {p['b']}", p["matrix"], blocks[p["a"]], blocks[p["b"]],
           f"{p['a']} block", f"{p['b']} block") for p in pairs],
          "minibatch CKA between models")
      lines += ["## CKA between models", "", f"![CKA between models]({CKA_BETWEEN_PNG})", "",
                "| a | b | CKA of same-index blocks (mean) | last block vs last block |",
                "|---|---|---:|---:|"]
      for p in pairs:
        m = np.asarray(p["matrix"])
        k = min(m.shape)
        lines.append(f"| {p['a']} | {p['b']} | {np.mean(np.diag(m[:k, :k])):.3f} | "
                     f"{m[-1, -1]:.3f} |")
      lines.append("")
    for r in records:
      sec = r["sections"].get("routing")
      if not sec:
        continue
      png = f"routing_{_slug(r['name'])}.png"
      plots.save_picture(paths.join(out_dir, png), plots.weight_heatmap(
          routing_maps.panels(sec), f"{r['name']}: routing weights ({sec['variant']}, decay "
          f"{sec['decay']}, alpha_min {sec['alpha_min']:g}) on {sec['num_images']} images"))
      lines += [f"## Routing weights: {r['name']}", "",
                f"Mean weights per routed sublayer (rows) over candidates (columns), one panel per "
                f"bin of SiT time t (t = 1 data), {sec['num_images']} evaluation images each.", "",
                f"![routing weights of {r['name']}]({png})", ""]
    for r in records:
      sec = r["sections"].get("segmentation")
      if sec:
        png = f"segmentation_{_slug(r['name'])}.png"
        pic = self.seg_pictures.get(r["name"])
        if pic is not None:
          plots.save_picture(paths.join(out_dir, png), _seg_picture(pic))
        lines += segmentation.markdown(r["name"], sec, png if pic is not None else None)
    return lines, extra


def _seg_picture(pic: dict) -> np.ndarray:
  """Rows image / ground truth / segments / predicted classes, enlarged to >= 96 pixels."""
  image = pic["image"]
  image = np.repeat(image, 3, axis=-1) if image.shape[-1] == 1 else image
  rows = [image, plots.label_colours(pic["mask"], pic["ignore"]),
          plots.label_colours(pic["segments"]), plots.label_colours(pic["pred"])]
  return plots.enlarge(plots.image_grid(rows), max(1, 96 // image.shape[1]))


def _slug(name: str) -> str:
  return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("_")


def _diagonal_line(name: str, matrix) -> str:
  m = np.asarray(matrix)
  nxt = [m[i, i + 1] for i in range(len(m) - 1)]
  return (f"- {name}: neighbouring blocks {np.mean(nxt):.3f} on average (min {np.min(nxt):.3f}); "
          f"first vs last block {m[0, -1]:.3f}." if nxt else f"- {name}: one block.")


def _ablation_md(out_dir: str, records: Sequence[dict], between: dict) -> List[str]:
  """The ablation table and one overlay of per-block curves per ablated model."""
  ablated = [r for r in records if "ablation" in r]
  if not ablated:
    return []
  by_name = {r["name"]: r for r in records}
  lines = ["## Post-training ablations", "",
           "Same parameters, changed residual update (docs/workbench.md): `alphas=1` every "
           "identity "
           "coefficient 1, `alpha_min=`/`shape=`/`convention=` another schedule, `no_identity=B` "
           "block B's coefficients 0, `no_branch=B` block B's branches 0.", "",
           "| model | ablation | alpha_eff | KNN top-1 (last) | linear top-1 (last) | "
           "best KNN block | best linear block | CKA last block vs unchanged |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
  fmt = lambda x: "-" if x is None else f"{100 * x:.2f}%"
  for base in dict.fromkeys(r["ablation"]["of"] for r in ablated):
    group = [by_name[base]] + [r for r in ablated if r["ablation"]["of"] == base]
    for r in group:
      lay = r["sections"].get("layers") or {}
      best = lambda p: f"{lay[p]['best_block']} ({fmt(lay[p]['best'])})" if p in lay else "-"
      pair = between.get((base, r["name"]))
      cka_last = "-" if pair is None else f"{pair[-1][-1]:.3f}"
      lines.append(f"| {r['name']} | {r.get('ablation', {}).get('entry', 'unchanged')} | "
                   f"{r['model']['alpha_eff']:.4g} | {fmt(lay.get('knn', {}).get('last'))} | "
                   f"{fmt(lay.get('linear', {}).get('last'))} | {best('knn')} | {best('linear')} | "
                   f"{cka_last} |")
    png = f"ablation_{_slug(base)}.png"
    if report.plot_accuracy(group, paths.join(out_dir, png)):
      lines += ["", f"![per-block probes of {base} and its ablations]({png})"]
  return lines + [""]
