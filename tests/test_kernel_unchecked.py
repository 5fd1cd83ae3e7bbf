"""``check=False``: the entry points for callers whose inputs are valid by construction.

Every kernel entry point takes ``check`` (keyword, default True). With ``check=False`` the caller
guarantees the contract and the function validates nothing and reads no tensor value on the host.
Three properties are checked here, on fresh random inputs each run (seed in failure messages), for
the torch twins and the Triton paths (under TRITON_INTERPRET=1 on the CPU, compiled on CUDA):

1. The results are bit-for-bit those of ``check=True`` (``torch.equal``, floats compared as their
   bits), over masks (fully masked rows included), GQA groups (G = 1 .. 40), paged tables with -1
   in unread columns, residuals, every quantized format, ``out`` views.
2. No host read of tensor values: each call runs under ``evaluation.host_cost.count_syncs``, which
   records the ops that make the host wait for the device (``_local_scalar_dense`` is every ``int()``,
   ``float()``, ``bool()`` and ``.item()`` of a tensor; ``nonzero``, ``equal``, the ``unique`` ops,
   indexing with a bool mask, ``tolist``...); zero is required. ``check=True`` on the twins that validate table and slot values records some,
   so the detector is shown to fire. Separately, every validator of the four modules (and of the dispatchers) is replaced by
   one that raises: ``check=False`` must not call any of them (and ``check=True`` must).
3. Less Python work: ``sys.setprofile`` counts the Python function calls of one dispatcher call on the
   CPU; ``check=False`` must make strictly fewer (the counts are printed, ``pytest -s`` shows them).
"""

from __future__ import annotations

import math
import sys
from functools import partial

import pytest
import torch
from kernel_checks import left_padding

import hf_kvplus.kernels.decode_attention as dense_mod
import hf_kvplus.kernels.dispatch as dispatch_mod
import hf_kvplus.kernels.paged_attention as paged_mod
import hf_kvplus.kernels.quant_attention as quant_mod
import hf_kvplus.kernels.quant_pack as pack_mod
from hf_kvplus.evaluation.host_cost import count_syncs
from hf_kvplus.kernels import format_kernels, kivi_kernels, rotated_kernels
from hf_kvplus.kernels.decode_attention import (
    decode_attention_torch,
    decode_attention_triton,
    decode_attention_with_mass_torch,
    decode_attention_with_mass_triton,
)
from hf_kvplus.kernels.dispatch import (
    decode_attention,
    paged_decode_attention,
    paged_store,
    quantize_keys,
    quantize_values,
    quantized_decode_attention,
)
from hf_kvplus.kernels.paged_attention import (
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    paged_store_torch,
    paged_store_triton,
)
from hf_kvplus.kernels.quant_attention import (
    quantized_decode_attention_torch,
    quantized_decode_attention_triton,
)
from hf_kvplus.kernels.quant_format import PackedKV, QuantFormat
from hf_kvplus.kernels.quant_format import quantize_keys as twin_quantize_keys
from hf_kvplus.kernels.quant_format import quantize_values as twin_quantize_values
from hf_kvplus.kernels.quant_pack import quantize_keys_triton, quantize_values_triton

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# ---------------------------------------------------------------------------------------------------
# Comparison and detectors
# ---------------------------------------------------------------------------------------------------


def as_bits(t):
    """Floats as same-size integers, so that equality is bit equality (NaN == NaN, -0 != +0)."""
    if t is None or not t.is_floating_point():
        return t
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_same(a, b, seed, what):
    """Bit equality of two results (a tensor, or a tuple of tensors / None)."""
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            assert x is None and y is None, f"{what}: result {i} is None on one side only"
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, f"{what}: result {i} {x.shape} vs {y.shape}"
        assert torch.equal(as_bits(x), as_bits(y)), f"{what}: result {i} differs (seed {seed})"


