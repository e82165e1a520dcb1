"""``logs.quiet_failed_reads``: the orphaned tensorstore read tasks of a failed orbax restore are not
reported (they would bury the one-line error), and nothing else is hidden."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tensorstore future that fails, wrapped by asyncio into a `_wrap_awaitable` task whose exception
# nobody retrieves: what orbax leaves behind when a sibling read of a corrupt checkpoint fails.
SCRIPT = """
import asyncio, gc, logging, sys
import tensorstore as ts
from decay_jax import logs
if sys.argv[1] == "quiet":
  logs.quiet_failed_reads()
logging.basicConfig()

class Plain:  # an awaitable of our own: its failure must still be reported
  def __await__(self):
    raise KeyError("ours")
    yield

async def main():
  spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": "/nonexistent/decay_jax/x"}}
  asyncio.ensure_future(ts.open(spec, open=True))
  asyncio.ensure_future(Plain())
  await asyncio.sleep(0.5)

asyncio.run(main())
gc.collect()
"""


def _stderr(mode):
  p = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO, capture_output=True, text=True,
                     timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
  assert p.returncode == 0, p.stderr[-2000:]
  return p.stderr


def test_orphaned_tensorstore_tasks_are_quiet_and_ours_are_not():
  loud = _stderr("loud")
  assert loud.count("Task exception was never retrieved") == 2 and "NOT_FOUND" in loud
  quiet = _stderr("quiet")
  assert quiet.count("Task exception was never retrieved") == 1
  assert "NOT_FOUND" not in quiet and "KeyError: 'ours'" in quiet
