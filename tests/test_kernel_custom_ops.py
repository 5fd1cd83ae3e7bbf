"""The kernels as torch custom operators (``kernels/custom_ops.py``): what ``torch.compile`` sees.

1. ``torch.library.opcheck`` passes for every ``torch.ops.kvplus`` op: schema (declared mutations,
   no aliasing), the fake implementation against the real one (shapes, dtypes, strides), autograd
   registration, and aot dispatch with dynamic shapes.
2. Every entry point called with ``check=False`` inside ``torch.compile(..., fullgraph=True)`` becomes
   exactly one ``kvplus`` node of the captured graph (and none of its twin's ops) on CUDA; off CUDA every
   entry point but the paged store is traced inline as its twin (no ``kvplus`` node); the compiled
   call gives eager's results bit for bit, in-place writes included (pools, ``out`` views and the
   buffers around them). With ``backend="aot_eager"`` the mutations go through functionalization: a
   store followed by attention over the stored tokens, and quantize-and-pack into buffer slices.
   ``torch.export`` (strict and non-strict) keeps the op too.
3. ``start`` and ``length`` reach the ops as SymInts: a dynamic compile serves two decode steps with
   one graph.
4. Eager calls never dispatch a ``kvplus`` op (the custom-op dispatch is for compiled graphs only).
5. The ops' CUDA implementations call the Triton paths with the right arguments: run here on CPU
   tensors under the Triton interpreter (compiled on CUDA where the suite runs there), they must
   equal the eager Triton entry points bit for bit.

Inputs come from ``test_kernel_unchecked``'s helpers, fresh random numbers each run (seed in
failure messages); each side of a comparison gets its own copy, rebuilt from the same seed.
"""

from __future__ import annotations

import contextlib
import operator
import unittest.mock

import pytest
import torch
from test_kernel_unchecked import (
    as_bits,
    assert_same,
    dense_case,
    pack_case,
    paged_case,
    quant_case,
    store_case,
)

