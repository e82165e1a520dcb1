"""The residual spec (models/residual.py): fields, checks, the update, the alpha parameter, and
params directories written before it (tests/fixtures/model_json_v1) and before the residual
stack, one per residual form (tests/fixtures/residual_forms_1aac245), loading unchanged."""

import dataclasses
import json
import math
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax.models import factory, residual, schedules
from decay_jax.models import mae as mae_lib
from decay_jax.models import sit as sit_lib
from decay_jax.models import uvit as uvit_lib
from decay_jax.models import vit as vit_lib
from decay_jax.models.residual import Residual
from decay_jax.train import checkpoint
from decay_jax.train import config as config_lib
from decay_jax.train import tasks

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "model_json_v1"


# ----- params directories written by the code before the spec -------------------------------------

def _load(name, tmp_path):
  # A copy: orbax may write beside what it reads, and the fixture stays untouched.
  shutil.copytree(FIXTURES / name, tmp_path / name)
  model, params = checkpoint.load_params(str(tmp_path / name))
  stored = json.loads((FIXTURES / name / "model.json").read_text())
  expected = json.loads((FIXTURES / name / "expected.json").read_text())
  return model, params, stored, expected


# Residual fields added since the fixture was written, at their defaults (the published forms).
NEW_FIELDS = {"branch_gain": "none", "gain_init": -1.0, "norm_position": "pre", "drop_path": 0.0,
              "hyper_connections": "none", "hyper_rate": 4}


def same_fields(now: dict, stored: dict, cls=None) -> bool:
  """The flat model.json of today's code is the stored one, same order, plus the residual fields
  added since (at their defaults, right after the old residual fields) and the fields of model
  class ``cls`` added since (at the class's defaults: SiT's ``routing_gate``, REPA's fields)."""
  defaults = {f.name: f.default for f in dataclasses.fields(cls)} if cls is not None else {}
  added = [k for k in now if k not in stored and k not in NEW_FIELDS]
  old = {k: v for k, v in now.items() if k not in NEW_FIELDS and k not in added}
  return (list(old.items()) == list(stored.items())
          and {k: now[k] for k in NEW_FIELDS} == NEW_FIELDS
          and all(k in defaults and now[k] == defaults[k] for k in added))


def _close(got, want):
  np.testing.assert_allclose(np.asarray(got), np.asarray(want, np.float32), rtol=1e-5, atol=1e-6)


def test_mae_params_dir_written_before_the_spec_loads_and_computes_the_same(tmp_path):
  model, params, stored, expected = _load("mae", tmp_path)
  assert type(model) is mae_lib.MaskedAutoencoder
  assert model.residual == Residual(alpha_min=0.6, schedule_shape="cosine",
                                    shortcut_form="learnable")
  assert same_fields(factory.model_fields(model), stored["fields"])
  # The learnable alpha is the stored parameter 'alpha', not the schedule it started from.
  assert params["alpha"].shape == (2, 2)
  assert not np.allclose(params["alpha"], schedules.decay_schedule(2, 0.6, shape="cosine"))
  inp = {k: jnp.asarray(v, jnp.float32) for k, v in expected["inputs"].items()}
  out = model.apply({"params": params}, inp["imgs"], inp["noise"])
  feats = model.apply({"params": params}, inp["imgs"], method=model.features)
  _close(out["loss"], expected["outputs"]["loss"])
  _close(out["pred"], expected["outputs"]["pred"])
  _close(feats, expected["outputs"]["features"])


def test_sit_params_dir_written_before_the_spec_loads_and_computes_the_same(tmp_path):
  model, params, stored, expected = _load("sit", tmp_path)
  assert type(model) is sit_lib.SiT
  assert model.residual == Residual(alpha_min=0.8, schedule_convention="block",
                                    shortcut_form="attn_only")
  assert same_fields(factory.model_fields(model), stored["fields"], sit_lib.SiT)
  inp = expected["inputs"]
  out = model.apply({"params": params}, jnp.asarray(inp["x"], jnp.float32),
                    jnp.asarray(inp["t"], jnp.float32), jnp.asarray(inp["y"], jnp.int32))
  _close(out, expected["outputs"]["out"])


