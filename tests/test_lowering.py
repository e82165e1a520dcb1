"""Cross-platform lowering (docs/lowering.md): the trainer's train step of every paper config and
the SiT sample command's sampler export with ``jax.export`` for TPU and CUDA over an abstract
64-device mesh, at full size, with the config's dtype, remat and mesh, and their shardings in the
StableHLO.

The module text is read back: the mesh, the partition count, one ``sdy.sharding`` per argument and
result equal to the sharding rule (FSDP for the state, the batch split over every device) and the
donation of the state (``tf.aliasing_output``). Dropping any sharding or the donation fails here.
"""

import os
import re
import runpy
import subprocess
import sys

import jax
import pytest

from decay_jax import sharding as shd
from decay_jax.perf import export

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 64
PLATFORMS = ("tpu", "cuda")
ROUTING_ROWS = list(runpy.run_path(os.path.join(REPO, "configs", "sit_s2_routing.py"))["ROWS"])
# (config file, row) of every paper config; sit_s2_routing.py selects a model per row string.
TRAIN_CONFIGS = ([(name, None) for name in ("mae_vit_b16", "mae_vit_l16", "mae_vit_h14", "sit_b2",
                                            "sit_xl2", "finetune_vit_b16", "finetune_vit_l16",
                                            "finetune_vit_h14", "uvit_s2_cifar100",
                                            "uvit_m4_imagenet")]
                 + [("sit_s2_routing", row) for row in ROUTING_ROWS]
                 # routing added to REPA SiT-XL/2: the gated start (init_from is read only by the
                 # trainer, not by the lowering)
                 + [("sit_repa_xl2_routing_finetune", None)]
                 # REPA's recipe: the alignment loss on stored targets (repa_target_0 in the batch)
                 + [("sit_repa_xl2", None)]
                 # the residual forms with trained branch gains (docs/residual_forms.md)
                 + [(name, f"branch_gain={gain}") for name in ("mae_vit_b16", "sit_xl2")
                    for gain in ("layerscale", "rezero")]
                 # DeepNorm and pre-training's stochastic depth (the step then draws drop_u)
                 + [(name, form) for name in ("mae_vit_b16", "sit_xl2")
                    for form in ("norm_position=deepnorm", "drop_path=0.1")]
                 # hyper-connections, static and dynamic (4 streams)
                 + [(name, f"hyper_connections={form}") for name in ("mae_vit_b16", "sit_xl2")
                    for form in ("static", "dynamic")]
                 + [("uvit_s2_cifar100", "hyper_connections=dynamic")])
# The sample command's default sampler (config.sample: ODE heun, CFG 4) per SiT size and for a
# routed model, and the SDE sampler of its docstring.
SAMPLE_CONFIGS = [("sit_b2", None, None), ("sit_xl2", None, None),
                  ("sit_s2_routing", "fused_mirror", None), ("sit_xl2", None, ("sde", "euler"))]

# One argument of ``@main``: its tensor type, attributes and name (the pytree path).
ARG = re.compile(r'%arg\d+: tensor<([^>]*)> \{(.*?)\} loc\("(.*?)"\)')
# One result of ``@main``: its pytree path and sharding.
RESULT = re.compile(r'jax\.result_info = "(.*?)", sdy\.sharding = #sdy\.sharding<@mesh, (\[.*?\])>')
SHARDING = re.compile(r"sdy\.sharding = #sdy\.sharding<@mesh, (\[.*?\])>")


def load_config(name, row=None):
  """A config file's config; ``row``: its row (sit_s2_routing.py) or a ``FIELD=VALUE`` of the model."""
  get_config = runpy.run_path(os.path.join(REPO, "configs", f"{name}.py"))["get_config"]
  if row and "=" in row:
    config = get_config()
    field, value = row.split("=")
    config.model[field] = type(config.model[field])(value)
    return config
  return get_config(row) if row else get_config()


def config_id(name, row):
  return f"{name}:{row}" if row else name


