"""PyTorch reference implementation of the official decayed-identity-shortcut models.

Written from the fact sheet ``docs/official_code.md`` (section numbers below refer to
it). It is used only as ground truth by the JAX/Flax parity tests; it reproduces the official
``MAE/models_mae.py`` (MaskedAutoencoderViT) and ``SiT/models.py`` (SiT) state_dict layouts,
initialisation and fp32 forward math, with flash-attention replaced by explicit attention
(softmax in float32).
"""
import math

import numpy as np
import torch
import torch.nn as nn

__all__ = [
    "get_1d_sincos_pos_embed_from_grid",
    "get_2d_sincos_pos_embed",
    "MaskedAutoencoderViT",
    "SiT",
    "randomize_",
]


# ------------------------------------------------------------------------------------------------
# 1.12  2-D sin-cos positional embedding
# ------------------------------------------------------------------------------------------------
def get_1d_sincos_pos_embed_from_grid(embed_dim, pos):
    """1-D table (spec 1.12): omega_i = 10000^(-i/(E/2)); output [sin(p*omega), cos(p*omega)]."""
    assert embed_dim % 2 == 0
    omega = np.arange(embed_dim // 2, dtype=np.float64)
    omega /= embed_dim / 2.0
    omega = 1.0 / 10000 ** omega
    pos = np.asarray(pos, dtype=np.float64).reshape(-1)
    out = np.einsum("m,d->md", pos, omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def get_2d_sincos_pos_embed(embed_dim, grid_size, cls_token=False):
    """2-D table (spec 1.12), float64, shape (G*G [+1], D).

    Token n = row*G + col. First D/2 channels encode the column index, last D/2 the row index.
    With ``cls_token`` a zero row is prepended.
    """
    assert embed_dim % 2 == 0
    col, row = np.meshgrid(np.arange(grid_size, dtype=np.float64),
                           np.arange(grid_size, dtype=np.float64))  # (G, G), indexed [row, col]
    emb_col = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, col)
    emb_row = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, row)
    emb = np.concatenate([emb_col, emb_row], axis=1)
    if cls_token:
        emb = np.concatenate([np.zeros([1, embed_dim]), emb], axis=0)
    return emb


