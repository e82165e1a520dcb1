#!/usr/bin/env python
"""Interleaved A/B of XLA:CPU flag sets on the train step, one ``decay_jax.cli.bench`` per arm.

    python launch/cpu_flag_ab.py OUTDIR            # all variants, 3 workloads, 3 rounds
    python launch/cpu_flag_ab.py OUTDIR --variants=default,no_xnnpack --rounds=5
    python launch/cpu_flag_ab.py OUTDIR --variant 'fast_math=--xla_cpu_enable_fast_math=true'
    python launch/cpu_flag_ab.py OUTDIR --variant threads_4=PJRT_NPROC=4 --variant same=
    python launch/cpu_flag_ab.py OUTDIR --workload='--task=sit --preset=S/2 --batch_per_device=16'
    python launch/cpu_flag_ab.py OUTDIR --smoke    # a check of this script: numbers mean nothing

What it measures: the seconds per train step (synthetic inputs, ``bench``'s median window of
``--steps`` steps over ``--repeats`` windows) of each workload under each flag variant. A variant
is a list of extra ``--xla_...`` flags appended to the inherited XLA_FLAGS and/or environment
settings ``NAME=value`` (``PJRT_NPROC`` sizes XLA:CPU's intra-op thread pool; it is read from the
environment, not from XLA_FLAGS). XLA reads both once, when JAX starts, so every arm is a fresh
subprocess (which also recompiles the step). Per workload and round every variant runs once, in
an order that rotates by one each round, so a machine that drifts (another job, thermal limits)
hits every variant alike. Before any timing each variant starts JAX once; a variant whose flag
this XLA does not know (JAX aborts with "Unknown flag in XLA_FLAGS") is reported in the table as
rejected and not run. Run it on an otherwise idle machine, under the environment training uses
(``source launch/cpu_env.sh`` first to match the CPU launch scripts).

Output: OUTDIR/ab.jsonl (bench's JSON line per call plus ``workload``, ``variant``,
``variant_flags``, ``round``, ``call_seconds``; a failed call has ``error`` instead of timings),
OUTDIR/ab.md (rewritten after every call; also printed at the end): per workload and variant the
median over rounds of the step seconds, the minimum over rounds of the fastest window, the median
CPU seconds per step, and the ratio default median / variant median (> 1: faster than default).
The default arm's spread over rounds (max / min - 1) is the noise level: a variant "wins" only if
its ratio exceeds 1 + spread, "loses" only if its median exceeds default's by more than the spread;
with one round there is no noise estimate and no verdict. OUTDIR/logs/ holds each call's output.
One line of progress with an ETA after each call. Exit status: 0, 1 if a bench call failed, 2 for
bad input (one line, before anything runs). Workload paths (``--config=``) are relative to the
repository root, where every bench runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> extra settings: ``--xla_...`` tokens go to XLA_FLAGS, ``NAME=value`` to the environment.
VARIANTS = {
    "default": "",
    "no_xnnpack": "--xla_cpu_use_xnnpack=false",
    "onednn_custom_call": ("--xla_cpu_experimental_onednn_custom_call=true "
                           "--xla_cpu_use_onednn=false"),
    "vector_width_512": "--xla_cpu_prefer_vector_width=512",
    # Dots and convolutions through Eigen on the calling thread instead of the intra-op pool.
    "single_thread_eigen": "--xla_cpu_multi_thread_eigen=false",
    # XLA:CPU's intra-op pool has PJRT_NPROC threads (default: one per core); one thread leaves
    # only the parallelism between independent thunks.
    "intra_op_threads_1": "PJRT_NPROC=1",
}
WORKLOADS = (
    "--config=configs/mae_cpu_mnist.py",  # the README's demo model, batch 128
    "--config=research/small_scale_study/config.py",  # the study's MAE-tiny, batch 128
    "--task=sit --preset=S/2 --batch_per_device=16",
)
# --smoke: the tests' micro MAE (seconds of compile, milliseconds a step) and two variants.
SMOKE = dict(workloads=["--config=configs/mae_cpu_mnist.py --config.model.preset=micro/4 "
                        "--config.data.image_size=16 --batch_per_device=2"],
             variants="default,no_xnnpack", rounds=1, steps=1, repeats=1)
FULL = dict(workloads=list(WORKLOADS), variants=",".join(VARIANTS), rounds=3, steps=10, repeats=3)
OWN_BENCH_FLAGS = ("--steps", "--repeats", "--out")  # set by this script for every call
MAX_CHARS = 300
_ENV_SETTING = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# An absl/glog error or fatal line, "E1204 22:02:07.368380   18599 file.cc:63] message".
_GLOG = re.compile(r"^[EF]\d{4} [\d:.]+\s+\d+ [^\]]*\] (.*)$")


class InputError(ValueError):
  """Bad command-line input: one line, exit status 2."""


def one_line(text: str) -> str:
  line = " ".join(str(text).split())
  return line if len(line) <= MAX_CHARS else line[:MAX_CHARS - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Input


def parse_args(argv):
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("outdir", help="Output folder (must not hold an ab.jsonl yet).")
  p.add_argument("--variants", help=f"Comma-separated subset of: {', '.join(VARIANTS)} "
                 "(default: all; 'default' is always run, it is the baseline).")
  p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                 help="An extra variant (repeatable): space-separated --xla_... flags and/or "
                 "NAME=value environment settings; empty FLAGS is a second default (an A/A check).")
  # One bench argument string per flag: argparse cannot take a list of values that start with --.
  p.add_argument("--workload", action="append", metavar="BENCH_ARGS",
                 help="Bench arguments of one workload (repeatable; --workload='--config=...'). "
                 f"Default: {' | '.join(WORKLOADS)}.")
  p.add_argument("--rounds", type=int, help="Rounds of every variant per workload (default 3).")
  p.add_argument("--steps", type=int, help="bench --steps (default 10).")
  p.add_argument("--repeats", type=int, help="bench --repeats (default 3).")
  p.add_argument("--smoke", action="store_true",
                 help="Cheap check of this script: micro MAE, default and no_xnnpack, 1 round, "
                 "1 step, 1 repeat (explicit flags still win).")
  a = p.parse_args(argv)
  base = SMOKE if a.smoke else FULL
  a.workloads = a.workload or list(base["workloads"])
  if a.variants is None:
    a.variants = base["variants"]
  for k in ("rounds", "steps", "repeats"):
    if getattr(a, k) is None:
      setattr(a, k, base[k])
  return a


def split_settings(spec: str):
  """``spec`` -> (XLA flags, environment settings dict); InputError on any other token."""
  flags, env = [], {}
  for token in shlex.split(spec):
    if token.startswith("--"):
      flags.append(token)
    elif _ENV_SETTING.match(token):
      k, v = token.split("=", 1)
      env[k] = v
    else:
      raise InputError(f"{token!r} is neither an XLA flag (--name=value) nor an environment "
                       "setting (NAME=value)")
  return flags, env


def select_variants(names: str, custom) -> dict:
  """The variants to run, name -> settings string, 'default' first."""
  chosen = {}
  for name in [n.strip() for n in names.split(",") if n.strip()]:
    if name not in VARIANTS:
      raise InputError(f"--variants: unknown variant {name!r}; choose from {', '.join(VARIANTS)} "
                       "or add one with --variant NAME=FLAGS")
    chosen[name] = VARIANTS[name]
  for spec in custom:
    name, sep, settings = spec.partition("=")
    if not sep or not _NAME.match(name):
      raise InputError(f"--variant {spec!r}: expected NAME=FLAGS, e.g. "
                       "'fast_math=--xla_cpu_enable_fast_math=true' or threads_4=PJRT_NPROC=4")
    if name in VARIANTS or name in chosen:
      raise InputError(f"--variant {spec!r}: the name {name!r} is taken; choose another")
    try:
      split_settings(settings)
    except InputError as e:
      raise InputError(f"--variant {spec!r}: {e}") from None
    chosen[name] = settings
  # Every ratio is against default, so it always runs, first in round 1.
  return {"default": VARIANTS["default"], **{k: v for k, v in chosen.items() if k != "default"}}


def check_workload(workload: str) -> None:
  """A config file that is not there, or a flag this script sets itself: InputError."""
  try:
    tokens = shlex.split(workload)
  except ValueError as e:
    raise InputError(f"--workload {workload!r}: {e}") from None
  if not tokens:
    raise InputError("--workload '': no bench arguments")
  for i, token in enumerate(tokens):
    flag, sep, value = token.partition("=")
    if flag in OWN_BENCH_FLAGS:
      raise InputError(f"--workload {workload!r}: {flag} is set by this script (use its own "
                       f"{flag} for --steps/--repeats)")
    if flag == "--config":
      path = value if sep else (tokens[i + 1] if i + 1 < len(tokens) else "")
      path = path.split(":", 1)[0]  # ml_collections: --config=file.py:argument
      if not os.path.isfile(os.path.join(REPO, path)):
        raise InputError(f"--workload {workload!r}: no such config file {path!r} (paths are "
                         "relative to the repository root)")


def validate(args) -> dict:
  """All input checks before anything runs; returns the variants."""
  for k in ("rounds", "steps", "repeats"):
    if getattr(args, k) < 1:
      raise InputError(f"--{k}={getattr(args, k)}: must be at least 1")
  variants = select_variants(args.variants, args.variant)
  for w in args.workloads:
    check_workload(w)
  if len(set(args.workloads)) < len(args.workloads):
    raise InputError("--workload: the same bench arguments twice; each workload once")
  if os.path.exists(os.path.join(args.outdir, "ab.jsonl")):
    raise InputError(f"{os.path.join(args.outdir, 'ab.jsonl')} exists; choose a new OUTDIR (this "
                     "script does not mix runs)")
  return variants


# ---------------------------------------------------------------------------------------------
# Running


def variant_env(base: dict, settings: str) -> dict:
  flags, env = split_settings(settings)
  out = dict(base, **env)
  out["XLA_FLAGS"] = " ".join(f for f in [base.get("XLA_FLAGS", "").strip(), *flags] if f)
  return out


def base_env() -> dict:
  env = dict(os.environ)
  env.setdefault("JAX_PLATFORMS", "cpu")  # these are CPU flags: a GPU backend would ignore them
  return env


def failure_message(output: str, returncode: int) -> str:
  """XLA's own reason (its first glog E/F line, which names the flag), else the last line."""
  lines = output.splitlines()
  glog = [m.group(1) for m in map(_GLOG.match, lines) if m]
  if glog:
    return one_line(glog[0])
  errors = [l for l in lines if l.startswith("error:")]
  if errors:
    return one_line(errors[-1][len("error:"):])
  rest = [l for l in lines if l.strip()]
  return one_line(rest[-1]) if rest else f"exit status {returncode}"


