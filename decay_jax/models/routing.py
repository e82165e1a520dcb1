"""Structured residual routing (mirror routing) for SiT, alone or with decayed shortcuts.

Spec: ``docs/routing.md`` (the paper "Structured Residual Connectivity Matters for
Diffusion Transformers" was not found; its method is known from a summary, so several choices below
are the spec's inferences, marked [INF] there and named here).

**The routing operator** (spec 3). For one sublayer ``s`` with candidates ``U = (u_0, ..., u_m)``,
each ``(N, T, d)``, and its only parameter ``w_s in R^d`` (zero-initialised), per token ``n``:

    z_k[n] = w_s^T RMSNorm(u_k[n]),  RMSNorm(u) = u / sqrt(mean_c u_c^2 + eps)  (no gain)
    pi_k[n] = softmax_k(z_k[n])        (over candidates, one weight for all channels)
    x~[n]   = sum_k pi_k[n] u_k[n]

``u_0 = x`` is the current stream [INF]; the others are sources ``x_0`` (patch + position
embedding) and ``x_i`` (output of encoder block ``i``, ``i = 1..K``, ``K = depth/2``). Each block
routes before both sublayers (two ``w``), and ``x~`` replaces ``x`` in the update (spec 3.2):
``x <- x~ + g(c) * f(mod(LN(x~)))``.

**Variants** (``SiT.residual_routing``; spec 4, decoder block ``j = 1..K``, encoder block ``i``):

==============  ===================================  ===========================  ============
variant         encoder sublayers                    decoder sublayers            new params
==============  ===================================  ===========================  ============
none            the official decayed SiT: decoder block j adds Linear(x_{K-j+1})  K(d^2+d)
plain           plain residual (the DiT baseline)    plain residual               0
static_skip     plain                                first ``x <- W_j [x; x_{K-j+1}] + b_j``  K(2d^2+d)
mirror          plain                                U = (x, x_{K-j+1})           2Kd
fused_mirror    U = (x, x_0, ..., x_{i-1})           U = (x, x_{K-j+1})           4Kd
fused_all       U = (x, x_0, ..., x_{i-1})           U = (x, x_0, ..., x_K)       4Kd
fused_first     U = (x, x_0, ..., x_{i-1})           U = (x, x_0)                 4Kd
fused_last      U = (x, x_0, ..., x_{i-1})           U = (x, x_K)                 4Kd
attnres         dense Attention Residuals (spec 6.1) over all sublayer outputs  2Dd + d
==============  ===================================  ===========================  ============

Mirror pairing: decoder block ``j`` reads ``x_{K-j+1}`` (``mirror_source``), the same pairing as the
official SiT's long skips. "First" is ``x_0`` (spec open item 2). The static skip is U-ViT's
concat + Linear with U-ViT's init (trunc-normal 0.02). ``attnres`` has no running stream: sublayer
``l`` reads ``h_l = sum_{i<l} pi_i v_i`` over ``v_0 = x_0`` and the gated outputs ``v_i`` of all
earlier sublayers, and the final layer reads a routed sum of all ``2D + 1`` values (one more ``w``).
At initialisation (adaLN-Zero gates 0) ``v_i = 0`` so ``h_l = x_0 / l``; LayerNorm inside every
sublayer and before the final layer hides this dilution (spec 5), so no correction is applied.

**Gate** (``SiT.routing_gate``, docs/routing.md "Routing added to a pretrained SiT"): each routed
sublayer mixes ``x~ = u_0 + g (R(U) - u_0)`` with a learned scalar ``g`` (``route_attn_gate``,
``route_mlp_gate``), zero-initialised, so a routed SiT started from a trained plain SiT computes the
plain SiT's function at step 0 (``models/routing_start.py``); ``g = 1`` is the ungated operator.

**Decay** (``SiT.routing_decay``, spec 10; only matters when ``alpha_min < 1``). Sublayers that route
nothing keep the decayed update ``alpha x + f(x)`` in every mode; routed sublayers use
  * ``after`` (A, default): ``x <- alpha x~ + f(x~)``. Decay stays what it is in the decayed SiT:
    each sublayer's coefficient multiplies everything the residual carries, so ``alpha_eff`` and the
    paper's ``alpha_min`` keep their meaning, and this is how the official decayed SiT treats its
    long skip (added to the stream, then decayed with it). It is a drop-in: the routed model with
    ``alpha_min = 1`` and the decayed model without routing are both special cases.
  * ``current`` (B): ``u_0 = alpha x``, then ``x <- x~ + f(x~)``: only the stream is decayed, the
    sources stay full-strength shortcuts; scores are unchanged (RMSNorm is scale-invariant).
  * ``encoder`` (C): every decoder identity coefficient is 1; the encoder decays as in (A).
  * ``null`` (D): a zero candidate with a fixed logit ``b = log(|U| (1 - alpha) / alpha)`` joins
    ``U`` (so ``1 - pi_null = alpha`` at ``w = 0``) and ``x <- x~ + f(x~)``; ``alpha = 1`` drops it.

**Memory-lean design.** Routing blocks are unrolled (a Python loop, parameters per block, not
scanned): a ``nn.scan`` would have to carry a growing buffer of sources, and autodiff would save a
copy of that buffer per iteration (``O(K^2)`` activations). Unrolled, the sources are the block
outputs themselves, each one array that the backward pass keeps anyway; the operator never stacks
candidates: it takes one dot product and one mean square per candidate and accumulates ``x~`` term
by term, so it adds ``O(|U| N T)`` scalars (logits, weights), not copies of ``(N, T, d)`` tensors.
The price is compile time growing with depth (docs/performance.md). ``none`` keeps the scanned blocks.

**Heat-map.** With ``'intermediates'`` mutable each routed sublayer sows its weights averaged over
tokens, ``(N, |U|)``; ``routing_weights`` collects them and ``plots.weight_heatmap`` draws rows = sublayers,
columns = candidates, one panel per time ``t``.
"""

