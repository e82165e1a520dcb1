"""Convert between official PyTorch state_dicts and decay-jax Flax parameters, both directions.

Supported sources (docs/official_code.md 1.2, 1.13, 4.2):
  * official decayed-MAE checkpoints (``.pth`` with ``model`` and ``args``; ``alpha_min`` comes from
    ``args.min_decay``); ViT-L/H checkpoints carry SkipLayers the forward never uses: they are
    reported and dropped, and re-created with the official init on the way back;
  * official SiT checkpoints (``model`` and ``ema``; ``alpha_min`` from ``args.min_sigma``);
  * upstream MAE ``mae_pretrain_vit_*.pth`` encoders, as an initialisation of the decayed encoder
    (the report lists what was loaded and what was left at its initial value).

The other way (``to-torch``), a training workdir's checkpoint or a params directory becomes a file
the official code loads: ``{'model', 'args'}`` for MAE, ``{'model', 'ema', 'args'}`` for SiT, keys
in the official order, strict-loadable. Models the official code cannot express (SiT routing,
other shortcut forms or schedules) are refused.

The conversion is a table of rules (torch key, Flax path, layer index, layout). Unknown keys, missing
keys and mis-shaped tensors raise ``ConversionError`` naming the key; nothing is skipped silently.
Fixed sin-cos tables are module constants here: the checkpoint's copy is checked against ours.
Files are read with ``torch.load(weights_only=True)`` only: a pickle holding code is refused, never
run. On the command line every bad input is one line naming the argument, exit status 2.

Command line (needs torch; paths may be ``gs://``)::

    python -m decay_jax.convert mae --checkpoint checkpoint-799.pth --out DIR
    python -m decay_jax.convert sit --checkpoint 0400000.pt --out DIR [--weights ema]
    python -m decay_jax.convert mae-upstream --checkpoint mae_pretrain_vit_base.pth --out DIR \
        --preset B/16 --alpha-min 0.6
    python -m decay_jax.convert to-torch --params WORKDIR_OR_PARAMS_DIR --out FILE.pth [--step N]

(``python -m decay_jax.io.convert`` is the same command.)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import logging
import math
import os
import pickle
import pickletools
import re
import sys
import warnings
import zipfile
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import traverse_util

from decay_jax import logs, paths
from decay_jax import sharding as shd
from decay_jax import validate
from decay_jax.models import factory
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib
from decay_jax.train import checkpoint

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


def _dense(prefix: str, path: Path, layer=None) -> List[Rule]:
  return [Rule(f"{prefix}.weight", path + ("kernel",), layer, "linear"),
          Rule(f"{prefix}.bias", path + ("bias",), layer)]


def _norm(prefix: str, path: Path, layer=None) -> List[Rule]:
  return [Rule(f"{prefix}.weight", path + ("scale",), layer),
          Rule(f"{prefix}.bias", path + ("bias",), layer)]


def _conv(prefix: str, path: Path) -> List[Rule]:
  return [Rule(f"{prefix}.weight", path + ("kernel",), None, "conv"),
          Rule(f"{prefix}.bias", path + ("bias",))]


def _vit_block(prefix: str, path: Path, layer, affine_norms: bool = True) -> List[Rule]:
  rules = []
  if affine_norms:
    rules += _norm(f"{prefix}.norm1", path + ("norm1",), layer)
  rules += _dense(f"{prefix}.attn.qkv", path + ("attn", "qkv"), layer)
  rules += _dense(f"{prefix}.attn.proj", path + ("attn", "proj"), layer)
  if affine_norms:
    rules += _norm(f"{prefix}.norm2", path + ("norm2",), layer)
  rules += _dense(f"{prefix}.mlp.fc1", path + ("mlp", "fc1"), layer)
  rules += _dense(f"{prefix}.mlp.fc2", path + ("mlp", "fc2"), layer)
  return rules


# ------------------------------------------------------------------------------------------------
# Rule tables (in the official state_dict order)
# ------------------------------------------------------------------------------------------------


def mae_rules(model: mae_lib.MaskedAutoencoder) -> List[Rule]:
  rules = [Rule("cls_token", ("cls_token",)), Rule("decoder_cls_token", ("decoder_cls_token",))]
  rules += _conv("patch_embed.proj", ("patch_embed", "proj"))
  for i in range(model.num_skip_layers):
    rules += [Rule(f"skip.{i}.mask_token", (f"skip_{i}", "mask_token"))]
    rules += _dense(f"skip.{i}.fc.0", (f"skip_{i}", "fc0"))
    rules += _dense(f"skip.{i}.fc.2", (f"skip_{i}", "fc2"))
  for j in range(model.depth):
    rules += _vit_block(f"blocks.{j}", ("blocks",), j)
  rules += _dense("decoder_embed", ("decoder_embed",))
  for k in range(model.decoder_depth):
    rules += _vit_block(f"decoder_blocks.{k}", (f"decoder_blocks_{k}",), None)
  rules += _norm("decoder_norm", ("decoder_norm",))
  rules += _dense("decoder_pred", ("decoder_pred",))
  return rules


def vit_rules(model) -> List[Rule]:
  """The fine-tuning classifier (``models.vit.ViTClassifier``) under timm's / upstream MAE's
  ``models_vit`` names (global pooling: ``fc_norm``, no ``norm``)."""
  rules = [Rule("cls_token", ("cls_token",)), Rule("pos_embed", ("pos_embed",))]
  rules += _conv("patch_embed.proj", ("patch_embed", "proj"))
  for j in range(model.depth):
    rules += _vit_block(f"blocks.{j}", ("blocks",), j)
  rules += _norm("fc_norm", ("fc_norm",))
  rules += _dense("head", ("head",))
  return rules


def mae_unused_skip_keys(model: mae_lib.MaskedAutoencoder) -> List[str]:
  """Keys of the SkipLayers the official model builds but never uses (ViT-L/H)."""
  return [f"skip.{i}.{name}" for i in range(model.num_skip_layers, len(model.skip_ids))
          for name in ("mask_token", "fc.0.weight", "fc.0.bias", "fc.2.weight", "fc.2.bias")]


def sit_rules(model: sit_lib.SiT) -> List[Rule]:
  rules = _conv("x_embedder.proj", ("x_embedder", "proj"))
  rules += _dense("t_embedder.mlp.0", ("t_embedder", "mlp0"))
  rules += _dense("t_embedder.mlp.2", ("t_embedder", "mlp2"))
  rules += [Rule("y_embedder.embedding_table.weight", ("y_embedder", "embedding"))]
  for part in ("enc_blocks", "dec_blocks"):
    for i in range(model.depth // 2):
      rules += _vit_block(f"{part}.{i}", (part,), i, affine_norms=False)
      rules += _dense(f"{part}.{i}.adaLN_modulation.1", (part, "adaLN_modulation"), i)
      if part == "dec_blocks":
        rules += _dense(f"{part}.{i}.skip", (part, "skip"), i)
  rules += _dense("final_layer.linear", ("final_linear",))
  rules += _dense("final_layer.adaLN_modulation.1", ("final_adaLN",))
  return rules


# ------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# Model-level API
# ------------------------------------------------------------------------------------------------


def _mae_init_args(model):
  return (jnp.zeros((1, model.img_size, model.img_size, model.in_chans)),
          jnp.zeros((1, model.num_patches)))


def mae_from_torch(state_dict: Mapping, model: mae_lib.MaskedAutoencoder) -> Tuple[dict, Report]:
  """Official decayed-MAE ``model`` state_dict -> Flax params of ``model``.

  ``model`` must carry the checkpoint's ``alpha_min`` (it is not in the state_dict).
  """
  check_table(state_dict, "pos_embed", model.pos_embed())
  check_table(state_dict, "decoder_pos_embed", model.decoder_pos_embed())
  ignore = {"pos_embed": "fixed sin-cos table (a module constant here; checked)",
            "decoder_pos_embed": "fixed sin-cos table (a module constant here; checked)"}
  ignore.update({k: "SkipLayer the official forward never uses" for k in mae_unused_skip_keys(model)})
  targets = abstract_params(model, *_mae_init_args(model))
  targets.pop(("alpha",), None)
  params, report = from_torch(state_dict, mae_rules(model), targets, ignore)
  if model.shortcuts.learnable:
    params["alpha"] = jnp.asarray(model.shortcuts.alphas, jnp.float32)
    report.left_at_init.append("alpha (learnable ablation, initialised from the schedule)")
  return params, report


def vit_from_torch(state_dict: Mapping, model) -> Tuple[dict, Report]:
  """A fine-tuning classifier's state_dict (upstream ``models_vit`` names, global pooling) ->
  Flax params of ``model`` (``models.vit.ViTClassifier``); every key must match."""
  init_args = (jnp.zeros((1, model.img_size, model.img_size, model.in_chans)),)
  return from_torch(state_dict, vit_rules(model), abstract_params(model, *init_args))


def official_unused_skip_init(model: mae_lib.MaskedAutoencoder, seed: int = 0) -> Dict[str, np.ndarray]:
  """Official-init values for the SkipLayers the official ViT-L/H build but never use.

  Their values cannot change any output; they exist so the official code can load the file.
  """
  rng = np.random.default_rng(seed)
  d, enc = model.decoder_dim, model.dim
  bound = math.sqrt(6.0 / (enc + d + d))
  out = {}
  for i in range(model.num_skip_layers, len(model.skip_ids)):
    out[f"skip.{i}.mask_token"] = (0.02 * rng.standard_normal((1, 1, enc))).astype(np.float32)
    out[f"skip.{i}.fc.0.weight"] = rng.uniform(-bound, bound, (d, enc + d)).astype(np.float32)
    out[f"skip.{i}.fc.0.bias"] = np.zeros((d,), np.float32)
    out[f"skip.{i}.fc.2.weight"] = np.zeros((d, d), np.float32)
    out[f"skip.{i}.fc.2.bias"] = np.zeros((d,), np.float32)
  return out


def mae_to_torch(params: Mapping, model: mae_lib.MaskedAutoencoder) -> "collections.OrderedDict":
  """Flax params -> official decayed-MAE state_dict (numpy), keys in the official order.

  Includes the fixed tables ``pos_embed`` / ``decoder_pos_embed`` and, for ViT-L/H, official-init
  values for the unused SkipLayers, so ``load_state_dict(strict=True)`` works on the official model.
  """
  params = {k: v for k, v in params.items() if k != "alpha"}
  if model.shortcuts.learnable:
    raise ConversionError("shortcut_form='learnable' has no counterpart in the official model")
  body = to_torch(params, mae_rules(model))
  unused = official_unused_skip_init(model)
  sd = collections.OrderedDict()
  sd["cls_token"] = body.pop("cls_token")
  sd["pos_embed"] = model.pos_embed()[None]
  sd["decoder_cls_token"] = body.pop("decoder_cls_token")
  sd["decoder_pos_embed"] = model.decoder_pos_embed()[None]
  for k, v in body.items():
    sd[k] = v
    if k == f"skip.{model.num_skip_layers - 1}.fc.2.bias":
      sd.update(unused)
  return sd


def _sit_init_args(model):
  return (jnp.zeros((1, model.input_size, model.input_size, model.in_channels)),
          jnp.zeros((1,)), jnp.zeros((1,), jnp.int32))


def sit_from_torch(state_dict: Mapping, model: sit_lib.SiT) -> Tuple[dict, Report]:
  """Official SiT ``model`` or ``ema`` state_dict -> Flax params of ``model``."""
  check_table(state_dict, "pos_embed", model.pos_embed())
  targets = abstract_params(model, *_sit_init_args(model))
  targets.pop(("alpha",), None)
  params, report = from_torch(state_dict, sit_rules(model), targets,
                              {"pos_embed": "fixed sin-cos table (a module constant here; checked)"})
  if model.shortcuts.learnable:
    params["alpha"] = jnp.asarray(model.shortcuts.alphas, jnp.float32)
    report.left_at_init.append("alpha (learnable ablation, initialised from the schedule)")
  return params, report


def sit_to_torch(params: Mapping, model: sit_lib.SiT) -> "collections.OrderedDict":
  """Flax params -> official SiT state_dict (numpy) including the fixed ``pos_embed``."""
  if model.shortcuts.learnable:
    raise ConversionError("shortcut_form='learnable' has no counterpart in the official model")
  sd = collections.OrderedDict(pos_embed=model.pos_embed()[None])
  sd.update(to_torch(params, sit_rules(model)))
  return sd


def mae_from_upstream_encoder(state_dict: Mapping, model: mae_lib.MaskedAutoencoder,
                              init_params: Mapping) -> Tuple[dict, Report]:
  """Upstream MAE (``mae_pretrain_vit_*.pth``) encoder -> initialisation of the decayed MAE.

  Loads ``cls_token``, ``patch_embed`` and all encoder ``blocks``; every other leaf keeps its value
  from ``init_params`` (the report lists them). The upstream final ``norm`` and any upstream decoder
  keys (``mask_token``, ``decoder_*``) have no place in the decayed model and are reported as ignored.
  """
  check_table(state_dict, "pos_embed", model.pos_embed())
  rules = [Rule("cls_token", ("cls_token",))] + _conv("patch_embed.proj", ("patch_embed", "proj"))
  for j in range(model.depth):
    rules += _vit_block(f"blocks.{j}", ("blocks",), j)
  targets = abstract_params(model, *_mae_init_args(model))
  ignore = {k: "upstream key with no counterpart in the decayed encoder"
            for k in state_dict if k.startswith(("norm.", "mask_token", "decoder_"))}
  ignore["pos_embed"] = "fixed sin-cos table (a module constant here; checked)"
  return from_torch(state_dict, rules, targets, ignore,
                    base=traverse_util.flatten_dict(dict(init_params)))


# ------------------------------------------------------------------------------------------------
# Reading official checkpoints: infer the architecture from the tensors
# ------------------------------------------------------------------------------------------------


def _count(state_dict, prefix: str) -> int:
  idx = {int(k[len(prefix):].split(".")[0]) for k in state_dict if k.startswith(prefix)}
  return max(idx) + 1 if idx else 0


def infer_mae_fields(state_dict: Mapping) -> dict:
  """Architecture fields of an official decayed-MAE state_dict (sizes read off the tensors).

  Head counts are not visible in the shapes: the official ones are used for the official widths
  (768 -> 12, 1024/1280 -> 16, decoder 512 -> 16), otherwise 64-wide (32-wide decoder) heads.
  """
  try:
    w = as_numpy(state_dict["patch_embed.proj.weight"])
    dim, in_chans, p, _ = w.shape
    tokens = as_numpy(state_dict["pos_embed"]).shape[1] - 1
    dec_dim = as_numpy(state_dict["decoder_embed.weight"]).shape[0]
  except KeyError as e:
    raise ConversionError(f"not an official decayed-MAE state_dict: key {e} is missing") from None
  grid = int(round(math.sqrt(tokens)))
  depth = _count(state_dict, "blocks.")
  heads = {768: 12, 1024: 16, 1280: 16}.get(dim, max(1, dim // 64))
  return dict(img_size=grid * p, patch_size=p, in_chans=in_chans, dim=dim, depth=depth,
              num_heads=heads, decoder_dim=dec_dim,
              decoder_depth=_count(state_dict, "decoder_blocks."),
              decoder_num_heads=max(1, dec_dim // 32),
              mlp_ratio=as_numpy(state_dict["blocks.0.mlp.fc1.weight"]).shape[0] / dim)


def infer_sit_fields(state_dict: Mapping) -> dict:
  """Architecture fields of an official SiT state_dict."""
  try:
    w = as_numpy(state_dict["x_embedder.proj.weight"])
    dim, in_ch, p, _ = w.shape
    tokens = as_numpy(state_dict["pos_embed"]).shape[1]
    table = as_numpy(state_dict["y_embedder.embedding_table.weight"])
    out = as_numpy(state_dict["final_layer.linear.weight"]).shape[0] // (p * p)
  except KeyError as e:
    raise ConversionError(f"not an official SiT state_dict: key {e} is missing") from None
  depth = 2 * _count(state_dict, "enc_blocks.")
  heads = {1152: 16, 1024: 16, 768: 12, 384: 6}.get(dim, max(1, dim // 64))
  return dict(input_size=int(round(math.sqrt(tokens))) * p, patch_size=p, in_channels=in_ch,
              dim=dim, depth=depth, num_heads=heads, num_classes=table.shape[0] - 1,
              learn_sigma=(out == 2 * in_ch),
              mlp_ratio=as_numpy(state_dict["enc_blocks.0.mlp.fc1.weight"]).shape[0] / dim)


# ------------------------------------------------------------------------------------------------
# Command-line input: every bad input is one line that names the argument
# ------------------------------------------------------------------------------------------------


class InputError(ValueError):
  """A command-line input that cannot be used: ``str()`` is one line, ``ARG VALUE: what is wrong;
  expected WHAT``."""


def bad_input(arg: str, value, problem: str, expected: str = "") -> InputError:
  """``InputError('--checkpoint /x.pth: no such file; expected an official ...')``.

  Args:
    arg: the command-line argument (``--checkpoint``).
    value: what was given (``None`` when the argument is missing).
    problem: what is wrong with it.
    expected: what the argument must be (left out when empty).
  """
  text = f"{arg}: {problem}" if value is None else f"{arg} {value}: {problem}"
  if expected:
    text += f"; expected {expected}"
  return InputError(" ".join(text.split()))


def error_detail(e: BaseException, limit: int = 120) -> str:
  """``Type: first sentence`` of a library's exception, on one line and at most ``limit`` chars.

  torch's refusals of a pickle advise loading it with the unrestricted unpickler, which would run
  whatever code it holds; such text is dropped (the type alone remains), never shown.
  """
  text = " ".join(str(e.args[0] if isinstance(e, KeyError) and e.args else e).split())
  if "weights_only" in text:
    text = ""
  text = text.split(" See full TensorStore details")[0].split(". ")[0]
  if len(text) > limit:
    text = text[:limit - 3] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _torch(what: str):
  try:
    import torch  # pylint: disable=import-outside-toplevel  (only the .pth paths need it)
  except ImportError:
    raise SystemExit(f"{what} needs PyTorch: pip install torch==2.13.0 (CPU is enough)") from None
  return torch


def input_file(path: str, arg: str, expected: str) -> epath.Path:
  """``path`` (local or a URI) as an ``epath.Path``, after checking that it is an existing file."""
  p = paths.resolve(path)
  try:
    is_dir, exists = p.is_dir(), p.exists()
  except Exception as e:  # pylint: disable=broad-except  (a bucket that cannot be reached, ...)
    raise bad_input(arg, path, f"cannot be opened ({error_detail(e)})", expected) from None
  if is_dir:
    raise bad_input(arg, path, "is a directory, not a file", expected)
  if not exists:
    raise bad_input(arg, path, "no such file", expected)
  return p


def read_head(p: epath.Path, arg: str, path: str, expected: str, size: int = 16) -> bytes:
  """The first ``size`` bytes of a file (to tell its format before parsing it)."""
  try:
    with p.open("rb") as f:
      head = f.read(size)
  except Exception as e:  # pylint: disable=broad-except  (permissions, object-store errors)
    raise bad_input(arg, path, f"cannot be opened ({error_detail(e)})", expected) from None
  if not head:
    raise bad_input(arg, path, "is empty", expected)
  return head


def is_safetensors(head: bytes) -> bool:
  """A safetensors file opens with its header length (8 bytes, little endian) and a JSON object."""
  return len(head) >= 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") < 1 << 32


# Globals a tensor checkpoint's pickle may name (torch's restricted unpickler allows these).
_TENSOR_GLOBALS = ("torch.", "collections.OrderedDict", "argparse.Namespace", "_codecs.encode")
_SCAN_LIMIT = 64 << 20


def _foreign_globals(p: epath.Path, error: BaseException) -> List[str]:
  """Python objects (functions, classes) a refused pickle names, none of them ever built.

  torch's refusal names the first (``GLOBAL posix.system``) when it got that far; otherwise the
  opcodes are listed with ``pickletools.genops``, which parses and never executes.
  """
  found = re.findall(r"GLOBAL ([\w.]+)", str(error))
  if found:
    return list(dict.fromkeys(found))
  try:
    with p.open("rb") as f:
      data = f.read(_SCAN_LIMIT)
    if zipfile.is_zipfile(io.BytesIO(data)):
      with zipfile.ZipFile(io.BytesIO(data)) as z:
        data = next((z.read(n) for n in z.namelist() if n.endswith("data.pkl")), b"")
  except Exception:  # pylint: disable=broad-except  (unreadable: nothing more to say)
    return []
  names, strings = [], []
  try:
    for op, arg, _ in pickletools.genops(data):
      if op.name in ("GLOBAL", "INST"):
        names.append(str(arg).replace(" ", "."))
      elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
        names.append(f"{strings[-2]}.{strings[-1]}")
      elif isinstance(arg, str):
        strings.append(arg)
  except Exception:  # pylint: disable=broad-except  (bytes after the pickle, or no pickle at all)
    pass
  return [n for n in dict.fromkeys(names) if not n.startswith(_TENSOR_GLOBALS)]


def _load_failure(e: BaseException) -> str:
  if isinstance(e, RuntimeError) and "zip archive" in str(e):
    return "it is a damaged or truncated zip archive (torch.save's format)"
  if isinstance(e, EOFError):
    return "it ends early (a truncated file?)"
  return f"it is not a PyTorch checkpoint ({error_detail(e)})"


def read_torch_file(path: str, arg: str = "--checkpoint",
                    expected: str = "a PyTorch checkpoint (.pth)"):
  """``torch.load`` of ``path`` restricted to tensors, containers and argparse Namespaces.

  The file is opened through ``etils.epath`` (local paths and ``gs://`` alike). A pickle that would
  build anything else (a call such as ``os.system``, an arbitrary class) is refused by torch's
  restricted unpickler before any of it runs. Every failure is one ``InputError`` line naming
  ``arg``: a missing file, a directory, an empty, truncated or foreign file, a safetensors file,
  and a pickle holding code.

  Returns:
    What the file holds (official checkpoints: a dict of state_dicts and ``args``).
  """
  torch = _torch("reading .pth files")
  p = input_file(path, arg, expected)
  if is_safetensors(read_head(p, arg, path, expected)):
    raise bad_input(arg, path, "is a safetensors file, not a PyTorch .pth", expected)
  try:
    with p.open("rb") as f, warnings.catch_warnings(), \
        torch.serialization.safe_globals([argparse.Namespace]):
      warnings.simplefilter("ignore")  # torch warns on stderr about unusual pickle protocols
      return torch.load(f, map_location="cpu", weights_only=True)
  except pickle.UnpicklingError as e:
    names = _foreign_globals(p, e)
    if names:
      raise bad_input(arg, path, f"contains code or objects other than tensors "
                      f"({', '.join(names[:3])}); it was not loaded", expected) from None
    raise bad_input(arg, path, "cannot be read; it is not a PyTorch checkpoint (not a pickle "
                    "of tensors)", expected) from None
  except Exception as e:  # pylint: disable=broad-except  (bytes of any kind raise any kind)
    raise bad_input(arg, path, f"cannot be read; {_load_failure(e)}", expected) from None


def load_torch_checkpoint(path: str) -> dict:
  """An official ``.pth`` as ``read_torch_file`` reads it (tensors and ``args`` only)."""
  return read_torch_file(path)


def _keys(mapping: Mapping) -> str:
  keys = [repr(k) for k in list(mapping)[:6]]
  return ", ".join(keys) + (" ..." if len(mapping) > 6 else "") if keys else "nothing"


def _arg(ckpt: Mapping, name: str, default=None):
  """``ckpt['args'].name``: official files hold an argparse Namespace, ours a plain dict."""
  args = ckpt.get("args")
  value = args.get(name) if isinstance(args, Mapping) else getattr(args, name, None)
  return default if value is None else value


def _alpha_min(ckpt: Mapping, name: str, override: Optional[float], path: str, what: str) -> float:
  if override is not None:
    return override
  value = _arg(ckpt, name)
  if value is None:
    raise bad_input("--checkpoint", path, f"the checkpoint has no args.{name}; pass --alpha-min "
                    f"({what})")
  return float(value)


# ------------------------------------------------------------------------------------------------
# Writing official checkpoints (to-torch)
# ------------------------------------------------------------------------------------------------

# Official factory names (docs/official_code.md 1.1, 4.1) of our presets.
OFFICIAL_MAE = {"B/16": "mae_vit_base_patch16", "L/16": "mae_vit_large_patch16",
                "H/14": "mae_vit_huge_patch14"}
OFFICIAL_SIT = {f"{size}/{p}": f"SiT-{size}/{p}"
                for size in ("XL", "L", "B", "S") for p in (2, 4, 8)}


def _official_name(model) -> str:
  """The official factory name of ``model``'s architecture, or 'custom'."""
  if isinstance(model, mae_lib.MaskedAutoencoder):
    presets, names = mae_lib.MAE_PRESETS, OFFICIAL_MAE
  else:
    presets, names = sit_lib.SIT_PRESETS, OFFICIAL_SIT
  for preset, name in names.items():
    if model.mlp_ratio == 4.0 and all(getattr(model, k) == v for k, v in presets[preset].items()):
      return name
  return "custom"


def no_official_layout(model) -> Optional[str]:
  """Why ``model`` has no official state_dict layout, or ``None`` when it has one.

  The official files store tensors and ``min_decay`` / ``min_sigma`` only, and the official code
  rebuilds the rest: the linear per-sublayer schedule, the decayed identity shortcut and (SiT) the
  plain Linear long skips. A model that differs in any of these would load into the official code
  as a different function, or not at all.
  """
  name = type(model).__name__
  if not isinstance(model, (mae_lib.MaskedAutoencoder, sit_lib.SiT)):
    return f"{name} has no official state_dict layout (to-torch writes the official MAE and SiT)"
  checks = [("shortcut_form", "decay", "the official code has only the decayed identity shortcut"),
            ("schedule_convention", "sublayer", "the official schedule is per sublayer"),
            ("schedule_shape", "linear", "the official schedule is linear")]
  if isinstance(model, sit_lib.SiT):
    checks.insert(0, ("residual_routing", "none", "the official SiT has no routing parameters; its "
                      "decoder blocks add Linear long skips"))
  for field, official, why in checks:
    value = getattr(model, field)
    if value != official:
      return f"{name} with {field}={value!r} has no official state_dict layout ({why})"
  if isinstance(model, mae_lib.MaskedAutoencoder) and model.depth % 2:
    return (f"{name} with depth={model.depth} has no official state_dict layout (the official "
            "skip_id pairs the encoder blocks, so the depth is even)")
  if isinstance(model, sit_lib.SiT) and model.class_dropout_prob <= 0:
    return (f"{name} with class_dropout_prob=0 has no official state_dict layout (the official "
            "label table always holds the null class)")
  return None


def mae_checkpoint(params: Mapping, model: mae_lib.MaskedAutoencoder) -> dict:
  """The official MAE file's contents: ``{'model': state_dict, 'args': {...}}`` (numpy).

  ``args`` is a plain dict (official files hold an argparse Namespace, which ``torch.load``'s
  default ``weights_only=True`` refuses); the official loader reads only ``model``. Besides the
  official ``min_decay``, ``norm_pix_loss``, ``mask_ratio``, ``input_size`` and ``model`` it holds
  the head counts, which the tensors do not show.
  """
  args = dict(model=_official_name(model), input_size=model.img_size,
              mask_ratio=float(model.mask_ratio), norm_pix_loss=bool(model.norm_pix_loss),
              min_decay=float(model.alpha_min), num_heads=model.num_heads,
              decoder_num_heads=model.decoder_num_heads)
  return {"model": mae_to_torch(params, model), "args": args}


def sit_checkpoint(params: Mapping, model: sit_lib.SiT, ema: Optional[Mapping] = None) -> dict:
  """The official SiT file's contents: ``{'model', 'ema', 'args'}`` (numpy state_dicts).

  Sampling (upstream ``find_model``) takes ``ema``; without EMA weights ``ema`` holds ``params``
  too. ``args``: ``model``, ``num_classes``, ``min_sigma``, ``learn_sigma``, ``num_heads``, and the
  official ``image_size`` (pixels, 8 x the latent side) for 4-channel latent models.
  """
  sd = sit_to_torch(params, model)
  args = dict(model=_official_name(model), num_classes=model.num_classes,
              min_sigma=float(model.alpha_min), learn_sigma=bool(model.learn_sigma),
              num_heads=model.num_heads)
  if model.in_channels == 4:
    args["image_size"] = 8 * model.input_size
  return {"model": sd, "ema": sit_to_torch(ema, model) if ema is not None else sd, "args": args}


def write_torch_file(contents: dict, out: str, arg: str = "--out") -> None:
  """``torch.save`` of ``contents`` (numpy arrays become float32/int tensors) through ``epath``."""
  torch = _torch("writing .pth files")
  tensors = {}

  def convert(x):
    if isinstance(x, np.ndarray):
      key = id(x)  # the same array twice (SiT 'model' and 'ema') is stored once
      if key not in tensors:
        a = x.astype(np.float32) if np.issubdtype(x.dtype, np.floating) else x
        tensors[key] = torch.from_numpy(np.ascontiguousarray(a))
      return tensors[key]
    if isinstance(x, Mapping):
      return type(x)((k, convert(v)) for k, v in x.items())
    return x

  p = paths.resolve(out)
  if p.is_dir():
    raise bad_input(arg, out, "is a directory", "a file name for the .pth")
  try:
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("wb") as f:
      torch.save(convert(contents), f)
  except Exception as e:  # pylint: disable=broad-except  (file systems and object stores)
    raise bad_input(arg, out, f"cannot be written ({error_detail(e)})") from None


PARAMS_EXPECTED = ("a training workdir (config.json and checkpoints/, from decay_jax.main) or a "
                   "params directory (model.json and params/, from this converter)")


def _unreadable(e: checkpoint.CheckpointError, what: str, full: str, directory: str) -> InputError:
  """A ``CheckpointError`` about ``what=full`` as the same line about ``--params directory``."""
  text = str(e)
  for prefix in (f"{what}={full!r} is not allowed; ", f"{what}={full!r} "):
    if text.startswith(prefix):
      return bad_input("--params", directory, text[len(prefix):])
  return bad_input("--params", directory, text)


@contextlib.contextmanager
def _quiet_orbax():
  """Holds back library warnings while a checkpoint is read: orbax logs one for each file that a
  corrupt checkpoint lacks before it raises, and the error line already says what is wrong."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _restore(full: str, directory: str, mesh, step: int, key: str):
  try:
    with _quiet_orbax():
      weights, _ = checkpoint.restore_run_params(full, mesh, step, key)
  except checkpoint.CheckpointError as e:
    raise _unreadable(e, "workdir", full, directory) from None
  return jax.device_get(weights)


def read_params(directory: str, step: Optional[int] = None, weights: Optional[str] = None):
  """``(model, params, ema, source)`` of a training workdir or a params directory.

  A workdir gives its newest checkpoint (or ``step``) and the model of its ``config.json``;
  ``weights`` ('model' or 'ema') picks an MAE run's weights; a SiT run gives params and, where the
  run kept them, the EMA (else ``ema`` is ``None``). A params directory gives its one set of
  weights.
  Every failure is one ``InputError`` line naming ``--params`` (or ``--step``, ``--weights``).
  """
  root = paths.resolve(directory)
  full = os.fspath(root)
  try:
    exists, is_dir = root.exists(), root.is_dir()
  except Exception as e:  # pylint: disable=broad-except
    raise bad_input("--params", directory, f"cannot be opened ({error_detail(e)})",
                    PARAMS_EXPECTED) from None
  if not exists:
    raise bad_input("--params", directory, "no such directory", PARAMS_EXPECTED)
  if not is_dir:
    raise bad_input("--params", directory, "is a file, not a directory", PARAMS_EXPECTED)
  if (root / "model.json").exists():
    for name, value in (("--step", step), ("--weights", weights)):
      if value is not None:
        raise bad_input(name, value, f"is for a training workdir; {directory} is a params "
                        "directory (one set of weights)")
    try:
      with _quiet_orbax():
        model, params = checkpoint.load_params(full, "params")
    except checkpoint.CheckpointError as e:
      raise _unreadable(e, "params", full, directory) from None
    except ValueError as e:  # fields that the model class refuses
      raise bad_input("--params", directory, f"its model.json is not a model ({e})",
                      PARAMS_EXPECTED) from None
    return model, jax.device_get(params), None, f"params directory {directory}"
  if not (root / "config.json").exists():
    raise bad_input("--params", directory, "has neither model.json nor config.json",
                    PARAMS_EXPECTED)
  try:
    config = checkpoint.run_config(full)
  except checkpoint.CheckpointError as e:
    raise _unreadable(e, "workdir", full, directory) from None
  except (ValueError, TypeError) as e:
    raise bad_input("--params", directory, f"its config.json is not a training config ({e})",
                    PARAMS_EXPECTED) from None
  try:
    steps = checkpoint.checkpoint_steps(full)
  except Exception as e:  # pylint: disable=broad-except
    raise bad_input("--params", directory, "its checkpoints/ cannot be listed "
                    f"({error_detail(e)})", PARAMS_EXPECTED) from None
  if not steps:
    raise bad_input("--params", directory, "is a training workdir with no finished checkpoint "
                    "in checkpoints/", "a run that saved at least one step")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise bad_input("--step", step, f"{directory} has checkpoints at steps {steps}")
  if config.task == "sit" and weights is not None:
    raise bad_input("--weights", weights, "to-torch of a SiT writes both 'model' (the params) and "
                    "'ema'; leave --weights out")
  mesh = shd.make_mesh(1, 1)  # one device: the weights are read whole, to be written whole
  first = "ema" if weights == "ema" else "params"
  try:
    params = _restore(full, directory, mesh, step, first)
    ema = _restore(full, directory, mesh, step, "ema") if config.task == "sit" else None
  except InputError:
    raise
  except ValueError:  # restore_run_params: the checkpoint holds no such subtree
    if first == "ema":
      raise bad_input("--weights", "ema", f"the checkpoint of step {step} in {directory} holds no "
                      "EMA weights (the run had ema_decay 0)") from None
    ema = None
  source = f"training workdir {directory}, step {step}"
  try:
    embed = params["patch_embed" if config.task == "mae" else "x_embedder"]["proj"]["kernel"]
    model = factory.build_model(config, {"image_size": config.data.image_size,
                                         "channels": int(embed.shape[2])})
  except (KeyError, TypeError, IndexError, ValueError) as e:
    raise bad_input("--params", directory, f"its config.json and checkpoint do not make a model "
                    f"({error_detail(e)})", PARAMS_EXPECTED) from None
  return model, params, ema, source


def check_params_match(model, params: Mapping, arg: str, value: str) -> None:
  """Every leaf of ``params`` has the shape ``model`` gives it, and no leaf is missing or extra."""
  is_mae = isinstance(model, mae_lib.MaskedAutoencoder)
  init = _mae_init_args(model) if is_mae else _sit_init_args(model)
  want = {p: tuple(s.shape) for p, s in abstract_params(model, *init).items()}
  got = {p: tuple(np.shape(v)) for p, v in traverse_util.flatten_dict(dict(params)).items()}
  bad = [f"{'/'.join(p)} {got.get(p, 'missing')} (the model has {want.get(p, 'none')})"
         for p in sorted(set(want) | set(got)) if want.get(p) != got.get(p)]
  if bad:
    raise bad_input(arg, value, f"its weights do not fit its model: {'; '.join(bad[:3])}"
                    f"{' ...' if len(bad) > 3 else ''}")


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------

FROM_TORCH = ("mae", "sit", "mae-upstream")
EXPECTED = {
    "mae": "an official decayed-MAE checkpoint (checkpoint-*.pth with 'model' and 'args')",
    "sit": "an official SiT checkpoint (*.pt with 'model', 'ema' and 'args')",
    "mae-upstream": "an upstream MAE encoder (mae_pretrain_vit_*.pth)",
}
OUT_DIR = "a directory for the Flax params (params/ and model.json)"


def state_dict_entry(ckpt, entry: Optional[str], path: str, expected: str) -> Mapping:
  """``ckpt[entry]`` (or ``ckpt`` itself for ``None``), checked to be a mapping of tensors."""
  if not isinstance(ckpt, Mapping):
    raise bad_input("--checkpoint", path, f"holds a {type(ckpt).__name__}, not a dict of "
                    "state_dicts", expected)
  if entry is not None and entry not in ckpt:
    raise bad_input("--checkpoint", path, f"has no {entry!r} entry (it holds {_keys(ckpt)})",
                    expected)
  sd = ckpt if entry is None else ckpt[entry]
  if not isinstance(sd, Mapping):
    raise bad_input("--checkpoint", path, f"its {entry!r} is a {type(sd).__name__}, not a "
                    "state_dict", expected)
  return sd


def check_out_dir(out: str) -> None:
  p = paths.resolve(out)
  if p.exists() and not p.is_dir():
    raise bad_input("--out", out, "is a file", OUT_DIR)


def _from_torch(a) -> int:
  expected = EXPECTED[a.kind]
  if not a.checkpoint:
    raise bad_input("--checkpoint", None, f"{a.kind} needs the file to convert", expected)
  for name, value in (("--params", a.params), ("--step", a.step)):
    if value is not None:
      raise bad_input(name, value, f"is for to-torch; {a.kind} reads --checkpoint")
  check_out_dir(a.out)
  path = a.checkpoint
  if a.kind == "mae-upstream":
    if a.alpha_min is None:
      raise bad_input("--alpha-min", None, "mae-upstream needs it (the decay of the new model)")
    try:
      model = mae_lib.mae(a.preset, alpha_min=a.alpha_min)
    except ValueError as e:
      arg, value = ("--alpha-min", a.alpha_min) if "alpha_min" in str(e) else ("--preset", a.preset)
      raise bad_input(arg, value, str(e)) from None
  ckpt = read_torch_file(path, "--checkpoint", expected)
  try:
    if a.kind == "mae":
      sd = state_dict_entry(ckpt, "model", path, expected)
      fields = infer_mae_fields(sd)  # first: is it an MAE at all?
      alpha_min = _alpha_min(ckpt, "min_decay", a.alpha_min, path,
                             "the official default is 1.0; README run 0.7")
      # The head counts are not in the tensors; files written by to-torch carry them in args.
      fields.update({k: int(_arg(ckpt, k)) for k in ("num_heads", "decoder_num_heads")
                     if _arg(ckpt, k) is not None})
      model = mae_lib.MaskedAutoencoder(
          alpha_min=alpha_min, norm_pix_loss=bool(_arg(ckpt, "norm_pix_loss", True)), **fields)
      params, report = mae_from_torch(sd, model)
    elif a.kind == "sit":
      weights = a.weights or "ema"
      held = isinstance(ckpt, Mapping) and ("model" in ckpt or "ema" in ckpt)
      other = "model" if weights == "ema" else "ema"
      if held and weights not in ckpt and other in ckpt:
        raise bad_input("--checkpoint", path, f"has no {weights!r} entry (it holds {_keys(ckpt)}); "
                        f"pass --weights {other} for its {other!r} weights", expected)
      sd = state_dict_entry(ckpt, weights if held else None, path, expected)
      fields = infer_sit_fields(sd)
      alpha_min = _alpha_min(ckpt, "min_sigma", a.alpha_min, path, "the official default is 0.8")
      if _arg(ckpt, "num_heads") is not None:
        fields["num_heads"] = int(_arg(ckpt, "num_heads"))
      model = sit_lib.SiT(alpha_min=alpha_min, **fields)
      params, report = sit_from_torch(sd, model)
    else:
      entry = "model" if isinstance(ckpt, Mapping) and "model" in ckpt else None
      sd = state_dict_entry(ckpt, entry, path, expected)
      init = model.init(jax.random.key(0), *_mae_init_args(model))["params"]
      params, report = mae_from_upstream_encoder(sd, model, init)
  except InputError:
    raise
  except (ConversionError, KeyError, TypeError, IndexError, AttributeError) as e:
    detail = (str(e) if isinstance(e, ConversionError)
              else f"its tensors cannot be read ({error_detail(e)})")
    raise bad_input("--checkpoint", path, detail, expected) from None
  except ValueError as e:  # the model refuses the fields read off the file (or --alpha-min)
    if a.alpha_min is not None and "alpha_min" in str(e):
      raise bad_input("--alpha-min", a.alpha_min, str(e)) from None
    raise bad_input("--checkpoint", path, f"its tensors do not make a valid model ({e})",
                    expected) from None
  print(report.summary())
  try:
    checkpoint.save_params(a.out, params, model)
  except Exception as e:  # pylint: disable=broad-except  (file systems and object stores)
    raise bad_input("--out", a.out, f"cannot be written ({error_detail(e)})", OUT_DIR) from None
  print(f"wrote {a.out} ({type(model).__name__}, alpha_min={model.alpha_min})")
  return 0


def _to_torch(a) -> int:
  if not a.params:
    raise bad_input("--params", None, "to-torch needs the weights to write", PARAMS_EXPECTED)
  for name, value in (("--checkpoint", a.checkpoint), ("--alpha-min", a.alpha_min)):
    if value is not None:
      raise bad_input(name, value, "is for the from-torch kinds; to-torch reads --params "
                      "(alpha_min comes from the model)")
  if paths.resolve(a.out).is_dir():
    raise bad_input("--out", a.out, "is a directory", "a file name for the .pth")
  model, params, ema, source = read_params(a.params, a.step, a.weights)
  reason = no_official_layout(model)
  if reason:
    raise bad_input("--params", a.params, reason)
  check_params_match(model, params, "--params", a.params)
  if ema is not None:
    check_params_match(model, ema, "--params", a.params)
  if isinstance(model, mae_lib.MaskedAutoencoder):
    contents = mae_checkpoint(params, model)
    extra = len(model.skip_ids) - model.num_skip_layers
    what = f"'model' ({len(contents['model'])} tensors)"
    if extra:
      what += (f", with official-init values for the {extra} SkipLayers the official model builds "
               "but never uses")
  else:
    contents = sit_checkpoint(params, model, ema)
    what = (f"'model' and 'ema' ({len(contents['model'])} tensors each"
            f"{'' if ema is not None else '; no EMA weights, so ema = model'})")
  write_torch_file(contents, a.out)
  print(f"read {source}: {type(model).__name__} ({_official_name(model)}), "
        f"alpha_min={model.alpha_min}")
  print(f"wrote {a.out}: {what}, 'args' {contents['args']}")
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The converter's command line; returns the exit status (2: bad input, one line on stderr)."""
  p = validate.ArgumentParser(prog="python -m decay_jax.convert",
                              description=__doc__.split("\n")[0])
  p.add_argument("kind", choices=FROM_TORCH + ("to-torch",),
                 help="mae, sit, mae-upstream: official .pth -> Flax; to-torch: Flax -> .pth")
  p.add_argument("--checkpoint", help="from-torch: the official .pth/.pt file (local or gs://)")
  p.add_argument("--params", help="to-torch: a training workdir (its newest checkpoint, or --step) "
                 "or a params directory with model.json")
  p.add_argument("--out", required=True, help="from-torch: directory for the Flax params (orbax) "
                 "+ model.json; to-torch: the .pth file to write")
  p.add_argument("--alpha-min", type=float, default=None,
                 help="override args.min_decay / args.min_sigma (required if the file has no args)")
  p.add_argument("--weights", choices=("model", "ema"), default=None,
                 help="sit: which weights to convert (default ema, as the official sampler); "
                 "to-torch of an MAE run: its params (model, default) or their EMA")
  p.add_argument("--preset", default="B/16",
                 help="mae-upstream: the decayed MAE preset to initialise")
  p.add_argument("--step", type=int, default=None,
                 help="to-torch of a training workdir: the checkpoint step (default: the newest)")
  a = p.parse_args(argv)
  try:
    return _to_torch(a) if a.kind == "to-torch" else _from_torch(a)
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2




def run():
  logs.run_command(main)


if __name__ == "__main__":
  run()
