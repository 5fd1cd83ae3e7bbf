"""Rotated formats' Triton kernels (under TRITON_INTERPRET=1 on the CPU): decode attention in the rotated space,
quantize-and-pack, and their custom operators.

Attention. Random K/V are coded with the twin ``quantize_rotated`` (dense: buffers [B, Hkv, T, ...]; paged: a
pool of blocks and a shuffled table whose rows share their first block); the reference is float64 softmax(q k^T *
scale + mask) v over ``dequantize_rotated(..., rotated_space=True)`` of the attended tokens (taken before any
poisoning), then the float32 residual, with ``kernel_checks``' float32 bounds (q is float32 in the rotated space).
Poison: codes of unattended tokens 0xFF and their norms NaN, table columns not read -1, every buffer the function
allocates NaN (``poisoned_empty``): reading any of them shows. The mass is checked against float64 as well.

Keys of a centred format (a cache layer's, with the state ``make_state`` makes) have a common offset per head and a far-off first token,
so their codes mix both signs of norm (relative to the centre, and plain).

Quantize-and-pack: the codes equal the twin's bit for bit, the norms to a float16 ulp (see rotated_pack's doc);
with ``out`` views of larger buffers nothing around them is written, with ``slots`` only the named rows.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import check, check_mass, left_padding, reference
from test_kernel_unchecked import assert_same

import hf_kvplus.kernels.custom_ops as ops
from hf_kvplus.errors import ConfigError, DTypeError, ShapeError
from hf_kvplus.kernels import rotated_cpu
from hf_kvplus.kernels.dispatch import quantized_decode_attention
from hf_kvplus.kernels.quant_format import PackedKV
from hf_kvplus.kernels.rotated_attention import rotated_decode_attention_triton
from hf_kvplus.kernels.rotated_format import (
    KeyCenter,
    RotatedFormat,
    codebook,
    dequantize_rotated,
    from_plane_order,
    in_plane_order,
    odd_polynomial,
    plane_order,
    planes_of,
    quantize_rotated,
    rotation,
)
from hf_kvplus.kernels.rotated_pack import quantize_rotated_triton
from hf_kvplus.kernels.turning_center import RotaryBasis

POISON_CODE = 0xFF


# ---------------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------------


def offset_keys(L, Hkv, T, D):
    """Keys [L, Hkv, T, D] around a common offset per head, token 0 far from it on the other side (so a centred
    format codes both ways: token 0 plain, the rest relative to the centre; a random token 0 came out centred in
    every row and head about once in a hundred runs)."""
    offset = 2 * torch.randn(Hkv, 1, D)
    keys = torch.randn(L, Hkv, T, D) + offset
    keys[:, :, 0] = -3 * offset[:, 0] + torch.randn(L, Hkv, D)
    return keys


def coded(fmt, center, L, Hkv, T, D, Dv):
    """PackedKV of random keys/values [L, Hkv, T, D/Dv] coded by the twin (keys relative to the layer's `center`, or
    None), and their rotated float64 decodings."""
    turning = center is not None and center.turns is not None
    positions = torch.arange(T) if turning else None  # a turning centre: at the buffer indices (dense layouts)
    kc, kn = quantize_rotated(offset_keys(L, Hkv, T, D), fmt, "keys", positions, center)
    if center is not None and T >= 8:
        assert (kn < 0).any() and (kn >= 0).any(), "a centred format coded every key alike"
    vc, vn = quantize_rotated(torch.randn(L, Hkv, T, Dv), fmt, "values")
    k_hat = dequantize_rotated(kc, kn, fmt, "keys", torch.float64, rotated_space=True, positions=positions,
                               center=center)  # fmt: skip
    v_hat = dequantize_rotated(vc, vn, fmt, "values", torch.float64, rotated_space=True)
    return PackedKV(kc, kn, None, vc, vn, None), k_hat, v_hat


class Layout:
    """Tokens start .. start + length - 1 of B rows: dense buffers (``bs`` None, 3 spare tokens after them), or a
    pool of blocks of ``bs`` tokens with a table (row b > 0 shares row 0's first block, 2 spare blocks, 2 spare
    columns of -1). k_hat / v_hat [B, Hkv, length, D/Dv]: the attended tokens' rotated decodings; all else poisoned."""

    def __init__(self, layer, B, Hkv, D, Dv, start, length, bs=None):
        if bs is None:
            T = start + length + 3
            packed, k_hat, v_hat = coded(*layer, B, Hkv, T, D, Dv)
            live = torch.zeros(B, T, dtype=torch.bool)
            live[:, start : start + length] = True
            self.block_table = None
            self.k_hat, self.v_hat = k_hat[:, :, start : start + length], v_hat[:, :, start : start + length]
        else:
            first, last = start // bs, (start + length - 1) // bs
            used = last - first + 1
            nb = used + (B - 1) * (used - 1) + 2
            ids = torch.randperm(nb).to(torch.int32)
            table = torch.full((B, last + 3), -1, dtype=torch.int32)
            table[:, first] = ids[0]
            table[:, first + 1 : last + 1] = ids[1 : 1 + B * (used - 1)].view(B, used - 1)
            packed, k_hat, v_hat = coded(*layer, nb, Hkv, bs, D, Dv)
            tokens = torch.arange(start, start + length)
            blocks, offs = table[:, tokens // bs].long(), tokens % bs  # [B, length], [length]
            live = torch.zeros(nb, bs, dtype=torch.bool)
            live[blocks, offs.expand_as(blocks)] = True
            self.block_table = table
            self.k_hat = k_hat[blocks, :, offs.expand_as(blocks)].permute(0, 2, 1, 3)  # [B, Hkv, length, D]
            self.v_hat = v_hat[blocks, :, offs.expand_as(blocks)].permute(0, 2, 1, 3)
        for t in (packed.k, packed.v):
            t.permute(0, 2, 1, 3)[~live] = POISON_CODE
        for t in (packed.k_scale, packed.v_scale):
            t.permute(0, 2, 1, 3)[~live] = float("nan")
        self.packed, self.start, self.length = packed, start, length


def residual(B, Hkv, R, D, Dv):
    """Rotated-space residual K/V (float32) as strided views along the token dim, or (None, None)."""
    if R is None:
        return None, None
    return torch.randn(B, Hkv, R + 4, D)[:, :, 1 : 1 + R], torch.randn(B, R + 2, Hkv, Dv)[:, 2:].transpose(1, 2)


def attend(q, layer, lay, rk, rv, mask, scale, **kw):
    fmt, center = layer
    return rotated_decode_attention_triton(
        q, lay.packed, fmt, start=lay.start, length=lay.length, scale=scale, residual_k=rk, residual_v=rv,
        mask=mask, block_table=lay.block_table, key_center=center, **kw,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------

# key bits, value bits, D, Dv, B, Hkv, G, block size (None: dense), start, length, R, pads, num_splits, keys centred
ATTENTION_CASES = [
    (4, 2, 64, 64, 2, 2, 2, None, 5, 60, 5, (0, 20), 2, True),
    (3, 2, 96, 96, 2, 2, 1, None, 0, 64, None, None, None, False),  # 3 bits straddle bytes; D_PAD 128
    (2, 2, 64, 64, 2, 2, 2, 16, 3, 50, 4, (0, 999), 3, True),  # row 1 fully masked
    (4, 4, 96, 96, 2, 2, 1, 8, 7, 33, None, (4, 0), None, False),
    (8, 8, 64, 64, 2, 2, 2, None, 10, 30, 3, None, 1, True),
    (1, 1, 96, 96, 2, 2, 2, None, 0, 40, None, (0, 7), 2, False),
    (3, 2, 64, 64, 2, 2, 2, 16, 0, 45, 6, (2, 0), None, True),
    (8, 8, 96, 96, 2, 2, 1, 8, 5, 20, 2, (0, 999), 2, False),
    (1, 1, 64, 64, 1, 2, 2, 16, 9, 30, 3, None, None, True),
    (4, 2, 96, 64, 2, 2, 2, None, 2, 30, 3, (1, 0), 2, False),  # value head dim != key head dim
    (2, 2, 96, 96, 2, 2, 1, None, 4, 25, 5, (0, 27), None, True),  # row 1: only the last residual keys
    (3, 3, 96, 96, 2, 2, 2, 8, 0, 30, 2, (3, 0), 2, True),
    (4, 2, 64, 64, 2, 2, 2, None, 5, 60, 5, (0, 20), 2, "turning"),  # a turning centre (dense: buffer indices)
    (3, 2, 96, 96, 2, 2, 3, None, 0, 40, 3, None, None, "turning"),
]


def _case_id(c):
    centred = "-turning" if c[13] == "turning" else "-centred" if c[13] else ""
    return f"k{c[0]}v{c[1]}-d{c[2]}-{'dense' if c[7] is None else f'bs{c[7]}'}-g{c[6]}{centred}"


def layer_format(key_bits, value_bits, seed, centred=True, head_dim=64):
    """A cache layer's (format, state): its keys centred, the centre set by the first keys it codes (`centred=
    "turning"`: a centre turning with a RoPE of base 500 over every channel, index 0 at position 4), or plain (None)."""
    fmt = RotatedFormat(key_bits, value_bits, seed)
    if centred == "turning":
        inv_freq = 1.0 / 500.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        return fmt.for_layer(0), fmt.make_state(turns=RotaryBasis(inv_freq, head_dim), origin=4)
    return (fmt.for_layer(0), fmt.make_state()) if centred else (fmt, None)


@pytest.mark.parametrize("with_mass", [False, True], ids=["out", "mass"])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[_case_id(c) for c in ATTENTION_CASES])
def test_attention_matches_float64(seed, poisoned_empty, case, with_mass):
    kb, vb, D, Dv, B, Hkv, G, bs, start, length, R, pads, num_splits, centred = case
    layer = layer_format(kb, vb, 3, centred, D)
    fmt = layer[0]
    lay = Layout(layer, B, Hkv, D, Dv, start, length, bs)
    q = torch.randn(B, Hkv * G, D)
    rk, rv = residual(B, Hkv, R, D, Dv)
    n = length + (R or 0)
    mask = None if pads is None else left_padding(B, n, [min(p, n) for p in pads])
    scale = 1.0 / math.sqrt(D)
    before = [t.clone() for t in (lay.packed.k, lay.packed.k_scale, lay.packed.v, lay.packed.v_scale)]

    out, mass = attend(q, layer, lay, rk, rv, mask, scale, num_splits=num_splits, with_mass=with_mass)
    keys, values = lay.k_hat, lay.v_hat
    if rk is not None:
        keys, values = torch.cat([keys, rk.double()], dim=2), torch.cat([values, rv.double()], dim=2)
    what = f"{fmt} {_case_id(case)}"
    check(out, q, Dv, reference(q, keys, values, scale, mask), seed, what)
    if mask is not None:
        for b in torch.nonzero(~mask.any(dim=1)).flatten().tolist():
            assert torch.equal(out[b], torch.zeros_like(out[b])), f"{what}: fully masked row {b} not zeros"
    if with_mass:
        check_mass(mass, q, keys, scale, mask, seed, what)
    else:
        assert mass is None
    after = (lay.packed.k, lay.packed.k_scale, lay.packed.v, lay.packed.v_scale)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before, strict=True))


