"""Launch scripts: syntax, argument errors, and the exact multi-host commands (dry runs)."""

import glob
import os
import platform
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, **env):
  return subprocess.run(args, cwd=REPO, env=dict(os.environ, **env), capture_output=True,
                        text=True, timeout=60)


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(REPO, "launch", "*.sh"))),
                         ids=os.path.basename)
def test_syntax(script):
  assert run(["bash", "-n", script]).returncode == 0


def test_local_needs_config_and_workdir():
  p = run(["bash", "launch/local.sh", "configs/mae_cpu_mnist.py"])
  assert p.returncode == 2 and "usage:" in p.stderr
  p = run(["bash", "launch/local.sh", "configs/nope.py", "/tmp/x"])
  assert p.returncode == 2 and "config file configs/nope.py not found" in p.stderr


def test_slurm_dry_run_runs_one_process_per_gpu():
  p = run(["bash", "launch/slurm.sh", "configs/mae_vit_b16.py", "/shared/run",
           "--config.batch_size=8192"], DRY_RUN="1")
  assert p.returncode == 0, p.stderr
  out = p.stdout
  assert out.startswith("srun --kill-on-bad-exit=1 bash -c ")
  assert "CUDA_VISIBLE_DEVICES=\\$SLURM_LOCALID" in out and "DECAY_JAX_DISTRIBUTED=1" in out
  assert "--config=configs/mae_vit_b16.py --workdir=/shared/run --config.batch_size=8192" in out


def test_tpu_pod_dry_run_targets_all_workers():
  p = run(["bash", "launch/tpu_pod.sh", "configs/mae_vit_l16.py", "gs://b/run"], DRY_RUN="1",
          TPU_NAME="v4-64", ZONE="us-central2-b")
  assert p.returncode == 0, p.stderr
  lines = p.stdout.strip().splitlines()
  assert lines[0].startswith("gcloud compute tpus tpu-vm scp") and "--worker=all" in lines[0]
  assert lines[1].startswith("gcloud compute tpus tpu-vm ssh v4-64 --zone=us-central2-b --worker=all")
  assert "DECAY_JAX_DISTRIBUTED=1\\ JAX_EXTRA=tpu\\ bash\\ launch/local.sh" in lines[1]
  assert "configs/mae_vit_l16.py" in lines[1] and "gs://b/run" in lines[1]
  p = run(["bash", "launch/tpu_pod.sh", "configs/mae_vit_l16.py", "gs://b/run"], DRY_RUN="1")
  assert p.returncode != 0 and "TPU_NAME" in p.stderr


def test_gpu_bench_dry_run_runs_sit_xl2_and_mae_vit_l_in_bf16_with_cudnn():
  p = run(["bash", "launch/gpu_bench.sh", "/tmp/out.jsonl"], DRY_RUN="1")
  assert p.returncode == 0, p.stderr
  sit, mae = p.stdout.strip().splitlines()
  for line in (sit, mae):
    assert line.startswith(".venv/bin/python -m decay_jax.cli.bench ")
    assert "--config.model.dtype=bfloat16 --config.model.attention_impl=cudnn" in line
    assert "--steps=20 --out=/tmp/out.jsonl" in line and "micro" not in line
  assert "--config=configs/sit_xl2.py --batch_per_device=64" in sit
  assert "--config=configs/mae_vit_l16.py --batch_per_device=128" in mae
  # The CPU check of the script: tiny models, XLA attention (cuDNN needs a GPU).
  p = run(["bash", "launch/gpu_bench.sh"], DRY_RUN="1", BENCH_PLATFORM="cpu")
  assert p.returncode == 0 and p.stdout.count("--config.model.preset=micro/4") == 2
  assert "attention_impl=xla" in p.stdout and "cudnn" not in p.stdout
  p = run(["bash", "launch/gpu_bench.sh"], BENCH_PLATFORM="tpu")
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
