"""The report of ``decay_jax.cli.evaluate``: ``evaluation.json``, ``report.md`` and PNG plots.

Input is a list of model records (``decay_jax.evals.suite.evaluate_model``): ``name``, ``source``,
``model`` (fields, ``alpha_eff``, ``alphas``), ``sections`` (``knn``, ``linear``, ``layers``,
``rank``, ``branches``: the ``evaluate()`` outputs of the evaluators), ``settings`` and ``seconds``.
Every table is per model; the plots overlay all models (accuracy and rank against the block,
branch ratio against the sublayer).
"""

from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Sequence

import numpy as np

from decay_jax import paths, plots

ACCURACY_PNG = "accuracy_vs_block.png"
RANK_PNG = "rank_vs_block.png"
BRANCH_PNG = "branch_ratio_vs_sublayer.png"

PROTOCOL_TEXT = """\
## What is measured

- **KNN** (our protocol; the official code has none): weighted k-NN (k, temperature T), cosine
  similarity, on the pooled output of the last encoder block; training features from the train
  split, queries from the test split, no augmentation.
- **Linear probes** on the last block, one head per feature choice (`mean`: mean of all tokens, cls
  included, the official probe's feature; `patch_mean`: mean of the patch tokens; `cls`: the cls
  token; `_ln`: followed by a parameter-free LayerNorm, standing in for upstream MAE's final norm,
  which the decayed model does not have).
  `official` = the released code's probe (AdamW lr 1e-2, wd 0.01, batch 256, 200 epochs, per-epoch
  cosine, precomputed features, no augmentation; the number after the last epoch).
  `mae` = upstream MAE's probe (BatchNorm without affine + linear head, LARS with trust coefficient
  0.001 and momentum 0.9, lr = blr x batch / 256, warmup then per-iteration cosine, random resized
  crops + flips; the best epoch, as upstream reports it, and the last).
- **Per block**: KNN (same settings) and a fast linear probe (standardised features, AdamW with
  cosine decay, a few epochs) on every block's output, from one forward pass; blocks are 0-based.
- **Effective rank**: for singular values s of a matrix, p = s / sum(s), rho = -sum p log p (the
  spectral entropy) and exp(rho) (Roy & Vetterli's effective rank, between 1 and min(rows, cols)).
  `tokens`: per image, the (tokens x channels) matrix of the block's raw output, rho and exp(rho)
  averaged over images; `pooled`: the (images x channels) matrix of pooled features.
  Uncentred (Roy & Vetterli's definition) unless marked `centred` (column means subtracted first:
  the image's mean token, or the mean feature over images).
- **Branch ratio** of sublayer k (k = 2l attention, 2l+1 MLP of block l): mean token norm of the
  branch f(x) over the mean token norm of the scaled shortcut alpha_k x, on unmasked images.
  alpha_eff is the product of all 2L shortcut coefficients.
"""


def _pct(x: Optional[float]) -> str:
  return "-" if x is None else f"{100.0 * x:.2f}%"


def _num(x: Optional[float], fmt: str = ".3g") -> str:
  return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, fmt)


def _get(record: dict, *path):
  node = record["sections"]
  for key in path:
    if not isinstance(node, dict) or key not in node:
      return None
    node = node[key]
  return node


