"""Compiling for a TPU slice with no TPU (docs/tpu.md): libtpu's compiler on this CPU.

The loop-aware recount of a compiled program (``perf.hlo_cost``) is checked on programs whose
FLOPs are known exactly (a scanned matmul, a batched matmul that XLA:TPU writes as a dilated
convolution), against XLA's own totals where those are right (loops once), and the trainer's
step of a micro MAE (data parallel) and a micro SiT (FSDP over 4 chips) is compiled for
``v5p:2x2x1`` through ``perf.tpu`` and the command line, and its report's fields checked.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.perf import hlo_cost, tpu
from test_sit_train import tiny_sit_config
from test_train import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def v5p():
  return tpu.target("v5p-8")


def compile_for(fn, args, tgt):
  mesh = jax.sharding.Mesh(np.asarray(tgt.devices[:1]), ("x",))
  shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shard) for a in args]
  return tpu.compile_lowered(jax.jit(fn).lower(*abstract))


def test_slice_names_and_one_line_errors():
  assert tpu.parse_name("v5p-64")[1] == (2, 4, 4)      # 64 TensorCores = 32 chips
  assert tpu.parse_name("v4-8")[1] == (2, 2, 1)
  assert tpu.parse_name("v5e-16")[1] == (4, 4)         # v5e counts chips
  assert tpu.parse_name("v5litepod-64")[1] == (8, 8)
  assert tpu.parse_name("v6e:4x8")[1] == (4, 8)
  assert tpu.parse_name("v5p:2x2x2")[0].peak_flops == 459e12
  for name, text in (("v7-8", "give a slice such as v5p-64"),
                     ("v5p-12", "v5p slices are v5p-8, v5p-16,"),
                     ("v5e:2x2x2", "v5e topologies have 2 dimensions")):
    with pytest.raises(ValueError, match=text) as e:
      tpu.parse_name(name)
    assert "\n" not in str(e.value)
  # 90% of v5e's 16 GB (10^9 bytes) is 13.4 GiB
  assert tpu.fits(13.0 * 2 ** 30, tpu.CHIPS["v5e"]) and not tpu.fits(13.5 * 2 ** 30,
                                                                     tpu.CHIPS["v5e"])


def test_multislice_mesh_puts_data_parallel_across_slices():
  """Two v5p-8 slices (8 chips): the trainer's mesh keeps each FSDP group inside one slice and
  splits the data-parallel axis across the slices (their link is the data-centre network)."""
  from decay_jax import sharding as shd
  tgt = tpu.target("v5p-8", num_slices=2)
  assert tgt.chips == 8 and {d.slice_index for d in tgt.devices} == {0, 1}
  mesh = shd.make_mesh(-1, 4, devices=list(tgt.devices))
  slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
  assert mesh.devices.shape == (2, 4)
  assert (slices == np.array([[0] * 4, [1] * 4])).all()
  # FSDP over all 8 chips would leave one data-parallel replica for two slices
  with pytest.raises(ValueError, match="mesh.data=1 is not allowed on 2 slices"):
    shd.make_mesh(1, 8, devices=list(tgt.devices))


def test_scanned_matmul_counted_per_trip(v5p):
  """A 7-step scan of a (256, 512) x (512, 512) matmul: XLA counts the body once, the recount
  7 times; both equal 2 M N K per body to the flop."""
  def f(x, w):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=7)[0]

  x, w = jnp.zeros((256, 512), jnp.bfloat16), jnp.zeros((512, 512), jnp.bfloat16)
  compiled = compile_for(f, (x, w), v5p)
  cost = hlo_cost.analyse(compiled.as_text())
  assert list(cost.trips.values()) == [7]
  matmul = 2 * 256 * 512 * 512
  xla = tpu.xla_cost(compiled)["flops"]
  assert xla == pytest.approx(cost.total("flops", weighted=False), rel=1e-3)
  assert matmul <= cost.total("flops", weighted=False) < 1.01 * matmul
  assert 7 * matmul <= cost.total("flops") < 1.01 * 7 * matmul
  # bytes: the recount follows XLA's within 15% on the unweighted program
  assert cost.total("bytes", weighted=False) == pytest.approx(
      tpu.xla_cost(compiled)["bytes accessed"], rel=0.15)


def test_batched_matmul_as_dilated_convolution(v5p):
  """XLA:TPU writes a batched matmul as a convolution whose window slides over the batch with
  holes (lhs_dilate): the recount's flops are the matmul's, not window x output."""
  a, b = jnp.zeros((16, 48, 64), jnp.float32), jnp.zeros((16, 64, 40), jnp.float32)
  compiled = compile_for(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), (a, b), v5p)
  cost = hlo_cost.analyse(compiled.as_text())
  assert cost.total("flops") == 2 * 16 * 48 * 64 * 40
  assert tpu.xla_cost(compiled)["flops"] == pytest.approx(cost.total("flops"), rel=1e-3)


def test_padding_of_tiled_layouts():
  # dimension 2 is the most minor (32 -> 128), then dimension 0 (16, a multiple of 8)
  assert hlo_cost._padded((16, 5, 32), "{2,0,1:T(8,128)}") == 16 * 5 * 128
  assert hlo_cost._padded((768, 3072), "{1,0:T(8,128)(2,1)}") == 768 * 3072
  assert hlo_cost._padded((5,), "{0:T(128)}") == 128
  assert hlo_cost._padded((5, 3), "{1,0}") == 15


@pytest.fixture(scope="module")
def reports(v5p):
  """The trainer's step of a micro MAE (data 4) and a micro SiT (FSDP 4) compiled for v5p-8."""
  mae = tiny_config(batch_size=64, **{"mesh.data": -1})
  sit = tiny_sit_config(batch_size=32, **{"mesh.data": -1, "mesh.fsdp": 4})
  return {"mae": tpu.compile_report(mae, v5p, top=5), "sit": tpu.compile_report(sit, v5p)}