from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from decay_jax import validate
from decay_jax.models import layers, stack
from decay_jax.models.blocks import modulate
from decay_jax.models.layers import Dtype
from decay_jax.models.residual import Residual

VARIANTS = ("none", "plain", "static_skip", "mirror", "fused_mirror", "fused_all", "fused_first",
            "fused_last", "attnres")
DECAY_MODES = ("after", "current", "encoder", "null")
ROUTED = ("mirror", "fused_mirror", "fused_all", "fused_first", "fused_last", "attnres")
GATED = ROUTED[:-1]  # the routed variants with a stream (attnres has none): routing_gate's
RMS_EPS = 1e-6
SUBLAYERS = ("attn", "mlp")


def mirror_source(j: int, half: int) -> int:
  """Index ``i`` of the source ``x_i`` that decoder block ``j`` (1-based, ``1..K``) reads: K - j + 1."""
  if not 1 <= j <= half:
    raise ValueError(f"decoder block j={j} is not allowed; it must be in 1..{half}")
  return half - j + 1


def block_sources(variant: str, depth: int) -> List[Optional[Tuple[int, ...]]]:
  """Per block (0-based, encoder then decoder): the source indices ``i`` of ``x_i`` that both of its
  sublayers route over besides the current stream, or ``None`` where the block does not route."""
  half = depth // 2
  out: List[Optional[Tuple[int, ...]]] = []
  for b in range(depth):
    if b < half:  # encoder block i = b + 1 sees (x_0, ..., x_{i-1}) [INF]
      out.append(tuple(range(b + 1)) if variant.startswith("fused") else None)
      continue
    j = b - half + 1
    out.append({"mirror": (mirror_source(j, half),), "fused_mirror": (mirror_source(j, half),),
                "fused_all": tuple(range(half + 1)), "fused_first": (0,),
                "fused_last": (half,)}.get(variant))
  return out


def null_logit(alpha: float, num_candidates: int) -> Optional[float]:
  """Fixed logit of the zero candidate (decay mode 'null') with ``1 - pi_null = alpha`` at w = 0."""
  if alpha >= 1.0:
    return None
  return math.log(num_candidates * (1.0 - alpha) / alpha)


def route(w, candidates: Sequence[jax.Array], null: Optional[float] = None, eps: float = RMS_EPS):
  """The routing operator: ``(x~ (N, T, d), pi (|U|, N, T))`` for candidates ``[(N, T, d), ...]``.

  ``z_k = w^T u_k / sqrt(mean(u_k^2) + eps)``, ``pi = softmax_k z``, ``x~ = sum_k pi_k u_k``, in
  float32. ``null`` appends a zero candidate with that fixed logit (its weight is in ``pi``). No
  stack of candidates is built: one dot product and one mean square per candidate.
  """
  w = w.astype(jnp.float32)
  cands = [u.astype(jnp.float32) for u in candidates]
  logits = [(u @ w) * jax.lax.rsqrt(jnp.mean(jnp.square(u), axis=-1) + eps) for u in cands]
  if null is not None:
    logits.append(jnp.full_like(logits[0], null))
  pi = jax.nn.softmax(jnp.stack(logits), axis=0)
  out = functools.reduce(lambda acc, k: acc + pi[k][..., None] * cands[k], range(1, len(cands)),
                         pi[0][..., None] * cands[0])
  return out, pi