def check_starts(variants: dict, env: dict, timeout: float = 180.0) -> dict:
  """name -> why this XLA refuses the variant, for those where JAX does not start. All at once:
  nothing is timed here, and each is mostly Python start-up."""
  code = "import jax; jax.numpy.ones(2).block_until_ready()"
  procs = {name: subprocess.Popen([sys.executable, "-c", code], cwd=REPO, text=True,
                                  env=variant_env(env, s), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT)
           for name, s in variants.items()}
  rejected = {}
  for name, proc in procs.items():
    try:
      out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.communicate()
      rejected[name] = f"JAX did not start within {timeout:.0f} s"
      continue
    if proc.returncode != 0:
      rejected[name] = failure_message(out, proc.returncode)
  return rejected


def round_order(names, round_index: int):
  """Round ``round_index`` (0-based) runs the variants rotated left by that many places."""
  k = round_index % len(names)
  return list(names[k:]) + list(names[:k])


def run_bench(workload: str, env: dict, steps: int, repeats: int, log_path: str):
  """One bench call: (its JSON result or None, error line or None, bench exit status)."""
  out_path = log_path[:-len(".log")] + ".json"
  cmd = [sys.executable, "-m", "decay_jax.cli.bench", *shlex.split(workload),
         f"--steps={steps}", f"--repeats={repeats}", f"--out={out_path}"]
  with open(log_path, "w") as log:
    log.write(f"$ {shlex.join(cmd)}\n# XLA_FLAGS={env.get('XLA_FLAGS', '')!r}\n")
    log.flush()
    rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
  with open(log_path) as f:
    output = f.read()
  if rc != 0 or not os.path.isfile(out_path):
    return None, failure_message(output, rc), rc
  with open(out_path) as f:
    result = json.loads(f.read().splitlines()[-1])
  os.remove(out_path)  # its line lives on in ab.jsonl
  return result, None, rc


