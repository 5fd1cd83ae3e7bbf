"""Decode attention: the Triton kernel (under TRITON_INTERPRET=1) and its torch twin against float64.

Inputs are fresh random numbers each run (the seed comes from os.urandom and is printed in failure
messages), every buffer the function allocates is NaN-poisoned (torch.empty is wrapped), and the
error is ||out - ref|| / ||ref|| against an explicit float64 softmax(q k^T * scale + mask) v.

Bounds. float32: the interpreter's tl.dot is a float32 matmul (measured about 3e-7), and on GPUs the
kernel uses input_precision="ieee" for float32, so 1e-5 leaves room for summation order over long
rows. float16 / bfloat16: the error is dominated by rounding the output to 11 / 8 significant bits
(measured about 2e-4 / 3e-3; the interpreter truncates float32 -> bfloat16 instead of rounding to
nearest, which doubles the bf16 figure compared with a GPU); bounds 2e-3 / 1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import check, left_padding, reference

import hf_kvplus.kernels.decode_attention as mod
import hf_kvplus.kernels.dispatch as dispatch
from hf_kvplus.errors import (
    ConfigError,
    DeviceError,
    DTypeError,
    KernelUnavailableError,
    KVPlusError,
    ShapeError,
)
from hf_kvplus.kernels.decode_attention import (
    decode_attention_torch,
    decode_attention_triton,
    pick_num_splits,
)
from hf_kvplus.kernels.dispatch import decode_attention

#: The device the tests make their tensors on (torch's default: see conftest.py).
HOME = torch.get_default_device().type


def make(B, Hkv, G, N, D, Dv, dtype):
    q = torch.randn(B, Hkv * G, D, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, dtype=dtype)
    v = torch.randn(B, Hkv, N, Dv, dtype=dtype)
    return q, k, v


# ---------------------------------------------------------------------------------------------------
# Triton kernel (interpreter)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, B, Hkv, G, N, D, Dv, num_splits, pads",
    [
        (torch.float32, 2, 2, 1, 130, 64, 64, 1, None),
        (torch.float32, 2, 2, 3, 200, 80, 80, 3, (0, 37)),
        (torch.float16, 2, 2, 4, 100, 64, 64, None, (5, 0)),
        (torch.bfloat16, 1, 1, 8, 150, 64, 64, 2, None),
        (torch.float16, 1, 2, 3, 70, 80, 48, 1000, (20,)),  # Dv != D, far more splits than tiles
        (torch.bfloat16, 2, 1, 4, 90, 80, 80, None, (0, 60)),
        (torch.float32, 1, 1, 40, 70, 64, 64, 2, None),  # G > 32: the group is read in two chunks
    ],
)
def test_triton_matches_reference(seed, poisoned_empty, dtype, B, Hkv, G, N, D, Dv, num_splits, pads):
    q, k, v = make(B, Hkv, G, N, D, Dv, dtype)
    mask = None if pads is None else left_padding(B, N, pads)
    scale = 1.0 / math.sqrt(D)
    out = decode_attention_triton(q, k, v, scale=scale, mask=mask, num_splits=num_splits)
    check(out, q, v.shape[-1], reference(q, k, v, scale, mask), seed)


@pytest.mark.parametrize("D", [16, 96, 128, 256])
def test_triton_head_dims(seed, poisoned_empty, D):
    q, k, v = make(1, 1, 2, 45, D, D, torch.float32)
    scale = 1.0 / math.sqrt(D)
    out = decode_attention_triton(q, k, v, scale=scale, num_splits=2)
    check(out, q, v.shape[-1], reference(q, k, v, scale), seed, f"D={D}")


def test_triton_num_splits_agree(seed, poisoned_empty):
    # 260 keys = 5 tiles of 64 (the last one partial). scale=1 makes the softmax peaky, so the merge
    # has to get the max rescaling right.
    q, k, v = make(1, 2, 2, 260, 64, 64, torch.float32)
    ref = reference(q, k, v, 1.0)
    for num_splits in (1, 2, 3, 5, 64):
        out = decode_attention_triton(q, k, v, scale=1.0, num_splits=num_splits)
        check(out, q, v.shape[-1], ref, seed, f"num_splits={num_splits}")


def test_triton_non_contiguous_views(seed, poisoned_empty):
    B, Hkv, G, N, D = 2, 2, 3, 75, 64
    q = torch.randn(B, Hkv * G, D)
    # A cache buffer with room for 128 tokens, of which N are filled.
    kbuf = torch.randn(B, Hkv, 128, D)
    vbuf = torch.randn(B, Hkv, 128, D)
    k, v = kbuf[:, :, :N], vbuf[:, :, :N]
    assert not k.is_contiguous()
    mask = left_padding(B, N, (0, 9))
    kbuf_before, vbuf_before = kbuf.clone(), vbuf.clone()
    out = decode_attention_triton(q, k, v, scale=0.125, mask=mask, num_splits=2)
    check(out, q, v.shape[-1], reference(q, k, v, 0.125, mask), seed, "[:, :, :N] view")
    assert torch.equal(kbuf, kbuf_before) and torch.equal(vbuf, vbuf_before)

    # Token-major storage [B, N, H, D] seen as [B, H, N, D], and a query that is a strided slice.
    kt = torch.randn(B, 128, Hkv, D).transpose(1, 2)[:, :, :N]
    vt = torch.randn(B, 128, Hkv, D).transpose(1, 2)[:, :, :N]
    qs = torch.randn(B, 2 * Hkv * G, D)[:, ::2]
    out = decode_attention_triton(qs, kt, vt, scale=0.125, mask=mask, num_splits=1)
    check(out, qs, vt.shape[-1], reference(qs, kt, vt, 0.125, mask), seed, "token-major view")

    # Head dim not unit-stride: the wrapper makes a contiguous copy.
    kd = torch.randn(B, Hkv, D, N).transpose(-1, -2)
    assert kd.stride(-1) != 1
    out = decode_attention_triton(q, kd, v, scale=0.125, num_splits=2)
    check(out, q, v.shape[-1], reference(q, kd, v, 0.125), seed, "strided head dim")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_padding_and_fully_masked_row(seed, poisoned_empty, dtype):
    # 200 keys = 4 tiles of 64; with 4 splits, row 1's first two splits see only padding and row 2
    # sees nothing at all.
    B, Hkv, G, N, D = 3, 2, 2, 200, 64
    q, k, v = make(B, Hkv, G, N, D, D, dtype)
    mask = left_padding(B, N, (3, 150, N))
    out = decode_attention_triton(q, k, v, scale=0.125, mask=mask, num_splits=4)
    ref = reference(q, k, v, 0.125, mask)
    check(out, q, v.shape[-1], ref, seed)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_triton_single_key_and_all_masked_batch(seed, poisoned_empty):
    q, k, v = make(2, 1, 3, 1, 64, 64, torch.float16)
    out = decode_attention_triton(q, k, v, scale=0.125)
    check(out, q, v.shape[-1], reference(q, k, v, 0.125), seed, "N=1")
    mask = torch.zeros(2, 1, dtype=torch.bool)
    out = decode_attention_triton(q, k, v, scale=0.125, mask=mask)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.usefixtures("on_cpu")
def test_triton_unavailable(monkeypatch):
    q, k, v = make(1, 1, 1, 4, 16, 16, torch.float32)
    monkeypatch.setattr(mod, "_is_interpreted", lambda fn: False)
    with pytest.raises(KernelUnavailableError, match="cpu"):
        decode_attention_triton(q, k, v, scale=1.0)
    monkeypatch.setattr(mod, "triton", None)
    with pytest.raises(KernelUnavailableError, match="triton"):
        decode_attention_triton(q, k, v, scale=1.0)


def test_pick_num_splits_rule():
    # 1 GiB of fp16 K+V with Hkv=8, D=128: 262144 keys = 4096 tiles of 64.
    assert pick_num_splits(1, 8, 262144, 64, 132) == math.ceil(4 * 132 / 8)
    assert pick_num_splits(64, 8, 262144, 64, 132) == 2
    # Each split covers at least 4 tiles, never more splits than tiles, at least one split.
    assert pick_num_splits(1, 1, 64 * 12, 64, 132) == 3
    assert pick_num_splits(1, 1, 10, 64, 132) == 1
    for n in (1, 63, 64, 65, 1000, 5000):
        s = pick_num_splits(1, 2, n, 64)
        assert 1 <= s <= max(1, math.ceil(n / 64))


# ---------------------------------------------------------------------------------------------------
# Torch twin and dispatcher
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 3, 4, 8])
def test_torch_twin_matches_reference(seed, dtype, G):
    B, Hkv, N, D, Dv = 3, 2, 333, 80, 64
    q, k, v = make(B, Hkv, G, N, D, Dv, dtype)
    mask = left_padding(B, N, (0, 100, N))
    kbuf = torch.randn(B, Hkv, N + 50, D, dtype=dtype)
    kbuf[:, :, :N] = k
    out = decode_attention_torch(q, kbuf[:, :, :N], v, scale=0.1, mask=mask)
    check(out, q, v.shape[-1], reference(q, k, v, 0.1, mask), seed, f"G={G}")
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    out = decode_attention_torch(q, k, v, scale=0.1)
    check(out, q, v.shape[-1], reference(q, k, v, 0.1), seed, f"G={G}, no mask")


def test_torch_twin_zeros_where_sdpa_gives_nan(seed, monkeypatch):
    # torch 2.13 on CPU already returns zeros for a row with no key; other versions and backends give
    # NaN. Simulate such a backend: the twin must still return zeros there and the right values elsewhere.
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def nan_sdpa(q, k, v, attn_mask=None, **kwargs):
        out = real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)
        dead = ~attn_mask.any(dim=-1, keepdim=True)  # [B, 1, 1, 1]
        return out.masked_fill(dead, float("nan"))

    monkeypatch.setattr(mod.F, "scaled_dot_product_attention", nan_sdpa)
    q, k, v = make(3, 2, 3, 40, 64, 64, torch.float32)
    mask = left_padding(3, 40, (0, 40, 11))
    out = decode_attention_torch(q, k, v, scale=0.125, mask=mask)
    check(out, q, v.shape[-1], reference(q, k, v, 0.125, mask), seed)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.usefixtures("on_cpu")
def test_dispatcher_uses_torch_twin_on_cpu(seed, monkeypatch):
    q, k, v = make(2, 2, 4, 50, 64, 64, torch.float32)
    mask = left_padding(2, 50, (0, 7))
    expected = decode_attention_torch(q, k, v, scale=0.125, mask=mask)
    calls = []

    def twin(*args, **kwargs):
        calls.append(1)
        return decode_attention_torch(*args, **kwargs)

    def boom(*args, **kwargs):
        raise AssertionError("the Triton path must not run for CPU tensors")

    monkeypatch.setattr(dispatch, "decode_attention_triton", boom)
    monkeypatch.setattr(dispatch, "decode_attention_torch", twin)
    out = decode_attention(q, k, v, scale=0.125, mask=mask, num_splits=3)
    assert calls == [1]
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------


def _ok(**overrides):
    """Valid inputs (B=2, Hq=4, Hkv=2, N=10, D=Dv=32) with some replaced."""
    args = {
        "q": torch.randn(2, 4, 32),
        "k": torch.randn(2, 2, 10, 32),
        "v": torch.randn(2, 2, 10, 32),
        "scale": 0.5,
        "mask": None,
    }
    args.update(overrides)
    return args


CASES = [
    ("q ndim", ShapeError, _ok(q=torch.randn(2, 4, 1, 32)), ["3", "4"]),
    ("k ndim", ShapeError, _ok(k=torch.randn(2, 10, 32)), ["4", "3"]),
    ("v ndim", ShapeError, _ok(v=torch.randn(2, 2, 2, 10, 32)), ["4", "5"]),
    ("batch", ShapeError, _ok(k=torch.randn(3, 2, 10, 32)), ["2", "3"]),
    ("batch v", ShapeError, _ok(v=torch.randn(5, 2, 10, 32)), ["2", "5"]),
    ("kv heads", ShapeError, _ok(v=torch.randn(2, 1, 10, 32)), ["2", "1"]),
    (
        "group",
        ShapeError,
        _ok(q=torch.randn(2, 6, 32), k=torch.randn(2, 4, 10, 32), v=torch.randn(2, 4, 10, 32)),
        ["6", "4"],
    ),
    ("keys", ShapeError, _ok(v=torch.randn(2, 2, 11, 32)), ["10", "11"]),
    ("no keys", ShapeError, _ok(k=torch.randn(2, 2, 0, 32), v=torch.randn(2, 2, 0, 32)), ["N=0"]),
    ("head dim", ShapeError, _ok(q=torch.randn(2, 4, 48)), ["48", "32"]),
    (
        "head dim small",
        ShapeError,
        _ok(q=torch.randn(2, 4, 8), k=torch.randn(2, 2, 10, 8)),
        ["8", "16", "256"],
    ),
    ("head dim big", ShapeError, _ok(q=torch.randn(2, 4, 512), k=torch.randn(2, 2, 10, 512)), ["512", "256"]),
    ("value dim", ShapeError, _ok(v=torch.randn(2, 2, 10, 300)), ["300", "256"]),
    ("dtype", DTypeError, _ok(q=torch.randn(2, 4, 32, dtype=torch.float64)), ["float64"]),
    ("dtype mix", DTypeError, _ok(k=torch.randn(2, 2, 10, 32, dtype=torch.float16)), ["float32", "float16"]),
    ("mask dtype", DTypeError, _ok(mask=torch.ones(2, 10)), ["float32", "bool"]),
    ("mask shape", ShapeError, _ok(mask=torch.ones(2, 11, dtype=torch.bool)), ["2", "10", "11"]),
    ("mask ndim", ShapeError, _ok(mask=torch.ones(2, 1, 10, dtype=torch.bool)), ["[2, 10]", "[2, 1, 10]"]),
    ("device", DeviceError, _ok(k=torch.randn(2, 2, 10, 32, device="meta")), [HOME, "meta"]),
    (
        "mask device",
        DeviceError,
        _ok(mask=torch.ones(2, 10, dtype=torch.bool, device="meta")),
        [HOME, "meta"],
    ),
    ("scale", ConfigError, _ok(scale=float("nan")), ["nan"]),
    ("scale type", ConfigError, _ok(scale="0.5"), ["0.5"]),
]


@pytest.mark.parametrize("fn", [decode_attention, decode_attention_torch, decode_attention_triton])
@pytest.mark.parametrize("name, exc, args, numbers", CASES, ids=[c[0] for c in CASES])
def test_validation_errors(fn, name, exc, args, numbers):
    args = dict(args)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc) as info:
        fn(q, k, v, **args)
    assert isinstance(info.value, KVPlusError)
    for n in numbers:
        assert n in str(info.value), f"{name}: {n!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("fn", [decode_attention, decode_attention_triton])
@pytest.mark.parametrize("num_splits", [0, -2, 1.5])
def test_bad_num_splits(fn, num_splits):
    args = _ok()
    with pytest.raises(ConfigError, match=str(num_splits)):
        fn(args["q"], args["k"], args["v"], scale=0.5, num_splits=num_splits)
