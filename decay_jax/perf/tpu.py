"""The trainer's step compiled for a TPU slice on this machine's CPU, by the TPU compiler itself.

libtpu (the ``[tpu]`` extra) describes a slice it is not running on
(``jax.experimental.topologies.get_topology_desc``): abstract TPU devices that a ``Mesh`` can be
made of and that ``jit(...).lower(...).compile()`` compiles for, with no TPU present. What
compiles is the trainer's own step (``train.setup.build``) on the mesh the trainer would build on
that slice (``sharding.make_mesh``'s device order: the torus, slices over DCN), so the report says
before any pod time is spent whether the step compiles, whether it fits a chip's HBM and what the
compiler's cost model expects of it:

    target = tpu.target("v5p-64")                    # 32 chips, topology 2x4x4
    report = tpu.compile_report(config, target)      # one dict: memory, cost, MFU, compile time

Slice names are Cloud TPU's accelerator types (``v5p-64``: 64 TensorCores = 32 chips; ``v5e-16``
and ``v6e-16``: 16 chips; ``v4-32``: 16 chips), or ``VERSION:AxBxC`` topologies
(``v5p:2x4x4``); ``num_slices`` > 1 is a multi-slice job of that many such slices.

The cost figures are per chip. XLA's ``cost_analysis()`` counts a loop body once (a scanned stack
of blocks runs its body once per layer), so ``hlo_cost`` recounts the optimised program with each
loop weighted by its trip count; both are reported, and the unweighted recount beside XLA's own
totals shows how closely the recount follows XLA's accounting.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np

from decay_jax import sharding as shd
from decay_jax.models import layers
from decay_jax.perf import hlo_cost, memory
from decay_jax.train import setup

GIB, HEADROOM = memory.GIB, memory.HEADROOM  # one byte unit and one usable fraction for all


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation or GPU, per chip (what JAX calls a device), from the vendors' pages
  (docs/tpu.md cites them): ``hbm_bytes``, peak dense bf16 ``peak_flops``, HBM bandwidth."""
  version: str
  device_kind: str
  hbm_bytes: float
  peak_flops: float
  hbm_bytes_per_second: float
  cores_per_chip: int          # an accelerator type's number counts TensorCores (v4, v5p) or chips
  dims: int                    # 3D torus (v4, v5p) or 2D (v5e, v6e)
  chip_config: str             # libtpu's chip configuration: one device per chip
  host_bounds: Tuple[int, int, int]  # chips per host
  platform: str = "tpu"


CHIPS = {
    "v4": Chip("v4", "TPU v4", 32 * GIB, 275e12, 1200e9, 2, 3, "megacore", (2, 2, 1)),
    "v5p": Chip("v5p", "TPU v5", 95e9, 459e12, 2765e9, 2, 3, "default", (2, 2, 1)),
    "v5e": Chip("v5e", "TPU v5 lite", 16e9, 197e12, 819e9, 1, 2, "default", (2, 4, 1)),
    "v6e": Chip("v6e", "TPU v6 lite", 32e9, 918e12, 1638e9, 1, 2, "default", (2, 4, 1)),
    # H100 SXM: 80 GB HBM3 (XLA's device description: 84,978,434,048 bytes), 989 TFLOP/s dense
    # bf16, 3.35 TB/s; 8 per host. Compiled by the CUDA plugin's compiler with no GPU (below).
    "h100": Chip("h100", "NVIDIA H100 80GB HBM3", 84978434048, 989e12, 3.35232e12, 1, 0, "",
                 (8, 1, 1), platform="cuda"),
}
# XLA's description of an H100 SXM (XLA's gpu_specs/h100_sxm.txtpb, its device facts verbatim),
# with the CUDA and cuDNN versions of jax-cuda12 0.10.2's build: what the CUDA plugin needs to
# compile for a GPU that is not there ("deviceless compilation").
H100_TARGET_CONFIG = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
runtime_version { major: 12 minor: 8 }
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
ALIASES = {"v5litepod": "v5e", "v6litepod": "v6e", "v5": "v5p"}
# Slice shapes by chip count, as Cloud TPU builds them.
SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
             128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16),
             2048: (8, 16, 16), 4096: (16, 16, 16)}
SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
             256: (16, 16)}


@dataclasses.dataclass(frozen=True)
class Target:
  """A TPU slice (or several): its chip, topology shape, slice count and abstract devices."""
  name: str
  chip: Chip
  shape: Tuple[int, ...]
  num_slices: int
  devices: Any

  @property
  def chips(self) -> int:
    return len(self.devices)

  @property
  def topology(self) -> str:
    if self.chip.platform == "cuda":
      return f"{self.shape[0]} host(s) x {self.shape[1]} {self.chip.version}"
    return f"{self.chip.version}:{'x'.join(map(str, self.shape))}"


def parse_name(name: str) -> Tuple[Chip, Tuple[int, ...]]:
  """``(chip, topology shape)`` of ``v5p-64`` or ``v5p:2x4x4``; a one-line ValueError otherwise."""
  known = ", ".join(f"{v}-N" for v in CHIPS)
  m = re.fullmatch(r"([a-z0-9]+?)(?:-(\d+)|:(\d+(?:x\d+){1,2}))", name.strip().lower())
  version = ALIASES.get(m.group(1), m.group(1)) if m else None
  if version not in CHIPS:
    raise ValueError(f"--topology={name!r} is not allowed; give a slice such as v5p-64, v5e-16, "
                     f"v6e-16, v4-32, h100-8 ({known}) or a topology such as v5p:2x4x4")
  chip = CHIPS[version]
  if chip.platform == "cuda":
    count = int(m.group(2) or 0)
    per_host = chip.host_bounds[0]
    if not (count in (1, 2, 4) or (count and count % per_host == 0)):
      raise ValueError(f"--topology={name!r} is not allowed; give {version}-N GPUs, N = 1, 2, "
                       f"4 or a multiple of {per_host} (hosts of {per_host})")
    return chip, (max(1, count // per_host), min(count, per_host))
  if m.group(3):
    shape = tuple(int(d) for d in m.group(3).split("x"))
    if len(shape) != chip.dims:
      raise ValueError(f"--topology={name!r} is not allowed; {version} topologies have "
                       f"{chip.dims} dimensions (e.g. {version}:"
                       f"{'x'.join(['2'] * chip.dims)})")
    return chip, shape
  count = int(m.group(2))
  shapes = SHAPES_3D if chip.dims == 3 else SHAPES_2D
  chips = count // chip.cores_per_chip
  if count % chip.cores_per_chip or chips not in shapes:
    sizes = ", ".join(f"{version}-{c * chip.cores_per_chip}" for c in shapes)
    raise ValueError(f"--topology={name!r} is not allowed; {version} slices are {sizes}")
  return chip, shapes[chips]


def quiet_libtpu() -> None:
  """Environment for libtpu on a machine that is not a TPU VM: the accelerator type and worker
  list it would otherwise look up (and warn about), and several processes may load it at once
  (tests run in parallel; the default is one process per machine, guarded by a lockfile)."""
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def target(name: str, num_slices: int = 1) -> Target:
  """The abstract devices of slice ``name`` (``num_slices`` of them), from libtpu's compiler, or
  of ``h100-N`` GPUs from the CUDA plugin's.

  Raises ValueError (one line) for an unknown name and for a missing compiler.
  """
  chip, shape = parse_name(name)
  if not isinstance(num_slices, int) or num_slices < 1:
    raise ValueError(f"--num_slices={num_slices} is not allowed; it must be an integer >= 1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  if chip.platform == "cuda":
    return _gpu_target(name, chip, shape, num_slices, topologies)
  quiet_libtpu()
  try:
    import libtpu  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise ValueError(f"--topology={name} needs libtpu, the TPU compiler, which is not installed; "
                     "pip install '.[tpu]' (or 'jax[tpu]' of the pinned jax) and run again")
  shape3 = tuple(shape) + (1,) * (3 - len(shape))
  bounds = tuple(min(h, s) for h, s in zip(chip.host_bounds, shape3))
  desc = topologies.get_topology_desc(
      platform="tpu", topology_name=f"{chip.version}:{'x'.join(map(str, shape))}",
      chip_config_name=chip.chip_config, chips_per_host_bounds=bounds, num_slices=num_slices)
  return Target(name, chip, shape, num_slices, desc.devices)


def _gpu_target(name, chip, shape, num_slices, topologies) -> Target:
  """``hosts x per_host`` H100s: the CUDA plugin's topology from XLA's device description
  (``target_config``) and a ``topology`` of ``1 x hosts x per_host``; the plugin skips its CUDA
  runtime check (no driver here) and compiles with ptxas (the nvidia-cuda-nvcc-cu12 wheel)."""
  if num_slices != 1:
    raise ValueError(f"--num_slices={num_slices} is not allowed with --topology={name}; GPU "
                     "hosts are one slice (h100-16: two hosts of 8)")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  try:
    import jax_plugins.xla_cuda12  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise ValueError(f"--topology={name} needs the CUDA plugin's compiler, which is not "
                     "installed; pip install '.[cuda12]' nvidia-cuda-nvcc-cu12 and run again")
  hosts, per_host = shape
  try:
    desc = topologies.get_topology_desc(topology_name=chip.version, platform="cuda",
                                        target_config=H100_TARGET_CONFIG,
                                        topology=f"1x{hosts}x{per_host}")
  except NotImplementedError as e:  # the plugin did not register (CUDA checks not skipped)
    raise ValueError(f"--topology={name}: the CUDA plugin offers no topology here ({e}); set "
                     "JAX_PLATFORMS=cpu and run again")
  return Target(name, chip, shape, 1, desc.devices)


def mesh(config, tgt: Target):
  """The ``(data, fsdp)`` mesh the trainer builds on ``tgt`` (``sharding.make_mesh``)."""
  return shd.make_mesh(config.mesh.data, config.mesh.fsdp, devices=list(tgt.devices))


def fits(peak_bytes: float, chip: Chip) -> bool:
  """Whether a per-chip peak fits the chip's HBM with ``HEADROOM``."""
  return peak_bytes <= HEADROOM * chip.hbm_bytes


def compile_report(config, tgt: Target, batch: Optional[int] = None, channels: int = 0,
                   top: int = 0) -> Dict[str, Any]:
  """Compiles the trainer's step of ``config`` for ``tgt`` and reports it per chip.

  Returns a flat dict: the slice and mesh; memory (``peak_gib``, ``argument_gib``, ``temp_gib``,
  ``fits``, ``hbm_gib``); XLA's ``xla_flops``, ``xla_bytes``, ``xla_optimal_seconds`` (loops
  counted once); the recount with loops per trip (``hlo_flops``, ``hlo_bytes``,
  ``collective_bytes``, ``step_seconds``: the roofline, and ``hlo_flops_once``/``hlo_bytes_once``,
  the recount without weights, to set beside XLA's); the model's FLOPs per chip
  (``model_flops``), ``mfu`` (model FLOPs / step_seconds / peak) and ``flops_per_byte``;
  ``compile_seconds``. With ``top``: the ``top`` instructions by bytes (``top_bytes``) and the
  bytes by category (``by_category``).
  """
  m = mesh(config, tgt)
  s = setup.build(config, info=setup.data_info(config, channels), mesh=m, batch=batch)
  t0 = time.perf_counter()
  # Traced as the target traces it (the attention kernel chosen per platform, models/layers.py);
  # on GPUs XLA's attention: cuDNN's needs the GPU's libraries and devices to be traced.
  with layers.target_platform("tpu" if tgt.chip.platform == "tpu" else None):
    lowered = s.train_step.lower(*s.abstract_args())
  t1 = time.perf_counter()
  compiled = compile_lowered(lowered, tgt)
  t2 = time.perf_counter()
  row = report_compiled(compiled, s, tgt, top)
  row.update(lower_seconds=round(t1 - t0, 2), compile_seconds=round(t2 - t1, 2))
  return row


# XLA:GPU without a device cannot autotune, and its default Triton GEMM tiling fails on some
# shapes ("Couldn't find output tile sizes"): matmuls go to cuBLAS, as without Triton.
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def compile_lowered(lowered, tgt: Optional[Target] = None):
  """``lowered.compile()`` for ``tgt``, never written to a persistent compilation cache (the tests
  turn one on), which could not load an executable for a slice that is not here."""
  key = "jax_persistent_cache_min_compile_time_secs"
  before = getattr(jax.config, key)
  jax.config.update(key, float("inf"))
  options = GPU_COMPILER_OPTIONS if tgt is not None and tgt.chip.platform == "cuda" else None
  try:
    return lowered.compile(compiler_options=options)
  except jax.errors.JaxRuntimeError as e:
    if "No PTX compilation provider" in str(e):
      raise ValueError(f"--topology={tgt.name if tgt else ''} needs ptxas to compile for a GPU; "
                       "pip install nvidia-cuda-nvcc-cu12 (or put a CUDA toolkit's bin on PATH)")
    raise
  finally:
    jax.config.update(key, before)


def xla_cost(compiled) -> Dict[str, float]:
  """XLA's cost analysis of a compiled program (loops once). The CUDA plugin's deviceless
  executables have none (``UNIMPLEMENTED: GetCostAnalysis``): XLA's generic ``HloCostAnalysis``
  of the optimised module stands in (no ``optimal_seconds`` then)."""
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):  # older jax: one dict per program
    ca = ca[0] if ca else {}
  if not ca:
    from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
    module = compiled.runtime_executable().hlo_modules()[0]
    ca = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
  return dict(ca or {})


def report_compiled(compiled, s, tgt: Target, top: int = 0) -> Dict[str, Any]:
  """The report of an already compiled step ``compiled`` of setup ``s`` (see ``compile_report``)."""
  chip, chips = tgt.chip, tgt.chips
  mem = compiled.memory_analysis()
  peak = memory.peak_bytes(mem)
  ca = xla_cost(compiled)
  cost = hlo_cost.analyse(compiled.as_text())
  seconds = cost.seconds(chip.peak_flops, chip.hbm_bytes_per_second)
  model_flops = s.flops_per_step / chips
  gib = lambda b: round(b / GIB, 3)
  unknown = sorted(k for k, v in cost.trips.items() if v is None)
  with layers.target_platform("tpu" if chip.platform == "tpu" else None):
    attention = layers.resolve_attention(s.config.model.get("attention_impl"),
                                         s.config.model.dtype, 0, 64) or "xla"
  row = {
      "attention": attention,
      "config": s.config.task, "preset": s.config.model.preset, "dtype": s.config.model.dtype,
      "remat": s.config.model.remat_policy, "topology": tgt.topology, "slice": tgt.name,
      "num_slices": tgt.num_slices, "chips": chips, "device_kind": chip.device_kind,
      "data": int(s.mesh.shape["data"]), "fsdp": int(s.mesh.shape["fsdp"]),
      "global_batch": s.batch_size, "batch_per_chip": s.batch_size // chips,
      "accum_steps": s.config.accum_steps,
      "params": sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(s.abstract["params"])),
      "hbm_gib": gib(chip.hbm_bytes), "peak_gib": gib(peak), "fits": fits(peak, chip),
      "argument_gib": gib(mem.argument_size_in_bytes), "output_gib": gib(mem.output_size_in_bytes),
      "alias_gib": gib(mem.alias_size_in_bytes), "temp_gib": gib(mem.temp_size_in_bytes),
      "xla_flops": ca.get("flops", float("nan")), "xla_bytes": ca.get("bytes accessed", float("nan")),
      "xla_optimal_seconds": ca.get("optimal_seconds", float("nan")),
      "hlo_flops_once": cost.total("flops", weighted=False),
      "hlo_bytes_once": cost.total("bytes", weighted=False),
      "hlo_seconds_once": cost.seconds(chip.peak_flops, chip.hbm_bytes_per_second, False),
      "loops": {k: v for k, v in sorted(cost.trips.items())},
      "hlo_flops": cost.total("flops"), "hlo_bytes": cost.total("bytes"),
      "collective_bytes": cost.total("bytes", collective=True),
      "roofline_seconds": seconds, "model_flops": model_flops,
      "model_over_hlo_flops": model_flops / max(cost.total("flops"), 1.0),
      "flops_per_byte": cost.total("flops") / max(cost.total("bytes"), 1.0),
      "ridge_flops_per_byte": chip.peak_flops / chip.hbm_bytes_per_second,
  }
  # The compiler's own time for the program, with each loop's share scaled to its trips as the
  # recount scales it: XLA's optimal_seconds x (roofline per trip / roofline once).
  # On some chips (v5e with this libtpu) XLA's optimal_seconds is not a time (negative): the
  # roofline stands in, and ``cost_model`` says which one the step time is.
  once = row["hlo_seconds_once"]
  xla = row["xla_optimal_seconds"]
  usable = bool(once) and xla == xla and xla > 0
  row["cost_model"] = "xla" if usable else "roofline"
  row["step_seconds"] = xla * seconds / once if usable else seconds
  row["mfu"] = model_flops / row["step_seconds"] / chip.peak_flops
  row["roofline_mfu"] = model_flops / seconds / chip.peak_flops if seconds else float("nan")
  row["hlo_flops_utilisation"] = cost.total("flops") / row["step_seconds"] / chip.peak_flops
  if unknown:
    row["loops_counted_once"] = unknown
  if top:
    row["by_category"] = cost.by("category", chip.peak_flops, chip.hbm_bytes_per_second)
    row["by_part"] = cost.by("part", chip.peak_flops, chip.hbm_bytes_per_second)[:top]
    row["top_bytes"] = cost.by("name", chip.peak_flops, chip.hbm_bytes_per_second)[:top]
  return row


def summary_lines(row: Dict[str, Any]) -> list:
  """The report as lines for the console (per chip)."""
  e = lambda x: f"{x:.3g}"
  fit = "fits" if row["fits"] else "DOES NOT FIT"
  peak = CHIPS_BY_KIND[row["device_kind"]].peak_flops / 1e12
  lines = [
      f"{row['preset']} {row['dtype']} remat={row['remat']} on {row['slice']} "
      f"({row['topology']}, {row['num_slices']} slice(s), {row['chips']} chips): mesh "
      f"data={row['data']} x fsdp={row['fsdp']}, batch {row['global_batch']} "
      f"({row['batch_per_chip']} per chip, accum_steps {row['accum_steps']})",
      f"  memory per chip: peak {row['peak_gib']} GiB of {row['hbm_gib']} GiB HBM: {fit} "
      f"(with {int(HEADROOM * 100)}% usable); arguments {row['argument_gib']}, temp "
      f"{row['temp_gib']}, output {row['output_gib']}, aliased {row['alias_gib']} GiB",
      f"  XLA cost analysis (loop bodies once): {e(row['xla_flops'])} flops, "
      f"{e(row['xla_bytes'])} bytes, optimal_seconds {e(row['xla_optimal_seconds'])}; the "
      f"recount of the same: {e(row['hlo_flops_once'])} flops, {e(row['hlo_bytes_once'])} bytes",
      f"  loops per trip {row['loops']}: {e(row['hlo_flops'])} flops, {e(row['hlo_bytes'])} bytes "
      f"({e(row['collective_bytes'])} in collectives), {row['flops_per_byte']:.1f} flops/byte "
      f"(the chip's ridge: {row['ridge_flops_per_byte']:.0f})",
      f"  step by {'the cost model' if row['cost_model'] == 'xla' else 'the roofline (XLA gave no time)'} "
      f"{row['step_seconds'] * 1e3:.2f} ms (roofline "
      f"{row['roofline_seconds'] * 1e3:.2f} ms): MFU {row['mfu'] * 100:.1f}% of {peak:.0f} "
      f"TFLOP/s (roofline {row['roofline_mfu'] * 100:.1f}%); model FLOPs per chip "
      f"{e(row['model_flops'])} = {row['model_over_hlo_flops']:.2f} x the program's",
  ]
  if "compile_seconds" in row:
    lines.append(f"  compiled in {row['compile_seconds']} s (lowered in {row['lower_seconds']} s)")
  if row.get("loops_counted_once"):
    lines.append(f"  loops of unknown trip count, counted once: {row['loops_counted_once']}")
  return lines


def where_bytes_go(row: Dict[str, Any]) -> str:
  """Tables of a ``top`` report: bytes and roofline time by op category, by model part, and the
  instructions that move the most (weighted by their loops' trips)."""
  out = []
  for key, title in (("by_category", "category"), ("by_part", "part"), ("top_bytes", "name")):
    out.append(f"\n| {title} | GB | GFLOP | roofline ms | count |" +
               (" opcode | category | part | trips | shape |" if key == "top_bytes" else ""))
    out.append("|---|---:|---:|---:|---:|" + ("---|---|---|---:|---|" if key == "top_bytes" else ""))
    for g in row.get(key, []):
      line = (f"| {g[title]} | {g['bytes'] / 1e9:.2f} | {g['flops'] / 1e9:.0f} | "
              f"{g['seconds'] * 1e3:.2f} | {g['count']} |")
      if key == "top_bytes":
        line += f" {g['opcode']} | {g['category']} | {g['part']} | {g['weight']:g} | {g['shape']} |"
      out.append(line)
  return "\n".join(out)


COLUMNS = (("preset", "model"), ("slice", "slice"), ("chips", "chips"), ("mesh", "data x fsdp"),
           ("dtype", "dtype"), ("remat", "remat"), ("global_batch", "batch"),
           ("batch_per_chip", "per chip"), ("peak_gib", "peak GiB"), ("fits", "fits"),
           ("argument_gib", "args GiB"), ("temp_gib", "temp GiB"), ("xla_flops", "XLA flops"),
           ("hlo_flops", "flops per trip"), ("model_over_hlo_flops", "model/program"),
           ("hlo_bytes", "bytes per trip"), ("step_seconds", "step ms"), ("mfu", "MFU"),
           ("compile_seconds", "compile s"))


def cell(row: Dict[str, Any], key: str) -> str:
  v = row.get(key, "")
  if key == "overrides":
    return f"`{v}`" if v else ""
  if key == "mesh":
    return f"{row['data']} x {row['fsdp']}"
  if key == "fits":
    return "yes" if v else "**no**"
  if key in ("xla_flops", "hlo_flops", "hlo_bytes"):
    return f"{v:.3g}"
  if key == "step_seconds":
    return f"{v * 1e3:.1f}"
  if key == "mfu":
    return f"{v * 100:.1f}%"
  if key == "model_over_hlo_flops":
    return f"{v:.2f}"
  return str(v)


def markdown(rows, with_config: bool = False) -> str:
  """One table row per report (per-chip figures); ``with_config``: the config file and its
  overrides first."""
  columns = ((("config_file", "config"), ("overrides", "overrides")) if with_config else ()) + COLUMNS
  text = ("preset", "slice", "mesh", "dtype", "remat", "fits", "config_file", "overrides")
  head = "| " + " | ".join(t for _, t in columns) + " |"
  sep = "|" + "|".join("---" if k in text else "---:" for k, _ in columns) + "|"
  return "\n".join([head, sep] + ["| " + " | ".join(cell(r, k) for k, _ in columns) + " |"
                                  for r in rows])


CHIPS_BY_KIND = {c.device_kind: c for c in CHIPS.values()}
