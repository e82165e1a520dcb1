"""The conversion engine: tables of rules, one PyTorch tensor <-> one Flax leaf, applied both ways.

A rule is (torch key, Flax path, layer index, layout); ``dense_rules``, ``norm_rules``,
``conv_rules`` and ``vit_block_rules`` build the common ones. ``from_torch`` applies a table to a
state_dict: unknown keys, missing keys and mis-shaped tensors raise ``ConversionError`` naming the
key, and nothing is skipped silently. ``to_torch`` writes a state_dict in the table's order.
``check_table`` checks a checkpoint's copy of a fixed sin-cos table against the model's (a module
constant, not a parameter). The tables live with their models: ``io.official`` (MAE, SiT, the
fine-tuning ViT), ``io.convert_uvit`` (U-ViT), ``io.convert_external`` (VAE, FID Inception).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

Path = Tuple[str, ...]
POS_EMBED_ATOL = 1e-5


class ConversionError(ValueError):
  """A state_dict does not match the model: unknown, missing or mis-shaped keys."""


@dataclasses.dataclass(frozen=True)
class Rule:
  """One torch tensor <-> one Flax leaf (or one layer slice of a scanned leaf).

  ``layout``: 'linear' (torch (out, in) <-> Flax (in, out)), 'conv' (torch (O, I, kh, kw) <-> Flax
  (kh, kw, I, O)), 'copy'.
  """
  torch_key: str
  path: Path
  layer: Optional[int] = None
  layout: str = "copy"


def to_flax_layout(w: np.ndarray, layout: str) -> np.ndarray:
  if layout == "linear":
    return w.T
  if layout == "conv":
    return w.transpose(2, 3, 1, 0)
  return w


def to_torch_layout(w: np.ndarray, layout: str) -> np.ndarray:
  if layout == "linear":
    return w.T
  if layout == "conv":
    return w.transpose(3, 2, 0, 1)
  return w


def dense_rules(prefix: str, path: Path, layer=None) -> List[Rule]:
  """A torch ``Linear`` at ``prefix`` <-> a Flax ``Dense`` at ``path`` (kernel transposed)."""
  return [Rule(f"{prefix}.weight", path + ("kernel",), layer, "linear"),
          Rule(f"{prefix}.bias", path + ("bias",), layer)]


def norm_rules(prefix: str, path: Path, layer=None) -> List[Rule]:
  """A torch ``LayerNorm`` (``weight``, ``bias``) <-> a Flax ``LayerNorm`` (``scale``, ``bias``)."""
  return [Rule(f"{prefix}.weight", path + ("scale",), layer),
          Rule(f"{prefix}.bias", path + ("bias",), layer)]


def conv_rules(prefix: str, path: Path) -> List[Rule]:
  """A torch ``Conv2d`` (OIHW) <-> a Flax ``Conv`` (HWIO)."""
  return [Rule(f"{prefix}.weight", path + ("kernel",), None, "conv"),
          Rule(f"{prefix}.bias", path + ("bias",))]


def vit_block_rules(prefix: str, path: Path, layer, affine_norms: bool = True) -> List[Rule]:
  """A timm-style ViT block: ``norm1``, ``attn.qkv``, ``attn.proj``, ``norm2``, ``mlp.fc1/fc2``
  (no norms when ``affine_norms`` is False: SiT's adaLN blocks)."""
  rules = []
  if affine_norms:
    rules += norm_rules(f"{prefix}.norm1", path + ("norm1",), layer)
  rules += dense_rules(f"{prefix}.attn.qkv", path + ("attn", "qkv"), layer)
  rules += dense_rules(f"{prefix}.attn.proj", path + ("attn", "proj"), layer)
  if affine_norms:
    rules += norm_rules(f"{prefix}.norm2", path + ("norm2",), layer)
  rules += dense_rules(f"{prefix}.mlp.fc1", path + ("mlp", "fc1"), layer)
  rules += dense_rules(f"{prefix}.mlp.fc2", path + ("mlp", "fc2"), layer)
  return rules


@dataclasses.dataclass
class Report:
  """What a conversion did: loaded keys, keys ignored on purpose, Flax leaves left at init."""
  loaded: List[str] = dataclasses.field(default_factory=list)
  ignored: Dict[str, str] = dataclasses.field(default_factory=dict)
  left_at_init: List[str] = dataclasses.field(default_factory=list)

  def summary(self) -> str:
    lines = [f"loaded {len(self.loaded)} tensors"]
    if self.ignored:
      lines.append(f"ignored {len(self.ignored)} keys:")
      lines += [f"  {k}: {why}" for k, why in self.ignored.items()]
    if self.left_at_init:
      lines.append(f"left at their initial value ({len(self.left_at_init)} Flax leaves):")
      lines += [f"  {p}" for p in self.left_at_init]
    return "\n".join(lines)


def as_numpy(t) -> np.ndarray:
  """A torch tensor (without importing torch) or array-like as a float32/int numpy array."""
  if hasattr(t, "detach"):
    t = t.detach().cpu().float().numpy() if t.is_floating_point() else t.detach().cpu().numpy()
  return np.asarray(t)


def abstract_params(model, *init_args) -> Dict[Path, jax.ShapeDtypeStruct]:
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *init_args)["params"])
  return traverse_util.flatten_dict(shapes)