def summary_table(records: Sequence[dict]) -> str:
  """One row per model: the headline numbers."""
  lines = ["| model | alpha_min | alpha_eff | KNN top-1 | linear top-1 (official, mean) | "
           "fine-tuned top-1 (best) | best KNN block | best linear block | "
           "tokens erank, last block | pooled erank, last block |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in records:
    lay = _get(r, "layers") or {}
    best = lambda p: ("-" if p not in lay else
                      f"{lay[p]['best_block']} ({_pct(lay[p]['best'])} vs last {_pct(lay[p]['last'])})")
    rank = _get(r, "rank") or {}
    last = lambda key: _num(rank[key][-1], ".2f") if key in rank else "-"
    lines.append(
        f"| {r['name']} | {r['model']['alpha_min']:g} | {r['model']['alpha_eff']:.4g} | "
        f"{_pct(_get(r, 'knn', 'top1'))} | "
        f"{_pct(_get(r, 'linear', 'official', 'results', 'mean', 'top1'))} | "
        f"{_pct(_get(r, 'finetune', 'top1'))} ({_pct(_get(r, 'finetune', 'top1_best'))}) | "
        f"{best('knn')} | "
        f"{best('linear')} | {last('tokens_erank')} | {last('pooled_erank')} |")
  return "\n".join(lines)


def _knn_md(knn: dict) -> List[str]:
  feature = knn["pool"] + ("_ln" if knn.get("layernorm") else "")
  return ["### KNN (last block)", "",
          "| feature | k | T | train | test | top-1 | top-5 |", "|---|---:|---:|---:|---:|---:|---:|",
          f"| {feature} | {knn['k']} | {knn['temperature']:g} | {knn['num_train']} | "
          f"{knn['num_query']} | {_pct(knn['top1'])} | {_pct(knn.get('top5'))} |", ""]


def _linear_md(lin: dict) -> List[str]:
  out = [f"### Linear probes (block {lin['block']}; {lin['num_train']} train, {lin['num_test']} "
         "test images)", "",
         "| protocol | feature | top-1 | top-5 | top-1 last epoch |", "|---|---|---:|---:|---:|"]
  for protocol in ("official", "mae"):
    if protocol not in lin:
      continue
    for choice, res in lin[protocol]["results"].items():
      out.append(f"| {protocol} | {choice} | {_pct(res['top1'])} | {_pct(res.get('top5'))} | "
                 f"{_pct(res.get('top1_last', res['top1']))} |")
  out.append("")
  for protocol in ("official", "mae"):
    if protocol in lin:
      s = ", ".join(f"{k} {v}" for k, v in lin[protocol]["settings"].items())
      out.append(f"Settings `{protocol}`: {s}.")
  return out + [""]


def _finetune_md(ft: dict, settings: dict) -> List[str]:
  return ["### Fine-tuning (end to end)", "",
          "| steps | batch | eval split | top-1 | top-5 | best top-1 |",
          "|---:|---:|---|---:|---:|---:|",
          f"| {ft['steps']} | {ft['batch_size']} | {ft['eval_split']} | {_pct(ft['top1'])} | "
          f"{_pct(ft['top5'])} | {_pct(ft['top1_best'])} |", "",
          f"Run: `{settings.get('workdir', '?')}` (its config.json and metrics hold the recipe).", ""]


def _blocks_md(r: dict) -> List[str]:
  lay, rank, br = _get(r, "layers"), _get(r, "rank"), _get(r, "branches")
  depth = len(r["model"]["alphas"])
  head = ["block"]
  if lay:
    head += ["KNN top-1", "linear top-1"]
  if rank:
    head += ["tokens rho", "tokens erank", "tokens erank (centred)", "pooled rho", "pooled erank",
             "pooled erank (centred)"]
  if br:
    head += ["alpha attn", "ratio attn", "alpha mlp", "ratio mlp"]
  out = ["### Per block", "", "| " + " | ".join(head) + " |",
         "|" + "---:|" * len(head)]
  for l in range(depth):
    row = [str(l)]
    if lay:
      row += [_pct(lay["knn_top1"][l]), _pct(lay["linear_top1"][l])]
    if rank:
      row += [_num(rank[k][l], ".3f") for k in ("tokens_rho", "tokens_erank", "tokens_erank_centred",
                                                 "pooled_rho", "pooled_erank",
                                                 "pooled_erank_centred")]
    if br:
      row += [f"{br['alpha'][l][0]:.4f}", _num(br["ratio"][l][0]), f"{br['alpha'][l][1]:.4f}",
              _num(br["ratio"][l][1])]
    out.append("| " + " | ".join(row) + " |")
  out.append("")
  if lay:
    for probe, label in (("knn", "KNN"), ("linear", "fast linear probe")):
      b = lay[probe]
      out.append(f"- {label}: best block {b['best_block']} at {_pct(b['best'])}, last block "
                 f"{_pct(b['last'])} (gap {100 * b['gap']:.2f} points).")
      if "selected" in lay:
        c = lay["selected"][probe]
        out.append(f"  Chosen on {lay['num_heldout']} held-out training images: block "
                   f"{c['block']} ({_pct(c['heldout'])} there), {_pct(c['test'])} on the test set.")
    out.append(f"- Per-block settings: feature `{lay['feature']}`, k {lay['k']}, T "
               f"{lay['temperature']:g}, fast probe {lay['probe_epochs']} epochs, lr "
               f"{lay['probe_lr']:g}, batch {lay['probe_batch_size']}; {lay['num_train']} train, "
               f"{lay['num_test']} test images.")
  if rank:
    out.append(f"- Rank: {rank['num_images']} images, feature `{rank['feature']}` for the pooled "
               f"matrix; upper bounds min(rows, cols): tokens {rank['tokens_bound']}, pooled "
               f"{rank['pooled_bound']}.")
  if br:
    out.append(f"- Branch ratios on {br['num_images']} images; alpha_eff (product of the "
               f"{2 * depth} coefficients) = {br['alpha_eff']:.4g}.")
  return out + [""]


def model_markdown(r: dict, plots: Sequence[str]) -> str:
  m, src = r["model"], r["source"]
  where = (f"workdir `{src['workdir']}`, step {src['step']} ({src['weights']})" if "workdir" in src
           else f"converted checkpoint `{src['checkpoint']}`")
  lines = [f"## {r['name']}", "",
           f"{where}. Encoder depth {len(m['alphas'])}, width {m['dim']}, patch {m['patch_size']}, "
           f"image {m.get('img_size', m.get('input_size'))} px; alpha_min {m['alpha_min']:g} "
           f"({m['schedule_convention']}, "
           f"{m['schedule_shape']}, {m['shortcut_form']}), alpha_eff {m['alpha_eff']:.4g}. Data "
           f"`{r['data']['dataset']}`.", ""]
  if _get(r, "knn"):
    lines += _knn_md(_get(r, "knn"))
  if _get(r, "linear"):
    lines += _linear_md(_get(r, "linear"))
  if _get(r, "finetune"):
    lines += _finetune_md(_get(r, "finetune"), r["settings"].get("finetune", {}))
  if any(_get(r, k) for k in ("layers", "rank", "branches")):
    lines += _blocks_md(r)
  secs = ", ".join(f"{k} {v:.1f} s" for k, v in r["seconds"].items())
  lines += [f"Time: {secs} (data loading and compilation included).", ""]
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Plots


def _series(records, *path):
  return [(r["name"], _get(r, *path)) for r in records if _get(r, *path) is not None]


def plot_accuracy(records, path: str) -> bool:
  knn, lin = _series(records, "layers", "knn_top1"), _series(records, "layers", "linear_top1")
  if not knn:
    return False
  with plots.figure(path, 1, 2, sharey=True) as (_, axes):
    for ax, series, title in ((axes[0, 0], knn, "KNN top-1"),
                              (axes[0, 1], lin, "fast linear probe top-1")):
      for name, ys in series:
        ax.plot(range(len(ys)), 100 * np.asarray(ys), marker="o", label=name)
      plots.style(ax, title, "encoder block")
    axes[0, 0].set_ylabel("accuracy (%)")
    axes[0, 0].legend()
  return True


def plot_rank(records, path: str) -> bool:
  tok, pooled = _series(records, "rank", "tokens_erank"), _series(records, "rank", "pooled_erank")
  if not tok:
    return False
  centred = {"tokens": dict(_series(records, "rank", "tokens_erank_centred")),
             "pooled": dict(_series(records, "rank", "pooled_erank_centred"))}
  with plots.figure(path, 1, 2) as (_, axes):
    for ax, series, kind, title in (
        (axes[0, 0], tok, "tokens", "tokens x channels per image (mean exp(rho))"),
        (axes[0, 1], pooled, "pooled", "pooled features: images x channels")):
      for name, ys in series:
        line, = ax.plot(range(len(ys)), ys, marker="o", label=name)
        if name in centred[kind]:
          ax.plot(range(len(ys)), centred[kind][name], ls="--", marker=".",
                  color=line.get_color(), label=f"{name} (centred)")
      plots.style(ax, title, "encoder block", "effective rank exp(rho)", title_size=10)
    axes[0, 0].legend()
  return True


def plot_branches(records, path: str) -> bool:
  series = _series(records, "branches", "ratio_flat")
  if not series:
    return False
  with plots.figure(path, size=(7, 3.8)) as (_, axes):
    ax = axes[0, 0]
    for name, ys in series:
      ys = np.asarray(ys)
      k = np.arange(ys.size)
      line, = ax.semilogy(k, ys, label=name)
      ax.plot(k[0::2], ys[0::2], "o", color=line.get_color(), ms=4)
      ax.plot(k[1::2], ys[1::2], "s", color=line.get_color(), ms=4)
    plots.style(ax, None, "sublayer k (o attention = 2l, s MLP = 2l+1)", "||f(x)|| / ||alpha x||",
                legend=10, which="both")
  return True


# ------------------------------------------------------------------------------------------------


def _jsonable(x):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.floating, np.integer, np.bool_)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return x


