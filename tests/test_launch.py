"""Launch scripts: syntax, argument errors, and the exact multi-host commands (dry runs), whose
training command must be one the trainer's own flag parser accepts."""

import ast
import glob
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, **env):
  return subprocess.run(args, cwd=REPO, env=dict(os.environ, **env), capture_output=True,
                        text=True, timeout=60)


# The trainer's flag parser as a small server: imports decay_jax.cli.train once (its absl flags),
# then parses each argv (one JSON line on stdin) in a forked copy, so that every argv meets fresh
# flags, and answers with one JSON line. A process of its own because other cli modules define
# flags of the same names (--config), which absl refuses in one process.
_PARSER = r"""
import json, os, sys
from absl import flags
import decay_jax.cli.train  # noqa: F401
for line in sys.stdin:
  r, w = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(r)
    try:
      sys.argv = ["decay_jax.cli.train", *json.loads(line)]  # config_flags reads overrides there
      flags.FLAGS(sys.argv)
      out = {"workdir": flags.FLAGS.workdir,
             "config": json.loads(flags.FLAGS.config.to_json_best_effort())}
    except Exception as e:  # what the trainer would print before exiting
      out = {"error": f"{type(e).__name__}: {e}"}
    with os.fdopen(w, "w") as f:
      f.write(json.dumps(out))
    os._exit(0)
  os.close(w)
  with os.fdopen(r) as f:
    answer = f.read()
  os.waitpid(pid, 0)
  print(answer, flush=True)
"""


@pytest.fixture(scope="module")
def trainer_parse():
  """``parse(argv) -> {"workdir", "config"} or {"error"}`` with the trainer's absl flags."""
  with tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen([sys.executable, "-c", _PARSER], cwd=REPO, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=err)

    def parse(argv):
      proc.stdin.write(json.dumps(list(argv)) + "\n")
      proc.stdin.flush()
      line = proc.stdout.readline()
      if not line:
        err.seek(0)
        raise AssertionError(f"the flag parser died:\n{err.read()[-3000:]}")
      return json.loads(line)

    try:
      yield parse
    finally:
      proc.stdin.close()
      proc.wait(timeout=30)


def field_path_error(config, dotted):
  """None if ``dotted`` (``model.alpha_min``) names a field of ``config``, else why not."""
  node = config
  for i, part in enumerate(dotted.split(".")):
    if not hasattr(node, "keys") or part not in node:
      return f"{'.'.join(dotted.split('.')[:i]) or 'the config'} has no field {part!r}"
    node = node[part]
  return None


def check_trainer_argv(parse, argv, config_file, workdir):
  """``argv`` (what reaches ``python -m decay_jax.cli.train``) starts with --config and --workdir, its
  every --config.x names a field of ``config_file`` (the project's config loader) and the trainer's
  parser accepts it all, unknown flags and bad values included, with the overrides applied."""
  from testing_configs import load_config
  assert argv[:2] == [f"--config={config_file}", f"--workdir={workdir}"], argv
  assert all(a.startswith("--") and "=" in a for a in argv), argv
  config = load_config(config_file)
  overrides = {}
  for a in argv[2:]:
    name, value = a[2:].split("=", 1)
    if name.startswith("config."):
      assert (why := field_path_error(config, name[len("config."):])) is None, f"{a}: {why}"
      overrides[name[len("config."):]] = value
  parsed = parse(argv)
  assert "error" not in parsed, f"the trainer rejects {shlex.join(argv)}: {parsed['error']}"
  assert parsed["workdir"] == workdir
  for dotted, value in overrides.items():
    got = parsed["config"]
    for part in dotted.split("."):
      got = got[part]
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):  # a plain string (a path, a preset name)
      pass
    assert got == value, (dotted, got, value)


