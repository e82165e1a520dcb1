"""A SiT started from a trained SiT's parameters: the same model, or routing added to a plain SiT.

docs/routing.md "Routing added to a pretrained SiT". ``start_from(source_params, source, model)``
maps every parameter of ``source`` into ``model``:

  * the same architecture (every field but the execution ones: dtype, attention, remat): the
    parameters, copied as they are (continuing a plain run is the baseline of a routed fine-tune);
  * ``source`` plain (``residual_routing='plain'``: DiT/REPA, no long skip) and ``model`` routed
    (``mirror``, ``fused_*``): ``routed_from_plain``. The blocks of both are ``RoutedTrunk``'s
    unrolled ``enc_XX``/``dec_XX`` with the same sublayers, so every plain parameter is copied
    exactly (embeddings, blocks, final layer, a learnable ``alpha``, REPA's projectors unless the
    model has none: they feed only REPA's alignment loss); the new ones start at zero:
    ``route_attn``/``route_mlp`` (``w = 0``: uniform softmax over the candidates) and, with
    ``routing_gate``, ``route_attn_gate``/``route_mlp_gate`` (``g = 0``).

Two starts follow from ``model.routing_gate``:
  * **False, the paper's start as far as it is public** (spec 5: ``w = 0``; how the paper
    initialised its fine-tune of REPA SiT-XL/2 is not public): every routed sublayer averages
    its candidates uniformly, which changes the trained function at step 0 (a mirror decoder
    sublayer reads ``(x + x_{K-j+1}) / 2`` instead of ``x``);
  * **True, the function-preserving start** (our default for fine-tuning):
    ``x~ = u_0 + g (R(U) - u_0)`` with ``g = 0`` is ``x``, so the routed model computes the plain
    model's function at step 0 (exactly: the same operations on the same parameters).
    ``dL/dg = <dL/dx~, R(U) - x>`` is non-zero at once (trained sources differ from the stream);
    ``dL/dw`` carries a factor ``g``, so ``w`` gets gradient from the second step on (Adam's
    update does not depend on its scale).

Refused, in one line: a source with the official decayed SiT's long-skip Linears (``'none'``: a
routed SiT has no place for them, dropping them changes the function), targets ``static_skip`` and
``attnres`` (no stream to route into: attnres drops the identity path), different sizes or residual
specs, and the function-preserving start where the decay acts inside the routing (``routing_decay``
``current``, ``encoder`` or ``null`` with ``alpha_min < 1``: the routed sublayer's identity
coefficient is then not the plain sublayer's).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple

import flax
import jax.numpy as jnp

from decay_jax.models import routing
from decay_jax.models import sit as sit_lib

# Fields that change how a model runs, not what it computes.
EXECUTION = ("dtype", "attention_impl", "remat_policy")
# REPA's projectors (SiT.repa_*) feed only its alignment loss: a model without them drops them.
REPA_FIELDS = ("repa_depth", "repa_dims", "repa_hidden")
ROUTING = ("residual_routing", "routing_decay", "routing_gate")
TARGETS = routing.GATED  # routed variants with a stream
NEW_PARAMS = tuple(f"route_{s}{g}" for s in routing.SUBLAYERS for g in ("", "_gate"))


def _differences(a: sit_lib.SiT, b: sit_lib.SiT,
                 skip: Tuple[str, ...]) -> Dict[str, Tuple[Any, Any]]:
  """``{field: (a's, b's)}`` of the fields that differ (the residual spec by its flat fields)."""
  out = {}
  for f in dataclasses.fields(a):
    if f.name in ("parent", "name") + skip:
      continue
    va, vb = getattr(a, f.name), getattr(b, f.name)
    if f.name == "residual":
      fa, fb = va.fields(), vb.fields()
      out.update({k: (fa[k], fb.get(k)) for k in fa if fa[k] != fb.get(k)})
    elif va != vb:
      out[f.name] = (va, vb)
  return out


def _ignored(model: sit_lib.SiT) -> Tuple[str, ...]:
  """Fields a start ignores: the execution ones, ``drop_path``, and REPA's where ``model`` has no
  projectors."""
  return EXECUTION + ("drop_path",) + (() if getattr(model, "repa_depth", 0) else REPA_FIELDS)


def _kept(source_params, model: sit_lib.SiT) -> Dict[Tuple[str, ...], Any]:
  """The source's parameters as a flat dict, REPA's projectors left out if ``model`` has none."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(source_params))
  if getattr(model, "repa_depth", 0):
    return flat
  return {k: v for k, v in flat.items() if not k[0].startswith("projectors")}