class RoutedSiTBlock(nn.Module):
  """adaLN-Zero SiT block (same sublayers and parameter names as ``blocks.SiTBlock``) with routing.

  ``__call__(x, alpha, c, sources, nulls)``: ``x (N, T, d)`` float32 stream, ``alpha (2,)`` identity
  coefficients, ``c (N, d)``, ``sources`` a tuple of ``(N, T, d)``, ``nulls`` the two null logits or
  ``None``. ``routed``: ``x~ = R([x, *sources])`` before both sublayers (``route_attn``,
  ``route_mlp``: ``(d,)`` each; with ``gate``, ``x~ = x + g (R - x)`` with scalars
  ``route_attn_gate``, ``route_mlp_gate`` starting at 0). ``skip``: U-ViT's
  ``x <- Linear([x; sources[0]])`` first.
  ``attnres``: ``x`` is unused, ``sources`` are the values ``v_0..v_{l-1}``, and the block returns
  its two new values ``(v_attn, v_mlp)`` (spec 6.1); otherwise it returns the new stream
  ``(N, T, d)``. Each sublayer's update is ``stack.sublayer``: ``x <- a x~ + s f(x~)``, with
  ``a = 1`` where the decay mode already decayed inside the routing.
  """
  num_heads: int
  mlp_ratio: float = 4.0
  residual: Residual = Residual()
  dtype: Dtype = jnp.float32
  attention_impl: Optional[str] = None
  routed: bool = False
  skip: bool = False
  attnres: bool = False
  decay: str = "after"
  gate: bool = False

  def _route(self, i: int, cands, null):
    w = self.param(f"route_{SUBLAYERS[i]}", nn.initializers.zeros, (cands[0].shape[-1],),
                   jnp.float32)
    out, pi = route(w, cands, null)
    if self.gate:  # x~ = u_0 + g (R(U) - u_0); the sown weights are the effective mix
      g = self.param(f"route_{SUBLAYERS[i]}_gate", nn.initializers.zeros, (), jnp.float32)
      u0 = cands[0].astype(jnp.float32)
      out = u0 + g * (out - u0)
      pi = (g * pi).at[0].add(1.0 - g)
    if self.is_mutable_collection("intermediates"):
      self.sow("intermediates", f"route_{SUBLAYERS[i]}", pi.mean(axis=-1).T)  # (N, |U|)
    return out

  def _branch(self, i: int, mod):
    """Sublayer ``i``'s norm and gated branch ``h -> g_i * f_i(mod(h))`` on the normalised
    input (before the residual's ``branch_scale``)."""
    shift, scale, gate = mod[3 * i], mod[3 * i + 1], mod[3 * i + 2]
    norm = layers.layer_norm(f"norm{i + 1}", affine=False)

    def f(h):
      if i == 0:
        h = layers.Attention(self.num_heads, self.dtype, implementation=self.attention_impl,
                             name="attn")(modulate(h, shift, scale))
      else:
        h = layers.Mlp(int(h.shape[-1] * self.mlp_ratio), approximate_gelu=True,
                       dtype=self.dtype, name="mlp")(modulate(h, shift, scale))
      return gate[:, None, :] * h
    return norm, f

  @nn.compact
  def __call__(self, x, alpha, c, sources=(), nulls=(None, None)):
    dim = c.shape[-1]
    mod = jnp.split(nn.Dense(6 * dim, dtype=self.dtype, kernel_init=layers.zeros,
                             bias_init=layers.zeros, name="adaLN_modulation")(nn.silu(c))
                    .astype(jnp.float32), 6, axis=-1)
    if self.attnres:
      values = list(sources)
      for i in range(2):
        h = self._route(i, values, None)
        norm, f = self._branch(i, mod)
        values.append(stack.scaled_branch(self.residual, f(norm(h)).astype(jnp.float32)))
      return values[-2], values[-1]
    if self.skip:
      x = nn.Dense(dim, dtype=self.dtype, kernel_init=nn.initializers.truncated_normal(0.02),
                   bias_init=layers.zeros, name="skip")(
                       jnp.concatenate([x, sources[0]], axis=-1)).astype(jnp.float32)
    for i in range(2):
      a = alpha[i]
      if self.routed:
        x = self._route(i, [a * x if self.decay == "current" else x, *sources], nulls[i])
        if self.decay in ("current", "null"):
          a = 1.0  # the decay already acted inside the routing
      norm, f = self._branch(i, mod)
      x = stack.sublayer(self, self.residual, i, x, stack.BlockInputs((a, a)), norm, f)
    return x


