"""``XLA_FLAGS`` for the tests' processes (pytest's own, set in conftest.py, and the commands the
tests start): ``devices`` fake CPU devices, and XLA's LLVM optimisations off. The tests' models are
tiny, so XLA's CPU compile is most of their time and LLVM's passes most of the compile: without them
the suite takes about a quarter less (docs/testing.md); each test compares runs compiled alike.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
  """The flags for a process with ``devices`` CPU devices (None: XLA's default, one)."""
  count = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
  return " ".join(count + [FAST_COMPILE])