def test_trainer_argv_check_catches_unknown_flags_and_fields(trainer_parse):
  from testing_configs import load_config
  config = load_config("configs/mae_cpu_mnist.py")
  assert field_path_error(config, "model.alpha_min") is None
  assert field_path_error(config, "model.alpha_mn") == "model has no field 'alpha_mn'"
  assert field_path_error(config, "batch_size.x") == "batch_size has no field 'x'"
  base = ["--config=configs/mae_cpu_mnist.py", "--workdir=/tmp/w"]
  assert "Unknown command line flag 'work_dir'" in trainer_parse(base + ["--work_dir=/x"])["error"]
  assert "batch_sizes" in trainer_parse(base + ["--config.batch_sizes=8"])["error"]
  assert "invalid literal" in trainer_parse(base + ["--config.batch_size=x"])["error"]


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(REPO, "launch", "*.sh"))),
                         ids=os.path.basename)
def test_syntax(script):
  assert run(["bash", "-n", script]).returncode == 0


def test_local_needs_config_and_workdir():
  p = run(["bash", "launch/local.sh", "configs/mae_cpu_mnist.py"])
  assert p.returncode == 2 and "usage:" in p.stderr
  p = run(["bash", "launch/local.sh", "configs/nope.py", "/tmp/x"])
  assert p.returncode == 2 and "config file configs/nope.py not found" in p.stderr


def test_slurm_dry_run_runs_one_process_per_gpu(trainer_parse):
  overrides = ["--config.batch_size=8192", "--config.model.alpha_min=0.7"]
  p = run(["bash", "launch/slurm.sh", "configs/mae_vit_b16.py", "/shared/run", *overrides],
          DRY_RUN="1")
  assert p.returncode == 0, p.stderr
  out = p.stdout
  assert out.startswith("srun --kill-on-bad-exit=1 bash -c ")
  assert "CUDA_VISIBLE_DEVICES=\\$SLURM_LOCALID" in out and "DECAY_JAX_DISTRIBUTED=1" in out
  # srun ... bash -c SCRIPT _ ARGS: SCRIPT execs the trainer with ARGS ("$@").
  srun = shlex.split(out)
  assert srun[:4] == ["srun", "--kill-on-bad-exit=1", "bash", "-c"] and srun[5] == "_", srun
  assert shlex.split(srun[4]) == ["CUDA_VISIBLE_DEVICES=$SLURM_LOCALID", "DECAY_JAX_DISTRIBUTED=1",
                                  "exec", ".venv/bin/python", "-m", "decay_jax.cli.train", "$@"]
  check_trainer_argv(trainer_parse, srun[6:], "configs/mae_vit_b16.py", "/shared/run")
  assert srun[8:] == overrides


def test_tpu_pod_dry_run_targets_all_workers(trainer_parse):
  overrides = ["--config.batch_size=4096", "--config.model.remat_policy=full"]
  p = run(["bash", "launch/tpu_pod.sh", "configs/mae_vit_l16.py", "gs://b/run", *overrides],
          DRY_RUN="1", TPU_NAME="v4-64", ZONE="us-central2-b")
  assert p.returncode == 0, p.stderr
  lines = p.stdout.splitlines()  # not stripped: the last argument may end in an escaped space
  assert lines[0].startswith("gcloud compute tpus tpu-vm scp") and "--worker=all" in lines[0]
  assert lines[1].startswith("gcloud compute tpus tpu-vm ssh v4-64 --zone=us-central2-b --worker=all")
  assert "DECAY_JAX_DISTRIBUTED=1\\ JAX_EXTRA=tpu\\ bash\\ launch/local.sh" in lines[1]
  assert "configs/mae_vit_l16.py" in lines[1] and "gs://b/run" in lines[1]
  # What every worker runs: unpack the repository, enter it, run local.sh with the arguments.
  ssh = shlex.split(lines[1])
  (remote,) = [a[len("--command="):] for a in ssh if a.startswith("--command=")]
  steps, step = [], []
  for token in shlex.split(remote) + ["&&"]:
    if token == "&&":
      steps.append(step)
      step = []
    else:
      step.append(token)
  assert ["cd", "~/decay-jax"] in steps, steps
  assert steps[-1] == ["DECAY_JAX_DISTRIBUTED=1", "JAX_EXTRA=tpu", "bash", "launch/local.sh",
                       "configs/mae_vit_l16.py", "gs://b/run", *overrides], steps[-1]
  # local.sh turns those arguments into the training command (its dry run installs nothing).
  p = run(steps[-1][2:], DRY_RUN="1", DECAY_JAX_DISTRIBUTED="1", JAX_EXTRA="tpu")
  assert p.returncode == 0, p.stderr
  python = shlex.split(p.stdout)
  assert python[:3] == [".venv/bin/python", "-m", "decay_jax.cli.train"], python
  check_trainer_argv(trainer_parse, python[3:], "configs/mae_vit_l16.py", "gs://b/run")
  assert python[5:] == overrides
  p = run(["bash", "launch/tpu_pod.sh", "configs/mae_vit_l16.py", "gs://b/run"], DRY_RUN="1")
  assert p.returncode != 0 and "TPU_NAME" in p.stderr