def write(out_dir: str, records: Sequence[dict], command: str = "", device: str = "",
          seconds: Optional[float] = None, appendix: Sequence[str] = (),
          extra: Optional[dict] = None) -> Dict[str, str]:
  """Writes the JSON, the plots and the Markdown report; returns their paths by kind.

  ``appendix``: Markdown lines after the plots (the workbench's ablations, CKA and routing maps,
  ``evals.workbench``); ``extra``: more top-level JSON entries (``cka_between``)."""
  files = {"json": paths.join(out_dir, "evaluation.json"),
           "report": paths.join(out_dir, "report.md")}
  stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
  paths.write_json(files["json"], _jsonable({"command": command, "device": device, "date": stamp,
                                             "seconds": seconds, "models": list(records),
                                             **(extra or {})}))
  plots = []
  for kind, name, fn in (("accuracy", ACCURACY_PNG, plot_accuracy), ("rank", RANK_PNG, plot_rank),
                         ("branches", BRANCH_PNG, plot_branches)):
    if fn(records, paths.join(out_dir, name)):
      files[kind] = paths.join(out_dir, name)
      plots.append(name)
  lines = ["# Representation evaluation", ""]
  if command:
    lines += [f"`{command}`", ""]
  total = f", {seconds:.0f} s in all" if seconds is not None else ""
  lines += [f"{stamp}, {device}{total}.", "", summary_table(records), ""]
  titles = {ACCURACY_PNG: "Accuracy against block", RANK_PNG: "Effective rank against block",
            BRANCH_PNG: "Branch ratio against sublayer"}
  for name in plots:
    lines += [f"![{titles[name]}]({name})", ""]
  lines += list(appendix)
  for r in records:
    lines.append(model_markdown(r, plots))
  lines.append(PROTOCOL_TEXT)
  paths.write_text(files["report"], "\n".join(lines))
  return files
