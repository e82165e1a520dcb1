"""FLOPs and bytes of a compiled XLA program, read off its optimised HLO text, with every loop body
counted once per trip.

XLA's ``compiled.cost_analysis()`` sums each instruction once, so the body of a ``while`` loop (a
scanned stack of blocks, forward and backward) is counted once however many layers it runs: for a
24-block SiT-XL/2 its ``flops`` are about a twelfth of the model's. This module redoes the sum on
the optimised HLO (``compiled.as_text()``) with each computation weighted by how often it runs:

  weight(ENTRY) = 1;  weight(body, condition of a while in C) = weight(C) x trips
  (trips: the bound ``N`` of the condition's ``i < N`` on the loop counter);
  weight(computation called by a fusion / call / conditional / async op in C) = weight(C).

Per instruction outside fused computations (a fusion, a copy, a collective: what moves data
between HBM and the cores):

  bytes = the operands read + the result written, as stored (tiled layouts padded: an
          ``f32[16,5,32]{...:T(8,128)}`` occupies 16 x 8 x 128 words); an operand the fusion only
          slices counts its slices, and a stacked buffer that a dynamic-update-slice at the root
          writes in place (a scan storing one layer's activations) counts only the update;
  flops = 2 x multiply-adds of each convolution and dot it runs (XLA:TPU writes dots as
          convolutions; a batched matmul becomes a convolution whose window slides over the batch
          with holes, which are not counted) plus one per result element of its elementwise ops
          and one per input element of its reductions; transcendentals apart.

With every weight 1 the flops equal XLA's own to rounding; the bytes follow XLA's closely for some
programs and exceed them for others (docs/tpu.md gives the agreement per config; the tests check
the counts on programs whose counts are known). ``Cost.seconds`` is a roofline per instruction, ``max(flops / peak, bytes /
bandwidth)``, summed; ``perf.tpu`` scales XLA's own ``optimal_seconds`` by the ratio of the
weighted to the unweighted roofline.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Dict, List, Optional, Tuple

import numpy as np

from decay_jax.perf import trace_table

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "s4": 0.5, "u4": 0.5, "token": 0}
# Instructions that move no data of their own: their operands are counted where they are used.
NO_BYTES = frozenset((
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
    "conditional", "after-all", "partition-id", "replica-id", "copy-done", "opt-barrier",
    "all-gather-done", "all-reduce-done", "collective-permute-done", "async-done",
    "async-update", "send-done", "recv-done", "add-dependency", "domain"))
COLLECTIVES = frozenset((
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
    "all-reduce-start", "all-gather-start", "collective-permute-start", "send", "recv",
    "ragged-all-to-all", "collective-broadcast"))
TRANSCENDENTAL = frozenset((
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "sqrt",
    "rsqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf"))
ELEMENTWISE = frozenset((
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare",
    "select", "clamp", "and", "or", "xor", "not", "remainder", "sign", "floor", "ceil",
    "round-nearest-even", "round-nearest-afz", "shift-left", "shift-right-logical",
    "shift-right-arithmetic", "convert", "is-finite", "real", "imag"))

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^{}]*\})?")
_HEAD = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = ")
_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|branch_computations)=\{?%([\w.\-]+)")


@dataclasses.dataclass
class Instruction:
  """One HLO instruction: its result's array leaves ``(dtype, dims)``, operand names, the text
  inside its parentheses (``args``: a constant's literal) and after them (``attrs``)."""
  name: str
  opcode: str
  arrays: List[Tuple[str, Tuple[int, ...], int]]
  operands: List[str]
  args: str
  attrs: str
  computation: str
  root: bool

  @property
  def bytes(self) -> float:
    """Bytes of the result as stored (tiled layouts padded)."""
    return sum(DTYPE_BYTES.get(d, 4) * p for d, _, p in self.arrays)

  @property
  def elements(self) -> int:
    """Elements of the result (unpadded)."""
    return sum(math.prod(s) for _, s, _ in self.arrays)

  def dims(self, key: str) -> Tuple[int, ...]:
    """An attribute such as ``lhs_contracting_dims={1,2}`` as a tuple (empty if absent)."""
    m = re.search(key + r"=\{([0-9,]*)\}", self.attrs)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at ``text[start]``."""
  opening = text[start]
  closing = {"(": ")", "{": "}", "[": "]"}[opening]
  depth = 0
  for i in range(start, len(text)):
    if text[i] == opening:
      depth += 1
    elif text[i] == closing:
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def _split_type(rest: str) -> Tuple[str, str]:
  """``(type text, text after it)`` of an instruction's right-hand side."""
  end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
  return rest[:end], rest[end:].lstrip()


def _padded(dims: Tuple[int, ...], layout: str) -> int:
  """Elements of an array as its tiled layout stores it: with ``{2,0,1:T(8,128)}`` (XLA:TPU) the
  most-minor dimension is padded to a multiple of 128 and the next one to a multiple of 8 (the
  first tile; later tiles such as bf16's ``(2,1)`` pack within it). Untiled layouts: unpadded."""
  m = re.match(r"\{([0-9,]*):T\(([0-9,]+)\)", layout or "")
  if not m or not dims:
    return math.prod(dims)
  order = [int(d) for d in m.group(1).split(",") if d] or list(reversed(range(len(dims))))
  tile = [int(t) for t in m.group(2).split(",")]
  padded = list(dims)
  for t, d in zip(reversed(tile), order):  # the tile's last entry pads the most-minor dimension
    padded[d] = -(-padded[d] // t) * t
  return math.prod(padded)


def _arrays(type_text: str) -> List[Tuple[str, Tuple[int, ...], int]]:
  """Array leaves of a type: ``(dtype, dims, elements as stored)``."""
  return [(dtype, dims, _padded(dims, layout)) for dtype, dims, layout in
          ((d, tuple(int(x) for x in s.split(",") if x), l) for d, s, l in _ARRAY.findall(type_text))]


@dataclasses.dataclass
class Module:
  """An HLO module: instructions by (module-unique) name, computations in order, the entry's name."""
  instructions: Dict[str, Instruction]
  computations: Dict[str, List[Instruction]]
  entry: str


def parse(text: str) -> Module:
  """An optimised HLO module's text (``compiled.as_text()``) as a ``Module``."""
  instructions: Dict[str, Instruction] = {}
  computations: Dict[str, List[Instruction]] = collections.defaultdict(list)
  entry, current = "", ""
  for line in text.splitlines():
    head = _HEAD.match(line)
    if head is None:
      c = _COMPUTATION.match(line)
      if c is not None:
        current = c.group(2)
        entry = current if c.group(1) else entry
      continue
    type_text, rest = _split_type(line[head.end():])
    paren = rest.find("(")
    if paren < 0:
      continue
    end = _balanced(rest, paren)
    args = rest[paren + 1:end - 1]
    ins = Instruction(head.group(2), rest[:paren], _arrays(type_text),
                      re.findall(r"%([\w.\-]+)", args), args, rest[end:], current,
                      bool(head.group(1)))
    instructions[ins.name] = ins
    computations[current].append(ins)
  return Module(instructions, dict(computations), entry)


def trip_count(module: Module, condition: str, loop: Optional[Instruction] = None
               ) -> Optional[int]:
  """Trips of a while loop: XLA:GPU's ``known_trip_count`` annotation, else the ``N`` of a loop
  condition whose root is ``i < N`` with ``N`` a constant (the form of ``lax.scan`` and
  ``fori_loop`` loops on TPU); ``None`` for any other form."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs) if loop else None
  if known:
    return int(known.group(1))
  for ins in module.computations.get(condition, ()):
    if ins.root and ins.opcode == "compare" and "direction=LT" in ins.attrs:
      bound = module.instructions.get(ins.operands[-1]) if ins.operands else None
      if bound is not None and bound.opcode == "constant" and re.fullmatch(r"-?\d+", bound.args):
        return int(bound.args)
  return None


def weights(module: Module) -> Tuple[Dict[str, float], Dict[str, Optional[int]], set]:
  """``(weight per computation, trips per while instruction, fused computations)``: how many
  times each computation runs per execution of the entry (see the module docstring)."""
  weight: Dict[str, float] = {module.entry: 1.0}
  trips: Dict[str, Optional[int]] = {}
  fused: set = set()
  order = [module.entry]
  while order:
    comp = order.pop()
    for ins in module.computations.get(comp, ()):
      called = _CALLS.findall(ins.attrs)
      if not called:
        continue
      for kind, name in called:
        if kind == "to_apply":  # a reduction's scalar function: counted by its caller
          continue
        w = weight[comp]
        if ins.opcode == "while":
          n = trip_count(module, dict(called).get("condition", ""), ins)
          trips[ins.name] = n
          w *= n if n else 1
        if ins.opcode == "fusion":
          fused.add(name)
        if name not in weight:
          weight[name] = w
          order.append(name)
  for comp in list(module.computations):  # computations only reached through fusions' fusions
    weight.setdefault(comp, 0.0)
  return weight, trips, fused


def _window(attrs: str) -> Dict[str, List[Tuple[int, ...]]]:
  """A convolution's ``window={size=3x3 stride=1x1 pad=1_1x1_1 lhs_dilate=... rhs_dilate=...}``."""
  m = re.search(r"window=\{([^}]*)\}", attrs)
  out: Dict[str, List[Tuple[int, ...]]] = {}
  for item in (m.group(1).split() if m else ()):
    key, value = item.split("=")
    out[key] = [tuple(int(v) for v in part.split("_")) for part in value.split("x")]
  return out


def _valid_taps(n: int, o: int, k: int, stride: int, lo: int, lhs_dilate: int,
                rhs_dilate: int) -> int:
  """(output position, kernel position) pairs of one spatial dimension that read a real input
  element: not padding, not a hole of the input's dilation. Batched dots that XLA:TPU writes as
  convolutions put their batch in such a dimension (window = batch, lhs_dilate = batch)."""
  dilated = (n - 1) * lhs_dilate + 1
  idx = (np.arange(o)[:, None] * stride + np.arange(k)[None, :] * rhs_dilate) - lo
  return int(np.count_nonzero((idx >= 0) & (idx < dilated) & (idx % lhs_dilate == 0)))


def contracted_macs(module: Module, ins: Instruction) -> float:
  """Multiply-adds of a dot or convolution, padding and dilation holes left out (as XLA counts)."""
  lhs = module.instructions.get(ins.operands[0]) if ins.operands else None
  rhs = module.instructions.get(ins.operands[1]) if len(ins.operands) > 1 else None
  if lhs is None or rhs is None or not lhs.arrays or not rhs.arrays:
    return 0.0
  if ins.opcode == "dot":
    shape = lhs.arrays[0][1]
    return float(ins.elements * math.prod(shape[d] for d in ins.dims("lhs_contracting_dims")))
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
  if not labels:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  x, kernel, out = lhs.arrays[0][1], rhs.arrays[0][1], ins.arrays[0][1]
  w = _window(ins.attrs)
  spatial = sorted(c for c in rhs_l if c.isdigit())
  taps = 1
  for i, d in enumerate(spatial):
    get = lambda key, default: w[key][i][0] if key in w else default
    lo = w["pad"][i][0] if "pad" in w else 0
    taps *= _valid_taps(x[lhs_l.index(d)], out[out_l.index(d)], kernel[rhs_l.index(d)],
                        get("stride", 1), lo, get("lhs_dilate", 1), get("rhs_dilate", 1))
  batch = out[out_l.index("b")]
  return float(batch * kernel[rhs_l.index("o")] * kernel[rhs_l.index("i")] * taps)


def own_flops(module: Module, ins: Instruction) -> Tuple[float, float]:
  """``(flops, transcendentals)`` of one instruction; a fusion's are its fused computation's
  (nested fusions included)."""
  if ins.opcode == "fusion":
    flops = trans = 0.0
    for body in ins_calls(ins):
      for inner in module.computations.get(body, ()):
        f, t = own_flops(module, inner)
        flops, trans = flops + f, trans + t
    return flops, trans
  if ins.opcode in ("dot", "convolution"):
    return 2.0 * contracted_macs(module, ins), 0.0
  if _is_gemm_call(ins):  # XLA:GPU's cuBLAS matmul: the dot's numbers in its backend config
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    lhs = module.instructions.get(ins.operands[0]) if ins.operands else None
    if m and lhs is not None and lhs.arrays and ins.arrays:
      dims = [int(d.strip('" ')) for d in m.group(1).split(",") if d.strip('" ')]
      out = math.prod(ins.arrays[0][1])
      return 2.0 * out * math.prod(lhs.arrays[0][1][d] for d in dims), 0.0
  if ins.opcode in TRANSCENDENTAL:
    return 0.0, float(ins.elements)
  if ins.opcode in ELEMENTWISE:
    return float(ins.elements), 0.0
  if ins.opcode in ("reduce", "reduce-window"):
    src = module.instructions.get(ins.operands[0]) if ins.operands else None
    return float(src.elements if src else 0), 0.0
  return 0.0, 0.0


def ins_calls(ins: Instruction) -> List[str]:
  """The computations a fusion runs (its ``calls=``)."""
  return [name for kind, name in _CALLS.findall(ins.attrs) if kind == "calls"]


def operand_bytes(module: Module, ins: Instruction) -> float:
  return sum(module.instructions[o].bytes for o in ins.operands if o in module.instructions)


_SLICES = frozenset(("dynamic-slice", "slice", "gather"))


def _users(instructions: List[Instruction]) -> Dict[str, List[Instruction]]:
  users: Dict[str, List[Instruction]] = collections.defaultdict(list)
  for ins in instructions:
    for o in ins.operands:
      users[o].append(ins)
  return users


def _fused_body(module: Module, fusion: Instruction) -> List[Instruction]:
  called = ins_calls(fusion)
  return module.computations.get(called[0], []) if called else []


def _read_bytes(module: Module, name: str, users: Dict[str, List[Instruction]], full: float,
                in_place: set) -> float:
  """Bytes a fused computation reads of its value ``name`` (``full`` bytes): only the slices
  taken of it when every use slices it (through bitcasts and nested fusions), nothing when it is
  the buffer a dynamic-update-slice writes in place, else all of it."""
  if not users.get(name):  # flows out of a nested computation to its user: read whole
    return full
  read = 0.0
  for user in users[name]:
    if user.opcode == "bitcast":
      read += _read_bytes(module, user.name, users, full, in_place)
    elif user.opcode in _SLICES and user.operands[0] == name:
      read += user.bytes
    elif user.opcode == "dynamic-update-slice" and user.operands[0] == name and \
        user.name in in_place:
      continue
    elif user.opcode == "fusion":
      body = _fused_body(module, user)
      params = {int(p.args): p for p in body if p.opcode == "parameter" and p.args.isdigit()}
      inner = _users(body)
      for i, o in enumerate(user.operands):
        if o == name and i in params:
          read += _read_bytes(module, params[i].name, inner, full, set())
    else:
      return full
  return min(read, full)


def fusion_bytes(module: Module, ins: Instruction) -> float:
  """Bytes a fusion moves, as XLA counts them: each operand read once, or only the slices the
  fused computation takes of it; the result written, or for a dynamic-update-slice at the root
  (a scan writing one layer into a stacked buffer, in place) only the update."""
  body = _fused_body(module, ins)
  if not body:
    return ins.bytes + operand_bytes(module, ins)
  users = _users(body)
  by_name = {b.name: b for b in body}
  root = next((b for b in body if b.root), None)
  outputs = ([by_name[o] for o in root.operands if o in by_name]
             if root is not None and root.opcode == "tuple" else [root] if root else [])
  in_place = {o.name for o in outputs if o.opcode == "dynamic-update-slice"}
  written = sum(by_name[o.operands[1]].bytes if o.name in in_place and o.operands[1] in by_name
                else o.bytes for o in outputs)
  params = {int(b.args): b for b in body if b.opcode == "parameter" and b.args.isdigit()}
  read = 0.0
  for i, operand in enumerate(ins.operands):
    src = module.instructions.get(operand)
    param = params.get(i)
    if src is None:
      continue
    read += _read_bytes(module, param.name, users, src.bytes, in_place) if param else src.bytes
  return read + written


def _is_gemm_call(ins: Instruction) -> bool:
  return ins.opcode == "custom-call" and re.search(r'custom_call_target="__cublas', ins.attrs) is not None


def instruction_bytes(module: Module, ins: Instruction) -> float:
  """Bytes one (unfused) instruction moves between HBM and the cores."""
  if _is_gemm_call(ins) and ins.arrays:  # the result; not cuBLAS's scratch workspace (s8[...])
    dtype, _, padded = ins.arrays[0]
    return DTYPE_BYTES.get(dtype, 4) * padded + operand_bytes(module, ins)
  if ins.opcode == "fusion":
    return fusion_bytes(module, ins)
  if ins.opcode in _SLICES:
    return 2.0 * ins.bytes
  if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
    update = module.instructions.get(ins.operands[1])
    return 2.0 * (update.bytes if update else 0.0)
  return ins.bytes + operand_bytes(module, ins)


@dataclasses.dataclass
class Row:
  """One instruction that moves data or computes: ``weight`` is how many times it runs per step."""
  name: str
  opcode: str
  category: str
  part: str
  weight: float
  flops: float
  transcendentals: float
  bytes: float
  collective: bool
  shape: str


@dataclasses.dataclass
class Cost:
  """The program's instructions (``rows``) and the loops' trip counts (``trips``: ``None`` where
  the condition's form was not recognised, then counted once)."""
  rows: List[Row]
  trips: Dict[str, Optional[int]]

  def total(self, field: str, weighted: bool = True, collective: Optional[bool] = None) -> float:
    return sum(getattr(r, field) * (r.weight if weighted else 1.0) for r in self.rows
               if collective is None or r.collective == collective)

  def seconds(self, peak_flops: float, bytes_per_second: float, weighted: bool = True) -> float:
    """Roofline time: each instruction takes ``max(flops / peak, bytes / bandwidth)``."""
    return sum(max(r.flops / peak_flops, r.bytes / bytes_per_second)
               * (r.weight if weighted else 1.0) for r in self.rows)

  def by(self, key: str, peak_flops: float, bytes_per_second: float) -> List[dict]:
    """Weighted flops, bytes and roofline seconds summed by ``key`` (``category``, ``part``,
    ``opcode`` or ``name``), largest bytes first."""
    groups: Dict[str, dict] = collections.defaultdict(
        lambda: {"flops": 0.0, "bytes": 0.0, "seconds": 0.0, "count": 0})
    for r in self.rows:
      g = groups[getattr(r, key)]
      g["flops"] += r.flops * r.weight
      g["bytes"] += r.bytes * r.weight
      g["seconds"] += max(r.flops / peak_flops, r.bytes / bytes_per_second) * r.weight
      g["count"] += 1
      if key == "name":
        g.update(opcode=r.opcode, category=r.category, part=r.part, weight=r.weight,
                 shape=r.shape)
    return sorted(({key: k, **v} for k, v in groups.items()), key=lambda g: -g["bytes"])


def _trace_ops(module: Module):
  """``trace_table.parse_hlo``'s view of ``module`` (``{name: Op}``, ``{computation: opcodes}``),
  taken from this parse rather than a second one of the text."""
  ops = {ins.name: trace_table.Op.of(ins.name, ins.opcode, ins.attrs)
         for ins in module.instructions.values()}
  return ops, {c: [i.opcode for i in body] for c, body in module.computations.items()}


def analyse(text: str) -> Cost:
  """The cost rows of an optimised HLO module's text (see the module docstring)."""
  module = parse(text)
  weight, trips, fused = weights(module)
  ops, opcodes = _trace_ops(module)
  rows = []
  for comp, instructions in module.computations.items():
    if comp in fused or not weight.get(comp):
      continue
    for ins in instructions:
      if ins.opcode in NO_BYTES:
        continue
      flops, trans = own_flops(module, ins)
      moved = instruction_bytes(module, ins)
      op = ops.get(ins.name)
      category = trace_table.category(op, opcodes) if op is not None else "other"
      part = trace_table.part(op.op_name)[0] if op is not None else "-"
      shape = ",".join(f"{d}[{'x'.join(map(str, s))}]" for d, s, _ in ins.arrays[:2])
      rows.append(Row(ins.name, ins.opcode, category, part, weight[comp], flops, trans, moved,
                      ins.opcode in COLLECTIVES, shape))
  return Cost(rows, trips)