FORMS_1AAC245 = FIXTURES.parent / "residual_forms_1aac245"
FORM_DIRS = sorted(p.name for p in FORMS_1AAC245.iterdir() if (p / "model.json").exists())


def test_the_residual_form_fixtures_are_all_there():
  assert FORM_DIRS == ["mae_deepnorm", "mae_drop_path", "mae_hyper_dynamic", "mae_hyper_static",
                       "mae_layerscale", "mae_post_norm", "mae_rezero", "sit_deepnorm",
                       "sit_hyper_dynamic"]


@pytest.mark.parametrize("name", FORM_DIRS)
def test_params_dirs_of_each_residual_form_written_before_the_stack_compute_the_same(tmp_path,
                                                                                     name):
  """Written by 1aac245's code (tests/fixtures/residual_forms_1aac245/make.py), before
  models/stack.py: today's code reads the same spec and gives the same outputs."""
  shutil.copytree(FORMS_1AAC245 / name, tmp_path / name)
  model, params = checkpoint.load_params(str(tmp_path / name))
  stored = json.loads((FORMS_1AAC245 / name / "model.json").read_text())["fields"]
  expected = json.loads((FORMS_1AAC245 / name / "expected.json").read_text())
  assert {k: v for k, v in model.residual.fields().items() if k in stored} == {
      k: stored[k] for k in residual.NAMES if k in stored}
  assert model.residual != Residual(alpha_min=model.residual.alpha_min)  # a form, not plain decay
  e = {k: np.asarray(v) for k, v in expected.items()}
  if name.startswith("mae"):
    out = model.apply({"params": params}, jnp.asarray(e["imgs"], jnp.float32),
                      jnp.asarray(e["noise"], jnp.float32))
    _close(out["loss"], e["loss"])
    _close(out["pred"], e["pred"])
  else:
    out = model.apply({"params": params}, jnp.asarray(e["x"], jnp.float32),
                      jnp.asarray(e["t"], jnp.float32), jnp.asarray(e["y"], jnp.int32))
    _close(out, e["out"])


def test_uvit_model_json_written_before_the_spec_round_trips():
  stored = json.loads((FIXTURES / "uvit" / "model.json").read_text())
  model = factory.model_from_fields(stored["class"], stored["fields"])
  assert model.residual == Residual(alpha_min=0.5, shortcut_form="sqrt_half_f")
  assert not model.zero_init_branches and model.mode == "decayed"
  assert same_fields(factory.model_fields(model), stored["fields"])
  assert model.shortcuts.branch_scale == math.sqrt(0.5)


def test_model_from_fields_reads_a_nested_residual_and_fills_missing_fields_from_the_class():
  nested = factory.model_from_fields("SiT", {"depth": 4, "residual": {"shortcut_form": "mlp_only"}})
  assert nested.residual == Residual(alpha_min=0.8, shortcut_form="mlp_only")  # SiT's default
  flat = factory.model_from_fields("UViT", {"alpha_min": 0.9})
  assert flat.residual == Residual(alpha_min=0.9)
  assert factory.model_from_fields("UViT", {}).residual == Residual(alpha_min=0.7)
  with pytest.raises(ValueError, match=r"unknown residual field\(s\) \['alpha'\]"):
    factory.model_from_fields("SiT", {"residual": {"alpha": 0.5}})


# ----- the spec -----------------------------------------------------------------------------------

