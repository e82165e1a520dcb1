"""Test set-up: 8 fake CPU devices for sharding tests (XLA flags: tests/xla_env.py), float32
matmuls at full precision."""

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_TESTS)
sys.path.insert(0, _REPO)
sys.path.insert(0, _TESTS)
from xla_env import xla_flags  # noqa: E402

os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see decay_jax/cli/__init__.py
# gs:// through fsspec (gcsfs), which tests/test_object_store.py points at its local emulator, never
# through TensorFlow's client, whose endpoint is compiled in (epath decides once per process).
os.environ.setdefault("EPATH_USE_TF", "false")
# Many tests train the same tiny models (resume against uninterrupted, one device count against
# another, a command in a subprocess): each trainer call jits afresh, so XLA would compile the same
# program again. One compilation cache for the session's processes (xdist workers and the
# subprocesses they start inherit these variables) compiles it once. Size-bounded, which also makes
# JAX lock the folder (filelock) while two workers read and write it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(_REPO, ".pytest_cache", "jax_compilation"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402
from absl import logging as absl_logging  # noqa: E402


@pytest.fixture(autouse=True)
def _absl_logger_level():
  """Restores absl's logger level after each test: a test that pins it (``set_verbosity``) would
  leave a later test of the same xdist worker that reads INFO records (caplog) without them."""
  logger = absl_logging.get_absl_logger()
  level = logger.level
  yield
  logger.setLevel(level)


# ----- order and tiers -----------------------------------------------------------------------------
# launch/test.sh gives each xdist worker whole modules (--dist loadscope) in the order collected
# (--no-loadscope-reorder): the longest modules first, so that no long module starts last and runs
# alone while the other worker idles (longest-processing-time-first). The seconds per module come
# from a full run (tests/module_seconds.py). A module longer than FAST_TIER_SECONDS is marked
# ``slow``: ``bash launch/test.sh -m "not slow"`` is the fast tier for iteration (docs/testing.md).
FAST_TIER_SECONDS = 35.0


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: a module over FAST_TIER_SECONDS in a full run "
                                     "(tests/conftest.py); -m 'not slow' leaves them out")


def pytest_collection_modifyitems(config, items):
  from module_seconds import DEFAULT_SECONDS_PER_TEST, load
  table = load()
  count = {}
  for item in items:
    count[item.location[0]] = count.get(item.location[0], 0) + 1
  seconds = {m: table.get(m, DEFAULT_SECONDS_PER_TEST * n) for m, n in count.items()}
  for item in items:
    if seconds[item.location[0]] > FAST_TIER_SECONDS:
      item.add_marker(pytest.mark.slow)
  # stable: a module's tests keep their order
  items.sort(key=lambda item: (-seconds[item.location[0]], item.location[0]))
