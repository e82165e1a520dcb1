"""launch/cpu_flag_ab.py: the XLA:CPU flag A/B in its cheap mode (--smoke: micro MAE, default and
no_xnnpack, one round of one step) plus a flag this XLA does not know, checked against its own
jsonl; bad input as one line and exit 2; the rotation and the verdicts on made-up rounds."""

import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest

from testing_configs import REPO
from xla_env import FAST_COMPILE

SCRIPT = os.path.join(REPO, "launch", "cpu_flag_ab.py")
# Accepted by this XLA (the first already its default): shows the inherited XLA_FLAGS are kept.
INHERITED = f"--xla_cpu_enable_fast_math=false {FAST_COMPILE}"
BOGUS = "--xla_cpu_no_such_flag=true"


def run_ab(outdir, *args, timeout=300):
  # One CPU device (conftest's XLA_FLAGS ask for 8): the cheap mode is one small step.
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=INHERITED)
  return subprocess.run([sys.executable, SCRIPT, str(outdir), *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def load_script():
  spec = importlib.util.spec_from_file_location("cpu_flag_ab", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def table_rows(table):
  """variant -> its row's cells (without the outer pipes)."""
  rows = {}
  for line in table.splitlines():
    if line.startswith("| ") and not line.startswith("| variant "):
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      rows[cells[0]] = cells
  return rows


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = tmp_path_factory.mktemp("cpu_flag_ab")
  p = run_ab(out, "--smoke", "--variant", f"bogus={BOGUS}")
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
  rows = [json.loads(line) for line in (out / "ab.jsonl").read_text().splitlines()]
  return out, p.stdout, rows


def test_one_jsonl_line_per_variant_round_and_workload(smoke):
  out, stdout, rows = smoke
  mod = load_script()
  (workload,) = mod.SMOKE["workloads"]
  assert sorted((r["variant"], r["round"], r["workload"]) for r in rows) == [
      ("default", 1, workload), ("no_xnnpack", 1, workload)]
  for r in rows:
    assert "error" not in r
    assert r["preset"] == "micro/4" and r["global_batch"] == 2
    assert r["steps"] == 1 and r["repeats"] == 1
    assert r["step_seconds"] > 0 and r["step_seconds_min"] > 0 and r["step_cpu_seconds"] > 0
  flags = {r["variant"]: r["xla_flags"] for r in rows}
  assert flags == {"default": INHERITED, "no_xnnpack": f"{INHERITED} --xla_cpu_use_xnnpack=false"}
  progress = [line for line in stdout.splitlines() if line.startswith("[") and "ETA" in line]
  assert [line.split(":")[0] for line in progress] == [  # one line per call, default first
      f"[1/2] {workload} | default | round 1", f"[2/2] {workload} | no_xnnpack | round 1"]
  assert sorted(os.listdir(out / "logs")) == ["w0_r1_default.log", "w0_r1_no_xnnpack.log"]


def test_table_rows_and_ratios_recomputed_from_the_jsonl(smoke):
  out, stdout, rows = smoke
  table = (out / "ab.md").read_text()
  assert stdout.endswith(table)
  cells = table_rows(table)
  assert list(cells) == ["default", "no_xnnpack", "bogus"]
  assert cells["bogus"][2] == f"rejected by this XLA: Unknown flag in XLA_FLAGS: {BOGUS}"
  assert "Noise: not measured" in table  # one round: no spread, so no verdicts
  median = {v: statistics.median(r["step_seconds"] for r in rows if r["variant"] == v)
            for v in ("default", "no_xnnpack")}
  for v in median:
    _, _, n, step_ms, min_ms, cpu_ms, ratio, verdict = cells[v]
    assert int(n) == 1
    assert float(step_ms) == pytest.approx(median[v] * 1e3, abs=0.006)
    mine = [r for r in rows if r["variant"] == v]
    assert float(min_ms) == pytest.approx(min(r["step_seconds_min"] for r in mine) * 1e3, abs=0.006)
    assert float(cpu_ms) == pytest.approx(
        statistics.median(r["step_cpu_seconds"] for r in mine) * 1e3, abs=0.006)
    assert float(ratio) > 0
    assert float(ratio) == pytest.approx(median["default"] / median[v], abs=0.0006)
  assert cells["default"][6] == "1.000" and cells["default"][7] == "baseline"
  assert cells["no_xnnpack"][7] == "no noise estimate (1 round)"


@pytest.mark.parametrize("args, message", [
    (["--variants=default,no_such_variant"], "unknown variant 'no_such_variant'"),
    (["--workload=--config=configs/no_such_config.py"], "no such config file"),
    (["--variant", "x=not_a_flag"], "neither an XLA flag"),
    (["--workload=--config=configs/mae_cpu_mnist.py --steps=2"], "--steps is set by this script"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(tmp_path, args, message):
  p = run_ab(tmp_path / "out", *args, timeout=60)
  assert p.returncode == 2, p.stdout + p.stderr
  assert p.stdout == ""
  assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1 and message in p.stderr
  assert not (tmp_path / "out").exists()


def test_rounds_rotate_and_verdicts_need_more_than_the_noise():
  mod = load_script()
  names = ["default", "a", "b"]
  orders = [mod.round_order(names, r) for r in range(3)]
  assert orders == [["default", "a", "b"], ["a", "b", "default"], ["b", "default", "a"]]
  for position in range(3):  # every variant takes every place once in three rounds
    assert sorted(o[position] for o in orders) == sorted(names)
  # default: 1.00, 1.10, 1.05 s -> median 1.05, spread 10%; a: 0.90 (ratio 1.167 > 1.1) wins;
  # b: 1.00 (ratio 1.05) is within the noise; c: 1.20 (more than 10% slower) loses.
  steps = {"default": [1.0, 1.1, 1.05], "a": [0.9, 0.9, 0.95], "b": [1.0, 1.0, 1.02],
           "c": [1.2, 1.2, 1.2]}
  rows = [{"workload": "w", "variant": v, "round": i + 1, "step_seconds": s,
           "step_seconds_min": s - 0.01, "step_cpu_seconds": 2 * s}
          for v, ss in steps.items() for i, s in enumerate(ss)]
  rows.append({"workload": "w", "variant": "b", "round": 4, "error": "boom"})
  s = mod.summarize(rows, ["w"], list(steps))
  assert s["w", "default"]["spread"] == pytest.approx(0.1)
  assert s["w", "a"]["ratio"] == pytest.approx(1.05 / 0.9)
  assert s["w", "a"]["min"] == pytest.approx(0.89) and s["w", "a"]["cpu"] == pytest.approx(1.8)
  assert [s["w", v]["verdict"] for v in steps] == ["baseline", "wins", "within noise", "loses"]
  assert s["w", "b"]["rounds"] == 3 and len(s["w", "b"]["failed"]) == 1
