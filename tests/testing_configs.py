"""Config helpers shared by the end-to-end tests."""

import importlib.util
import os

from decay_jax.train import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str, *args):
  """``configs/<name>.py``'s ``get_config(*args)`` (``args``: the ``:string`` of ``--config``).

  A ``name`` ending in ``.py`` is a path from the repository root (the study's config).
  """
  path = (os.path.join(REPO, name) if name.endswith(".py")
          else os.path.join(REPO, "configs", f"{name}.py"))
  spec = importlib.util.spec_from_file_location("cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(*args)


override = config_lib.override  # dotted-field overrides, shared with research.small_scale_study.run
