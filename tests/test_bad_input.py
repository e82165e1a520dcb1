"""Every command, given a bad input, prints one line naming the argument and what was expected,
exits 2, and prints no traceback: missing and broken config files, misspelt overrides, missing
files and directories, unreadable or corrupt checkpoints and params directories, pickles.

The converters' own table (malicious pickles, wrong file kinds) is in tests/test_convert_cli.py.
Each cell is a real process, as a user would start it.
"""

import glob
import os
import pickle
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from decay_jax.evals import registry
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import trainer
from decay_jax.train import setup
from test_train import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = "configs/mae_cpu_mnist.py"
# The tiny model of the fixture run, so that a resume reaches the checkpoint (and its corruption).
TINY = ["--config.model.preset=micro/4", "--config.data.image_size=16", "--config.batch_size=16",
        "--config.num_train_steps=6", "--config.mesh.data=1", "--config.tensorboard=false"]


def _garble(pattern):
  for path in glob.glob(pattern, recursive=True):
    if os.path.isfile(path):
      with open(path, "wb") as f:
        f.write(b"\x00 not a checkpoint \x00" * 4)


class _Evil:
  def __reduce__(self):
    return (os.system, ("echo pwned > PWNED",))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  """A finished tiny run, its params directory, and broken copies of both."""
  root = tmp_path_factory.mktemp("bad")
  run = str(root / "run")
  c = tiny_config(num_train_steps=3, tensorboard=False)
  trainer.train_and_evaluate(c, run, evaluators=registry.build)
  _, model, mesh = setup.check_config(c)
  params, _ = ckpt_lib.restore_run_params(run, mesh)
  ckpt_lib.save_params(str(root / "params"), jax.device_get(params), model)
  out = {"root": str(root), "run": run, "params": str(root / "params")}
  for name, pattern in (("bad_arrays", "checkpoints/3/state/ocdbt.process_0/d/*"),
                        ("bad_metadata", "checkpoints/3/state/_METADATA"),
                        ("bad_config", "config.json")):
    shutil.copytree(run, root / name)
    _garble(str(root / name / pattern))
    out[name] = str(root / name)
  shutil.copytree(root / "params", root / "bad_params")
  _garble(str(root / "bad_params" / "params" / "d" / "*"))
  out["bad_params"] = str(root / "bad_params")
  shutil.copytree(root / "params", root / "bad_model_json")
  _garble(str(root / "bad_model_json" / "model.json"))
  out["bad_model_json"] = str(root / "bad_model_json")
  np.savez(root / "images.npz", arr_0=np.zeros((4, 32, 32, 3), np.uint8))
  out["images"] = str(root / "images.npz")
  with open(root / "evil.npz", "wb") as f:  # a pickle that runs a shell command when loaded
    pickle.dump(_Evil(), f)
  out["evil"] = str(root / "evil.npz")
  (root / "broken_config.py").write_text("def get_config(:\n")
  out["broken_config"] = str(root / "broken_config.py")
  return out


