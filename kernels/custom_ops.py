"""The kernel entry points as torch custom operators (``torch.ops.kvplus.*``), for compiled graphs.

Why: traced by ``torch.compile``, an entry point would be inlined op by op (the twin's gathers and
online softmax, with Python control flow on ``start``/``length`` that specializes the graph), or on
CUDA dynamo would have to trace the Triton launch code and its planning. As a custom operator each
kernel is one opaque node, with a fake implementation that gives its output shapes without reading
data: CUDA tensors run the Triton kernel, all others the torch twin, the functions eager calls, always
with ``check=False`` (inside a graph nothing is validated and no tensor value is read on the host).
The entry points (``kernels/dispatch.py``) route here only while tracing (``torch.compiler.is_compiling()``) and
with ``check=False``; eager calls never pay the custom-op dispatch (tens of microseconds per call). Every
entry point but the paged store routes here with CUDA tensors only: elsewhere its twin is traced inline
(SDPA, the with-mass softmax, a gather of blocks, chunked dequantization, quantize-and-pack), which a
compiled graph fuses with the ops around it, at the price of specializing on the twins' chunking (on CPU
a static int4 QuantizedCache went from 4.88x to 1.36x of StaticCache's compiled decode at 1K; the
figures: BENCHMARKS.md, compiled decode, stops 25 and 26).

Schemas hold tensors and scalars only: a ``PackedKV`` is passed as its six tensors (the zeros as
``Tensor?``, None for fp8), a ``QuantFormat`` as ``str bits`` ("8", "4", "2" or "fp8") and
``int group_size``, a ``RotatedFormat`` as ``int key_bits``, ``int value_bits`` and ``int seed`` (its
PackedKV as four tensors: codes and norms, no zeros) and its centre as a ``Tensor?`` (the attention ops: the
keys' centre in the rotated space, ``KeyCenter.rotated``; ``quantize_rotated``: the coded keys',
``KeyCenter.mu``, and ``bool inputs_rotated``: the vectors come rotated). Ints are ``SymInt`` (``start`` and
``length`` change every decode step). The quantize ops write into given ``codes``, ``scale``, ``zero``
(rotated: ``codes``, ``norms``; declared mutated) and return nothing.

The rotated attention ops run ``rotated_attention``'s kernel in the rotated space: q and the residual
come rotated and the output stays rotated (the rotations are plain matmuls the graph keeps around the
op); their twin is ``quantized_decode_attention_torch`` on those rotated inputs. ``quantize_rotated``
runs ``rotated_pack``'s kernel (twin: ``rotated_format.quantize_rotated``, copied or, with ``slots``,
scattered into the given tensors).
"""

import functools

import torch
from torch import Tensor

from hf_kvplus.kernels import decode_attention as dense
from hf_kvplus.kernels import paged_attention as paged
from hf_kvplus.kernels import quant_attention as quant
from hf_kvplus.kernels import quant_format, rotated_attention, rotated_pack
from hf_kvplus.kernels import quant_pack as pack
from hf_kvplus.kernels.errors import ConfigError
from hf_kvplus.kernels.quant_format import BIT_WIDTHS, PackedKV, QuantFormat
from hf_kvplus.kernels.rotated_format import KeyCenter, RotatedFormat
from hf_kvplus.kernels.rotated_format import quantize_rotated as quantize_rotated_twin


def format_args(fmt: QuantFormat) -> tuple[str, int]:
    """``fmt`` as the ops' ``bits`` and ``group_size``. Traced: dynamo may have made the bit width a
    symbolic int, of which it cannot trace ``str()``; comparing it to each width specializes it."""
    return next(str(bits) for bits in BIT_WIDTHS if fmt.bits == bits), fmt.group_size


@functools.cache
def _format(bits: str, group_size: int) -> QuantFormat:
    """The inverse of :func:`format_args` (run time: plain ints)."""
    return QuantFormat("fp8" if bits == "fp8" else int(bits), group_size)


def _attention_out(q: Tensor, dv) -> Tensor:
    """The attention output of every kernel: [B, Hq, Dv] in q's dtype, contiguous."""
    return q.new_empty((q.shape[0], q.shape[1], dv))


# ---------------------------------------------------------------------------------------------------
# Dense decode attention
# ---------------------------------------------------------------------------------------------------


@torch.library.custom_op("kvplus::decode_attention", mutates_args=())
def decode_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None, num_splits: int | None
) -> Tensor:
    return dense.decode_attention_torch(q, k, v, scale=scale, mask=mask, check=False)


@decode_attention.register_kernel("cuda")
def decode_attention_cuda(q, k, v, scale, mask, num_splits):
    return dense.decode_attention_triton(q, k, v, scale=scale, mask=mask, num_splits=num_splits, check=False)