def python_calls(call) -> int:
    """Python function calls (``sys.setprofile`` 'call' events) made by ``call()``."""
    n = 0

    def profile(frame, event, arg):
        nonlocal n
        if event == "call":
            n += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return n


def test_detector_sees_host_reads():
    # Each kind of read the detector is meant to catch, so that a zero count means something.
    t = torch.arange(6) - 2
    reads = [
        lambda: int(t.min()),
        lambda: float(t.sum()),
        lambda: bool(t.any()),
        lambda: t.nonzero(),
        lambda: torch.equal(t, t),
        lambda: t[t > 0],
        lambda: t.unique(),
        lambda: torch.repeat_interleave(t.abs()),
        lambda: t.tolist(),
    ]
    for i, read in enumerate(reads):
        assert sum(count_syncs(read).values()) > 0, f"read {i} not seen"
    assert not count_syncs(lambda: (t * 2 + 1).sum())


# ---------------------------------------------------------------------------------------------------
# Inputs: dense, paged, quantized, quantize-and-pack
# ---------------------------------------------------------------------------------------------------


def dense_case(dtype, B, Hkv, G, N, D, Dv, pads):
    q = torch.randn(B, Hkv * G, D).to(dtype)
    # K as a view of a longer cache buffer, V token-major: any strides.
    k = torch.randn(B, Hkv, N + 7, D).to(dtype)[:, :, 3 : 3 + N]
    v = torch.randn(B, N, Hkv, Dv).to(dtype).transpose(1, 2)
    mask = None if pads is None else left_padding(B, N, pads)
    return (q, k, v), {"scale": 1.0 / math.sqrt(D), "mask": mask}


def block_table(B, used_cols, first_col, num_blocks, extra_cols=2):
    """int32 [B, first_col + used_cols + extra_cols]: distinct shuffled block ids in the used columns
    (row 1 shares row 0's first column, as beams do), -1 in every other column."""
    ids = torch.randperm(num_blocks)
    table = torch.full((B, first_col + used_cols + extra_cols), -1, dtype=torch.int32)
    pos = 0
    for b in range(B):
        table[b, first_col : first_col + used_cols] = ids[pos : pos + used_cols].to(torch.int32)
        if b == 1:
            table[b, first_col] = table[0, first_col]
        pos += used_cols
    return table


def paged_case(dtype, B, Hkv, G, D, Dv, bs, start, length, pads, pool_view=False):
    first, last = start // bs, (start + length - 1) // bs
    used = last - first + 1
    nb = B * used + 2
    table = block_table(B, used, first, nb)
    if pool_view:  # pools that are views (a spare head in the buffer): the twin's non-flat gather
        k_pool = torch.randn(nb, Hkv + 1, bs, D).to(dtype)[:, 1:]
        v_pool = torch.randn(nb, Hkv + 1, bs, Dv).to(dtype)[:, :Hkv]
    else:
        k_pool = torch.randn(nb, Hkv, bs, D).to(dtype)
        v_pool = torch.randn(nb, Hkv, bs, Dv).to(dtype)
    q = torch.randn(B, Hkv * G, D).to(dtype)
    mask = None if pads is None else left_padding(B, length, pads)
    kw = {"start": start, "length": length, "scale": 1.0 / math.sqrt(D), "mask": mask}
    return (q, k_pool, v_pool, table), kw


def packed_of(k, v, fmt, keys_per_token=False):
    kc, ks, kz = (twin_quantize_values if keys_per_token else twin_quantize_keys)(k, fmt)
    vc, vs, vz = twin_quantize_values(v, fmt)
    return PackedKV(kc, ks, kz, vc, vs, vz)


