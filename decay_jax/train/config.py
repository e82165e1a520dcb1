"""Default training configs (ml_collections) and their validation.

Config files in ``configs/`` start from ``mae_config()``, ``finetune_config()``, ``sit_config()`` or
``uvit_config()`` and override fields;
every field can be overridden on the command line (``--config.model.alpha_min=0.7``). The configs
are locked, so a misspelt override fails at once. ``validate`` turns every bad value into a
one-line ``ValueError`` naming the field, before anything is compiled.
"""

from __future__ import annotations

from typing import Optional, Tuple

import ml_collections as mlc

from decay_jax import validate as validate_lib
from decay_jax.data import pipeline
from decay_jax.models import residual as residual_lib


def _common(task: str) -> mlc.ConfigDict:
  c = mlc.ConfigDict()
  c.task = task
  c.seed = 0
  c.data = pipeline.default_data_config()
  c.batch_size = 256  # effective (global) batch per optimiser step
  c.accum_steps = 1  # microbatches per step (the batch is split inside the jitted step)
  c.num_epochs = 1.0
  c.num_train_steps = -1  # > 0 overrides num_epochs
  c.warmup_steps = -1  # > 0 overrides warmup_epochs
  c.ema_decay = 0.0  # > 0 keeps an EMA of the parameters in the train state (SiT: 0.9999)
  c.warmup_epochs = 0.0
  c.mesh = mlc.ConfigDict(dict(data=-1, fsdp=1))
  c.checkpoint = mlc.ConfigDict(dict(every_steps=1000, keep=3, keep_every_steps=0,
                                     async_save=True))
  c.log_every_steps = 50
  c.picture_every_steps = 1000
  c.tensorboard = True  # False: metrics.jsonl and the console only (see train.writers)
  c.profile_steps = ""  # "START,COUNT": a jax.profiler trace of those steps (train.profiling)
  c.evals = mlc.ConfigDict()
  return c


def _model_fields(residual: residual_lib.Residual = residual_lib.Residual()) -> mlc.ConfigDict:
  """Residual and precision fields common to all models (architecture comes from the preset):
  every field of the ``residual`` spec, flat (``model.alpha_min``, ``model.shortcut_form`` ...)."""
  return mlc.ConfigDict(dict(**residual.fields(), dtype="float32",
                             attention_impl=mlc.FieldReference(None, field_type=str),
                             remat_policy="none"))


def representation_evals() -> mlc.ConfigDict:
  """The frozen-feature evaluators' settings (MAE runs; U-ViT runs through their probe view)."""
  evals = mlc.ConfigDict()
  evals.knn = mlc.ConfigDict(dict(enabled=True, every_steps=25_000, k=20, temperature=0.07,
                                  pool="mean", layernorm=False, train_split="train",
                                  eval_split="validation", max_train_examples=100_000,
                                  max_eval_examples=0, batch_size=256))
  # Representation evaluators (decay_jax.evals.evaluators; protocols in evals/linear_probe.py).
  # The probes are off during training (run `python -m decay_jax.cli.evaluate`); the rank pass (effective
  # rank per block, branch ratios per sublayer) is one forward over num_images images.
  evals.linear = mlc.ConfigDict(dict(
      enabled=False, every_steps=0, protocols="official", features="mean,patch_mean_ln,cls_ln",
      train_split="train", eval_split="validation", max_train_examples=100_000,
      max_eval_examples=0, batch_size=256, seed=0,
      official=dict(epochs=200, lr=1e-2, weight_decay=0.01, batch_size=256),
      mae=dict(epochs=90, warmup_epochs=10.0, blr=0.1, batch_size=16384, momentum=0.9,
               trust_coefficient=0.001, weight_decay=0.0, augment=True, crop_scale=(0.08, 1.0))))
  evals.layers = mlc.ConfigDict(dict(
      enabled=False, every_steps=0, feature="mean", k=20, temperature=0.07, probe_epochs=10,
      probe_lr=1e-3, probe_batch_size=256, seed=0, train_split="train", eval_split="validation",
      max_train_examples=50_000, max_eval_examples=10_000, batch_size=256,
      heldout_fraction=0.0))  # > 0: also pick the block on that share of the training set
  evals.rank = mlc.ConfigDict(dict(
      enabled=True, every_steps=5000, feature="mean", branch_ratios=True,
      split="validation", num_images=2048, batch_size=256))
  return evals


