"""PyTorch reference of U-ViT (baofff/U-ViT ``libs/uvit.py``) with optional decayed shortcuts.

Transcribed from the U-ViT source (read at commit ce551708, docs/uvit.md 1),
not from the Flax model. It is ground truth for tests/test_uvit.py only. Same state_dict keys,
init and fp32 forward as U-ViT's ``UViT``; attention is written out (U-ViT's 'math' path, which
computes the same function as its 'flash' and 'xformers' paths); einops rearranges are spelled
as reshapes/permutes.

Additions that are not in U-ViT (all off by default, so the default model is U-ViT's):
  * ``alphas``: one ``(alpha_attn, alpha_mlp)`` pair per block in the order in-blocks, mid-block,
    out-blocks; the block computes ``x <- a_attn x + attn(norm1 x)`` and then
    ``x <- a_mlp x + mlp(norm2 x)``.
  * ``zero_init_branches``: ``attn.proj.weight`` and ``mlp.fc2.weight`` set to zero after U-ViT's
    init.
  * ``skip_mode='add'``: out-blocks compute ``x <- x + skip_linear(skip)`` with Linear(D, D)
    instead of U-ViT's ``x <- skip_linear(cat[x, skip])`` with Linear(2D, D).
"""
import math

import torch
import torch.nn as nn
import torch.utils.checkpoint

__all__ = ["timestep_embedding", "patchify", "unpatchify", "Attention", "Mlp", "Block",
           "PatchEmbed", "UViT"]


