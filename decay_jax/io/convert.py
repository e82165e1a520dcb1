"""Convert between official PyTorch state_dicts and decay-jax Flax parameters, both directions.

Supported sources (docs/official_code.md 1.2, 1.13, 4.2):
  * official decayed-MAE checkpoints (``.pth`` with ``model`` and ``args``; ``alpha_min`` comes from
    ``args.min_decay``); ViT-L/H checkpoints carry SkipLayers the forward never uses: they are
    reported and dropped, and re-created with the official init on the way back;
  * official SiT checkpoints (``model`` and ``ema``; ``alpha_min`` from ``args.min_sigma``);
  * upstream MAE ``mae_pretrain_vit_*.pth`` encoders, as an initialisation of the decayed encoder
    (the report lists what was loaded and what was left at its initial value).

The conversion is a table of rules (torch key, Flax path, layer index, layout). Unknown keys, missing
keys and mis-shaped tensors raise ``ConversionError`` naming the key; nothing is skipped silently.
Fixed sin-cos tables are module constants here: the checkpoint's copy is checked against ours.

Command line (needs torch)::

    python -m decay_jax.io.convert mae --checkpoint checkpoint-799.pth --out DIR
    python -m decay_jax.io.convert sit --checkpoint 0400000.pt --out DIR [--weights ema]
    python -m decay_jax.io.convert mae-upstream --checkpoint mae_pretrain_vit_base.pth --out DIR \
        --preset B/16 --alpha-min 0.6
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

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


def load_torch_checkpoint(path: str) -> dict:
  """``torch.load`` restricted to tensors and argparse Namespaces (official files hold ``args``)."""
  try:
    import torch
  except ImportError:
    raise SystemExit("reading .pth files needs PyTorch: pip install torch==2.13.0 (CPU is enough)")
  with torch.serialization.safe_globals([argparse.Namespace]):
    return torch.load(path, map_location="cpu", weights_only=True)


def _arg(ckpt: Mapping, name: str, override: Optional[float], what: str) -> float:
  if override is not None:
    return override
  args = ckpt.get("args")
  value = getattr(args, name, None) if args is not None else None
  if value is None and isinstance(args, Mapping):
    value = args.get(name)
  if value is None:
    raise ConversionError(f"the checkpoint has no args.{name}; pass --alpha-min ({what})")
  return float(value)


def main(argv: Optional[Sequence[str]] = None) -> int:

  p = argparse.ArgumentParser(prog="python -m decay_jax.io.convert", description=__doc__.split("\n")[0])
  p.add_argument("kind", choices=("mae", "sit", "mae-upstream"))
  p.add_argument("--checkpoint", required=True, help="official .pth/.pt file")
  p.add_argument("--out", required=True, help="directory for the Flax params (orbax) + model.json")
  p.add_argument("--alpha-min", type=float, default=None,
                 help="override args.min_decay / args.min_sigma (required if the file has no args)")
  p.add_argument("--weights", choices=("model", "ema"), default="ema",
                 help="SiT: which weights to convert (default ema, as the official sampler)")
  p.add_argument("--preset", default="B/16", help="mae-upstream: the decayed MAE preset to initialise")
  a = p.parse_args(argv)
  try:
    ckpt = load_torch_checkpoint(a.checkpoint)
    if a.kind == "mae":
      alpha_min = _arg(ckpt, "min_decay", a.alpha_min, "the official default is 1.0; README run 0.7")
      fields = infer_mae_fields(ckpt["model"])
      model = mae_lib.MaskedAutoencoder(alpha_min=alpha_min, norm_pix_loss=bool(
          getattr(ckpt.get("args"), "norm_pix_loss", True)), **fields)
      params, report = mae_from_torch(ckpt["model"], model)
    elif a.kind == "sit":
      alpha_min = _arg(ckpt, "min_sigma", a.alpha_min, "the official default is 0.8")
      sd = ckpt[a.weights] if a.weights in ckpt else ckpt
      model = sit_lib.SiT(alpha_min=alpha_min, **infer_sit_fields(sd))
      params, report = sit_from_torch(sd, model)
    else:
      if a.alpha_min is None:
        raise ConversionError("mae-upstream needs --alpha-min (the decay of the new model)")
      model = mae_lib.mae(a.preset, alpha_min=a.alpha_min)
      init = model.init(jax.random.key(0), *_mae_init_args(model))["params"]
      params, report = mae_from_upstream_encoder(ckpt.get("model", ckpt), model, init)
  except ConversionError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(report.summary())
  checkpoint.save_params(a.out, params, model)
  print(f"wrote {a.out} ({type(model).__name__}, alpha_min={model.alpha_min})")
  return 0


def run():
  sys.exit(main())


if __name__ == "__main__":
  run()
