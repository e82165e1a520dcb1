"""PyTorch transcription of REPA's SiT (sihyun-yu/REPA ``models/sit.py``, commit 67f7145), ground
truth for the REPA converter's parity test.

REPA's blocks are the official SiT's without decay or long skips (``SiTBlock``: adaLN-Zero,
timm ``Attention(qkv_bias=True, qk_norm=False)`` (fused or not: the same math), tanh-GELU ``Mlp``),
so the building blocks come from ``torch_reference`` (the official SiT's transcription) with
``sigma=(1, 1)`` and ``skip=False``. What REPA adds is transcribed here: ``build_mlp`` (the
projectors), ``blocks`` as one list, the projected tokens after block ``encoder_depth``
(1-based: ``(i + 1) == encoder_depth``), ``forward`` returning ``(x, zs)``, and no learned sigma.
"""
import numpy as np
import torch
import torch.nn as nn

import torch_reference as ref


def build_mlp(hidden_size, projector_dim, z_dim):
    """REPA ``build_mlp``: Linear, SiLU, Linear, SiLU, Linear (keys ``0``, ``2``, ``4``)."""
    return nn.Sequential(nn.Linear(hidden_size, projector_dim), nn.SiLU(),
                         nn.Linear(projector_dim, projector_dim), nn.SiLU(),
                         nn.Linear(projector_dim, z_dim))


class SiT(nn.Module):
    """REPA ``SiT``: ``forward(x, t, y) -> (x (N, C, H, W), zs [(N, T, z_dim), ...])``; t in REPA's
    convention (t = 0 data, t = 1 noise), output the velocity ``noise - data``."""

    def __init__(self, input_size=32, patch_size=2, in_channels=4, hidden_size=1152,
                 encoder_depth=8, depth=28, num_heads=16, mlp_ratio=4.0, class_dropout_prob=0.1, num_classes=1000,
                 z_dims=(768,), projector_dim=2048):
        super().__init__()
        self.in_channels = self.out_channels = in_channels
        self.patch_size = patch_size
        self.encoder_depth = encoder_depth
        self.x_embedder = ref.PatchEmbed(input_size, patch_size, in_channels, hidden_size,
                                         bias=True)
        self.t_embedder = ref.TimestepEmbedder(hidden_size)
        self.y_embedder = ref.LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        num_patches = self.x_embedder.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList([ref.SiTBlock(hidden_size, num_heads, mlp_ratio)
                                     for _ in range(depth)])
        self.projectors = nn.ModuleList([build_mlp(hidden_size, projector_dim, z) for z in z_dims])
        self.final_layer = ref.FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self):
        """REPA ``initialize_weights``: xavier Linear weights / zero biases (projectors included),
        the sin-cos table, xavier on the patch conv's 2-D view, N(0, 0.02) label table and t-MLP,
        zero adaLN and final layer."""
        def _basic_init(module):
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)
        self.apply(_basic_init)
        pos = ref.get_2d_sincos_pos_embed(self.pos_embed.shape[-1], self.x_embedder.grid_size)
        self.pos_embed.data.copy_(torch.from_numpy(np.asarray(pos)).float().unsqueeze(0))
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.constant_(self.x_embedder.proj.bias, 0)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:
            nn.init.constant_(block.adaLN_modulation[-1].weight, 0)
            nn.init.constant_(block.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].weight, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.linear.weight, 0)
        nn.init.constant_(self.final_layer.linear.bias, 0)

    def unpatchify(self, x):
        c, p = self.out_channels, self.patch_size
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(shape=(x.shape[0], h, w, p, p, c))
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(shape=(x.shape[0], c, h * p, w * p))

    def forward(self, x, t, y, force_drop_ids=None):
        x = self.x_embedder(x) + self.pos_embed
        N, T, D = x.shape
        c = self.t_embedder(t) + self.y_embedder(y, self.training, force_drop_ids)
        zs = None
        for i, block in enumerate(self.blocks):
            x = block(x, c)
            if (i + 1) == self.encoder_depth:
                zs = [projector(x.reshape(-1, D)).reshape(N, T, -1)
                      for projector in self.projectors]
        x = self.final_layer(x, c)
        return self.unpatchify(x), zs


def proj_loss(zs, zs_tilde):
    """REPA ``loss.py`` ``SILoss``'s projection loss, as written there: per target and example,
    ``mean_flat(-(normalize(z_j) * normalize(z_tilde_j)).sum(-1))`` (a mean over tokens), summed,
    then divided by ``len(zs) * bsz``."""
    loss = 0.0
    bsz = zs[0].shape[0]
    for z, z_tilde in zip(zs, zs_tilde):
        for z_j, z_tilde_j in zip(z, z_tilde):
            z_tilde_j = nn.functional.normalize(z_tilde_j, dim=-1)
            z_j = nn.functional.normalize(z_j, dim=-1)
            loss += torch.mean(-(z_j * z_tilde_j).sum(dim=-1))
    return loss / (len(zs) * bsz)