# ------------------------------------------------------------------------------------------------
# Shared building blocks
# ------------------------------------------------------------------------------------------------
class PatchEmbed(nn.Module):
    """timm-style PatchEmbed: Conv2d(k=stride=p) then flatten to (N, L, D), row-major tokens."""

    def __init__(self, img_size, patch_size, in_chans, embed_dim, bias=True):
        super().__init__()
        self.img_size = img_size
        self.patch_size = patch_size
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size,
                              bias=bias)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention (spec 1.5 / 4.5): packed qkv Linear with bias, [q|k|v] then
    head-major split, scores = q @ k^T * head_dim**-0.5, softmax in float32, output channel
    index h*hd + i, then proj."""

    def __init__(self, dim, num_heads):
        super().__init__()
        assert dim % num_heads == 0
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x).reshape(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (B, H, T, hd)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.float().softmax(dim=-1).to(v.dtype)
        x = (attn @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(x)


class Mlp(nn.Module):
    """timm Mlp: fc1 -> GELU -> fc2 (no dropout; ``mlp.norm`` is Identity and has no params)."""

    def __init__(self, dim, hidden_dim, approximate="none"):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU(approximate=approximate)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


# ------------------------------------------------------------------------------------------------
# 1.  MAE
# ------------------------------------------------------------------------------------------------
class Block(nn.Module):
    """Decayed pre-norm ViT block (spec 1.5):
    x <- a0*x + Attn(LN1(x));  x <- a1*x + MLP(LN2(x)).  LN eps 1e-6, exact-erf GELU.
    ``attn.proj`` and ``mlp.fc2`` weights are zero-initialised (spec 1.3)."""

    def __init__(self, dim, num_heads, mlp_ratio=4.0, decay=(1.0, 1.0)):
        super().__init__()
        self.decay = [float(decay[0]), float(decay[1])]  # plain Python floats, not in state_dict
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), approximate="none")
        self.attn.proj._zero_init = True
        self.mlp.fc2._zero_init = True

    def forward(self, x):
        x = self.decay[0] * x + self.attn(self.norm1(x))
        x = self.decay[1] * x + self.mlp(self.norm2(x))
        return x


class SkipLayer(nn.Module):
    """U-Net style skip from an encoder block into the decoder (spec 1.7).

    The visible encoder tokens are un-shuffled with this layer's own mask token (encoder width)
    filling masked positions, the encoder cls output is put in front, and
    u <- u + fc(cat([s_full (skip_dim), u (feat_dim)], -1)) with fc = Linear -> SiLU -> Linear
    (the last Linear zero-initialised). Plain residual, no decay.
    """

    def __init__(self, feat_dim, skip_dim):
        super().__init__()
        self.mask_token = nn.Parameter(torch.randn(1, 1, skip_dim) * 0.02)
        self.fc = nn.Sequential(nn.Linear(skip_dim + feat_dim, feat_dim), nn.SiLU(),
                                nn.Linear(feat_dim, feat_dim))
        self.fc[2]._zero_init = True

    def forward(self, u, s, ids_restore):
        N, T, C = s.shape
        n_mask = ids_restore.shape[1] + 1 - T
        mask_tokens = self.mask_token.expand(N, n_mask, C)
        s_ = torch.cat([s[:, 1:, :], mask_tokens], dim=1)
        s_ = torch.gather(s_, 1, ids_restore.unsqueeze(-1).expand(-1, -1, C))
        s_ = torch.cat([s[:, :1, :], s_], dim=1)
        return u + self.fc(torch.cat([s_, u], dim=-1))


class MaskedAutoencoderViT(nn.Module):
    """Official decayed MAE (spec section 1).

    state_dict (spec 1.2): cls_token, pos_embed, decoder_cls_token, decoder_pos_embed,
    patch_embed.proj.*, skip.{i}.*, blocks.{j}.*, decoder_embed.*, decoder_blocks.{k}.*,
    decoder_norm.*, decoder_pred.*. No final encoder norm, no global mask token.
    """

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, depth=12,
                 num_heads=12, decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16,
                 mlp_ratio=4., norm_pix_loss=False, min_decay=1.0):
        super().__init__()
        assert depth % 2 == 0, "skip_id = arange(depth).reshape(-1, 2)[:, 1] needs an even depth"
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.embed_dim = embed_dim
        self.decoder_embed_dim = decoder_embed_dim
        self.norm_pix_loss = norm_pix_loss
        self.min_decay = float(min_decay)

        # Own parameters (emitted first in the state_dict).
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim),
                                      requires_grad=False)
        self.decoder_cls_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, decoder_embed_dim),
                                              requires_grad=False)

        # 1.6 step 5: skips from the odd encoder blocks; one SkipLayer per entry.
        self.skip_id = np.arange(depth).reshape(-1, 2)[:, 1]
        self.skip = nn.ModuleList([SkipLayer(decoder_embed_dim, embed_dim)
                                   for _ in range(len(self.skip_id))])

        # 1.4: per-sublayer linear decay of the encoder identity path.
        decay = 1 - np.linspace(0, 1, 2 * depth).reshape(depth, 2) * (1 - self.min_decay)
        self.decay = [[float(a), float(b)] for a, b in decay]
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, mlp_ratio, decay=self.decay[j])
                                     for j in range(depth)])

        # Decoder (1.8): undecayed blocks.
        self.decoder_embed = nn.Linear(decoder_embed_dim, decoder_embed_dim, bias=True)
        self.decoder_blocks = nn.ModuleList([Block(decoder_embed_dim, decoder_num_heads, mlp_ratio)
                                             for _ in range(decoder_depth)])
        self.decoder_norm = nn.LayerNorm(decoder_embed_dim, eps=1e-6)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size ** 2 * in_chans, bias=True)
        self.decoder_pred._zero_init = True

        self.initialize_weights()

    # -- 1.3 -------------------------------------------------------------------------------------
    def initialize_weights(self):
        """Spec 1.3: fixed sin-cos pos embeds, xavier on the 2-D view of the patch-embed weight
        (bias keeps the Conv2d default), cls tokens N(0, 0.02), Linear weights xavier_uniform
        except the zero-init set, all Linear biases 0, LayerNorm (1, 0)."""
        grid = self.patch_embed.grid_size
        if not self.pos_embed.is_meta:
            with torch.no_grad():
                self.pos_embed.copy_(torch.from_numpy(
                    get_2d_sincos_pos_embed(self.embed_dim, grid, cls_token=True)).float()[None])
                self.decoder_pos_embed.copy_(torch.from_numpy(
                    get_2d_sincos_pos_embed(self.decoder_embed_dim, grid, cls_token=True)
                ).float()[None])
        w = self.patch_embed.proj.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.normal_(self.cls_token, std=.02)
        nn.init.normal_(self.decoder_cls_token, std=.02)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            if getattr(m, "_zero_init", False):
                nn.init.zeros_(m.weight)
            else:
                nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    # -- 1.9 -------------------------------------------------------------------------------------
    def patchify(self, imgs):
        """(N, C, H, W) -> (N, L, p*p*C); per-patch index (r*p + c)*C + ch (spec 1.9)."""
        p = self.patch_size
        N, C, H, W = imgs.shape
        assert H == W and H % p == 0
        h = w = H // p
        x = imgs.reshape(N, C, h, p, w, p)
        x = torch.einsum("nchpwq->nhwpqc", x)
        return x.reshape(N, h * w, p * p * C)

    def unpatchify(self, x):
        """Inverse of :meth:`patchify`: (N, L, p*p*C) -> (N, C, H, W)."""
        p = self.patch_size
        C = self.in_chans
        h = w = int(round(x.shape[1] ** .5))
        assert h * w == x.shape[1]
        x = x.reshape(x.shape[0], h, w, p, p, C)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], C, h * p, w * p)

    # -- 1.6 -------------------------------------------------------------------------------------
    @staticmethod
    def random_masking(x, mask_ratio, noise):
        """Spec 1.6 step 3. ``noise`` (N, L): ascending argsort, the smallest ``int(L*(1-r))``
        are kept (in shuffled order). Returns (x_masked, mask, ids_restore); mask is 1 for
        removed patches, in original patch order."""
        N, L, D = x.shape
        len_keep = int(L * (1 - mask_ratio))
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, D))
        mask = torch.ones([N, L], device=x.device, dtype=x.dtype)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, 1, ids_restore)
        return x_masked, mask, ids_restore

    def forward_encoder(self, imgs, mask_ratio, noise=None):
        """Spec 1.6. Returns (x, mask, ids_restore, skips): x (N, 1+len_keep, D) is the last
        block output (no final norm), skips = outputs of the blocks in skip_id, shallowest
        first. ``noise=None`` draws torch.rand (tests should pass it)."""
        x = self.patch_embed(imgs)
        x = x + self.pos_embed[:, 1:, :]
        if noise is None:
            noise = torch.rand(x.shape[0], x.shape[1], device=x.device)
        x, mask, ids_restore = self.random_masking(x, mask_ratio, noise)
        cls_token = self.cls_token + self.pos_embed[:, :1, :]
        x = torch.cat([cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        skip_set = set(int(i) for i in self.skip_id)
        skips = []
        for j, blk in enumerate(self.blocks):
            x = blk(x)
            if j in skip_set:
                skips.append(x)
        return x, mask, ids_restore, skips

    # -- 1.7 / 1.8 -------------------------------------------------------------------------------
    def forward_decoder(self, skips, ids_restore, batch):
        """Spec 1.8. Decoder input = decoder_embed(cat(decoder_cls_token, decoder_pos_embed[:,1:]))
        broadcast to ``batch``; before decoder block k, while skips remain, apply skip[k] with
        skips.pop() (deepest first). Returns pred (N, L, p*p*C), cls position dropped.
        The caller's ``skips`` list is not modified."""
        skips = list(skips)
        x = torch.cat([self.decoder_cls_token, self.decoder_pos_embed[:, 1:, :]], dim=1)
        x = self.decoder_embed(x.expand(batch, -1, -1))
        for k, blk in enumerate(self.decoder_blocks):
            if len(skips) > 0:
                x = self.skip[k](x, skips.pop(), ids_restore)
            x = blk(x)
        x = self.decoder_norm(x)
        x = self.decoder_pred(x)
        return x[:, 1:, :]

    def forward_loss(self, imgs, pred, mask):
        """Spec 1.9: per-patch MSE against patchify(imgs) (norm_pix: unbiased var + 1e-6),
        averaged over masked patches only."""
        target = self.patchify(imgs)
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)  # unbiased
            target = (target - mean) / (var + 1.e-6) ** .5
        loss = (pred - target) ** 2
        loss = loss.mean(dim=-1)
        return (loss * mask).sum() / mask.sum()

    def forward(self, imgs, mask_ratio=0.75, noise=None):
        """Returns (loss, pred (N, L, p*p*C), mask (N, L), latent (N, 1+len_keep, D))."""
        latent, mask, ids_restore, skips = self.forward_encoder(imgs, mask_ratio, noise)
        pred = self.forward_decoder(skips, ids_restore, imgs.shape[0])
        loss = self.forward_loss(imgs, pred, mask)
        return loss, pred, mask, latent

    # -- 1.10 ------------------------------------------------------------------------------------
    def forward_feat(self, imgs):
        """Spec 1.10: no masking; all 1+L tokens through every block; returns the raw output of
        the final encoder block (= last entry of skip_id), shape (N, 1+L, D), no norm."""
        x = self.patch_embed(imgs)
        x = x + self.pos_embed[:, 1:, :]
        cls_token = self.cls_token + self.pos_embed[:, :1, :]
        x = torch.cat([cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        for blk in self.blocks:
            x = blk(x)
        return x


class VisionTransformerClassifier(nn.Module):
    """Upstream MAE's fine-tuning model (``models_vit.VisionTransformer``, global_pool=True) with the
    decayed blocks (docs/finetune.md): [cls; patches] + pos_embed (a trainable parameter), blocks
    with the official per-sublayer decay for ``min_decay``, mean of the patch tokens (cls left
    out), ``fc_norm`` (LN eps 1e-6), ``head``. No final ``norm`` (upstream deletes it)."""

    def __init__(self, img_size=32, patch_size=4, in_chans=3, embed_dim=64, depth=4, num_heads=4,
                 num_classes=10, mlp_ratio=4.0, min_decay=1.0):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        n = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, embed_dim))
        decay = 1 - np.linspace(0, 1, 2 * depth).reshape(depth, 2) * (1 - float(min_decay))
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, mlp_ratio, decay=d)
                                     for d in decay])
        self.fc_norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.fc_norm(x[:, 1:].mean(dim=1)))