def test_attention_residual_only_and_all_masked(seed, poisoned_empty):
    # length 0: the coded buffers are all poison and only the residual counts; every key masked: zeros, zero mass.
    layer = layer_format(4, 2, 0)
    lay = Layout(layer, 2, 2, 64, 64, 0, 0)
    q = torch.randn(2, 4, 64)
    rk, rv = residual(2, 2, 9, 64, 64)
    mask = left_padding(2, 9, (0, 3))
    out, mass = attend(q, layer, lay, rk, rv, mask, 0.125, with_mass=True)
    check(out, q, 64, reference(q, rk, rv, 0.125, mask), seed, "residual only")
    check_mass(mass, q, rk, 0.125, mask, seed, "residual only")
    layer = layer_format(4, 2, 0)  # a centre of its own: new keys
    lay = Layout(layer, 2, 2, 64, 64, 3, 20, bs=8)
    out, mass = attend(q, layer, lay, rk, rv, torch.zeros(2, 29, dtype=torch.bool), 0.125, with_mass=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(mass, torch.zeros(2, 2, 29))


def test_attention_bad_block_id_is_masked(seed, poisoned_empty):
    # No host read of the table: a block id outside the pool in a column that is read counts as masked keys.
    layer = layer_format(4, 2, 0)
    lay = Layout(layer, 2, 1, 64, 64, 4, 30, bs=8)
    q = torch.randn(2, 2, 64)
    lay.block_table[1, 1] = lay.packed.k.shape[0]  # tokens 8..15 of row 1: keys 4..11
    lay.block_table[1, 2] = -1  # tokens 16..23: keys 12..19
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 4:20] = False
    out, _ = attend(q, layer, lay, None, None, None, 0.2)
    check(out, q, 64, reference(q, lay.k_hat, lay.v_hat, 0.2, mask), seed, "bad block ids")


