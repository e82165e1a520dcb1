"""A quiet console: one short line per log step and one summary line per evaluation, no image
lines; the full dictionaries still reach TensorBoard and metrics.jsonl.

The console is captured as the command line shows it: absl's line format, the library filter of
``decay_jax.logs.quiet_libraries`` (which every CLI installs), and stdout.
"""

import contextlib
import glob
import io
import json
import logging
import os

import numpy as np
import pytest
import tensorflow as tf
from absl import logging as absl_logging

from decay_jax import logs
from decay_jax.evals import evaluators, registry
from decay_jax.train import evaluation, trainer, writers
from testing_configs import load_config, override

MAX_LINE = 300  # characters of any console line
MAX_SUMMARY = 200  # characters of an evaluation's summary
RANK_KEYS = ("tokens_erank", "pooled_erank", "tokens_rho", "pooled_rho", "tokens_erank_centred",
             "pooled_erank_centred")


@contextlib.contextmanager
def console():
  """Yields a list that receives the console lines (absl log records and stdout) on exit."""
  lines = []
  buf, out = io.StringIO(), io.StringIO()
  handler = logging.StreamHandler(buf)
  handler.setFormatter(absl_logging.PythonFormatter())
  root = logging.getLogger()
  root.addHandler(handler)
  logs.quiet_libraries()  # as the CLIs do: also filters this handler
  # absl's logger level itself (NOTSET: root's), not get_verbosity(): setting that back would pin
  # the logger at the effective level it reports (WARNING) for every later test of this worker
  absl_level, level = absl_logging.get_absl_logger().level, root.level
  absl_logging.set_verbosity(absl_logging.INFO)
  root.setLevel(logging.INFO)  # as absl's app.run: INFO of the standard `logging` users too
  try:
    with contextlib.redirect_stdout(out):
      yield lines
  finally:
    absl_logging.get_absl_logger().setLevel(absl_level)
    root.setLevel(level)
    root.removeHandler(handler)
    lines.extend(buf.getvalue().splitlines() + out.getvalue().splitlines())


def longest(lines):
  return max(lines, key=len) if lines else ""


def tensorboard_values(workdir):
  """``{tag: [(step, array)]}`` of every event file under ``workdir``."""
  found = {}
  for path in glob.glob(os.path.join(workdir, "**", "events.out.tfevents.*"), recursive=True):
    for event in tf.compat.v1.train.summary_iterator(path):
      for v in event.summary.value:
        found.setdefault(v.tag, []).append((event.step, tf.make_ndarray(v.tensor)))
  return found


