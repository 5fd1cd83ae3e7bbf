"""What a step costs the host: ops that would stall a GPU's queue, Python calls made by cache code, and
the time spent inside kernels.

A decode step on a GPU is a queue of kernels the host fills; anything that reads a tensor's value back
(`.item()`, `bool(t)`, `int(t)`, `.tolist()`, `nonzero`, a data-dependent shape) makes the host wait
for the device. These are counted here by op, with a `TorchDispatchMode`, on any device (on a CPU the
same ops run, they merely cost nothing), so a test can assert there are none.

Off CUDA a kernel (attention, quantize) is its torch twin, whose compute (dequantizing codes, gathering
blocks) a CPU pays on the host; on CUDA it is one launch. `timing_kernels` measures that share of a
step, so a benchmark can report the host time of everything around the kernels separately.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
#: Ops whose result the host must read (or whose output shape depends on tensor values).
SYNC_OPS = {
    aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.nonzero.default,
    aten.equal.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
    aten.unique_consecutive.default, aten.unique_dim.default, aten.unique_dim_consecutive.default,
    aten.repeat_interleave.Tensor,
}  # fmt: skip
#: A tensor made from Python data (`torch.tensor(x, device=...)`): on a GPU, a copy from pageable host memory, which
#: waits; on a CPU the same op, so a CPU test sees it. `host_index.index_tensor`'s, queued without a wait, are not.
HOST_DATA_OPS = {aten.lift_fresh.default}
#: Ops that sync when indexed with a bool mask (its count of True decides the shape).
BOOL_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}

__all__ = [
    "SYNC_OPS", "KernelTime", "SyncCounter", "count_cache_calls", "count_syncs", "stubbing_kernels", "timing_kernels",
]  # fmt: skip


class SyncCounter(TorchDispatchMode):
    """Counts, by name, the ops run inside it that make the host wait for the device."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS:
            self.counts[func.overloadpacket.__name__] += 1
        elif func in HOST_DATA_OPS and not _queued(sys._getframe(1)):
            self.counts["tensor from host data"] += 1
        elif func in BOOL_INDEX_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in (args[1] if len(args) > 1 else [])
        ):
            self.counts["index with a bool mask"] += 1
        return func(*args, **kwargs)


def _queued(frame) -> bool:
    """Whether `frame` is inside `index_tensor`, which sends host data without a wait."""
    from ..host_index import index_tensor

    while frame is not None:
        if frame.f_code is index_tensor.__code__:
            return True
        frame = frame.f_back
    return False


def count_syncs(step: Callable[[], object]) -> Counter:
    """The ops of `step()` that read device values on the host, by name (`tolist` calls included)."""
    counter = SyncCounter()
    real_tolist = torch.Tensor.tolist
    inside = []

    def tolist(self):
        if inside:  # a torch function mode (a default device: `torch.device(...)` as a context) calls it again
            return real_tolist(self)
        counter.counts["tolist"] += 1
        inside.append(True)
        try:
            return real_tolist(self)
        finally:
            inside.pop()

    torch.Tensor.tolist = tolist
    try:
        with counter:
            step()
    finally:
        torch.Tensor.tolist = real_tolist
    return counter.counts


def _cache_code(filename: str) -> bool:
    return "hf_kvplus" in filename or "/kernels/" in filename or filename.endswith("cache_utils.py")