def test_attention_validates(seed):
    fmt = RotatedFormat(4, 2)
    lay = Layout((fmt, None), 1, 2, 64, 64, 0, 16)
    q = torch.randn(1, 4, 64)
    kw = dict(start=0, length=16, scale=0.125)
    with pytest.raises(ConfigError, match="RotatedFormat"):
        rotated_decode_attention_triton(q, lay.packed, "k4v2", **kw)
    bad = PackedKV(lay.packed.k, lay.packed.k_scale.float(), None, lay.packed.v, lay.packed.v_scale, None)
    with pytest.raises(DTypeError, match="float16"):
        rotated_decode_attention_triton(q, bad, fmt, **kw)
    with pytest.raises(ShapeError, match="32 bytes per token"):  # 3-bit keys of D=64 need 24 bytes
        rotated_decode_attention_triton(q, lay.packed, RotatedFormat(3, 2), **kw)


# ---------------------------------------------------------------------------------------------------
# Quantize-and-pack
# ---------------------------------------------------------------------------------------------------


def assert_matches_twin(codes, norms, x, fmt, side, what, positions=None, center=None):
    """Codes bit for bit, norms to one float16 ulp (and nearly all exactly)."""
    want_codes, want_norms = quantize_rotated(x, fmt, side, positions, center)
    assert codes.dtype == torch.uint8 and norms.dtype == torch.float16
    assert torch.equal(codes, want_codes), f"{what}: codes differ from the twin's"
    ulps = (norms.view(torch.int16).int() - want_norms.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps > 0).sum() <= max(1, ulps.numel() // 100), f"{what}: norms off by {ulps.max()}"


# bits, D, dtype, B, H, T
PACK_CASES = [
    (1, 64, torch.float32, 2, 2, 19),
    (2, 96, torch.float16, 1, 3, 40),
    (3, 64, torch.bfloat16, 2, 1, 33),
    (3, 96, torch.float32, 1, 2, 17),
    (4, 64, torch.float16, 2, 2, 16),
    (4, 96, torch.bfloat16, 1, 1, 5),
    (8, 64, torch.float32, 1, 2, 24),
    (8, 96, torch.float16, 2, 1, 9),
]


@pytest.mark.parametrize("case", PACK_CASES, ids=[f"{c[0]}bit-d{c[1]}-{str(c[2])[6:]}" for c in PACK_CASES])
def test_quantize_matches_twin(seed, poisoned_empty, case):
    bits, D, dtype, B, H, T = case
    x = (torch.randn(B, H, T, D) * 3).to(dtype)
    x[0, 0, 0] = 0  # a zero vector: norm 0
    for side, fmt in (("keys", RotatedFormat(bits, 2, seed=7)), ("values", RotatedFormat(2, bits, seed=7))):
        codes, norms, zero = quantize_rotated_triton(x, fmt, side)
        assert zero is None and codes.shape == (B, H, T, D * bits // 8) and norms.shape == (B, H, T, 1)
        assert_matches_twin(codes, norms, x, fmt, side, f"{side} {fmt} {dtype}")


@pytest.mark.parametrize("case", PACK_CASES[::2], ids=[f"{c[0]}bit-d{c[1]}-{str(c[2])[6:]}" for c in PACK_CASES[::2]])
def test_quantize_centred_matches_twin(seed, poisoned_empty, case):
    # Keys relative to a given centre: x = 0 codes plain (norm -2**-24, decoded 0), x = mu relative to it (norm 0,
    # decoded mu); token 0 of the other rows, -2 mu, plain; the rest (around mu) relative to the centre.
    bits, D, dtype, B, H, T = case
    x = offset_keys(B, H, T, D).to(dtype)
    mu = x.float()[:, :, 1:].mean(dim=(0, 2))
    fmt, center = RotatedFormat(bits, 2, 7), KeyCenter.given(mu, 7)
    x[0, 0, 0], x[0, 0, 1], x[1:, :, 0] = 0, mu[0].to(dtype), (-2 * mu).to(dtype)
    codes, norms, _ = quantize_rotated_triton(x, fmt, "keys", center=center)
    assert_matches_twin(codes, norms, x, fmt, "keys", f"centred {bits} bits {dtype}", center=center)
    rounding = (x[0, 0, 1].float() - mu[0]).norm()  # of mu to x's dtype
    assert norms[0, 0, 0].item() == -(2.0**-24) and 0 <= norms[0, 0, 1].item() <= 2 * rounding + 1e-6
    assert (norms[1:, :, 0] < 0).all() and (norms[..., 2:, :] >= 0).float().mean() > 0.9, "signs of norms"
    decoded = dequantize_rotated(codes, norms, fmt, "keys", center=center)
    assert decoded[0, 0, 0].abs().max() < 1e-4 and (decoded[0, 0, 1] - mu[0]).norm() <= 3 * rounding + 1e-5
    plain = RotatedFormat(bits, 2, 7)
    err = [(dequantize_rotated(*quantize_rotated(x, f, "keys", None, c), f, "keys", center=c) - x.float())[..., 2:, :].norm()
           for f, c in ((fmt, center), (plain, None))]  # fmt: skip
    assert err[0] < err[1], f"centred keys coded worse than plain ones: {err}"


@pytest.mark.parametrize("bits", [3, 8])
def test_quantize_into_out_views(seed, bits):
    # x a strided view (tokens along dim 1 of its buffer); out = token slices of larger buffers, sentinels around.
    fmt, D, B, H, T = RotatedFormat(bits, bits, seed=1), 64, 2, 2, 21
    x = torch.randn(B, T + 2, H, D)[:, 1 : 1 + T].transpose(1, 2)
    codes_buf = torch.full((B, H, T + 10, D * bits // 8 + 4), 0xAB, dtype=torch.uint8)
    norms_buf = torch.full((B, H, T + 10, 3), -7.0, dtype=torch.float16)
    codes, norms = codes_buf[:, :, 4 : 4 + T, 2 : 2 + D * bits // 8], norms_buf[:, :, 4 : 4 + T, 1:2]
    got = quantize_rotated_triton(x, fmt, "values", out=(codes, norms, None))
    assert got[0] is codes and got[1] is norms and got[2] is None
    assert_matches_twin(codes, norms, x, fmt, "values", "out views")
    codes_buf[:, :, 4 : 4 + T, 2 : 2 + D * bits // 8] = 0xAB
    norms_buf[:, :, 4 : 4 + T, 1:2] = -7.0
    assert (codes_buf == 0xAB).all() and (norms_buf == -7.0).all(), "wrote outside the out views"


@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_into_slots(seed, bits):
    (fmt, center), D, B, H, T, N = layer_format(bits, 2, 2), 96, 2, 2, 6, 15
    x = offset_keys(B, H, T, D).to(torch.float16)
    slots = torch.stack([torch.randperm(N)[:T] for _ in range(B * H)]).view(B, H, T)
    codes = torch.full((B, H, N, D * bits // 8), 0xAB, dtype=torch.uint8)
    norms = torch.full((B, H, N, 1), -7.0, dtype=torch.float16)
    quantize_rotated_triton(x, fmt, "keys", out=(codes, norms, None), slots=slots, center=center)
    index = slots[..., None]
    assert_matches_twin(
        codes.gather(2, index.expand(B, H, T, codes.shape[-1])), norms.gather(2, index), x, fmt, "keys", "slots",
        center=center,
    )
    written = torch.zeros(B, H, N, dtype=torch.bool).scatter_(2, slots, True)
    assert (codes[~written] == 0xAB).all() and (norms[~written] == -7.0).all(), "wrote rows no slot names"


def test_quantize_validates():
    fmt = RotatedFormat(4, 2)
    x = torch.randn(1, 2, 3, 64)
    with pytest.raises(ConfigError, match="multiple of 8"):
        quantize_rotated_triton(torch.randn(1, 2, 3, 60), fmt, "keys")
    with pytest.raises(ConfigError, match="side"):
        quantize_rotated_triton(x, fmt, "queries")
    with pytest.raises(ShapeError, match=r"\[1, 2, 3, 32\]"):
        quantize_rotated_triton(x, fmt, "keys", out=(torch.empty(1, 2, 3, 16, dtype=torch.uint8),
                                                     torch.empty(1, 2, 3, 1, dtype=torch.float16), None))  # fmt: skip
    with pytest.raises(ShapeError, match="int64"):
        out = (torch.empty(1, 2, 9, 32, dtype=torch.uint8), torch.empty(1, 2, 9, 1, dtype=torch.float16), None)
        quantize_rotated_triton(x, fmt, "keys", out=out, slots=torch.zeros(1, 2, 3, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------
# Custom operators
# ---------------------------------------------------------------------------------------------------


def attention_op_args(layer, lay, q, rk, rv, mask, scale, num_splits=2):
    (fmt, center), p = layer, lay.packed
    return (
        q, p.k, p.k_scale, p.v, p.v_scale, fmt.key_bits, fmt.value_bits, fmt.seed, lay.start, lay.length, scale,
        rk, rv, mask, lay.block_table, num_splits, center.rotated,
    )  # fmt: skip


def attention_inputs(paged):
    layer = layer_format(3, 2, 5)
    lay = Layout(layer, 2, 2, 64, 64, 3, 30, bs=8 if paged else None)
    rk, rv = residual(2, 2, 4, 64, 64)
    return layer, lay, torch.randn(2, 4, 64), rk, rv, left_padding(2, 34, (0, 5))


def quantize_op_args(with_slots, centred=False):
    """The quantize op's arguments: 4-bit values (of a format with 3-bit keys), with a centre when `centred`."""
    fmt, B, H, T, N = RotatedFormat(3, 4, seed=1), 2, 2, 5, 9
    x = offset_keys(B, H, T, 64)
    rows = N if with_slots else T
    slots = torch.stack([torch.randperm(N)[:T] for _ in range(B * H)]).view(B, H, T) if with_slots else None
    codes = torch.zeros(B, H, rows, 64 * 4 // 8, dtype=torch.uint8)
    norms = torch.zeros(B, H, rows, 1, dtype=torch.float16)
    center = x[:, :, 1:].mean(dim=(0, 2)) if centred else None
    return x, fmt.key_bits, fmt.value_bits, fmt.seed, "values", codes, norms, slots, center


@pytest.mark.parametrize("case", PACK_CASES[1::3], ids=[f"{c[0]}bit-d{c[1]}-{str(c[2])[6:]}" for c in PACK_CASES[1::3]])
def test_quantize_turning_matches_twin(seed, poisoned_empty, case):
    # Keys relative to a turning centre at buffer indices 7 ..: the twin's codes (the centre set by the same keys).
    bits, D, dtype, B, H, T = case
    x = offset_keys(B, H, T, D).to(dtype)
    positions = torch.arange(7, 7 + T)
    fmt, center = layer_format(bits, 2, 7, "turning", D)
    codes, norms, _ = quantize_rotated_triton(x, fmt, "keys", positions=positions, center=center)
    assert center.mu is not None and (norms < 0).any() and (norms >= 0).any()
    assert_matches_twin(codes, norms, x, fmt, "keys", f"turning {bits} bits {dtype}", positions, center)


def test_cuda_implementations_take_a_turning_centre(seed):
    # The ops' CUDA bodies with a turning centre's tensors (under the interpreter): the attention's against the Triton
    # path reading the centre from the format, the quantize op's (the centre of each token) against Triton's codes.
    layer = layer_format(3, 2, 5, "turning")
    (fmt, center), lay = layer, Layout(layer, 2, 2, 64, 64, 3, 30)
    q, (rk, rv), mask = torch.randn(2, 4, 64), residual(2, 2, 4, 64, 64), left_padding(2, 34, (0, 5))
    kw = dict(start=3, length=30, scale=0.125, residual_k=rk, residual_v=rv, mask=mask, num_splits=2, check=False)
    want = rotated_decode_attention_triton(q, lay.packed, fmt, **kw, key_center=center)[0]
    args = (*attention_op_args(layer, lay, q, rk, rv, mask, 0.125)[:-1], None,
            center.query_weights(q, rotated=True), center.basis(33, q.device))  # fmt: skip
    assert_same(ops.rotated_decode_attention_cuda(*args), want, seed, "rotated attention, turning centre")
    plain = KeyCenter.given(center.mu, 5)  # the wrong centre: a different output
    assert not torch.allclose(rotated_decode_attention_triton(q, lay.packed, fmt, **kw, key_center=plain)[0], want,
                              atol=1e-3)  # fmt: skip

    x = offset_keys(2, 2, 12, 64)
    positions = torch.arange(20, 32)
    codes, norms, _ = quantize_rotated_triton(x, fmt, "keys", positions=positions, center=center)
    codes2, norms2 = torch.empty_like(codes), torch.empty_like(norms)
    ops.quantize_rotated_cuda(x, 3, 2, 5, "keys", codes2, norms2, None, center.at(positions, rotated=False))
    assert_same((codes2, norms2), (codes, norms), seed, "quantize_rotated, turning centre")


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("op", ["rotated_decode_attention", "rotated_decode_attention_with_mass"])
def test_opcheck_attention(seed, op, paged):
    args = attention_op_args(*attention_inputs(paged), 0.125)
    results = torch.library.opcheck(getattr(ops, op), args)
    assert set(results.values()) == {"SUCCESS"}, f"{op}: {results} (seed {seed})"


@pytest.mark.parametrize("centred", [False, True], ids=["plain", "centred"])
@pytest.mark.parametrize("with_slots", [False, True], ids=["out", "slots"])
def test_opcheck_quantize(seed, with_slots, centred):
    results = torch.library.opcheck(ops.quantize_rotated, quantize_op_args(with_slots, centred))
    assert set(results.values()) == {"SUCCESS"}, f"quantize_rotated: {results} (seed {seed})"


def test_cuda_implementations_match_the_triton_paths(seed):
    # The ops' CUDA bodies call the Triton entry points with the right arguments (on the CPU, under the interpreter):
    # bit for bit, each against the call of its own specialization (with_mass adds the scores store and the lse
    # merge, which compiled need not round the output alike; under the interpreter they do).
    layer, lay, q, rk, rv, mask = attention_inputs(paged=True)
    fmt = layer[0]
    kw = dict(start=lay.start, length=lay.length, scale=0.125, residual_k=rk, residual_v=rv, mask=mask,
              block_table=lay.block_table, num_splits=2, check=False, key_center=layer[1])  # fmt: skip
    args = attention_op_args(layer, lay, q, rk, rv, mask, 0.125)
    plain, no_mass = rotated_decode_attention_triton(q, lay.packed, fmt, **kw)
    assert no_mass is None
    want = rotated_decode_attention_triton(q, lay.packed, fmt, **kw, with_mass=True)
    assert_same(ops.rotated_decode_attention_cuda(*args), plain, seed, "rotated attention")
    assert_same(ops.rotated_decode_attention_with_mass_cuda(*args), want, seed, "rotated attention with mass")
    # The CPU implementation (the twin in the rotated space), given CPU tensors whatever the suite's device (CUDA ones
    # would dispatch to the CUDA body), agrees to float32 rounding.
    cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    check(ops.rotated_decode_attention(*cpu_args), q.cpu(), 64, plain.double().cpu(), seed, "twin op")

    for with_slots, centred in ((False, False), (True, False), (False, True), (True, True)):
        x, kb, vb, s, side, codes, norms, slots, center = quantize_op_args(with_slots, centred)
        codes2, norms2 = codes.clone(), norms.clone()
        ops.quantize_rotated_cuda(x, kb, vb, s, side, codes, norms, slots, center)
        fmt = RotatedFormat(kb, vb, s)
        quantize_rotated_triton(x, fmt, side, (codes2, norms2, None), slots, check=False,
                                center=KeyCenter.given(center, s))  # fmt: skip
        what = f"quantize_rotated slots={with_slots} centred={centred}"
        assert_same((codes, norms), (codes2, norms2), seed, what)
        assert (norms != 0).sum() == x.shape[0] * x.shape[1] * x.shape[2], "norms not written"
        assert (norms < 0).any() == centred, f"{what}: signs of norms"


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("centred", [False, True])
def test_plane_order_decode_is_the_channel_order_decode_permuted(seed, bits, D, centred):
    # What the compiled CPU twin reads (`planes=True`) against the eager decode, both in the rotated space: the same
    # numbers to float32 rounding (plane order decodes by the codebook's polynomial, channel order by its table),
    # channels in `plane_order`; a format whose planes would be short keeps channel order.
    x = offset_keys(2, 3, 9, D)
    fmt = RotatedFormat(bits, 2, 5)
    center = KeyCenter.given(x[:, :, 1:].mean(dim=(0, 2)), 5) if centred else None
    codes, norms = quantize_rotated(x, fmt, "keys", None, center)[:2]
    plain = dequantize_rotated(codes, norms, fmt, "keys", rotated_space=True, center=center)
    planes = dequantize_rotated(codes, norms, fmt, "keys", rotated_space=True, planes=True, center=center)
    order = plane_order(D, bits, x.device)
    assert sorted(order.tolist()) == list(range(D))
    torch.testing.assert_close(planes, plain[..., order], rtol=1e-6, atol=1e-6, msg=f"{bits} bits, D {D}")
    assert torch.equal(in_plane_order(plain, bits), plain[..., order]), "the view a centre is taken to plane order by"
    # and back: how the twin turns q and its output so far to channel order, to fold in a ring held rotated
    assert torch.equal(from_plane_order(plain[..., order], bits), plain)
    rotated = rotation(D, 5, x.device, plane_bits=bits)
    assert torch.equal(rotated, rotation(D, 5, x.device)[:, order]), "the rotation it attends with"
    # A plane holds at least 8 channels: the codes of one byte, or of one 12-bit half of a 3-bit word.
    assert planes_of(D, bits) == {1: 1 if D < 64 else 8, 2: 4, 3: 4, 4: 2, 8: 1}[bits]


@pytest.mark.parametrize("D", [32, 40, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_the_odd_polynomial_gives_every_centroid(D, bits):
    # The compiled CPU twin decodes a code by the codebook's polynomial (no table): in float32, as the graph
    # evaluates it (Horner's rule in t**2, then times t), every centroid to within 2e-7 of the largest.
    centroids = codebook(D, bits)[0]  # on the CPU: codebook's default device
    t = (torch.arange(2**bits, device=centroids.device) * 2 - (2**bits - 1)).float()
    coefficients = odd_polynomial(D, bits)
    assert len(coefficients) == 2 ** (bits - 1)
    p = torch.full_like(t, coefficients[-1])
    for a in reversed(coefficients[:-1]):
        p = t * t * p + a
    torch.testing.assert_close(t * p, centroids, rtol=0, atol=2e-7 * centroids.abs().max().item())


@pytest.mark.parametrize("twin", [False, True], ids=["cpu-operator", "twin"])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("bits", [(4, 2), (3, 2), (2, 4)])
@pytest.mark.parametrize("length, with_mass", [(12, False), (1030, True)])  # one twin chunk; two, masked, with mass
def test_a_residual_that_comes_rotated_is_attended_as_it_is(seed, compiled, bits, length, with_mass, twin,
                                                            monkeypatch):  # fmt: skip
    # A static storage's ring holds its tokens rotated, and its read's format says so (`with_rotated_inputs`): the
    # same attention as the plain format over the tokens as they were, eager and compiled. Compiled, the twin reads
    # the codes in plane order and the ring in channel order, folded in after the codes with q and the output so
    # far turned to channel order; past one chunk of codes the ring would otherwise join the last one. On the CPU
    # the C++ operator takes these calls where it is built; `twin` runs the twin as where it is not.
    if twin:
        monkeypatch.setattr(rotated_cpu, "_LOADED", False)
    fmt = RotatedFormat(*bits, 7)
    packed, _, _ = coded(fmt, None, 1, 2, length, 32, 32)
    # The ring's keys lie along their group's queries, so the ring takes most of the attention and a ring read wrong
    # shows past 1030 coded tokens too (random ring keys did not always: a flaky check).
    q, residual_v = torch.randn(1, 4, 32), torch.randn(1, 2, 5, 32)
    residual_k = 2 * q.view(1, 2, 2, 32).mean(2, keepdim=True) + 0.1 * torch.randn(1, 2, 5, 32)
    r = rotation(32, 7, q.device)
    mask = None
    if with_mass:
        mask = torch.rand(1, length + 5) > 0.2
        mask[:, length:] = True
    kw = dict(start=0, length=length, scale=0.2, mask=mask, with_mass=with_mass, check=False)
    attention = quantized_decode_attention

    def attend(fmt, rk, rv):
        return attention(q, packed, fmt, residual_k=rk, residual_v=rv, **kw)

    want = attend(fmt, residual_k, residual_v)  # eager: the reference
    if compiled:
        torch._dynamo.reset()
        # aot_eager: the compiled branches of the twin, traced and functionalized as inductor takes them, without
        # inductor's C++ code generation on the CPU (20-60 s a case)
        attend = torch.compile(attend, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(attend(fmt, residual_k, residual_v), want, atol=1e-5, rtol=0)
    got = attend(fmt.with_rotated_inputs(), residual_k @ r, residual_v @ r)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    wrong = attend(fmt.with_rotated_inputs(), residual_k, residual_v)
    assert not torch.allclose(wrong[0] if with_mass else wrong, want[0] if with_mass else want, atol=1e-2)
