"""Test set-up: 8 fake CPU devices for sharding tests, float32 matmuls at full precision."""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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
_TESTS = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_TESTS)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(_REPO, ".pytest_cache", "jax_compilation"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))
sys.path.insert(0, _REPO)
sys.path.insert(0, _TESTS)

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