def sdy_dims(spec, ndim: int) -> str:
  """The Shardy text of a ``PartitionSpec`` on an ``ndim`` array: ``[{}, {"fsdp"}]``."""
  dims = []
  for i in range(ndim):
    entry = spec[i] if i < len(spec) else None
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    dims.append("{" + ", ".join(f'"{n}"' for n in names) + "}")
  return "[" + ", ".join(dims) + "]"


def main_signature(text: str):
  """``({name: (type, attributes)}, {result path: sharding})`` of the module's ``@main``."""
  start = text.index("func.func public @main(")
  line = text[start:text.index("\n", start)]
  params, results = line.split(") -> (", 1)
  args = {name: (ty, attrs) for ty, attrs, name in ARG.findall(params)}
  return args, dict(RESULT.findall(results))


def leaves(prefix: str, tree):
  """``{prefix + keystr(path): leaf}``, the names ``jax.export`` gives the arguments."""
  return {prefix + jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_header(text: str, mesh):
  data, fsdp = mesh.shape["data"], mesh.shape["fsdp"]
  assert f"mhlo.num_partitions = {DEVICES} : i32" in text
  assert f'sdy.mesh @mesh = <["data"={data}, "fsdp"={fsdp}]>' in text


@pytest.mark.parametrize("name,row", TRAIN_CONFIGS, ids=[config_id(*c) for c in TRAIN_CONFIGS])
def test_train_step_exports_with_its_shardings_and_donation(name, row):
  config = load_config(name, row)
  program = export.program_for(config, DEVICES)
  rows = export.lower(program, PLATFORMS)
  state, batch = program.args
  mesh = program.mesh
  assert (mesh.shape["fsdp"], mesh.size) == (config.mesh.fsdp, DEVICES)
  fsdp_size = mesh.shape["fsdp"]
  expected = leaves("state", state)
  assert [r["platform"] for r in rows] == list(PLATFORMS)
  for row in rows:
    text = row["text"]
    check_header(text, mesh)
    args, results = main_signature(text)
    for name, leaf in expected.items():
      ty, attrs = args[name]  # KeyError: a state leaf is missing from the module
      (spec,) = SHARDING.findall(attrs)
      assert spec == sdy_dims(leaf.sharding.spec, leaf.ndim), name
      assert "tf.aliasing_output" in attrs, f"{name} is not donated"
      assert results["result[0]" + name[len("state"):]] == spec, name  # state keeps its sharding
    for name, leaf in leaves("state['params']", state["params"]).items():
      # Independent of step.state_shardings: the FSDP rule itself.
      assert leaf.sharding.spec == shd.fsdp_spec(leaf.shape, fsdp_size), name
    sharded = [n for n in expected if '"fsdp"' in SHARDING.findall(args[n][1])[0]
               and n.startswith("state['params']")]
    assert bool(sharded) == (fsdp_size > 1)  # H/14 shards its parameters over fsdp 8
    image = batch["image"]
    assert args["batch['image']"][0].startswith("x".join(map(str, image.shape)))
    assert SHARDING.findall(args["batch['image']"][1]) == ['[{"data", "fsdp"}, {}, {}, {}]']
    if config.task == "sit":  # MAE never reads the labels; XLA drops that argument
      assert SHARDING.findall(args["batch['label']"][1]) == ['[{"data", "fsdp"}]']
    if config.model.dtype == "bfloat16":
      assert "bf16" in text
    assert row["chars"] == len(text) > 0 and row["bytes"] > 0


@pytest.mark.parametrize("name,row,sampler", SAMPLE_CONFIGS,
                         ids=[config_id(n, r) + (f"-{s[0]}-{s[1]}" if s else "")
                              for n, r, s in SAMPLE_CONFIGS])
def test_sit_sampler_exports_with_batch_and_weight_shardings(name, row, sampler):
  config = load_config(name, row)
  if sampler:
    config.sample.mode, config.sample.method = sampler
  program = export.program_for(config, DEVICES, "sample")
  params, noise, labels, _ = program.args
  assert noise.shape[0] == export.sample_batch_size(config.sample.batch_size, DEVICES)
  for row_ in export.lower(program, PLATFORMS):
    text = row_["text"]
    check_header(text, program.mesh)
    args, results = main_signature(text)
    for path, leaf in leaves("p", params).items():
      assert SHARDING.findall(args[path][1]) == [sdy_dims(leaf.sharding.spec, leaf.ndim)], path
    assert SHARDING.findall(args["x"][1]) == ['[{"data", "fsdp"}, {}, {}, {}]']
    assert SHARDING.findall(args["y"][1]) == ['[{"data", "fsdp"}]']
    assert results == {"result": '[{"data", "fsdp"}, {}, {}, {}]'}


def test_dopri5_still_needs_devices_to_lower():
  """Pins why ``check_abstract`` refuses dopri5: when JAX or equinox lift it, this fails and the
  refusal (and docs/lowering.md) can go."""
  config = load_config("sit_b2")
  config.sample.method = "dopri5"
  with pytest.raises(ValueError, match="sample.method='dopri5' is not allowed"):
    export.program_for(config, DEVICES, "sample")
  program = export.sample_program(config, export.abstract_mesh(-1, 1, DEVICES))
  with pytest.raises(ValueError, match="AbstractMesh cannot be used"):
    export.export(program, "cuda")


def test_bad_values_fail_in_one_line_before_lowering():
  config = load_config("mae_vit_h14")  # fsdp 8
  cases = [
      (lambda: export.check_platforms(["tpu", "gpu"]), "platforms='tpu,gpu' is not allowed"),
      (lambda: export.check_platforms([]), "platforms='' is not allowed"),
      (lambda: export.program_for(config, 60), "devices=60 is not allowed; it must be divisible "
                                               "by mesh.fsdp=8"),
      (lambda: export.program_for(config, 0), "devices=0 is not allowed"),
      (lambda: export.abstract_mesh(4, 8, 64), "devices=64 is not allowed; it must equal "
                                               "mesh.data=4 x mesh.fsdp=8"),
      (lambda: export.program_for(config, 64, "sample"), "program='sample' is not allowed"),
  ]
  cudnn = load_config("sit_b2")
  cudnn.model.attention_impl = "cudnn"
  cases.append((lambda: export.program_for(cudnn, 64), "model.attention_impl='cudnn' is not "
                                                       "allowed"))
  bad_batch = load_config("sit_b2")
  cases.append((lambda: export.program_for(bad_batch, 48), "batch_size=256 is not allowed"))
  for fn, message in cases:
    with pytest.raises(ValueError, match=re.escape(message)):
      fn()


def lower_cli(*args):
  return subprocess.run([sys.executable, "-m", "decay_jax.cli.lower", *args], cwd=REPO,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=300)


def test_command_prints_a_line_per_platform_and_writes_the_modules(tmp_path):
  out = tmp_path / "step.mlir"
  p = lower_cli("--config=configs/mae_cpu_mnist.py", "--platforms=tpu,cuda", "--devices=64",
                f"--out={out}")
  assert p.returncode == 0, p.stderr[-3000:]
  lines = p.stdout.strip().splitlines()
  assert [line.split(":")[0] for line in lines] == ["tpu", "cuda"], p.stdout
  for line, platform in zip(lines, PLATFORMS):
    assert re.search(r"train_step lowered in [\d.]+ s, StableHLO [\d,]+ chars", line), line
    assert "mesh data=64 x fsdp=1 (64 devices)" in line
    path = tmp_path / f"step.{platform}.mlir"
    assert str(path) in line
    assert 'sdy.mesh @mesh = <["data"=64, "fsdp"=1]>' in path.read_text()
  p = lower_cli("--config=configs/mae_cpu_mnist.py", "--platforms=tpu,gpu")
  assert p.returncode == 2
  assert p.stderr.strip().splitlines()[-1].startswith("error: --platforms='tpu,gpu' is not "
                                                       "allowed")
