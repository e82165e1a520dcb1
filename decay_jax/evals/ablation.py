"""Post-training ablations of the residual update: the same parameters in a changed model.

``--ablate`` of ``decay_jax.cli.evaluate`` is a comma-separated list; each entry is one more model
in the report, named ``NAME[entry]``, evaluated like the unchanged model. An entry is one change
or several joined by ``+`` (applied in order):

  ``alphas_one`` (or ``alphas=1``)  every identity coefficient 1 (the standard residual update)
  ``alpha_min=V``, ``shape=S``, ``convention=C``  the spec's schedule with that field changed
                                      (``models.residual.Residual``: alpha_min in (0, 1], shape
                                      linear/cosine, convention sublayer/block)
  ``no_identity=B``                   block ``B``'s identity removed: both its coefficients 0
  ``no_branch=B``                     block ``B``'s branches removed: its ``f`` scaled to 0

Blocks are 0-based in the order of the per-block curves (``model.features``; a U-ViT's
in -> mid -> out), negative ones count from the end. Example:
``--ablate=alphas_one,alpha_min=0.8,no_identity=3,no_branch=5,alpha_min=0.5+shape=cosine``.

How (the coefficients are module constants computed from the spec, never parameters):

* a schedule change is a changed spec (``model.clone(residual=...)``);
* a changed table of coefficients (``alphas_one``, ``no_identity``) is the spec as
  ``TableResidual``, a subclass of ``Residual`` whose ``shortcuts(depth)`` returns the given
  ``(depth, 2)`` table (every block and model reads its coefficients there);
* a learnable model (``shortcut_form='learnable'``) keeps its spec: its parameter ``alpha`` is
  replaced by the ablated table instead;
* ``no_branch`` zeroes the kernel and bias of the block's last layer of each branch
  (``attn/proj`` and ``mlp/fc2``, in the block's slice of scanned parameters), so that
  ``f(x) = 0`` exactly whatever gain or gate multiplies it: ``x <- alpha x``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import jax.numpy as jnp
import numpy as np

from decay_jax.evals import features
from decay_jax.models import schedules
from decay_jax.models.residual import Residual

FLAG = "--ablate"
SCHEDULE_FIELDS = {"alpha_min": "alpha_min", "shape": "schedule_shape",
                   "convention": "schedule_convention"}
BLOCK_OPS = ("no_identity", "no_branch")
BRANCH_LAYERS = (("attn", "proj"), ("mlp", "fc2"))


@dataclasses.dataclass(frozen=True)
class TableResidual(Residual):
  """A ``Residual`` whose coefficients are the fixed ``table`` (``depth`` rows of (attention,
  MLP) identity coefficients) instead of its schedule; the update is the spec's otherwise."""
  table: Tuple[Tuple[float, float], ...] = ()

  def shortcuts(self, depth: int) -> schedules.Shortcuts:
    if len(self.table) != depth:
      raise ValueError(f"the ablated table has {len(self.table)} rows for {depth} blocks")
    alphas = np.asarray(self.table, np.float64)
    alphas.setflags(write=False)
    return schedules.Shortcuts(alphas, branch_scale=self.branch_scale, learnable=False)


def _bad(entry: str, why: str) -> ValueError:
  return ValueError(f"{FLAG} entry {entry!r} is not allowed; {why}")


def parse(spec) -> List[Tuple[str, List[Tuple[str, object]]]]:
  """``[(label, [(op, value), ...]), ...]`` of the flag's entries (checked; one-line errors)."""
  entries = list(spec) if isinstance(spec, (list, tuple)) else str(spec).split(",")
  out = []
  for entry in (e.strip() for e in entries):
    if not entry:
      continue
    ops, labels = [], []
    for part in entry.split("+"):
      key, _, value = part.strip().partition("=")
      if key == "alphas_one" and not value or key == "alphas" and value in ("1", "1.0"):
        ops.append(("alphas_one", None))
        labels.append("alphas=1")
      elif key in SCHEDULE_FIELDS:
        value = value.strip()
        if key == "alpha_min":
          try:
            value = float(value)
          except ValueError:
            raise _bad(entry, "alpha_min takes a number in (0, 1]") from None
        ops.append((key, value))
        labels.append(f"{key}={value:g}" if key == "alpha_min" else f"{key}={value}")
      elif key in BLOCK_OPS:
        try:
          value = int(value)
        except ValueError:
          raise _bad(entry, f"{key} takes a block index (0-based)") from None
        ops.append((key, value))
        labels.append(f"{key}={value}")
      else:
        raise _bad(entry, "give alphas_one, alpha_min=V, shape=S, convention=C, no_identity=B or "
                   "no_branch=B, several joined by '+'")
    out.append(("+".join(labels), ops))
  names = [label for label, _ in out]
  if len(set(names)) != len(names):
    raise ValueError(f"{FLAG}={spec!r} is not allowed; it repeats an entry")
  return out