def _fields_text(diff: Dict[str, Tuple[Any, Any]]) -> str:
  return ", ".join(f"{k} {a!r} (model: {b!r})" for k, (a, b) in sorted(diff.items()))


def check_routed_start(plain: sit_lib.SiT, routed: sit_lib.SiT) -> None:
  """One-line ValueErrors for a start of ``routed`` from ``plain``'s parameters."""
  if not isinstance(plain, sit_lib.SiT):
    raise ValueError(f"init_from holds a {type(plain).__name__}; a SiT starts from a SiT")
  if plain.residual_routing == "none":
    raise ValueError("init_from is an official decayed SiT (residual_routing='none'); its "
                     "long-skip Linears have no place in a routed SiT: start routing from a "
                     "plain SiT (residual_routing='plain')")
  if plain.residual_routing != "plain":
    raise ValueError(f"init_from has residual_routing={plain.residual_routing!r}; routing is added "
                     "to a plain SiT (residual_routing='plain'), or the same model continues")
  if routed.residual_routing not in TARGETS:
    raise ValueError(f"residual_routing={routed.residual_routing!r} is not allowed when starting "
                     f"from a plain SiT; it must be one of {', '.join(TARGETS)}")
  diff = _differences(plain, routed, _ignored(routed) + ROUTING)
  if diff:
    raise ValueError(f"init_from's SiT differs from the model in {_fields_text(diff)}; set the "
                     "model's fields to the pre-trained ones")
  if (routed.routing_gate and routed.alpha_min < 1.0
      and routed.routing_decay in ("current", "encoder", "null")):
    raise ValueError(f"routing_decay={routed.routing_decay!r} with alpha_min={routed.alpha_min} "
                     "cannot start function-preserving (the decay acts inside the routing); use "
                     "routing_decay='after'")


def routed_from_plain(plain_params, plain: sit_lib.SiT, routed: sit_lib.SiT):
  """Parameters of ``routed`` (mirror, fused_*) from a plain SiT's: every plain parameter copied,
  the routing weights ``w`` and gates ``g`` at zero (module docstring)."""
  check_routed_start(plain, routed)
  source = _kept(plain_params, routed)
  target = flax.traverse_util.flatten_dict(flax.core.unfreeze(sit_lib.abstract_params(routed)))
  out = {}
  for path, leaf in target.items():
    if path in source:
      if tuple(source[path].shape) != tuple(leaf.shape):
        raise ValueError(f"init_from's parameter {'/'.join(path)} has shape "
                         f"{tuple(source[path].shape)}, the model's {tuple(leaf.shape)}")
      out[path] = source[path]
    elif path[-1] in NEW_PARAMS:
      out[path] = jnp.zeros(leaf.shape, leaf.dtype)
    else:
      raise ValueError(f"init_from has no parameter {'/'.join(path)} (expected a plain SiT's)")
  unused = sorted("/".join(p) for p in source if p not in target)
  if unused:
    raise ValueError(f"init_from's parameters {', '.join(unused[:3])}"
                     f"{' ...' if len(unused) > 3 else ''} have no place in the model")
  return flax.traverse_util.unflatten_dict(out)


def start_from(source_params, source, model: sit_lib.SiT):
  """``model``'s first parameters from ``source``'s: the same SiT's (as they are; ``drop_path``, the
  execution fields and REPA's projectors, dropped, may differ) or ``routed_from_plain``."""
  if not isinstance(source, sit_lib.SiT):
    raise ValueError(f"init_from holds a {type(source).__name__}; a SiT starts from a SiT")
  diff = _differences(source, model, _ignored(model))
  if not diff:
    return flax.traverse_util.unflatten_dict(_kept(source_params, model))
  if source.residual_routing == model.residual_routing:
    raise ValueError(f"init_from's SiT differs from the model in {_fields_text(diff)}; set the "
                     "model's fields to the pre-trained ones")
  return routed_from_plain(source_params, source, model)


def describe(source, model: sit_lib.SiT) -> str:
  """One line for the log: how ``model`` starts from ``source``."""
  if source.residual_routing == model.residual_routing:
    return f"the same SiT ({model.residual_routing}), every parameter copied"
  start = ("function-preserving (gates g = 0)" if model.routing_gate
           else "the paper's (w = 0: uniform routing)")
  n = routing.extra_params(model.residual_routing, model.depth, model.dim, model.routing_gate)
  return (f"{model.residual_routing} routing added to a plain SiT, every plain parameter copied, "
          f"{n} new routing parameters at zero; start: {start}")