def jsonl_rows(workdir):
  with open(os.path.join(workdir, writers.JSONL), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------------------------
# The writer: a compact scalar line, no image line, everything in the files.


def test_writer_console_is_one_short_line_and_files_keep_everything(tmp_path):
  train = {"loss": 0.473615123, "lr": 0.000475, "grad_norm": 0.14446412,
           "examples_per_sec": 147.0921,
           "examples_per_sec_per_device": 147.0921, "model_tflops_per_sec_per_device": 0.025871634}
  rank = {f"rank/{key}/block_{b:02d}": 12.345678 - b - 0.01 * i
          for i, key in enumerate(RANK_KEYS) for b in range(8)}  # 48 values, the rank pass
  picture = np.random.default_rng(0).integers(0, 255, (1, 92, 242, 3), dtype=np.uint8)
  with console() as lines:
    w = writers.make_writer(str(tmp_path), is_main=True)
    w.write_scalars(25, train)
    w.write_scalars(100, rank)
    w.write_images(100, {"reconstruction": picture})
    w.flush()
    w.close()
  assert len(rank) == 48
  # Console: the training scalars on one line, fixed order, 4 digits; nothing for rank or images.
  ours = [l for l in lines if "writers.py" in l]
  assert len(ours) == 1, lines
  assert ours[0].endswith("] [25] loss=0.4736, lr=0.000475, grad_norm=0.1445, "
                          "examples_per_sec=147.1, model_tflops_per_sec_per_device=0.02587")
  assert not [l for l in lines if "Got images" in l or "rank/" in l or "block_" in l], lines
  assert all(len(l) < MAX_LINE for l in lines), longest(lines)
  # metrics.jsonl: both writes, every value at full precision.
  rows = jsonl_rows(str(tmp_path))
  assert [r["step"] for r in rows] == [25, 100]
  assert rows[0] == dict(train, step=25)
  assert rows[1] == dict(rank, step=100)
  # TensorBoard: all 48 per-block scalars and the picture.
  tb = tensorboard_values(str(tmp_path))
  for k, v in rank.items():
    (step, value), = tb[k]
    assert step == 100 and float(value) == pytest.approx(v, rel=1e-6)
  assert float(tb["loss"][0][1]) == pytest.approx(train["loss"], rel=1e-6)
  (step, image), = tb["reconstruction"]
  assert step == 100 and image.dtype == object and len(image) == 3  # width, height, PNG bytes
  assert (int(image[0]), int(image[1])) == (242, 92) and image[2].startswith(b"\x89PNG")


def test_compact_fallbacks_stay_short():
  many = {f"rank/tokens_erank_centred/block_{b:02d}": 10.123456 + b for b in range(48)}
  line = evaluation.compact(many)
  assert len(line) <= 200 and line.startswith("rank/tokens_erank_centred/block_00 10.12, ")
  assert line.endswith(" more)")
  results = dict({"compile_seconds": 17.4123, "step": 20, "loss": 0.47361234}, **many,
                 **{"knn/top1": 0.335, "knn/top5": 0.79}, preempted=False)
  line = logs.compact_results(results)
  assert line.startswith("step 20, loss 0.4736, knn/top1 0.335, knn/top5 0.79, preempted False, "
                         "compile_seconds 17.41")
  assert "block_" not in line and line.endswith("(+48 more in results.json)") and len(line) < 250


# ----------------------------------------------------------------------------------------------
# A real training run of the micro MAE with all four evaluators.


def tiny_config():
  """The demo config on the micro model and 16-pixel digits, every evaluator a few steps long."""
  c = load_config("mae_cpu_mnist")
  return override(c, **{
      "model.preset": "micro/4", "data.image_size": 16, "batch_size": 16, "num_train_steps": 4,
      "warmup_epochs": 0.0, "log_every_steps": 2, "picture_every_steps": 4,
      "checkpoint.every_steps": 4, "checkpoint.async_save": False, "mesh.data": 1,
      "evals.knn.max_train_examples": 512, "evals.knn.max_eval_examples": 256,
      "evals.knn.batch_size": 128,
      "evals.rank.every_steps": 2, "evals.rank.num_images": 64, "evals.rank.batch_size": 32,
      "evals.linear.enabled": True, "evals.linear.protocols": "official,mae",
      "evals.linear.features": "mean,cls_ln", "evals.linear.max_train_examples": 512,
      "evals.linear.max_eval_examples": 256, "evals.linear.batch_size": 128,
      "evals.linear.official.epochs": 2, "evals.linear.official.batch_size": 64,
      "evals.linear.mae.epochs": 2, "evals.linear.mae.warmup_epochs": 1.0,
      "evals.linear.mae.batch_size": 128,
      "evals.layers.enabled": True, "evals.layers.max_train_examples": 512,
      "evals.layers.max_eval_examples": 256, "evals.layers.batch_size": 128,
      "evals.layers.probe_epochs": 2, "evals.layers.probe_batch_size": 64})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """Trains once; returns (console lines, {name: evaluator}, {name: [run() outputs]}, workdir)."""
  workdir = str(tmp_path_factory.mktemp("console"))
  built, runs = {}, {}

  def build(config, model, mesh, task):  # registry.build, recording what each run() returns
    built.update(registry.build(config, model, mesh, task=task))
    for name, e in built.items():
      def recorded(params, run=e.run, name=name):
        out = run(params)
        runs.setdefault(name, []).append(out)
        return out
      e.run = recorded
    return built

  with console() as lines:
    results = trainer.train_and_evaluate(tiny_config(), workdir, evaluators=build)
    logging.info("results: %s", logs.compact_results(results))  # as decay_jax.cli.train
  return lines, built, runs, workdir


def test_training_console_lines_are_short(trained):
  lines, built, runs, _ = trained
  assert set(built) == {"knn", "linear", "layers", "rank"}
  assert len(runs["rank"]) == 2 and all(len(runs[n]) == 1 for n in ("knn", "linear", "layers"))
  assert len(lines) > 8 and len(longest(lines)) < MAX_LINE, longest(lines)
  assert not [l for l in lines if "Got images" in l or "block_" in l]
  evals = [l for l in lines if "] eval at step " in l]
  assert len(evals) == 5  # rank at steps 2 and 4, the others at the end
  steps = [l for l in lines if "writers.py" in l and "loss=" in l]
  assert len(steps) == 2 and all(len(l) < 250 for l in steps)  # steps 2 and 4


def test_each_evaluation_logs_its_summary_line(trained):
  lines, built, runs, _ = trained
  for name, outs in runs.items():
    for step, out in zip((2, 4) if name == "rank" else (4,), outs):
      summary = built[name].summary(out)
      assert 0 < len(summary) < MAX_SUMMARY
      assert sum(l.endswith(f"eval at step {step}: {summary}") for l in lines) == 1


def test_knn_and_rank_summaries_show_the_numbers(trained):
  _, built, runs, _ = trained
  knn = runs["knn"][0]
  assert set(knn) == {"knn/top1", "knn/top5"}
  assert built["knn"].summary(knn) == (f"knn top1 {100 * knn['knn/top1']:.1f}% "
                                       f"top5 {100 * knn['knn/top5']:.1f}%")
  rank = runs["rank"][-1]
  depth = built["rank"].model.depth
  assert len([k for k in rank if k.startswith("rank/")]) == len(RANK_KEYS) * depth
  g = lambda key: f"{rank[key]:.3g}"
  last = f"block_{depth - 1:02d}"
  expected = (f"rank: tokens erank last {g('rank/tokens_erank/' + last)} "
              f"(block 0: {g('rank/tokens_erank/block_00')}), pooled erank last "
              f"{g('rank/pooled_erank/' + last)} (block 0: {g('rank/pooled_erank/block_00')})")
  if "branches/ratio_attn/block_00" in rank:
    expected += (f"; branch ratio last attn {g('branches/ratio_attn/' + last)} "
                 f"mlp {g('branches/ratio_mlp/' + last)}")
  assert built["rank"].summary(rank) == expected


def test_linear_and_layers_summaries_show_the_numbers(trained):
  _, built, runs, _ = trained
  lin = runs["linear"][0]
  assert set(lin) == {f"linear/{p}/{c}/{k}" for p in ("official", "mae") for c in ("mean", "cls_ln")
                      for k in ("top1", "top5")} | {f"linear/mae/{c}/top1_last"
                                                    for c in ("mean", "cls_ln")}
  parts = []
  for protocol in ("official", "mae"):
    top1 = {c: lin[f"linear/{protocol}/{c}/top1"] for c in ("mean", "cls_ln")}
    best = max(top1, key=top1.get)
    parts.append(f"{protocol} top1 {100 * top1[best]:.1f}% (best of 2: {best})")
  assert built["linear"].summary(lin) == "linear: " + ", ".join(parts)
  lay = runs["layers"][0]
  depth = built["layers"].model.depth
  parts = []
  for probe in ("knn", "linear"):
    curve = [lay[f"layers/{probe}_top1/block_{b:02d}"] for b in range(depth)]
    best = int(lay[f"layers/{probe}_best_block"])
    assert curve[best] == max(curve)
    parts.append(f"best {probe} block {best} {100 * curve[best]:.1f}%, last {100 * curve[-1]:.1f}%")
  assert built["layers"].summary(lay) == "layers: " + "; ".join(parts)


def test_summaries_of_a_large_model_fit_one_line():
  # A 24-block model with six feature choices and three protocols: still one short line.
  ev = {name: object.__new__(cls) for name, cls in registry.EVALUATORS.items()}
  rank = {f"rank/{k}/block_{b:02d}": 123.456789 / (b + 1) for k in RANK_KEYS for b in range(24)}
  rank.update({f"branches/ratio_{s}/block_{b:02d}": 0.0123456 * b for s in ("attn", "mlp")
               for b in range(24)})
  line = ev["rank"].summary(rank)
  assert line == ("rank: tokens erank last 5.14 (block 0: 123), pooled erank last 5.14 "
                  "(block 0: 123); branch ratio last attn 0.284 mlp 0.284")
  choices = ("mean", "patch_mean", "cls", "mean_ln", "patch_mean_ln", "cls_ln")
  lin = {f"linear/{p}/{c}/{k}": 0.5 + 0.01 * i + (0.001 if k == "top5" else 0)
         for p in evaluators.PROTOCOLS for i, c in enumerate(choices) for k in ("top1", "top5")}
  line = ev["linear"].summary(lin)
  assert line == ("linear: official top1 55.0% (best of 6: cls_ln), official_std top1 55.0% "
                  "(best of 6: cls_ln), mae top1 55.0% (best of 6: cls_ln)")
  lay = {f"layers/{p}_top1/block_{b:02d}": 0.3 + 0.01 * b - (0.05 if b == 23 else 0)
         for p in ("knn", "linear") for b in range(24)}
  lay.update({"layers/knn_best_block": 22.0, "layers/linear_best_block": 22.0})
  assert ev["layers"].summary(lay) == ("layers: best knn block 22 52.0%, last 48.0%; "
                                       "best linear block 22 52.0%, last 48.0%")
  knn = {"knn/top1": 0.44204, "knn/top5": 0.87649}
  assert ev["knn"].summary(knn) == "knn top1 44.2% top5 87.6%"
  assert ev["knn"].summary({"knn/top1": 0.5}) == "knn top1 50.0%"
  assert all(len(e.summary({})) < MAX_SUMMARY for n, e in ev.items() if n != "knn")
  assert len(evaluators.fit("x" * 500)) == evaluators.SUMMARY_WIDTH


def test_tensorboard_and_jsonl_keep_the_full_evaluations(trained):
  _, _, runs, workdir = trained
  rows = jsonl_rows(workdir)
  tb = tensorboard_values(workdir)
  for name, outs in runs.items():
    for out in outs:
      assert any(all(r.get(k) == v for k, v in out.items()) for r in rows), name
      for k, v in out.items():
        assert any(float(x) == pytest.approx(v, rel=1e-6, abs=1e-7) for _, x in tb[k]), k
  assert "reconstruction" in tb  # the picture goes to TensorBoard, not the console