@decode_attention.register_fake
def _(q, k, v, scale, mask, num_splits):
    return _attention_out(q, v.shape[-1])


@torch.library.custom_op("kvplus::decode_attention_with_mass", mutates_args=())
def decode_attention_with_mass(
    q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None, num_splits: int | None
) -> tuple[Tensor, Tensor]:
    return dense.decode_attention_with_mass_torch(q, k, v, scale=scale, mask=mask, check=False)


@decode_attention_with_mass.register_kernel("cuda")
def decode_attention_with_mass_cuda(q, k, v, scale, mask, num_splits):
    return dense.decode_attention_with_mass_triton(
        q, k, v, scale=scale, mask=mask, num_splits=num_splits, check=False
    )


@decode_attention_with_mass.register_fake
def _(q, k, v, scale, mask, num_splits):
    mass = q.new_empty((k.shape[0], k.shape[1], k.shape[2]), dtype=torch.float32)
    return _attention_out(q, v.shape[-1]), mass


# ---------------------------------------------------------------------------------------------------
# Paged decode attention and store
# ---------------------------------------------------------------------------------------------------


@torch.library.custom_op("kvplus::paged_decode_attention", mutates_args=())
def paged_decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    start: int,
    length: int,
    scale: float,
    mask: Tensor | None,
    num_splits: int | None,
) -> Tensor:
    return paged.paged_decode_attention_torch(
        q, k_pool, v_pool, block_table, start=start, length=length, scale=scale, mask=mask, check=False
    )


@paged_decode_attention.register_kernel("cuda")
def paged_decode_attention_cuda(q, k_pool, v_pool, block_table, start, length, scale, mask, num_splits):
    return paged.paged_decode_attention_triton(
        q, k_pool, v_pool, block_table, start=start, length=length, scale=scale, mask=mask,
        num_splits=num_splits, check=False,
    )  # fmt: skip


@paged_decode_attention.register_fake
def _(q, k_pool, v_pool, block_table, start, length, scale, mask, num_splits):
    return _attention_out(q, v_pool.shape[-1])


@torch.library.custom_op("kvplus::paged_store", mutates_args=("k_pool", "v_pool"))
def paged_store(k_pool: Tensor, v_pool: Tensor, keys: Tensor, values: Tensor, slot_mapping: Tensor) -> None:
    paged.paged_store_torch(k_pool, v_pool, keys, values, slot_mapping, check=False)


@paged_store.register_kernel("cuda")
def paged_store_cuda(k_pool, v_pool, keys, values, slot_mapping):
    paged.paged_store_triton(k_pool, v_pool, keys, values, slot_mapping, check=False)


@paged_store.register_fake
def _(k_pool, v_pool, keys, values, slot_mapping):
    return None


# ---------------------------------------------------------------------------------------------------
# Quantized decode attention
# ---------------------------------------------------------------------------------------------------


#: The quantized attention ops' arguments: a `PackedKV`'s six tensors, a `QuantFormat` as (bits, group_size), then
#: the entry point's keywords (written once for the two ops: each is defined from this schema).
_QUANTIZED_ARGS = (
    "Tensor q, Tensor k, Tensor k_scale, Tensor? k_zero, Tensor v, Tensor v_scale, Tensor? v_zero, str bits, "
    "SymInt group_size, SymInt start, SymInt length, float scale, Tensor? residual_k, Tensor? residual_v, "
    "Tensor? mask, Tensor? block_table, SymInt? num_splits, bool keys_per_token"
)


def _quantized_call(q, k, k_scale, k_zero, v, v_scale, v_zero, bits, group_size, start, length, scale, residual_k,
                    residual_v, mask, block_table, num_splits, keys_per_token):  # fmt: skip
    """(q, PackedKV, QuantFormat, keywords of the twins and, with `num_splits`, of the Triton kernels)."""
    kw = dict(
        start=start, length=length, scale=scale, residual_k=residual_k, residual_v=residual_v, mask=mask,
        block_table=block_table, keys_per_token=keys_per_token, check=False,
    )  # fmt: skip
    return q, PackedKV(k, k_scale, k_zero, v, v_scale, v_zero), _format(bits, group_size), kw, num_splits