def generation_eval(sample: mlc.ConfigDict, **sampler) -> mlc.ConfigDict:
  """The reported generation evaluation (``decay_jax.evals.generation_eval``; docs/
  generation_metrics.md "Periodic evaluation"), off in training unless ``enabled``: FID, sFID, IS,
  precision, recall, density and coverage of ``num_samples`` EMA samples every ``every_steps``
  against the reference batch ``ref``. ``sample`` has ``config.sample``'s sampler fields (not the
  picture grid's ``grid_size``/``batch_size``) set to ``sampler``: the reported sampler, kept apart
  from the monitoring grid's. ``report_num``: the paper's sample count (the full evaluation is
  ``decay_jax.cli.sample`` + ``decay_jax.cli.fid`` with these settings)."""
  fields = {k: v for k, v in sample.to_dict().items() if k not in ("grid_size", "batch_size")}
  return mlc.ConfigDict(dict(
      enabled=False, every_steps=50_000, num_samples=2000, report_num=50_000, seed=0,
      weights="ema", ref="", inception="", vae="", batch_size=64, inception_batch_size=200,
      is_split_size=5000, pr_k=3, dc_k=5,  # ADM's split and k; prdc's k
      sample=dict(fields, **sampler)))


def mae_config() -> mlc.ConfigDict:
  """MAE pretraining defaults: the official recipe (docs/official_code.md 2) at ViT-B/16."""
  c = _common("mae")
  c.model = _model_fields(residual_lib.Residual(alpha_min=0.7))
  c.model.preset = "B/16"
  c.model.norm_pix_loss = True
  c.model.mask_ratio = 0.75
  c.data.dataset = "imagenet2012"
  c.data.image_size = 224
  c.data.normalize = "imagenet"
  c.data.eval_split = "validation"
  c.batch_size = 4096
  c.num_epochs = 800.0
  c.warmup_epochs = 40.0
  c.checkpoint.every_steps = 2000
  c.checkpoint.keep_every_steps = 50_000
  c.picture_every_steps = 5000
  c.optim = mlc.ConfigDict(dict(base_lr=1.5e-4, lr=mlc.FieldReference(None, field_type=float),
                                schedule="warmup_cosine", b1=0.9, b2=0.95, eps=1e-8,
                                weight_decay=0.05, min_lr=0.0, grad_clip_norm=0.0))
  c.evals = representation_evals()
  return c


def finetune_config() -> mlc.ConfigDict:
  """End-to-end fine-tuning defaults: upstream MAE's ViT-B/16 recipe (docs/finetune.md).

  ``init_from``: a pre-training workdir of ``decay_jax.cli.train`` (its latest checkpoint) or a params
  directory (``decay_jax.cli.convert mae ... --out DIR``); the classifier takes that encoder's sizes and
  decay schedule (``model.preset`` and ``model.alpha_min`` are then not used). Empty: from scratch
  with ``model.preset``'s encoder. The classes come from the data.
  """
  c = _common("finetune")
  c.init_from = ""
  c.model = _model_fields()
  c.model.preset = "B/16"
  c.model.drop_path = 0.1
  c.data.dataset = "imagenet2012"
  c.data.image_size = 224
  c.data.normalize = "imagenet"
  c.data.eval_split = "validation"
  c.data.crop_scale = (0.08, 1.0)  # timm's RandomResizedCrop default
  c.data.rand_augment = "rand-m9-mstd0.5-inc1"
  c.batch_size = 1024
  c.num_epochs = 100.0
  c.warmup_epochs = 5.0
  c.checkpoint.every_steps = 2000
  c.picture_every_steps = 0
  c.optim = mlc.ConfigDict(dict(base_lr=5e-4, lr=mlc.FieldReference(None, field_type=float),
                                schedule="warmup_cosine", b1=0.9, b2=0.999, eps=1e-8,
                                weight_decay=0.05, min_lr=1e-6, grad_clip_norm=0.0,
                                layer_decay=0.65))
  # On device (data/mixup.py): random erasing per example, then timm's Mixup as upstream calls
  # it per 32-example GPU batch.
  c.mixup = mlc.ConfigDict(dict(erase_prob=0.25, mixup_alpha=0.8, cutmix_alpha=1.0,
                                switch_prob=0.5, smoothing=0.1, group=32))
  c.evals.accuracy = mlc.ConfigDict(dict(enabled=True, every_steps=1251, eval_split="validation",
                                         max_eval_examples=0, batch_size=256))
  return c


