"""PyTorch files: ``.pth`` read with the tensors-only unpickler, written with ``torch.save``.

Files are read with ``torch.load(weights_only=True)`` only: a pickle holding code is refused, never
run, and the refusal names the objects it would have built (found by parsing, never executing).
Paths go through ``etils.epath`` (``gs://`` works). Every failure is one ``InputError`` line naming
the argument. torch is imported only when a file is read or written.
"""

from __future__ import annotations

import argparse
import io
import pickle
import pickletools
import re
import warnings
import zipfile
from typing import List, Mapping

import numpy as np
from etils import epath

from decay_jax import paths
from decay_jax.io.inputs import bad_input, error_detail, input_file, read_head


def _torch(what: str):
  try:
    import torch  # pylint: disable=import-outside-toplevel  (only the .pth paths need it)
  except ImportError:
    raise SystemExit(f"{what} needs PyTorch: pip install torch==2.13.0 (CPU is enough)") from None
  return torch


def is_safetensors(head: bytes) -> bool:
  """A safetensors file opens with its header length (8 bytes, little endian) and a JSON object."""
  return len(head) >= 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") < 1 << 32


# Globals a tensor checkpoint's pickle may name (torch's restricted unpickler allows these).
_TENSOR_GLOBALS = ("torch.", "collections.OrderedDict", "argparse.Namespace", "_codecs.encode")
_SCAN_LIMIT = 64 << 20


def _foreign_globals(p: epath.Path, error: BaseException) -> List[str]:
  """Python objects (functions, classes) a refused pickle names, none of them ever built.

  torch's refusal names the first (``GLOBAL posix.system``) when it got that far; otherwise the
  opcodes are listed with ``pickletools.genops``, which parses and never executes.
  """
  found = re.findall(r"GLOBAL ([\w.]+)", str(error))
  if found:
    return list(dict.fromkeys(found))
  try:
    with p.open("rb") as f:
      data = f.read(_SCAN_LIMIT)
    if zipfile.is_zipfile(io.BytesIO(data)):
      with zipfile.ZipFile(io.BytesIO(data)) as z:
        data = next((z.read(n) for n in z.namelist() if n.endswith("data.pkl")), b"")
  except Exception:  # pylint: disable=broad-except  (unreadable: nothing more to say)
    return []
  names, strings = [], []
  try:
    for op, arg, _ in pickletools.genops(data):
      if op.name in ("GLOBAL", "INST"):
        names.append(str(arg).replace(" ", "."))
      elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
        names.append(f"{strings[-2]}.{strings[-1]}")
      elif isinstance(arg, str):
        strings.append(arg)
  except Exception:  # pylint: disable=broad-except  (bytes after the pickle, or no pickle at all)
    pass
  return [n for n in dict.fromkeys(names) if not n.startswith(_TENSOR_GLOBALS)]


def _load_failure(e: BaseException) -> str:
  if isinstance(e, RuntimeError) and "zip archive" in str(e):
    return "it is a damaged or truncated zip archive (torch.save's format)"
  if isinstance(e, EOFError):
    return "it ends early (a truncated file?)"
  return f"it is not a PyTorch checkpoint ({error_detail(e)})"


def read_torch_file(path: str, arg: str = "--checkpoint",
                    expected: str = "a PyTorch checkpoint (.pth)"):
  """``torch.load`` of ``path`` restricted to tensors, containers and argparse Namespaces.

  The file is opened through ``etils.epath`` (local paths and ``gs://`` alike). A pickle that would
  build anything else (a call such as ``os.system``, an arbitrary class) is refused by torch's
  restricted unpickler before any of it runs. Every failure is one ``InputError`` line naming
  ``arg``: a missing file, a directory, an empty, truncated or foreign file, a safetensors file,
  and a pickle holding code.

  Returns:
    What the file holds (official checkpoints: a dict of state_dicts and ``args``).
  """
  torch = _torch("reading .pth files")
  p = input_file(path, arg, expected)
  if is_safetensors(read_head(p, arg, path, expected)):
    raise bad_input(arg, path, "is a safetensors file, not a PyTorch .pth", expected)
  try:
    with p.open("rb") as f, warnings.catch_warnings(), \
        torch.serialization.safe_globals([argparse.Namespace]):
      warnings.simplefilter("ignore")  # torch warns on stderr about unusual pickle protocols
      return torch.load(f, map_location="cpu", weights_only=True)
  except pickle.UnpicklingError as e:
    names = _foreign_globals(p, e)
    if names:
      raise bad_input(arg, path, f"contains code or objects other than tensors "
                      f"({', '.join(names[:3])}); it was not loaded", expected) from None
    raise bad_input(arg, path, "cannot be read; it is not a PyTorch checkpoint (not a pickle "
                    "of tensors)", expected) from None
  except Exception as e:  # pylint: disable=broad-except  (bytes of any kind raise any kind)
    raise bad_input(arg, path, f"cannot be read; {_load_failure(e)}", expected) from None


def load_torch_checkpoint(path: str) -> dict:
  """An official ``.pth`` as ``read_torch_file`` reads it (tensors and ``args`` only)."""
  return read_torch_file(path)


def write_torch_file(contents: dict, out: str, arg: str = "--out") -> None:
  """``torch.save`` of ``contents`` (numpy arrays become float32/int tensors) through ``epath``."""
  torch = _torch("writing .pth files")
  tensors = {}

  def convert(x):
    if isinstance(x, np.ndarray):
      key = id(x)  # the same array twice (SiT 'model' and 'ema') is stored once
      if key not in tensors:
        a = x.astype(np.float32) if np.issubdtype(x.dtype, np.floating) else x
        tensors[key] = torch.from_numpy(np.ascontiguousarray(a))
      return tensors[key]
    if isinstance(x, Mapping):
      return type(x)((k, convert(v)) for k, v in x.items())
    return x

  p = paths.resolve(out)
  if p.is_dir():
    raise bad_input(arg, out, "is a directory", "a file name for the .pth")
  try:
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("wb") as f:
      torch.save(convert(contents), f)
  except Exception as e:  # pylint: disable=broad-except  (file systems and object stores)
    raise bad_input(arg, out, f"cannot be written ({error_detail(e)})") from None
