"""Decode attention with per-key attention mass (H2O heavy hitters): Triton kernel and torch twin.

Both outputs are checked against an explicit float64 softmax: the attention output as in
test_kernel_decode_attention.py (same BOUND per dtype), the mass [B, Hkv, N] = sum over each KV
head's query group of the float64 probabilities. Inputs are fresh random numbers each run (seed in
failure messages) and the Triton tests NaN-poison every buffer the function allocates, so a logit or
log-sum-exp the kernels fail to write shows up as NaN mass.

Mass bound. The probabilities come from float32 logits of the same (rounded) inputs the reference
sees in float64, so their error does not depend on the input dtype: float32 rounding of q.k (relative
~1e-7 per logit, times |logit| <= ~10 here) and of the exp2 rebuild; measured below 1e-6, bound 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import check, check_mass, left_padding, reference

import hf_kvplus.kernels.decode_attention as mod
import hf_kvplus.kernels.dispatch as dispatch
from hf_kvplus.errors import ConfigError, DTypeError, KernelUnavailableError, ShapeError
from hf_kvplus.kernels.decode_attention import (
    decode_attention_torch,
    decode_attention_triton,
    decode_attention_with_mass_torch,
    decode_attention_with_mass_triton,
)
from hf_kvplus.kernels.dispatch import decode_attention


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
        (torch.float32, 2, 2, 1, 130, 32, 32, 1, None),  # 3 tiles of 64, the last partial
        (torch.float32, 3, 2, 2, 150, 32, 48, 2, (0, 37, 150)),  # padding + a fully masked row
        (torch.float16, 2, 1, 4, 100, 64, 64, 1000, (5, 0)),  # far more splits than tiles
        (torch.bfloat16, 2, 2, 4, 90, 32, 32, None, (0, 60)),
        (torch.float16, 3, 1, 2, 200, 16, 16, 4, (3, 150, 200)),  # splits that see only padding
        (torch.float32, 1, 1, 40, 70, 16, 16, 2, (9,)),  # G > 32: the group is read in two chunks
    ],
)
def test_triton_matches_reference(seed, poisoned_empty, dtype, B, Hkv, G, N, D, Dv, num_splits, pads):
    q, k, v = make(B, Hkv, G, N, D, Dv, dtype)
    mask = None if pads is None else left_padding(B, N, pads)
    scale = 1.0 / math.sqrt(D)
    out, mass = decode_attention_with_mass_triton(q, k, v, scale=scale, mask=mask, num_splits=num_splits)
    check(out, q, Dv, reference(q, k, v, scale, mask), seed)
    check_mass(mass, q, k, scale, mask, seed)
    if mask is not None:
        dead = ~mask.any(dim=-1)
        assert torch.equal(out[dead], torch.zeros_like(out[dead]))


def test_triton_num_splits_agree(seed, poisoned_empty):
    # 260 keys = 5 tiles of 64 (the last one partial). scale=1 makes the softmax peaky, so the merge's
    # log-sum-exp has to get the max rescaling right for the mass to sum to G.
    q, k, v = make(1, 2, 2, 260, 32, 32, torch.float32)
    mask = left_padding(1, 260, (70,))
    ref = reference(q, k, v, 1.0, mask)
    for num_splits in (1, 2, 3, 5, 64):
        out, mass = decode_attention_with_mass_triton(q, k, v, scale=1.0, mask=mask, num_splits=num_splits)
        check(out, q, 32, ref, seed, f"num_splits={num_splits}")
        check_mass(mass, q, k, 1.0, mask, seed, f"num_splits={num_splits}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_output_unchanged_by_scores(seed, dtype):
    # STORE_SCORES and STORE_LSE only add stores: the output is the plain kernel's, bit for bit.
    q, k, v = make(2, 2, 2, 100, 32, 32, dtype)
    mask = left_padding(2, 100, (0, 30))
    out, _ = decode_attention_with_mass_triton(q, k, v, scale=0.2, mask=mask, num_splits=2)
    assert torch.equal(out, decode_attention_triton(q, k, v, scale=0.2, mask=mask, num_splits=2))


def test_triton_non_contiguous_views(seed, poisoned_empty):
    # A cache buffer with room for 96 tokens of which N are filled, and token-major storage.
    B, Hkv, G, N, D = 2, 2, 2, 75, 32
    q = torch.randn(B, Hkv * G, D)
    k = torch.randn(B, Hkv, 96, D)[:, :, :N]
    v = torch.randn(B, 96, Hkv, D).transpose(1, 2)[:, :, :N]
    mask = left_padding(B, N, (0, 9))
    out, mass = decode_attention_with_mass_triton(q, k, v, scale=0.125, mask=mask, num_splits=2)
    check(out, q, D, reference(q, k, v, 0.125, mask), seed)
    check_mass(mass, q, k, 0.125, mask, seed)


def test_triton_single_key_and_all_masked_batch(seed, poisoned_empty):
    q, k, v = make(2, 1, 3, 1, 16, 16, torch.float16)
    out, mass = decode_attention_with_mass_triton(q, k, v, scale=0.125)
    check(out, q, 16, reference(q, k, v, 0.125), seed, "N=1")
    assert torch.equal(mass, torch.full_like(mass, 3.0))
    mask = torch.zeros(2, 1, dtype=torch.bool)
    out, mass = decode_attention_with_mass_triton(q, k, v, scale=0.125, mask=mask)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(mass, torch.zeros_like(mass))


@pytest.mark.usefixtures("on_cpu")
def test_triton_unavailable(monkeypatch):
    q, k, v = make(1, 1, 1, 4, 16, 16, torch.float32)
    monkeypatch.setattr(mod, "_is_interpreted", lambda fn: False)
    with pytest.raises(KernelUnavailableError, match="cpu"):
        decode_attention_with_mass_triton(q, k, v, scale=1.0)
    monkeypatch.setattr(mod, "triton", None)
    with pytest.raises(KernelUnavailableError, match="triton"):
        decode_attention_with_mass_triton(q, k, v, scale=1.0)


# ---------------------------------------------------------------------------------------------------
# Torch twin and dispatcher
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_torch_twin_matches_reference(seed, dtype, G):
    B, Hkv, N, D, Dv = 3, 2, 133, 32, 48
    q, k, v = make(B, Hkv, G, N, D, Dv, dtype)
    mask = left_padding(B, N, (0, 100, N))
    kbuf = torch.randn(B, Hkv, N + 20, D, dtype=dtype)
    kbuf[:, :, :N] = k
    out, mass = decode_attention_with_mass_torch(q, kbuf[:, :, :N], v, scale=0.1, mask=mask)
    check(out, q, Dv, reference(q, k, v, 0.1, mask), seed, f"G={G}")
    check_mass(mass, q, k, 0.1, mask, seed, f"G={G}")
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    out, mass = decode_attention_with_mass_torch(q, k, v, scale=0.1)
    check(out, q, Dv, reference(q, k, v, 0.1), seed, f"G={G}, no mask")
    check_mass(mass, q, k, 0.1, None, seed, f"G={G}, no mask")


def test_torch_twin_agrees_with_triton_and_sdpa(seed):
    q, k, v = make(2, 2, 2, 90, 32, 32, torch.float32)
    mask = left_padding(2, 90, (0, 50))
    out, mass = decode_attention_with_mass_torch(q, k, v, scale=0.3, mask=mask)
    out_t, mass_t = decode_attention_with_mass_triton(q, k, v, scale=0.3, mask=mask, num_splits=2)
    torch.testing.assert_close(out, decode_attention_torch(q, k, v, scale=0.3, mask=mask))
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(mass, mass_t)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("operator", [False, True])
def test_dispatcher_on_cpu_takes_the_operator_else_the_twin(seed, monkeypatch, operator):
    # Eager CPU calls read K/V in place with the C++ operator where it is built (kivi_cpu.dense_decode_cpu), else
    # the torch twin; both give the twin's output and mass (the operator to float32 rounding).
    from hf_kvplus.kernels import kivi_cpu, rotated_cpu

    if operator and not rotated_cpu.available():
        pytest.skip("no C++ toolchain here: the CPU operators cannot be built")
    monkeypatch.setattr(kivi_cpu, "supports", lambda q: operator)
    q, k, v = make(2, 2, 2, 50, 32, 32, torch.float32)
    k, v = torch.cat([k, k], 2)[:, :, ::2], torch.cat([v, v], 2)[:, :, ::2]  # (strided views, as a layer's slots)
    mask = left_padding(2, 50, (0, 7))
    expected = decode_attention_with_mass_torch(q, k, v, scale=0.125, mask=mask)
    calls = []

    def twin(*args, **kwargs):
        calls.append(1)
        return decode_attention_with_mass_torch(*args, **kwargs)

    def boom(*args, **kwargs):
        raise AssertionError("the Triton path must not run for CPU tensors")

    monkeypatch.setattr(dispatch, "decode_attention_with_mass_triton", boom)
    monkeypatch.setattr(dispatch, "decode_attention_with_mass_torch", twin)
    out, mass = decode_attention(q, k, v, scale=0.125, mask=mask, num_splits=3, with_mass=True)
    assert calls == ([] if operator else [1])
    if operator:
        torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mass, expected[1], rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(out, expected[0]) and torch.equal(mass, expected[1])


# ---------------------------------------------------------------------------------------------------
# Validation (the shared checks; test_kernel_decode_attention.py covers every case)
# ---------------------------------------------------------------------------------------------------

def decode_attention_with_mass(*args, **kwargs):
    """The dispatcher asked for the mass."""
    return decode_attention(*args, with_mass=True, **kwargs)


FNS = [decode_attention_with_mass, decode_attention_with_mass_torch, decode_attention_with_mass_triton]


@pytest.mark.parametrize("fn", FNS)
def test_validation_errors(fn):
    q, k, v = torch.randn(2, 6, 32), torch.randn(2, 4, 10, 32), torch.randn(2, 4, 10, 32)
    with pytest.raises(ShapeError, match="6.*4"):
        fn(q, k, v, scale=0.5)
    q = torch.randn(2, 4, 32)
    with pytest.raises(DTypeError, match="bool"):
        fn(q, k, v, scale=0.5, mask=torch.ones(2, 10))
    with pytest.raises(ConfigError, match="nan"):
        fn(q, k, v, scale=float("nan"))


@pytest.mark.parametrize("fn", [decode_attention_with_mass, decode_attention_with_mass_triton])
@pytest.mark.parametrize("num_splits", [0, 1.5])
def test_bad_num_splits(fn, num_splits):
    q, k, v = torch.randn(2, 4, 32), torch.randn(2, 2, 10, 32), torch.randn(2, 2, 10, 32)
    with pytest.raises(ConfigError, match=str(num_splits)):
        fn(q, k, v, scale=0.5, num_splits=num_splits)
