"""Checks of the PyTorch reference (tests/torch_reference.py) against numbers in the spec
(docs/official_code.md). CPU only, fast."""
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import (  # noqa: E402
    MaskedAutoencoderViT, SiT, get_2d_sincos_pos_embed, randomize_)


def _numel(model):
    return sum(p.numel() for p in model.parameters())


def _tiny_mae(**kw):
    cfg = dict(img_size=32, patch_size=4, in_chans=3, embed_dim=32, depth=4, num_heads=2,
               decoder_embed_dim=24, decoder_depth=2, decoder_num_heads=2, mlp_ratio=4.,
               min_decay=0.7)
    cfg.update(kw)
    return MaskedAutoencoderViT(**cfg)


def _tiny_sit(**kw):
    cfg = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=4, num_heads=2,
               num_classes=10, min_sigma=0.8)
    cfg.update(kw)
    return SiT(**cfg)


# ----------------------------------------------------------------------------------- 1.12 -----
def test_sincos_layout():
    D, G = 16, 5
    emb = get_2d_sincos_pos_embed(D, G, cls_token=True)
    assert emb.shape == (G * G + 1, D) and emb.dtype == np.float64
    assert np.all(emb[0] == 0)
    E = D // 2
    omega = 10000.0 ** (-np.arange(E // 2) / (E / 2))
    for row, col in [(0, 0), (1, 3), (4, 2)]:
        v = emb[1 + row * G + col]
        np.testing.assert_allclose(v[:E // 2], np.sin(col * omega), atol=1e-12)
        np.testing.assert_allclose(v[E // 2:E], np.cos(col * omega), atol=1e-12)
        np.testing.assert_allclose(v[E:E + E // 2], np.sin(row * omega), atol=1e-12)
        np.testing.assert_allclose(v[E + E // 2:], np.cos(row * omega), atol=1e-12)
    assert get_2d_sincos_pos_embed(D, G).shape == (G * G, D)


# ------------------------------------------------------------------------------- 1.1 - 1.4 ----
def test_mae_vit_b_keys_and_params():
    with torch.device("meta"):
        model = MaskedAutoencoderViT(min_decay=0.7)
    sd = model.state_dict()
    keys = list(sd.keys())
    assert len(keys) == 282
    assert keys[:6] == ["cls_token", "pos_embed", "decoder_cls_token", "decoder_pos_embed",
                        "patch_embed.proj.weight", "patch_embed.proj.bias"]
    assert keys[6:11] == ["skip.0.mask_token", "skip.0.fc.0.weight", "skip.0.fc.0.bias",
                          "skip.0.fc.2.weight", "skip.0.fc.2.bias"]
    assert keys[36:48] == [f"blocks.0.{n}" for n in [
        "norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
        "attn.proj.bias", "norm2.weight", "norm2.bias", "mlp.fc1.weight", "mlp.fc1.bias",
        "mlp.fc2.weight", "mlp.fc2.bias"]]
    assert keys[36 + 144:36 + 146] == ["decoder_embed.weight", "decoder_embed.bias"]
    assert keys[-4:] == ["decoder_norm.weight", "decoder_norm.bias",
                         "decoder_pred.weight", "decoder_pred.bias"]
    assert "norm.weight" not in sd and "mask_token" not in sd
    shapes = {
        "pos_embed": (1, 197, 768), "decoder_pos_embed": (1, 197, 512),
        "patch_embed.proj.weight": (768, 3, 16, 16), "skip.5.mask_token": (1, 1, 768),
        "skip.5.fc.0.weight": (512, 1280), "skip.5.fc.2.weight": (512, 512),
        "blocks.11.attn.qkv.weight": (2304, 768), "blocks.11.mlp.fc2.weight": (768, 3072),
        "decoder_embed.weight": (512, 512), "decoder_blocks.7.attn.qkv.weight": (1536, 512),
        "decoder_blocks.7.mlp.fc1.weight": (2048, 512), "decoder_pred.weight": (768, 512),
    }
    for k, s in shapes.items():
        assert tuple(sd[k].shape) == s, k
    assert _numel(model) == 117_291_008
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 117_038_848
    assert sum(p.numel() for p in model.skip.parameters()) == 5_515_776
    assert not model.pos_embed.requires_grad and not model.decoder_pos_embed.requires_grad
    assert list(model.skip_id) == [1, 3, 5, 7, 9, 11]


def test_mae_vit_l_has_12_skiplayers():
    with torch.device("meta"):
        model = MaskedAutoencoderViT(embed_dim=1024, depth=24, num_heads=16)
    assert len(model.skip) == 12
    assert list(model.skip_id) == list(range(1, 24, 2))


def test_mae_decay_table():
    with torch.device("meta"):
        model = MaskedAutoencoderViT(min_decay=0.7)
    d = [blk.decay for blk in model.blocks]
    assert all(type(a) is float and type(b) is float for a, b in d)
    np.testing.assert_allclose(d[0], [1.0, 0.986957], atol=1e-6)
    np.testing.assert_allclose(d[5], [0.869565, 0.856522], atol=1e-6)
    np.testing.assert_allclose(d[11], [0.713043, 0.7], atol=1e-6)
    assert d[0][0] == 1.0
    assert math.isclose(float(np.prod(d)), 0.017646, rel_tol=1e-4)
    assert all(blk.decay == [1.0, 1.0] for blk in model.decoder_blocks)


# ---------------------------------------------------------------------------------- 1.3 ------
def test_mae_init():
    torch.manual_seed(0)
    model = _tiny_mae()
    sd = model.state_dict()
    for k, v in sd.items():
        if k.endswith(("attn.proj.weight", "mlp.fc2.weight")) or k.startswith("decoder_pred") \
                or (k.startswith("skip.") and ".fc.2." in k):
            assert torch.all(v == 0), k
        if k.endswith(".bias") and not k.startswith("patch_embed"):
            assert torch.all(v == 0), k
    w = model.patch_embed.proj.weight
    bound = math.sqrt(6 / (w.shape[0] + w[0].numel()))
    assert w.abs().max() <= bound
    assert model.patch_embed.proj.bias.abs().max() > 0  # torch default kept
    np.testing.assert_allclose(model.pos_embed[0].numpy(),
                               get_2d_sincos_pos_embed(32, 8, cls_token=True), atol=1e-6)


def test_mae_prediction_zero_at_init():
    torch.manual_seed(0)
    model = _tiny_mae(norm_pix_loss=True)
    imgs = torch.randn(2, 3, 32, 32)
    noise = torch.rand(2, 64, generator=torch.Generator().manual_seed(1))
    loss, pred, mask, latent = model(imgs, 0.75, noise)
    assert torch.all(pred == 0)
    assert torch.isfinite(loss)


# ------------------------------------------------------------------------------- 1.6 - 1.10 ---
def test_mae_tiny_forward():
    torch.manual_seed(0)
    model = _tiny_mae(norm_pix_loss=True)
    randomize_(model, seed=3)
    imgs = torch.randn(2, 3, 32, 32)
    noise = torch.rand(2, 64, generator=torch.Generator().manual_seed(1))
    loss, pred, mask, latent = model(imgs, mask_ratio=0.75, noise=noise)
    assert pred.shape == (2, 64, 4 * 4 * 3)
    assert mask.shape == (2, 64) and torch.all(mask.sum(1) == 48)
    assert latent.shape == (2, 1 + 16, 32)
    assert torch.isfinite(loss) and loss.item() > 0
    # The kept tokens are those with the smallest noise.
    keep = torch.argsort(noise, dim=1)[:, :16]
    assert torch.all(torch.gather(mask, 1, keep) == 0)
    # Deterministic given the noise.
    loss2, pred2, _, _ = model(imgs, mask_ratio=0.75, noise=noise)
    assert torch.equal(pred, pred2) and torch.equal(loss, loss2)


def test_mae_forward_feat_matches_unmasked_encoder():
    torch.manual_seed(0)
    model = _tiny_mae()
    randomize_(model, seed=4)
    imgs = torch.randn(2, 3, 32, 32)
    noise = torch.arange(64, dtype=torch.float32).expand(2, 64)  # identity shuffle
    x, mask, ids_restore, skips = model.forward_encoder(imgs, 0.0, noise)
    feat = model.forward_feat(imgs)
    assert feat.shape == (2, 65, 32)
    assert torch.allclose(feat, x, atol=1e-6)
    assert len(skips) == 2 and skips[-1] is x
    assert torch.all(mask == 0)


def test_mae_decoder_skip_pairing():
    """Decoder block k uses SkipLayer k with the (deepest-first) popped skip (spec 1.8)."""
    torch.manual_seed(0)
    model = _tiny_mae(depth=4, decoder_depth=3)
    randomize_(model, seed=5)
    imgs = torch.randn(1, 3, 32, 32)
    noise = torch.rand(1, 64, generator=torch.Generator().manual_seed(2))
    _, _, ids_restore, skips = model.forward_encoder(imgs, 0.75, noise)
    pred = model.forward_decoder(skips, ids_restore, 1)
    assert len(skips) == 2  # caller's list untouched
    u = model.decoder_embed(torch.cat([model.decoder_cls_token,
                                       model.decoder_pos_embed[:, 1:]], 1))
    u = model.decoder_blocks[0](model.skip[0](u, skips[1], ids_restore))
    u = model.decoder_blocks[1](model.skip[1](u, skips[0], ids_restore))
    u = model.decoder_blocks[2](u)
    ref = model.decoder_pred(model.decoder_norm(u))[:, 1:]
    assert torch.allclose(pred, ref, atol=1e-6)


def test_patchify_layout():
    model = _tiny_mae()
    imgs = torch.randn(2, 3, 32, 32)
    x = model.patchify(imgs)
    p, G = 4, 8
    for n, (i, j, r, c, ch) in enumerate([(0, 0, 0, 0, 0), (2, 5, 1, 3, 2), (7, 7, 3, 3, 1)]):
        assert x[1, i * G + j, (r * p + c) * 3 + ch] == imgs[1, ch, i * p + r, j * p + c]
    assert torch.equal(model.unpatchify(x), imgs)


# ------------------------------------------------------------------------------- 4.2 - 4.4 ----
def test_sit_xl_keys_and_params():
    with torch.device("meta"):
        model = SiT()
    sd = model.state_dict()
    keys = list(sd.keys())
    assert len(keys) == 320
    assert keys[:8] == ["pos_embed", "x_embedder.proj.weight", "x_embedder.proj.bias",
                        "t_embedder.mlp.0.weight", "t_embedder.mlp.0.bias",
                        "t_embedder.mlp.2.weight", "t_embedder.mlp.2.bias",
                        "y_embedder.embedding_table.weight"]
    assert keys[-4:] == ["final_layer.linear.weight", "final_layer.linear.bias",
                         "final_layer.adaLN_modulation.1.weight",
                         "final_layer.adaLN_modulation.1.bias"]
    shapes = {
        "pos_embed": (1, 256, 1152), "x_embedder.proj.weight": (1152, 4, 2, 2),
        "t_embedder.mlp.0.weight": (1152, 256), "y_embedder.embedding_table.weight": (1001, 1152),
        "enc_blocks.13.attn.qkv.weight": (3456, 1152), "enc_blocks.0.mlp.fc1.weight": (4608, 1152),
        "enc_blocks.0.adaLN_modulation.1.weight": (6912, 1152),
        "dec_blocks.13.skip.weight": (1152, 1152), "dec_blocks.0.skip.bias": (1152,),
        "final_layer.linear.weight": (32, 1152),
        "final_layer.adaLN_modulation.1.weight": (2304, 1152),
    }
    for k, s in shapes.items():
        assert tuple(sd[k].shape) == s, k
    assert not any(k.startswith("enc_blocks.") and ".skip." in k for k in keys)
    assert len(model.enc_blocks) == 14 and len(model.dec_blocks) == 14
    assert _numel(model) == 693_725_216
    assert sum(p.numel() for n, p in model.named_parameters() if ".skip." in n) == 18_595_584
    assert not model.pos_embed.requires_grad


def test_sit_sigma_table():
    with torch.device("meta"):
        model = SiT(min_sigma=0.8)
    enc = [b.sigma for b in model.enc_blocks]
    dec = [b.sigma for b in model.dec_blocks]
    np.testing.assert_allclose(enc[0], [1.0, 0.996364], atol=1e-6)
    np.testing.assert_allclose(enc[13], [0.905455, 0.901818], atol=1e-6)
    np.testing.assert_allclose(dec[0], [0.898182, 0.894545], atol=1e-6)
    np.testing.assert_allclose(dec[13], [0.803636, 0.8], atol=1e-6)
    for b in range(28):
        np.testing.assert_allclose((enc + dec)[b], [1 - 0.4 * b / 55, 1 - 0.2 * (2 * b + 1) / 55],
                                   atol=1e-12)
    assert math.isclose(float(np.prod(enc)), 0.2410, rel_tol=1e-3)
    assert math.isclose(float(np.prod(dec)), 0.01008, rel_tol=1e-3)
    assert math.isclose(float(np.prod(enc + dec)), 0.002430, rel_tol=1e-3)


# --------------------------------------------------------------------------------- 4.3 - 4.8 --
def test_sit_timestep_embedding():
    from torch_reference import TimestepEmbedder
    t = torch.tensor([0.0, 0.3, 1.0])
    e = TimestepEmbedder.timestep_embedding(t, 256)
    f = np.exp(-math.log(10000) * np.arange(128) / 128)
    ref = np.concatenate([np.cos(t.numpy()[:, None] * f), np.sin(t.numpy()[:, None] * f)], 1)
    np.testing.assert_allclose(e.numpy(), ref, atol=1e-6)


def test_sit_output_zero_at_init():
    torch.manual_seed(0)
    model = _tiny_sit().eval()
    x = torch.randn(3, 4, 8, 8)
    out = model(x, torch.rand(3), torch.tensor([0, 5, 9]))
    assert out.shape == (3, 4, 8, 8)
    assert torch.all(out == 0)
    assert torch.all(model.x_embedder.proj.bias == 0)
    assert model.y_embedder.embedding_table.weight.shape == (11, 32)


def test_sit_tiny_forward_and_cfg():
    torch.manual_seed(0)
    model = _tiny_sit()
    randomize_(model, seed=7)
    model.eval()
    n = 2
    x = torch.randn(n, 4, 8, 8)
    t = torch.rand(n)
    y = torch.tensor([1, 7])
    out = model(x, t, y)
    assert out.shape == (n, 4, 8, 8) and torch.isfinite(out).all()
    assert out.abs().max() > 0

    x2 = torch.cat([x, x], 0)
    t2 = torch.cat([t, t], 0)
    y2 = torch.cat([y, torch.full_like(y, 10)], 0)
    cfg1 = model.forward_with_cfg(x2, t2, y2, 1.0)
    assert cfg1.shape == (2 * n, 4, 8, 8)
    uncond = model(x, t, torch.full_like(y, 10))
    assert torch.allclose(cfg1[:n, :3], out[:, :3], atol=1e-5)
    assert torch.allclose(cfg1[n:, :3], out[:, :3], atol=1e-5)
    assert torch.allclose(cfg1[:n, 3:], out[:, 3:], atol=1e-6)
    assert torch.allclose(cfg1[n:, 3:], uncond[:, 3:], atol=1e-6)

    cfg4 = model.forward_with_cfg(x2, t2, y2, 4.0)
    guided = uncond[:, :3] + 4.0 * (out[:, :3] - uncond[:, :3])
    assert torch.allclose(cfg4[:n, :3], guided, atol=1e-5)
    assert torch.allclose(cfg4[:n, 3:], out[:, 3:], atol=1e-6)

    # force_drop_ids == 1 rows use the null class even in eval mode.
    forced = model(x, t, y, force_drop_ids=torch.tensor([1, 0]))
    assert torch.allclose(forced[0], uncond[0], atol=1e-6)
    assert torch.allclose(forced[1], out[1], atol=1e-6)


def test_sit_decoder_skip_pairing():
    """Decoder block j receives the output of encoder block depth/2-1-j (spec 4.4)."""
    torch.manual_seed(0)
    model = _tiny_sit()
    randomize_(model, seed=8)
    model.eval()
    x = torch.randn(1, 4, 8, 8)
    t = torch.rand(1)
    y = torch.tensor([3])
    out = model(x, t, y)
    h = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder.embedding_table(y)
    e0 = model.enc_blocks[0](h, c)
    e1 = model.enc_blocks[1](e0, c)
    d = model.dec_blocks[0](e1, c, e1)
    d = model.dec_blocks[1](d, c, e0)
    ref = model.unpatchify(model.final_layer(d, c))[:, :4]
    assert torch.allclose(out, ref, atol=1e-6)


def test_randomize_():
    model = _tiny_mae()
    pos = model.pos_embed.clone()
    randomize_(model, seed=0)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.all(p != 0), n
    assert torch.equal(model.pos_embed, pos)
    assert abs(model.decoder_norm.weight.mean().item() - 1.0) < 0.1
    other = _tiny_mae()
    randomize_(other, seed=0)
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