def sit_config() -> mlc.ConfigDict:
  """SiT training defaults: the official recipe (docs/official_code.md 5.2) at SiT-XL/2."""
  c = _common("sit")
  c.model = _model_fields(residual_lib.Residual(alpha_min=0.8))
  c.model.preset = "XL/2"
  c.model.num_classes = 1000
  c.model.class_dropout_prob = 0.1
  c.model.learn_sigma = True
  # Structured residual routing (decay_jax/models/routing.py): 'none' is the official decayed SiT.
  c.model.residual_routing = "none"
  c.model.routing_decay = "after"
  # REPA (docs/repa.md): projectors after block repa_depth (0: off), one per target width.
  c.model.repa_depth = 0
  c.model.repa_dims = ()
  c.model.repa_hidden = 2048
  c.model.flow_convention = "sit"  # 'repa': REPA's time and velocity inside the network
  c.model.routing_gate = False  # True: routing added to a trained SiT starts function-preserving
  # A SiT run or params directory to start from (docs/routing.md "Routing added to a pretrained
  # SiT"); empty: random initialisation.
  c.init_from = ""
  c.data.dataset = "imagenet2012"
  c.data.image_size = 32
  c.data.normalize = "none"
  c.data.eval_split = "validation"
  c.data.crop_scale = (1.0, 1.0)  # latents: ADM centre crop + flip happen at extraction time
  c.data.crop_ratio = (1.0, 1.0)
  c.batch_size = 256
  c.num_train_steps = 400_000
  c.ema_decay = 0.9999
  c.optim = mlc.ConfigDict(dict(base_lr=0.0, lr=1e-4, schedule="constant", b1=0.9, b2=0.999,
                                eps=1e-8, weight_decay=0.0, min_lr=0.0, grad_clip_norm=0.0))
  c.transport = mlc.ConfigDict(dict(path_type="linear", prediction="velocity",
                                    loss_weight=mlc.FieldReference(None, field_type=str),
                                    train_eps=mlc.FieldReference(None, field_type=float),
                                    sample_eps=mlc.FieldReference(None, field_type=float)))
  # REPA's alignment loss (decay_jax/train/tasks/sit.py; off while model.repa_depth is 0): the
  # targets come in the batch ('repa_target_I') or from the frozen encoder at `encoder` (a params
  # directory, model.json + params, or an MAE training workdir) on the uint8 pixels (a pixel
  # stream's images, or the 'repa_pixels' a latent stream delivers).
  # `encoder_normalize`: the data.normalize mode an MAE encoder was trained with (DINOv2 has REPA's).
  c.repa = mlc.ConfigDict(dict(proj_coeff=0.5, encoder="", encoder_normalize="imagenet"))
  # Sampling: the monitoring grid during training and the defaults of decay_jax.cli.sample. The
  # official in-training samples use ODE dopri5 with CFG 4.0; the official FID sampler CFG 1.0.
  c.sample = mlc.ConfigDict(dict(mode="ode", method="heun", num_steps=50, atol=1e-6, rtol=1e-3,
                                 cfg_scale=4.0, cfg_channels=3, cfg_interval=(0.0, 1.0),
                                 diffusion_form="sigma", diffusion_norm=1.0, last_step="Mean",
                                 last_step_size=0.04, grid_size=16, batch_size=64))
  # The reported FID-50K: SiT's FID sampler (SDE Euler-Maruyama, 250 steps, "Mean" last step;
  # no guidance as the 400K-step rows; its 2.06 adds cfg_scale 1.5) on EMA weights against ADM's
  # VIRTUAL_imagenet256_labeled.npz. The decay paper's own sampler is not public.
  c.evals.generation = generation_eval(c.sample, mode="sde", method="euler", num_steps=250,
                                       cfg_scale=1.0)
  c.picture_every_steps = 10_000
  c.checkpoint.every_steps = 5000
  c.checkpoint.keep_every_steps = 50_000
  c.log_every_steps = 100
  return c


def uvit_config() -> mlc.ConfigDict:
  """U-ViT training defaults: baofff/U-ViT's ``cifar10_uvit_small`` recipe (docs/uvit.md) at S/2.

  AdamW lr 2e-4, betas (0.99, 0.999), weight decay 0.03 on every parameter, linear warmup over
  2,500 steps then constant, EMA 0.9999, batch 128, 500K steps, images in [-1, 1] with random
  horizontal flips, the continuous VPSDE, DPM-Solver-fast with 50 model calls for samples.
  """
  c = _common("uvit")
  c.model = _model_fields(residual_lib.Residual(alpha_min=0.7))
  c.model.preset = "S/2"
  c.model.mode = "decayed"  # 'uvit_original': alpha 1 and U-ViT's init, bit for bit
  c.model.skip_mode = "concat"
  c.model.zero_init_branches = True
  c.model.conditional = False  # True: label token; num_classes from the data (+1 with dropout)
  c.data.dataset = "cifar10"
  c.data.image_size = 32
  c.data.normalize = "half"
  c.data.eval_split = "test"
  c.data.crop_scale = (1.0, 1.0)  # the whole image, flipped at random: U-ViT's CIFAR transform
  c.data.crop_ratio = (1.0, 1.0)
  c.batch_size = 128
  c.num_train_steps = 500_000
  c.warmup_steps = 2500
  c.ema_decay = 0.9999
  c.optim = mlc.ConfigDict(dict(base_lr=0.0, lr=2e-4, schedule="warmup_constant", b1=0.99,
                                b2=0.999, eps=1e-8, weight_decay=0.03, decay_params="all",
                                min_lr=0.0, grad_clip_norm=0.0))
  c.diffusion = mlc.ConfigDict(dict(schedule="vpsde", class_dropout_prob=0.0))
  # For `decay_jax.cli.evaluate` on the run (decay_jax.evals.diffusion_probe); not run in training.
  c.evals = representation_evals()
  c.sample = mlc.ConfigDict(dict(mode="dpm", method="fast", num_steps=50, cfg_scale=0.0,
                                 grid_size=16, batch_size=64))
  # U-ViT's FID: DPM-Solver-fast, 50 model calls, unguided, EMA; its train.py evaluates 10,000
  # such samples at every checkpoint save, the paper's rows 50,000 (docs/uvit.md 6).
  c.evals.generation = generation_eval(c.sample, mode="dpm", method="fast", num_steps=50,
                                       cfg_scale=0.0)
  c.evals.generation.num_samples = 10_000
  c.picture_every_steps = 10_000
  c.checkpoint.every_steps = 5000
  c.checkpoint.keep_every_steps = 50_000
  c.log_every_steps = 100
  return c