def timestep_embedding(timesteps, dim, max_period=10000):
    """(N,) -> (N, dim): [cos(t f), sin(t f)] with f_j = exp(-ln(max_period) j / (dim//2)), cos
    first; a zero column is appended for odd dim."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = timesteps[:, None].float() * freqs[None].to(timesteps.device)
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


def patchify(imgs, patch_size):
    """'B C (h p1) (w p2) -> B (h w) (p1 p2 C)'."""
    b, c, hp, wp = imgs.shape
    p = patch_size
    x = imgs.reshape(b, c, hp // p, p, wp // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (hp // p) * (wp // p), p * p * c)


def unpatchify(x, channels=3):
    """'B (h w) (p1 p2 C) -> B C (h p1) (w p2)' for a square grid."""
    p = int((x.shape[2] // channels) ** 0.5)
    h = w = int(x.shape[1] ** 0.5)
    assert h * w == x.shape[1] and p * p * channels == x.shape[2]
    x = x.reshape(x.shape[0], h, w, p, p, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(x.shape[0], channels, h * p, w * p)


class Attention(nn.Module):
    """qkv Linear (bias only with qkv_bias) rearranged 'B L (K H D) -> K B H L D', softmax attention
    with scale qk_scale or head_dim**-0.5, heads merged as (H D), then proj Linear (with bias)."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_scale=None):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = qk_scale or head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, L, C = x.shape
        qkv = self.qkv(x).reshape(B, L, 3, self.num_heads, C // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, L, hd)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, L, C)
        return self.proj(x)


class Mlp(nn.Module):
    """timm Mlp (U-ViT libs/timm.py) with dropout 0: fc1 -> GELU (exact erf) -> fc2."""

    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm block; out-blocks (skip=True) first replace the stream by skip_linear([x, skip]).
    ``alpha`` scales the two identities (U-ViT: (1, 1))."""

    def __init__(self, dim, num_heads, mlp_ratio=4., qkv_bias=False, qk_scale=None,
                 norm_layer=nn.LayerNorm, skip=False, use_checkpoint=False, alpha=(1.0, 1.0),
                 skip_mode="concat"):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_scale=qk_scale)
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.skip_mode = skip_mode
        skip_in = 2 * dim if skip_mode == "concat" else dim
        self.skip_linear = nn.Linear(skip_in, dim) if skip else None
        self.use_checkpoint = use_checkpoint
        self.alpha = (float(alpha[0]), float(alpha[1]))

    def forward(self, x, skip=None):
        if self.use_checkpoint:
            return torch.utils.checkpoint.checkpoint(self._forward, x, skip, use_reentrant=False)
        return self._forward(x, skip)

    def _forward(self, x, skip=None):
        if self.skip_linear is not None:
            if self.skip_mode == "concat":
                x = self.skip_linear(torch.cat([x, skip], dim=-1))
            else:
                x = x + self.skip_linear(skip)
        x = self.alpha[0] * x + self.attn(self.norm1(x))
        x = self.alpha[1] * x + self.mlp(self.norm2(x))
        return x


class PatchEmbed(nn.Module):
    """Conv2d(kernel = stride = patch_size, bias) then flatten to (B, N, D), row-major tokens."""

    def __init__(self, patch_size, in_chans=3, embed_dim=768):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        _, _, H, W = x.shape
        assert H % self.patch_size == 0 and W % self.patch_size == 0
        return self.proj(x).flatten(2).transpose(1, 2)


class UViT(nn.Module):
    """U-ViT: tokens [label?, time, patches] + pos_embed; depth//2 in-blocks (outputs pushed), a
    mid-block, depth//2 out-blocks each popping a skip; norm, decoder_pred, drop the extras,
    unpatchify, final 3x3 conv (or Identity).
    forward(x (B, C, H, W), timesteps (B,), y (B,) or None) -> (B, C, H, W)."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, depth=12,
                 num_heads=12, mlp_ratio=4., qkv_bias=False, qk_scale=None, norm_layer=nn.LayerNorm,
                 mlp_time_embed=False, num_classes=-1, use_checkpoint=False, conv=True, skip=True,
                 alphas=None, zero_init_branches=False, skip_mode="concat"):
        super().__init__()
        self.num_features = self.embed_dim = embed_dim
        self.num_classes = num_classes
        self.in_chans = in_chans
        half = depth // 2
        if alphas is None:
            alphas = [(1.0, 1.0)] * (2 * half + 1)
        assert len(alphas) == 2 * half + 1

        self.patch_embed = PatchEmbed(patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        num_patches = (img_size // patch_size) ** 2
        if mlp_time_embed:
            self.time_embed = nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.SiLU(),
                                            nn.Linear(4 * embed_dim, embed_dim))
        else:
            self.time_embed = nn.Identity()
        if self.num_classes > 0:
            self.label_emb = nn.Embedding(self.num_classes, embed_dim)
            self.extras = 2
        else:
            self.extras = 1
        self.pos_embed = nn.Parameter(torch.zeros(1, self.extras + num_patches, embed_dim))

        common = dict(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                      qk_scale=qk_scale, norm_layer=norm_layer, use_checkpoint=use_checkpoint)
        self.in_blocks = nn.ModuleList([Block(alpha=alphas[i], **common) for i in range(half)])
        self.mid_block = Block(alpha=alphas[half], **common)
        self.out_blocks = nn.ModuleList([
            Block(skip=skip, skip_mode=skip_mode, alpha=alphas[half + 1 + j], **common)
            for j in range(half)])

        self.norm = norm_layer(embed_dim)
        self.patch_dim = patch_size ** 2 * in_chans
        self.decoder_pred = nn.Linear(embed_dim, self.patch_dim, bias=True)
        self.final_layer = (nn.Conv2d(self.in_chans, self.in_chans, 3, padding=1) if conv
                            else nn.Identity())

        nn.init.trunc_normal_(self.pos_embed, std=.02)  # timm's: bounds -2, 2 in absolute units
        self.apply(self._init_weights)
        if zero_init_branches:
            for blk in [*self.in_blocks, self.mid_block, *self.out_blocks]:
                nn.init.zeros_(blk.attn.proj.weight)
                nn.init.zeros_(blk.mlp.fc2.weight)

    def _init_weights(self, m):
        """Linear: trunc-normal std .02, bias 0; LayerNorm: 1, 0. Convs and the label table keep
        torch's default init."""
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.LayerNorm):
            nn.init.constant_(m.bias, 0)
            nn.init.constant_(m.weight, 1.0)

    @torch.jit.ignore
    def no_weight_decay(self):
        return {'pos_embed'}

    def forward(self, x, timesteps, y=None):
        x = self.patch_embed(x)
        _, L, _ = x.shape
        time_token = self.time_embed(timestep_embedding(timesteps, self.embed_dim)).unsqueeze(1)
        x = torch.cat((time_token, x), dim=1)
        if y is not None:
            x = torch.cat((self.label_emb(y).unsqueeze(1), x), dim=1)
        x = x + self.pos_embed

        skips = []
        for blk in self.in_blocks:
            x = blk(x)
            skips.append(x)
        x = self.mid_block(x)
        for blk in self.out_blocks:
            x = blk(x, skips.pop())

        x = self.decoder_pred(self.norm(x))
        assert x.size(1) == self.extras + L
        x = unpatchify(x[:, self.extras:, :], self.in_chans)
        return self.final_layer(x)
