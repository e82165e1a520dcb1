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


def write_digit_folder(directory: str, train: int = 64, test_per_class: int = 2) -> str:
  """An image folder of PNG digits from the embedded MNIST: ``directory/train/<digit>/<i>.png``
  (the first ``train`` training digits) and ``directory/test/<digit>/<i>.png`` (the first
  ``test_per_class`` test digits of each class, so both splits have all ten class folders).
  File names are zero-padded indices, so the sorted order is the index order within a class.
  Written once; returns ``directory``."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  if os.path.isdir(directory):
    return directory
  with np.load(os.path.join(REPO, "decay_jax", "data", "embedded", "mnist_10k.npz")) as d:
    test = np.concatenate([np.nonzero(d["y_test"] == c)[0][:test_per_class] for c in range(10)])
    arrays = {"train": (d["x_train"][:train], d["y_train"][:train]),
              "test": (d["x_test"][test], d["y_test"][test])}
  for split, (images, labels) in arrays.items():
    for i, (image, label) in enumerate(zip(images, labels)):
      os.makedirs(os.path.join(directory, split, str(label)), exist_ok=True)
      Image.fromarray(image[..., 0], "L").save(
          os.path.join(directory, split, str(label), f"{i:04d}.png"))
  return directory
