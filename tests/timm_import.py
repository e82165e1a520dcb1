"""Import timm (the reference of tests/test_timm_parity.py) where torchvision cannot be imported.

Why: timm 1.0 imports torchvision at module level (``timm.layers`` takes ``FrozenBatchNorm2d``
from ``torchvision.ops.misc``; ``timm.data`` imports ``torchvision.transforms``), but the only
torchvision builds for the pinned torch CPU wheel are CUDA builds that fail to import ("operator
torchvision::nms does not exist"). timm is therefore installed with ``--no-deps``
(requirements-test-nodeps.txt), and none of the code the parity tests run (VisionTransformer,
Mixup, auto_augment, RandomErasing) touches torchvision.

``import_timm()`` returns the real torchvision-backed timm when torchvision imports. Otherwise, only
while ``import timm`` runs, a ``sys.meta_path`` finder serves ``torchvision`` and every
``torchvision.*`` submodule as an inert stub: any attribute of a stub module is a placeholder class
(subclassable, hashable, comparable by identity, with arbitrary class attributes such as
``InterpolationMode.BILINEAR``) and constructing one raises ``RuntimeError``, so a test that reached
torchvision would fail loudly instead of testing a stub. Afterwards the finder and the stub modules
are removed, so the rest of the process sees no torchvision.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

STUB = "torchvision"


class _Placeholder(type):
  """Metaclass: every unknown class attribute is another placeholder class (one per name)."""

  def __getattr__(cls, name):
    if name.startswith("__"):
      raise AttributeError(name)
    return _placeholder(f"{cls.__qualname__}.{name}", cls.__module__)


class _Unavailable(metaclass=_Placeholder):
  def __init__(self, *args, **kwargs):
    raise RuntimeError(f"{type(self).__module__}.{type(self).__qualname__} is a stub: torchvision "
                       "is not importable here (tests/timm_import.py)")


_CACHE: dict = {}


def _placeholder(qualname: str, module: str) -> type:
  key = (module, qualname)
  if key not in _CACHE:
    _CACHE[key] = _Placeholder(qualname.rsplit(".", 1)[-1], (_Unavailable,),
                               {"__module__": module, "__qualname__": qualname})
  return _CACHE[key]


class _StubModule(types.ModuleType):
  def __getattr__(self, name):  # PEP 562 style: attributes that are not submodules
    if name.startswith("__"):
      raise AttributeError(name)
    return _placeholder(name, self.__name__)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  def find_spec(self, fullname, path=None, target=None):
    if fullname == STUB or fullname.startswith(STUB + "."):
      return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
    return None

  def create_module(self, spec):
    module = _StubModule(spec.name)
    module.__path__ = []  # a package, so that any submodule can be imported
    return module

  def exec_module(self, module):
    pass


def _real_torchvision_imports() -> bool:
  if importlib.util.find_spec(STUB) is None:
    return False
  try:
    importlib.import_module(STUB)
    return True
  except (ImportError, RuntimeError):  # e.g. a CUDA-only build: "operator torchvision::nms ..."
    for name in [n for n in sys.modules if n == STUB or n.startswith(STUB + ".")]:
      del sys.modules[name]
    return False


def import_timm():
  """The ``timm`` package, imported with a stub torchvision when the real one cannot be imported."""
  if importlib.util.find_spec("timm") is None:
    raise ModuleNotFoundError("timm is not installed: `pip install --no-deps -r "
                              "requirements-test-nodeps.txt` (launch/test.sh does this)")
  if "timm" in sys.modules or _real_torchvision_imports():
    return importlib.import_module("timm")
  finder = _StubFinder()
  sys.meta_path.insert(0, finder)
  try:
    timm = importlib.import_module("timm")
    importlib.import_module("timm.data")
  finally:
    sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if n == STUB or n.startswith(STUB + ".")]:
      del sys.modules[name]
  return timm
