"""Config helpers shared by the end-to-end tests."""

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str):
  """``configs/<name>.py``'s ``get_config()``."""
  spec = importlib.util.spec_from_file_location("cfg", os.path.join(REPO, "configs", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def override(c, **overrides):
  """Sets dotted fields, e.g. ``override(c, **{"model.alpha_min": 0.7})``; returns ``c``."""
  for key, value in overrides.items():
    node = c
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  return c