def from_torch(state_dict: Mapping, rules: Sequence[Rule], targets: Dict[Path, jax.ShapeDtypeStruct],
               ignore: Mapping[str, str] = (), base: Optional[Mapping] = None,
               strict_unknown: bool = True) -> Tuple[dict, Report]:
  """Applies ``rules`` to ``state_dict``. Returns nested Flax params and a ``Report``.

  ``targets``: flat Flax shapes. ``ignore``: keys to drop, with the reason. ``base``: flat Flax
  params that supply leaves no rule fills (otherwise every leaf must be filled).
  """
  report = Report(ignored=dict(ignore))
  by_key = {r.torch_key: r for r in rules}
  unknown = [k for k in state_dict if k not in by_key and k not in report.ignored]
  if unknown and strict_unknown:
    raise ConversionError(f"unknown key(s) in the state_dict: {unknown[:8]}"
                          f"{' ...' if len(unknown) > 8 else ''} ({len(unknown)} in all)")
  for k in unknown:
    report.ignored[k] = "not used by this model"
  missing = [r.torch_key for r in rules if r.torch_key not in state_dict]
  if missing and base is None:
    raise ConversionError(f"missing key(s) in the state_dict: {missing[:8]}"
                          f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)")
  out: Dict[Path, np.ndarray] = {}
  filled: Dict[Path, set] = collections.defaultdict(set)
  for r in rules:
    if r.torch_key not in state_dict:
      continue
    target = targets.get(r.path)
    if target is None:
      raise ConversionError(f"rule for {r.torch_key!r} points at unknown Flax path {'/'.join(r.path)}")
    w = to_flax_layout(as_numpy(state_dict[r.torch_key]), r.layout)
    want = target.shape[1:] if r.layer is not None else target.shape
    if tuple(w.shape) != tuple(want):
      raise ConversionError(
          f"{r.torch_key}: shape {tuple(to_torch_layout(w, r.layout).shape)} does not match the "
          f"model, which expects {tuple(to_torch_layout(np.empty(want), r.layout).shape)}")
    if r.layer is None:
      out[r.path] = w.astype(target.dtype)
    else:
      if r.path not in out:
        out[r.path] = np.zeros(target.shape, target.dtype)
      out[r.path][r.layer] = w
      filled[r.path].add(r.layer)
    report.loaded.append(r.torch_key)
  for path, got in filled.items():
    if len(got) != targets[path].shape[0]:
      if base is None:
        raise ConversionError(f"{'/'.join(path)}: only layers {sorted(got)} found")
      base_leaf = np.array(base[path])
      for i in got:
        base_leaf[i] = out[path][i]
      out[path] = base_leaf
  for path in targets:
    if path not in out:
      if base is None:
        raise ConversionError(f"no tensor in the state_dict fills Flax parameter {'/'.join(path)}")
      out[path] = np.asarray(base[path])
      report.left_at_init.append("/".join(path))
  return traverse_util.unflatten_dict({p: jnp.asarray(v) for p, v in out.items()}), report


def to_torch(params: Mapping, rules: Sequence[Rule]) -> "collections.OrderedDict[str, np.ndarray]":
  """Flax params -> ordered ``{official key: numpy array}`` (without the constant tables)."""
  flat = traverse_util.flatten_dict(params)
  used = {r.path for r in rules}
  extra = [("/".join(p)) for p in flat if p not in used]
  if extra:
    raise ConversionError(f"Flax parameter(s) {extra} have no counterpart in the official model")
  sd = collections.OrderedDict()
  for r in rules:
    w = np.asarray(flat[r.path])
    if r.layer is not None:
      w = w[r.layer]
    sd[r.torch_key] = np.ascontiguousarray(to_torch_layout(w, r.layout))
  return sd


def check_table(state_dict: Mapping, key: str, expected: np.ndarray) -> None:
  """The checkpoint's fixed sin-cos table must equal ours (it is a constant, not a parameter)."""
  if key not in state_dict:
    return
  got = as_numpy(state_dict[key])
  if got.shape != (1,) + expected.shape:
    raise ConversionError(f"{key}: shape {got.shape} does not match the model, which expects "
                          f"{(1,) + expected.shape} (wrong image size or patch size?)")
  got = got[0]
  err = float(np.abs(got - expected).max())
  if err > POS_EMBED_ATOL:
    raise ConversionError(f"{key}: differs from the 2-D sin-cos table by {err:.2e} (> "
                          f"{POS_EMBED_ATOL}); this is not an official checkpoint layout")


def check_residual_form(model, where: str) -> None:
  """Refuses, in one line, a model whose blocks ``where`` (the official models, U-ViT) cannot
  hold: trained branch gains (LayerScale, ReZero: parameters that layout has no place for), or
  a norm after the sum (post-norm, DeepNorm: the same parameters, but those models apply their
  norms before the branch). Stochastic depth (``drop_path``) is training-only and converts."""
  res = model.residual
  if res.branch_gain != "none":
    raise ConversionError(f"branch_gain={res.branch_gain!r} has no counterpart in {where} (its "
                          "gains are parameters that layout has no place for)")
  if res.norm_position != "pre":
    raise ConversionError(f"norm_position={res.norm_position!r} has no counterpart in {where} "
                          "(its blocks are pre-norm)")
  if res.hyper:
    raise ConversionError(f"hyper_connections={res.hyper_connections!r} has no counterpart in "
                          f"{where} (its streams' weights are parameters that layout has no "
                          "place for)")
