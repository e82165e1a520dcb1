"""Console logging: keep INFO for our own progress, drop the library chatter."""

import logging

_NOISY = ("/orbax/", "/jax/_src/", "/tensorflow/", "/tensorflow_datasets/", "/absl/")


class _QuietLibraries(logging.Filter):
  """Passes WARNING and above from libraries (orbax logs every file it writes at INFO)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.WARNING:
      return True
    return not any(part in record.pathname for part in _NOISY)


def quiet_libraries() -> None:
  """Installs the filter on the absl handler and the root logger's handlers."""
  from absl import logging as absl_logging
  handlers = [absl_logging.get_absl_handler()] + logging.getLogger().handlers
  for h in handlers:
    if not any(isinstance(f, _QuietLibraries) for f in h.filters):
      h.addFilter(_QuietLibraries())


def cpu_malloc_hint(backend: str, environ=None) -> str | None:
  """A one-line tip when XLA:CPU runs under glibc without launch/cpu_env.sh, else None.

  glibc unmaps XLA:CPU's per-step scratch block on free and faults it in again next step
  (launch/cpu_env.sh has the numbers); the launch scripts set the fix, a bare `python -m` does not.
  """
  import os
  import platform
  environ = os.environ if environ is None else environ
  if backend != "cpu" or platform.libc_ver()[0] != "glibc":
    return None
  if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
    return None
  return ("CPU run without launch/cpu_env.sh: glibc unmaps and re-faults XLA's scratch memory "
          "every step (kernel time); `source launch/cpu_env.sh` before python avoids it")
