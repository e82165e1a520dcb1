"""Every file the project reads or writes goes through ``etils.epath`` (the path library of orbax
and TFDS), so a workdir, a dataset or an output may be a local path or an object-store URI
(``gs://bucket/run``, ``s3://...``) alike.

Local paths are made absolute once (a run moved between shells keeps working); URIs are kept as
they are (``os.path.abspath("gs://b/run")`` would give ``<cwd>/gs:/b/run``). Object stores have no
append and no cheap rename, so the helpers here write whole files; JSON records are written to a
temporary name first and moved into place, so a reader never sees half a file on local disk.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any, Union

import numpy as np
from etils import epath

PathLike = Union[str, os.PathLike]
_URI_SCHEMES = ("gs://", "s3://", "az://", "hf://")


def is_uri(path: PathLike) -> bool:
  """True for object-store URIs (``gs://``, ``s3://``, ``az://``, ``hf://``)."""
  return os.fspath(path).startswith(_URI_SCHEMES)


def resolve(path: PathLike) -> epath.Path:
  """``epath.Path`` of ``path``: local paths absolute (``~`` expanded), URIs unchanged."""
  text = os.fspath(path)
  if is_uri(text):
    return epath.Path(text)
  return epath.Path(os.path.abspath(os.path.expanduser(text)))


def join(path: PathLike, *parts: str) -> str:
  """``os.path.join`` that keeps URIs intact; returns a string (for messages and configs)."""
  return os.fspath(resolve(path).joinpath(*parts))


def exists(path: PathLike) -> bool:
  return resolve(path).exists()


def read_text(path: PathLike) -> str:
  return resolve(path).read_text(encoding="utf-8")


def write_text(path: PathLike, text: str) -> None:
  """Writes ``text`` to ``path`` whole (parents created); atomic on local disk via a rename."""
  path = resolve(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  if is_uri(path):  # an object appears whole when its upload ends; a rename would be a copy
    path.write_text(text, encoding="utf-8")
    return
  tmp = path.parent / f".{path.name}.tmp"
  tmp.write_text(text, encoding="utf-8")
  tmp.replace(path)


def append_text(path: PathLike, text: str) -> None:
  """Appends ``text`` to ``path``; object stores have no append, so there the file is rewritten."""
  path = resolve(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  if is_uri(path):
    path.write_text((path.read_text() if path.exists() else "") + text)
    return
  with open(path, "a", encoding="utf-8") as f:
    f.write(text)


def read_json(path: PathLike) -> Any:
  return json.loads(read_text(path))


def write_json(path: PathLike, obj: Any, indent: int = 1) -> None:
  write_text(path, json.dumps(obj, indent=indent))


def write_bytes(path: PathLike, data: bytes) -> None:
  path = resolve(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(data)


def save_png(path: PathLike, image) -> None:
  """Writes a PIL image as PNG to ``path`` (local or URI)."""
  buf = io.BytesIO()
  image.save(buf, format="PNG")
  write_bytes(path, buf.getvalue())


def save_npz(path: PathLike, **arrays) -> None:
  """``np.savez`` of ``arrays`` to ``path`` (local or URI)."""
  buf = io.BytesIO()
  np.savez(buf, **arrays)
  write_bytes(path, buf.getvalue())


def save_npy(path: PathLike, array) -> None:
  """``np.save`` of one array to ``path`` (local or URI)."""
  buf = io.BytesIO()
  np.save(buf, array)
  write_bytes(path, buf.getvalue())


def load_numpy(path: PathLike, mmap: bool = False):
  """``np.load`` of a ``.npy`` / ``.npz`` (no pickles). ``mmap`` maps local ``.npy`` files; URIs are
  read into memory (an object store cannot be mapped)."""
  path = resolve(path)
  try:
    if not is_uri(path):
      return np.load(os.fspath(path), mmap_mode="r" if mmap else None, allow_pickle=False)
    return np.load(io.BytesIO(path.read_bytes()), allow_pickle=False)
  except (ValueError, OSError, EOFError) as e:  # a pickle, a truncated or foreign file
    raise ValueError(f"{str(path)!r} is not allowed; it is not a readable .npy/.npz file "
                     f"({' '.join(str(e).split())[:120]})") from e


def list_files(directory: PathLike, suffixes: tuple = ()) -> list:
  """Every file under ``directory`` (recursively) whose lower-cased name ends with one of
  ``suffixes`` (all files when empty), as sorted strings."""
  root = resolve(directory)
  suffixes = tuple(s.lower() for s in suffixes)
  keep = lambda name: not suffixes or name.lower().endswith(suffixes)
  if not is_uri(root):
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root, followlinks=True)
                  for f in files if keep(f))
  out, todo = [], [root]
  while todo:
    for child in todo.pop().iterdir():
      if child.is_dir():
        todo.append(child)
      elif keep(child.name):
        out.append(str(child))
  return sorted(out)