def _quantized_op(name: str, twin, triton, with_mass: bool):
    """A quantized attention op of `_QUANTIZED_ARGS` (the twin on every device, Triton on CUDA, a fake of the shapes)
    and its CUDA implementation."""

    def run(*args):
        q, packed, fmt, kw, _ = _quantized_call(*args)
        return twin(q, packed, fmt, **kw)

    op = torch.library.custom_op(f"kvplus::{name}", run, mutates_args=(),
                                 schema=f"({_QUANTIZED_ARGS}) -> {'(Tensor, Tensor)' if with_mass else 'Tensor'}")  # fmt: skip

    @op.register_kernel("cuda")
    def cuda(*args):
        q, packed, fmt, kw, num_splits = _quantized_call(*args)
        return triton(q, packed, fmt, num_splits=num_splits, **kw)

    @op.register_fake
    def _(q, k, k_scale, k_zero, v, v_scale, v_zero, bits, group_size, start, length, scale, residual_k, *rest):
        # Codes per byte depend on the bit width alone (the group size may be symbolic here: no format is made).
        out = _attention_out(q, v.shape[-1] * _format(bits, 1).per_byte)
        return (out, _mass_out(q, k, length, residual_k)) if with_mass else out

    return op, cuda


def _mass_out(q: Tensor, k: Tensor, length, residual_k: Tensor | None) -> Tensor:
    """The attention mass of every quantized kernel: float32 [B, Hkv, length + R]."""
    keys = length + (0 if residual_k is None else residual_k.shape[2])
    return q.new_empty((q.shape[0], k.shape[1], keys), dtype=torch.float32)