def test_fields_round_trip_and_defaults_per_model():
  spec = Residual(alpha_min=0.6, schedule_convention="block", schedule_shape="cosine",
                  shortcut_form="mlp_only")
  assert spec.fields() == dict(alpha_min=0.6, schedule_convention="block",
                               schedule_shape="cosine", shortcut_form="mlp_only", **NEW_FIELDS)
  assert tuple(spec.fields()) == residual.NAMES
  again, rest = Residual.from_fields(dict(spec.fields(), dim=8))
  assert again == spec and rest == {"dim": 8}
  assert hash(again) == hash(spec)
  assert Residual.from_fields({"alpha_min": 0.5}, base=spec)[0] == dataclasses.replace(
      spec, alpha_min=0.5)
  assert Residual.from_fields({"residual": spec, "alpha_min": 0.5})[0].alpha_min == 0.5
  assert mae_lib.MaskedAutoencoder().residual == Residual()
  # the fine-tuning ViT's drop path (timm's 0.1) is the spec's field, as in pre-training
  assert vit_lib.ViTClassifier(num_classes=3).residual == Residual(drop_path=0.1)
  assert vit_lib.ViTClassifier(num_classes=3, drop_path=0.2).drop_path == 0.2
  assert sit_lib.SiT().residual == Residual(alpha_min=0.8)
  assert uvit_lib.UViT().residual == Residual(alpha_min=0.7)


@pytest.mark.parametrize("kwargs,match", [
    (dict(alpha_min=0.0), r"alpha_min=0.0 is not allowed; it must be a number in \(0, 1\]"),
    (dict(alpha_min=True), r"alpha_min=True is not allowed"),
    (dict(schedule_convention="x"), "schedule_convention='x' is not allowed; choose one of"),
    (dict(schedule_shape="step"), "schedule_shape='step' is not allowed"),
    (dict(shortcut_form="rezero"), "shortcut_form='rezero' is not allowed; choose one of 'decay'"),
    (dict(norm_position="after"), "norm_position='after' is not allowed; choose one of 'pre'"),
    (dict(drop_path=1.0), r"drop_path=1.0 is not allowed; it must be a number in \[0, 1\)"),
])
def test_bad_fields_fail_when_the_spec_is_built(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Residual(**kwargs)


def test_a_model_refuses_a_residual_that_is_not_a_spec():
  with pytest.raises(ValueError, match=r"residual=0.7 is not allowed; it must be a "
                                       r"decay_jax.models.residual.Residual"):
    sit_lib.SiT(residual=0.7)


def test_flat_keywords_fold_into_the_spec_with_the_model_defaults():
  """Callers that predate the spec (converters, config files) keep the flat names."""
  assert sit_lib.SiT(shortcut_form="learnable").residual == Residual(0.8, shortcut_form="learnable")
  assert sit_lib.SiT(alpha_min=0.7) == sit_lib.SiT(residual=Residual(alpha_min=0.7))
  m = mae_lib.mae("micro/4", residual=Residual(alpha_min=0.6), schedule_shape="cosine")
  assert m.residual == Residual(alpha_min=0.6, schedule_shape="cosine")
  assert (m.alpha_min, m.schedule_convention, m.schedule_shape, m.shortcut_form) == (
      0.6, "sublayer", "cosine", "decay")
  np.testing.assert_array_equal(m.shortcuts.alphas,
                                schedules.decay_schedule(m.depth, 0.6, shape="cosine"))
  with pytest.raises(AttributeError):
    m.alpha_min = 0.5  # read-only views


def test_add_is_alpha_x_plus_scaled_branch_summed_in_float32():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
  branch = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.bfloat16)
  for form, scale in (("decay", 1.0), ("sqrt_half_f", math.sqrt(0.5))):
    spec = Residual(alpha_min=0.5, shortcut_form=form)
    assert spec.branch_scale == scale
    got = spec.add(x, 0.75, spec.scale_branch(branch))  # as stack.sublayer adds a branch
    scaled = branch if scale == 1.0 else scale * branch  # in the branch's dtype, then cast
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, 0.75 * x + scaled.astype(jnp.float32))


