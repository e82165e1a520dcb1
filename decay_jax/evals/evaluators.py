"""Representation evaluators built from ``config.evals.<name>``: linear probes, per-block probes,
effective rank and branch ratios and weighted KNN.

Each evaluator has ``every_steps`` (0 = only at the end of training), ``evaluate(params) -> dict``
(JSON-able sections for the report of ``decay_jax.cli.evaluate``), ``run(params) -> dict`` (flat
scalars for TensorBoard) and ``summary(scalars) -> str`` (that output as one console line under 200
characters; the full dictionary goes to TensorBoard and metrics.jsonl only). The same objects run
inside training and on any checkpoint, so the numbers of a report and of a training run are
computed by the same code.

Evaluators that pool block outputs also have ``requests()`` (the images, feature choices and blocks
they will pool) and a ``cache`` attribute: ``decay_jax.cli.evaluate`` gives all evaluators of a model
one ``features.FeatureCache`` so that each image set goes through the encoder once.

Images stay uint8 pixels on the host (``load_split``, the linear probe's augmented stream); every
compiled feature function normalises them on the devices first (``features.on_pixels`` with the
evaluator's data config).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Dict

import jax
import ml_collections
import numpy as np

from decay_jax import sharding as shd
from decay_jax.data import pipeline
from decay_jax import validate
from decay_jax.evals import branches, features, knn, layerwise, linear_probe, rank

PROTOCOLS = ("official", "official_std", "mae")


def load_split(data_cfg, split: str, max_examples: int) -> Dict[str, np.ndarray]:
  """The first ``max_examples`` (0: all) images of ``split``, resized without augmentation.

  Returns read-only arrays ``{'image': (N, S, S, C) uint8, 'label': (N,) int32}`` (float32
  latents for a latent source), shared by all evaluators that ask for the same data (KNN, linear
  and per-block probes read the same training images once). The pixels are normalised on the
  devices (``features.on_pixels``). The images live in host memory: ``max_examples`` bounds it
  (224 px RGB: 0.15 MB each).
  """
  validate.check_int("max_examples", max_examples, 0)
  cfg = data_cfg.copy_and_resolve_references()
  with cfg.unlocked():
    cfg.max_eval_examples = int(max_examples) or None
  return _load_cached(cfg.to_json(), split)


@functools.lru_cache(maxsize=4)
def _load_cached(data_json: str, split: str) -> Dict[str, np.ndarray]:
  arrays = pipeline.load_eval_arrays(ml_collections.ConfigDict(json.loads(data_json)), split)
  for a in arrays.values():
    a.setflags(write=False)
  return arrays


def _num_classes(*label_arrays) -> int:
  return int(max(int(np.max(y)) for y in label_arrays)) + 1


def _block_scalars(prefix: str, values) -> Dict[str, float]:
  return {f"{prefix}/block_{i:02d}": float(v) for i, v in enumerate(values)}


# ----------------------------------------------------------------------------------------------
# One console line per evaluation: ``summary(scalars)`` of each evaluator formats its ``run()``.

SUMMARY_WIDTH = 199  # characters of a summary line at most


def _pct(value) -> str:
  return f"{100 * float(value):.1f}%"


def _num(value) -> str:
  return f"{float(value):.3g}"


def _blocks(scalars: Dict[str, float], prefix: str) -> list:
  """The per-block values ``prefix/block_XX`` of ``scalars`` in block order (``[]`` if none)."""
  head = prefix + "/block_"
  found = sorted((int(k[len(head):]), v) for k, v in scalars.items()
                 if k.startswith(head) and k[len(head):].isdigit())
  return [v for _, v in found]


def fit(line: str, width: int = SUMMARY_WIDTH) -> str:
  """``line`` cut to ``width`` characters (``...`` at the end when cut)."""
  return line if len(line) <= width else line[:width - 3] + "..."


def pooled(evaluator, params, images: np.ndarray, choices, layers) -> np.ndarray:
  """``(N, L, P, D)`` features through the evaluator's cache when it has one for ``params``,
  otherwise with ``evaluator.fn`` (compiled once per evaluator: no recompilation during training).
  """
  cache = getattr(evaluator, "cache", None)
  if cache is not None and cache.params is params:
    return cache.pooled(images, choices, layers)
  return features.extract(evaluator.fn, params, images, evaluator.mesh, evaluator.cfg.batch_size)


def parse_protocols(spec: str) -> tuple:
  names = tuple(s.strip() for s in str(spec).split(",") if s.strip())
  if not names or any(n not in PROTOCOLS for n in names):
    raise ValueError(f"evals.linear.protocols={spec!r} is not allowed; give a comma-separated "
                     f"subset of {', '.join(map(repr, PROTOCOLS))}")
  return names


class LinearEvaluator:
  """Linear probes of the last encoder block (``config.evals.linear``; protocols in
  ``evals.linear_probe``), one head per feature choice, all trained together."""

  def __init__(self, cfg, model, data_cfg, mesh):
    self.cfg, self.mesh, self.data_cfg = cfg, mesh, data_cfg
    self.every_steps = cfg.every_steps
    self.protocols = parse_protocols(cfg.protocols)
    self.choices = features.parse_choices(cfg.features, "evals.linear.features")
    self.model = model
    self.train = load_split(data_cfg, cfg.train_split, cfg.max_train_examples)
    self.test = load_split(data_cfg, cfg.eval_split, cfg.max_eval_examples)
    self.num_classes = _num_classes(self.train["label"], self.test["label"])
    self.layers = (features.num_blocks(self.model) - 1,)
    self.fn = features.on_pixels(features.pooled_fn(self.model, self.choices, self.layers),
                                 data_cfg)
    self.cache = None

  def requests(self):
    return [(d["image"], self.choices, self.layers) for d in (self.train, self.test)]

  def _features(self, params, arrays) -> np.ndarray:
    """(N, P, D) pooled last-block features of every choice."""
    return pooled(self, params, arrays["image"], self.choices, self.layers)[:, 0]

  def _augmented_batches(self, params):
    """``(batches(epoch), steps_per_epoch, stream)`` recomputing features from augmented images
    (the caller closes ``stream``). The stream's uint8 batches go to the devices as they are;
    ``self.fn`` normalises them with the same statistics as the evaluation arrays."""
    m = self.cfg.mae
    aug = self.data_cfg.copy_and_resolve_references()
    with aug.unlocked():
      n = self.cfg.max_train_examples
      aug.train_split = f"{self.cfg.train_split}[:{n}]" if n else self.cfg.train_split
      aug.crop_scale = tuple(m.crop_scale)
      aug.flip = True
    steps = pipeline.dataset_info(aug)["num_train"] // m.batch_size
    if steps < 1:
      raise ValueError(f"evals.linear.mae.batch_size={m.batch_size} is not allowed; it must be at "
                       f"most the number of training images")
    stream = pipeline.make_train_iterator(aug, m.batch_size, self.cfg.seed,
                                          process_index=jax.process_index(),
                                          process_count=jax.process_count(), mesh=self.mesh)
    feats = jax.jit(self.fn)

    def batches(epoch: int):
      del epoch  # the stream continues across epochs; an epoch is `steps` iterations of it
      for _ in range(steps):
        b = shd.global_batch_from_local(next(stream), self.mesh)
        yield feats(params, b["image"])[:, 0], b["label"]

    return batches, steps, stream

  def evaluate(self, params) -> Dict[str, dict]:
    train_x, test_x = self._features(params, self.train), self._features(params, self.test)
    out = {"features": list(self.choices), "block": features.num_blocks(self.model) - 1,
           "num_train": int(train_x.shape[0]), "num_test": int(test_x.shape[0])}
    by_choice = lambda res: {c: {k: v[i] for k, v in res.items() if isinstance(v, list)}
                             for i, c in enumerate(self.choices)}
    for protocol in ("official", "official_std"):  # one recipe, raw or standardised features
      if protocol not in self.protocols:
        continue
      o = self.cfg.official
      res = linear_probe.official_probe(train_x, self.train["label"], test_x, self.test["label"],
                                        self.num_classes, epochs=o.epochs, lr=o.lr,
                                        weight_decay=o.weight_decay, batch_size=o.batch_size,
                                        seed=self.cfg.seed,
                                        standardize_features=protocol == "official_std")
      out[protocol] = {"settings": o.to_dict(), "results": by_choice(res)}
    if "mae" in self.protocols:
      m = self.cfg.mae
      stream = None
      if m.augment:
        batches, steps, stream = self._augmented_batches(params)
      else:
        batches = linear_probe.epoch_batches(train_x, self.train["label"], m.batch_size,
                                             self.cfg.seed)
        steps = train_x.shape[0] // m.batch_size
      log = lambda e, acc: logging.info("linear probe (mae) epoch %d: top1 %s", e,
                                        np.round(acc["top1"], 4).tolist())
      res = linear_probe.mae_probe(
          batches, test_x, self.test["label"], self.num_classes, steps_per_epoch=steps,
          epochs=m.epochs, warmup_epochs=m.warmup_epochs, blr=m.blr, batch_size=m.batch_size,
          momentum=m.momentum, trust_coefficient=m.trust_coefficient,
          weight_decay=m.weight_decay, seed=self.cfg.seed, on_epoch=log)
      if stream is not None:
        stream.close()  # its Grain workers, if any
      settings = dict(m.to_dict(), lr=res["lr"], steps_per_epoch=steps)
      settings["crop_scale"] = list(settings["crop_scale"])
      out["mae"] = {"settings": settings, "results": by_choice(res)}
    return {"linear": out}

  def run(self, params) -> Dict[str, float]:
    lin = self.evaluate(params)["linear"]
    scalars = {}
    for protocol in self.protocols:
      for choice, res in lin[protocol]["results"].items():
        for key in ("top1", "top5", "top1_last"):
          if key in res:
            scalars[f"linear/{protocol}/{choice}/{key}"] = float(res[key])
    return scalars

  def summary(self, scalars: Dict[str, float]) -> str:
    """``linear: official top1 54.3% (best of 6: cls_ln), mae top1 50.1% (best of 6: mean)``."""
    by_protocol: Dict[str, Dict[str, float]] = {}
    for k, v in scalars.items():
      parts = k.split("/")
      if len(parts) == 4 and parts[0] == "linear" and parts[3] == "top1":
        by_protocol.setdefault(parts[1], {})[parts[2]] = v
    items = []
    for protocol, top1 in by_protocol.items():
      choice = max(top1, key=top1.get)
      where = f"best of {len(top1)}: {choice}" if len(top1) > 1 else choice
      items.append(f"{protocol} top1 {_pct(top1[choice])} ({where})")
    return fit("linear: " + (", ".join(items) or "no results"))


class LayerwiseEvaluator:
  """KNN and the fast linear probe on every encoder block (``config.evals.layers``)."""

  def __init__(self, cfg, model, data_cfg, mesh):
    self.cfg, self.mesh = cfg, mesh
    self.every_steps = cfg.every_steps
    features.parse_choice(cfg.feature)
    self.model = model
    self.train = load_split(data_cfg, cfg.train_split, cfg.max_train_examples)
    self.test = load_split(data_cfg, cfg.eval_split, cfg.max_eval_examples)
    self.num_classes = _num_classes(self.train["label"], self.test["label"])
    self.fn = features.on_pixels(features.pooled_fn(self.model, (cfg.feature,)), data_cfg)
    self.cache = None

  def requests(self):
    return [(d["image"], (self.cfg.feature,), None) for d in (self.train, self.test)]

  def evaluate(self, params) -> Dict[str, dict]:
    get = lambda d: pooled(self, params, d["image"], (self.cfg.feature,), None)[:, :, 0]
    out = layerwise.layer_curves(
        get(self.train), self.train["label"], get(self.test), self.test["label"],
        self.num_classes, k=self.cfg.k, temperature=self.cfg.temperature,
        probe_epochs=self.cfg.probe_epochs, probe_lr=self.cfg.probe_lr,
        probe_batch_size=self.cfg.probe_batch_size, seed=self.cfg.seed,
        heldout_fraction=self.cfg.get("heldout_fraction", 0.0))
    out["feature"] = self.cfg.feature
    return {"layers": out}

  def run(self, params) -> Dict[str, float]:
    lay = self.evaluate(params)["layers"]
    scalars = {}
    for key in ("knn_top1", "linear_top1"):
      scalars.update(_block_scalars(f"layers/{key}", lay[key]))
    for probe in ("knn", "linear"):
      scalars[f"layers/{probe}_best_block"] = float(lay[probe]["best_block"])
    return scalars

  def summary(self, scalars: Dict[str, float]) -> str:
    """``layers: best knn block 9 47.4%, last 44.3%; best linear block 8 50.1%, last 48.0%``."""
    items = []
    for probe in ("knn", "linear"):
      curve = _blocks(scalars, f"layers/{probe}_top1")
      if not curve:
        continue
      best = int(scalars.get(f"layers/{probe}_best_block", int(np.argmax(curve))))
      items.append(f"best {probe} block {best} {_pct(curve[best])}, last {_pct(curve[-1])}")
    return fit("layers: " + ("; ".join(items) or "no results"))


class RankEvaluator:
  """Effective rank per block (``evals.rank``) and branch ratios per sublayer
  (``evals.branches``), from one encoder pass over ``num_images`` images of ``split``
  (``config.evals.rank``)."""

  def __init__(self, cfg, model, data_cfg, mesh):
    self.cfg, self.mesh = cfg, mesh
    self.every_steps = cfg.every_steps
    features.parse_choice(cfg.feature)
    validate.check_int("evals.rank.num_images", cfg.num_images, 2)
    self.with_branches = validate.check_flag("evals.rank.branch_ratios", cfg.branch_ratios)
    self.model = model
    self.images = load_split(data_cfg, cfg.split, cfg.num_images)["image"]
    choice = (cfg.feature,)

    def fn(params, images):
      if self.with_branches:
        tokens, norms = branches.features_and_norms(model, params, images)
      else:
        tokens = model.apply({"params": params}, images, method=model.features)
      out = {"tokens": tokens, "pooled": features.pool_all(tokens, choice)[:, :, 0]}  # (N, L, D)
      if self.with_branches:
        out["norms"] = norms  # (N, L, 2, 2)
      return out

    def spectra(out):  # a second program: see features.extract(post=...)
      tokens = out.pop("tokens")
      return dict(out, token_rho=rank.entropy_rank(tokens).T,  # (N, L)
                  token_rho_centred=rank.entropy_rank(tokens, center=True).T)

    self.fn, self.post = features.on_pixels(fn, data_cfg), spectra

  def evaluate(self, params) -> Dict[str, dict]:
    res = features.extract(self.fn, params, self.images, self.mesh, self.cfg.batch_size,
                           post=self.post)
    num_tokens = self.model.num_patches + 1
    out = {"rank": dict(rank.summarize(res["token_rho"], res["token_rho_centred"], res["pooled"],
                                       num_tokens), feature=self.cfg.feature)}
    if self.with_branches:
      out["branches"] = branches.summarize(res["norms"], branches.model_alphas(self.model, params),
                                           self.model.shortcuts.branch_scale)
    return out

  def run(self, params) -> Dict[str, float]:
    res = self.evaluate(params)
    scalars = {}
    for key in ("tokens_erank", "pooled_erank", "tokens_rho", "pooled_rho", "tokens_erank_centred",
                "pooled_erank_centred"):
      scalars.update(_block_scalars(f"rank/{key}", res["rank"][key]))
    if "branches" in res:
      ratio = np.asarray(res["branches"]["ratio"])
      scalars.update(_block_scalars("branches/ratio_attn", ratio[:, 0]))
      scalars.update(_block_scalars("branches/ratio_mlp", ratio[:, 1]))
    return scalars

  def summary(self, scalars: Dict[str, float]) -> str:
    """``rank: tokens erank last 2.47 (block 0: 10.1), pooled erank last 21.3 (block 0: 30.2);
    branch ratio last attn 0.123 mlp 0.345`` (uncentred; the rest is in TensorBoard)."""
    items = []
    for kind in ("tokens", "pooled"):
      curve = _blocks(scalars, f"rank/{kind}_erank")
      if curve:
        items.append(f"{kind} erank last {_num(curve[-1])} (block 0: {_num(curve[0])})")
    line = "rank: " + (", ".join(items) or "no results")
    attn, mlp = _blocks(scalars, "branches/ratio_attn"), _blocks(scalars, "branches/ratio_mlp")
    if attn and mlp:
      line += f"; branch ratio last attn {_num(attn[-1])} mlp {_num(mlp[-1])}"
    return fit(line)


class KnnEvaluator:
  """Weighted k-NN top-1/top-5 on pooled final-block features (our protocol, see ``evals.knn``)."""

  def __init__(self, cfg, model, data_cfg, mesh):
    self.cfg, self.mesh = cfg, mesh
    self.every_steps = cfg.every_steps
    self.train = load_split(data_cfg, cfg.train_split, cfg.max_train_examples)
    self.test = load_split(data_cfg, cfg.eval_split, cfg.max_eval_examples)
    self.num_classes = int(max(self.train["label"].max(), self.test["label"].max())) + 1
    self.model = model
    self.choice = cfg.pool + ("_ln" if cfg.layernorm else "")
    self.cache = None  # a features.FeatureCache shared with other evaluators (decay_jax.cli.evaluate)

    def last_block(params, images):
      tokens = model.apply({"params": params}, images, method=model.features)[-1]
      return knn.pool_tokens(tokens, cfg.pool, cfg.layernorm)

    self.features = features.on_pixels(last_block, data_cfg)

  def requests(self):
    return [(d["image"], (self.choice,), (-1,)) for d in (self.train, self.test)]

  def _get(self, params, images):
    if self.cache is not None and self.cache.params is params:
      return self.cache.pooled(images, (self.choice,), (-1,))[:, 0, 0]
    return features.extract(self.features, params, images, self.mesh, self.cfg.batch_size)

  def evaluate(self, params) -> Dict[str, dict]:
    get = lambda d: self._get(params, d["image"])
    res = knn.knn_accuracy(get(self.train), self.train["label"], get(self.test), self.test["label"],
                           self.num_classes, k=self.cfg.k, temperature=self.cfg.temperature)
    return {"knn": dict(res, pool=self.cfg.pool, layernorm=bool(self.cfg.layernorm))}

  def run(self, params) -> Dict[str, float]:
    res = self.evaluate(params)["knn"]
    out = {"knn/top1": res["top1"]}
    if "top5" in res:
      out["knn/top5"] = res["top5"]
    return out

  def summary(self, scalars: Dict[str, float]) -> str:
    """``knn top1 44.2% top5 87.6%``."""
    line = f"knn top1 {_pct(scalars['knn/top1'])}"
    if "knn/top5" in scalars:
      line += f" top5 {_pct(scalars['knn/top5'])}"
    return fit(line)


class AccuracyEvaluator:
  """Top-1 / top-5 of the fine-tuned classifier's logits on the evaluation split (upstream MAE
  evaluates after every epoch: the images resized and centre-cropped by ``data.eval_resize``)."""

  def __init__(self, cfg, model, data_cfg, mesh):
    self.cfg, self.mesh, self.model = cfg, mesh, model
    self.every_steps = cfg.every_steps
    self.test = load_split(data_cfg, cfg.eval_split, cfg.max_eval_examples)
    self.fn = features.on_pixels(lambda params, images: model.apply({"params": params}, images),
                                 data_cfg)

  def evaluate(self, params) -> Dict[str, dict]:
    logits = features.extract(self.fn, params, self.test["image"], self.mesh, self.cfg.batch_size)
    labels = self.test["label"]
    top5 = np.argsort(-logits, axis=-1)[:, :5]
    return {"accuracy": {"top1": float(np.mean(top5[:, 0] == labels)),
                         "top5": float(np.mean((top5 == labels[:, None]).any(axis=-1))),
                         "num_eval": int(len(labels))}}

  def run(self, params) -> Dict[str, float]:
    res = self.evaluate(params)["accuracy"]
    return {"accuracy/top1": res["top1"], "accuracy/top5": res["top5"]}

  def summary(self, scalars: Dict[str, float]) -> str:
    """``accuracy top1 81.2% top5 95.0%``."""
    return fit(f"accuracy top1 {_pct(scalars['accuracy/top1'])} "
               f"top5 {_pct(scalars['accuracy/top5'])}")
