"""Packaging: pyproject.toml agrees with the requirements files the README's commands install from,
the wheel holds the package and its data (not tests/, research/, configs/), and the installed wheel
(and an editable install) imports from outside the checkout and runs its console scripts.

The wheel is built offline (``--no-build-isolation --no-index``, setuptools is pinned in
requirements-test.txt) from a copy of the working tree, so that setuptools' ``build/`` and
``decay_jax.egg-info/`` never land in the checkout. It is installed with ``--no-deps`` into a fresh
venv that sees the test interpreter's site-packages through a ``.pth`` file: a venv made from a
venv's python with ``--system-site-packages`` would see the *base* interpreter's packages instead.
"""

import fcntl
import fnmatch
import importlib.metadata
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tomllib
import types
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# [project.scripts]: the layout of issue 32, the input benchmark of issue 34, the trace table of
# issue 37.
SCRIPTS = {
    "decay-jax-train": "decay_jax.cli.train:run",
    "decay-jax-evaluate": "decay_jax.cli.evaluate:run",
    "decay-jax-sample": "decay_jax.cli.sample:run",
    "decay-jax-fid": "decay_jax.cli.fid:run",
    "decay-jax-bench": "decay_jax.cli.bench:run",
    "decay-jax-trace-table": "decay_jax.cli.trace_table:run",
    "decay-jax-data-bench": "decay_jax.cli.data_bench:run",
    "decay-jax-memory": "decay_jax.cli.memory:run",
    "decay-jax-compare": "decay_jax.cli.compare:run",
    "decay-jax-extract-latents": "decay_jax.cli.extract_latents:run",
    "decay-jax-convert": "decay_jax.cli.convert:run",
    "decay-jax-convert-external": "decay_jax.cli.convert_external:run",
    "decay-jax-schedules": "decay_jax.cli.schedules:run",
    "decay-jax-lower": "decay_jax.cli.lower:run",
}
EMBEDDED_NPZ = "decay_jax/data/embedded/mnist_10k.npz"
TIMEOUT = 300

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9._,-]+\])?==([A-Za-z0-9.+!*-]+)$")
# Variables a package might set at import time: removed from the subprocesses' environment, so that
# an `os.environ.setdefault` in decay_jax shows up as a change (conftest.py sets some of them).
_ENV_STRIP = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "PYTHONUSERBASE",
              "VIRTUAL_ENV", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL")


def _pin(line):
  """'Name[extra]==1.0' -> ('name', '[extra]', '1.0'), names normalised as PEP 503 does."""
  m = _PIN.match(line.replace(" ", ""))
  assert m, f"not an exact pin: {line!r}"
  return re.sub(r"[-_.]+", "-", m[1]).lower(), m[2] or "", m[3]


def _requirement_pins(name):
  """The file's own pins (no -r includes); every other non-comment line is an error."""
  pins = []
  with open(os.path.join(REPO, name)) as f:
    for raw in f:
      line = raw.split("#", 1)[0].strip()
      if not line or line == "-r requirements.txt":
        continue
      pins.append(_pin(line))
  return pins


def _pyproject():
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def _as_set(pins, what):
  assert len(set(pins)) == len(pins), f"duplicate pins in {what}: {pins}"
  names = [p[0] for p in pins]
  assert len(set(names)) == len(names), f"a package pinned twice in {what}: {sorted(names)}"
  return set(pins)


def test_pyproject_metadata():
  project = _pyproject()["project"]
  assert project["name"] == "decay-jax"
  assert project["version"] == "0.1.0"
  assert project["requires-python"] == ">=3.11"  # what the pinned jax, numpy, flax need
  assert project["readme"] == "README.md"
  assert project["scripts"] == SCRIPTS
  for target in SCRIPTS.values():
    module = target.split(":")[0]
    assert os.path.isfile(os.path.join(REPO, *module.split(".")) + ".py"), target


def test_dependencies_match_requirements_txt():
  runtime = _as_set(_requirement_pins("requirements.txt"), "requirements.txt")
  project = _as_set([_pin(d) for d in _pyproject()["project"]["dependencies"]], "pyproject")
  assert project == runtime, (f"only in pyproject: {sorted(project - runtime)}; "
                              f"only in requirements.txt: {sorted(runtime - project)}")


def test_test_extra_matches_requirements_test_txt():
  with open(os.path.join(REPO, "requirements-test.txt")) as f:
    assert "-r requirements.txt" in [line.strip() for line in f]
  test = _as_set(_requirement_pins("requirements-test.txt"), "requirements-test.txt")
  extra = _as_set([_pin(d) for d in _pyproject()["project"]["optional-dependencies"]["test"]],
                  "the test extra")
  assert extra == test, (f"only in the test extra: {sorted(extra - test)}; "
                         f"only in requirements-test.txt: {sorted(test - extra)}")
  runtime = {p[0] for p in _requirement_pins("requirements.txt")}
  assert not runtime & {p[0] for p in test}, "requirements-test.txt re-pins a runtime dependency"