class RoutedTrunk(nn.Module):
  """The ``depth`` blocks of a SiT with ``residual_routing`` other than 'none', unrolled.

  ``__call__(x0, alpha, c)``: ``x0 (N, T, d)`` embedded tokens, ``alpha (depth, 2)`` (the model's
  ``residual.coefficients``), ``c (N, d)``; returns the stream ``(N, T, d)`` that enters the final
  layer, or with ``capture > 0`` (REPA's aligned block, 1-based; not 'attnres') the pair of it and
  the stream after block ``capture``. ``residual`` is the blocks' update; its constant schedule
  ``residual.shortcuts(depth)`` also gives decay mode 'null' its logit priors.
  """
  depth: int
  num_heads: int
  mlp_ratio: float = 4.0
  variant: str = "mirror"
  decay: str = "after"
  residual: Residual = Residual()
  dtype: Dtype = jnp.float32
  attention_impl: Optional[str] = None
  remat_policy: str = "none"
  gate: bool = False
  capture: int = 0

  @nn.compact
  def __call__(self, x0, alpha, c):
    block = layers.remat(RoutedSiTBlock, self.remat_policy)
    common = dict(num_heads=self.num_heads, mlp_ratio=self.mlp_ratio, residual=self.residual,
                  dtype=self.dtype, attention_impl=self.attention_impl, decay=self.decay,
                  gate=self.gate)
    if self.variant == "attnres":
      values = [x0]
      for b in range(self.depth):
        values += block(**common, attnres=True, name=f"block_{b:02d}")(
            None, None, c, tuple(values))
      w = self.param("route_final", nn.initializers.zeros, (x0.shape[-1],), jnp.float32)
      out, pi = route(w, values)
      if self.is_mutable_collection("intermediates"):
        self.sow("intermediates", "route_final", pi.mean(axis=-1).T)
      return out
    half = self.depth // 2
    plan = block_sources(self.variant, self.depth)
    alphas = self.residual.shortcuts(self.depth).alphas  # float64 (depth, 2), for 'null' priors
    xs, x, captured = [x0], x0, None
    for b, srcs in enumerate(plan):
      dec = b >= half
      # (C) frees the identities of routing decoder blocks only; the others keep alpha x + f(x).
      a = (jnp.ones((2,), jnp.float32) if (dec and self.decay == "encoder" and srcs is not None)
           else alpha[b])
      nulls = (None, None)
      if srcs is not None and self.decay == "null":
        nulls = tuple(null_logit(float(alphas[b][i]), 1 + len(srcs)) for i in range(2))
      skip = self.variant == "static_skip" and dec
      sources = (tuple(xs[i] for i in srcs) if srcs is not None
                 else (xs[mirror_source(b - half + 1, half)],) if skip else ())
      name = f"enc_{b:02d}" if not dec else f"dec_{b - half:02d}"
      x = block(**common, routed=srcs is not None, skip=skip, name=name)(x, a, c, sources, nulls)
      captured = x if b + 1 == self.capture else captured
      if not dec:
        xs.append(x)
    return (x, captured) if self.capture else x


# ------------------------------------------------------------------------------------------------
# Validation, parameter and FLOP accounting.
# ------------------------------------------------------------------------------------------------

def check_fields(m) -> None:
  """One-line errors for the routing fields of a SiT ``m``."""
  validate.check_choice("residual_routing", m.residual_routing, VARIANTS)
  validate.check_choice("routing_decay", m.routing_decay, DECAY_MODES)
  res = m.residual
  if m.residual_routing == "attnres" and (res.alpha_min != 1.0 or res.shortcut_form != "decay"):
    raise ValueError(f"residual_routing='attnres' has no identity shortcut to decay; it needs "
                     f"alpha_min=1 and shortcut_form='decay' (got {res.alpha_min}, "
                     f"{res.shortcut_form!r})")
  if m.residual_routing != "none" and res.branch_gain != "none":
    raise ValueError(f"branch_gain={res.branch_gain!r} is not allowed with residual_routing="
                     f"{m.residual_routing!r}; routed blocks have no branch gains (use "
                     "residual_routing='none')")
  if m.residual_routing != "none" and res.norm_position != "pre":
    raise ValueError(f"norm_position={res.norm_position!r} is not allowed with residual_routing="
                     f"{m.residual_routing!r}; routed blocks are pre-norm (use 'pre')")
  if m.residual_routing != "none" and res.hyper:
    raise ValueError(f"hyper_connections={res.hyper_connections!r} is not allowed with "
                     f"residual_routing={m.residual_routing!r}; routed blocks carry one stream "
                     "(use 'none')")
  if m.residual_routing != "none" and res.drop_path:
    raise ValueError(f"drop_path={res.drop_path!r} is not allowed with residual_routing="
                     f"{m.residual_routing!r}; routed blocks have no stochastic depth (use 0)")
  if m.routing_gate and m.residual_routing not in GATED:
    raise ValueError(f"routing_gate=True is not allowed with residual_routing="
                     f"{m.residual_routing!r}; it gates the routed stream of "
                     f"{', '.join(GATED)}")
  if m.routing_decay == "null" and res.shortcut_form != "decay":
    raise ValueError(f"routing_decay='null' needs constant coefficients: shortcut_form='decay' "
                     f"(got {res.shortcut_form!r})")


