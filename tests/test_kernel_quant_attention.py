"""Quantized decode attention: the Triton kernel (under TRITON_INTERPRET=1) and its torch twin.

Each case draws random K/V, quantizes them with ``quant_format``'s torch functions (dense: into
[B, Hkv, T, ...] buffers; paged: a pool of blocks quantized block by block, which is what scattering
block-sized chunks of quantized rows gives, since key groups never cross a block), and checks the
output against float64 softmax(q k^T * scale + mask) v over the DEQUANTIZED keys and values of the
attended tokens (``quant_format.dequantize_*``, computed before any poisoning) followed by the
full-precision residual, with the bounds of ``kernel_checks.BOUND``.

Poison. Everything outside the attended range is made NaN-producing after the reference is taken:
codes of unattended tokens are 0xFF (a NaN in e4m3), value scales/zeros of unattended tokens and key
scales/zeros of key groups holding no attended token are NaN, table columns that are not read hold -1,
and every buffer the function allocates starts as NaN (``poisoned_empty``). Reading any of them shows.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import MASS_BOUND, check, check_mass, left_padding, reference, rel_err

import hf_kvplus.kernels.quant_attention as mod
from hf_kvplus.errors import (
    ConfigError,
    DeviceError,
    DTypeError,
    KernelUnavailableError,
    KVPlusError,
    ShapeError,
)
from hf_kvplus.kernels import format_kernels, kivi_cpu, kivi_kernels, rotated_cpu
from hf_kvplus.kernels.dispatch import quantized_decode_attention
from hf_kvplus.kernels.quant_attention import (
    quantized_decode_attention_torch,
    quantized_decode_attention_triton,
    quantized_decode_attention_with_mass_torch,
    quantized_decode_attention_with_mass_triton,
)
from hf_kvplus.kernels.quant_format import (
    PackedKV,
    QuantFormat,
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
POISON_CODE = 0xFF  # e4m3fn NaN; for the integer formats the largest codes

# ---------------------------------------------------------------------------------------------------
# Layouts and references
# ---------------------------------------------------------------------------------------------------

#: The device the tests make their tensors on (torch's default: see conftest.py).
HOME = torch.get_default_device().type


def quantize(k, v, fmt, keys_per_token=False):
    """PackedKV of keys k [..., T, D] and values v [..., T, Dv], and their dequantized float32 copies (keys per
    channel over groups of tokens, or per token as the values)."""
    kc, ks, kz = (quantize_values if keys_per_token else quantize_keys)(k, fmt)
    vc, vs, vz = quantize_values(v, fmt)
    k_hat = (dequantize_values if keys_per_token else dequantize_keys)(kc, ks, kz, fmt)
    v_hat = dequantize_values(vc, vs, vz, fmt)
    assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()
    return PackedKV(kc, ks, kz, vc, vs, vz), k_hat, v_hat


def poison(packed, live_tok, live_grp):
    """Poison every slot not in live_tok (bool [L, T]) and every key group not in live_grp ([L, T // G], or
    live_tok for keys per token)."""
    for t in (packed.k, packed.v):
        t.permute(0, 2, 1, 3)[~live_tok] = POISON_CODE
    for t in (packed.v_scale, packed.v_zero):
        if t is not None:
            t.permute(0, 2, 1, 3)[~live_tok] = float("nan")
    for t in (packed.k_scale, packed.k_zero):
        if t is not None:
            t.permute(0, 2, 1, 3)[~live_grp] = float("nan")


class Dense:
    """Quantized buffers [B, Hkv, T, ...] with tokens start .. start+length-1 attended (the rest poisoned)."""

    def __init__(self, fmt, B, Hkv, D, Dv, T, start, length, keys_per_token=False):
        G = fmt.group_size
        packed, k_hat, v_hat = quantize(torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, Dv), fmt, keys_per_token)
        self.k_hat, self.v_hat = k_hat[:, :, start : start + length], v_hat[:, :, start : start + length]
        live_tok = torch.zeros(B, T, dtype=torch.bool)
        live_tok[:, start : start + length] = True
        live_grp = live_tok if keys_per_token else live_tok.view(B, T // G, G).any(dim=-1)
        poison(packed, live_tok, live_grp)
        self.packed, self.start, self.length, self.block_table = packed, start, length, None


class Paged:
    """A pool of quantized blocks and a table for `length` tokens from `start` (as paged_attention's tests).

    Row 0 gets shuffled block ids; rows 1.. share row 0's first `share` columns (beams) and get their
    own blocks for the rest. Columns outside the used ones hold -1; unused slots and groups are poisoned.
    """

    def __init__(
        self, fmt, B, Hkv, D, Dv, bs, start, length, share=1, extra_cols=2, spare_blocks=2, keys_per_token=False
    ):
        G = fmt.group_size
        first, last = start // bs, (start + length - 1) // bs
        used = last - first + 1
        share = min(share, used)
        nb = used + (B - 1) * (used - share) + spare_blocks
        ids = torch.randperm(nb).tolist()
        table = torch.full((B, last + 1 + extra_cols), -1, dtype=torch.int32)
        table[0, first : last + 1] = torch.tensor(ids[:used], dtype=torch.int32)
        pos = used
        for b in range(1, B):
            table[b, first : first + share] = table[0, first : first + share]
            table[b, first + share : last + 1] = torch.tensor(
                ids[pos : pos + used - share], dtype=torch.int32
            )
            pos += used - share
        packed, k_hat, v_hat = quantize(
            torch.randn(nb, Hkv, bs, D), torch.randn(nb, Hkv, bs, Dv), fmt, keys_per_token
        )
        # The attended tokens of each row, read slot by slot through the table.
        self.k_hat = torch.zeros(B, Hkv, length, D)
        self.v_hat = torch.zeros(B, Hkv, length, Dv)
        live_tok = torch.zeros(nb, bs, dtype=torch.bool)
        for b in range(B):
            for i in range(length):
                t = start + i
                blk, off = int(table[b, t // bs]), t % bs
                self.k_hat[b, :, i] = k_hat[blk, :, off]
                self.v_hat[b, :, i] = v_hat[blk, :, off]
                live_tok[blk, off] = True
        live_grp = live_tok if keys_per_token else live_tok.view(nb, bs // G, G).any(dim=-1)
        poison(packed, live_tok, live_grp)
        self.packed, self.start, self.length, self.block_table = packed, start, length, table


def residual(B, Hkv, R, D, Dv, dtype):
    """Residual K/V as strided views along the token dim (unit stride on the last dim), or None."""
    if R is None:
        return None, None
    kbuf = torch.randn(B, Hkv, R + 5, D).to(dtype)
    vbuf = torch.randn(B, R + 3, Hkv, Dv).to(dtype)
    return kbuf[:, :, 2 : 2 + R], vbuf[:, 1 : 1 + R].transpose(1, 2)


def full_reference(q, lay, rk, rv, scale, mask):
    k, v = lay.k_hat.double(), lay.v_hat.double()
    if rk is not None:
        k, v = torch.cat([k, rk.double()], dim=2), torch.cat([v, rv.double()], dim=2)
    return reference(q, k, v, scale, mask)


def run(fn, q, fmt, lay, scale, rk=None, rv=None, mask=None, **kw):
    return fn(
        q, lay.packed, fmt, start=lay.start, length=lay.length, scale=scale, residual_k=rk, residual_v=rv,
        mask=mask, block_table=lay.block_table, **kw,
    )  # fmt: skip


def mask_for(B, n, pads):
    """Left padding; a pad of n (or more) masks the whole row."""
    return None if pads is None else left_padding(B, n, [min(p, n) for p in pads])


# ---------------------------------------------------------------------------------------------------
# Triton kernel (interpreter) and twin on the same cases
# ---------------------------------------------------------------------------------------------------

# bits, group, dtype, B, Hkv, G, D, Dv, T (dense buffer), start, length, R, pads, num_splits
DENSE_CASES = [
    (8, 32, F32, 2, 2, 2, 64, 64, 192, 37, 120, 5, (0, 30), 2),  # start mid-group
    (4, 16, F16, 2, 1, 4, 64, 32, 128, 3, 90, None, (0, 999), None),  # row 1 fully masked
    (2, 32, BF16, 1, 2, 3, 32, 32, 160, 64, 70, 16, None, 3),
    ("fp8", 16, F32, 2, 2, 1, 32, 64, 96, 17, 60, 3, (5, 0), None),
    (4, 16, F32, 2, 1, 3, 80, 48, 96, 9, 80, 4, (3, 0), 2),  # D, Dv not powers of two: padded bytes
    (2, 16, F16, 1, 1, 2, 48, 48, 64, 15, 40, None, None, 1),  # int2, 12 bytes per token
    (8, 16, BF16, 2, 2, 2, 32, 32, 64, 0, 64, 20, (70, 2), None),  # row 0: only the last residual keys
    ("fp8", 32, F16, 1, 2, 2, 64, 64, 128, 31, 97, 8, (40,), 2),
]

# bits, group, dtype, B, Hkv, G, D, Dv, block size, start, length, R, pads, num_splits, share
PAGED_CASES = [
    (8, 16, F16, 2, 2, 2, 64, 64, 32, 21, 100, 6, (0, 17), 2, 2),  # start mid-block and mid-group
    (4, 32, F32, 2, 1, 4, 64, 64, 64, 70, 130, None, (0, 999), None, 1),
    (2, 16, BF16, 2, 2, 1, 32, 32, 16, 5, 75, 9, None, 3, 3),
    ("fp8", 16, F32, 2, 1, 3, 32, 32, 16, 40, 50, 4, (10, 0), None, 1),
    (4, 8, BF16, 1, 2, 2, 80, 48, 16, 3, 60, 2, None, 2, 0),  # padded byte tiles, paged
    ("fp8", 8, F16, 2, 2, 2, 32, 64, 8, 13, 44, None, (0, 44), 1, 2),  # row 1 fully masked
    (2, 32, F32, 2, 2, 2, 64, 32, 32, 0, 96, 12, (0, 100), 2, 1),  # row 1: only residual keys
    (8, 8, F32, 2, 1, 2, 32, 32, 8, 6, 33, 1, (2, 0), None, 2),
]


def _dense_inputs(bits, group, dtype, B, Hkv, G, D, Dv, T, start, length, R, pads):
    fmt = QuantFormat(bits, group)
    lay = Dense(fmt, B, Hkv, D, Dv, T, start, length)
    return fmt, lay, *_common(B, Hkv, G, D, Dv, length, R, pads, dtype)


def _paged_inputs(bits, group, dtype, B, Hkv, G, D, Dv, bs, start, length, R, pads, share):
    fmt = QuantFormat(bits, group)
    lay = Paged(fmt, B, Hkv, D, Dv, bs, start, length, share=share)
    return fmt, lay, *_common(B, Hkv, G, D, Dv, length, R, pads, dtype)


def _common(B, Hkv, G, D, Dv, length, R, pads, dtype):
    q = torch.randn(B, Hkv * G, D).to(dtype)
    rk, rv = residual(B, Hkv, R, D, Dv, dtype)
    mask = mask_for(B, length + (R or 0), pads)
    return q, rk, rv, mask


def _check_case(fn, q, fmt, lay, rk, rv, mask, seed, what, **kw):
    D, Dv = q.shape[-1], lay.v_hat.shape[-1]
    scale = 1.0 / math.sqrt(D)
    before = [None if t is None else t.clone() for t in vars(lay.packed).values()]
    out = run(fn, q, fmt, lay, scale, rk, rv, mask, **kw)
    check(out, q, Dv, full_reference(q, lay, rk, rv, scale, mask), seed, what)
    if mask is not None:
        for b in torch.nonzero(~mask.any(dim=1)).flatten().tolist():
            assert torch.equal(out[b], torch.zeros_like(out[b])), f"{what}: masked row {b} not zeros"
    for t, t0 in zip(vars(lay.packed).values(), before, strict=True):
        assert t is None or torch.equal(t.view(torch.uint8), t0.view(torch.uint8)), "inputs modified"


@pytest.mark.parametrize("case", DENSE_CASES, ids=[f"{c[0]}-g{c[1]}-{str(c[2])[6:]}" for c in DENSE_CASES])
def test_dense_triton(seed, poisoned_empty, case):
    *args, num_splits = case
    fmt, lay, q, rk, rv, mask = _dense_inputs(*args)
    _check_case(
        quantized_decode_attention_triton, q, fmt, lay, rk, rv, mask, seed, f"{fmt}", num_splits=num_splits
    )


@pytest.mark.parametrize("case", DENSE_CASES, ids=[f"{c[0]}-g{c[1]}-{str(c[2])[6:]}" for c in DENSE_CASES])
def test_dense_twin(seed, case):
    fmt, lay, q, rk, rv, mask = _dense_inputs(*case[:-1])
    _check_case(quantized_decode_attention_torch, q, fmt, lay, rk, rv, mask, seed, f"{fmt}")


@pytest.mark.parametrize("case", PAGED_CASES, ids=[f"{c[0]}-g{c[1]}-{str(c[2])[6:]}" for c in PAGED_CASES])
def test_paged_triton(seed, poisoned_empty, case):
    *args, num_splits, share = case
    fmt, lay, q, rk, rv, mask = _paged_inputs(*args, share)
    _check_case(
        quantized_decode_attention_triton, q, fmt, lay, rk, rv, mask, seed, f"{fmt}", num_splits=num_splits
    )


@pytest.mark.parametrize("case", PAGED_CASES, ids=[f"{c[0]}-g{c[1]}-{str(c[2])[6:]}" for c in PAGED_CASES])
def test_paged_twin(seed, case):
    *args, _, share = case
    fmt, lay, q, rk, rv, mask = _paged_inputs(*args, share)
    _check_case(quantized_decode_attention_torch, q, fmt, lay, rk, rv, mask, seed, f"{fmt}")


# Keys per token (an evicting cache's slots): bits, group, dtype, B, Hkv, G, D, Dv, T or block size, start,
# length, R, pads, paged. Starts, lengths and block sizes off the group bounds: no key group spans tokens.
PER_TOKEN_CASES = [
    (4, 32, F32, 2, 2, 2, 64, 64, 100, 0, 100, None, (0, 30), False),  # the slots' read: all of a cut buffer
    (2, 16, F16, 1, 2, 3, 32, 32, 77, 5, 61, 4, None, False),
    ("fp8", 16, BF16, 2, 1, 4, 64, 32, 70, 3, 67, None, (0, 999), False),  # row 1 fully masked
    (8, 16, F32, 2, 2, 1, 48, 48, 12, 7, 50, 3, (4, 0), True),  # paged, block size 12 (no multiple of 16)
    (4, 16, BF16, 2, 1, 2, 32, 32, 16, 9, 40, None, None, True),
]


def _per_token_inputs(bits, group, dtype, B, Hkv, G, D, Dv, T, start, length, R, pads, paged):
    fmt = QuantFormat(bits, group)
    if paged:
        lay = Paged(fmt, B, Hkv, D, Dv, T, start, length, share=1, keys_per_token=True)
    else:
        lay = Dense(fmt, B, Hkv, D, Dv, T, start, length, keys_per_token=True)
    return fmt, lay, *_common(B, Hkv, G, D, Dv, length, R, pads, dtype)


@pytest.mark.parametrize("fn", [quantized_decode_attention_triton, quantized_decode_attention_torch])
@pytest.mark.parametrize("case", PER_TOKEN_CASES, ids=[f"{c[0]}-{'paged' if c[-1] else 'dense'}-{c[8]}" for c in PER_TOKEN_CASES])
def test_keys_per_token(seed, poisoned_empty, fn, case):
    fmt, lay, q, rk, rv, mask = _per_token_inputs(*case)
    _check_case(fn, q, fmt, lay, rk, rv, mask, seed, f"{fmt} keys per token", keys_per_token=True)


def test_keys_per_token_chunked_twin(seed, monkeypatch):
    # The twin cuts per-token keys at any token (no key group to respect): chunks of 7 give one chunk's result.
    fmt, lay, q, rk, rv, mask = _per_token_inputs(4, 16, F32, 2, 2, 2, 32, 32, 90, 3, 80, 5, (0, 40), False)
    ref = full_reference(q, lay, rk, rv, 1.0, mask)
    monkeypatch.setattr(mod, "TWIN_CHUNK_TOKENS", 7)
    out = run(quantized_decode_attention_torch, q, fmt, lay, 1.0, rk, rv, mask, keys_per_token=True)
    check(out, q, 32, ref, seed, "chunks of 7")


@pytest.mark.parametrize("fn", [quantized_decode_attention_triton, quantized_decode_attention_torch])
def test_only_residual_and_only_quantized(seed, poisoned_empty, fn):
    # length 0: only the residual (the quantized buffers are all poison); an empty residual tensor
    # pair; and the query group larger than 32 (read in two chunks of the group).
    fmt = QuantFormat(4, 16)
    lay = Dense(fmt, 2, 1, 32, 32, 64, 16, 0)
    q = torch.randn(2, 40, 32)
    rk, rv = residual(2, 1, 11, 32, 32, F32)
    mask = left_padding(2, 11, (0, 4))
    _check_case(fn, q, fmt, lay, rk, rv, mask, seed, "residual only")
    lay = Dense(fmt, 2, 1, 32, 32, 64, 16, 33)
    rk, rv = residual(2, 1, 0, 32, 32, F32)
    _check_case(fn, q, fmt, lay, rk, rv, None, seed, "empty residual")
    out = run(fn, q, fmt, lay, 0.2, mask=torch.zeros(2, 33, dtype=torch.bool))
    assert out.dtype == q.dtype and torch.equal(out, torch.zeros_like(out))


def test_triton_num_splits_agree(seed, poisoned_empty):
    # 200 keys from mid-group in tiles of 64, a residual, scale 1 (a peaky softmax): the merge has to
    # rescale both launches' splits right.
    fmt = QuantFormat(4, 32)
    lay = Dense(fmt, 1, 2, 64, 64, 256, 40, 200)
    q = torch.randn(1, 4, 64)
    rk, rv = residual(1, 2, 7, 64, 64, F32)
    ref = full_reference(q, lay, rk, rv, 1.0, None)
    for num_splits in (1, 3, 64):
        out = run(quantized_decode_attention_triton, q, fmt, lay, 1.0, rk, rv, num_splits=num_splits)
        check(out, q, 64, ref, seed, f"num_splits={num_splits}")


def test_triton_bad_block_id_is_masked(seed, poisoned_empty):
    # The Triton path does not sync to check the table: a block id past the pool in a column it reads
    # counts as masked keys there.
    fmt = QuantFormat(8, 8)
    lay = Paged(fmt, 2, 1, 32, 32, 8, 4, 30, share=0)
    q = torch.randn(2, 2, 32)
    lay.block_table[1, 1] = 10**6  # tokens 8..15 of row 1: keys 4..11
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 4:12] = False
    out = run(quantized_decode_attention_triton, q, fmt, lay, 0.2)
    check(out, q, 32, full_reference(q, lay, None, None, 0.2, mask), seed, "bad block id")


# ---------------------------------------------------------------------------------------------------
# With the attention mass (H2O over quantized slots): every case above, output and mass
# ---------------------------------------------------------------------------------------------------

MASS_FNS = [quantized_decode_attention_with_mass_triton, quantized_decode_attention_with_mass_torch]
MASS_CASES = (
    [("dense", c[:-1], c[-1]) for c in DENSE_CASES]
    + [("paged", (*c[:-2], c[-1]), c[-2]) for c in PAGED_CASES]
    + [("per-token", c, None) for c in PER_TOKEN_CASES]
)
_MASS_INPUTS = {"dense": _dense_inputs, "paged": _paged_inputs, "per-token": _per_token_inputs}


#: The mass bound of the Triton path for float16/bfloat16 q. ``kernel_checks.MASS_BOUND`` (1e-5) holds for float32
#: logits of the numbers the reference sees; for half-precision q the kernel's q k^T is a "tf32" dot (DOT_PRECISION
#: in kernels/quant_attention.py), which rounds the float32 dequantized keys to 11 significant bits (2**-11 ~ 4.9e-4
#: relative per element; q, half-precision, is exact in tf32), so the logits and with them the mass carry errors of
#: that order: up to 4.2e-4 (float16) and 2.3e-4 (bfloat16) measured on an H200. About 5x that; the interpreter's
#: dots are float32 and stay under 1e-5. The twin computes in float32 on every device: MASS_BOUND.
TF32_MASS_BOUND = 2e-3


def _check_mass_case(fn, q, fmt, lay, rk, rv, mask, seed, what, **kw):
    """Output as `_check_case`; the mass against float64 over the dequantized keys, then the residual."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, mass = run(fn, q, fmt, lay, scale, rk, rv, mask, **kw)
    check(out, q, lay.v_hat.shape[-1], full_reference(q, lay, rk, rv, scale, mask), seed, what)
    keys = lay.k_hat if rk is None else torch.cat([lay.k_hat, rk.float()], dim=2)
    tf32 = fn is quantized_decode_attention_with_mass_triton and q.dtype != F32
    check_mass(mass, q, keys, scale, mask, seed, what, bound=TF32_MASS_BOUND if tf32 else MASS_BOUND)
    return out, mass


@pytest.mark.parametrize("fn", MASS_FNS, ids=["triton", "twin"])
@pytest.mark.parametrize(
    ("kind", "case", "num_splits"), MASS_CASES, ids=[f"{k}-{c[0]}-g{c[1]}-{str(c[2])[6:]}" for k, c, _ in MASS_CASES]
)
def test_with_mass(seed, poisoned_empty, fn, kind, case, num_splits):
    fmt, lay, q, rk, rv, mask = _MASS_INPUTS[kind](*case)
    kw = {"keys_per_token": True} if kind == "per-token" else {}
    if fn is quantized_decode_attention_with_mass_triton:
        kw["num_splits"] = num_splits
    _check_mass_case(fn, q, fmt, lay, rk, rv, mask, seed, f"{kind} {fmt} with mass", **kw)


@pytest.mark.parametrize("dtype", [F32, F16])
def test_triton_output_unchanged_by_mass(seed, dtype):
    # The logit stores and the log-sum-exp only add stores: the output is the plain path's, bit for bit.
    fmt, lay, q, rk, rv, mask = _dense_inputs(4, 16, dtype, 2, 2, 2, 32, 32, 128, 5, 100, 6, (0, 30))
    out, _ = run(quantized_decode_attention_with_mass_triton, q, fmt, lay, 0.2, rk, rv, mask, num_splits=3)
    assert torch.equal(out, run(quantized_decode_attention_triton, q, fmt, lay, 0.2, rk, rv, mask, num_splits=3))


@pytest.mark.parametrize("fn", MASS_FNS, ids=["triton", "twin"])
def test_with_mass_fully_masked_and_residual_only(seed, poisoned_empty, fn):
    # Every key masked: zeros out, zero mass; length 0: the mass is the residual's alone.
    fmt = QuantFormat(4, 16)
    lay = Dense(fmt, 2, 1, 32, 32, 64, 3, 40, keys_per_token=True)
    q = torch.randn(2, 3, 32)
    out, mass = run(fn, q, fmt, lay, 0.2, mask=torch.zeros(2, 40, dtype=torch.bool), keys_per_token=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(mass, torch.zeros(2, 1, 40))
    lay = Dense(fmt, 2, 1, 32, 32, 64, 16, 0)
    rk, rv = residual(2, 1, 9, 32, 32, F32)
    _check_mass_case(fn, q, fmt, lay, rk, rv, left_padding(2, 9, (0, 4)), seed, "residual only")


def test_with_mass_twin_chunks_agree(seed, monkeypatch):
    # Chunks of 16 keep every chunk's logits: the same mass as one chunk (and as the float64 reference),
    # with rows whose first chunks are all padding and a peaky softmax (scale 1).
    fmt, lay, q, rk, rv, mask = _per_token_inputs(4, 16, F32, 3, 2, 2, 32, 32, 90, 3, 80, 5, (0, 40, 70), False)
    kw = dict(keys_per_token=True)
    whole = run(quantized_decode_attention_with_mass_torch, q, fmt, lay, 1.0, rk, rv, mask, **kw)
    monkeypatch.setattr(mod, "TWIN_CHUNK_TOKENS", 16)
    out, mass = run(quantized_decode_attention_with_mass_torch, q, fmt, lay, 1.0, rk, rv, mask, **kw)
    check(out, q, 32, full_reference(q, lay, rk, rv, 1.0, mask), seed, "chunks of 16")
    check_mass(mass, q, torch.cat([lay.k_hat, rk.float()], dim=2), 1.0, mask, seed, "chunks of 16")
    assert rel_err(mass, whole[1].double()) < 1e-5


@pytest.mark.usefixtures("on_cpu")
def test_with_mass_dispatcher_uses_torch_twin_on_cpu(seed, monkeypatch):
    monkeypatch.setattr(rotated_cpu, "_LOADED", False)  # as where the CPU operators cannot be built: the twin
    fmt, lay, q, rk, rv, mask = _per_token_inputs(4, 16, F32, 2, 2, 2, 32, 32, 50, 0, 50, None, (0, 7), False)
    expected = run(quantized_decode_attention_with_mass_torch, q, fmt, lay, 0.2, mask=mask, keys_per_token=True)

    def boom(*a, **kw):
        raise AssertionError("the Triton path must not run for CPU tensors")

    monkeypatch.setattr(kivi_kernels, "quantized_decode_attention_with_mass_triton", boom)
    out, mass = run(quantized_decode_attention, q, fmt, lay, 0.2, mask=mask, keys_per_token=True, with_mass=True)
    assert torch.equal(out, expected[0]) and torch.equal(mass, expected[1])
    with pytest.raises(ShapeError, match="mask"):
        run(quantized_decode_attention, q, fmt, lay, 0.2, mask=mask[:, 1:], keys_per_token=True, with_mass=True)


# ---------------------------------------------------------------------------------------------------
# Torch twin: chunking, dispatcher
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("paged", [False, True])
def test_twin_chunks_agree(seed, monkeypatch, paged, chunk):
    # Chunks of 16 (one key group / one block; residual chunks of 16) or 64 (the last chunk's 25 keys and the 37 of
    # the residual in one step) give the single-chunk result: rows whose first chunks are all padding, a random
    # mask, a peaky softmax (scale 1).
    fmt = QuantFormat(4, 8)
    B, Hkv, G, D, length, R = 3, 2, 2, 32, 150, 37
    if paged:
        lay = Paged(fmt, B, Hkv, D, D, 16, 11, length, share=3)
    else:
        lay = Dense(fmt, B, Hkv, D, D, 176, 11, length)
    q = torch.randn(B, Hkv * G, D)
    rk, rv = residual(B, Hkv, R, D, D, F32)
    mask = left_padding(B, length + R, (0, 100, length + 20))
    mask[0] = torch.rand(length + R) < 0.6
    mask[0, -1] = True
    ref = full_reference(q, lay, rk, rv, 1.0, mask)
    whole = run(quantized_decode_attention_torch, q, fmt, lay, 1.0, rk, rv, mask)
    check(whole, q, D, ref, seed, "one chunk")
    monkeypatch.setattr(mod, "TWIN_CHUNK_TOKENS", chunk)
    chunked = run(quantized_decode_attention_torch, q, fmt, lay, 1.0, rk, rv, mask)
    check(chunked, q, D, ref, seed, f"chunks of {chunk}")
    assert rel_err(chunked, whole.double()) < 1e-5


def test_twin_memory_is_per_chunk(monkeypatch):
    # The twin dequantizes one chunk at a time: no dequantize call sees more than the chunk's keys.
    fmt = QuantFormat(2, 16)
    lay = Dense(fmt, 1, 1, 32, 32, 512, 5, 500)
    seen = []
    real = QuantFormat.dequantize

    def dequantize(self, codes, *a, **kw):
        seen.append(codes.shape[-2])
        return real(self, codes, *a, **kw)

    monkeypatch.setattr(QuantFormat, "dequantize", dequantize)
    monkeypatch.setattr(mod, "TWIN_CHUNK_TOKENS", 64)
    q = torch.randn(1, 1, 32)
    out = run(quantized_decode_attention_torch, q, fmt, lay, 0.3)
    check(out, q, 32, full_reference(q, lay, None, None, 0.3, None), 0, "chunked")
    assert len(seen) == 2 * 8 and max(seen) <= 64


@pytest.mark.usefixtures("on_cpu")
def test_dispatcher_uses_torch_twin_on_cpu(seed, monkeypatch):
    monkeypatch.setattr(rotated_cpu, "_LOADED", False)  # as where the CPU operators cannot be built: the twin
    fmt = QuantFormat(4, 16)
    lay = Dense(fmt, 2, 2, 32, 32, 64, 3, 50)
    q = torch.randn(2, 4, 32)
    rk, rv = residual(2, 2, 4, 32, 32, F32)
    expected = run(quantized_decode_attention_torch, q, fmt, lay, 0.2, rk, rv)
    calls = []

    the_twin = format_kernels._twin

    def twin(*a, **kw):
        calls.append(kw["planes"])
        return the_twin(*a, **kw)

    def boom(*a, **kw):
        raise AssertionError("the Triton path must not run for CPU tensors")

    monkeypatch.setattr(kivi_kernels, "quantized_decode_attention_triton", boom)
    monkeypatch.setattr(format_kernels, "_twin", twin)
    out = run(quantized_decode_attention, q, fmt, lay, 0.2, rk, rv, num_splits=3)
    assert calls == [False]  # eager: the codes' planes are not kept
    assert torch.equal(out, expected)
    with pytest.raises(ConfigError, match="num_splits"):
        run(quantized_decode_attention, q, fmt, lay, 0.2, rk, rv, num_splits=0)


@pytest.mark.usefixtures("on_cpu")
def test_triton_unavailable(monkeypatch):
    fmt = QuantFormat(8, 16)
    lay = Dense(fmt, 1, 1, 16, 16, 16, 0, 4)
    q = torch.randn(1, 1, 16)
    monkeypatch.setattr(mod, "_is_interpreted", lambda fn: False)
    with pytest.raises(KernelUnavailableError, match="cpu"):
        run(quantized_decode_attention_triton, q, fmt, lay, 1.0)
    monkeypatch.setattr(mod, "triton", None)
    with pytest.raises(KernelUnavailableError, match="triton"):
        run(quantized_decode_attention_triton, q, fmt, lay, 1.0)


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------

I4 = QuantFormat(4, 16)


def _packed(L=2, Hkv=2, T=64, D=32, Dv=32, fmt=I4, **overrides):
    """Valid int4/g16 buffers [L, Hkv, T, ...] (or fmt's), with fields replaced by `overrides`."""
    per, G = fmt.per_byte, fmt.group_size
    zero = not fmt.is_float
    fields = {
        "k": torch.zeros(L, Hkv, T, D // per, dtype=torch.uint8),
        "k_scale": torch.ones(L, Hkv, T // G, D, dtype=torch.float16),
        "k_zero": torch.zeros(L, Hkv, T // G, D, dtype=torch.float16) if zero else None,
        "v": torch.zeros(L, Hkv, T, Dv // per, dtype=torch.uint8),
        "v_scale": torch.ones(L, Hkv, T, Dv // G, dtype=torch.float16),
        "v_zero": torch.zeros(L, Hkv, T, Dv // G, dtype=torch.float16) if zero else None,
    }
    fields.update(overrides)
    return PackedKV(**fields)


def _args(**overrides):
    """Valid dense inputs: B=2, Hq=4, Hkv=2, D=Dv=32, T=64, tokens 5..24, a residual of 3 (mask [2, 23])."""
    args = {
        "q": torch.randn(2, 4, 32),
        "packed": _packed(),
        "fmt": I4,
        "start": 5,
        "length": 20,
        "scale": 0.5,
        "residual_k": torch.randn(2, 2, 3, 32),
        "residual_v": torch.randn(2, 2, 3, 32),
        "mask": None,
        "block_table": None,
    }
    args.update(overrides)
    return args


def _paged_args(**overrides):
    """Valid paged inputs: 6 blocks of 16, table [2, 3], tokens 5..24."""
    args = {
        "packed": _packed(L=6, T=16),
        "block_table": torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
    }
    args.update(overrides)
    return _args(**args)


U8, H = torch.uint8, torch.float16
FP8 = QuantFormat("fp8", 16)

VALIDATION_CASES = [
    ("fmt type", ConfigError, _args(fmt=(4, 16)), ["QuantFormat", "tuple"]),
    ("packed type", DTypeError, _args(packed=(1, 2)), ["PackedKV", "tuple"]),
    ("q type", DTypeError, _args(q=[1.0]), ["list"]),
    ("q ndim", ShapeError, _args(q=torch.randn(2, 4, 1, 32)), ["3", "4"]),
    ("q dtype", DTypeError, _args(q=torch.randn(2, 4, 32, dtype=torch.float64)), ["float64"]),
    ("codes dtype", DTypeError, _args(packed=_packed(k=torch.zeros(2, 2, 64, 16, dtype=torch.int8))), ["uint8", "int8"]),
    ("k_scale dtype", DTypeError, _args(packed=_packed(k_scale=torch.ones(2, 2, 4, 32))), ["k_scale", "float32"]),
    ("v_zero dtype", DTypeError, _args(packed=_packed(v_zero=torch.zeros(2, 2, 64, 2, dtype=BF16))), ["v_zero", "bfloat16"]),
    ("codes type", DTypeError, _args(packed=_packed(v=None)), ["v", "NoneType"]),
    ("int zero missing", ConfigError, _args(packed=_packed(k_zero=None)), ["int4/g16", "k_zero", "None"]),
    ("fp8 zero given", ConfigError, _args(fmt=FP8, packed=_packed(fmt=FP8, v_zero=torch.zeros(2, 2, 64, 2, dtype=H))), ["fp8/g16", "v_zero"]),
    ("codes ndim", ShapeError, _args(packed=_packed(k=torch.zeros(2, 64, 16, dtype=U8))), ["4", "3"]),
    ("code bytes", ShapeError, _args(packed=_packed(k=torch.zeros(2, 2, 64, 32, dtype=U8))), ["32 bytes", "D=32", "16"]),
    ("k_scale rows", ShapeError, _args(packed=_packed(k_scale=torch.ones(2, 2, 5, 32, dtype=H))), ["[2, 2, 4, 32]", "[2, 2, 5, 32]"]),
    ("k_zero heads", ShapeError, _args(packed=_packed(k_zero=torch.ones(2, 1, 4, 32, dtype=H))), ["[2, 2, 4, 32]", "[2, 1, 4, 32]"]),
    ("v tokens", ShapeError, _args(packed=_packed(v=torch.zeros(2, 2, 60, 16, dtype=U8))), ["[2, 2, 64, 16]", "[2, 2, 60, 16]"]),
    ("v_scale groups", ShapeError, _args(packed=_packed(v_scale=torch.ones(2, 2, 64, 4, dtype=H))), ["[2, 2, 64, 2]", "[2, 2, 64, 4]"]),
    ("head dim vs group", ConfigError, _args(q=torch.randn(2, 4, 40), packed=_packed(D=40)), ["16", "40"]),
    ("head dim vs bytes", ConfigError, _args(fmt=QuantFormat(2, 1), q=torch.randn(2, 4, 34), packed=_packed(D=32, fmt=QuantFormat(2, 1))), ["34", "4"]),
    ("head dim small", ShapeError, _args(q=torch.randn(2, 4, 8), packed=_packed(D=8, Dv=8, fmt=QuantFormat(8, 8)), fmt=QuantFormat(8, 8), residual_k=None, residual_v=None), ["D=8", "16", "256"]),
    ("value dim large", ShapeError, _args(packed=_packed(Dv=512), residual_k=None, residual_v=None), ["512", "256"]),
    ("group", ShapeError, _args(q=torch.randn(2, 6, 32), packed=_packed(Hkv=4), residual_k=None, residual_v=None), ["6", "4"]),
    ("batch", ShapeError, _args(packed=_packed(L=3)), ["B=2", "3 rows"]),
    ("start negative", ConfigError, _args(start=-1), ["-1"]),
    ("start float", ConfigError, _args(start=5.0), ["5.0"]),
    ("length negative", ConfigError, _args(length=-3), ["-3"]),
    ("length bool", ConfigError, _args(length=True), ["True"]),
    ("past the buffer", ShapeError, _args(start=30, length=40), ["30..69", "T=64"]),
    ("past the last group", ShapeError, _args(packed=_packed(T=60, k_scale=torch.ones(2, 2, 3, 32, dtype=H), k_zero=torch.ones(2, 2, 3, 32, dtype=H)), start=40, length=10), ["40..49", "3 key groups", "48"]),
    ("residual half", ConfigError, _args(residual_v=None), ["residual_k", "residual_v"]),
    ("residual dtype", DTypeError, _args(residual_k=torch.randn(2, 2, 3, 32, dtype=H)), ["residual_k", "float32", "float16"]),
    ("residual heads", ShapeError, _args(residual_v=torch.randn(2, 1, 3, 32)), ["residual_v", "[2, 2, R, 32]", "[2, 1, 3, 32]"]),
    ("residual dim", ShapeError, _args(residual_k=torch.randn(2, 2, 3, 16)), ["residual_k", "[2, 2, R, 32]", "[2, 2, 3, 16]"]),
    ("residual ndim", ShapeError, _args(residual_k=torch.randn(2, 3, 32)), ["residual_k", "4", "3"]),
    ("residual lengths", ShapeError, _args(residual_v=torch.randn(2, 2, 4, 32)), ["R=3", "4"]),
    ("residual device", DeviceError, _args(residual_v=torch.randn(2, 2, 3, 32, device="meta")), ["meta", HOME]),
    ("no keys", ShapeError, _args(length=0, residual_k=None, residual_v=None), ["length=0", "R=0"]),
    ("no keys, empty residual", ShapeError, _args(length=0, residual_k=torch.randn(2, 2, 0, 32), residual_v=torch.randn(2, 2, 0, 32)), ["length=0", "R=0"]),
    ("mask shape", ShapeError, _args(mask=torch.ones(2, 20, dtype=torch.bool)), ["[2, 23]", "[2, 20]"]),
    ("mask dtype", DTypeError, _args(mask=torch.ones(2, 23)), ["float32", "bool"]),
    ("mask device", DeviceError, _args(mask=torch.ones(2, 23, dtype=torch.bool, device="meta")), [HOME, "meta"]),
    ("scale", ConfigError, _args(scale=float("inf")), ["inf"]),
    ("packed device", DeviceError, _args(packed=_packed(v_scale=torch.ones(2, 2, 64, 2, dtype=H, device="meta"))), ["v_scale", "meta", HOME]),
    ("paged block vs group", ConfigError, _paged_args(packed=_packed(L=6, T=24, k_scale=torch.ones(6, 2, 1, 32, dtype=H), k_zero=torch.ones(6, 2, 1, 32, dtype=H))), ["24", "16"]),
    ("paged pool mismatch", ShapeError, _paged_args(packed=_packed(L=6, T=16, v=torch.zeros(5, 2, 16, 16, dtype=U8))), ["[6, 2, 16, 16]", "[5, 2, 16, 16]"]),
    ("table dtype", DTypeError, _paged_args(block_table=torch.zeros(2, 3, dtype=torch.int64)), ["int64", "int32"]),
    ("table type", DTypeError, _paged_args(block_table=[[0, 1, 2], [3, 4, 5]]), ["list"]),
    ("table ndim", ShapeError, _paged_args(block_table=torch.zeros(6, dtype=torch.int32)), ["2", "1"]),
    ("table batch", ShapeError, _paged_args(block_table=torch.zeros(3, 3, dtype=torch.int32)), ["B=2", "3 rows"]),
    ("table device", DeviceError, _paged_args(block_table=torch.zeros(2, 3, dtype=torch.int32, device="meta")), [HOME, "meta"]),
    ("past the table", ShapeError, _paged_args(start=30, length=20), ["30..49", "4", "3 columns", "48"]),
    ("per-token keys, per-channel scales", ShapeError, _args(keys_per_token=True), ["k_scale", "[2, 2, 64, 2]", "[2, 2, 4, 32]"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "fn", [quantized_decode_attention, quantized_decode_attention_torch, quantized_decode_attention_triton]
)
@pytest.mark.parametrize("name, exc, args, numbers", VALIDATION_CASES, ids=[c[0] for c in VALIDATION_CASES])
def test_validation_errors(fn, name, exc, args, numbers):
    args = dict(args)
    q, packed, fmt = args.pop("q"), args.pop("packed"), args.pop("fmt")
    with pytest.raises(exc) as info:
        fn(q, packed, fmt, **args)
    assert isinstance(info.value, KVPlusError)
    for n in numbers:
        assert n in str(info.value), f"{name}: {n!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("make", [_args, _paged_args], ids=["dense", "paged"])
@pytest.mark.parametrize(
    "fn", [quantized_decode_attention, quantized_decode_attention_torch, quantized_decode_attention_triton]
)
def test_valid_args_pass(seed, fn, make):
    # The base inputs of the error cases are valid: each error above comes from its one change.
    args = make()
    out = fn(args.pop("q"), args.pop("packed"), args.pop("fmt"), **args)
    assert out.shape == (2, 4, 32) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "fn", [quantized_decode_attention, quantized_decode_attention_torch, quantized_decode_attention_triton]
)
@pytest.mark.parametrize("num_splits", [0, -2, 1.5, True])
def test_bad_num_splits(fn, num_splits):
    args = _args()
    with pytest.raises(ConfigError, match="num_splits"):
        fn(args.pop("q"), args.pop("packed"), args.pop("fmt"), **args, num_splits=num_splits)


@pytest.mark.parametrize("fn", [quantized_decode_attention, quantized_decode_attention_torch])
@pytest.mark.parametrize("bad, numbers", [(-1, ["-1", "0..5"]), (6, ["6", "0..5"])])
def test_twin_checks_block_ids_it_reads(request, fn, bad, numbers):
    # Columns 0..1 are read for tokens 5..24; a -1 or a block past the pool there is an error, while
    # an unread column may hold anything. The dispatcher reaches the twin with CPU tensors: it sends CUDA ones to
    # Triton, which reads no table value (a bad id there counts as masked keys: test_triton_bad_block_id_is_masked).
    if fn is quantized_decode_attention:
        request.getfixturevalue("on_cpu")
    table = torch.tensor([[0, 1, -7], [3, 4, 99]], dtype=torch.int32)
    args = _paged_args(block_table=table)
    q, packed, fmt = args.pop("q"), args.pop("packed"), args.pop("fmt")
    fn(q, packed, fmt, **args)
    table[1, 1] = bad
    with pytest.raises(ShapeError) as info:
        fn(q, packed, fmt, **args)
    for n in numbers + ["0..1"]:
        assert n in str(info.value)


# ---------------------------------------------------------------------------------------------------
# The C++ operator on the CPU (kernels/kivi_cpu.py): every case above, through the dispatcher
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def cpu_op(monkeypatch):
    """CPU tensors, the operator built, and the twin made to fail: what runs is the operator."""
    if not rotated_cpu.available():
        pytest.skip("no C++ toolchain here: the CPU operators cannot be built (the twin's tests cover this path)")

    def boom(*a, **kw):
        raise AssertionError("the twin ran where the CPU operator should have")

    monkeypatch.setattr(format_kernels, "_twin", boom)
    with torch.device("cpu"):
        yield


def _op(q, packed, fmt, **kw):
    kw.pop("num_splits", None)
    return quantized_decode_attention(q, packed, fmt, **kw)


def _op_with_mass(q, packed, fmt, **kw):
    kw.pop("num_splits", None)
    return quantized_decode_attention(q, packed, fmt, with_mass=True, **kw)


@pytest.mark.usefixtures("cpu_op")
@pytest.mark.parametrize("case", DENSE_CASES, ids=[f"{c[0]}-g{c[1]}-{str(c[2])[6:]}" for c in DENSE_CASES])
def test_dense_cpu_op(seed, case):
    fmt, lay, q, rk, rv, mask = _dense_inputs(*case[:-1])
    _check_case(_op, q, fmt, lay, rk, rv, mask, seed, f"{fmt} CPU operator")


@pytest.mark.usefixtures("cpu_op")
@pytest.mark.parametrize("case", PAGED_CASES, ids=[f"{c[0]}-g{c[1]}-{str(c[2])[6:]}" for c in PAGED_CASES])
def test_paged_cpu_op(seed, case):
    *args, _, share = case
    fmt, lay, q, rk, rv, mask = _paged_inputs(*args, share)
    _check_case(_op, q, fmt, lay, rk, rv, mask, seed, f"{fmt} paged CPU operator")


@pytest.mark.usefixtures("cpu_op")
@pytest.mark.parametrize("case", PER_TOKEN_CASES, ids=[f"{c[0]}-{'paged' if c[-1] else 'dense'}-{c[8]}" for c in PER_TOKEN_CASES])
def test_keys_per_token_cpu_op(seed, case):
    fmt, lay, q, rk, rv, mask = _per_token_inputs(*case)
    _check_case(_op, q, fmt, lay, rk, rv, mask, seed, f"{fmt} keys per token, CPU operator", keys_per_token=True)


@pytest.mark.usefixtures("cpu_op")
@pytest.mark.parametrize(
    ("kind", "case", "num_splits"), MASS_CASES, ids=[f"{k}-{c[0]}-g{c[1]}-{str(c[2])[6:]}" for k, c, _ in MASS_CASES]
)
def test_with_mass_cpu_op(seed, kind, case, num_splits):
    fmt, lay, q, rk, rv, mask = _MASS_INPUTS[kind](*case)
    kw = {"keys_per_token": True} if kind == "per-token" else {}
    _check_mass_case(_op_with_mass, q, fmt, lay, rk, rv, mask, seed, f"{kind} {fmt} with mass, CPU operator", **kw)


@pytest.mark.usefixtures("cpu_op")
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("bits", [4, "fp8"])
def test_cpu_op_spans_over_threads(seed, bits, threads):
    # Long contexts are split into spans of keys per (row, KV head), merged at the end: with 1, 2 and 4 threads
    # (1, 2 and 4 spans of a row of 3000 keys), rows of different lengths (left padding, one row all but the
    # residual masked) give the float64 reference, output and mass.
    fmt, lay, q, rk, rv, mask = _dense_inputs(bits, 32, F32, 3, 1, 3, 64, 64, 3008, 5, 3000, 7, (0, 1100, 3000))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_mass_case(_op_with_mass, q, fmt, lay, rk, rv, mask, seed, f"{threads} threads")
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("cpu_op")
def test_cpu_op_checks_what_the_twin_checks():
    # check=True: the twin's typed errors, the table's block ids among them (the operator reads them unchecked).
    fmt = QuantFormat(8, 8)
    lay = Paged(fmt, 2, 1, 32, 32, 8, 4, 30, share=0)
    q = torch.randn(2, 2, 32)
    with pytest.raises(ShapeError, match="mask"):
        run(_op, q, fmt, lay, 0.2, mask=torch.ones(2, 29, dtype=torch.bool))
    lay.block_table[1, 1] = 10**6
    with pytest.raises(ShapeError, match="1000000"):
        run(_op, q, fmt, lay, 0.2)


def test_cpu_op_traced_is_one_call(seed):
    # Compiled on the CPU (check=False, as the storages call it), the dispatcher's call is the operator, one node,
    # with the eager result.
    if not rotated_cpu.available():
        pytest.skip("no C++ toolchain here: the CPU operators cannot be built")
    with torch.device("cpu"):
        fmt, lay, q, rk, rv, mask = _dense_inputs(4, 16, F32, 2, 2, 2, 32, 32, 128, 5, 100, 6, (0, 30))

        def step(q, rk, rv, mask):
            return run(quantized_decode_attention, q, fmt, lay, 0.2, rk, rv, mask, check=False)

        graphs = []

        def backend(gm, inputs):
            graphs.append(gm)
            return gm.forward

        eager = step(q, rk, rv, mask)
        compiled = torch.compile(step, fullgraph=True, backend=backend)(q, rk, rv, mask)
    assert torch.allclose(compiled, eager, atol=1e-6)
    ops = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("hf_kvplus_cpu.kivi_decode" in op for op in ops) == 1, ops
    assert kivi_cpu.supports(q)
