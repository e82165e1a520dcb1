"""Time by op category from a profile of train steps (``train.profiling``).

The trace (``perfetto_trace.json.gz``) has one event per executed XLA op, named by its HLO
instruction; the compiled step's HLO (``train_step.hlo.txt``, written beside it) says what each
instruction is: its opcode, the ops fused into it and, in ``metadata={op_name=...}``, the JAX name
stack, which carries the Flax module path (``.../blocks/attn/dot_general``), the direction
(``jvp(...)``: forward, ``transpose(jvp(...))``: backward) and the trainer's ``optimizer`` scope.

Categories, first match wins:
  optimizer          ops in the step's ``optimizer`` scope (AdamW, norms of the update, EMA)
  attention          ops under an ``attn`` module other than its ``qkv``/``proj`` projections
  matmuls            dots and convolutions, alone or fused (the projections, the MLPs, patchify)
  norms              ops under a LayerNorm module (``norm``, ``norm1``, ``decoder_norm``, ...)
  transposes/copies  ops that only move data (copy, transpose, slice, concatenate, gather, ...)
  other              the rest: elementwise (GELU, residual updates), reductions, random numbers

Op time is the sum of the op events' durations: an op XLA splits over its thread pool is one
event on the thread that launched it, counted once for as long as it ran, so the sum is neither
wall time nor CPU time (how many cores an op kept busy is not in the trace). Host-side rows are
wall time: ``input pipeline`` (the trainer's ``input`` annotation: the next batch read and placed)
and ``host gaps`` (wall time of the window with no XLA op running anywhere: dispatch, Python,
waiting on the host).
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from typing import Dict, List, Tuple

from decay_jax import paths
from decay_jax.train import profiling

CATEGORIES = ("matmuls", "attention", "norms", "transposes/copies", "other", "optimizer")
# Opcodes that only move or reshape data (and the plumbing of fused computations).
_DATA_MOVEMENT = frozenset((
    "copy", "transpose", "bitcast", "reshape", "broadcast", "slice", "dynamic-slice",
    "dynamic-update-slice", "concatenate", "pad", "gather", "scatter", "reverse", "tuple",
    "get-tuple-element", "copy-start", "copy-done", "bitcast-convert", "iota"))
_PLUMBING = frozenset(("parameter", "constant"))
# Ops that only contain others: the trace times their bodies' ops separately.
_CONTAINERS = frozenset(("while", "call", "conditional", "async-start", "async-done"))
_MATMUL = frozenset(("dot", "convolution"))
# Name-stack segments of control flow and remat, not of modules: a scanned stack of blocks is
# ``.../while/body/closed_call/blocks/...``.
_CONTROL = frozenset(("while", "body", "cond", "closed_call", "checkpoint", "remat",
                      "rematted_computation", "scan", "cond_fun", "body_fun"))
_NORM = re.compile(r"(^|_)norm\d*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")


class Op:
  __slots__ = ("name", "opcode", "op_name", "calls")

  def __init__(self, name: str, opcode: str, op_name: str, calls: Tuple[str, ...]):
    self.name, self.opcode, self.op_name, self.calls = name, opcode, op_name, calls

  @classmethod
  def of(cls, name: str, opcode: str, text: str) -> "Op":
    """The instruction ``name`` of ``opcode`` whose operands and attributes are ``text`` (its
    metadata's ``op_name`` and the computations it calls)."""
    op_name = re.search(r'op_name="([^"]*)"', text)
    calls = tuple(re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", text))
    return cls(name, opcode, op_name.group(1) if op_name else "", calls)


def parse_hlo(text: str) -> Tuple[Dict[str, Op], Dict[str, List[str]]]:
  """``({instruction name: Op}, {computation name: [opcodes]})`` of an HLO module's text."""
  ops: Dict[str, Op] = {}
  computations: Dict[str, List[str]] = collections.defaultdict(list)
  current = None
  for line in text.splitlines():
    m = _INSTRUCTION.match(line)
    if m is None:
      c = _COMPUTATION.match(line)
      if c is not None:
        current = c.group(1)
      continue
    name, opcode, rest = m.groups()
    ops[name] = Op.of(name, opcode, rest)
    if current is not None:
      computations[current].append(opcode)
  return ops, dict(computations)


def inner_opcodes(op: Op, computations: Dict[str, List[str]]) -> set:
  """Opcodes an instruction runs: its own, or those of the computations a fusion calls."""
  if op.opcode != "fusion" and op.opcode != "custom-call":
    return {op.opcode}
  found = set()
  for c in op.calls:
    found.update(computations.get(c, ()))
  return (found - _PLUMBING) or {op.opcode}


def category(op: Op, computations: Dict[str, List[str]]) -> str:
  """The op's row in the table (see the module docstring for the rules)."""
  segments = op.op_name.split("/")
  if "optimizer" in segments:
    return "optimizer"
  if "attn" in segments:
    after = segments[segments.index("attn") + 1:]
    if not (after and after[0] in ("qkv", "proj")):
      return "attention"
  inner = inner_opcodes(op, computations)
  if inner & _MATMUL:
    return "matmuls"
  if any(_NORM.search(s) for s in segments):
    return "norms"
  if inner <= _DATA_MOVEMENT:
    return "transposes/copies"
  return "other"


def part(op_name: str) -> Tuple[str, str]:
  """``(model part, direction)``: the first module or method under the model, and
  forward/backward; the optimizer scope and ops outside the model have their own names."""
  if not op_name:
    return "unnamed (copies and fusions XLA inserted, e.g. of the scan's carries)", "-"
  segments = op_name.split("/")
  if "optimizer" in segments:
    return "optimizer", "-"
  for i, s in enumerate(segments):
    if s.startswith("transpose(jvp(") or s.startswith("jvp("):
      direction = "backward" if s.startswith("transpose(") else "forward"
      below = [t for t in segments[i + 1:]
               if not (t.startswith("jit(") or t.startswith("vmap(") or t in _CONTROL)]
      # One segment left is the primitive itself: an op at the top of the loss function.
      name = below[0].rsplit(".", 1)[-1] if len(below) > 1 else "top level of the loss"
      return name, direction
  return "outside the gradient (random numbers, masks)", "-"


def find_run(path: str) -> str:
  """The profile run directory at or under ``path`` (the newest one); one-line error if none."""
  if paths.exists(paths.join(path, profiling.TRACE_FILE)):
    return path
  for logdir in (path, paths.join(path, "profile")):
    run = profiling.newest_run(logdir)
    if run is not None and paths.exists(paths.join(run, profiling.TRACE_FILE)):
      return run
  raise ValueError(f"path={path!r} is not allowed; it holds no {profiling.TRACE_FILE} (give a "
                   "workdir, a --profile_dir, or the run directory of a profile)")


def summarize(run_dir: str) -> dict:
  """Milliseconds per step by category and by model part, and the host-side rows."""
  hlo_path = paths.join(run_dir, profiling.HLO_FILE)
  if not paths.exists(hlo_path):
    raise ValueError(f"path={run_dir!r} is not allowed; it has a trace but no {profiling.HLO_FILE}"
                     " (profiles written by train.profiling have both)")
  hlo = paths.read_text(hlo_path)
  ops, computations = parse_hlo(hlo)
  module = re.search(r"^HloModule ([\w.\-]+)", hlo, re.M)
  module = module.group(1) if module else None
  with paths.resolve(paths.join(run_dir, profiling.TRACE_FILE)).open("rb") as f:
    events = json.loads(gzip.decompress(f.read()))
  events = events["traceEvents"] if isinstance(events, dict) else events
  events = [e for e in events if e.get("ph") == "X"]
  steps = [e for e in events if e.get("name") == "train"]
  if not steps:
    raise ValueError(f"path={run_dir!r} is not allowed; its trace has no 'train' step annotations")
  by_category = collections.Counter({c: 0.0 for c in CATEGORIES})
  by_part: Dict[Tuple[str, str], float] = collections.Counter()
  intervals, threads, unmapped = [], set(), 0.0
  for e in events:
    args = e.get("args", {})
    name = args.get("hlo_op")
    if name is None or (module and args.get("hlo_module") not in (None, module)):
      continue
    op = ops.get(name)
    if op is None:
      unmapped += e["dur"]
      continue
    if op.opcode in _CONTAINERS:
      continue
    by_category[category(op, computations)] += e["dur"]
    by_part[part(op.op_name)] += e["dur"]
    intervals.append((e["ts"], e["ts"] + e["dur"]))
    threads.add(e["tid"])
  if not intervals:
    raise ValueError(f"path={run_dir!r} is not allowed; its trace has no ops of {module}")
  start = min(e["ts"] for e in steps)
  end = max(b for _, b in intervals)
  busy, reach = 0.0, start
  for a, b in sorted(intervals):  # length of the union of the op intervals
    a = max(a, reach)
    if b > a:
      busy += b - a
      reach = b
  n = len(steps)
  ms = lambda us: us / 1e3 / n  # trace times are microseconds
  return {
      "run_dir": run_dir, "module": module, "steps": n, "threads": len(threads),
      "step_wall_ms": ms(end - start),
      "op_ms": {c: ms(v) for c, v in by_category.items()},
      "unmapped_op_ms": ms(unmapped),
      "part_ms": {f"{p} ({d})" if d != "-" else p: ms(v) for (p, d), v in
                  sorted(by_part.items(), key=lambda kv: -kv[1])},
      "input_ms": ms(sum(e["dur"] for e in events if e.get("name") == "input")),
      "host_gap_ms": ms(max(0.0, (end - start) - busy)),
  }


def format_table(s: dict) -> str:
  """Markdown tables of ``summarize``'s result."""
  total = sum(s["op_ms"].values()) + s["unmapped_op_ms"]
  pct = lambda v: f"{100 * v / total:.1f}%" if total else "-"
  lines = [f"{s['steps']} steps of {s['module']}, {s['step_wall_ms']:.1f} ms wall per step, ops "
           f"launched from {s['threads']} threads ({total:.1f} ms of op time per step, each op "
           "counted once for its duration)", "",
           "| category | ms per step | share of op time |", "|---|---:|---:|"]
  for c in CATEGORIES:
    lines.append(f"| {c} | {s['op_ms'][c]:.1f} | {pct(s['op_ms'][c])} |")
  if s["unmapped_op_ms"]:
    lines.append(f"| (ops not in the HLO file) | {s['unmapped_op_ms']:.1f} | "
                 f"{pct(s['unmapped_op_ms'])} |")
  wall = s["step_wall_ms"]
  lines += ["", "| host side | ms per step | share of wall |", "|---|---:|---:|",
            f"| input pipeline | {s['input_ms']:.1f} | {100 * s['input_ms'] / wall:.1f}% |",
            f"| host gaps (no XLA op running) | {s['host_gap_ms']:.1f} | "
            f"{100 * s['host_gap_ms'] / wall:.1f}% |",
            "", "| model part | ms per step | share of op time |", "|---|---:|---:|"]
  for p, v in s["part_ms"].items():
    lines.append(f"| {p} | {v:.1f} | {pct(v)} |")
  return "\n".join(lines)


# PyTorch's ops (torch.profiler names) in the same categories, for ``bench --torch_profile``: the
# reference's linear layers are addmm/mm, its attention the only bmm (``q @ k^T``, ``@ v``) plus
# softmax, its norms layer_norm; its optimizer is timed apart (the step outside the profile).
_TORCH_OPS = {
    "matmuls": ("aten::addmm", "aten::mm", "aten::convolution", "aten::mkldnn_convolution",
                "aten::convolution_backward"),
    "attention": ("aten::bmm", "aten::_softmax", "aten::_softmax_backward_data"),
    "norms": ("aten::native_layer_norm", "aten::native_layer_norm_backward"),
    "transposes/copies": ("aten::copy_", "aten::clone", "aten::cat", "aten::gather",
                          "aten::scatter", "aten::index", "aten::index_select", "aten::repeat",
                          "aten::_unsafe_view", "aten::contiguous", "aten::transpose",
                          "aten::permute", "aten::expand", "aten::view", "aten::reshape"),
}


def torch_category(name: str) -> str:
  """The ``CATEGORIES`` entry of a torch.profiler op name (``other`` when none claims it)."""
  for c, names in _TORCH_OPS.items():
    if name in names:
      return c
  return "other"


def torch_summary(self_us: Dict[str, float], steps: int, optimizer_ms: float) -> Dict[str, float]:
  """Milliseconds per step by category of PyTorch's self CPU time per op name (``self_us``,
  microseconds over ``steps`` profiled steps of forward and backward) and the optimizer's step."""
  out = {c: 0.0 for c in CATEGORIES}
  for name, us in self_us.items():
    out[torch_category(name)] += us / 1e3 / steps
  out["optimizer"] += optimizer_ms
  return out
