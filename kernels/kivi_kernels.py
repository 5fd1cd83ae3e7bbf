"""The KIVI formats' kernels (`quant_format.QuantFormat`): the C++ operators on the CPU (`kivi_cpu`), the Triton
kernels on CUDA (`quant_attention`, `quant_pack`), their custom operators while a graph is traced there
(`custom_ops`), the twins elsewhere."""

from __future__ import annotations

from hf_kvplus.kernels import custom_ops, kivi_cpu
from hf_kvplus.kernels.format_kernels import TWIN_ARGS, TWINS, FormatKernels, check_used_blocks, path_of
from hf_kvplus.kernels.kv_format import register_kernels
from hf_kvplus.kernels.quant_attention import (
    _check_inputs,
    quantized_decode_attention_triton,
    quantized_decode_attention_with_mass_triton,
)
from hf_kvplus.kernels.quant_format import QuantFormat
from hf_kvplus.kernels.quant_pack import (
    _new_out,
    quantize_keys_triton,
    quantize_values_at_triton,
    quantize_values_triton,
)

__all__ = ["KiviKernels"]


class KiviKernels(FormatKernels):
    """KIVI codes read in place by the C++ operator (CPU) or the Triton kernel (CUDA)."""

    def attend(self, q, packed, fmt, kw, with_mass):
        kw.pop("state", None)  # (a KIVI format keeps no layer state; `kw` is the dispatcher's, made for this call)
        if kivi_cpu.supports(q):  # (inline, not a method: every layer and step)
            if kw["check"]:
                info = _check_inputs(q, packed, fmt, *(kw[k] for k in TWIN_ARGS[:-1]))
                if info.paged and kw["length"] > 0:
                    check_used_blocks(kw["block_table"], info.num_blocks, info.T, kw["start"], kw["length"])
            out, mass = kivi_cpu.kivi_decode_cpu(
                q, packed, fmt, kw["start"], kw["length"], kw["scale"], kw["residual_k"], kw["residual_v"], kw["mask"],
                kw["block_table"], kw["keys_per_token"], with_mass,
            )  # fmt: skip
            out = out if out.dtype == q.dtype else out.to(q.dtype)  # (no call into torch when it is)
            return (out, mass) if with_mass else out
        path = path_of(q, kw["check"])
        if path == "op":
            p, args = packed, [kw[k] for k in ("start", "length", "scale", "residual_k", "residual_v", "mask")]
            op = custom_ops.quantized_decode_attention_with_mass if with_mass else custom_ops.quantized_decode_attention
            return op(
                q, p.k, p.k_scale, p.k_zero, p.v, p.v_scale, p.v_zero, *custom_ops.format_args(fmt), *args,
                kw["block_table"], kw["num_splits"], kw["keys_per_token"],
            )  # fmt: skip
        if path == "triton":
            fn = quantized_decode_attention_with_mass_triton if with_mass else quantized_decode_attention_triton
            return fn(q, packed, fmt, **kw)
        return super().attend(q, packed, fmt, kw, with_mass)

    def encode(self, x, fmt, side, positions=None, state=None):
        if kivi_cpu.encodes(x):
            return kivi_cpu.kivi_encode_cpu(x, fmt, side)
        return super().encode(x, fmt, side, positions, state)

    def quantize(self, x, fmt, out, side, check, positions=None, state=None):
        path = path_of(x, check)
        if path in TWINS:
            return super().quantize(x, fmt, out, side, check, positions, state)
        if path == "op":
            codes, scale, zero = _new_out(side, tuple(x.shape), fmt, x.device) if out is None else out
            op = custom_ops.quantize_keys if side == "keys" else custom_ops.quantize_values
            op(x, *custom_ops.format_args(fmt), codes, scale, zero)
            return codes, scale, zero
        return (quantize_keys_triton if side == "keys" else quantize_values_triton)(x, fmt, out=out, check=check)

    def codes_into(self, x, state=None) -> bool:
        return path_of(x, False) == "twin" and kivi_cpu.encodes(x)

    def encode_into(self, x, fmt, out, start, slots, limit, bad, state=None) -> None:
        kivi_cpu.kivi_encode_into_cpu(x, fmt, out, start, slots, limit, bad)

    def encode_kv_into(self, k, v, fmts, out_k, out_v, start, slots, limit, bad, state=None) -> None:
        if fmts[0] is not fmts[1] and fmts[0] != fmts[1]:  # (one operator call codes one format)
            return super().encode_kv_into(k, v, fmts, out_k, out_v, start, slots, limit, bad, state)
        kivi_cpu.kivi_encode_kv_into_cpu(k, v, fmts[0], out_k, out_v, start, slots, limit, bad)

    def quantize_at(self, x, fmt, out, slots, check, state=None):
        path = path_of(x, check)
        if path in TWINS:
            return super().quantize_at(x, fmt, out, slots, check, state)
        if path == "op":
            custom_ops.quantize_values_at(x, *custom_ops.format_args(fmt), *out, slots)
            return out
        return quantize_values_at_triton(x, fmt, out, slots, check=check)


register_kernels(QuantFormat, KiviKernels())