def test_docs_recipes_data_dir_override_reaches_the_trainer(trainer_parse):
  # docs/training.md's SLURM and TPU pod recipes pass the TFDS directory this way.
  p = run(["bash", "launch/slurm.sh", "configs/mae_vit_l16.py", "/shared/runs/mae_l16",
           "--config.data.data_dir=/shared/tfds"], DRY_RUN="1")
  assert p.returncode == 0, p.stderr
  check_trainer_argv(trainer_parse, shlex.split(p.stdout)[6:], "configs/mae_vit_l16.py",
                     "/shared/runs/mae_l16")


def test_gpu_bench_dry_run_runs_the_headline_cases_then_the_a_b_cases():
  p = run(["bash", "launch/gpu_bench.sh", "/tmp/out"], DRY_RUN="1")
  assert p.returncode == 0, p.stderr
  lines = p.stdout.strip().splitlines()
  assert len(lines) == 13
  for line in lines:
    assert ".venv/bin/python -m decay_jax.cli.bench " in line and "micro" not in line
    assert "--steps=10 --repeats=3 --out=/tmp/out/bench.jsonl" in line
    assert "--config.model.dtype=bfloat16" in line
  sit, mae, sit_128, sit_context, cudnn_gemm, no_triton, sit_maxtext = lines[:7]
  assert "--config=configs/sit_xl2.py" in sit and "--batch_per_device=64" in sit
  assert "attention_impl=cudnn" in sit and "--remat=dots" in sit and not sit.startswith("XLA_FLAGS")
  # MAE's decoder (197 tokens) takes cuDNN's kernel padded to 198 (layers.attend).
  assert "--config=configs/mae_vit_l16.py" in mae and "--batch_per_device=128" in mae
  assert "attention_impl=cudnn" in mae
  assert "--batch_per_device=128" in sit_128 and "--remat=dots_context" in sit_context
  assert cudnn_gemm.startswith("XLA_FLAGS=--xla_gpu_cudnn_gemm_fusion_level=2 ")
  assert no_triton.startswith("XLA_FLAGS=--xla_gpu_enable_triton_gemm=false ")
  assert sit_maxtext.startswith("XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true")
  assert any("mae_vit_l16.py" in line and "attention_impl=xla" in line for line in lines[7:])
  assert {"--batch_per_device=32", "--batch_per_device=128"} <= set(p.stdout.split())
  # The CPU check of the script: the two headline cases and one with every flag, tiny, XLA.
  p = run(["bash", "launch/gpu_bench.sh", "/tmp/out"], DRY_RUN="1", BENCH_PLATFORM="cpu")
  assert p.returncode == 0 and p.stdout.count("--config.model.preset=micro/4") == 3
  flags = p.stdout.strip().splitlines()[2].split(" .venv")[0]
  assert all(f in flags for f in ("cudnn_gemm_fusion_level=2", "enable_triton_gemm=false",
                                  "latency_hiding_scheduler=true"))
  assert "cudnn" not in p.stdout.replace("cudnn_gemm_fusion_level", "")
  p = run(["bash", "launch/gpu_bench.sh", "/tmp/out"], BENCH_PLATFORM="tpu")
  assert p.returncode == 2 and "BENCH_PLATFORM=tpu is not allowed" in p.stderr
  p = run(["bash", "launch/gpu_bench.sh"])
  assert p.returncode != 0 and "usage: bash launch/gpu_bench.sh OUTDIR" in p.stderr


