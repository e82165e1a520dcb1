"""SLURM for real: a one-node cluster on localhost (munged, slurmctld, slurmd from Debian's
slurm-wlm and munge) runs ``launch/slurm.sh`` with 2 tasks on the demo config for 2 steps. Both
tasks must join one ``jax.distributed`` run (found through jax's SLURM auto-detection) and the run
must write exactly one checkpoint.

The cluster lives in a temporary directory (munge key, slurm.conf, cgroup.conf, state, logs) and
is stopped and removed at the end, also on failure. Where the binaries are missing or a daemon
does not start, the test skips and says why (the daemon's last log line). ``launch/test.sh`` (``launch/slurm_deps.sh``) installs
slurm-wlm and munge with apt-get where it can.
"""

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest
from xla_env import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARIES = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "scontrol", "scancel")
START_TIMEOUT_S = 30  # daemons up and the node idle; measured ~3 s
JOB_TIMEOUT_S = 240  # the whole job; measured 35-50 s on 2 shared cores
STEPS = 2
# The demo config shrunk to seconds of training: the micro model on 16-pixel digits, no
# evaluators or pictures; one checkpoint, at the last step.
OVERRIDES = (f"--config.num_train_steps={STEPS}", "--config.model.preset=micro/4",
             "--config.data.image_size=16", "--config.batch_size=16",
             "--config.warmup_epochs=0", "--config.log_every_steps=1",
             "--config.picture_every_steps=0", "--config.checkpoint.every_steps=100",
             "--config.evals.knn.enabled=False", "--config.evals.rank.enabled=False")