def candidate_counts(variant: str, depth: int) -> List[int]:
  """``|U|`` of every routed operator (null candidates not counted), in model order."""
  if variant == "attnres":
    return list(range(1, 2 * depth + 1)) + [2 * depth + 1]
  return [1 + len(s) for s in block_sources(variant, depth) if s is not None for _ in range(2)]


def extra_params(variant: str, depth: int, dim: int, gate: bool = False) -> int:
  """New parameters against the plain DiT (spec 7): 2Kd, 4Kd, K(2d^2 + d), 2Dd + d, K(d^2 + d);
  ``gate`` (``SiT.routing_gate``) adds one scalar per routed sublayer."""
  half = depth // 2
  if variant == "none":
    return half * (dim * dim + dim)
  if variant == "static_skip":
    return half * (2 * dim * dim + dim)
  if variant == "attnres":
    return 2 * depth * dim + dim
  return len(candidate_counts(variant, depth)) * (dim + int(gate))


def long_range_macs(m) -> float:
  """Forward multiply-adds per example of the long-range connections of SiT ``m``: the skip
  Linears ('none': d^2, 'static_skip': 2 d^2 per token and decoder block) or the routing operators
  (2 |U| d per token and operator: the score dot products and the weighted sum; RMS and softmax are
  norms, which ``decay_jax.models.flops`` does not count; a gate adds ``d`` per token)."""
  t, d, half = m.grid ** 2, m.dim, m.depth // 2
  if m.residual_routing == "none":
    return half * t * d * d
  if m.residual_routing == "static_skip":
    return half * t * 2 * d * d
  return sum((2 * n + int(m.routing_gate)) * t * d
             for n in candidate_counts(m.residual_routing, m.depth))


# ------------------------------------------------------------------------------------------------
# Routing weights and their heat-map.
# ------------------------------------------------------------------------------------------------

def sublayer_rows(variant: str, depth: int, decay: str = "after"):
  """``[(path, sow name, row label, candidate labels)]`` of every routed operator, model order."""
  if variant == "attnres":
    rows = [((f"block_{l // 2:02d}",), f"route_{SUBLAYERS[l % 2]}",
             f"b{l // 2 + 1} {SUBLAYERS[l % 2]}", [f"v{i}" for i in range(l + 1)])
            for l in range(2 * depth)]
    return rows + [((), "route_final", "final", [f"v{i}" for i in range(2 * depth + 1)])]
  half, rows = depth // 2, []
  for b, srcs in enumerate(block_sources(variant, depth)):
    if srcs is None:
      continue
    dec = b >= half
    name = f"dec_{b - half:02d}" if dec else f"enc_{b:02d}"
    label = f"dec{b - half + 1}" if dec else f"enc{b + 1}"
    for s in SUBLAYERS:
      cols = ["x"] + [f"x{i}" for i in srcs] + (["null"] if decay == "null" else [])
      rows.append(((name,), f"route_{s}", f"{label} {s}", cols))
  return rows


def routing_weights(model, params, x, t, y) -> List[Tuple[str, List[str], np.ndarray]]:
  """Mean routing weights of every routed sublayer for inputs ``(x, t, y)``: ``[(row label,
  candidate labels, weights (|U|,))]`` (a null candidate that is absent at alpha = 1 weighs 0)."""
  _, state = model.apply({"params": params}, x, t, y, mutable=["intermediates"])
  return weights_from_state(model, state)


def weights_from_state(model, state) -> List[Tuple[str, List[str], np.ndarray]]:
  """``routing_weights`` from the mutated ``{'intermediates': ...}`` of a forward pass."""
  inter = state["intermediates"]["trunk"]
  out = []
  for path, name, label, cols in sublayer_rows(model.residual_routing, model.depth,
                                               model.routing_decay):
    node = inter
    for p in path:
      node = node[p]
    w = np.asarray(node[name][0]).mean(axis=0)
    out.append((label, cols, np.pad(w, (0, len(cols) - w.shape[0]))))
  return out
