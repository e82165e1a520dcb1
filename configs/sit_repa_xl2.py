"""REPA's SiT-XL/2 recipe (Yu et al. 2024, sihyun-yu/REPA; docs/repa.md): a plain SiT-XL/2 whose
block-8 tokens are aligned with DINOv2-B/14 patch tokens, ImageNet 256x256 as SD-VAE latents.

Command (latents extracted once into $LATENTS with the DINOv2-B targets stored beside them as
repa_target_0, format in decay_jax/data/latents.py; $DINOV2 converted once by
`python -m decay_jax.cli.convert_external dinov2`: docs/dinov2.md, docs/repa.md "Targets"):
  python -m decay_jax.cli.extract_latents --images=$IMAGENET_TRAIN --vae=$VAE --out=$LATENTS \
      --image_size=256 --repa_encoder=$DINOV2
  python -m decay_jax.cli.train --config=configs/sit_repa_xl2.py --workdir=$WORKDIR \
      --config.data.dataset=latents:$LATENTS
Hardware: REPA trained on 8 H100 (fp16 autocast, batch 256); any device count dividing 256 works
  here, bfloat16 compute.
Expected time: not measured by us; 400K steps of SiT-XL/2 at batch 256 (plus 2% for the
  projector), about 6 days on 8 A100 at the 0.8 steps/s of configs/sit_xl2.py.
Expected result (the paper's, Table 2, not reproduced here): FID-50K 5.9 without guidance at 400K
  steps (SiT-XL/2 alone: 17.2 at 400K, 8.3 at 7M); 4M steps with guidance 1.8 (interval to
  t = 0.7, REPA's time): FID 1.42. SDE Euler-Maruyama, 250 steps.

The recipe (REPA train.py defaults and README command): linear path, velocity prediction,
t ~ U[0, 1], batch 256, AdamW lr 1e-4 (betas 0.9, 0.999, eps 1e-8), no weight decay, gradient clipping at norm
1.0, EMA 0.9999, label drop 0.1, proj_coeff 0.5, encoder_depth 8, projector width 2048, 400K
steps. flow_convention 'repa' keeps REPA's time and velocity inside the network, so the weights
export to and from REPA's layout (decay_jax/io/convert_repa.py).
Compiled for its target (docs/tpu.md, 2026-12-07): v5p-16 (8 chips, 32 per chip): 19.2 of 88.5 GiB
  per chip, fits; cost-model MFU 42.5%.
"""

from decay_jax.train import config as config_lib


def get_config():
  c = config_lib.sit_config()
  # REPA's SiT is the plain SiT of Ma et al.: no decay, no long skip, no sigma output; block 8's
  # tokens are projected to DINOv2-B/14's width 768 by a 2048-wide MLP.
  c.model.update(preset="XL/2", alpha_min=1.0, residual_routing="plain", learn_sigma=False,
                 flow_convention="repa", repa_depth=8, repa_dims=(768,), repa_hidden=2048,
                 dtype="bfloat16")
  c.data.dataset = "latents:/path/to/imagenet256_latents"
  c.update(batch_size=256, num_train_steps=400_000, ema_decay=0.9999)
  c.optim.update(lr=1e-4, weight_decay=0.0, grad_clip_norm=1.0)
  # Targets stored beside the latents (repa_target_0: (256, 768) per image); a DINOv2 params
  # directory here computes them on the fly instead (docs/repa.md "Targets").
  c.repa.update(proj_coeff=0.5, encoder="")
  c.sample.update(mode="sde", method="euler", num_steps=250, cfg_scale=1.0)
  return c