def test_accelerator_extras_pin_the_same_jax():
  versions = {name: version for name, _, version in _requirement_pins("requirements.txt")}
  assert versions["jaxlib"] == versions["jax"]
  extras = _pyproject()["project"]["optional-dependencies"]
  assert [_pin(d) for d in extras["cuda12"]] == [("jax", "[cuda12]", versions["jax"])]
  assert [_pin(d) for d in extras["tpu"]] == [("jax", "[tpu]", versions["jax"]),
                                              ("libtpu", "", "0.0.42.1")]
  # the libtpu of the tpu extra is the one jax[tpu] of the pinned jax requires (0.0.42.*), and
  # the tests compile with that same one
  test = {name: version for name, _, version in _requirement_pins("requirements-test.txt")}
  assert test["libtpu"] == "0.0.42.1"


# ---------------------------------------------------------------------------------------- the wheel


def _env():
  env = {k: v for k, v in os.environ.items() if k not in _ENV_STRIP}
  env["PYTHONNOUSERSITE"] = "1"
  return env


def _run(args, cwd, check=True):
  p = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
  if check and p.returncode:
    pytest.fail(f"{args} exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\n"
                f"stderr:\n{p.stderr[-3000:]}")
  return p


def _copy_ignore(directory, names):
  """copytree filter: no git, venvs, build outputs, workdirs or byte code."""
  drop = {n for n in names if n in ("__pycache__", ".git", ".pytest_cache")
          or n.endswith((".pyc", ".egg-info"))}
  if os.path.samefile(directory, REPO):
    drop |= {n for n in names if n in ("build", "dist", "outputs") or fnmatch.fnmatch(n, "workdir*")
             or os.path.isfile(os.path.join(directory, n, "pyvenv.cfg"))}
  return drop


def _test_site_dirs():
  """The test interpreter's site-packages (a venv's own, plus the base's if the venv includes them)."""
  dirs = []
  for d in site.getsitepackages() + [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]:
    if os.path.isdir(d) and os.path.realpath(d) not in [os.path.realpath(x) for x in dirs]:
      dirs.append(d)
  return dirs


def _make_venv(root):
  """A venv under root whose python also sees the test interpreter's packages (pip included)."""
  _run([sys.executable, "-m", "venv", "--without-pip", root], cwd=os.path.dirname(root))
  python = os.path.join(root, "bin", "python")
  purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                 cwd=root).stdout.strip()
  with open(os.path.join(purelib, "_decay_jax_test_site.pth"), "w") as f:
    for d in _test_site_dirs():  # after the venv's own site-packages, so the install there wins
      f.write(f"import site; site.addsitedir({d!r})\n")
  return types.SimpleNamespace(root=root, python=python, purelib=purelib,
                               bin=os.path.join(root, "bin"))


def _no_decay_jax_in_test_site():
  for d in _test_site_dirs():
    for dist in importlib.metadata.distributions(path=[d]):
      assert dist.metadata["Name"].lower().replace("_", "-") != "decay-jax", (
          f"decay-jax is installed in {d} (editable?): `pip uninstall decay-jax` there; it would "
          "hide what the installed wheel does")
    assert not [n for n in os.listdir(d) if "decay_jax" in n], os.listdir(d)