def quant_case(bits, group, dtype, B, Hkv, G, D, Dv, T, start, length, R, pads, paged, keys_per_token=False):
    """Dense: buffers of T tokens per row. Paged: blocks of T tokens and a table. Keys per channel over groups of
    tokens, or per token (an evicting cache's slots)."""
    fmt = QuantFormat(bits, group)
    if paged:
        first, last = start // T, (start + length - 1) // T if length else start // T
        used = last - first + 1
        nb = B * used + 2
        table = block_table(B, used, first, nb)
        packed = packed_of(torch.randn(nb, Hkv, T, D), torch.randn(nb, Hkv, T, Dv), fmt, keys_per_token)
    else:
        table = None
        packed = packed_of(torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, Dv), fmt, keys_per_token)
    q = torch.randn(B, Hkv * G, D).to(dtype)
    rk = rv = None
    if R is not None:
        rk = torch.randn(B, Hkv, R + 4, D).to(dtype)[:, :, 2 : 2 + R]
        rv = torch.randn(B, R, Hkv, Dv).to(dtype).transpose(1, 2)
    n = length + (R or 0)
    mask = None if pads is None else left_padding(B, n, [min(p, n) for p in pads])
    kw = {
        "start": start, "length": length, "scale": 1.0 / math.sqrt(D), "residual_k": rk, "residual_v": rv,
        "mask": mask, "block_table": table, "keys_per_token": keys_per_token,
    }  # fmt: skip
    return (q, packed, fmt), kw


# dtype, B, Hkv, G, N, D, Dv, pads, num_splits
DENSE_CASES = [
    (F32, 2, 2, 1, 70, 64, 64, None, 2),
    (F16, 3, 2, 3, 90, 80, 48, (0, 20, 90), None),  # row 2 fully masked, Dv != D
    (BF16, 1, 1, 40, 33, 32, 32, (5,), 1),  # G > 32: two chunks of the group
]
# dtype, B, Hkv, G, D, Dv, bs, start, length, pads, num_splits, pool view
PAGED_CASES = [
    (F32, 2, 2, 1, 64, 64, 16, 5, 60, None, 2, False),
    (F16, 2, 1, 4, 80, 48, 8, 13, 45, (0, 45), None, True),  # row 1 fully masked
    (BF16, 2, 2, 3, 32, 32, 32, 40, 70, (9, 0), 1, False),
]
# bits, group, dtype, B, Hkv, G, D, Dv, T (buffer or block size), start, length, R, pads, paged
QUANT_CASES = [
    (8, 16, F32, 2, 2, 2, 32, 32, 64, 5, 50, 3, (0, 20), False),
    (4, 16, F16, 2, 1, 3, 32, 64, 64, 0, 64, None, (0, 64), False),  # row 1 fully masked
    (2, 32, BF16, 1, 2, 1, 64, 32, 96, 31, 40, 7, None, False),
    ("fp8", 16, F32, 2, 2, 2, 32, 32, 64, 17, 30, 5, (3, 0), False),
    (4, 16, F32, 2, 1, 1, 32, 32, 64, 16, 0, 9, (2, 0), False),  # only the residual
    (8, 16, F16, 2, 2, 2, 32, 32, 16, 5, 40, 4, (0, 11), True),
    (4, 8, F32, 2, 1, 4, 32, 32, 16, 3, 33, None, None, True),
    (2, 16, BF16, 2, 2, 2, 32, 32, 32, 20, 50, 6, (0, 56), True),  # row 1 fully masked
    ("fp8", 8, F16, 1, 2, 3, 32, 64, 8, 9, 30, 2, (4,), True),
]
QUANT_IDS = [f"{c[0]}-g{c[1]}-{'paged' if c[-1] else 'dense'}-R{c[11]}" for c in QUANT_CASES]
# bits, group, dtype, B, H, T, D
PACK_CASES = [
    (8, 16, F32, 2, 2, 32, 32),
    (4, 32, F16, 1, 2, 64, 64),
    (2, 16, BF16, 2, 1, 32, 48),
    ("fp8", 16, F32, 1, 2, 48, 32),
]

DENSE_FNS = [decode_attention, decode_attention_torch, decode_attention_triton]
def decode_attention_with_mass(*args, **kwargs):
    """The dispatcher asked for the mass."""
    return decode_attention(*args, with_mass=True, **kwargs)