def steps_for(config, num_train: int):
  """``(total optimiser steps, warmup steps)`` from epochs or ``num_train_steps``."""
  if config.num_train_steps <= 0 and not num_train:
    raise ValueError(f"data.dataset={config.data.dataset!r} reports no training-set size; set "
                     "num_train_steps > 0 instead of num_epochs")
  steps_per_epoch = (num_train or 0) / config.batch_size
  total = (config.num_train_steps if config.num_train_steps > 0
           else max(1, int(round(config.num_epochs * steps_per_epoch))))
  warmup = (config.warmup_steps if config.get("warmup_steps", -1) > 0
            else int(round(config.warmup_epochs * steps_per_epoch)))
  return total, min(warmup, total)


def parse_steps(value: str) -> Optional[Tuple[int, int]]:
  """``"START,COUNT"`` -> ``(START, COUNT)``; ``""`` -> None. One-line ValueError otherwise."""
  if not value:
    return None
  parts = str(value).split(",")
  if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[1]) < 1:
    raise validate_lib.not_allowed(
        "profile_steps", value, "it must be 'START,COUNT' (integers, START >= 0, COUNT >= 1), "
        "e.g. '10,3', or '' for no profile")
  return int(parts[0]), int(parts[1])


def validate(config) -> None:
  """One-line errors for the training fields; ``task``, the task's own sections and the model's
  fields are checked where they are built (``train.setup.check_config``: ``Task.check_config``,
  ``models.factory.build_model``)."""
  for name in ("batch_size", "accum_steps", "log_every_steps"):
    validate_lib.check_int(name, config[name])
  parse_steps(config.get("profile_steps", ""))
  if config.batch_size % config.accum_steps:
    raise validate_lib.not_allowed("batch_size", config.batch_size,
                                   f"it must be divisible by accum_steps={config.accum_steps}")
  if config.num_train_steps <= 0 and not config.num_epochs > 0:
    raise validate_lib.not_allowed("num_epochs", config.num_epochs,
                                   "it must be > 0 (or set num_train_steps > 0)")
  patch = config.model.preset.split("/")[-1]
  if patch.isdigit() and config.data.image_size % int(patch):
    raise validate_lib.not_allowed(
        "data.image_size", config.data.image_size,
        f"it must be a multiple of the patch size {patch} of model.preset={config.model.preset!r}")
  validate_lib.check_choice("optim.schedule", config.optim.schedule,
                            ("warmup_cosine", "warmup_constant", "constant"))
  validate_lib.check_choice("optim.decay_params", config.optim.get("decay_params", "matrices"),
                            ("matrices", "all"))
  if not (config.optim.get("lr") or config.optim.base_lr > 0):
    raise ValueError("optim.lr or optim.base_lr must be > 0")
  validate_lib.check_range("ema_decay", config.ema_decay, 0.0, 1.0, high_open=True)
  validate_lib.check_range("optim.weight_decay", config.optim.weight_decay, 0.0)


def override(config, **overrides):
  """Sets dotted fields in place, e.g. ``override(c, **{"model.alpha_min": 0.7})``; returns it.

  A field the config does not have is an error (as on the command line), not a new field.
  """
  for key, value in overrides.items():
    node = config
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    if last not in node:
      raise ValueError(f"{key}={value!r} is not allowed; the config has no field {key!r}")
    node[last] = value
  return config


def model_overrides(preset=None, dtype=None, remat=None) -> dict:
  """The dotted overrides of the command-line model flags that were given (``None``/empty: keep).

  ``bench`` and ``memory`` share these flags; ``validate`` checks the values afterwards.
  """
  given = {"model.preset": preset, "model.dtype": dtype, "model.remat_policy": remat}
  return {k: v for k, v in given.items() if v}

