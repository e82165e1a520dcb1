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