MASS_FNS = [decode_attention_with_mass, decode_attention_with_mass_torch, decode_attention_with_mass_triton]
PAGED_FNS = [paged_decode_attention, paged_decode_attention_torch, paged_decode_attention_triton]
STORE_FNS = [paged_store, paged_store_torch, paged_store_triton]
QUANT_FNS = [quantized_decode_attention, quantized_decode_attention_torch, quantized_decode_attention_triton]
PACK_FNS = [quantize_keys, quantize_values, quantize_keys_triton, quantize_values_triton]
TAKES_SPLITS = {
    decode_attention, decode_attention_triton, decode_attention_with_mass, decode_attention_with_mass_triton,
    paged_decode_attention, paged_decode_attention_triton, *QUANT_FNS,
}  # fmt: skip


def name(fn):
    return fn.__name__


def splits_kw(fn, num_splits):
    return {"num_splits": num_splits} if fn in TAKES_SPLITS else {}


def store_case(dtype, B, Hkv, n, D, Dv, bs):
    """Pools and new rows with distinct valid slots (no -1: the check=False contract)."""
    nb = (B * n) // bs + 3
    k_pool = torch.randn(nb, Hkv, bs, D).to(dtype)
    v_pool = torch.randn(nb, Hkv, bs, Dv).to(dtype)
    keys = torch.randn(B, n, Hkv, D).to(dtype).transpose(1, 2)  # [B, n, Hkv, D] storage, as models hand it
    values = torch.randn(B, Hkv, n, Dv).to(dtype)
    slots = torch.randperm(nb * bs - 1)[: B * n].view(B, n)
    if B * n:
        slots[-1, -1] = nb * bs - 1  # the last slot of the pool (no other row's: all distinct)
    return k_pool, v_pool, keys, values, slots


# dtype, B, Hkv, n, D, Dv, bs
STORE_CASES = [
    (F32, 2, 2, 37, 64, 64, 16),  # prefill: several tiles of tokens
    (F16, 3, 1, 1, 80, 48, 8),  # a decode step
    (BF16, 2, 3, 20, 32, 64, 64),
    (F32, 2, 1, 0, 32, 32, 8),  # nothing to store
]


def pack_case(kind, bits, group, dtype, B, H, T, D, with_out):
    fmt = QuantFormat(bits, group)
    x = torch.randn(B, H, T, D + 8).to(dtype)[..., 4 : 4 + D]  # a strided view
    out = None
    if with_out:  # slices along the token dim of larger buffers
        per, G = fmt.per_byte, group
        lead = (B, H)
        codes = torch.zeros(*lead, T + 16, D // per, dtype=torch.uint8)[:, :, 16:]
        params_t, params_d = (T // G, D) if kind == "keys" else (T, D // G)
        scale = torch.zeros(*lead, params_t + 2, params_d, dtype=torch.float16)[:, :, 2:]
        zero = (
            None
            if fmt.is_float
            else torch.zeros(*lead, params_t + 2, params_d, dtype=torch.float16)[:, :, 2:]
        )
        out = (codes, scale, zero)
    return x, fmt, out


def clone_out(out):
    return None if out is None else tuple(None if t is None else t.clone() for t in out)


# ---------------------------------------------------------------------------------------------------
# 1. check=False gives check=True's results, bit for bit
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", DENSE_FNS + MASS_FNS, ids=name)
@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: f"{str(c[0])[6:]}-G{c[3]}-pads{c[7]}")
def test_dense_same_results(seed, fn, case):
    *shape, num_splits = case
    args, kw = dense_case(*shape)
    kw.update(splits_kw(fn, num_splits))
    assert_same(fn(*args, **kw, check=False), fn(*args, **kw), seed, name(fn))


@pytest.mark.parametrize("fn", PAGED_FNS, ids=name)
@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: f"{str(c[0])[6:]}-G{c[3]}-bs{c[6]}")
def test_paged_same_results(seed, fn, case):
    *shape, num_splits, view = case
    args, kw = paged_case(*shape, pool_view=view)
    kw.update(splits_kw(fn, num_splits))
    assert_same(fn(*args, **kw, check=False), fn(*args, **kw), seed, name(fn))