class _Holder:
  """What ``coefficients`` needs of a module: ``param``."""

  def __init__(self):
    self.params = {}

  def param(self, name, init):
    self.params[name] = init(None)
    return self.params[name]


def test_coefficients_are_a_constant_or_the_learnable_parameter_alpha():
  fixed, held = Residual(alpha_min=0.6).coefficients(_Holder(), 3), _Holder()
  learned = Residual(alpha_min=0.6, shortcut_form="learnable").coefficients(held, 3)
  want = schedules.decay_schedule(3, 0.6).astype(np.float32)
  np.testing.assert_array_equal(fixed, want)
  np.testing.assert_array_equal(learned, want)
  assert list(held.params) == ["alpha"] and learned.dtype == jnp.float32


def test_learnable_alpha_keeps_its_parameter_name_in_every_model():
  for model, args in (
      (mae_lib.mae("micro/4", residual=Residual(0.6, shortcut_form="learnable")),
       (jnp.zeros((1, 16, 16, 3)), jnp.zeros((1, 16)))),
      (sit_lib.sit("micro/2", input_size=8, num_classes=10,
                   residual=Residual(shortcut_form="learnable")),
       (jnp.zeros((1, 8, 8, 4)), jnp.zeros((1,)), jnp.zeros((1,), jnp.int32))),
      (uvit_lib.uvit("tiny/4", depth=2, residual=Residual(shortcut_form="learnable")),
       (jnp.zeros((1, 32, 32, 3)), jnp.zeros((1,))))):
    params = jax.eval_shape(model.init, jax.random.key(0), *args)["params"]
    assert params["alpha"].shape == model.shortcuts.alphas.shape


def test_uvit_original_mode_gives_the_blocks_the_plain_residual():
  m = uvit_lib.UViT(residual=Residual(alpha_min=0.5, shortcut_form="sqrt_half_both"),
                    mode="uvit_original")
  assert m.block_residual == Residual() and m.alpha_min == 0.5
  assert np.all(m.shortcuts.alphas == 1.0) and m.shortcuts.branch_scale == 1.0


# ----- configs and the factory --------------------------------------------------------------------

def test_every_config_holds_every_residual_field_flat():
  for make, alpha_min in ((config_lib.mae_config, 0.7), (config_lib.finetune_config, 1.0),
                          (config_lib.sit_config, 0.8), (config_lib.uvit_config, 0.7)):
    model = make().model
    # fine-tuning keeps upstream MAE's drop path 0.1 (now the spec's field); pre-training 0 (off)
    drop_path = 0.1 if make is config_lib.finetune_config else 0.0
    assert {k: model[k] for k in residual.NAMES} == Residual(alpha_min=alpha_min,
                                                             drop_path=drop_path).fields()


def test_build_model_builds_one_spec_and_finetuning_takes_the_pretrained_spec():
  assert set(tasks.TASKS) == {"mae", "sit", "finetune", "uvit"}
  config = config_lib.mae_config()
  config.model.preset = "micro/4"
  config.model.shortcut_form = "attn_only"
  info = dict(image_size=16, channels=1, num_classes=10)
  pretrained = tasks.build_model(config, info)
  assert pretrained.residual == Residual(alpha_min=0.7, shortcut_form="attn_only")
  ft = config_lib.finetune_config()
  ft.model.preset = "micro/4"
  classifier = tasks.build_model(ft, info, pretrained=pretrained)
  # the pre-trained spec, not the config's fields; only the drop path is fine-tuning's own
  assert classifier.residual == dataclasses.replace(pretrained.residual, drop_path=0.1)
  bad = config_lib.sit_config()
  bad.model.schedule_shape = "step"
  with pytest.raises(ValueError, match="^model.schedule_shape='step' is not allowed"):
    tasks.build_model(bad, dict(image_size=8, channels=4, num_classes=10))
