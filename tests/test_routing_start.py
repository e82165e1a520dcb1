"""Routing added to a trained plain SiT (models/routing_start.py, docs/routing.md "Routing added to
a pretrained SiT"): the function-preserving start, the paper's start, the parameter mapping, the
gradients of the new parameters, one-line errors, and a run started from a plain run's workdir."""

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decay_jax import sharding as shd
from decay_jax.models import factory, mae as mae_lib, routing, routing_start
from decay_jax.models import sit as sit_lib
from decay_jax.train import checkpoint as ckpt_lib
from decay_jax.train import pretrained, trainer
from decay_jax.train.tasks.sit import SiTTask
from decay_jax.train import tasks
from test_sit_train import tiny_sit_config
from testing_configs import load_config

X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8, 8, 2)), jnp.float32)
T = jnp.asarray([0.1, 0.4, 0.6, 0.9], jnp.float32)
Y = jnp.asarray([0, 1, 2, 3], jnp.int32)


def plain_sit(alpha_min=1.0, **fields):
  return sit_lib.sit("micro/2", input_size=8, in_channels=2, num_classes=3,
                     residual_routing="plain", alpha_min=alpha_min, **fields)


def trained_like(model, seed=2):
  """Parameters with every gate open (adaLN-Zero's zeros perturbed), as after training."""
  params = model.init(jax.random.key(0), X, T, Y)["params"]
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree_util.tree_unflatten(
      tree, [a + 0.1 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def sources():
  """``{alpha_min: (plain SiT, its trained-like parameters, its output on X, T, Y)}``."""
  out = {}
  for am in (1.0, 0.8):
    m = plain_sit(am)
    p = trained_like(m)
    out[am] = (m, p, m.apply({"params": p}, X, T, Y))
  return out


def flat(tree):
  return flax.traverse_util.flatten_dict(flax.core.unfreeze(tree))


@pytest.mark.parametrize("variant,alpha_min", [("mirror", 1.0), ("fused_mirror", 1.0),
                                               ("mirror", 0.8), ("fused_all", 0.8)])
def test_function_preserving_start_is_the_plain_model(sources, variant, alpha_min):
  plain, p, want = sources[alpha_min]
  routed = dataclasses.replace(plain, residual_routing=variant, routing_gate=True)
  params = routing_start.routed_from_plain(p, plain, routed)
  got = routed.apply({"params": params}, X, T, Y)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  assert float(jnp.abs(got).max()) > 0.1  # a non-trivial function
  for _, _, w in routing.routing_weights(routed, params, X, T, Y):
    np.testing.assert_array_equal(w, np.eye(len(w))[0])  # the stream only


def test_a_repa_sit_gains_routing_without_its_projectors():
  """REPA's SiT (projectors after block 1, REPA's flow convention) -> gated mirror without
  projectors: the same function, the projectors dropped (they feed only the alignment loss)."""
  repa = plain_sit(repa_depth=1, repa_dims=(8,), repa_hidden=16, flow_convention="repa")
  p = trained_like(repa)
  assert any(k.startswith("projectors") for k in p)
  routed = dataclasses.replace(repa, residual_routing="mirror", routing_gate=True, repa_depth=0,
                               repa_dims=())
  params = routing_start.start_from(p, repa, routed)
  assert not any(k.startswith("projectors") for k in params)
  np.testing.assert_allclose(routed.apply({"params": params}, X, T, Y),
                             repa.apply({"params": p}, X, T, Y), atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="differs from the model in flow_convention 'repa' "
                                       ".model: 'sit'."):
    routing_start.start_from(p, repa, dataclasses.replace(routed, flow_convention="sit"))


def test_paper_start_routes_uniformly_and_changes_the_function(sources):
  plain, p, want = sources[1.0]
  for variant in ("mirror", "fused_mirror"):
    routed = dataclasses.replace(plain, residual_routing=variant)
    params = routing_start.routed_from_plain(p, plain, routed)
    rows = routing.routing_weights(routed, params, X, T, Y)
    assert len(rows) == len(routing.candidate_counts(variant, plain.depth))
    for _, cols, w in rows:
      np.testing.assert_allclose(w, np.full(len(cols), 1.0 / len(cols)), rtol=1e-6)
    assert float(jnp.abs(routed.apply({"params": params}, X, T, Y) - want).max()) > 1e-2


@pytest.mark.parametrize("variant,gate", [("mirror", True), ("fused_first", False)])
def test_every_plain_parameter_is_copied_and_the_new_ones_start_at_zero(sources, variant, gate):
  plain, p, _ = sources[0.8]
  routed = dataclasses.replace(plain, residual_routing=variant, routing_gate=gate)
  out, src = flat(routing_start.routed_from_plain(p, plain, routed)), flat(p)
  for path, a in src.items():
    assert out[path] is a or np.array_equal(out[path], a), path
  new = {k: v for k, v in out.items() if k not in src}
  assert {k[-1] for k in new} == (set(routing_start.NEW_PARAMS) if gate
                                  else {"route_attn", "route_mlp"})
  assert all(not np.any(v) and v.dtype == jnp.float32 for v in new.values())
  assert sum(v.size for v in new.values()) == routing.extra_params(variant, plain.depth,
                                                                    plain.dim, gate)
  shapes = flat(sit_lib.abstract_params(routed))
  assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in shapes.items()}


def grads(model, params):
  target = jnp.asarray(np.random.default_rng(1).standard_normal(X.shape), jnp.float32)
  loss = lambda q: jnp.mean(jnp.square(model.apply({"params": q}, X, T, Y) - target))
  return {"/".join(k): np.abs(np.asarray(v)).max() for k, v in flat(jax.grad(loss)(params)).items()
          if k[-1].startswith("route_")}


def test_new_parameters_get_gradients(sources):
  """Gated: g at once, w from the second step (its gradient carries g); the paper's start: w at
  once. Decoder block 1's attention reads x_K, its own input: identical candidates, no gradient."""
  plain, p, _ = sources[1.0]
  gated = dataclasses.replace(plain, residual_routing="mirror", routing_gate=True)
  params = routing_start.routed_from_plain(p, plain, gated)
  g0 = grads(gated, params)
  idle = "trunk/dec_00/route_attn"
  for name, v in g0.items():
    if name.startswith(idle):
      assert v == 0, name
    elif name.endswith("_gate"):
      assert v > 1e-6, name
    else:
      assert v == 0, name  # w: multiplied by g = 0
  moved = jax.tree_util.tree_map_with_path(
      lambda k, a: a + 0.01 if jax.tree_util.keystr(k).endswith("gate']") else a, params)
  g1 = grads(gated, moved)  # after a first step of g (Adam moves it by about lr)
  assert all(v > 1e-7 for n, v in g1.items() if not n.startswith(idle)), g1
  paper = dataclasses.replace(plain, residual_routing="mirror")
  g = grads(paper, routing_start.routed_from_plain(p, plain, paper))
  assert all(v > 1e-6 for n, v in g.items() if not n.startswith(idle)), g


def test_one_line_errors(sources, tmp_path):
  plain, p, _ = sources[1.0]
  mirror = dataclasses.replace(plain, residual_routing="mirror", routing_gate=True)
  cases = [
      (dataclasses.replace(plain, residual_routing="none"), mirror,
       "official decayed SiT .residual_routing='none'.; its long-skip Linears have no place"),
      (plain, dataclasses.replace(plain, residual_routing="attnres"),
       "residual_routing='attnres' is not allowed when starting from a plain SiT"),
      (plain, dataclasses.replace(plain, residual_routing="static_skip"),
       "residual_routing='static_skip' is not allowed when starting from a plain SiT"),
      (plain, dataclasses.replace(mirror, dim=64), "differs from the model in dim 32 .model: 64."),
      (plain, dataclasses.replace(plain, dim=64), "differs from the model in dim 32 .model: 64."),
      (plain, sit_lib.sit("micro/2", input_size=8, in_channels=2, num_classes=3,
                          residual_routing="mirror", alpha_min=0.8),
       "differs from the model in alpha_min 1.0 .model: 0.8."),
      (plain_sit(0.8), dataclasses.replace(plain_sit(0.8), residual_routing="mirror",
                                           routing_gate=True, routing_decay="current"),
       "routing_decay='current' with alpha_min=0.8 cannot start function-preserving"),
      (mirror, dataclasses.replace(plain, residual_routing="fused_mirror"),
       "init_from has residual_routing='mirror'; routing is added to a plain SiT"),
  ]
  for source, model, match in cases:
    with pytest.raises(ValueError, match=match) as e:
      routing_start.start_from(p, source, model)
    assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="routing_gate=True is not allowed with residual_routing="
                                       "'plain'; it gates the routed stream of mirror"):
    plain_sit(routing_gate=True)
  # an MAE is no start for a SiT run
  mae = mae_lib.mae("micro/4", img_size=8, in_chans=1)
  ckpt_lib.save_params(str(tmp_path / "mae"),
                       mae.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"], mae)
  with pytest.raises(ValueError, match="holds a MaskedAutoencoder, a sit model is needed here"):
    pretrained.load(str(tmp_path / "mae"), None, SiTTask)


def test_the_gate_is_a_model_field_of_configs_and_model_json(sources, tmp_path):
  plain, p, _ = sources[1.0]
  routed = dataclasses.replace(plain, residual_routing="mirror", routing_gate=True)
  ckpt_lib.save_params(str(tmp_path / "routed"), routing_start.routed_from_plain(p, plain, routed),
                       routed)
  model, params = pretrained.load(str(tmp_path / "routed"), None, SiTTask)
  assert model == routed and "route_mlp_gate" in params["trunk"]["dec_01"]
  fields = factory.model_fields(routed)
  del fields["routing_gate"]  # a model.json written before the field
  assert factory.model_from_fields("SiT", fields).routing_gate is False
  for name, start, channels in (("sit_cpu_mnist_routing_finetune", "mirror", 1),
                                ("sit_repa_xl2_routing_finetune", "mirror_paper", 4)):
    c = load_config(name, start)
    model = tasks.build_model(c, {"image_size": c.data.image_size, "channels": channels})
    assert model.routing_gate is (start == "mirror") and model.residual_routing == "mirror"
    assert model.alpha_min == 1.0 and c.init_from


def test_a_routed_run_starts_from_a_plain_run_with_its_loss(tmp_path):
  """A plain SiT trained 3 steps; from its workdir, a gated mirror run and the same plain SiT
  continued: their first losses on the same batch agree, and the routed run's EMA started as a
  copy of its started parameters."""
  common = {"model.residual_routing": "plain", "model.alpha_min": 0.8, "ema_decay": 0.9,
            "checkpoint.every_steps": 1}
  plain_dir = str(tmp_path / "plain")
  trainer.train_and_evaluate(tiny_sit_config(**common, num_train_steps=3), plain_dir)
  start = {**common, "num_train_steps": 1, "init_from": plain_dir}
  cont = trainer.train_and_evaluate(tiny_sit_config(**start), str(tmp_path / "continued"))
  routed_cfg = tiny_sit_config(**{**start, "model.residual_routing": "mirror",
                                  "model.routing_gate": True})
  routed = trainer.train_and_evaluate(routed_cfg, str(tmp_path / "routed"))
  np.testing.assert_allclose(routed["loss"], cont["loss"], rtol=1e-5)
  mesh = shd.make_mesh(1, 1)
  source, source_params = pretrained.load(plain_dir, mesh, SiTTask)
  model = tasks.build_model(routed_cfg, {"image_size": 16, "channels": 1})
  started = flat(routing_start.routed_from_plain(source_params, source, model))
  ema, _ = ckpt_lib.restore_run_params(str(tmp_path / "routed"), mesh, weights="ema")
  params, _ = ckpt_lib.restore_run_params(str(tmp_path / "routed"), mesh)
  ema, params = flat(ema), flat(params)
  for k, s in started.items():
    np.testing.assert_allclose(ema[k], 0.9 * np.asarray(s) + 0.1 * np.asarray(params[k]),
                               atol=1e-6, err_msg="/".join(k))
  bad = tiny_sit_config(**{**start, "model.residual_routing": "mirror", "model.alpha_min": 1.0})
  with pytest.raises(ValueError, match="differs from the model in alpha_min 0.8 .model: 1.0.") as e:
    trainer.train_and_evaluate(bad, str(tmp_path / "bad"))
  assert "\n" not in str(e.value)
