"""What a format's decode and coding run on, chosen in one place per format: the base here runs the plain-torch twins
on every device, which is all a format needs to work (eager, and compiled: traced inline); a format with kernels of
its own (Triton, C++ operators, custom operators) subclasses it and registers the subclass for its class
(`kv_format.register_kernels`), beside the kernels.

`path_of` is the one place kernels/ asks whether the compiler is tracing; `dispatch` calls the registered kernels of a
call's format through `kv_format.kernels_for`.
"""

from __future__ import annotations

import torch

from hf_kvplus.kernels.kv_format import KVFormat, kernels_for, register_kernels
from hf_kvplus.kernels.paged_attention import _check_block_ids
from hf_kvplus.kernels.quant_attention import _twin
from hf_kvplus.kernels.quant_format import quantize_keys, quantize_values
from hf_kvplus.kernels.quant_pack import _check_at, quantize_off_cuda, quantize_values_at_torch

__all__ = ["TWINS", "TWIN_ARGS", "FormatKernels", "check_used_blocks", "path_of"]


def path_of(x, check: bool, op_off_cuda: bool = False) -> str:
    """Where a call on `x` runs: "op" (the custom operator: an unchecked call being traced, on CUDA unless
    `op_off_cuda`), "triton" (CUDA tensors), "traced" (the twin, traced off CUDA: it takes the forms inductor fuses) or
    "twin" (everything else, a checked call's non-tensor included, which the twin's checks refuse)."""
    cuda = (not check or isinstance(x, torch.Tensor)) and x.is_cuda
    if not torch.compiler.is_compiling():
        return "triton" if cuda else "twin"
    if not check and (cuda or op_off_cuda):
        return "op"
    return "triton" if cuda else "traced"


#: The paths that run the torch twin.
TWINS = ("twin", "traced")

#: The twin's positional arguments after (q, packed, fmt), by keyword name.
TWIN_ARGS = (
    "start", "length", "scale", "residual_k", "residual_v", "mask", "block_table", "num_splits", "keys_per_token",
    "check",
)  # fmt: skip


def check_used_blocks(block_table, num_blocks: int, block_size: int, start: int, length: int) -> None:
    """The block ids of the table columns tokens `start .. start + length - 1` use are in the pool (a host read, as
    the twins' check makes): the operators read them unchecked."""
    if length > 0:
        first, end = start // block_size, (start + length - 1) // block_size + 1
        _check_block_ids(block_table[:, first:end], num_blocks, first, end, start, length)


class FormatKernels:
    """A format's decode attention and coding as the plain-torch twins, on every device (`kw`: the keywords of
    `dispatch.quantized_decode_attention`, ``kw["state"]`` the layer's state; `state`: the layer's state of the codes
    coded, None for none)."""

    def attend(self, q, packed, fmt: KVFormat, kw: dict, with_mass: bool):
        """Decode attention over `packed` and the residual: the output, and with `with_mass` each key's mass."""
        result = _twin(q, packed, fmt, *(kw[k] for k in TWIN_ARGS), with_mass=with_mass,
                       planes=path_of(q, kw["check"]) == "traced", state=kw.get("state"))  # fmt: skip
        return result if with_mass else result[0]

    def encode(self, x, fmt: KVFormat, side: str, positions=None, state=None):
        """(codes, scale, zero) of x off CUDA."""
        twin = quantize_keys if side == "keys" else quantize_values
        kw = {} if positions is None else {"positions": positions}
        return twin(x, fmt, **kw, **({} if state is None else {"state": state}))

    def quantize(self, x, fmt: KVFormat, out, side: str, check: bool, positions=None, state=None):
        """(codes, scale, zero) of x, written into `out` when it is given."""
        return quantize_off_cuda(x, fmt, out, side, check, positions, state)

    def quantize_at(self, x, fmt: KVFormat, out, slots, check: bool, state=None):
        """Values x coded per token into rows `slots` of `out` (see `dispatch.quantize_values_at`)."""
        if check:
            _check_at(x, fmt, out, slots)
        return quantize_values_at_torch(x, fmt, out, slots, state)

    def codes_into(self, x, state=None) -> bool:
        """Whether `encode_into` codes `x` here, with the layer's `state` (see `dispatch.takes_values_into`): not
        with the twins alone."""
        return False

    def encode_into(self, x, fmt: KVFormat, out, start: int, slots, limit, bad, state=None) -> None:
        """Values x coded per token, guarded by `limit`, straight into `out` (see `dispatch.quantize_values_into`)."""
        raise NotImplementedError(f"{type(fmt).__name__} has no operator that codes values into their slots")

    def encode_kv_into(self, k, v, fmts, out_k, out_v, start: int, slots, limit, bad, state=None) -> None:
        """`encode_into` of keys `k` (format ``fmts[0]``, with the layer's `state`) into `out_k` and values `v`
        (``fmts[1]``) into `out_v`, at the same rows; one call where the format's operator codes both sides."""
        self.encode_into(k, fmts[0], out_k, start, slots, limit, bad, state)
        kernels_for(fmts[1]).encode_into(v, fmts[1], out_v, start, slots, limit, bad)


register_kernels(KVFormat, FormatKernels())