def test_report_of_the_trainers_step(reports):
  for name, row in reports.items():
    assert row["chips"] == 4 and row["device_kind"] == "TPU v5" and row["topology"] == "v5p:2x2x1"
    assert row["data"] * row["fsdp"] == 4 and row["batch_per_chip"] * 4 == row["global_batch"]
    assert row["fits"] and 0 < row["argument_gib"] <= row["peak_gib"] < 1
    assert row["hbm_gib"] == pytest.approx(95e9 / 2 ** 30, abs=1e-3)
    # the recount of XLA's program, loops once, is XLA's own flop count
    assert row["hlo_flops_once"] == pytest.approx(row["xla_flops"], rel=0.02), name
    # the micro MAE's encoder is a scan of depth 4 (forward and backward), the micro SiT's 4
    # blocks two scans of 2 (in- and out-blocks around its long skips): the weighted count is
    # larger than XLA's and near the model's FLOPs
    assert set(row["loops"].values()) == {4 if name == "mae" else 2}, row["loops"]
    assert row["hlo_flops"] > 1.3 * row["hlo_flops_once"]
    assert 0.5 < row["model_over_hlo_flops"] < 1.2, row["model_over_hlo_flops"]
    assert 0 < row["mfu"] < 1 and row["step_seconds"] > row["xla_optimal_seconds"]
    assert row["compile_seconds"] > 0
  assert reports["mae"]["fsdp"] == 1 and reports["sit"]["fsdp"] == 4
  # FSDP: the parameters are gathered and the gradients reduce-scattered over the chips
  assert reports["sit"]["collective_bytes"] > 0
  cats = {g["category"] for g in reports["mae"]["by_category"]}
  assert {"matmuls", "attention", "optimizer"} <= cats
  assert sum(g["bytes"] for g in reports["mae"]["by_category"]) == pytest.approx(
      reports["mae"]["hlo_bytes"])
  lines = tpu.summary_lines(reports["sit"])
  assert "fits" in lines[1] and "MFU" in lines[4]
  table = tpu.markdown(list(reports.values())).splitlines()
  assert len(table) == 4 and "| v5p-8 | 4 | 1 x 4 |" in table[3]


def test_command_line_and_its_errors():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  base = [sys.executable, "-m", "decay_jax.cli.memory", "--config=configs/mae_cpu_mnist.py",
          "--config.model.preset=micro/4", "--config.data.image_size=16"]
  p = subprocess.run(base + ["--topology=v5p-8", "--batch=32"], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-2000:]
  assert "for v5p-8 (v5p:2x2x1 x 1 slice(s), 4 TPU v5 chips)" in p.stdout
  assert "of 88.476 GiB HBM: fits" in p.stdout and "| micro/4 | v5p-8 | 4 | 4 x 1 |" in p.stdout
  for args, line in ((["--topology=v9-8"], "error: --topology='v9-8' is not allowed; give a "
                                           "slice such as v5p-64"),
                     (["--topology=v5p-8", "--devices=8"], "error: --devices is not allowed "
                                                           "with --topology")):
    p = subprocess.run(base + args, cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith(line), p.stderr
  p = subprocess.run([sys.executable, "-m", "decay_jax.cli.bench", "--task=sit", "--preset=micro/4",
                      "--topology=v5p-8"], cwd=REPO, env=env, capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
      "error: --topology=v5p-8 is not allowed without --compile_only; there is no TPU here to "
      "time the step on"), p.stderr
  # without libtpu: one line saying what to install
  code = ("import sys; sys.modules['libtpu'] = None; from decay_jax.cli import memory; "
          "sys.argv = ['memory', '--topology=v5p-8']; memory.run()")
  p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=120)
  assert p.returncode == 2, p.stderr
  assert p.stderr.strip().splitlines()[-1] == (
      "error: --topology=v5p-8 needs libtpu, the TPU compiler, which is not installed; pip "
      "install '.[tpu]' (or 'jax[tpu]' of the pinned jax) and run again")


