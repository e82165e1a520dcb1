"""The converters' command-line inputs: every bad input is one ``InputError`` line naming the
argument (``ARG VALUE: what is wrong; expected WHAT``), and the checks of input files and output
directories that raise it."""

from __future__ import annotations

from etils import epath

from decay_jax import paths
from decay_jax.validate import InputError

OUT_DIR = "a directory for the Flax params (params/ and model.json)"


def bad_input(arg: str, value, problem: str, expected: str = "") -> InputError:
  """``InputError('--checkpoint /x.pth: no such file; expected an official ...')``.

  Args:
    arg: the command-line argument (``--checkpoint``).
    value: what was given (``None`` when the argument is missing).
    problem: what is wrong with it.
    expected: what the argument must be (left out when empty).
  """
  text = f"{arg}: {problem}" if value is None else f"{arg} {value}: {problem}"
  if expected:
    text += f"; expected {expected}"
  return InputError(" ".join(text.split()))


def error_detail(e: BaseException, limit: int = 120) -> str:
  """``Type: first sentence`` of a library's exception, on one line and at most ``limit`` chars.

  torch's refusals of a pickle advise loading it with the unrestricted unpickler, which would run
  whatever code it holds; such text is dropped (the type alone remains), never shown.
  """
  text = " ".join(str(e.args[0] if isinstance(e, KeyError) and e.args else e).split())
  if "weights_only" in text:
    text = ""
  text = text.split(" See full TensorStore details")[0].split(". ")[0]
  if len(text) > limit:
    text = text[:limit - 3] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__



def input_file(path: str, arg: str, expected: str) -> epath.Path:
  """``path`` (local or a URI) as an ``epath.Path``, after checking that it is an existing file."""
  p = paths.resolve(path)
  try:
    is_dir, exists = p.is_dir(), p.exists()
  except Exception as e:  # pylint: disable=broad-except  (a bucket that cannot be reached, ...)
    raise bad_input(arg, path, f"cannot be opened ({error_detail(e)})", expected) from None
  if is_dir:
    raise bad_input(arg, path, "is a directory, not a file", expected)
  if not exists:
    raise bad_input(arg, path, "no such file", expected)
  return p


def read_head(p: epath.Path, arg: str, path: str, expected: str, size: int = 16) -> bytes:
  """The first ``size`` bytes of a file (to tell its format before parsing it)."""
  try:
    with p.open("rb") as f:
      head = f.read(size)
  except Exception as e:  # pylint: disable=broad-except  (permissions, object-store errors)
    raise bad_input(arg, path, f"cannot be opened ({error_detail(e)})", expected) from None
  if not head:
    raise bad_input(arg, path, "is empty", expected)
  return head


def check_out_dir(out: str) -> None:
  """``--out`` may be a new or an existing directory, not a file."""
  p = paths.resolve(out)
  if p.exists() and not p.is_dir():
    raise bad_input("--out", out, "is a file", OUT_DIR)
