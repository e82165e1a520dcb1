"""The profiler window (``config.profile_steps``), the trace table and ``bench --from_trainer``,
on one real 3-step training run of the micro MAE (one compile for the module)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from decay_jax.train import config as config_lib
from decay_jax.perf import trace_table
from decay_jax.train import profiling, trainer
from testing_configs import REPO, load_config, override

ENV = dict(os.environ, JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 3-step run logging every step, steps 1-2 profiled; returns its workdir."""
  workdir = str(tmp_path_factory.mktemp("profiled"))
  c = load_config("mae_cpu_mnist")
  override(c, **{"model.preset": "micro/4", "data.image_size": 16, "batch_size": 16,
                 "num_train_steps": 3, "warmup_epochs": 0.0, "log_every_steps": 1,
                 "picture_every_steps": 0, "checkpoint.every_steps": 0,
                 "checkpoint.async_save": False, "evals.knn.enabled": False,
                 "evals.rank.enabled": False, "mesh.data": 1, "tensorboard": False,
                 "profile_steps": "1,2"})
  trainer.train_and_evaluate(c, workdir)
  return workdir


def test_profile_steps_parse_or_fail_in_one_line():
  assert config_lib.parse_steps("") is None
  assert config_lib.parse_steps("10,3") == (10, 3)
  for bad in ("3", "a,b", "1,0", "-1,2", "1,2,3"):
    with pytest.raises(ValueError, match=r"profile_steps='.*' is not allowed; it must be "
                                         r"'START,COUNT'"):
      config_lib.parse_steps(bad)


def test_the_window_holds_its_steps_and_every_op_is_named(run):
  run_dir = trace_table.find_run(run)
  for name in (profiling.TRACE_FILE, profiling.HLO_FILE):
    assert os.path.isfile(os.path.join(run_dir, name))
  assert any(f.endswith(".xplane.pb") for f in os.listdir(run_dir))  # TensorBoard's input
  s = trace_table.summarize(run_dir)
  assert s["steps"] == 2 and s["module"] == "jit_step"
  assert s["unmapped_op_ms"] == 0  # every op the trace timed is an instruction of the HLO file
  for cat in ("matmuls", "attention", "norms", "optimizer", "other"):
    assert s["op_ms"][cat] > 0, cat
  assert 0 <= s["host_gap_ms"] <= s["step_wall_ms"]
  assert s["input_ms"] > 0  # the batch for step 2 is read inside the window
  for p in ("forward_encoder (forward)", "forward_encoder (backward)", "forward_decoder (forward)",
            "forward_decoder (backward)", "optimizer"):
    assert s["part_ms"][p] > 0, p
  # The two splits count the same ops.
  np.testing.assert_allclose(sum(s["part_ms"].values()), sum(s["op_ms"].values()), rtol=1e-9)


def test_trainer_logs_wall_and_cpu_seconds_per_step(run):
  rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
  rows = [r for r in rows if "examples_per_sec" in r]
  assert [r["step"] for r in rows] == [1, 2, 3]
  for r in rows:
    np.testing.assert_allclose(r["step_seconds"] * r["examples_per_sec"], 16, rtol=1e-6)
    assert r["step_cpu_seconds"] > 0