import hf_kvplus.kernels.custom_ops as ops
from hf_kvplus.kernels import kivi_cpu
from hf_kvplus.kernels.decode_attention import decode_attention_triton, decode_attention_with_mass_triton
from hf_kvplus.kernels.dispatch import (
    decode_attention,
    paged_decode_attention,
    paged_store,
    quantize_keys,
    quantize_values,
    quantize_values_at,
    quantized_decode_attention,
)
from hf_kvplus.kernels.paged_attention import paged_decode_attention_triton, paged_store_triton
from hf_kvplus.kernels.quant_attention import (
    quantized_decode_attention_triton,
    quantized_decode_attention_with_mass_triton,
)
from hf_kvplus.kernels.quant_format import QuantFormat
from hf_kvplus.kernels.quant_pack import (
    quantize_keys_triton,
    quantize_values_at_triton,
    quantize_values_triton,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
KV = torch.ops.kvplus


def decode_attention_with_mass(*args, **kwargs):
    """The dispatcher asked for the mass: the custom operator of this name when traced on CUDA."""
    return decode_attention(*args, with_mass=True, **kwargs)


def quantized_decode_attention_with_mass(*args, **kwargs):
    """The dispatcher asked for the mass: the custom operator of this name when traced on CUDA."""
    return quantized_decode_attention(*args, with_mass=True, **kwargs)


# ---------------------------------------------------------------------------------------------------
# Inputs, as entry-point arguments and as op arguments
# ---------------------------------------------------------------------------------------------------

# dense_case: dtype, B, Hkv, G, N, D, Dv, pads (row 1 fully masked in the first)
DENSE = {"f16-mask": (F16, 2, 2, 3, 40, 32, 32, (0, 40)), "f32": (F32, 1, 2, 2, 24, 32, 16, None)}
# paged_case: dtype, B, Hkv, G, D, Dv, bs, start, length, pads, pool view
PAGED = {
    "f32-mask": (F32, 2, 2, 2, 32, 32, 8, 3, 30, (0, 5), False),
    "f16-view": (F16, 2, 1, 4, 32, 16, 16, 13, 45, None, True),
}
# quant_case: bits, group, dtype, B, Hkv, G, D, Dv, T (buffer or block size), start, length, R, pads, paged
# (, keys per token)
QUANT = {
    "int4-dense-residual-mask": (4, 16, F16, 2, 1, 2, 32, 32, 32, 5, 20, 3, (0, 4), False),
    "fp8-dense-mask": ("fp8", 16, F32, 1, 2, 2, 32, 64, 64, 0, 48, None, (5,), False),
    "int4-paged-residual-mask": (4, 8, F32, 2, 1, 2, 32, 32, 16, 3, 30, 4, (2, 0), True),
    "fp8-paged": ("fp8", 8, F16, 2, 2, 1, 32, 32, 8, 3, 20, None, None, True),
    "int2-slots-mask": (2, 16, F32, 2, 2, 2, 32, 32, 37, 0, 37, None, (0, 6), False, True),  # keys per token
}
# store_case: dtype, B, Hkv, n, D, Dv, bs
STORE = {"f32-prefill": (F32, 2, 2, 5, 32, 32, 8), "bf16-step": (BF16, 1, 1, 1, 32, 64, 16)}
# pack_case (after the kind): bits, group, dtype, B, H, T, D
PACK = {"int4": (4, 16, F16, 1, 2, 32, 32), "fp8": ("fp8", 16, F32, 2, 1, 16, 32)}


def dense_op_args(args, kw, num_splits=2):
    q, k, v = args
    return (q, k, v, kw["scale"], kw["mask"], num_splits)


def paged_op_args(args, kw, num_splits=2):
    q, k_pool, v_pool, table = args
    return (q, k_pool, v_pool, table, kw["start"], kw["length"], kw["scale"], kw["mask"], num_splits)


def quant_op_args(args, kw, num_splits=2):
    q, p, fmt = args
    return (
        q, p.k, p.k_scale, p.k_zero, p.v, p.v_scale, p.v_zero, str(fmt.bits), fmt.group_size, kw["start"],
        kw["length"], kw["scale"], kw["residual_k"], kw["residual_v"], kw["mask"], kw["block_table"],
        num_splits, kw["keys_per_token"],
    )  # fmt: skip


def at_case(bits, group, dtype, B, H, T, D):
    """Values to quantize into distinct slots of slot buffers [B, H, T + 5, ...] (an evicting cache's hole)."""
    fmt, slots_total = QuantFormat(bits, group), T + 5
    x = torch.randn(B, H, T, D).to(dtype)
    slots = torch.stack([torch.randperm(slots_total)[:T] for _ in range(B * H)]).view(B, H, T).to(x.device)
    codes = torch.zeros(B, H, slots_total, D // fmt.per_byte, dtype=torch.uint8)
    scale = torch.zeros(B, H, slots_total, D // group, dtype=torch.float16)
    zero = None if fmt.is_float else torch.zeros(B, H, slots_total, D // group, dtype=torch.float16)
    return x, fmt, (codes, scale, zero), slots


def at_op_args(case):
    x, fmt, out, slots = at_case(*case)
    return (x, str(fmt.bits), fmt.group_size, *out, slots)


def pack_op_args(kind, case):
    x, fmt, out = pack_case(kind, *case, True)
    return (x, str(fmt.bits), fmt.group_size, *out)


def twice(seed, make):
    """Two independent copies of the inputs ``make()`` builds (rebuilt from the same seed)."""
    torch.manual_seed(seed)
    first = make()
    torch.manual_seed(seed)
    return first, make()


# ---------------------------------------------------------------------------------------------------
# 1. opcheck
# ---------------------------------------------------------------------------------------------------

#: Per op: its cases, and how one case becomes the op's arguments.
OP_INPUTS = {
    "decode_attention": (DENSE, lambda c: dense_op_args(*dense_case(*c))),
    "decode_attention_with_mass": (DENSE, lambda c: dense_op_args(*dense_case(*c))),
    "paged_decode_attention": (PAGED, lambda c: paged_op_args(*paged_case(*c[:-1], pool_view=c[-1]))),
    "paged_store": (STORE, lambda c: store_case(*c)),
    "quantized_decode_attention": (QUANT, lambda c: quant_op_args(*quant_case(*c))),
    "quantized_decode_attention_with_mass": (QUANT, lambda c: quant_op_args(*quant_case(*c))),
    "quantize_keys": (PACK, lambda c: pack_op_args("keys", c)),
    "quantize_values": (PACK, lambda c: pack_op_args("values", c)),
    "quantize_values_at": (PACK, at_op_args),
}
OPCHECK_CASES = [(op, case) for op, (cases, _) in OP_INPUTS.items() for case in cases]


@pytest.mark.parametrize(("op", "case"), OPCHECK_CASES, ids=[f"{op}-{case}" for op, case in OPCHECK_CASES])
def test_opcheck(seed, op, case):
    cases, op_args = OP_INPUTS[op]
    results = torch.library.opcheck(getattr(ops, op), op_args(cases[case]))
    assert set(results.values()) == {"SUCCESS"}, f"{op} {case}: {results} (seed {seed})"


# ---------------------------------------------------------------------------------------------------
# 2. Each entry point compiles to one kvplus op, with eager's results
# ---------------------------------------------------------------------------------------------------


class GraphRecorder:
    """A ``torch.compile`` backend that keeps every FX graph dynamo captures and runs it as captured."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def calls(self) -> list:
        return [n.target for g in self.graphs for n in g.graph.nodes if n.op == "call_function"]


def compile_recorded(fn, **kwargs):
    torch._dynamo.reset()  # no graph of an earlier test (same code object, other backend) is reused
    recorder = GraphRecorder()
    return torch.compile(fn, backend=recorder, fullgraph=True, **kwargs), recorder


def check_compiled(seed, fn, make, op, allowed=()):
    """``fn(*make())`` eager and compiled (each on its own copy of the inputs): the same results and the
    same inputs afterwards (in-place writes), bit for bit; the graph calls ``op`` once and nothing but
    ``allowed`` besides. Returns the compiled call's inputs and the eager call's."""
    eager_in, compiled_in = twice(seed, make)
    want = fn(*eager_in)
    compiled, recorder = compile_recorded(fn)
    got = compiled(*compiled_in)
    calls = recorder.calls()
    assert len(recorder.graphs) == 1 and calls.count(op) == 1, f"{op} not captured once: {calls}"
    assert set(calls) - {op} <= set(allowed), f"graph calls more than {op}: {calls}"
    if want is None:
        assert got is None
    else:
        assert_same(got, want, seed, f"compiled {op}")
    tensors = [(a, b) for a, b in zip(compiled_in, eager_in, strict=True) if isinstance(a, torch.Tensor)]
    assert_same(tuple(a for a, _ in tensors), tuple(b for _, b in tensors), seed, f"inputs after {op}")
    return compiled_in, eager_in


@pytest.mark.parametrize("case", DENSE)
@pytest.mark.parametrize("entry", [decode_attention, decode_attention_with_mass], ids=lambda f: f.__name__)
def test_compiled_dense(seed, entry, case):
    scale = dense_case(*DENSE[case])[1]["scale"]

    def fn(q, k, v, mask):
        return entry(q, k, v, scale=scale, mask=mask, num_splits=2, check=False)

    def make():
        (q, k, v), kw = dense_case(*DENSE[case])
        return q, k, v, kw["mask"]

    if make()[0].is_cuda:
        # getitem: the with-mass op returns a tuple, which the graph takes apart.
        check_compiled(seed, fn, make, getattr(KV, entry.__name__).default, allowed={operator.getitem})
    else:
        check_inlined(seed, fn, make, eager_twin=entry is decode_attention_with_mass)


def check_inlined(seed, fn, make, eager_twin: bool = False):
    """Off CUDA an entry point's twin is traced inline (torch the compiler fuses with its neighbours): one graph,
    no ``kvplus`` node, eager's results and in-place writes bit for bit. `eager_twin`: eager's with the C++ operators
    off, where the eager call takes one that sums in another order than the twin (the dense decode with mass).
    Returns the inputs, as `check_compiled`."""
    eager_in, compiled_in = twice(seed, make)
    with unittest.mock.patch.object(kivi_cpu, "supports", lambda q: False) if eager_twin else contextlib.nullcontext():
        want = fn(*eager_in)
    compiled, recorder = compile_recorded(fn)
    got = compiled(*compiled_in)
    calls = recorder.calls()
    assert len(recorder.graphs) == 1, f"{len(recorder.graphs)} graphs"
    assert not [c for c in calls if str(c).startswith("kvplus.")], f"a kvplus op off CUDA: {calls}"
    assert_same(got, want, seed, "compiled inline twin")
    tensors = [(a, b) for a, b in zip(compiled_in, eager_in, strict=True) if isinstance(a, torch.Tensor)]
    assert_same(tuple(a for a, _ in tensors), tuple(b for _, b in tensors), seed, "inputs after the inline twin")
    return compiled_in, eager_in


@pytest.mark.parametrize("case", PAGED)
def test_compiled_paged_attention(seed, case):
    *shape, view = PAGED[case]
    kw = paged_case(*shape)[1]

    def fn(q, k_pool, v_pool, table, mask):
        return paged_decode_attention(
            q, k_pool, v_pool, table, start=kw["start"], length=kw["length"], scale=kw["scale"], mask=mask,
            check=False,
        )  # fmt: skip

    def make():
        args, kw = paged_case(*shape, pool_view=view)
        return (*args, kw["mask"])

    if make()[0].is_cuda:
        check_compiled(seed, fn, make, KV.paged_decode_attention.default)
    else:
        check_inlined(seed, fn, make)


@pytest.mark.parametrize("case", STORE)
def test_compiled_paged_store(seed, case):
    def fn(k_pool, v_pool, keys, values, slots):
        paged_store(k_pool, v_pool, keys, values, slots, check=False)

    (k_pool, v_pool, keys, values, slots), _ = check_compiled(
        seed, fn, lambda: store_case(*STORE[case]), KV.paged_store.default
    )
    bs = STORE[case][-1]
    for b, i in ((0, 0), (-1, -1)):  # the rows did land (not two untouched pools)
        s = int(slots[b, i])
        assert torch.equal(as_bits(k_pool[s // bs, :, s % bs]), as_bits(keys[b, :, i])), f"seed {seed}"
        assert torch.equal(as_bits(v_pool[s // bs, :, s % bs]), as_bits(values[b, :, i])), f"seed {seed}"


@pytest.mark.parametrize("case", QUANT)
@pytest.mark.parametrize(
    "entry", [quantized_decode_attention, quantized_decode_attention_with_mass], ids=lambda f: f.__name__
)
def test_compiled_quantized_attention(seed, entry, case):
    (_, _, fmt), kw = quant_case(*QUANT[case])
    start, length, scale, per_token = kw["start"], kw["length"], kw["scale"], kw["keys_per_token"]

    def fn(q, packed, residual_k, residual_v, mask, table):
        return entry(
            q, packed, fmt, start=start, length=length, scale=scale, residual_k=residual_k,
            residual_v=residual_v, mask=mask, block_table=table, num_splits=2, keys_per_token=per_token, check=False,
        )  # fmt: skip

    def make():
        (q, packed, _), kw = quant_case(*QUANT[case])
        return q, packed, kw["residual_k"], kw["residual_v"], kw["mask"], kw["block_table"]

    if make()[0].is_cuda:
        check_compiled(seed, fn, make, getattr(KV, entry.__name__).default, allowed={operator.getitem})
    else:
        check_inlined(seed, fn, make)


@pytest.mark.parametrize("with_out", [False, True], ids=["new", "out"])
@pytest.mark.parametrize("case", PACK)
@pytest.mark.parametrize("entry", [quantize_keys, quantize_values], ids=lambda f: f.__name__)
def test_compiled_quantize(seed, entry, case, with_out):
    kind = entry.__name__.split("_")[1]
    fmt = QuantFormat(*PACK[case][:2])

    def fn(x, codes, scale, zero):
        return entry(x, fmt, None if codes is None else (codes, scale, zero), check=False)

    def make():
        x, _, out = pack_case(kind, *PACK[case], with_out)
        return (x, *(out or (None, None, None)))

    if make()[0].is_cuda:  # without out, the results are allocated in the graph
        (_, *out), (_, *eager_out) = check_compiled(
            seed, fn, make, getattr(KV, entry.__name__).default, allowed={torch.empty}
        )
    else:  # traced inline, writing into the `out` views in place
        (_, *out), (_, *eager_out) = check_inlined(seed, fn, make)
    if with_out:  # the views were compared; the buffers around them too
        for got, want in zip(out, eager_out, strict=True):
            if got is not None:
                assert_same(got._base, want._base, seed, "buffer around an out view")
        assert (out[1] != 0).all(), f"scales not written (seed {seed})"


# ---------------------------------------------------------------------------------------------------
# 2b. aot_eager: mutations through functionalization
# ---------------------------------------------------------------------------------------------------


def test_aot_eager_store_then_attend(seed):
    """Store three new tokens per row into the blocks the attention reads, then attend over them."""
    B, Hkv, G, D, bs, start, length, n = 2, 2, 2, 32, 8, 3, 30, 3
    scale = 0.125

    def make():
        (q, k_pool, v_pool, table), kw = paged_case(F32, B, Hkv, G, D, D, bs, start, length, (0, 4))
        tokens = torch.arange(start + length - n, start + length)  # the last n attended tokens
        slots = (table[:, tokens // bs].long() * bs + tokens % bs).contiguous()  # own blocks: distinct rows
        keys, values = torch.randn(B, Hkv, n, D), torch.randn(B, Hkv, n, D)
        return k_pool, v_pool, keys, values, slots, q, table, kw["mask"]

    def fn(k_pool, v_pool, keys, values, slots, q, table, mask):
        paged_store(k_pool, v_pool, keys, values, slots, check=False)
        return paged_decode_attention(
            q, k_pool, v_pool, table, start=start, length=length, scale=scale, mask=mask, check=False
        )

    eager_in, compiled_in = twice(seed, make)
    k_pool, v_pool, _, _, _, q, table, mask = eager_in
    before = paged_decode_attention(
        q, k_pool, v_pool, table, start=start, length=length, scale=scale, mask=mask
    )
    want = fn(*eager_in)
    assert not torch.equal(want, before), "the store does not change what the attention reads"
    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(*compiled_in)
    assert_same(got, want, seed, "attention after the store")
    assert_same(compiled_in[:2], eager_in[:2], seed, "pools after the store")


@pytest.mark.parametrize("case", PACK)
def test_aot_eager_quantize_into_buffer_slices(seed, case):
    """Keys and values quantized into token slices of larger buffers, as the quantized storages do."""

    def make():
        xk, fmt, out_k = pack_case("keys", *PACK[case], True)
        xv, _, out_v = pack_case("values", *PACK[case], True)
        return fmt, xk, out_k, xv, out_v

    def fn(xk, out_k, xv, out_v, fmt):
        quantize_keys(xk, fmt, out_k, check=False)
        quantize_values(xv, fmt, out_v, check=False)

    (fmt, *eager_in), (_, *compiled_in) = twice(seed, make)
    fn(*eager_in, fmt)
    torch._dynamo.reset()
    torch.compile(fn, backend="aot_eager", fullgraph=True)(*compiled_in, fmt)
    (_, out_k, _, out_v), (_, want_k, _, want_v) = compiled_in, eager_in
    for got, want in zip((*out_k, *out_v), (*want_k, *want_v), strict=True):
        if want is not None:
            assert_same(got._base, want._base, seed, "buffer around an out view")
    assert (out_k[1] != 0).all() and (out_v[1] != 0).all(), f"scales not written (seed {seed})"


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_export_keeps_the_op(seed, strict):
    # Non-strict export runs the Python code on fake tensors (no dynamo): the routing still applies.
    # The paged store: its op is kept on every device (dense and paged attention keep theirs on CUDA only).
    class Store(torch.nn.Module):
        def forward(self, k_pool, v_pool, keys, values, slots):
            paged_store(k_pool, v_pool, keys, values, slots, check=False)
            return k_pool * 1, v_pool * 1

    exported_in, eager_in = twice(seed, lambda: store_case(*STORE[next(iter(STORE))]))
    program = torch.export.export(Store(), exported_in, strict=strict)
    calls = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert KV.paged_store.default in calls, calls
    got, want = program.module()(*exported_in), Store()(*eager_in)
    assert_same(got, want, seed, "exported")


# ---------------------------------------------------------------------------------------------------
# 3. start and length as SymInts
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["paged", "quantized"])
def test_dynamic_start_and_length_share_a_graph(seed, kind):
    # Two decode steps: the attended range moves and grows by one token.
    steps = [(3, 30), (4, 31)]
    if kind == "paged":
        (q, k_pool, v_pool, table), kw = paged_case(F32, 2, 2, 2, 32, 32, 8, 3, 40, None)
        op = KV.paged_decode_attention.default

        def fn(q, start, length):
            return paged_decode_attention(
                q, k_pool, v_pool, table, start=start, length=length, scale=kw["scale"], check=False
            )
    else:
        (q, packed, fmt), kw = quant_case(4, 16, F32, 2, 1, 2, 32, 32, 16, 3, 40, None, None, True)
        op = KV.quantized_decode_attention.default

        def fn(q, start, length):
            return quantized_decode_attention(
                q, packed, fmt, start=start, length=length, scale=kw["scale"], block_table=kw["block_table"],
                check=False,
            )  # fmt: skip

    fn(q, *steps[0])  # an eager call first, as a cache's prompt makes: the CPU operators are built outside the graph
    compiled, recorder = compile_recorded(fn, dynamic=True)
    for start, length in steps:
        assert_same(compiled(q, start, length), fn(q, start, length), seed, f"{kind} start={start}")
    assert len(recorder.graphs) == 1, f"{len(recorder.graphs)} graphs for {len(steps)} steps"
    if not q.is_cuda:
        return  # traced inline there: the one graph is what shows start and length stayed symbolic
    (node,) = [n for n in recorder.graphs[0].graph.nodes if n.target is op]
    start_arg, length_arg = node.args[4:6] if kind == "paged" else node.args[9:11]
    assert isinstance(start_arg, torch.fx.Node) and isinstance(length_arg, torch.fx.Node), node.args


# ---------------------------------------------------------------------------------------------------
# 4. Eager calls stay off the custom-op dispatch
# ---------------------------------------------------------------------------------------------------


class OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_eager_calls_dispatch_no_kvplus_op(seed):
    (q, k, v), dense_kw = dense_case(F32, 2, 2, 2, 24, 32, 32, (0, 3))
    paged_args, paged_kw = paged_case(F32, 2, 2, 2, 32, 32, 8, 3, 30, None)
    quant_args, quant_kw = quant_case(4, 16, F32, 2, 1, 2, 32, 32, 32, 5, 20, 3, None, False)
    x, fmt, out = pack_case("keys", 4, 16, F32, 1, 2, 32, 32, True)
    calls = [
        lambda: decode_attention(q, k, v, **dense_kw, check=False),
        lambda: decode_attention_with_mass(q, k, v, **dense_kw, check=False),
        lambda: paged_decode_attention(*paged_args, **paged_kw, check=False),
        lambda: paged_store(*store_case(F32, 2, 2, 5, 32, 32, 8), check=False),
        lambda: quantized_decode_attention(*quant_args, **quant_kw, check=False),
        lambda: quantize_keys(x, fmt, out, check=False),
        lambda: quantize_values(x, fmt, check=False),
    ]
    for i, call in enumerate(calls):
        with OpRecorder() as rec:
            call()
        assert rec.ops, f"call {i}: the recorder saw no op at all"
        kvplus = [f for f in rec.ops if f.namespace == "kvplus"]
        assert not kvplus, f"call {i} dispatched {kvplus} in eager mode"
    with OpRecorder() as rec:  # the recorder does see a kvplus op when one is dispatched
        ops.decode_attention(q, k, v, dense_kw["scale"], dense_kw["mask"], None)
    assert KV.decode_attention.default in rec.ops


# ---------------------------------------------------------------------------------------------------
# 5. The CUDA implementations call the Triton paths with the right arguments
# ---------------------------------------------------------------------------------------------------


def test_cuda_implementations_match_the_triton_paths(seed):
    (q, k, v), kw = dense_case(F16, 2, 2, 3, 40, 32, 32, (0, 40))
    got = ops.decode_attention_cuda(*dense_op_args((q, k, v), kw))
    want = decode_attention_triton(q, k, v, **kw, num_splits=2, check=False)
    assert_same(got, want, seed, "decode_attention")
    got = ops.decode_attention_with_mass_cuda(*dense_op_args((q, k, v), kw))
    want = decode_attention_with_mass_triton(q, k, v, **kw, num_splits=2, check=False)
    assert_same(got, want, seed, "decode_attention_with_mass")

    args, kw = paged_case(F32, 2, 2, 2, 32, 32, 8, 3, 30, (0, 5))
    got = ops.paged_decode_attention_cuda(*paged_op_args(args, kw))
    assert_same(got, paged_decode_attention_triton(*args, **kw, num_splits=2, check=False), seed, "paged")

    for case in ("int4-paged-residual-mask", "fp8-dense-mask"):
        args, kw = quant_case(*QUANT[case])
        got = ops.quantized_decode_attention_cuda(*quant_op_args(args, kw))
        want = quantized_decode_attention_triton(*args, **kw, num_splits=2, check=False)
        assert_same(got, want, seed, f"quantized {case}")
        got = ops.quantized_decode_attention_with_mass_cuda(*quant_op_args(args, kw))
        want = quantized_decode_attention_with_mass_triton(*args, **kw, num_splits=2, check=False)
        assert_same(got, want, seed, f"quantized with mass {case}")

    (k_pool, v_pool, keys, values, slots), (k2, v2, *_) = twice(
        seed, lambda: store_case(*STORE["f32-prefill"])
    )
    untouched = k_pool.clone()
    ops.paged_store_cuda(k_pool, v_pool, keys, values, slots)
    paged_store_triton(k2, v2, keys, values, slots, check=False)
    assert_same((k_pool, v_pool), (k2, v2), seed, "paged_store")
    assert not torch.equal(k_pool, untouched), f"the store wrote nothing (seed {seed})"

    for cuda_fn, triton_fn, kind in (
        (ops.quantize_keys_cuda, quantize_keys_triton, "keys"),
        (ops.quantize_values_cuda, quantize_values_triton, "values"),
    ):
        for case in PACK.values():
            (x, bits, group, *out), (_, _, _, *out2) = twice(seed, lambda c=case, k=kind: pack_op_args(k, c))
            cuda_fn(x, bits, group, *out)
            triton_fn(x, QuantFormat(*case[:2]), tuple(out2), check=False)
            assert_same(*(tuple(t for t in o if t is not None) for o in (out, out2)), seed, kind)
            assert (out[1] != 0).all(), f"{kind}: scales not written (seed {seed})"


@pytest.mark.parametrize("case", PACK)
def test_compiled_quantize_values_at(seed, case):
    """An evicting cache's refill: quantized into slot buffers in place, the same bits compiled as eager."""
    fmt = QuantFormat(*PACK[case][:2])

    def fn(x, codes, scale, zero, slots):
        quantize_values_at(x, fmt, (codes, scale, zero), slots, check=False)

    def make():
        x, _, out, slots = at_case(*PACK[case])
        return (x, *out, slots)

    if make()[0].is_cuda:
        check_compiled(seed, fn, make, KV.quantize_values_at.default)
    else:
        check_inlined(seed, fn, make)


def test_cuda_implementation_of_quantize_values_at_matches_the_triton_path(seed):
    (x, bits, group, *out, slots), (_, _, _, *out2, _) = twice(seed, lambda: at_op_args(PACK["int4"]))
    ops.quantize_values_at_cuda(x, bits, group, *out, slots)
    quantize_values_at_triton(x, QuantFormat(4, 16), tuple(out2), slots, check=False)
    assert_same(tuple(t for t in out if t is not None), tuple(t for t in out2 if t is not None), seed, "at")
    assert (out[1].gather(2, slots[..., None].expand(*slots.shape, out[1].shape[-1])) != 0).all()
