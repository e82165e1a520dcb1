"""The GPU scripts in their CPU check mode (``BENCH_PLATFORM=cpu``): every command they run on a GPU
runs here on tiny models, writes the files the docs promise and the table reads them back.

launch/gpu_bench.sh: the two headline cases and one case with every flag of the XLA-flag cases
(the flags must parse in the pinned jaxlib). launch/gpu_study.sh: three arms trained at once, each evaluated, one report.
"""

import json
import os
import subprocess
import sys

import pytest

from testing_configs import REPO


def run_script(script, outdir, timeout):
  env = dict(os.environ, BENCH_PLATFORM="cpu", PYTHON=sys.executable)
  return subprocess.run(["bash", script, str(outdir)], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu_bench")
  p = run_script("launch/gpu_bench.sh", out, 600)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
  return out, p.stdout


def test_gpu_bench_cpu_check_times_three_cases_and_tabulates_them(bench_out):
  out, stdout = bench_out
  rows = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
  assert [r["config"] for r in rows] == ["sit_xl2.py", "mae_vit_l16.py", "sit_xl2.py"]
  for r in rows:
    assert r["preset"] == "micro/4" and r["dtype"] == "bfloat16" and r["attention"] == "xla"
    assert r["repeats"] == 1 and r["steps"] == 2 and r["global_batch"] == 2
    assert 0 < r["step_seconds_min"] <= r["step_seconds"] < 60
    assert r["images_per_sec"] == pytest.approx(2 / r["step_seconds"], rel=0.01)
    assert r["model_gflops_per_example"] > 0 and r["compile_seconds"] > 0
  assert [r["remat"] for r in rows] == ["dots", "none", "dots"]
  assert rows[0]["xla_flags"] == "" and rows[1]["xla_flags"] == ""
  for flag in ("--xla_gpu_cudnn_gemm_fusion_level=2", "--xla_gpu_enable_triton_gemm=false",
               "--xla_gpu_enable_latency_hiding_scheduler=true",
               "--xla_gpu_enable_command_buffer="):
    assert flag in rows[2]["xla_flags"].split()
  table = (out / "bench.md").read_text()
  assert table == stdout[stdout.index("1 x cpu"):]
  body = [line for line in table.splitlines() if line.startswith("| ")]
  assert len(body) == 1 + 3  # header + one row per case
  assert "| default |" in body[1] and "mae_vit_l16.py" in body[2] and "| MaxText |" in body[3]
  assert all(line.endswith(" |") and "n/a" in line for line in body[1:])  # CPU: no peak, no MFU


def test_gpu_study_cpu_check_trains_three_arms_at_once_and_reports(tmp_path):
  p = run_script("launch/gpu_study.sh", tmp_path, 900)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
  names = [f"a{a}_lr0.001_e0.5" for a in ("0.6", "0.8", "1")]
  records = [json.loads((tmp_path / f"{n}.json").read_text()) for n in names]
  for n, alpha, r in zip(names, (0.6, 0.8, 1.0), records):
    assert (r["name"], r["alpha_min"], r["epochs"], r["step"]) == (n, alpha, 0.5, 5)
    assert r == json.loads((tmp_path / "study" / n / "study_record.json").read_text())
    assert 0 < r["final_loss"] < 5 and r["train_seconds"] > 0 and r["eval_seconds"] > 0
    assert f"arm {n}: done after" in p.stdout
  table = (tmp_path / "study" / "study.md").read_text()
  assert all(f"| {n} |" in table for n in names)
  for png in ("accuracy_vs_layer.png", "accuracy_vs_alpha.png", "knn_vs_epochs.png"):
    assert (tmp_path / "study" / png).stat().st_size > 1000
  assert "three arms in" in p.stdout