quantized_decode_attention, quantized_decode_attention_cuda = _quantized_op(
    "quantized_decode_attention", quant.quantized_decode_attention_torch, quant.quantized_decode_attention_triton, False
)
quantized_decode_attention_with_mass, quantized_decode_attention_with_mass_cuda = _quantized_op(
    "quantized_decode_attention_with_mass", quant.quantized_decode_attention_with_mass_torch,
    quant.quantized_decode_attention_with_mass_triton, True,
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Quantize and pack (into given tensors)
# ---------------------------------------------------------------------------------------------------


def _quantize_twin(twin, x, bits, group_size, codes, scale, zero) -> None:
    """The eager dispatcher's CPU path with ``out``: the twin's results copied into the given tensors."""
    result = twin(x, _format(bits, group_size))
    for dst, src in zip((codes, scale, zero), result, strict=True):
        if dst is not None:
            dst.copy_(src)


@torch.library.custom_op("kvplus::quantize_keys", mutates_args=("codes", "scale", "zero"))
def quantize_keys(
    x: Tensor, bits: str, group_size: int, codes: Tensor, scale: Tensor, zero: Tensor | None
) -> None:
    _quantize_twin(quant_format.quantize_keys, x, bits, group_size, codes, scale, zero)


@quantize_keys.register_kernel("cuda")
def quantize_keys_cuda(x, bits, group_size, codes, scale, zero):
    pack.quantize_keys_triton(x, _format(bits, group_size), (codes, scale, zero), check=False)


@quantize_keys.register_fake
def _(x, bits, group_size, codes, scale, zero):
    return None


@torch.library.custom_op("kvplus::quantize_values", mutates_args=("codes", "scale", "zero"))
def quantize_values(
    x: Tensor, bits: str, group_size: int, codes: Tensor, scale: Tensor, zero: Tensor | None
) -> None:
    _quantize_twin(quant_format.quantize_values, x, bits, group_size, codes, scale, zero)


@quantize_values.register_kernel("cuda")
def quantize_values_cuda(x, bits, group_size, codes, scale, zero):
    pack.quantize_values_triton(x, _format(bits, group_size), (codes, scale, zero), check=False)


@quantize_values.register_fake
def _(x, bits, group_size, codes, scale, zero):
    return None


@torch.library.custom_op("kvplus::quantize_values_at", mutates_args=("codes", "scale", "zero"))
def quantize_values_at(
    x: Tensor, bits: str, group_size: int, codes: Tensor, scale: Tensor, zero: Tensor | None, slots: Tensor
) -> None:
    pack.quantize_values_at_torch(x, _format(bits, group_size), (codes, scale, zero), slots)


@quantize_values_at.register_kernel("cuda")
def quantize_values_at_cuda(x, bits, group_size, codes, scale, zero, slots):
    pack.quantize_values_at_triton(x, _format(bits, group_size), (codes, scale, zero), slots, check=False)


@quantize_values_at.register_fake
def _(x, bits, group_size, codes, scale, zero, slots):
    return None


# ---------------------------------------------------------------------------------------------------
# Rotated formats: decode attention in the rotated space, quantize-and-pack
# ---------------------------------------------------------------------------------------------------


#: The rotated attention ops' arguments: codes and norms of both sides, a `RotatedFormat` as (key_bits, value_bits,
#: seed), the entry point's keywords, the keys' centre in the rotated space (``KeyCenter.rotated``) and a turning
#: centre's query weights and basis (CUDA only).
_ROTATED_ARGS = (
    "Tensor q, Tensor k, Tensor k_norm, Tensor v, Tensor v_norm, SymInt key_bits, SymInt value_bits, SymInt seed, "
    "SymInt start, SymInt length, float scale, Tensor? residual_k, Tensor? residual_v, Tensor? mask, "
    "Tensor? block_table, SymInt? num_splits, Tensor? key_center, Tensor? key_turn_q=None, Tensor? key_turn_basis=None"
)


def _rotated_call(q, k, k_norm, v, v_norm, key_bits, value_bits, seed, start, length, scale, residual_k, residual_v,
                  mask, block_table, num_splits, key_center, key_turn_q=None, key_turn_basis=None):  # fmt: skip
    """(q, PackedKV, RotatedFormat, keywords (the layer's state, a `KeyCenter` of the given centre, among them),
    num_splits, the Triton kernel's ``turn`` or None)."""
    kw = dict(
        start=start, length=length, scale=scale, residual_k=residual_k, residual_v=residual_v, mask=mask,
        block_table=block_table, check=False,
    )  # fmt: skip
    state = KeyCenter.given(key_center, seed, rotated=True)
    turn = None if key_turn_q is None else (key_turn_q, key_turn_basis)
    packed, fmt = PackedKV(k, k_norm, None, v, v_norm, None), RotatedFormat(key_bits, value_bits, seed)
    return q, packed, fmt, kw | {"state": state}, num_splits, turn


def _rotated_op(name: str, twin, with_mass: bool):
    """A rotated attention op of `_ROTATED_ARGS`, in the rotated space (the twin off CUDA, where no turning centre goes:
    the dispatcher runs the C++ operator or the twin; `rotated_attention`'s kernel on CUDA; a fake of the shapes), and
    its CUDA implementation."""

    def run(*args):
        q, packed, fmt, kw, _, turn = _rotated_call(*args)
        if turn is not None:
            raise ConfigError("the rotated attention operators read a turning key centre on CUDA only (Triton); off "
                              "CUDA the dispatcher runs the C++ operator or the twin")  # fmt: skip
        return twin(q, packed, fmt, **kw)

    op = torch.library.custom_op(f"kvplus::{name}", run, mutates_args=(),
                                 schema=f"({_ROTATED_ARGS}) -> {'(Tensor, Tensor)' if with_mass else 'Tensor'}")  # fmt: skip

    @op.register_kernel("cuda")
    def cuda(*args):
        q, packed, fmt, kw, num_splits, turn = _rotated_call(*args)
        kw["key_center"] = kw.pop("state")
        result = rotated_attention.rotated_decode_attention_triton(
            q, packed, fmt, num_splits=num_splits, with_mass=with_mass, turn=turn, **kw
        )
        return result if with_mass else result[0]

    @op.register_fake
    def _(q, k, k_norm, v, v_norm, key_bits, value_bits, seed, start, length, scale, residual_k, *rest):
        out = _attention_out(q, v.shape[-1] * 8 // value_bits)  # (no format made: its tables are real tensors)
        return (out, _mass_out(q, k, length, residual_k)) if with_mass else out

    return op, cuda


rotated_decode_attention, rotated_decode_attention_cuda = _rotated_op(
    "rotated_decode_attention", quant.quantized_decode_attention_torch, False
)
rotated_decode_attention_with_mass, rotated_decode_attention_with_mass_cuda = _rotated_op(
    "rotated_decode_attention_with_mass", quant.quantized_decode_attention_with_mass_torch, True
)


@torch.library.custom_op("kvplus::quantize_rotated", mutates_args=("codes", "norms"))
def quantize_rotated(
    x: Tensor,
    key_bits: int,
    value_bits: int,
    seed: int,
    side: str,
    codes: Tensor,
    norms: Tensor,
    slots: Tensor | None,
    center: Tensor | None,
    inputs_rotated: bool = False,
) -> None:
    fmt = RotatedFormat(key_bits, value_bits, seed, inputs_rotated=inputs_rotated)
    coded = quantize_rotated_twin(x, fmt, side, None, KeyCenter.given(center, seed))
    for dst, src in zip((codes, norms), coded, strict=True):
        if slots is None:
            dst.copy_(src)
        else:
            dst.scatter_(2, slots[..., None].expand(*src.shape), src)


@quantize_rotated.register_kernel("cuda")
def quantize_rotated_cuda(x, key_bits, value_bits, seed, side, codes, norms, slots, center, inputs_rotated=False):
    fmt = RotatedFormat(key_bits, value_bits, seed, inputs_rotated=inputs_rotated)
    rotated_pack.quantize_rotated_triton(x, fmt, side, (codes, norms, None), slots, check=False,
                                         center=KeyCenter.given(center, seed))  # fmt: skip


@quantize_rotated.register_fake
def _(x, key_bits, value_bits, seed, side, codes, norms, slots, center, inputs_rotated=False):
    return None