# (entry point, argv with {placeholders} from the fixture, a phrase the line must contain)
CASES = {
    "train/missing_config": ("decay_jax.cli.train", ["--config=configs/nope.py", "--workdir={root}/w"],
                             "--config=configs/nope.py: no such config file"),
    "train/broken_config": ("decay_jax.cli.train", ["--config={broken_config}", "--workdir={root}/w"],
                            "the config file cannot be loaded (SyntaxError"),
    "train/misspelt_override": ("decay_jax.cli.train",
                                [f"--config={DEMO}", "--workdir={root}/w", "--config.model.alpha_mn=0.5"],
                                "--config.model.alpha_mn=0.5: the config has no field 'alpha_mn'; "
                                "did you mean 'alpha_min'?"),
    "train/misspelt_section": ("decay_jax.cli.train",
                               [f"--config={DEMO}", "--workdir={root}/w", "--config.optimm.lr=1"],
                               "--config.optimm.lr=1: the config has no field 'optimm'"),
    "train/bad_value": ("decay_jax.cli.train",
                        [f"--config={DEMO}", "--workdir={root}/w", "--config.model.alpha_min=abc"],
                        "--config.model.alpha_min=abc: could not convert string to float"),
    "train/no_workdir": ("decay_jax.cli.train", [f"--config={DEMO}"], "--workdir must have a value"),
    "train/cudnn_float32": ("decay_jax.cli.train", [f"--config={DEMO}", "--workdir={root}/w",
                                               "--config.model.attention_impl=cudnn"],
                            "model.attention_impl='cudnn' is not allowed with dtype=float32"),
    "bench/torch_finetune": ("decay_jax.cli.bench", ["--config=configs/finetune_cpu_mnist.py",
                                                     "--torch"],
                             "--torch is not allowed with task='finetune'"),
    "bench/cudnn_float32": ("decay_jax.cli.bench", [f"--config={DEMO}", "--dtype=float32",
                                                    "--config.model.attention_impl=cudnn"],
                            "model.attention_impl='cudnn' is not allowed with dtype=float32"),
    "train/corrupt_checkpoint": ("decay_jax.cli.train",
                                 [f"--config={DEMO}", "--workdir={bad_arrays}", *TINY],
                                 "workdir='{bad_arrays}' cannot be resumed: no intact checkpoint "
                                 "(checkpoints/3: it cannot be read: "),
    "evaluate/missing_workdir": ("decay_jax.cli.evaluate", ["--workdir={root}/nowhere"],
                                 "workdir='{root}/nowhere' is not allowed; it has no config.json"),
    "evaluate/corrupt_checkpoint": ("decay_jax.cli.evaluate", ["--workdir={bad_arrays}"],
                                    "workdir='{bad_arrays}' cannot be read"),
    "evaluate/corrupt_metadata": ("decay_jax.cli.evaluate", ["--workdir={bad_metadata}"],
                                  "workdir='{bad_metadata}' cannot be read"),
    "evaluate/corrupt_config_json": ("decay_jax.cli.evaluate", ["--workdir={bad_config}"],
                                     "workdir='{bad_config}' cannot be read (JSONDecodeError"),
    "evaluate/corrupt_params": ("decay_jax.cli.evaluate",
                                ["--checkpoint={bad_params}", f"--config={DEMO}"],
                                "checkpoint='{bad_params}' cannot be read"),
    "evaluate/corrupt_model_json": ("decay_jax.cli.evaluate",
                                    ["--checkpoint={bad_model_json}", f"--config={DEMO}"],
                                    "checkpoint='{bad_model_json}' cannot be read"),
    "evaluate/not_params_dir": ("decay_jax.cli.evaluate", ["--checkpoint={root}", f"--config={DEMO}"],
                                "checkpoint='{root}' is not allowed; it has no model.json"),
    "evaluate/missing_config": ("decay_jax.cli.evaluate",
                                ["--checkpoint={params}", "--config=configs/nope.py"],
                                "no such config file"),
    "evaluate/misspelt_override": ("decay_jax.cli.evaluate",
                                   ["--checkpoint={params}", f"--config={DEMO}",
                                    "--config.evals.knn.kk=3"],
                                   "--config.evals.knn.kk=3: the config has no field 'kk'"),
    "sample/missing_workdir": ("decay_jax.cli.sample", ["--workdir={root}/nowhere"],
                               "workdir='{root}/nowhere' is not allowed; it has no config.json"),
    "sample/corrupt_config_json": ("decay_jax.cli.sample", ["--workdir={bad_config}"],
                                   "workdir='{bad_config}' cannot be read"),
    "sample/wrong_task": ("decay_jax.cli.sample", ["--workdir={run}"], "this command needs 'sit'"),
    "compare/missing_config": ("decay_jax.cli.compare",
                               ["--config=configs/nope.py", "--workdir={root}/c"],
                               "no such config file"),
    "compare/misspelt_override": ("decay_jax.cli.compare",
                                  [f"--config={DEMO}", "--workdir={root}/c", "--config.batchsize=8"],
                                  "--config.batchsize=8: the config has no field 'batchsize'"),
    "train/bad_profile_steps": ("decay_jax.cli.train", [f"--config={DEMO}", "--workdir={root}/w",
                                                   "--config.profile_steps=3"],
                                "profile_steps='3' is not allowed; it must be 'START,COUNT'"),
    "bench/from_trainer_not_a_run": ("decay_jax.cli.bench", ["--from_trainer={root}/nowhere"],
                                     "from_trainer='{root}/nowhere' is not allowed; it has no "
                                     "metrics.jsonl"),
    "bench/profile_past_the_steps": ("decay_jax.cli.bench", [f"--config={DEMO}", "--steps=2",
                                                             "--repeats=1", "--profile_steps=1,2"],
                                     "profile_steps='1,2' is not allowed; the bench times 2 steps"),
    "bench/missing_config": ("decay_jax.cli.bench", ["--config=configs/nope.py"],
                             "no such config file"),
    "bench/misspelt_override": ("decay_jax.cli.bench", [f"--config={DEMO}", "--config.mdoel.dtype=x"],
                                "--config.mdoel.dtype=x: the config has no field 'mdoel'"),
    "memory/missing_config": ("decay_jax.cli.memory", ["--config=configs/nope.py"],
                              "no such config file"),
    "lower/misspelt_override": ("decay_jax.cli.lower", [f"--config={DEMO}", "--config.mesh.fdsp=2"],
                                "--config.mesh.fdsp=2: the config has no field 'fdsp'"),
    "study/missing_config": ("research.small_scale_study.run",
                             ["--config=configs/nope.py", "--workdir={root}/s"],
                             "no such config file"),
    "fid/missing_samples": ("decay_jax.cli.fid", ["--samples={root}/none.npz", "--ref={images}"],
                            "--samples='{root}/none.npz' is not allowed; no such file"),
    "fid/corrupt_inception": ("decay_jax.cli.fid",
                              ["--samples={images}", "--ref={images}", "--inception={bad_params}"],
                              "inception='{bad_params}' cannot be read"),
    "fid/not_inception_dir": ("decay_jax.cli.fid",
                              ["--samples={images}", "--ref={images}", "--inception={root}"],
                              "inception='{root}' is not allowed; it has no model.json"),
    "fid/pickle_as_statistics": ("decay_jax.cli.fid", ["--samples={evil}", "--ref={evil}"],
                                 "'{evil}' is not allowed; it is not a readable .npy/.npz file"),
    "fid/unknown_flag": ("decay_jax.cli.fid", ["--samples=x", "--bogus=1"],
                         "unrecognized arguments: --bogus=1"),
    "extract_latents/missing_vae": ("decay_jax.cli.extract_latents",
                                    ["--images={root}", "--vae={root}/novae", "--out={root}/lat"],
                                    "vae='{root}/novae' is not allowed; it is not a converted VAE"),
    "extract_latents/corrupt_vae": ("decay_jax.cli.extract_latents",
                                    ["--images={root}", "--vae={bad_params}", "--out={root}/lat"],
                                    "vae='{bad_params}' cannot be read"),
    "schedules/bad_flag": ("decay_jax.cli.schedules", ["--depth=x"], "invalid int value"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gives_one_line(inputs, case):
  module, argv, phrase = CASES[case]
  argv = [a.format(**inputs) for a in argv]
  p = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, capture_output=True,
                     text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu",
                                                      PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
  # Library log lines (absl/TF "W1203 ..." warnings) are not part of the answer; the rest is.
  lines = [l for l in p.stderr.splitlines()
           if l.strip() and not l.startswith(("WARNING: All log messages", "I0000", "W0000"))
           and not (len(l) > 5 and l[0] in "IWE" and l[1:5].isdigit())]
  assert p.returncode == 2, (case, p.returncode, p.stderr[-2000:])
  assert len(lines) == 1, (case, lines)
  line = lines[0]
  assert line.startswith("error: ") and len(line) <= 320, line
  assert phrase.format(**inputs) in line, (case, line)
  assert "Traceback" not in p.stderr and "weights_only" not in p.stderr
  assert not os.path.exists(os.path.join(REPO, "PWNED"))  # no pickle was ever executed