def _build_and_install(root):
  src, dist = os.path.join(root, "src"), os.path.join(root, "dist")
  shutil.copytree(REPO, src, ignore=_copy_ignore, symlinks=True)
  _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
        "--disable-pip-version-check", "-q", "-w", dist, src], cwd=src)
  (wheel,) = [os.path.join(dist, n) for n in os.listdir(dist) if n.endswith(".whl")]
  venv = _make_venv(os.path.join(root, "venv"))
  _run([venv.python, "-m", "pip", "install", "--no-deps", "--no-index",
        "--disable-pip-version-check", "-q", wheel], cwd=root)
  return dict(wheel=wheel, **vars(venv))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """Builds the wheel and installs it into a fresh venv, once per run (also under pytest-xdist)."""
  _no_decay_jax_in_test_site()
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent  # shared by the workers of this run
  root = str(base / "packaging")
  with open(str(base / "packaging.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = os.path.join(root, "done.json")
    if not os.path.exists(done):
      shutil.rmtree(root, ignore_errors=True)
      os.makedirs(root)
      info = _build_and_install(root)
      with open(done, "w") as f:
        json.dump(info, f)
    with open(done) as f:
      return types.SimpleNamespace(**json.load(f))


def test_wheel_contents(installed):
  with zipfile.ZipFile(installed.wheel) as z:
    names = z.namelist()
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = z.read(entry_points).decode()
  assert "decay_jax/models/mae.py" in names
  assert EMBEDDED_NPZ in names
  assert "decay_jax/data/embedded/README.md" in names  # the data's CC BY-SA credit and licence
  top = {n.split("/")[0] for n in names}
  assert top == {"decay_jax", "decay_jax-0.1.0.dist-info"}, top
  assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
  scripts = dict(re.findall(r"^\s*([\w.-]+)\s*=\s*(\S+)\s*$",
                            text.split("[console_scripts]", 1)[1].split("\n[", 1)[0], re.M))
  assert scripts == SCRIPTS


# Runs in the installed venv, cwd outside the checkout: where decay_jax comes from, what importing it
# does to os.environ, whether the data is there, and where each console script's run() is.
_PROBE = r"""
import ast, importlib.metadata, importlib.resources, importlib.util, json, os, sys
before = dict(os.environ)
import decay_jax
after = dict(os.environ)
from decay_jax.models import mae
scripts = {}
for ep in importlib.metadata.entry_points(group="console_scripts"):
  if ep.dist is not None and ep.dist.name == "decay-jax":
    origin = importlib.util.find_spec(ep.module).origin  # imports the parent packages only
    with open(origin) as f:
      tree = ast.parse(f.read())
    run = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == ep.attr]
    takes_no_args = bool(run) and not (run[0].args.args or run[0].args.posonlyargs
                                       or [k for k, d in zip(run[0].args.kwonlyargs,
                                                             run[0].args.kw_defaults) if d is None])
    scripts[ep.name] = [ep.value, origin, takes_no_args]
npz = importlib.resources.files("decay_jax.data").joinpath("embedded/mnist_10k.npz")
print(json.dumps(dict(
    decay_jax=decay_jax.__file__, mae=mae.__file__, version=getattr(decay_jax, "__version__", None),
    dist_version=importlib.metadata.version("decay-jax"), sys_path=sys.path, scripts=scripts,
    npz=npz.is_file(),
    environ={k: [before.get(k), after.get(k)] for k in set(before) | set(after)
             if before.get(k) != after.get(k)})))
"""


def _probe(python, cwd):
  out = _run([python, "-c", _PROBE], cwd=cwd).stdout
  return json.loads(out.strip().splitlines()[-1])


def _under(path, directory):
  path, directory = os.path.realpath(path), os.path.realpath(directory)
  return os.path.commonpath([path, directory]) == directory


@pytest.fixture(scope="module")
def probe(installed, tmp_path_factory):
  return _probe(installed.python, str(tmp_path_factory.mktemp("outside")))


def test_installed_wheel_imports_outside_the_checkout(installed, probe):
  for key in ("decay_jax", "mae"):
    assert _under(probe[key], installed.purelib), (key, probe[key], installed.purelib)
  assert not [p for p in probe["sys_path"] if p and os.path.realpath(p) in
              (os.path.realpath(REPO), os.path.realpath(os.path.join(REPO, "tests")))]
  assert probe["npz"], "the embedded MNIST subset is not in the installed package"
  assert probe["version"] == probe["dist_version"] == _pyproject()["project"]["version"]


def test_importing_decay_jax_leaves_environ_alone(probe):
  assert probe["environ"] == {}, f"`import decay_jax` changed os.environ: {probe['environ']}"


def test_console_scripts_point_at_run_functions(installed, probe):
  assert {name: value for name, (value, _, _) in probe["scripts"].items()} == SCRIPTS
  for name, (value, origin, takes_no_args) in sorted(probe["scripts"].items()):
    assert _under(origin, installed.purelib), (name, origin)
    assert os.path.isfile(os.path.join(installed.bin, name)), name
  missing = sorted(value for value, _, ok in probe["scripts"].values() if not ok)
  assert not missing, f"no top-level `def run()` without required arguments: {missing}"


def test_console_script_runs(installed, tmp_path):
  script = os.path.join(installed.bin, "decay-jax-schedules")
  p = _run([script, "--help"], cwd=str(tmp_path))
  assert "usage:" in p.stdout
  p = _run([script, "--depth=4", "--alpha-min=0.6"], cwd=str(tmp_path))
  assert p.stdout.strip()


def test_editable_install(tmp_path):
  """`pip install -e .` (README) works: from a copy of the tree, so its egg-info stays out of REPO."""
  _no_decay_jax_in_test_site()
  src = str(tmp_path / "src")
  shutil.copytree(REPO, src, ignore=_copy_ignore, symlinks=True)
  venv = _make_venv(str(tmp_path / "venv"))
  _run([venv.python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
        "--disable-pip-version-check", "-q", "-e", src], cwd=str(tmp_path))
  outside = tmp_path / "outside"
  outside.mkdir()
  probe = _probe(venv.python, str(outside))
  assert _under(probe["decay_jax"], os.path.join(src, "decay_jax")), probe["decay_jax"]
  assert sorted(probe["scripts"]) == sorted(SCRIPTS)
  assert probe["npz"]