def eta_seconds(durations: dict, plan, done: int) -> float:
  """Seconds left: each remaining call costs the mean of its workload's calls so far (the
  workloads differ several-fold), or of all calls for a workload not yet started."""
  every = [d for ds in durations.values() for d in ds]
  if not every:
    return float("nan")
  mean_all = sum(every) / len(every)
  return sum(statistics.fmean(durations[w]) if durations.get(w) else mean_all
             for w, _, _ in plan[done:])


def minutes(seconds: float) -> str:
  return "?" if seconds != seconds else f"{seconds / 60:.1f} min"


# ---------------------------------------------------------------------------------------------
# Table


def summarize(rows, workloads, variants) -> dict:
  """(workload, variant) -> the table's numbers, from the successful rows of ab.jsonl."""
  out = {}
  for w in workloads:
    base = None
    for v in variants:
      ok = [r for r in rows if r["workload"] == w and r["variant"] == v and "error" not in r]
      failed = [r for r in rows if r["workload"] == w and r["variant"] == v and "error" in r]
      s = {"rounds": len(ok), "failed": failed}
      if ok:
        steps = [r["step_seconds"] for r in ok]
        s.update(median=statistics.median(steps),
                 min=min(r["step_seconds_min"] for r in ok),
                 cpu=statistics.median(r["step_cpu_seconds"] for r in ok),
                 spread=max(steps) / min(steps) - 1 if len(steps) > 1 else None,
                 first=ok[0])
      if v == "default":
        base = s
      if ok and base and base["rounds"]:
        s["ratio"] = base["median"] / s["median"]
        noise = base["spread"]
        if v == "default":
          s["verdict"] = "baseline"
        elif noise is None:
          s["verdict"] = "no noise estimate (1 round)"
        elif s["ratio"] > 1 + noise:
          s["verdict"] = "wins"
        elif s["median"] > base["median"] * (1 + noise):
          s["verdict"] = "loses"
        else:
          s["verdict"] = "within noise"
      out[w, v] = s
  return out


