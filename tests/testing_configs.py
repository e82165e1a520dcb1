"""Config helpers shared by the end-to-end tests."""

import importlib.util
import os

from decay_jax.train import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str, *args):
  """``configs/<name>.py``'s ``get_config(*args)`` (``args``: the ``:string`` of ``--config``)."""
  spec = importlib.util.spec_from_file_location("cfg", os.path.join(REPO, "configs", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(*args)


override = config_lib.override  # dotted-field overrides, shared with decay_jax.study