def _block_slot(model, params, b: int):
  """``(path, index)`` of block ``b``'s parameters (the model's ``block_slot``): a subtree and its
  slice (None: unscanned)."""
  if hasattr(model, "block_slot"):
    path, index = model.block_slot(b)
    if path[0] in params:
      return path, index
  raise ValueError(f"{FLAG} no_branch is not allowed on {type(model).__name__}: its blocks' "
                   "parameters are not known here")


def _zero_branch(model, params, b: int):
  """``params`` with block ``b``'s ``attn/proj`` and ``mlp/fc2`` kernels and biases zeroed."""
  path, index = _block_slot(model, params, b)
  params = dict(params)
  node = params
  for key in path:
    child = dict(node[key])
    node[key] = child
    node = child
  for sub, layer in BRANCH_LAYERS:
    if sub not in node or layer not in node[sub]:
      raise ValueError(f"{FLAG} no_branch={b} is not allowed on {type(model).__name__}: block "
                       f"{b} has no {sub}/{layer} layer")
    node[sub] = dict(node[sub])
    node[sub][layer] = {
        k: (jnp.zeros_like(v) if index is None else jnp.asarray(v).at[index].set(0))
        for k, v in node[sub][layer].items()}
  return params


def apply(model, params, ops: List[Tuple[str, object]]):
  """``(model, params, info)``: ``model`` and ``params`` ablated by ``ops`` (``parse``); ``info``
  the JSON note of the report (the coefficients in use, the removed branches)."""
  spec = getattr(model, "block_residual", model.residual)
  if getattr(model, "mode", None) == "uvit_original" and any(o not in ("no_branch",)
                                                             for o, _ in ops):
    raise ValueError(f"{FLAG} is not allowed to change coefficients of a U-ViT in mode "
                     "'uvit_original' (its blocks have none); use no_branch only")
  base = model.shortcuts
  learnable = base.learnable and "alpha" in params
  table = np.array(params["alpha"] if learnable else base.alphas, np.float64)
  rows = table.shape[0]
  blocks = features.num_blocks(model)
  spec_changed = table_changed = False
  no_branch = []
  for op, value in ops:
    if op in SCHEDULE_FIELDS:
      try:  # the spec checks the value
        spec = dataclasses.replace(spec, **{SCHEDULE_FIELDS[op]: value})
      except ValueError as e:
        raise ValueError(f"{FLAG} {op}={value}: {e}") from None
      table = np.array(spec.shortcuts(rows).alphas, np.float64)
      spec_changed = True
    elif op == "alphas_one":
      table[:] = 1.0
      table_changed = True
    else:
      if not -blocks <= value < blocks:
        raise ValueError(f"{FLAG} {op}={value} is not allowed; the model has {blocks} blocks "
                         f"(0..{blocks - 1})")
      b = value % blocks
      if op == "no_identity":
        table[b] = 0.0
        table_changed = True
      else:
        no_branch.append(b)
  if getattr(model, "routing_decay", None) == "null" and (table == 0).any():
    raise ValueError(f"{FLAG} no_identity is not allowed with routing_decay='null' (its null "
                     "logit needs alpha > 0)")
  if learnable:
    params = dict(params, alpha=jnp.asarray(table, jnp.float32))
  elif table_changed:
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(Residual)}
    model = model.clone(residual=TableResidual(**fields, table=tuple(map(tuple, table.tolist()))))
  elif spec_changed:
    model = model.clone(residual=spec)
  for b in no_branch:
    params = _zero_branch(model, params, b)
  info = {"alphas": table.tolist(), "alpha_eff": float(np.prod(table)),
          "no_branch": sorted(set(no_branch)), "learnable": bool(learnable)}
  return model, params, info


def variants(name: str, model, params, spec) -> List[Tuple[str, object, object, Dict]]:
  """``[(NAME[entry], model, params, info)]`` for every entry of the flag value ``spec``."""
  out = []
  for label, ops in parse(spec):
    m, p, info = apply(model, params, ops)
    out.append((f"{name}[{label}]", m, p, dict(info, of=name, entry=label)))
  return out
