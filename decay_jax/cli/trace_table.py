"""Time by op category of a profiled run: a table of what the train step spends its time on.

    python -m decay_jax.cli.main --config=configs/mae_cpu_mnist.py --workdir=W \\
        --config.profile_steps=20,3 --config.num_train_steps=30
    python -m decay_jax.cli.trace_table W            # the newest profile under W/profile
    python -m decay_jax.cli.trace_table /tmp/decay_jax_bench_profile   # bench --profile_steps

Reads the profile's ``perfetto_trace.json.gz`` and the compiled step's ``train_step.hlo.txt``
(``decay_jax.train.profiling`` writes both) and prints milliseconds per step by category
(matmuls, attention, norms, transposes/copies, other, optimizer: ``perf.trace_table`` has the
rules), the host side (input pipeline, host gaps) and the split by model part and direction
(e.g. MAE's encoder against its decoder, forward against backward). ``--json=FILE`` also writes
the numbers.
"""

from __future__ import annotations

import json
import sys

from absl import flags

from decay_jax import paths
from decay_jax.cli import errors
from decay_jax.perf import trace_table

_JSON = flags.DEFINE_string("json", None, "Also write the numbers to this JSON file.")


def main(argv):
  if len(argv) != 2:
    print("error: give one path: a workdir, a --profile_dir, or a profile's run directory "
          "(usage: python -m decay_jax.cli.trace_table PATH)", file=sys.stderr)
    return 2
  try:
    summary = trace_table.summarize(trace_table.find_run(argv[1]))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"profile: {summary['run_dir']}")
  print(trace_table.format_table(summary))
  if _JSON.value:
    paths.write_text(_JSON.value, json.dumps(summary, indent=1))
  return 0


def run():
  errors.run(main)


if __name__ == "__main__":
  run()