def test_gpu_study_dry_run_trains_three_arms_then_reports():
  p = run(["bash", "launch/gpu_study.sh", "/tmp/gs"], DRY_RUN="1", NPZ="/data/c.npz")
  assert p.returncode == 0, p.stderr
  lines = p.stdout.strip().splitlines()
  assert len(lines) == 4
  for line, arm in zip(lines, ("a0.6", "a0.8", "a1")):
    assert line.endswith(f"--only={arm}_lr0.001_e300 ")
  for line in lines:
    assert "--config=research/small_scale_study/config_gpu.py --workdir=/tmp/gs/study" in line
    assert "--grid=long --long_epochs=300 --config.data.num_workers=3" in line
    assert "--config.data.dataset=npz:/data/c.npz" in line
  assert lines[3].strip().endswith("--report_only")
  p = run(["bash", "launch/gpu_study.sh", "/tmp/gs"], DRY_RUN="1", EPOCHS="100")
  assert "--only=a1_lr0.001_e100" in p.stdout
  p = run(["bash", "launch/gpu_study.sh", "/tmp/gs"], BENCH_PLATFORM="tpu")
  assert p.returncode == 2 and "BENCH_PLATFORM=tpu is not allowed" in p.stderr


# A worker thread mallocs, touches and frees a 64 MB block five times, as XLA:CPU does with a
# step's scratch block; prints the process's minor page faults.
_FAULTS = """
import ctypes, resource, threading
libc = ctypes.CDLL("libc.so.6"); libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def work():
  for _ in range(5):
    p = libc.malloc(64 << 20); ctypes.memset(p, 1, 64 << 20); libc.free(p)
t = threading.Thread(target=work); t.start(); t.join()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
"""


def _faults(source_env: bool, **env) -> int:
  script = ("source launch/cpu_env.sh; " if source_env else "") + 'exec python3 -c "$0"'
  p = run(["bash", "-c", script, _FAULTS], **env)
  assert p.returncode == 0, p.stderr
  return int(p.stdout)


def test_cpu_env_keeps_freed_scratch_mapped():
  if platform.libc_ver()[0] != "glibc":
    pytest.skip("glibc only: GLIBC_TUNABLES means nothing elsewhere")
  base = {"GLIBC_TUNABLES": ""}
  # 64 MB is 16,384 pages: faulted five times by default, once with the tunables.
  default, tuned = _faults(False, **base), _faults(True, **base)
  assert default - tuned > 3 * 16384, (default, tuned)


def _sourced_tunables(**env) -> str:
  """GLIBC_TUNABLES as launch/cpu_env.sh leaves it, starting from `env`."""
  p = run(["bash", "-c", "source launch/cpu_env.sh; echo $GLIBC_TUNABLES"], **env)
  assert p.returncode == 0, p.stderr
  return p.stdout.strip()


def test_cpu_env_leaves_user_malloc_settings():
  assert _sourced_tunables(GLIBC_TUNABLES="glibc.malloc.arena_max=4") == "glibc.malloc.arena_max=4"
  assert _sourced_tunables(GLIBC_TUNABLES="glibc.rtld.optional_static_tls=512") == (
      "glibc.rtld.optional_static_tls=512:glibc.malloc.arena_max=1:"
      "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736")


def test_trainer_hint_names_cpu_env_only_when_missing():
  from decay_jax import logs
  on_glibc = platform.libc_ver()[0] == "glibc"
  hint = logs.cpu_malloc_hint("cpu", {})
  assert (hint is not None and "source launch/cpu_env.sh" in hint) == on_glibc
  tuned = _sourced_tunables(GLIBC_TUNABLES="")
  assert logs.cpu_malloc_hint("cpu", {"GLIBC_TUNABLES": tuned}) is None
  assert logs.cpu_malloc_hint("gpu", {}) is None
