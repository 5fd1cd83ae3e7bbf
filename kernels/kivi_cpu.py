"""Decode attention on the CPU over KIVI codes (``torch.ops.hf_kvplus_cpu.kivi_decode``), over a paged pool's
float blocks (``torch.ops.hf_kvplus_cpu.paged_decode``) and over float K/V with each key's attention mass
(``torch.ops.hf_kvplus_cpu.dense_decode``), read in place; a decode step's token written into a paged pool
(``torch.ops.hf_kvplus_cpu.write_token``); and KIVI's quantize-and-pack
(``torch.ops.hf_kvplus_cpu.kivi_encode``, and ``kivi_encode_into``, which codes a decode step's token straight into
an evicting cache's slots with the range guard folded in; ``kivi_encode_kv_into``, its key and value in one call).

Why: the plain-torch twins dequantize every code (or gather every block) of the cache into float32 tensors at each
step, then multiply: on a CPU that copy costs more than the attention, and more the longer the context, where the
codes were meant to make a step read fewer bytes than DynamicCache's. The operators (``kivi_attention_cpu.cpp``) turn
one token's codes into a row of floats in a small buffer that every query of its KV head reads at once (a key's
score over per-channel groups is ``(q * scale) . codes + q . zero``, the first made once per group), read a block
table in place, take the full-precision ring and the mask, and split long contexts over the threads. One call per
layer and step, which a compiled graph calls as one external kernel. The encode operator (``kivi_pack_cpu.cpp``)
codes a group in one pass, bit for bit as ``quant_format``'s twins, where the twin runs about fifteen tensor
operations per call: an evicting cache codes its new token at every step and layer.

They are built with the rotated formats' operators, as one library (``rotated_cpu``: on first use, optional; where
it cannot be built, or with ``HF_KVPLUS_CPU_KERNELS=0``, the twins run).
"""

from __future__ import annotations

import torch

from hf_kvplus.kernels import rotated_cpu
from hf_kvplus.kernels.errors import ShapeError

__all__ = [
    "FLOATS", "dense_decode_cpu", "encodes", "kivi_decode_cpu", "kivi_encode_cpu", "kivi_encode_into_cpu",
    "kivi_encode_kv_into_cpu", "paged_decode_cpu", "supports", "write_token_cpu",
]  # fmt: skip

#: What the encode and dense decode operators take (the twins refuse other dtypes with typed errors, or take them).
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def supports(q) -> bool:
    """Whether a call with query `q` can take an operator here: a CPU tensor, and the operators built."""
    return isinstance(q, torch.Tensor) and q.is_cpu and rotated_cpu.available()


def encodes(x) -> bool:
    """Whether `x` can be coded by the encode operator: floats [B, H, T, D] on the CPU, and the operator built."""
    return (isinstance(x, torch.Tensor) and x.is_cpu and x.dim() == 4 and x.dtype in FLOATS
            and rotated_cpu.available())  # fmt: skip


def kivi_encode_cpu(x: torch.Tensor, fmt, side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scale, zero or None) of x [B, H, T, D], as ``quant_format.quantize_keys`` (`side` "keys") or
    ``quantize_values`` make them, with their errors for a head dim or a token count the format cannot take."""
    D, keys = x.shape[-1], side == "keys"
    fmt.check_head_dim(D)
    if keys and x.shape[-2] % fmt.group_size:
        raise ShapeError(f"keys hold {x.shape[-2]} tokens, not a multiple of the group size {fmt.group_size}")
    codes, scale, zero = torch.ops.hf_kvplus_cpu.kivi_encode(x.float(), 0 if fmt.is_float else fmt.bits,
                                                             fmt.group_size, keys)  # fmt: skip
    return codes, scale, None if fmt.is_float else zero


#: The `bad` counter of an unguarded `kivi_encode_into_cpu` call (the operator leaves it untouched).
_UNCOUNTED = torch.zeros((), dtype=torch.long)
#: fp8's `zero` (none: the operator leaves it untouched).
_NO_ZERO = torch.empty(0, dtype=torch.float16)


def kivi_encode_into_cpu(x: torch.Tensor, fmt, out, start: int = 0, slots: torch.Tensor | None = None,
                         limit: float | None = None, bad: torch.Tensor | None = None) -> None:  # fmt: skip
    """Values' coding (per token) of x [B, H, T, D] written into `out` = (codes, scale, zero or None) [B, H, N, ...]
    at rows `slots` [B, H, T] int64 (None: rows `start` .. `start` + T - 1), bit for bit what
    ``quantize_values(x, fmt)`` makes. With `limit`, what `RangeGuard` would zero (magnitudes above it, NaN) is coded
    as 0 and counted into `bad` (0-d int64): the guard, the coding and the copies of an evicting cache's decode step
    in one call. The caller keeps the contract (a quantize call with ``check=False``)."""
    codes, scale, zero = out
    torch.ops.hf_kvplus_cpu.kivi_encode_into(
        x, 0 if fmt.is_float else fmt.bits, fmt.group_size, -1.0 if limit is None else float(limit), codes,
        scale, _NO_ZERO if zero is None else zero, start, slots, _UNCOUNTED if bad is None else bad,
    )  # fmt: skip


def kivi_encode_kv_into_cpu(k: torch.Tensor, v: torch.Tensor, fmt, out_k, out_v, start: int = 0,
                            slots: torch.Tensor | None = None, limit: float | None = None,
                            bad: torch.Tensor | None = None) -> None:  # fmt: skip
    """`kivi_encode_into_cpu` of a token's keys `k` into `out_k` and values `v` into `out_v` (one format, the same rows)
    in one operator call: at a decode step an operator call costs more than its compute."""
    (kc, ks, kz), (vc, vs, vz) = out_k, out_v
    torch.ops.hf_kvplus_cpu.kivi_encode_kv_into(
        k, v, 0 if fmt.is_float else fmt.bits, fmt.group_size,
        -1.0 if limit is None else float(limit), kc, ks, _NO_ZERO if kz is None else kz, vc, vs,
        _NO_ZERO if vz is None else vz, start, slots, _UNCOUNTED if bad is None else bad,
    )  # fmt: skip


def kivi_decode_cpu(
    q: torch.Tensor, packed, fmt, start: int, length: int, scale: float, residual_k, residual_v, mask, block_table,
    keys_per_token: bool, with_mass: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(output [B, Hq, Dv] float32, mass [B, Hkv, length + R] or None), as `quant_attention`'s twin computes them
    from the same arguments. The inputs go to the operator as they are: it makes q and the ring float32, and what is
    not unit-stride in its last dim contiguous, itself (a decode step's are already: no Python call per input)."""
    p = packed
    out, mass = torch.ops.hf_kvplus_cpu.kivi_decode(
        q, p.k, p.k_scale, p.k_zero, p.v, p.v_scale, p.v_zero, 0 if fmt.is_float else fmt.bits, fmt.group_size,
        keys_per_token, start, length, block_table, residual_k, residual_v, mask, float(scale), with_mass,
    )  # fmt: skip
    return out, (mass if with_mass else None)