# ------------------------------------------------------------------------------------------------
# 4.  SiT
# ------------------------------------------------------------------------------------------------
def modulate(x, shift, scale):
    """Spec 4.5: x*(1+scale) + shift, broadcast over tokens."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    """Spec 4.6: 256 frequency features [cos(t f), sin(t f)], f_j = exp(-ln(1e4) j/128)
    in float32, t unscaled; then Linear -> SiLU -> Linear."""

    def __init__(self, hidden_size, frequency_embedding_size=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size, bias=True),
                                 nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size, bias=True))
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period)
                          * torch.arange(start=0, end=half, dtype=torch.float32) / half
                          ).to(device=t.device)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class LabelEmbedder(nn.Module):
    """Spec 4.6: table with num_classes (+1 null row when dropout_prob > 0); label dropout to
    class ``num_classes`` in training (prob dropout_prob) or where force_drop_ids == 1."""

    def __init__(self, num_classes, hidden_size, dropout_prob):
        super().__init__()
        use_cfg_embedding = dropout_prob > 0
        self.embedding_table = nn.Embedding(num_classes + int(use_cfg_embedding), hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def token_drop(self, labels, force_drop_ids=None):
        if force_drop_ids is None:
            drop_ids = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop_ids = force_drop_ids == 1
        return torch.where(drop_ids, torch.full_like(labels, self.num_classes), labels)

    def forward(self, labels, train, force_drop_ids=None):
        if (train and self.dropout_prob > 0) or (force_drop_ids is not None):
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)


class SiTBlock(nn.Module):
    """Spec 4.5. Decoder blocks (``skip=True``) first add skip(s) (Linear, no decay), then
    x <- sigma0*x + gate_msa*Attn(modulate(LN(x))); x <- sigma1*x + gate_mlp*MLP(modulate(LN(x))).
    LN without affine, eps 1e-6; tanh-GELU MLP; adaLN chunks in the order
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp."""

    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, sigma=(1.0, 1.0), skip=False):
        super().__init__()
        self.sigma = [float(sigma[0]), float(sigma[1])]
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio), approximate="tanh")
        self.adaLN_modulation = nn.Sequential(nn.SiLU(),
                                              nn.Linear(hidden_size, 6 * hidden_size, bias=True))
        self.skip = nn.Linear(hidden_size, hidden_size) if skip else None

    def forward(self, x, c, s=None):
        if self.skip is not None:
            x = x + self.skip(s)
        (shift_msa, scale_msa, gate_msa,
         shift_mlp, scale_mlp, gate_mlp) = self.adaLN_modulation(c).chunk(6, dim=1)
        x = self.sigma[0] * x + gate_msa.unsqueeze(1) * self.attn(
            modulate(self.norm1(x), shift_msa, scale_msa))
        x = self.sigma[1] * x + gate_mlp.unsqueeze(1) * self.mlp(
            modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    """Spec 4.7: adaLN(c) -> (shift, scale); LN (no affine) -> modulate -> Linear(D, p*p*C_out)."""

    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(),
                                              nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class SiT(nn.Module):
    """Official decayed SiT with encoder/decoder split and long skips (spec section 4).

    state_dict (spec 4.2): pos_embed, x_embedder.proj.*, t_embedder.mlp.{0,2}.*,
    y_embedder.embedding_table.weight, enc_blocks.{i}.*, dec_blocks.{i}.* (+ .skip.*),
    final_layer.linear.*, final_layer.adaLN_modulation.1.*.
    """

    def __init__(self, input_size=32, patch_size=2, in_channels=4, hidden_size=1152, depth=28,
                 num_heads=16, mlp_ratio=4.0, class_dropout_prob=0.1, num_classes=1000,
                 learn_sigma=True, min_sigma=0.8):
        super().__init__()
        assert depth % 2 == 0
        self.learn_sigma = learn_sigma
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.num_classes = num_classes
        self.min_sigma = float(min_sigma)

        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size, bias=True)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        num_patches = self.x_embedder.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, hidden_size),
                                      requires_grad=False)

        # 4.4: one schedule over all 2*depth sublayers, encoder rows then decoder rows.
        sigma = np.linspace(1, self.min_sigma, 2 * depth).reshape(depth, 2)
        self.sigma = [[float(a), float(b)] for a, b in sigma]
        half = depth // 2
        self.enc_blocks = nn.ModuleList([
            SiTBlock(hidden_size, num_heads, mlp_ratio, sigma=self.sigma[i])
            for i in range(half)])
        self.dec_blocks = nn.ModuleList([
            SiTBlock(hidden_size, num_heads, mlp_ratio, sigma=self.sigma[i + half], skip=True)
            for i in range(half)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self):
        """Spec 4.3: xavier Linear weights / zero biases; xavier on the 2-D view of the
        x_embedder weight with bias 0; embedding table and t-MLP weights N(0, 0.02); adaLN and
        final layer (linear and adaLN) zero; skip Linears xavier."""
        def _basic_init(m):
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.apply(_basic_init)

        if not self.pos_embed.is_meta:
            grid = self.x_embedder.grid_size
            with torch.no_grad():
                self.pos_embed.copy_(torch.from_numpy(
                    get_2d_sincos_pos_embed(self.hidden_size, grid)).float()[None])

        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for blk in list(self.enc_blocks) + list(self.dec_blocks):
            nn.init.zeros_(blk.adaLN_modulation[-1].weight)
            nn.init.zeros_(blk.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def unpatchify(self, x):
        """Spec 4.7: (N, T, p*p*C_out) -> (N, C_out, H, W); token vector index (pi*p+qi)*C_out+ch."""
        c = self.out_channels
        p = self.patch_size
        h = w = int(round(x.shape[1] ** 0.5))
        assert h * w == x.shape[1]
        x = x.reshape(x.shape[0], h, w, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x, t, y, force_drop_ids=None):
        """x (N, C, H, W), t (N,) in [0, 1], y (N,) int labels -> (N, in_channels, H, W).
        Label dropout only in training mode or for rows with force_drop_ids == 1."""
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y, self.training, force_drop_ids)
        stack = []
        for blk in self.enc_blocks:
            x = blk(x, c)
            stack.append(x)
        for blk in self.dec_blocks:
            x = blk(x, c, stack.pop())  # dec j <- enc (depth/2 - 1 - j)
        x = self.final_layer(x, c)
        x = self.unpatchify(x)
        if self.learn_sigma:
            x, _ = x.chunk(2, dim=1)
        return x

    def forward_with_cfg(self, x, t, y, cfg_scale):
        """Spec 4.8 (upstream DiT/SiT): the first half of the batch is duplicated and run with
        labels y (caller passes y = [labels; null]); channels 0..2 get
        uncond + s*(cond - uncond) in both halves, channels >= 3 pass through unguided
        (first half conditional, second half unconditional). Returns (2*(N//2), C, H, W)."""
        half = x[: len(x) // 2]
        combined = torch.cat([half, half], dim=0)
        model_out = self.forward(combined, t, y)
        eps, rest = model_out[:, :3], model_out[:, 3:]
        cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
        half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        eps = torch.cat([half_eps, half_eps], dim=0)
        return torch.cat([eps, rest], dim=1)


# ------------------------------------------------------------------------------------------------
# Test helper
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def randomize_(model, seed, scale=0.05):
    """Fill every trainable parameter with deterministic N(0, 1)*scale values (+1.0 for affine
    LayerNorm weights), so parity tests do not run on the zero-heavy official init. Frozen
    parameters (the sin-cos pos embeds) are left untouched. Returns ``model``."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    ln_weights = {id(m.weight) for m in model.modules()
                  if isinstance(m, nn.LayerNorm) and m.weight is not None}
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        v = torch.randn(p.shape, generator=gen, dtype=torch.float32) * scale
        if id(p) in ln_weights:
            v = v + 1.0
        p.copy_(v.to(dtype=p.dtype, device=p.device))
    return model


def training_loss(task, model, batch):
    """``(module, loss closure)``: the reference of the JAX ``model`` of ``task`` ('mae' or 'sit'
    pre-training) and its loss on random inputs of ``batch`` examples, for timing a train step
    (``decay_jax.cli.bench --torch``)."""
    if task == "mae":
        tm = MaskedAutoencoderViT(
            img_size=model.img_size, patch_size=model.patch_size, in_chans=model.in_chans,
            embed_dim=model.dim, depth=model.depth, num_heads=model.num_heads,
            decoder_embed_dim=model.decoder_dim, decoder_depth=model.decoder_depth,
            decoder_num_heads=model.decoder_num_heads, norm_pix_loss=model.norm_pix_loss,
            min_decay=model.alpha_min)
        x = torch.randn(batch, model.in_chans, model.img_size, model.img_size)
        return tm, lambda: tm(x, model.mask_ratio, torch.rand(batch, model.num_patches))[0]
    if task == "sit":
        tm = SiT(input_size=model.input_size, patch_size=model.patch_size,
                 in_channels=model.in_channels, hidden_size=model.dim, depth=model.depth,
                 num_heads=model.num_heads, num_classes=model.num_classes,
                 learn_sigma=model.learn_sigma, min_sigma=model.alpha_min)
        x = torch.randn(batch, model.in_channels, model.input_size, model.input_size)
        y = torch.randint(0, model.num_classes, (batch,))
        return tm, lambda: ((tm(x, torch.rand(batch), y) - x) ** 2).mean()
    raise ValueError(f"no PyTorch reference of task {task!r}")
