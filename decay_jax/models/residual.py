"""The residual specification: how every block of a model adds its branch to the stream.

Every transformer block here has two sublayers (attention, MLP). Sublayer ``s`` of block ``l``
(``s = 0`` attention, ``1`` MLP) updates the float32 residual stream ``x (N, T, C)`` as::

    x <- alpha_{l,s} * x + branch_scale * f_{l,s}(x)

``alpha (depth, 2)`` are the identity coefficients (``decay_jax.models.schedules``: a linear or
cosine decay from 1 to ``alpha_min`` over the sublayers or blocks, the paper's
``x_{l+1} = alpha_l x_l + f(x_l)``) and ``branch_scale`` a Python float (1, or sqrt(1/2) for the
``sqrt_half_*`` controls). ``alpha_min = 1`` with ``shortcut_form='decay'`` is the standard
residual network ``x + f(x)``.

A trained gain on each branch (``branch_gain``) replaces ``f`` by ``g * f``:

  * ``'layerscale'`` (CaiT, Touvron et al. 2021): ``g = diag(lambda)``, one trainable ``lambda (C,)``
    per sublayer, initialised to ``gain_init`` or, by default, CaiT's rule over the model's depth:
    0.1 up to depth 18, 1e-5 up to 24, 1e-6 deeper (the paper gives 18, 24 and "deeper"; depths
    19-23 take 1e-5 here);
  * ``'rezero'`` (ReZero, Bachlechner et al. 2020; SkipInit, De & Smith 2020): ``g = a``, one
    trainable scalar per sublayer, initialised to ``gain_init`` (default 0). The blocks keep their
    pre-norm unless ``norm_position='none'`` (SkipInit's arrangement: a gain per branch);
  * ``'rezero_block'`` (ReZero as its paper and code have it: ``RZTXEncoderLayer.resweight``):
    ``g = a``, one trainable scalar per block shared by its two sublayers (parameter ``gain``),
    initialised to ``gain_init`` (default 0); with ``norm_position='none'`` the block is ReZero's,
    ``x <- x + a Attn(x); x <- x + a MLP(x)``.

Gains are parameters ``gain_attn`` and ``gain_mlp`` of each block (``branch``). They combine with
any ``alpha`` schedule (``alpha_min = 1`` gives the published forms).

Where the sublayer's norm sits (``norm_position``):

  * ``'pre'`` (the models' own): ``x <- alpha x + g f(LN(x))``;
  * ``'post'``: ``x <- LN(alpha x + g f(x))``;
  * ``'deepnorm'`` (DeepNet, Wang et al. 2022): post-norm with the identity up-weighted by
    ``a = (2N)^(1/4)``, ``x <- LN(a alpha x + g f(x))``, and the init of the FFN (``fc1``,
    ``fc2``), the value third of ``qkv`` and ``attn.proj`` scaled by ``b = (8N)^(-1/4)``, for a
    model of ``N`` blocks (the encoder-only constants);
  * ``'none'`` (SkipInit, De & Smith 2020; ReZero's paper): no norm in the block,
    ``x <- alpha x + g f(x)``; the sublayer's norm is never applied, so the block has no norm
    parameters. Meant with a gain that starts at 0 (``branch_gain='rezero'``: SkipInit, one
    scalar per branch), which keeps the unnormalised stack the identity at init; the model's own
    norms outside the blocks (MAE's encoder ``norm``, SiT's ``norm_final``) stay.

Stochastic depth (``drop_path``, timm's rule: rate ``linspace(0, drop_path, N)[l]`` in block
``l``) drops each example's branch with that probability and divides the kept ones by the keep
probability; only where the caller passes the uniform draws (training; ``drop_path_rates``).

``Residual`` is the one object that models and blocks take for this (``MaskedAutoencoder``,
``SiT``, ``ViTClassifier`` and ``UViT`` each have one field ``residual``; the blocks a keyword
``residual``). It holds the fields (the names of ``model.json`` and of the config's ``model``
section, which both stay flat: ``fields()`` / ``from_fields``), checks them when built, and is
the one place that

  * computes the coefficients of a stack of ``depth`` blocks (``shortcuts(depth)``),
  * creates them for a module (``coefficients(module, depth)``): a constant, or the trainable
    parameter ``alpha (depth, 2)`` initialised from the schedule (``shortcut_form='learnable'``),
  * applies the update (``update(x, alpha, branch)``; its sum is in ``x``'s dtype, float32).

A new residual form (a new field, or a new value of one) is added here only (a new
``shortcut_form`` value also to ``schedules.FORMS``): blocks and models reach these methods only
through ``models/stack.py`` (``sublayer`` does read -> branch -> gain -> add), so what a form
changes of them reaches every block; configs, ``model.json`` and the factory take the fields from
``fields()`` / ``from_fields``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional, Tuple

import jax.numpy as jnp
import numpy as np

from decay_jax import validate
from decay_jax.models import hyper, schedules


@dataclasses.dataclass(frozen=True)
class Residual:
  """The residual update of a model's blocks (see the module docstring for the equation).

  Attributes:
    alpha_min: the last identity coefficient of the schedule, in (0, 1]; 1 is the standard
      residual network (the paper's ``alpha_min``; the official MAE's ``min_decay``, SiT's
      ``min_sigma``).
    schedule_convention: 'sublayer' (official: one coefficient per sublayer, ``2 depth`` in all)
      or 'block' (the paper's equation: ``(alpha_l, 1)`` per block).
    schedule_shape: 'linear' or 'cosine' (same end points).
    shortcut_form: one of ``schedules.FORMS``: 'decay' (the method), 'learnable' (``alpha`` a
      trained parameter), 'sqrt_half_both' / 'sqrt_half_f' (no schedule), 'attn_only' /
      'mlp_only' (the schedule on one sublayer's identity).
    branch_gain: 'none', 'layerscale', 'rezero' or 'rezero_block': a trained gain on every
      branch, or one per block (module docstring).
    gain_init: the gains' initial value; -1 (default) is the form's own (CaiT's rule, or 0).
    norm_position: 'pre', 'post', 'deepnorm' or 'none': where each sublayer's LayerNorm sits,
      if anywhere (module docstring).
    drop_path: stochastic depth, the largest per-block drop rate in [0, 1); 0 is off.
    hyper_connections: 'none', 'static' or 'dynamic': ``hyper_rate`` residual streams per token
      (Hyper-Connections, ``models/hyper.py``; MAE's encoder and SiT).
    hyper_rate: the number of streams ``n`` of hyper-connections (the paper's expansion rate).
    model_depth: not a flat field: the model's block count, set by ``at_depth`` where a form needs
      it (DeepNorm's constants).

  Built specs are checked (one-line ``ValueError`` naming the field), hashable and immutable, so a
  Flax module can hold one as a field.
  """
  alpha_min: float = 1.0
  schedule_convention: str = "sublayer"
  schedule_shape: str = "linear"
  shortcut_form: str = "decay"
  branch_gain: str = "none"
  gain_init: float = -1.0
  norm_position: str = "pre"
  drop_path: float = 0.0
  hyper_connections: str = "none"
  hyper_rate: int = 4
  model_depth: int = dataclasses.field(default=0, metadata={"flat": False})

  def __post_init__(self):
    self.check()

  def check(self) -> None:
    """One-line errors for bad fields (``alpha_min=0.0 is not allowed; ...``)."""
    validate.check_range("alpha_min", self.alpha_min, 0.0, 1.0, low_open=True)
    validate.check_choice("schedule_convention", self.schedule_convention, schedules.CONVENTIONS)
    validate.check_choice("schedule_shape", self.schedule_shape, schedules.SHAPES)
    validate.check_choice("shortcut_form", self.shortcut_form, schedules.FORMS)
    validate.check_choice("branch_gain", self.branch_gain, BRANCH_GAINS)
    if self.gain_init != -1.0 and not (validate.is_number(self.gain_init)
                                       and self.gain_init >= 0.0):
      raise validate.not_allowed("gain_init", self.gain_init,
                                 "it must be >= 0, or -1 for the form's own initial value")
    validate.check_choice("norm_position", self.norm_position, NORM_POSITIONS)
    validate.check_range("drop_path", self.drop_path, 0.0, 1.0, high_open=True)
    validate.check_choice("hyper_connections", self.hyper_connections, hyper.FORMS)
    validate.check_int("hyper_rate", self.hyper_rate, minimum=1)
    if self.hyper and self.branch_gain != "none":
      raise validate.not_allowed("branch_gain", self.branch_gain, "hyper-connections take no "
                                 "branch gains (use 'none', or hyper_connections='none')")
    if self.hyper and self.norm_position != "pre":
      raise validate.not_allowed("norm_position", self.norm_position, "hyper-connections are "
                                 "pre-norm (use 'pre', or hyper_connections='none')")

  # ----- flat fields (model.json, configs) --------------------------------------------------------
  def fields(self) -> dict:
    """The fields as a flat dict, ``{'alpha_min': ..., 'schedule_convention': ..., ...}``."""
    return {name: getattr(self, name) for name in NAMES}

  @classmethod
  def from_fields(cls, mapping: Mapping[str, Any],
                  base: Optional["Residual"] = None) -> Tuple["Residual", dict]:
    """``(spec, rest)``: the spec read off ``mapping`` and the entries that are not its fields.

    The spec is ``base`` (default ``Residual()``, the model's own default where a model reads it)
    with the flat fields of ``mapping`` (``alpha_min=...``) set; a ``residual`` entry that is a
    ``Residual`` replaces ``base``, one that is a dict of fields is read as flat fields. An entry
    ``residual`` of another type is left in ``rest`` for the model's check to name.
    """
    rest = dict(mapping)
    spec = base if base is not None else cls()
    nested = rest.pop("residual", None)
    flat = {}
    if isinstance(nested, Residual):
      spec = nested
    elif isinstance(nested, Mapping):
      flat.update(nested)
    elif nested is not None:
      rest["residual"] = nested
    flat.update({name: rest.pop(name) for name in NAMES if name in rest})
    unknown = sorted(set(flat) - set(NAMES))
    if unknown:
      raise ValueError(f"unknown residual field(s) {unknown}; allowed: {list(NAMES)}")
    return (dataclasses.replace(spec, **flat) if flat else spec), rest

  # ----- the coefficients ------------------------------------------------------------------------
  def shortcuts(self, depth: int) -> schedules.Shortcuts:
    """The coefficients of ``depth`` blocks: ``alphas (depth, 2)`` float64 (attention, MLP
    identity per block), ``branch_scale`` and ``learnable`` (cached in ``schedules``)."""
    return schedules.shortcuts(depth, self.alpha_min, self.schedule_convention,
                               self.schedule_shape, self.shortcut_form)

  @property
  def branch_scale(self) -> float:
    """The factor on every branch ``f(x)``: a Python float, so it is part of the program."""
    return schedules.branch_scale(self.shortcut_form)

  def coefficients(self, module, depth: int):
    """The identity coefficients ``alpha (depth, 2)`` float32 of ``module``'s ``depth`` blocks.

    A constant of the program, or (``shortcut_form='learnable'``) ``module``'s trainable
    parameter ``alpha``, initialised from the schedule. Call it from ``module``'s ``setup`` or a
    compact method; it is the only place that creates ``alpha``.
    """
    sc = self.shortcuts(depth)
    if sc.learnable:
      return module.param("alpha", lambda _: jnp.asarray(sc.alphas, jnp.float32))
    return jnp.asarray(sc.alphas, jnp.float32)

  # ----- the branch gains -------------------------------------------------------------------------
  def at_depth(self, depth: int) -> "Residual":
    """This spec resolved for a model of ``depth`` blocks (models pass it to their blocks):
    ``gain_init`` -1 becomes CaiT's LayerScale rule or ReZero's 0, and DeepNorm records ``depth``
    (``model_depth``) for its constants. Unchanged where nothing depends on the depth."""
    spec = self
    if self.branch_gain != "none" and self.gain_init == -1.0:
      init = 0.0 if self.branch_gain in ZERO_GAINS else cait_init(depth)
      spec = dataclasses.replace(spec, gain_init=init)
    if self.norm_position == "deepnorm":
      spec = dataclasses.replace(spec, model_depth=int(depth))
    return spec

  def branch(self, module, name: str, f):
    """``g * branch_scale * f(x)`` for a branch ``f (N, T, C)`` of ``module``: ``g`` its trainable
    gain ``gain_<name>`` (``(C,)`` LayerScale, ``()`` ReZero; created here, the only place), the
    block's one ``gain`` (``'rezero_block'``: made by the first sublayer, read by the second),
    or 1 without ``branch_gain``. In the branch's dtype."""
    out = self.scale_branch(f)
    if self.branch_gain == "none":
      return out
    if self.gain_init == -1.0:
      raise ValueError("branch_gain needs the model's depth: pass residual.at_depth(depth) to "
                       "the blocks")
    shape = (f.shape[-1],) if self.branch_gain == "layerscale" else ()
    init = float(self.gain_init)
    name = "gain" if self.branch_gain == "rezero_block" else f"gain_{name}"
    if module.has_variable("params", name):  # the block's second sublayer shares the first's
      gain = module.get_variable("params", name)
    else:
      gain = module.param(name, lambda _: jnp.full(shape, init, jnp.float32))
    return out * gain.astype(out.dtype)

  @property
  def zero_branch_init(self) -> bool:
    """Whether blocks may start their branch at zero (the official MAE's zero-initialised
    ``attn.proj`` / ``mlp.fc2``, DiT's adaLN-Zero, U-ViT's ``zero_init_branches``). Not with
    ReZero: its gain starts at 0 and a zero branch as well would leave both without a gradient
    (``d/dg`` is ``f``, ``d/df`` is ``g``), so the blocks start the branch at their usual random
    init instead, as ReZero does. Not with DeepNorm either: its init is the branch's random init
    scaled by ``beta`` (``scaled_init``), which a zero layer would void."""
    return self.branch_gain not in ZERO_GAINS and self.norm_position != "deepnorm"

  # ----- the norm placement and DeepNorm ---------------------------------------------------------
  def branch_input(self, norm, x):
    """What a sublayer's branch reads: ``norm(x)`` with pre-norm, ``x`` itself with post-norm
    (``norm`` is then applied to the sum, in ``add``) and without a norm."""
    return norm(x) if self.norm_position == "pre" else x

  @property
  def deepnorm_gains(self) -> Tuple[float, float]:
    """``(alpha, beta)``: DeepNorm's ``((2N)^(1/4), (8N)^(-1/4))`` for the ``N = model_depth``
    blocks (``deepnorm_constants(N)``), ``(1, 1)`` in the other forms."""
    if self.norm_position != "deepnorm":
      return 1.0, 1.0
    if self.model_depth < 1:
      raise ValueError("norm_position='deepnorm' needs the model's depth: pass "
                       "residual.at_depth(depth) to the blocks")
    return deepnorm_constants(self.model_depth)

  def shortcut(self, alpha):
    """The identity coefficient of a sublayer: ``alpha``, times DeepNorm's ``(2N)^(1/4)``."""
    up = self.deepnorm_gains[0]
    return alpha if up == 1.0 else up * alpha

  def scaled_init(self, init, value_only: bool = False):
    """A branch layer's initialiser: ``init``, or with DeepNorm ``beta * init`` (the Xavier init
    with gain ``beta`` where ``init`` is Xavier's). ``value_only``: only the value third
    ``[..., 2C:]`` of a fused qkv kernel ``(C, 3C)``, laid out ``[q | k | v]``."""
    beta = self.deepnorm_gains[1]
    if beta == 1.0:
      return init

    def scaled(key, shape, dtype=jnp.float32):
      w = init(key, shape, dtype)
      if not value_only:
        return beta * w
      return w.at[..., 2 * (shape[-1] // 3):].multiply(beta)
    return scaled

  def add(self, x, alpha, branch, norm=None, connections=None):
    """``alpha * x + branch`` (pre-norm, no norm), or ``norm(shortcut(alpha) * x + branch)``
    (post-norm and DeepNorm: ``norm`` the sublayer's LayerNorm), with the branch (already scaled,
    ``branch``) cast to ``x``'s dtype. With ``connections`` (``read``'s) the hyper-connection
    write ``alpha A_r^T H + beta branch``."""
    if connections is not None:
      return hyper.write(x, alpha, branch, connections)
    out = self.shortcut(alpha) * x + branch.astype(x.dtype)
    if self.norm_position in ("pre", "none"):
      return out
    if norm is None:
      raise ValueError(f"norm_position={self.norm_position!r} needs the sublayer's norm in add")
    return norm(out)

  # ----- hyper-connections (models/hyper.py) -----------------------------------------------------
  @property
  def hyper(self) -> bool:
    """Whether the blocks carry ``hyper_rate`` streams ``H (N, T, n, C)`` (hyper-connections)."""
    return self.hyper_connections != "none"

  def hyper_weights(self, module, depth: int, dim: int):
    """The hyper-connection parameters ``hyper_*`` of ``module``'s ``depth`` blocks, stacked
    ``(depth, 2, ...)`` (created here, from the model's ``setup``), or None without them."""
    if not self.hyper:
      return None
    return hyper.weights(module, depth, dim, self.hyper_rate,
                         self.hyper_connections == "dynamic")

  def expand(self, x):
    """The model's stream as the blocks carry it: ``x``, or ``n`` copies ``(N, T, n, C)``."""
    return hyper.expand(x, self.hyper_rate) if self.hyper else x

  def reduce(self, x):
    """A block's output as the model reads it (skips, features): ``x``, or the streams' sum."""
    return hyper.reduce(x) if self.hyper else x

  def inject(self, x, v):
    """``x + v`` for a side input ``v (N, T, C)`` (the long skips of SiT, and of U-ViT's 'add'):
    added to every stream."""
    return x + (v[..., None, :] if self.hyper else v).astype(x.dtype)

  def read(self, x, weights, s: int):
    """``(input, connections)`` of sublayer ``s``: ``(x, None)``, or with hyper-connections the
    weighted sum ``A_m^T H`` and what ``add`` needs (``weights``: the block's ``(2, ...)``)."""
    if weights is None:
      return x, None
    return hyper.read(x, hyper.sublayer(weights, s))

  # ----- stochastic depth -------------------------------------------------------------------------
  def drop_path_rates(self, depth: int):
    """timm's per-block drop rates, float32 ``linspace(0, drop_path, depth)``: block 0 never
    drops."""
    return np.linspace(0.0, self.drop_path, depth, dtype=np.float64).astype(np.float32)

  # ----- the update ------------------------------------------------------------------------------
  def scale_branch(self, branch):
    """``branch_scale * f(x)`` in the branch's own dtype (unchanged where the scale is 1)."""
    if self.branch_scale != 1.0:
      return self.branch_scale * branch
    return branch


# the flat keys, in order (``model_depth`` is derived, not one of them)
NAMES = tuple(f.name for f in dataclasses.fields(Residual) if f.metadata.get("flat", True))
BRANCH_GAINS = ("none", "layerscale", "rezero", "rezero_block")
ZERO_GAINS = ("rezero", "rezero_block")  # gains that start at 0
NORM_POSITIONS = ("pre", "post", "deepnorm", "none")


def deepnorm_constants(depth: int) -> Tuple[float, float]:
  """DeepNorm's ``(alpha, beta) = ((2N)^(1/4), (8N)^(-1/4))`` for an encoder-only model of ``N``
  blocks (Wang et al. 2022; torchscale ``EncoderLayer.alpha`` and ``Encoder``'s ``init_scale``)."""
  return (2.0 * depth) ** 0.25, (8.0 * depth) ** -0.25


def cait_init(depth: int) -> float:
  """CaiT's LayerScale initial value for ``depth`` blocks (Touvron et al. 2021, section 3)."""
  if depth <= 18:
    return 0.1
  return 1e-5 if depth <= 24 else 1e-6


class HasResidual:
  """Mixin of the models with a ``residual: Residual`` field.

  Read-only flat views for callers that predate the spec: one per field of ``Residual``
  (``alpha_min``, ``schedule_convention``, ...) and ``shortcuts`` (the coefficients of the model's
  ``depth`` blocks). The constructor also takes the flat names as keywords, folded into the
  ``residual`` field (``SiT(alpha_min=0.7)`` is ``SiT(residual=Residual(alpha_min=0.7))``, the
  other fields from the ``residual`` given or the class default), as ``model.json`` and the
  configs spell them.
  """

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)  # Flax makes the class a dataclass with its __init__ here
    cls.__init__ = _accepting_flat_fields(cls.__init__)

  @property
  def shortcuts(self) -> schedules.Shortcuts:
    return self.residual.shortcuts(self.depth)

  def block_slot(self, b: int):
    """``(path, index)`` of block ``b``'s parameters in the model's ``params``: a subtree and its
    slice along the scanned layer axis (None: the subtree is the block's own). Default: the
    scanned ``blocks`` of the ViTs (MAE encoder, classifier); SiT and U-ViT say theirs."""
    return ("blocks",), b


for _name in NAMES:  # a read-only view of every spec field, new ones included
  setattr(HasResidual, _name, property(lambda self, _n=_name: getattr(self.residual, _n)))


def _accepting_flat_fields(init):
  @functools.wraps(init)
  def __init__(self, *args, **kwargs):
    if any(name in kwargs for name in NAMES) or isinstance(kwargs.get("residual"), Mapping):
      default = type(self).__dataclass_fields__["residual"].default
      spec, kwargs = Residual.from_fields(kwargs, default)
      kwargs["residual"] = spec
    init(self, *args, **kwargs)
  return __init__


def check_field(m) -> None:
  """A model's ``residual`` must be a ``Residual`` (its fields were checked when it was built)."""
  if not isinstance(m.residual, Residual):
    raise validate.not_allowed("residual", m.residual,
                               "it must be a decay_jax.models.residual.Residual")