def paged_decode_cpu(q, k_pool, v_pool, block_table, start: int, length: int, scale: float, mask) -> torch.Tensor:
    """Output [B, Hq, Dv] float32 of `paged_attention`'s decode over the pools' blocks through `block_table`."""
    if block_table.dtype != torch.int32:
        block_table = block_table.int()
    return torch.ops.hf_kvplus_cpu.paged_decode(
        rotated_cpu.float32(q).contiguous(), rotated_cpu.rows(k_pool), rotated_cpu.rows(v_pool), block_table, start,
        length, mask, float(scale),
    )


def write_token_cpu(k_buf, v_buf, keys, values, offset: int, block_table, column: int) -> None:
    """A decode step's keys and values [B, Hkv, 1, D] (the pools' dtypes) written at `offset` of the blocks that
    column `column` of the int32 `block_table` names in pools [blocks, Hkv, T, D] (``token_write_cpu.cpp``): one call
    for both sides. Every tensor with unit stride in its last dim."""
    torch.ops.hf_kvplus_cpu.write_token(k_buf, v_buf, keys, values, block_table, column, offset)


def dense_decode_cpu(q, k, v, scale: float, mask, with_mass: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output [B, Hq, Dv] float32, mass [B, Hkv, N] float32 or None) of `decode_attention`'s decode over float K/V
    [B, Hkv, N, D] read in place (views of a layer's slots: the twin with the mass copies them to float32 first)."""
    out, mass = torch.ops.hf_kvplus_cpu.dense_decode(
        rotated_cpu.float32(q).contiguous(), rotated_cpu.rows(k), rotated_cpu.rows(v), mask, float(scale), with_mass
    )
    return out, (mass if with_mass else None)


def register_fakes() -> None:
    """The operators' shapes for tracing (``torch.compile``), registered when the library is loaded."""
    torch.library.register_fake("hf_kvplus_cpu::kivi_decode")(_fake_kivi)
    torch.library.register_fake("hf_kvplus_cpu::paged_decode")(_fake_paged)
    torch.library.register_fake("hf_kvplus_cpu::kivi_encode")(_fake_encode)
    torch.library.register_fake("hf_kvplus_cpu::kivi_encode_into")(_fake_encode_into)
    torch.library.register_fake("hf_kvplus_cpu::kivi_encode_kv_into")(_fake_encode_kv_into)
    torch.library.register_fake("hf_kvplus_cpu::dense_decode")(_fake_dense)
    torch.library.register_fake("hf_kvplus_cpu::write_token")(_fake_write_token)


rotated_cpu.when_loaded(register_fakes)


def _fake_kivi(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits, group, keys_per_token, start, length,
               block_table, ring_k, ring_v, mask, scale, with_mass):  # fmt: skip
    B, Hq, _ = q.shape
    Hkv = k_codes.shape[1]
    Dv = v_codes.shape[-1] * (1 if bits == 0 else 8 // bits)
    L = length + (0 if ring_k is None else ring_k.shape[2])
    f32 = torch.float32  # (whatever q's dtype: the operator computes and returns float32)
    return q.new_empty(B, Hq, Dv, dtype=f32), q.new_empty(B if with_mass else 0, Hkv, L, dtype=f32)


def _fake_paged(q, k_pool, v_pool, block_table, start, length, mask, scale):
    B, Hq, _ = q.shape
    return q.new_empty(B, Hq, v_pool.shape[-1])


def _fake_encode(x, bits, group, per_channel):
    B, H, T, D = x.shape
    params = (B, H, T // group, D) if per_channel else (B, H, T, D // group)
    codes = x.new_empty(B, H, T, D if bits == 0 else D * bits // 8, dtype=torch.uint8)
    scale = x.new_empty(params, dtype=torch.float16)
    return codes, scale, x.new_empty((0,) if bits == 0 else params, dtype=torch.float16)


def _fake_encode_into(x, bits, group, limit, codes, scale, zero, start, slots, bad):
    return None


def _fake_encode_kv_into(k, v, bits, group, limit, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, start, slots,
                         bad):  # fmt: skip
    return None


def _fake_write_token(k_buf, v_buf, keys, values, block_table, column, offset):
    return None


def _fake_dense(q, k, v, mask, scale, with_mass):
    B, Hq, _ = q.shape
    return q.new_empty(B, Hq, v.shape[-1]), q.new_empty(B if with_mass else 0, k.shape[1], k.shape[2])
