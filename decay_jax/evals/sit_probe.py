"""Representations of a SiT velocity network for the frozen-feature evaluators (CKA, probes).

A SiT has no clean-image encoder; like a U-ViT (``evals.diffusion_probe``) it is read on a noised
input. ``probed_sit(model, probe_t, path_type)`` returns the same SiT (same parameter tree) with a
``features(images)`` method as the MAE's:

    x_t = t x + (1 - t) eps  (the run's transport path; linear by default),  t = 1 - probe_t
    features(x) = every block's output (encoder then decoder blocks, before the final layer) at
                  time t with the null label: ``(depth, N, patches, D)``

so ``probe_t`` is the noise level, as for the U-ViT probe (SiT's own time runs the other way:
t = 1 is data). ``eps`` depends on the image alone (``diffusion_probe.fingerprint_keys``). The
blocks of a routed SiT (``residual_routing`` other than 'none') are read where they return the
stream (``flax.linen.intercept_methods`` on ``routing.RoutedSiTBlock``); 'attnres' has no stream
and is refused. SiT's tokens are all patch tokens (the condition enters through adaLN), so the
feature choice ``mean`` is the patch mean.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from decay_jax.diffusion import transport as transport_lib
from decay_jax.evals import diffusion_probe
from decay_jax.models import routing, stack
from decay_jax.models import sit as sit_lib


class ProbedSiT(sit_lib.SiT):
  """A ``SiT`` whose ``features`` are the noised-input block outputs of the module docstring."""
  probe_t: float = diffusion_probe.PROBE_T
  probe_label: int = 0
  probe_path: str = "linear"

  @property
  def feature_blocks(self) -> int:
    return self.depth

  @property
  def img_size(self) -> int:  # the names the evaluators' data checks read
    return self.input_size

  @property
  def in_chans(self) -> int:
    return self.in_channels

  def block_outputs(self, x, t, y):
    """Every block's output stream ``(depth, N, T, D)`` for inputs ``x (N, H, W, C)``, t, y."""
    tokens = self.x_embedder(x).astype(jnp.float32) + self.pos_embed()[None]
    cond = (self.t_embedder(t).astype(jnp.float32)
            + self.embed_labels(y, False).astype(jnp.float32))
    if self.residual_routing == "none":  # with hyper-connections each output the streams' sum
      tokens, enc_outs = self.enc_blocks(stack.expand(self.residual, tokens),
                                         self.block_inputs(0), cond)
      _, dec_outs = self.dec_blocks(tokens, self.block_inputs(1, None, enc_outs[::-1]), cond)
      return jnp.concatenate([enc_outs, dec_outs], axis=0)
    outs = []

    def keep(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if isinstance(context.module, routing.RoutedSiTBlock) and context.method_name == "__call__":
        outs.append(out)
      return out

    with nn.intercept_methods(keep):
      self.trunk(tokens, self.stream.alpha, cond)
    return jnp.stack(outs)

  def features(self, images):
    """``(depth, N, T, D)`` float32 block outputs of the noised ``images (N, H, W, C)``."""
    n = images.shape[0]
    t = jnp.full((n,), 1.0 - self.probe_t, jnp.float32)
    eps = jax.vmap(lambda k: jax.random.normal(k, images.shape[1:]))(
        diffusion_probe.fingerprint_keys(images))
    x_t = transport_lib.compute_xt(self.probe_path, t, eps, images.astype(jnp.float32))
    return self.block_outputs(x_t, t, jnp.full((n,), self.probe_label, jnp.int32))


def probed_sit(model: sit_lib.SiT, probe_t: float = diffusion_probe.PROBE_T,
               path_type: str = "linear") -> ProbedSiT:
  """The probe view of ``model`` (same fields and parameters; no rematerialisation)."""
  if not 0.0 < probe_t < 1.0:
    raise ValueError(f"probe_t={probe_t!r} is not allowed; it must be in (0, 1)")
  if model.class_dropout_prob <= 0:
    raise ValueError("a SiT is probed with its null label: it must have been trained with "
                     "model.class_dropout_prob > 0")
  if model.residual_routing == "attnres":
    raise ValueError("residual_routing='attnres' is not allowed here; its blocks return values, "
                     "not a stream, so they have no block outputs to compare")
  fields = {f: getattr(model, f) for f in model.__dataclass_fields__
            if f not in ("parent", "name")}
  fields["remat_policy"] = "none"  # intercepted block outputs must not be inside a remat trace
  return ProbedSiT(**fields, probe_t=probe_t, probe_label=model.num_classes, probe_path=path_type)
