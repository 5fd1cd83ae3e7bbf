"""Paged attention and paged store: the Triton kernels (under TRITON_INTERPRET=1) and their torch twins.

Attention is checked against float64 softmax(q k^T * scale + mask) v over K/V that this file lays
out contiguously from the pool and the block table, token by token, with its own loop. Inputs are
fresh random numbers each run (the seed comes from os.urandom and is printed in failure messages);
every buffer the function allocates is NaN-poisoned (torch.empty is wrapped); so is every pool slot
that holds none of the attended tokens (unused blocks, the part of the first block before `start`,
the tail of the last block), and table columns that are not read hold -1: reading any of them shows
up as NaN or a wrong block. Tables are shuffled block ids, rows share their first blocks (beams).
The error is ||out - ref|| / ||ref||, with the bounds of the dense decode kernel (see
test_kernel_decode_attention.py): 1e-5 float32, 2e-3 float16, 1e-2 bfloat16.

The store is checked bit for bit against a loop that writes slot by slot.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import check, left_padding, reference

import hf_kvplus.kernels.dispatch as dispatch
import hf_kvplus.kernels.paged_attention as mod
from hf_kvplus.errors import (
    ConfigError,
    DeviceError,
    DTypeError,
    KernelUnavailableError,
    KVPlusError,
    ShapeError,
)
from hf_kvplus.kernels import rotated_cpu
from hf_kvplus.kernels.dispatch import paged_decode_attention, paged_store
from hf_kvplus.kernels.paged_attention import (
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    paged_store_torch,
    paged_store_triton,
)

# ---------------------------------------------------------------------------------------------------
# Layouts and references
# ---------------------------------------------------------------------------------------------------

#: The device the tests make their tensors on (torch's default: see conftest.py).
HOME = torch.get_default_device().type


class Layout:
    """Pools and a block table holding `length` tokens from `start` for B rows.

    Row 0 gets shuffled block ids for its columns; rows 1.. share row 0's first `share` columns (as
    beams share their prefix) and get their own blocks for the rest. Columns before the first used
    one and `extra_cols` after the last hold -1. Pool slots not holding an attended token are NaN.
    """

    def __init__(self, B, Hkv, D, Dv, bs, start, length, dtype, share=0, extra_cols=2, spare_blocks=3):
        first, last = start // bs, (start + length - 1) // bs
        used = last - first + 1
        share = min(share, used)
        num_blocks = used + (B - 1) * (used - share) + spare_blocks
        ids = torch.randperm(num_blocks).tolist()
        table = torch.full((B, last + 1 + extra_cols), -1, dtype=torch.int32)
        table[0, first : last + 1] = torch.tensor(ids[:used], dtype=torch.int32)
        pos = used
        for b in range(1, B):
            table[b, first : first + share] = table[0, first : first + share]
            table[b, first + share : last + 1] = torch.tensor(ids[pos : pos + used - share], dtype=torch.int32)
            pos += used - share
        k_pool = torch.randn(num_blocks, Hkv, bs, D).to(dtype)
        v_pool = torch.randn(num_blocks, Hkv, bs, Dv).to(dtype)
        live = torch.zeros(num_blocks, bs, dtype=torch.bool)
        for b in range(B):
            for t in range(start, start + length):
                live[int(table[b, t // bs]), t % bs] = True
        k_pool.permute(0, 2, 1, 3)[~live] = float("nan")
        v_pool.permute(0, 2, 1, 3)[~live] = float("nan")
        self.k_pool, self.v_pool, self.table = k_pool, v_pool, table
        self.start, self.length, self.bs = start, length, bs

    def kwargs(self):
        return {"start": self.start, "length": self.length}


def contiguous(pool, table, start, length):
    """float64 [B, Hkv, length, dim]: token start + i of row b, read slot by slot through the table."""
    B = table.shape[0]
    _, Hkv, bs, dim = pool.shape
    out = torch.zeros(B, Hkv, length, dim, dtype=torch.float64)
    for b in range(B):
        for i in range(length):
            t = start + i
            out[b, :, i] = pool[int(table[b, t // bs]), :, t % bs].double()
    return out


def paged_reference(q, lay, scale, mask=None):
    """The float64 reference over the contiguous K/V the table describes."""
    k = contiguous(lay.k_pool, lay.table, lay.start, lay.length)
    v = contiguous(lay.v_pool, lay.table, lay.start, lay.length)
    assert torch.isfinite(k).all() and torch.isfinite(v).all()  # the poison is outside the range
    return reference(q, k, v, scale, mask)


def bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


# ---------------------------------------------------------------------------------------------------
# Attention: Triton kernel (interpreter)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, B, Hkv, G, D, Dv, bs, start, length, num_splits, pads, share",
    [
        (torch.float32, 2, 2, 1, 64, 64, 16, 5, 100, 1, None, 2),
        (torch.float32, 3, 1, 3, 80, 80, 8, 13, 75, 3, (0, 20, 75), 1),  # row 2 fully masked
        (torch.float16, 2, 2, 4, 64, 64, 64, 40, 150, None, (7, 0), 1),
        (torch.bfloat16, 2, 1, 4, 80, 80, 16, 3, 90, 2, (0, 33), 1),
        (torch.bfloat16, 1, 2, 3, 64, 64, 8, 0, 37, None, None, 0),
        (torch.float16, 2, 1, 3, 80, 48, 16, 201, 70, 1000, (20, 0), 2),  # start far into the table, Dv != D
    ],
)
def test_triton_matches_reference(
    seed, poisoned_empty, dtype, B, Hkv, G, D, Dv, bs, start, length, num_splits, pads, share
):
    lay = Layout(B, Hkv, D, Dv, bs, start, length, dtype, share=share)
    q = torch.randn(B, Hkv * G, D).to(dtype)
    mask = None if pads is None else left_padding(B, length, pads)
    scale = 1.0 / math.sqrt(D)
    k_before, v_before = bits(lay.k_pool).clone(), bits(lay.v_pool).clone()
    out = paged_decode_attention_triton(
        q, lay.k_pool, lay.v_pool, lay.table, **lay.kwargs(), scale=scale, mask=mask, num_splits=num_splits
    )
    check(out, q, Dv, paged_reference(q, lay, scale, mask), seed)
    if pads is not None and max(pads) == length:
        assert torch.equal(out[pads.index(length)], torch.zeros_like(out[0]))
    assert torch.equal(bits(lay.k_pool), k_before) and torch.equal(bits(lay.v_pool), v_before)


def test_triton_num_splits_agree(seed, poisoned_empty):
    # 230 keys from mid-block: 4 tiles of 64, the last partial. scale=1 makes the softmax peaky, so
    # the merge has to get the max rescaling right.
    lay = Layout(2, 2, 64, 64, 16, 9, 230, torch.float32, share=3)
    q = torch.randn(2, 4, 64)
    ref = paged_reference(q, lay, 1.0)
    for num_splits in (1, 2, 3, 64):
        out = paged_decode_attention_triton(
            q, lay.k_pool, lay.v_pool, lay.table, **lay.kwargs(), scale=1.0, num_splits=num_splits
        )
        check(out, q, 64, ref, seed, f"num_splits={num_splits}")


def test_triton_views_and_all_masked(seed, poisoned_empty):
    # Pools that are views into bigger buffers (a spare head, unused trailing dims), a strided table.
    B, Hkv, G, D, bs = 2, 2, 2, 64, 8
    lay = Layout(B, Hkv, D, D, bs, 6, 50, torch.float16, share=2)
    nb = lay.k_pool.shape[0]
    kbuf = torch.randn(nb, Hkv + 1, bs, D + 16).to(torch.float16)
    vbuf = torch.randn(nb, Hkv + 1, bs, D + 16).to(torch.float16)
    kbuf[:, :Hkv, :, :D] = lay.k_pool
    vbuf[:, :Hkv, :, :D] = lay.v_pool
    tbuf = torch.full((B, 2 * lay.table.shape[1]), 10**6, dtype=torch.int32)
    tbuf[:, ::2] = lay.table
    q = torch.randn(B, Hkv * G, D).to(torch.float16)
    k, v, table = kbuf[:, :Hkv, :, :D], vbuf[:, :Hkv, :, :D], tbuf[:, ::2]
    assert not (k.is_contiguous() or table.is_contiguous())
    mask = left_padding(B, 50, (3, 0))
    out = paged_decode_attention_triton(q, k, v, table, start=6, length=50, scale=0.125, mask=mask, num_splits=2)
    check(out, q, D, paged_reference(q, lay, 0.125, mask), seed, "views")

    mask = torch.zeros(B, 50, dtype=torch.bool)
    out = paged_decode_attention_triton(q, k, v, table, start=6, length=50, scale=0.125, mask=mask)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.usefixtures("on_cpu")
def test_triton_unavailable(monkeypatch):
    lay = Layout(1, 1, 16, 16, 8, 0, 4, torch.float32)
    q = torch.randn(1, 1, 16)
    keys, slots = torch.randn(1, 1, 1, 16), torch.zeros(1, 1, dtype=torch.int64)
    monkeypatch.setattr(mod, "_is_interpreted", lambda fn: False)
    with pytest.raises(KernelUnavailableError, match="cpu"):
        paged_decode_attention_triton(q, lay.k_pool, lay.v_pool, lay.table, **lay.kwargs(), scale=1.0)
    with pytest.raises(KernelUnavailableError, match="cpu"):
        paged_store_triton(lay.k_pool, lay.v_pool, keys, keys, slots)
    monkeypatch.setattr(mod, "triton", None)
    with pytest.raises(KernelUnavailableError, match="triton"):
        paged_decode_attention_triton(q, lay.k_pool, lay.v_pool, lay.table, **lay.kwargs(), scale=1.0)
    with pytest.raises(KernelUnavailableError, match="triton"):
        paged_store_triton(lay.k_pool, lay.v_pool, keys, keys, slots)


# ---------------------------------------------------------------------------------------------------
# Attention: torch twin and dispatcher
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "G, D, Dv, bs, start, length",
    [(1, 64, 64, 16, 7, 333), (3, 80, 80, 8, 21, 250), (4, 64, 48, 64, 100, 300), (3, 64, 64, 16, 1030, 2100)],
)
def test_torch_twin_matches_reference(seed, dtype, G, D, Dv, bs, start, length):
    # The last case spans three chunks of TWIN_CHUNK_TOKENS (1024) keys, starting mid-block.
    B, Hkv = 3, 2
    lay = Layout(B, Hkv, D, Dv, bs, start, length, dtype, share=2)
    q = torch.randn(B, Hkv * G, D).to(dtype)
    mask = left_padding(B, length, (0, length // 3, length))
    out = paged_decode_attention_torch(q, lay.k_pool, lay.v_pool, lay.table, **lay.kwargs(), scale=0.1, mask=mask)
    check(out, q, Dv, paged_reference(q, lay, 0.1, mask), seed, f"G={G}, bs={bs}")
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    out = paged_decode_attention_torch(q, lay.k_pool, lay.v_pool, lay.table, **lay.kwargs(), scale=0.1)
    check(out, q, Dv, paged_reference(q, lay, 0.1), seed, f"G={G}, bs={bs}, no mask")


def test_torch_twin_reads_a_table_changed_in_place(seed):
    # The twin keeps its gather index on the table tensor between calls (a decode step reuses it); a table
    # whose entries change in place (another cache's copy-on-write, a caller's own table) must be read anew.
    B, Hkv, G, D, bs, start, length = 2, 2, 2, 64, 8, 3, 40
    lay = Layout(B, Hkv, D, D, bs, start, length, torch.float32, share=0)
    q = torch.randn(B, Hkv * G, D)
    out = paged_decode_attention_torch(q, lay.k_pool, lay.v_pool, lay.table, **lay.kwargs(), scale=0.1)
    check(out, q, D, paged_reference(q, lay, 0.1), seed, "first call")
    lay.table[[0, 1]] = lay.table[[1, 0]].clone()  # the rows swap their blocks
    out = paged_decode_attention_torch(q, lay.k_pool, lay.v_pool, lay.table, **lay.kwargs(), scale=0.1)
    check(out, q, D, paged_reference(q, lay, 0.1), seed, "after the rows swapped blocks in place")
    with torch.inference_mode():  # an inference tensor has no version counter: read anew every call
        table = lay.table.clone()
        paged_decode_attention_torch(q, lay.k_pool, lay.v_pool, table, **lay.kwargs(), scale=0.1)
        table[[0, 1]] = table[[1, 0]].clone()
        out = paged_decode_attention_torch(q, lay.k_pool, lay.v_pool, table, **lay.kwargs(), scale=0.1)
    lay.table = table
    check(out, q, D, paged_reference(q, lay, 0.1), seed, "an inference table changed in place")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_twin_small_chunks(seed, monkeypatch, dtype):
    # Chunks of two blocks: rows whose first chunks are all padding, a window-like random mask, a
    # peaky softmax (scale 1) so the merge across chunks must rescale right, and pools that are views
    # (the twin's path for non-contiguous pools).
    monkeypatch.setattr(mod, "TWIN_CHUNK_TOKENS", 16)
    B, Hkv, G, D, bs, start, length = 4, 2, 3, 64, 8, 5, 90
    lay = Layout(B, Hkv, D, D, bs, start, length, dtype, share=3)
    q = torch.randn(B, Hkv * G, D).to(dtype)
    mask = left_padding(B, length, (0, 40, 89, 0))
    mask[3] = torch.rand(length) < 0.7
    mask[3, -1] = True
    ref = paged_reference(q, lay, 1.0, mask)
    out = paged_decode_attention_torch(q, lay.k_pool, lay.v_pool, lay.table, **lay.kwargs(), scale=1.0, mask=mask)
    check(out, q, D, ref, seed, "contiguous pools")
    kbuf = torch.randn(lay.k_pool.shape[0], Hkv + 1, bs, D).to(dtype)
    vbuf = torch.randn(lay.k_pool.shape[0], Hkv + 1, bs, D).to(dtype)
    kbuf[:, 1:], vbuf[:, 1:] = lay.k_pool, lay.v_pool
    out = paged_decode_attention_torch(q, kbuf[:, 1:], vbuf[:, 1:], lay.table, **lay.kwargs(), scale=1.0, mask=mask)
    check(out, q, D, ref, seed, "pool views")


@pytest.mark.usefixtures("on_cpu")
def test_dispatcher_uses_torch_twin_on_cpu(seed, monkeypatch):
    monkeypatch.setattr(rotated_cpu, "_LOADED", False)  # as where the CPU operators cannot be built: the twin
    lay = Layout(2, 2, 64, 64, 16, 3, 50, torch.float32, share=1)
    q = torch.randn(2, 8, 64)
    mask = left_padding(2, 50, (0, 7))
    args = (q, lay.k_pool, lay.v_pool, lay.table)
    expected = paged_decode_attention_torch(*args, **lay.kwargs(), scale=0.125, mask=mask)
    calls = []

    def twin(*a, **kw):
        calls.append(1)
        return paged_decode_attention_torch(*a, **kw)

    def boom(*a, **kw):
        raise AssertionError("the Triton path must not run for CPU tensors")

    monkeypatch.setattr(dispatch, "paged_decode_attention_triton", boom)
    monkeypatch.setattr(dispatch, "paged_decode_attention_torch", twin)
    out = paged_decode_attention(*args, **lay.kwargs(), scale=0.125, mask=mask, num_splits=3)
    assert calls == [1]
    assert torch.equal(out, expected)


@pytest.fixture
def cpu_op(monkeypatch):
    """CPU tensors, the C++ operator (kernels/kivi_cpu.py) built, and the twin made to fail."""
    if not rotated_cpu.available():
        pytest.skip("no C++ toolchain here: the CPU operators cannot be built (the twin's tests cover this path)")

    def boom(*a, **kw):
        raise AssertionError("the twin ran where the CPU operator should have")

    monkeypatch.setattr(dispatch, "paged_decode_attention_torch", boom)
    with torch.device("cpu"):
        yield


@pytest.mark.usefixtures("cpu_op")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "B, G, D, Dv, bs, start, length, pads",
    [
        (3, 1, 64, 64, 16, 7, 333, (0, 111, 333)),  # row 2 fully masked
        (2, 3, 80, 80, 8, 21, 250, (0, 7)),
        (3, 4, 64, 48, 64, 100, 300, None),  # Dv != D
        (3, 3, 64, 64, 16, 1030, 2100, (0, 700, 2099)),  # start far into the table, spans over threads
    ],
)
def test_cpu_op_matches_reference(seed, dtype, B, G, D, Dv, bs, start, length, pads):
    Hkv = 2
    lay = Layout(B, Hkv, D, Dv, bs, start, length, dtype, share=2)
    q = torch.randn(B, Hkv * G, D).to(dtype)
    mask = None if pads is None else left_padding(B, length, pads)
    k_before, v_before = bits(lay.k_pool).clone(), bits(lay.v_pool).clone()
    out = paged_decode_attention(q, lay.k_pool, lay.v_pool, lay.table, **lay.kwargs(), scale=0.1, mask=mask)
    check(out, q, Dv, paged_reference(q, lay, 0.1, mask), seed, f"G={G}, bs={bs}")
    if pads is not None and max(pads) == length:
        assert torch.equal(out[pads.index(length)], torch.zeros_like(out[0]))
    assert torch.equal(bits(lay.k_pool), k_before) and torch.equal(bits(lay.v_pool), v_before)


@pytest.mark.usefixtures("cpu_op")
def test_cpu_op_reads_the_table_in_place(seed):
    # Pools that are views, then a table changed in place between calls, then a bad block id (check=True refuses
    # it with the twin's error: the operator reads ids unchecked).
    B, Hkv, G, D, bs, start, length = 2, 2, 2, 64, 8, 3, 40
    lay = Layout(B, Hkv, D, D, bs, start, length, torch.float32, share=0)
    q = torch.randn(B, Hkv * G, D)
    kbuf, vbuf = (torch.randn(lay.k_pool.shape[0], Hkv + 1, bs, D) for _ in range(2))
    kbuf[:, 1:], vbuf[:, 1:] = lay.k_pool, lay.v_pool
    out = paged_decode_attention(q, kbuf[:, 1:], vbuf[:, 1:], lay.table, **lay.kwargs(), scale=0.1)
    check(out, q, D, paged_reference(q, lay, 0.1), seed, "pool views")
    lay.table[[0, 1]] = lay.table[[1, 0]].clone()
    out = paged_decode_attention(q, lay.k_pool, lay.v_pool, lay.table, **lay.kwargs(), scale=0.1)
    check(out, q, D, paged_reference(q, lay, 0.1), seed, "after the rows swapped blocks in place")
    lay.table[1, 1] = 10**6
    with pytest.raises(ShapeError, match="1000000"):
        paged_decode_attention(q, lay.k_pool, lay.v_pool, lay.table, **lay.kwargs(), scale=0.1)


# ---------------------------------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------------------------------


def store_reference(k_pool, v_pool, keys, values, slots):
    k_pool, v_pool = k_pool.clone(), v_pool.clone()
    bs = k_pool.shape[2]
    for b in range(slots.shape[0]):
        for i in range(slots.shape[1]):
            s = int(slots[b, i])
            if s >= 0:
                k_pool[s // bs, :, s % bs] = keys[b, :, i]
                v_pool[s // bs, :, s % bs] = values[b, :, i]
    return k_pool, v_pool


def random_slots(B, n, num_slots, skip=0.2):
    """Distinct slots of 0..num_slots-2 (the last slot is left free), about `skip` of them -1."""
    slots = torch.randperm(num_slots - 1)[: B * n].view(B, n)
    slots[torch.rand(B, n) < skip] = -1
    return slots


@pytest.mark.parametrize("fn", [paged_store_triton, paged_store_torch, paged_store])
@pytest.mark.parametrize(
    "dtype, B, Hkv, n, D, Dv, bs",
    [
        (torch.float32, 2, 2, 37, 64, 64, 16),  # prefill: several tiles of tokens
        (torch.float16, 3, 1, 1, 80, 48, 8),  # decode step
        (torch.bfloat16, 2, 3, 20, 64, 80, 64),
    ],
)
def test_store_matches_loop(seed, fn, dtype, B, Hkv, n, D, Dv, bs):
    nb = (B * n) // bs + 4
    k_pool = torch.randn(nb, Hkv, bs, D).to(dtype)
    v_pool = torch.randn(nb, Hkv, bs, Dv).to(dtype)
    # Keys as a model hands them: [B, n, Hkv, D] storage seen as [B, Hkv, n, D].
    keys = torch.randn(B, n, Hkv, D).to(dtype).transpose(1, 2)
    values = torch.randn(B, Hkv, n, Dv).to(dtype)
    slots = random_slots(B, n, nb * bs)
    if n > 1:
        slots[0, 0], slots[-1, -1] = -1, nb * bs - 1  # a skipped slot, the last slot of the pool
    k_ref, v_ref = store_reference(k_pool, v_pool, keys, values, slots)
    k_data, v_data = k_pool.data_ptr(), v_pool.data_ptr()
    assert fn(k_pool, v_pool, keys, values, slots) is None
    assert k_pool.data_ptr() == k_data and v_pool.data_ptr() == v_data
    assert torch.equal(bits(k_pool), bits(k_ref)), f"seed {seed}"
    assert torch.equal(bits(v_pool), bits(v_ref)), f"seed {seed}"


@pytest.mark.usefixtures("on_cpu")
def test_store_dispatcher_uses_torch_twin_on_cpu(monkeypatch):
    args = _store()
    calls = []

    def twin(*a, **kw):
        calls.append(1)
        return paged_store_torch(*a, **kw)

    def boom(*a, **kw):
        raise AssertionError("the Triton path must not run for CPU tensors")

    monkeypatch.setattr(dispatch, "paged_store_triton", boom)
    monkeypatch.setattr(dispatch, "paged_store_torch", twin)
    paged_store(**args)
    assert calls == [1]
    assert torch.equal(args["k_pool"][1, :, 1], args["keys"][0, :, 1])


@pytest.mark.usefixtures("cpu_op")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("operator", [True, False])
def test_store_token_writes_each_rows_block_at_the_offset(seed, monkeypatch, dtype, operator):
    """A decode step's token (`paged_store_token`): the C++ operator (eager CPU) and the indexing it replaces (what a
    traced step runs, forced here) write the same bits, every row into the block its table column names; keys as a
    model hands them (a transposed view), pools that are views (a spare head), nothing else touched, their version
    counters moved; a table naming a block past the pool is refused by the operator, naming it."""
    calls, write = [], dispatch.kivi_cpu.write_token_cpu
    monkeypatch.setattr(dispatch.kivi_cpu, "write_token_cpu", lambda *a: calls.append(1) or write(*a))
    if not operator:
        monkeypatch.setattr(dispatch.kivi_cpu, "supports", lambda x: False)
    Hkv, bs, D, Dv, B = 2, 8, 32, 48, 3
    nb = 9
    kbuf, vbuf = torch.randn(nb, Hkv + 1, bs, D).to(dtype), torch.randn(nb, Hkv + 1, bs, Dv).to(dtype)
    k_pool, v_pool = kbuf[:, 1:], vbuf[:, 1:]
    keys = torch.randn(B, 1, Hkv, D).to(dtype).transpose(1, 2)
    values = torch.randn(B, Hkv, 1, Dv).to(dtype)
    table = torch.tensor([[0, 4, 2], [1, 7, 3], [8, 5, 6]], dtype=torch.int32)
    column, offset = 1, 5
    rows = table[:, column]
    k_ref, v_ref = kbuf.clone(), vbuf.clone()
    for b in range(B):
        k_ref[rows[b], 1:, offset] = keys[b, :, 0]
        v_ref[rows[b], 1:, offset] = values[b, :, 0]
    versions = kbuf._version, vbuf._version
    dispatch.paged_store_token(k_pool, v_pool, keys, values, offset, table, column)
    assert torch.equal(bits(kbuf), bits(k_ref)) and torch.equal(bits(vbuf), bits(v_ref)), f"seed {seed}"
    # Written in place as far as torch knows (an offloaded layer's placement reads the version counters).
    assert kbuf._version > versions[0] and vbuf._version > versions[1]
    assert calls == ([1] if operator else [])
    if operator:
        with pytest.raises(RuntimeError, match="names block 9 of 9"):
            dispatch.paged_store_token(k_pool, v_pool, keys, values, 0, table.masked_fill(table == 8, 9), 0)


@pytest.mark.parametrize("fn", [paged_store_triton, paged_store_torch])
def test_store_into_pool_views_and_nothing(seed, fn):
    # Pools that are views (a spare head): the write lands in the buffer. All slots -1, and n = 0,
    # write nothing.
    nb, Hkv, bs, D = 5, 2, 8, 32
    kbuf, vbuf = torch.randn(nb, Hkv + 1, bs, D), torch.randn(nb, Hkv + 1, bs, D)
    keys, values = torch.randn(2, Hkv, 6, D), torch.randn(2, Hkv, 6, D)
    slots = random_slots(2, 6, nb * bs)
    k_ref, v_ref = store_reference(kbuf[:, 1:], vbuf[:, 1:], keys, values, slots)
    fn(kbuf[:, 1:], vbuf[:, 1:], keys, values, slots)
    assert torch.equal(kbuf[:, 1:], k_ref) and torch.equal(vbuf[:, 1:], v_ref)
    before = kbuf.clone(), vbuf.clone()
    fn(kbuf[:, 1:], vbuf[:, 1:], keys, values, torch.full((2, 6), -1, dtype=torch.int64))
    fn(kbuf[:, 1:], vbuf[:, 1:], keys[:, :, :0], values[:, :, :0], torch.zeros(2, 0, dtype=torch.int64))
    assert torch.equal(kbuf, before[0]) and torch.equal(vbuf, before[1])


def test_store_triton_skips_out_of_range_slots(seed):
    # The Triton path does not sync to check slot values; a slot past the pool is not written.
    k_pool, v_pool = torch.randn(3, 1, 8, 16), torch.randn(3, 1, 8, 16)
    keys, values = torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16)
    slots = torch.tensor([[5, 24, 10**9]])
    k_ref, v_ref = store_reference(k_pool, v_pool, keys[:, :, :1], values[:, :, :1], slots[:, :1])
    paged_store_triton(k_pool, v_pool, keys, values, slots)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)


def test_store_then_attend(seed):
    # The two halves together, as a cache uses them: store a prompt through slots from a block
    # table, then attend over it; the twins and the kernels agree with the dense reference.
    B, Hkv, G, D, bs, n = 2, 2, 2, 32, 8, 21
    lay = Layout(B, Hkv, D, D, bs, 3, n, torch.float32, share=0)
    t = torch.arange(3, 3 + n)
    slots = lay.table.long()[:, t // bs] * bs + t % bs
    keys, values = torch.randn(B, Hkv, n, D), torch.randn(B, Hkv, n, D)
    q = torch.randn(B, Hkv * G, D)
    dense = keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1)
    p = torch.softmax(torch.einsum("bhd,bhnd->bhn", q.double(), dense[0].double()) * 0.2, dim=-1)
    ref = torch.einsum("bhn,bhnd->bhd", p, dense[1].double())
    pairs = ((paged_store_torch, paged_decode_attention_torch), (paged_store_triton, paged_decode_attention_triton))
    for store, attend in pairs:
        k_pool, v_pool = lay.k_pool.clone(), lay.v_pool.clone()
        store(k_pool, v_pool, keys, values, slots)
        out = attend(q, k_pool, v_pool, lay.table, start=3, length=n, scale=0.2)
        check(out, q, D, ref, seed, store.__name__)


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------


def _attn(**overrides):
    """Valid inputs (B=2, Hq=4, Hkv=2, 6 blocks of 8, D=Dv=32, 3 table columns, tokens 2..21)."""
    args = {
        "q": torch.randn(2, 4, 32),
        "k_pool": torch.randn(6, 2, 8, 32),
        "v_pool": torch.randn(6, 2, 8, 32),
        "block_table": torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
        "start": 2,
        "length": 20,
        "scale": 0.5,
        "mask": None,
    }
    args.update(overrides)
    return args


def _pools(bs, nb=6):
    return {"k_pool": torch.randn(nb, 2, bs, 32), "v_pool": torch.randn(nb, 2, bs, 32)}


ATTN_CASES = [
    ("q ndim", ShapeError, _attn(q=torch.randn(2, 4, 1, 32)), ["3", "4"]),
    ("k_pool ndim", ShapeError, _attn(k_pool=torch.randn(6, 2, 256)), ["4", "3"]),
    ("v_pool ndim", ShapeError, _attn(v_pool=torch.randn(1, 6, 2, 8, 32)), ["4", "5"]),
    ("pool type", DTypeError, _attn(k_pool=[1.0]), ["list"]),
    ("pool blocks", ShapeError, _attn(v_pool=torch.randn(7, 2, 8, 32)), ["6", "7"]),
    ("pool heads", ShapeError, _attn(v_pool=torch.randn(6, 1, 8, 32)), ["[6, 2, 8]", "[6, 1, 8]"]),
    ("pool block size", ShapeError, _attn(v_pool=torch.randn(6, 2, 16, 32)), ["8", "16"]),
    ("no blocks", ShapeError, _attn(**_pools(8, nb=0)), ["num_blocks=0"]),
    ("block size 12", ConfigError, _attn(**_pools(12)), ["12", "8", "128"]),
    ("block size 4", ConfigError, _attn(**_pools(4), start=0, length=4), ["4", "8", "128"]),
    ("block size 256", ConfigError, _attn(**_pools(256)), ["256", "8", "128"]),
    (
        "group",
        ShapeError,
        _attn(q=torch.randn(2, 6, 32), k_pool=torch.randn(6, 4, 8, 32), v_pool=torch.randn(6, 4, 8, 32)),
        ["6", "4"],
    ),
    ("head dim", ShapeError, _attn(q=torch.randn(2, 4, 48)), ["48", "32"]),
    (
        "head dim small",
        ShapeError,
        _attn(q=torch.randn(2, 4, 8), k_pool=torch.randn(6, 2, 8, 8)),
        ["8", "16", "256"],
    ),
    ("value dim", ShapeError, _attn(v_pool=torch.randn(6, 2, 8, 300)), ["300", "256"]),
    ("dtype", DTypeError, _attn(q=torch.randn(2, 4, 32, dtype=torch.float64)), ["float64"]),
    ("pool dtype mix", DTypeError, _attn(v_pool=torch.randn(6, 2, 8, 32, dtype=torch.float16)), ["float32", "float16"]),
    (
        "q vs pools dtype",
        DTypeError,
        _attn(**{k: t.half() for k, t in _pools(8).items()}),
        ["float32", "float16"],
    ),
    ("table type", DTypeError, _attn(block_table=[[0, 1, 2], [3, 4, 5]]), ["list"]),
    ("table dtype", DTypeError, _attn(block_table=torch.zeros(2, 3, dtype=torch.int64)), ["int64", "int32"]),
    ("table ndim", ShapeError, _attn(block_table=torch.zeros(6, dtype=torch.int32)), ["2", "1"]),
    ("table batch", ShapeError, _attn(block_table=torch.zeros(3, 3, dtype=torch.int32)), ["B=2", "3 rows"]),
    ("start negative", ConfigError, _attn(start=-1), ["-1"]),
    ("start float", ConfigError, _attn(start=2.0), ["2.0"]),
    ("length float", ConfigError, _attn(length=20.0), ["20.0"]),
    ("length 0", ShapeError, _attn(length=0), ["length=0"]),
    ("past the table", ShapeError, _attn(start=5), ["5", "20", "4", "3 columns", "24"]),
    ("mask dtype", DTypeError, _attn(mask=torch.ones(2, 20)), ["float32", "bool"]),
    ("mask shape", ShapeError, _attn(mask=torch.ones(2, 21, dtype=torch.bool)), ["[2, 20]", "[2, 21]"]),
    ("mask ndim", ShapeError, _attn(mask=torch.ones(2, 1, 20, dtype=torch.bool)), ["[2, 20]", "[2, 1, 20]"]),
    ("pool device", DeviceError, _attn(v_pool=torch.randn(6, 2, 8, 32, device="meta")), [HOME, "meta"]),
    (
        "q device",
        DeviceError,
        _attn(**{k: t.to("meta") for k, t in _pools(8).items()}),
        [HOME, "meta"],
    ),
    (
        "table device",
        DeviceError,
        _attn(block_table=torch.zeros(2, 3, dtype=torch.int32, device="meta")),
        [HOME, "meta"],
    ),
    ("mask device", DeviceError, _attn(mask=torch.ones(2, 20, dtype=torch.bool, device="meta")), [HOME, "meta"]),
    ("scale", ConfigError, _attn(scale=float("nan")), ["nan"]),
    ("scale type", ConfigError, _attn(scale="0.5"), ["0.5"]),
]


def _call_attention(fn, args):
    args = dict(args)
    pos = [args.pop(k) for k in ("q", "k_pool", "v_pool", "block_table")]
    return fn(*pos, **args)


@pytest.mark.parametrize("fn", [paged_decode_attention, paged_decode_attention_torch, paged_decode_attention_triton])
@pytest.mark.parametrize("name, exc, args, numbers", ATTN_CASES, ids=[c[0] for c in ATTN_CASES])
def test_attention_validation_errors(fn, name, exc, args, numbers):
    with pytest.raises(exc) as info:
        _call_attention(fn, args)
    assert isinstance(info.value, KVPlusError)
    for n in numbers:
        assert n in str(info.value), f"{name}: {n!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("fn", [paged_decode_attention, paged_decode_attention_triton])
@pytest.mark.parametrize("num_splits", [0, -2, 1.5])
def test_attention_bad_num_splits(fn, num_splits):
    with pytest.raises(ConfigError, match=str(num_splits)):
        _call_attention(fn, _attn(num_splits=num_splits))


@pytest.mark.parametrize("fn", [paged_decode_attention, paged_decode_attention_torch])
@pytest.mark.parametrize("bad, numbers", [(-1, ["-1", "0..5"]), (6, ["6", "0..5"])])
def test_twin_checks_block_ids_it_reads(request, fn, bad, numbers):
    # Columns 0..2 are read for tokens 2..21; a -1 or a block past the pool there is an error, while
    # an unread column may hold anything. The dispatcher reaches the twin with CPU tensors: it sends CUDA ones to
    # Triton, which reads no table value (a bad id there counts as masked keys: see the module doc).
    if fn is paged_decode_attention:
        request.getfixturevalue("on_cpu")
    table = torch.tensor([[0, 1, 2, -7], [3, 4, 5, 99]], dtype=torch.int32)
    _call_attention(fn, _attn(block_table=table))
    table[1, 1] = bad
    with pytest.raises(ShapeError) as info:
        _call_attention(fn, _attn(block_table=table))
    for n in numbers + ["0..2"]:
        assert n in str(info.value)


def _store(**overrides):
    """Valid inputs: pools of 6 blocks of 8, Hkv=2, D=Dv=32; 3 tokens per row, B=2."""
    args = {
        "k_pool": torch.randn(6, 2, 8, 32),
        "v_pool": torch.randn(6, 2, 8, 32),
        "keys": torch.randn(2, 2, 3, 32),
        "values": torch.randn(2, 2, 3, 32),
        "slot_mapping": torch.tensor([[0, 9, -1], [47, 3, 4]]),
    }
    args.update(overrides)
    return args


STORE_CASES = [
    ("pool ndim", ShapeError, _store(k_pool=torch.randn(6, 2, 256)), ["4", "3"]),
    ("pool blocks", ShapeError, _store(v_pool=torch.randn(5, 2, 8, 32)), ["[6, 2, 8]", "[5, 2, 8]"]),
    ("block size 24", ConfigError, _store(**_pools(24)), ["24", "8", "128"]),
    ("pool dtype", DTypeError, _store(**{k: t.double() for k, t in _pools(8).items()}), ["float64"]),
    ("pool dtype mix", DTypeError, _store(v_pool=torch.randn(6, 2, 8, 32).half()), ["float32", "float16"]),
    ("pool device", DeviceError, _store(v_pool=torch.randn(6, 2, 8, 32, device="meta")), [HOME, "meta"]),
    ("keys type", DTypeError, _store(keys=1.0), ["float"]),
    ("keys ndim", ShapeError, _store(keys=torch.randn(2, 3, 32)), ["4", "3"]),
    ("keys dtype", DTypeError, _store(keys=torch.randn(2, 2, 3, 32).half()), ["float16", "float32"]),
    ("values dtype", DTypeError, _store(values=torch.randn(2, 2, 3, 32).bfloat16()), ["bfloat16", "float32"]),
    ("keys device", DeviceError, _store(keys=torch.randn(2, 2, 3, 32, device="meta")), [HOME, "meta"]),
    ("tokens", ShapeError, _store(values=torch.randn(2, 2, 4, 32)), ["[2, 3]", "[2, 4]"]),
    ("batch", ShapeError, _store(values=torch.randn(1, 2, 3, 32)), ["[2, 3]", "[1, 3]"]),
    ("heads", ShapeError, _store(keys=torch.randn(2, 3, 3, 32)), ["Hkv=2", "3"]),
    ("head dim", ShapeError, _store(keys=torch.randn(2, 2, 3, 16)), ["32", "16"]),
    ("value dim", ShapeError, _store(values=torch.randn(2, 2, 3, 48)), ["32", "48"]),
    ("slots type", DTypeError, _store(slot_mapping=[[0, 1, 2], [3, 4, 5]]), ["list"]),
    ("slots dtype", DTypeError, _store(slot_mapping=torch.zeros(2, 3, dtype=torch.int32)), ["int32", "int64"]),
    ("slots shape", ShapeError, _store(slot_mapping=torch.zeros(2, 4, dtype=torch.int64)), ["[2, 3]", "[2, 4]"]),
    (
        "slots device",
        DeviceError,
        _store(slot_mapping=torch.zeros(2, 3, dtype=torch.int64, device="meta")),
        [HOME, "meta"],
    ),
]


@pytest.mark.parametrize("fn", [paged_store, paged_store_torch, paged_store_triton])
@pytest.mark.parametrize("name, exc, args, numbers", STORE_CASES, ids=[c[0] for c in STORE_CASES])
def test_store_validation_errors(fn, name, exc, args, numbers):
    with pytest.raises(exc) as info:
        fn(**args)
    assert isinstance(info.value, KVPlusError)
    for n in numbers:
        assert n in str(info.value), f"{name}: {n!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("fn", [paged_store, paged_store_torch])
@pytest.mark.parametrize("bad", [48, -2, 10**6])
def test_store_twin_rejects_slots_outside_pool(request, fn, bad):
    if fn is paged_store:  # the twin with CPU tensors (CUDA: Triton, test_store_triton_skips_out_of_range_slots)
        request.getfixturevalue("on_cpu")
    args = _store()
    args["slot_mapping"][1, 2] = bad
    before = args["k_pool"].clone()
    with pytest.raises(ShapeError) as info:
        fn(**args)
    for n in (str(bad), "0..47", "6 blocks x 8"):
        assert n in str(info.value)
    assert torch.equal(args["k_pool"], before)  # checked before anything is written