def test_full_size_sit_xl2_compiles_for_v5p_with_fsdp(v5p):
  """The largest step per chip of the shipped configs, SiT-XL/2 (675M parameters, two scans of 14
  blocks), at full size (a small batch: compile time hardly depends on it) with FSDP over the
  slice's 4 chips: it compiles, every loop runs 14 times, and the recount's flops are the
  model's within 10% (XLA's own, loops once, are under a tenth of them)."""
  from testing_configs import load_config
  config = load_config("sit_xl2")
  config.mesh.data, config.mesh.fsdp = -1, 4
  row = tpu.compile_report(config, v5p, batch=16)
  assert row["fsdp"] == 4 and row["params"] > 6e8
  assert set(row["loops"].values()) == {14}, row["loops"]
  assert 0.9 < row["model_over_hlo_flops"] < 1.1, row["model_over_hlo_flops"]
  assert row["xla_flops"] < 0.1 * row["hlo_flops"]
  # FSDP divides the float32 parameters, their EMA and AdamW's two moments (16 bytes per
  # parameter replicated) over the 4 chips: about a quarter of that is on each
  assert row["argument_gib"] * 2 ** 30 < 0.35 * 16 * row["params"]


CUDA_COMPILE = os.path.join(REPO, ".cuda_compile")  # launch/test.sh installs it (pip --target)


def test_eight_h100s_without_a_gpu(tmp_path):
  """The CUDA plugin compiles for 8 H100s from XLA's device description (no GPU, no driver), in a
  process that has the plugin on its path: the micro MAE's step compiles, its memory is XLA's,
  its loops are found (XLA:GPU annotates their trip counts), and cuBLAS's matmuls are counted from
  their dot dimensions, which XLA's generic cost analysis (the plugin has none) leaves out."""
  assert os.path.isfile(os.path.join(CUDA_COMPILE, ".installed")), (
      "the CUDA plugin's compiler is not in .cuda_compile/; run bash launch/test.sh, which "
      "installs requirements-gpu-compile.txt there")
  out = tmp_path / "rows.jsonl"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([CUDA_COMPILE, REPO]))
  p = subprocess.run([sys.executable, "-m", "decay_jax.cli.memory",
                      "--config=configs/mae_cpu_mnist.py", "--config.model.preset=micro/4",
                      "--config.data.image_size=16", "--topology=h100-8", "--batch=64",
                      f"--out={out}"], cwd=REPO, env=env, capture_output=True, text=True,
                     timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "for h100-8 (1 host(s) x 8 h100 x 1 slice(s), 8 NVIDIA H100 80GB HBM3 chips)" in p.stdout
  row = json.loads(out.read_text())
  assert row["chips"] == row["data"] == 8 and row["fits"] and row["peak_gib"] > 0
  assert set(row["loops"].values()) == {4}, row["loops"]
  assert row["cost_model"] == "roofline" and 0 < row["mfu"] < 1
  assert row["hlo_flops_once"] > 2 * row["xla_flops"]
  assert 0.5 < row["model_over_hlo_flops"] < 1.2, row["model_over_hlo_flops"]


def test_gpu_names_and_a_missing_plugin_are_one_line():
  with pytest.raises(ValueError, match="give h100-N GPUs, N = 1, 2, 4 or a multiple of 8"):
    tpu.parse_name("h100-12")
  assert tpu.parse_name("h100-16")[1] == (2, 8)
  with pytest.raises(ValueError, match=r"--topology=h100-8 needs the CUDA plugin's compiler, "
                                        r"which is not installed; pip install"):
    tpu.target("h100-8")  # this process has no CUDA plugin (launch/test.sh keeps it apart)