def count_cache_calls(step: Callable[[], object]) -> int:
    """Python function calls made by cache code (hf_kvplus, its kernels, Transformers' cache_utils.py)
    during `step()`, counted with `sys.setprofile`."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" and _cache_code(frame.f_code.co_filename):
            calls += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(previous)
    return calls


@dataclass
class KernelTime:
    """Wall time and calls spent inside kernels (or their torch twins) while timing."""

    seconds: float = 0.0
    calls: int = 0


def _kernel_sites() -> list[tuple[object, str]]:
    """(module, name) of every kernel entry point, where its callers look it up at call time: hf_kvplus's
    decode kernels, its SDPA fallback and the attention function other caches get, and the quantize kernels."""
    from ..attention import dispatch, route, slots
    from ..paging import quant_layer_pool
    from ..storage import packed_segment, static_quantized
    from ..storage import slot_codecs as slot_store

    quantizing = [(module, name) for module in (packed_segment, static_quantized, quant_layer_pool)
                  for name in ("quantize_keys", "quantize_values")]  # fmt: skip
    return [
        (route, "decode_attention"), (route, "paged_decode_attention"), (route, "quantized_decode_attention"),
        (route, "sdpa_attention_forward"), (slots, "decode_attention"), (slots, "quantized_decode_attention"),
        (dispatch, "_fallback"), (slot_store, "quantize_values"), (slot_store, "quantize_values_at"),
        (slot_store, "quantize_values_into"), (slot_store, "quantize_kv_into"), *quantizing,
    ]  # fmt: skip


@contextmanager
def _wrapping_kernels(wrapper) -> Iterator[None]:
    originals = [(module, name, getattr(module, name)) for module, name in _kernel_sites()]
    for module, name, kernel in originals:
        setattr(module, name, wrapper(name, kernel))
    try:
        yield
    finally:
        for module, name, kernel in originals:
            setattr(module, name, kernel)


class _Zeros(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def _stub_outputs() -> dict[str, Callable]:
    """Per kernel entry point's name, its outputs' shapes (and dtype) from its arguments: attention gives
    `[batch, q_heads, value_dim]` (with the mass `[batch, kv_heads, n]` float32), SDPA Transformers' layout, a
    quantize its codes, scales and zeros (or the buffers it was given to write)."""

    def decode(q, keys, values, *, with_mass=False, **kwargs):
        out = _Zeros((q.shape[0], q.shape[1], values.shape[-1]), q.dtype)
        return (out, _Zeros((keys.shape[0], keys.shape[1], keys.shape[2]), torch.float32)) if with_mass else out

    def paged(q, k_pool, v_pool, block_table, **kwargs):
        return _Zeros((q.shape[0], q.shape[1], v_pool.shape[-1]), q.dtype)

    def quantized(q, packed, fmt, *, length, residual_k=None, with_mass=False, **kwargs):
        out = _Zeros((q.shape[0], q.shape[1], fmt.channels(packed.v.shape[-1], "values")), q.dtype)
        keys = length + (0 if residual_k is None else residual_k.shape[2])
        return (out, _Zeros((q.shape[0], packed.k.shape[1], keys), torch.float32)) if with_mass else out

    def quantize(side):
        def rule(x, fmt, out=None, **kwargs):
            if out is not None:  # given buffers: the kernel returns them, written
                return out
            *lead, tokens, dim = x.shape
            scale = _Zeros((*lead, *fmt.param_shape(side, tokens, dim)), torch.float16)
            codes = _Zeros((*lead, tokens, fmt.code_dim(dim, side)), torch.uint8)
            return codes, scale, scale if fmt.has_zero else None

        return rule

    def sdpa(module, query, key, value, *args, **kwargs):
        return _Zeros((query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), query.dtype), None

    return {
        "decode_attention": decode, "paged_decode_attention": paged, "quantized_decode_attention": quantized,
        "sdpa_attention_forward": sdpa, "_fallback": sdpa,
        "quantize_keys": quantize("keys"), "quantize_values": quantize("values"),
        "quantize_values_at": lambda x, fmt, out, slots, **kwargs: out,  # writes the given buffers: returns them
        "quantize_values_into": lambda *args, **kwargs: None,  # writes the given buffers
        "quantize_kv_into": lambda *args, **kwargs: None,  # writes the given buffers
    }  # fmt: skip


@contextmanager
def stubbing_kernels() -> Iterator[KernelTime]:
    """Inside the block the kernels compute nothing, so a step's time is the host work around them: an attention
    call returns zeros of its output's shape (one tensor per shape, made once), a quantize call given `out=` leaves
    it as it is (one without returns zeros too). Off CUDA a twin's compute (dequantizing
    every code) also slows the host code after it (caches, allocator), which taking its time out
    (`timing_kernels`) leaves in; here no such compute runs. The time stubs take accrues to the `KernelTime` it
    yields. Outputs are zeros: for timing only (tokens, and an evicting cache's choices, are then arbitrary)."""
    spent = KernelTime()
    shapes = _stub_outputs()
    zeros: dict[tuple, torch.Tensor] = {}

    def made(spec, device):
        if isinstance(spec, torch.Tensor):
            return spec
        if not isinstance(spec, _Zeros):
            return None if spec is None else tuple(made(part, device) for part in spec)
        key = (*spec, device)
        if key not in zeros:
            zeros[key] = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        return zeros[key]

    def stub(name, kernel):
        rule = shapes[name]

        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                spec = rule(*args, **kwargs)
                device = next(a for a in args if isinstance(a, torch.Tensor)).device
                return made(spec, device)
            finally:
                spent.seconds += time.perf_counter() - start
                spent.calls += 1

        return call

    with _wrapping_kernels(stub):
        yield spent


@contextmanager
def timing_kernels() -> Iterator[KernelTime]:
    """Inside the block, the time spent in kernels (attention and quantize; outermost calls only) accrues to
    the `KernelTime` it yields. For benchmarks: it wraps the entry points while open."""
    spent = KernelTime()
    depth = 0

    def timed(kernel):
        def call(*args, **kwargs):
            nonlocal depth
            depth += 1
            start = time.perf_counter()
            try:
                return kernel(*args, **kwargs)
            finally:
                depth -= 1
                if depth == 0:
                    spent.seconds += time.perf_counter() - start
                    spent.calls += 1

        return call

    with _wrapping_kernels(lambda name, kernel: timed(kernel)):
        yield spent