@pytest.mark.parametrize("fn", STORE_FNS, ids=name)
@pytest.mark.parametrize("case", STORE_CASES, ids=lambda c: f"{str(c[0])[6:]}-n{c[3]}")
def test_store_same_results(seed, fn, case):
    k_pool, v_pool, keys, values, slots = store_case(*case)
    k2, v2 = k_pool.clone(), v_pool.clone()
    assert fn(k_pool, v_pool, keys, values, slots) is None
    assert fn(k2, v2, keys, values, slots, check=False) is None
    assert_same((k2, v2), (k_pool, v_pool), seed, name(fn))
    bs = case[-1]
    for b, i in ((0, 0), (-1, -1)) if case[3] else ():  # the rows did land (not two untouched pools)
        s = int(slots[b, i])
        assert torch.equal(as_bits(k2[s // bs, :, s % bs]), as_bits(keys[b, :, i])), f"seed {seed}"
        assert torch.equal(as_bits(v2[s // bs, :, s % bs]), as_bits(values[b, :, i])), f"seed {seed}"


@pytest.mark.parametrize("fn", QUANT_FNS, ids=name)
@pytest.mark.parametrize("case", QUANT_CASES, ids=QUANT_IDS)
def test_quantized_same_results(seed, fn, case):
    args, kw = quant_case(*case)
    kw["num_splits"] = 2
    assert_same(fn(*args, **kw, check=False), fn(*args, **kw), seed, name(fn))


@pytest.mark.parametrize("fn", PACK_FNS, ids=name)
@pytest.mark.parametrize("with_out", [False, True], ids=["new", "out"])
@pytest.mark.parametrize("case", PACK_CASES, ids=lambda c: f"{c[0]}-g{c[1]}-{str(c[2])[6:]}")
def test_quant_pack_same_results(seed, fn, with_out, case):
    kind = "keys" if "keys" in name(fn) else "values"
    x, fmt, out = pack_case(kind, *case, with_out)
    out2 = clone_out(out)
    want = fn(x, fmt, out)
    got = fn(x, fmt, out2, check=False)
    assert_same(got, want, seed, name(fn))
    if with_out:  # written into the given views (and returned), not into fresh tensors
        for g, o in zip(got, out2, strict=True):
            assert g is o


# ---------------------------------------------------------------------------------------------------
# 2. check=False reads no tensor value on the host and calls no validator
# ---------------------------------------------------------------------------------------------------


def unchecked_calls():
    """(label, call) for every entry point with check=False, on one valid input each (small shapes)."""
    calls = []
    dense_args, dense_kw = dense_case(F16, 2, 2, 3, 40, 32, 32, (0, 40))
    for fn in DENSE_FNS + MASS_FNS:
        kw = {**dense_kw, **splits_kw(fn, 2)}
        calls.append((name(fn), lambda fn=fn, kw=kw: fn(*dense_args, **kw, check=False)))
    paged_args, paged_kw = paged_case(F32, 2, 2, 2, 32, 32, 8, 3, 30, (0, 5))
    for fn in PAGED_FNS:
        kw = {**paged_kw, **splits_kw(fn, 2)}
        calls.append((name(fn), lambda fn=fn, kw=kw: fn(*paged_args, **kw, check=False)))
    store_args = store_case(F32, 2, 2, 5, 32, 32, 8)
    for fn in STORE_FNS:
        calls.append((name(fn), lambda fn=fn: fn(*store_args, check=False)))
    for paged in (False, True):
        quant_args, quant_kw = quant_case(4, 16, F32, 2, 1, 2, 32, 32, 32, 5, 20, 3, (0, 4), paged)
        for fn in QUANT_FNS:
            label = f"{name(fn)}[{'paged' if paged else 'dense'}]"
            calls.append(
                (label, lambda fn=fn, a=quant_args, kw=quant_kw: fn(*a, **kw, num_splits=2, check=False))
            )
    for fn in PACK_FNS:
        kind = "keys" if "keys" in name(fn) else "values"
        for with_out in (False, True):
            x, fmt, out = pack_case(kind, "fp8" if with_out else 4, 16, F16, 1, 2, 32, 32, with_out)
            calls.append(
                (
                    f"{name(fn)}[out={with_out}]",
                    lambda fn=fn, x=x, fmt=fmt, out=out: fn(x, fmt, out, check=False),
                )
            )
    return calls


def test_unchecked_reads_nothing_on_host():
    calls = unchecked_calls()
    assert len(calls) == 6 + 3 + 3 + 6 + 8
    for label, call in calls:
        reads = count_syncs(call)
        assert not reads, f"{label} with check=False read tensor values on the host: {dict(reads)}"


def test_checked_twins_do_read_on_host():
    # The twins that validate table and slot values read them back with check=True: the detector
    # above would see it if check=False still did.
    paged_args, paged_kw = paged_case(F32, 2, 2, 2, 32, 32, 8, 3, 30, None)
    quant_args, quant_kw = quant_case(4, 16, F32, 2, 1, 2, 32, 32, 32, 5, 20, 3, None, True)
    k_pool, v_pool, keys, values, slots = store_case(F32, 2, 2, 5, 32, 32, 8)
    skipping = slots.clone()
    skipping[0, 0] = -1  # a skipped slot: the twin selects the others with nonzero
    checked = [
        ("paged_decode_attention_torch", lambda: paged_decode_attention_torch(*paged_args, **paged_kw)),
        ("paged_decode_attention", lambda: paged_decode_attention(*paged_args, **paged_kw)),
        ("paged_store_torch", lambda: paged_store_torch(k_pool, v_pool, keys, values, slots)),
        ("paged_store", lambda: paged_store(k_pool, v_pool, keys, values, skipping)),
        (
            "quantized_decode_attention_torch",
            lambda: quantized_decode_attention_torch(*quant_args, **quant_kw),
        ),
    ]
    on_cuda = paged_args[0].is_cuda  # the dispatchers run Triton there, which reads nothing
    for label, call in checked:
        if on_cuda and not label.endswith("_torch"):
            continue
        reads = count_syncs(call)
        assert reads["_local_scalar_dense"] >= 2, f"{label}: {dict(reads)}"
    if not on_cuda:
        reads = count_syncs(lambda: paged_store(k_pool, v_pool, keys, values, skipping))
        assert reads["nonzero"] == 1, dict(reads)


#: Every validation helper of the four kernel modules and the dispatchers, by the module namespace it is looked up in.
VALIDATORS = {
    dense_mod: ["_check_inputs", "_check_mask_and_scale", "_check_num_splits", "_is_interpreted"],
    paged_mod: [
        "_check_pools", "_check_attention_inputs", "_check_store_inputs", "_check_triton", "_check_runnable",
        "_check_block_ids", "_check_mask_and_scale", "_check_num_splits", "_is_interpreted", "_is_int",
    ],
    quant_mod: [
        "_check_inputs", "_check_tensor", "_check_block_ids", "_check_mask_and_scale", "_check_num_splits",
        "_is_interpreted", "_is_int",
    ],
    pack_mod: ["_check_fmt", "_check_x", "_check_out", "_check_inputs", "_is_interpreted"],
    dispatch_mod: ["_check_num_splits"],
    kivi_kernels: ["_check_inputs"],
    rotated_kernels: ["_check_inputs"],
    format_kernels: ["_check_at"],
}  # fmt: skip


def test_unchecked_calls_no_validator(monkeypatch):
    calls = unchecked_calls()  # inputs built before the validators are replaced
    called = []

    def forbidden(label):
        def validator(*args, **kwargs):
            called.append(label)
            raise AssertionError(f"validator {label} called")

        return validator

    for module, names in VALIDATORS.items():
        for attr in names:
            assert callable(getattr(module, attr)), attr
            monkeypatch.setattr(module, attr, forbidden(f"{module.__name__}.{attr}"))
    for label, call in calls:
        call()
        assert not called, f"{label} with check=False called {called}"
    # The same calls with check=True do reach the validators.
    args, kw = dense_case(F32, 1, 1, 2, 20, 32, 32, None)
    with pytest.raises(AssertionError, match="validator"):
        decode_attention(*args, **kw)
    with pytest.raises(AssertionError, match="validator"):
        paged_store_triton(*store_case(F32, 1, 1, 2, 32, 32, 8))
    quant_args, quant_kw = quant_case(8, 16, F32, 1, 1, 1, 32, 32, 32, 0, 20, None, None, False)
    with pytest.raises(AssertionError, match="validator"):
        quantized_decode_attention_triton(*quant_args, **quant_kw)
    with pytest.raises(AssertionError, match="validator"):
        quantize_values(*pack_case("values", 8, 16, F32, 1, 1, 16, 32, False)[:2])


# ---------------------------------------------------------------------------------------------------
# 3. check=False makes fewer Python calls (dispatchers on the CPU: the torch twins)
# ---------------------------------------------------------------------------------------------------


def dispatcher_calls():
    """(label, call(check)) for every dispatcher on CPU tensors, one decode step's shapes."""
    with torch.device("cpu"):
        d_args, d_kw = dense_case(F32, 1, 2, 4, 64, 32, 32, (3,))
        p_args, p_kw = paged_case(F32, 1, 2, 4, 32, 32, 16, 0, 64, (3,))
        s_args = store_case(F32, 1, 2, 1, 32, 32, 16)
        qd_args, qd_kw = quant_case(4, 16, F32, 1, 2, 4, 32, 32, 64, 0, 48, 5, (3,), False)
        qp_args, qp_kw = quant_case(4, 16, F32, 1, 2, 4, 32, 32, 16, 0, 48, 5, (3,), True)
        k_x, k_fmt, k_out = pack_case("keys", 4, 16, F32, 1, 2, 16, 32, True)
        v_x, v_fmt, _ = pack_case("values", 4, 16, F32, 1, 2, 1, 32, False)
    return [
        ("decode_attention", lambda c: decode_attention(*d_args, **d_kw, check=c)),
        ("decode_attention_with_mass", lambda c: decode_attention(*d_args, **d_kw, with_mass=True, check=c)),
        ("paged_decode_attention", lambda c: paged_decode_attention(*p_args, **p_kw, check=c)),
        ("paged_store", lambda c: paged_store(*s_args, check=c)),
        (
            "quantized_decode_attention[dense]",
            lambda c: quantized_decode_attention(*qd_args, **qd_kw, check=c),
        ),
        (
            "quantized_decode_attention[paged]",
            lambda c: quantized_decode_attention(*qp_args, **qp_kw, check=c),
        ),
        ("quantize_keys[out]", lambda c: quantize_keys(k_x, k_fmt, k_out, check=c)),
        ("quantize_values", lambda c: quantize_values(v_x, v_fmt, check=c)),
    ]


def test_unchecked_makes_fewer_python_calls():
    rows = []
    for label, call in dispatcher_calls():
        call(True), call(False)  # warm up: lazy imports and caches out of the count
        checked, unchecked = python_calls(partial(call, True)), python_calls(partial(call, False))
        rows.append((label, checked, unchecked))
    print("\nPython calls per dispatcher call (CPU): check=True -> check=False")
    for label, checked, unchecked in rows:
        print(f"  {label:36s} {checked:4d} -> {unchecked:4d}")
    for label, checked, unchecked in rows:
        assert unchecked < checked, (
            f"{label}: check=False made {unchecked} Python calls, check=True {checked}"
        )
