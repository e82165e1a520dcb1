"""The seconds each test module takes in a full run, for tests/conftest.py's order and tiers.

``python tests/module_seconds.py JUNIT_XML`` rewrites ``tests/module_seconds.json`` from the JUnit
report of a full run (``bash launch/test.sh --junitxml=JUNIT_XML``): per module the sum of its
tests' times (setup, call and teardown, which the report adds up per test) as the worker that ran
it measured them. Read by ``load()``; a module missing from the table (a new one) counts as
``DEFAULT_SECONDS_PER_TEST`` a test until the table is made again.
"""

import collections
import json
import os
import sys
import xml.etree.ElementTree as ET

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_seconds.json")
DEFAULT_SECONDS_PER_TEST = 2.0


def load() -> dict:
  """``{'tests/test_x.py': seconds}`` (empty when the table is missing)."""
  if not os.path.exists(TABLE):
    return {}
  with open(TABLE) as f:
    return json.load(f)["seconds"]


def from_junit(path: str) -> dict:
  """Seconds per module from a JUnit XML report (``classname`` ``tests.test_x[.Class]``)."""
  out = collections.Counter()
  for case in ET.parse(path).getroot().iter("testcase"):
    parts = case.get("classname", "").split(".")
    module = next((i for i, p in enumerate(parts) if p.startswith("test_")), None)
    if module is not None:
      out["/".join(parts[:module + 1]) + ".py"] += float(case.get("time", 0.0))
  return {k: round(v, 1) for k, v in sorted(out.items())}


def main(argv) -> int:
  if len(argv) != 2:
    print("usage: python tests/module_seconds.py JUNIT_XML", file=sys.stderr)
    return 2
  seconds = from_junit(argv[1])
  with open(TABLE, "w") as f:
    json.dump({"source": os.path.basename(argv[1]), "seconds": seconds}, f, indent=1)
    f.write("\n")
  print(f"{len(seconds)} modules, {sum(seconds.values()):.0f} s in all -> {TABLE}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