# Job states after which the job no longer runs (scontrol's JobState).
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def free_ports(n: int):
  """``n`` distinct free TCP ports on the loopback (held open together, so not the same one)."""
  socks = [socket.socket() for _ in range(n)]
  try:
    for s in socks:
      s.bind(("127.0.0.1", 0))
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def last_line(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      lines = [line.strip() for line in f if line.strip()]
  except OSError:
    return "(no log)"
  return lines[-1] if lines else "(empty log)"


class Cluster:
  """munged, slurmctld and slurmd in ``root``, each in its own process group."""

  def __init__(self, root: str):
    self.root = root
    self.procs = {}  # daemon name -> Popen
    self.jobs = []
    self.conf = os.path.join(root, "slurm.conf")
    self.socket = os.path.join(root, "munge.socket")
    # Our own config and nothing from a SLURM job this test may itself be running in.
    self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    self.env["SLURM_CONF"] = self.conf

  def write_config(self) -> None:
    os.chmod(self.root, 0o755)  # munged wants its socket's directory searchable by all
    for d in ("state", "spool", "munge"):
      os.makedirs(os.path.join(self.root, d))
    os.chmod(os.path.join(self.root, "munge"), 0o700)
    key = os.path.join(self.root, "munge", "munge.key")
    with open(key, "wb") as f:
      f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    r = self.root
    ctld_port, slurmd_port = free_ports(2)
    # jax's coordinator listens on 61440 + job id % 4096: a random first job id keeps two
    # clusters on one machine (parallel CI jobs) off each other's port.
    first_job = random.randrange(1, 4096)
    # No cgroups, accounting or MPI: linuxproc tracks the tasks; CPUs=2 with config_overrides
    # gives 2 task slots whatever the machine has.
    conf = f"""
ClusterName=decayjax
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
FirstJobId={first_job}
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""
    with open(self.conf, "w") as f:
      f.write(conf.lstrip())
    # slurmd 22.05 always loads a cgroup plugin (there is no 'disabled'); constrain nothing and
    # do not ask systemd, which containers lack.
    with open(os.path.join(r, "cgroup.conf"), "w") as f:
      f.write("CgroupPlugin=autodetect\nIgnoreSystemd=yes\nConstrainCores=no\n"
              "ConstrainRAMSpace=no\nConstrainSwapSpace=no\nConstrainDevices=no\n")

  def log(self, name: str) -> str:
    return os.path.join(self.root, f"{name}.log")

  def spawn(self, name: str, args) -> None:
    with open(self.log(name), "w") as log:
      self.procs[name] = subprocess.Popen(args, cwd=self.root, env=self.env, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)

  def dead(self):
    """A skip reason if a daemon has exited, else None."""
    for name, p in self.procs.items():
      if p.poll() is not None:
        return (f"one-node SLURM cluster did not start: {name} exited with code {p.returncode}; "
                f"its last log line: {last_line(self.log(name))}")
    return None

  def start(self):
    """Starts the daemons and waits until the node is idle; returns a skip reason or None."""
    self.write_config()
    r = self.root
    self.spawn("munged", ["munged", "--foreground", f"--socket={self.socket}",
                          f"--key-file={r}/munge/munge.key", f"--pid-file={r}/munge/munged.pid",
                          f"--seed-file={r}/munge/munged.seed", f"--log-file={r}/munge/munged.log"])
    deadline = time.monotonic() + START_TIMEOUT_S
    while not os.path.exists(self.socket):  # slurmctld checks munge once, at start
      if (reason := self.dead()) or time.monotonic() > deadline:
        return reason or f"munged made no socket in {START_TIMEOUT_S} s"
      time.sleep(0.1)
    self.spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
    self.spawn("slurmd", ["slurmd", "-D", "-N", "localhost", "-f", self.conf])
    state = ""
    while time.monotonic() < deadline:
      if reason := self.dead():
        return reason
      p = subprocess.run(["sinfo", "-h", "-N", "-n", "localhost", "-o", "%T"], env=self.env,
                         capture_output=True, text=True, timeout=10)
      state = (p.stdout.strip() or p.stderr.strip() or "(nothing)").splitlines()[-1]
      if state == "idle":
        return None
      time.sleep(0.5)
    return (f"one-node SLURM cluster did not start: node localhost not idle after "
            f"{START_TIMEOUT_S} s (sinfo: {state!r}); slurmd's last log line: "
            f"{last_line(self.log('slurmd'))}")

  def submit(self, args) -> str:
    p = subprocess.run(["sbatch", "--parsable", *args], cwd=REPO, env=self.job_env(),
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, f"sbatch failed: {p.stderr}"
    job = p.stdout.strip().split(";")[0]
    self.jobs.append(job)
    return job

  def job_env(self) -> dict:
    """What the job's tasks get (sbatch and srun pass the environment on)."""
    return dict(self.env,
                JAX_PLATFORMS="cpu",
                # One CPU device per task (not conftest's 8); XLA's LLVM optimisations off,
                # which halves the compile of both tasks on 2 shared cores (same loss).
                XLA_FLAGS=xla_flags(1),
                JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",  # as tests/test_multiprocess.py
                SLURM_LABELIO="1")  # srun --label: each output line starts with its task id

  def wait(self, job: str, timeout_s: float):
    """``(JobState, ExitCode)`` once the job has finished; cancels it after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
      out = subprocess.run(["scontrol", "-o", "show", "job", job], env=self.env,
                           capture_output=True, text=True, timeout=10).stdout
      state = re.search(r"JobState=(\w+)", out)
      if state and state.group(1) in FINISHED:
        return state.group(1), re.search(r"ExitCode=(\S+)", out).group(1)
      if time.monotonic() > deadline:
        subprocess.run(["scancel", job], env=self.env, timeout=10)
        return "TIMEOUT (test)", None
      time.sleep(1)

  def stop(self) -> None:
    """Cancels our jobs, stops the daemons (SIGTERM, then SIGKILL) and removes everything."""
    if self.jobs and "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
      subprocess.run(["scancel", *self.jobs], env=self.env, capture_output=True, timeout=10)
      time.sleep(1)  # slurmd signals the job's tasks before it is stopped
    for name in ("slurmd", "slurmctld", "munged"):
      p = self.procs.get(name)
      if p is None:
        continue
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
          p.wait(timeout=10)
        except subprocess.TimeoutExpired:
          os.killpg(p.pid, signal.SIGKILL)
          p.wait()
    shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
  missing = [b for b in BINARIES if shutil.which(b) is None]
  if missing:
    pytest.skip(f"SLURM not installed (missing {', '.join(missing)}); "
                "`apt-get install slurm-wlm munge` (as launch/test.sh does) enables this test")
  # /tmp, not a deep pytest directory: munge's socket path must fit a unix socket name.
  c = Cluster(tempfile.mkdtemp(prefix="decay-jax-slurm-", dir="/tmp" if os.path.isdir("/tmp")
                               else None))
  try:
    if reason := c.start():
      pytest.skip(reason)
    yield c
  finally:
    c.stop()


def test_slurm_job_runs_two_tasks_as_one_jax_distributed_run(cluster):
  workdir = os.path.join(cluster.root, "run")
  out = os.path.join(cluster.root, "job.out")
  job = cluster.submit([
      "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1",
      "--gpus-per-node=0",  # the script asks for 8 GPUs per node; this node has none
      "--time=5", f"--output={out}",
      "launch/slurm.sh", "configs/mae_cpu_mnist.py", workdir, *OVERRIDES])
  state, code = cluster.wait(job, JOB_TIMEOUT_S)
  log = open(out, errors="replace").read() if os.path.exists(out) else ""
  assert (state, code) == ("COMPLETED", "0:0"), (
      f"job {job}: {state}, exit {code}\n--- job output ---\n{log[-4000:]}\n"
      f"--- slurmd ---\n{last_line(cluster.log('slurmd'))}")
  # Each task (srun labels its lines with SLURM_PROCID, which jax's SLURM cluster takes as the
  # process index) logs the global view: 2 devices, one per task, in 2 processes.
  for task in (0, 1):
    assert re.search(rf"^{task}: .*devices: 2 \(cpu\), processes: 2,", log, re.MULTILINE), (
        f"task {task} did not join a 2-process run:\n{log[-4000:]}")
  # Both reached the end, with the same loss of the global batch at the last step.
  losses = dict(re.findall(rf"^(\d): .*results: step {STEPS}, loss ([\d.e+-]+)", log,
                           re.MULTILINE))
  assert sorted(losses) == ["0", "1"] and losses["0"] == losses["1"], log[-4000:]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [str(STEPS)]
  assert os.path.exists(os.path.join(workdir, "checkpoints", str(STEPS), "commit_success.txt"))