def ms(seconds: float) -> str:
  return f"{seconds * 1e3:.2f}"


def render(args, variants, rejected, rows, started: str) -> str:
  summary = summarize(rows, args.workloads, [v for v in variants if v not in rejected])
  inherited = f"`{os.environ['XLA_FLAGS']}`" if os.environ.get("XLA_FLAGS") else "none"
  lines = [f"# XLA:CPU flag A/B of the train step: rounds {args.rounds}; per call, bench "
           f"--steps={args.steps} --repeats={args.repeats}",
           "",
           f"Started {started}; {os.cpu_count()} CPUs; inherited XLA_FLAGS: "
           f"{inherited}. Ratio = default median / variant median (> 1: "
           "faster). Noise = the default arm's spread over rounds (max / min - 1).", ""]
  for w in args.workloads:
    base = summary.get((w, "default"), {})
    first = base.get("first", {})
    what = (f" ({first.get('config')}, {first.get('preset')}, global batch "
            f"{first.get('global_batch')})" if first else "")
    noise = base.get("spread")
    lines += [f"## `{w}`{what}", "",
              (f"Noise: {noise * 100:.1f}% over {base['rounds']} rounds; a variant wins only with "
               f"a ratio above {1 + noise:.3f}." if noise is not None else
               "Noise: not measured (fewer than 2 rounds of default); no verdicts."), "",
              "| variant | settings | rounds | step ms (median) | step ms (min) | CPU ms/step "
              "(median) | ratio vs default | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    for v, settings in variants.items():
      shown = f"`{settings}`" if settings else ""
      if v in rejected:
        lines.append(f"| {v} | {shown} | rejected by this XLA: {rejected[v]} |")
        continue
      s = summary[w, v]
      failed = s["failed"]
      if not s["rounds"]:
        why = (f"failed: {failed[-1]['error']} (round {failed[-1]['round']})" if failed
               else "not run yet")
        lines.append(f"| {v} | {shown} | {why} |")
        continue
      ratio = f"{s['ratio']:.3f}" if "ratio" in s else "n/a"
      verdict = s.get("verdict", "n/a") + (f" ({len(failed)} failed)" if failed else "")
      lines.append(f"| {v} | {shown} | {s['rounds']} | {ms(s['median'])} | {ms(s['min'])} | "
                   f"{ms(s['cpu'])} | {ratio} | {verdict} |")
    lines.append("")
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def main(argv) -> int:
  args = parse_args(argv)
  try:
    variants = validate(args)
  except InputError as e:
    print(f"error: {one_line(e)}", file=sys.stderr)
    return 2
  env = base_env()
  rejected = check_starts(variants, env)
  if "default" in rejected:  # the inherited XLA_FLAGS themselves: nothing to compare against
    print(f"error: JAX does not start with the inherited XLA_FLAGS "
          f"{env.get('XLA_FLAGS', '')!r}: {rejected['default']}", file=sys.stderr)
    return 2
  for v, why in rejected.items():
    print(f"{v}: rejected by this XLA: {why}", flush=True)
  print(f"JAX starts with: {', '.join(v for v in variants if v not in rejected)}", flush=True)
  os.makedirs(os.path.join(args.outdir, "logs"), exist_ok=True)
  jsonl, md = os.path.join(args.outdir, "ab.jsonl"), os.path.join(args.outdir, "ab.md")
  names = [v for v in variants if v not in rejected]
  plan = [(w, r, v) for w in args.workloads for r in range(1, args.rounds + 1)
          for v in round_order(names, r - 1)]
  started, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.time()
  rows, durations, any_failed = [], {}, False
  for i, (w, r, v) in enumerate(plan):
    log = os.path.join(args.outdir, "logs", f"w{args.workloads.index(w)}_r{r}_{v}.log")
    t = time.time()
    result, error, rc = run_bench(w, variant_env(env, variants[v]), args.steps, args.repeats, log)
    took = time.time() - t
    if rc == 2:  # bench's bad-input line: the same for every variant, so stop here
      print(f"error: --workload {w!r}: {error}", file=sys.stderr)
      return 2
    durations.setdefault(w, []).append(took)
    row = {**(result or {"error": error}), "workload": w, "variant": v,
           "variant_flags": variants[v], "round": r, "call_seconds": round(took, 1)}
    rows.append(row)
    any_failed |= error is not None
    with open(jsonl, "a") as f:
      f.write(json.dumps(row) + "\n")
    with open(md, "w") as f:  # an interrupted run keeps its table so far
      f.write(render(args, variants, rejected, rows, started))
    what = (f"{ms(result['step_seconds'])} ms/step" if result else f"FAILED: {error}")
    print(f"[{i + 1}/{len(plan)}] {w} | {v} | round {r}: {what}; call {took:.0f} s, elapsed "
          f"{minutes(time.time() - t0)}, ETA {minutes(eta_seconds(durations, plan, i + 1))}",
          flush=True)
  table = render(args, variants, rejected, rows, started)
  with open(md, "w") as f:
    f.write(table)
  print("\n" + table, end="")
  return 1 if any_failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