def test_trace_table_command_prints_and_writes_the_numbers(run, tmp_path):
  out = tmp_path / "t.json"
  p = subprocess.run([sys.executable, "-m", "decay_jax.cli.trace_table", run, f"--json={out}"],
                     cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  saved = json.loads(out.read_text())
  assert saved == json.loads(json.dumps(trace_table.summarize(trace_table.find_run(run))))
  for cat in trace_table.CATEGORIES:
    assert f"| {cat} | {saved['op_ms'][cat]:.1f} |" in p.stdout
  assert "| host gaps (no XLA op running) |" in p.stdout
  p = subprocess.run([sys.executable, "-m", "decay_jax.cli.trace_table", str(tmp_path)],
                     cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
  assert p.returncode == 2
  assert p.stderr.strip().splitlines()[-1] == (
      f"error: path={str(tmp_path)!r} is not allowed; it holds no perfetto_trace.json.gz (give a "
      "workdir, a --profile_dir, or the run directory of a profile)")


def test_bench_from_trainer_puts_the_runs_timing_beside_its_own(run, tmp_path):
  out, prof = tmp_path / "b.jsonl", tmp_path / "prof"
  p = subprocess.run([sys.executable, "-m", "decay_jax.cli.bench", f"--from_trainer={run}",
                      "--steps=2", "--repeats=1", f"--out={out}", "--profile_steps=0,2",
                      f"--profile_dir={prof}", "--torch", "--torch_profile"],
                     cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-2000:]
  res = json.loads(out.read_text())
  rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
  walls = [r["step_seconds"] for r in rows if "step_seconds" in r][1:]  # the first window warms up
  assert res["trainer_windows"] == 2 and res["global_batch"] == 16
  np.testing.assert_allclose(res["trainer_step_seconds"], np.median(walls), atol=1e-5)
  np.testing.assert_allclose(res["trainer_step_seconds_min"], min(walls), atol=1e-5)
  np.testing.assert_allclose(res["bench_over_trainer"],
                             res["step_seconds"] / res["trainer_step_seconds"], rtol=0.01)
  assert res["config"].endswith("config.json") and res["preset"] == "micro/4"
  s = trace_table.summarize(res["profile"])  # the bench's own trace of its two timed steps
  assert s["steps"] == 2 and s["op_ms"]["matmuls"] > 0 and s["input_ms"] == 0
  # The PyTorch reference's ops in the same categories (--torch_profile): every category found.
  torch_ms = res["torch_op_ms"]
  assert list(torch_ms) == list(trace_table.CATEGORIES) and min(torch_ms.values()) > 0
  np.testing.assert_allclose(res["speedup_vs_torch"],
                             res["torch_step_seconds"] / res["step_seconds"], rtol=0.01)


def test_torch_ops_fall_in_trace_tables_categories():
  self_us = {"aten::addmm": 3000.0, "aten::bmm": 1000.0, "aten::_softmax": 500.0,
             "aten::native_layer_norm": 200.0, "aten::copy_": 100.0, "aten::gelu": 300.0}
  got = trace_table.torch_summary(self_us, 2, optimizer_ms=4.0)
  assert got == {"matmuls": 1.5, "attention": 0.75, "norms": 0.1, "transposes/copies": 0.05,
                 "other": 0.15, "optimizer": 4.0}


def test_category_and_part_rules_on_named_ops():
  hlo = "\n".join([
      "HloModule jit_step",
      "%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {",
      "  %p0 = f32[4,4]{1,0} parameter(0)",
      "  %p1 = f32[4,4]{1,0} parameter(1)",
      "  ROOT %d = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}",
      "}",
      "%fused_move (p0: f32[4,4]) -> f32[4,4] {",
      "  %p0 = f32[4,4]{1,0} parameter(0)",
      "  ROOT %t = f32[4,4]{0,1} transpose(%p0), dimensions={1,0}",
      "}",
      "ENTRY %main (x: f32[4,4]) -> f32[4,4] {",
      "  %x = f32[4,4]{1,0} parameter(0)",
      '  %qkv = f32[4,4]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot, metadata={op_name='
      '"jit(step)/jvp(MaskedAutoencoder)/MaskedAutoencoder.forward_encoder/blocks/attn/qkv/'
      'dot_general"}',
      '  %scores = f32[4,4]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot, metadata={op_name='
      '"jit(step)/transpose(jvp(MaskedAutoencoder))/MaskedAutoencoder.forward_decoder/'
      'decoder_blocks_0/attn/dot_general"}',
      '  %ln = f32[4,4]{1,0} multiply(%x, %x), metadata={op_name="jit(step)/jvp(SiT)/blocks/norm1/'
      'mul"}',
      '  %fc_norm = f32[4,4]{1,0} add(%x, %x), metadata={op_name="jit(step)/jvp(ViT)/fc_norm/add"}',
      '  %adam = f32[4,4]{1,0} multiply(%x, %x), metadata={op_name="jit(step)/optimizer/mul"}',
      "  %moved = f32[4,4]{0,1} fusion(%x), kind=kLoop, calls=%fused_move",
      '  %gelu = f32[4,4]{1,0} tanh(%x), metadata={op_name="jit(step)/jvp(SiT)/blocks/mlp/tanh"}',
      '  ROOT %w = f32[4,4]{1,0} while(%x), condition=%c, body=%b',
      "}",
  ])
  ops, comps = trace_table.parse_hlo(hlo)
  cat = {n: trace_table.category(ops[n], comps) for n in
         ("qkv", "scores", "ln", "fc_norm", "adam", "moved", "gelu")}
  assert cat == {"qkv": "matmuls", "scores": "attention", "ln": "norms", "fc_norm": "norms",
                 "adam": "optimizer", "moved": "transposes/copies", "gelu": "other"}
  assert ops["w"].opcode == "while" and ops["w"].calls == ("c", "b")
  assert trace_table.part(ops["qkv"].op_name) == ("forward_encoder", "forward")
  assert trace_table.part(ops["scores"].op_name) == ("forward_decoder", "backward")
  assert trace_table.part(ops["ln"].op_name) == ("blocks", "forward")
  assert trace_table.part("jit(step)/transpose(jvp(SiT))/while/body/closed_call/blocks/attn/"
                          "dot_general") == ("blocks", "backward")
  assert trace_table.part(ops["adam"].op_name) == ("optimizer", "-")
  assert trace_table.part("")[0].startswith("unnamed")
  assert trace_table.part("jit(step)/jit(_uniform)/add")[0].startswith("outside the gradient")
