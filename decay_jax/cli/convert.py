"""Convert between official PyTorch state_dicts and decay-jax Flax parameters, both directions.

The converter's command line (needs torch; paths may be ``gs://``)::

    python -m decay_jax.cli.convert mae --checkpoint checkpoint-799.pth --out DIR
    python -m decay_jax.cli.convert sit --checkpoint 0400000.pt --out DIR [--weights ema]
    python -m decay_jax.cli.convert repa --checkpoint last.pt --out DIR [--encoder-depth 8]
    python -m decay_jax.cli.convert mae-upstream --checkpoint mae_pretrain_vit_base.pth --out DIR \
        --preset B/16 --alpha-min 0.6
    python -m decay_jax.cli.convert to-torch --params WORKDIR_OR_PARAMS_DIR --out FILE.pth \
        [--step N]

``mae``, ``sit``, ``repa`` (REPA's SiT, ``io.convert_repa``) and ``mae-upstream`` read an
official (or upstream MAE) file and write orbax params
plus ``model.json``; ``to-torch`` reads a training workdir's checkpoint or a params directory and
writes the file the official code loads (``io.official`` holds the layouts, ``io.sizes`` reads a
file's model sizes, ``io.torch_files`` the tensors-only reading, ``io.flax_params`` the Flax side).
Every bad input is one line naming the argument, exit status 2. ``python -m decay_jax.cli.convert`` and
the console script ``decay-jax-convert`` are the same command.
"""

from __future__ import annotations

import sys
from typing import Mapping, Optional, Sequence

import jax

from decay_jax import logs, paths, validate
from decay_jax.io import convert_repa
from decay_jax.io.flax_params import PARAMS_EXPECTED, check_params_match, read_params
from decay_jax.io.inputs import OUT_DIR, bad_input, check_out_dir, error_detail
from decay_jax.io.official import (mae_checkpoint, mae_from_torch, mae_from_upstream_encoder,
                                   mae_init_args, no_official_layout, official_name,
                                   sit_checkpoint, sit_from_torch)
from decay_jax.io.rules import ConversionError
from decay_jax.io.sizes import infer_mae_fields, infer_sit_fields
from decay_jax.io.torch_files import read_torch_file, write_torch_file
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib
from decay_jax.train import checkpoint
from decay_jax.validate import InputError

FROM_TORCH = ("mae", "sit", "repa", "mae-upstream")
EXPECTED = {
    "mae": "an official decayed-MAE checkpoint (checkpoint-*.pth with 'model' and 'args')",
    "sit": "an official SiT checkpoint (*.pt with 'model', 'ema' and 'args')",
    "repa": "REPA's SiT (its release last.pt, or a training checkpoint with 'ema' and 'model')",
    "mae-upstream": "an upstream MAE encoder (mae_pretrain_vit_*.pth)",
}


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


def _from_torch(a) -> int:
  expected = EXPECTED[a.kind]
  if not a.checkpoint:
    raise bad_input("--checkpoint", None, f"{a.kind} needs the file to convert", expected)
  for name, value in (("--params", a.params), ("--step", a.step)):
    if value is not None:
      raise bad_input(name, value, f"is for to-torch; {a.kind} reads --checkpoint")
  if a.encoder_depth is not None and a.kind != "repa":
    raise bad_input("--encoder-depth", a.encoder_depth, "is for repa")
  if a.kind == "repa" and a.alpha_min is not None:
    raise bad_input("--alpha-min", a.alpha_min, "REPA's SiT has no decay (alpha_min is 1)")
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
    elif a.kind == "repa":
      sd, what = convert_repa.repa_state_dict(ckpt, a.weights)
      depth = convert_repa.encoder_depth_of(ckpt, a.encoder_depth)
      print(f"read {what}; aligned block (encoder_depth) {depth}")
      model, params, report = convert_repa.repa_from_torch(sd, depth)
    else:
      entry = "model" if isinstance(ckpt, Mapping) and "model" in ckpt else None
      sd = state_dict_entry(ckpt, entry, path, expected)
      init = model.init(jax.random.key(0), *mae_init_args(model))["params"]
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
  print(f"read {source}: {type(model).__name__} ({official_name(model)}), "
        f"alpha_min={model.alpha_min}")
  print(f"wrote {a.out}: {what}, 'args' {contents['args']}")
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The converter's command line; returns the exit status (2: bad input, one line on stderr)."""
  p = validate.ArgumentParser(prog="python -m decay_jax.cli.convert",
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
                 help="sit, repa: which weights to convert (default ema, as the official sampler); "
                 "to-torch of an MAE run: its params (model, default) or their EMA")
  p.add_argument("--preset", default="B/16",
                 help="mae-upstream: the decayed MAE preset to initialise")
  p.add_argument("--encoder-depth", type=int, default=None,
                 help="repa: the block the projectors read (default: args.encoder_depth of a "
                 "training checkpoint, else REPA's 8)")
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
