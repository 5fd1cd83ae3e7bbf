"""The rotated formats' kernels (`rotated_format.RotatedFormat`): attention in the rotated space (q and the residual
rotated in once, the codes read as they are, the output rotated back once) by the C++ operator on the CPU
(`rotated_cpu`), the Triton kernel on CUDA (`rotated_attention`, `rotated_pack`), their custom operators while a graph
is traced there, the twins elsewhere."""

from __future__ import annotations

import torch

from hf_kvplus.kernels import custom_ops, rotated_cpu
from hf_kvplus.kernels.errors import ShapeError
from hf_kvplus.kernels.format_kernels import TWIN_ARGS, TWINS, FormatKernels, path_of
from hf_kvplus.kernels.kv_format import register_kernels
from hf_kvplus.kernels.quant_attention import _check_inputs, _twin
from hf_kvplus.kernels.quant_pack import _new_out
from hf_kvplus.kernels.rotated_attention import rotated_decode_attention_triton
from hf_kvplus.kernels.rotated_format import RotatedFormat, rotation, scaled_keys, turning_key_center
from hf_kvplus.kernels.rotated_pack import quantize_rotated_triton

__all__ = ["RotatedKernels"]


class RotatedKernels(FormatKernels):
    """Rotated codes read in the rotated space; coded by the C++ encoder (CPU) or the Triton kernel (CUDA)."""

    def attend(self, q, packed, fmt, kw, with_mass):
        """q . k and the softmax are unchanged by an orthogonal rotation: q and the residual rotated in (float32; a
        residual of a format with `inputs_rotated` comes rotated), the output (a weighted sum of rotated values)
        rotated back once. A layer's key scale (``kw["state"].scale``: the keys coded as ``k * s``) is folded into the
        rotations of q (``diag(1 / s) R``) and of a residual held as it came (``diag(s) R``); the CPU operator, which
        rotates inside, takes ``q / s`` and the residual times s."""
        if kw["check"] and (not isinstance(q, torch.Tensor) or q.dim() != 3):
            raise ShapeError(f"q must be a 3-d tensor [B, Hq, D], got {getattr(q, 'shape', type(q).__name__)}")
        center = kw.get("state")
        scaled = center is not None and center.scale is not None
        if rotated_cpu.supports(q, kw["block_table"]):  # (first: every eager CPU layer and step takes it)
            return self._cpu(q, packed, fmt, kw, with_mass, center if scaled else None)
        D, Dv, kw = q.shape[-1], fmt.channels(packed.v.shape[-1], "values"), dict(kw)
        # Compiled off CUDA the twin decodes the codes in plane order (`rotated_format.decoded_planes`), which inductor
        # vectorizes: a permutation of the channels shared by q, the keys, the values and the rotation back leaves the
        # output unchanged, so the rotations' columns are permuted to match.
        path = path_of(q, kw["check"])
        planes = path == "traced"
        # A ring held rotated stays in channel order: the twin folds it in after the codes, with q and the running
        # output turned to channel order (a few floats), where putting the ring in plane order copied all of it every
        # step.
        ring_in_channels = planes and kw["residual_k"] is not None and fmt.inputs_rotated
        r_k = rotation(D, fmt.seed, q.device, plane_bits=fmt.key_bits if planes else None)
        r_v = rotation(Dv, fmt.seed, q.device, plane_bits=fmt.value_bits if planes and not ring_in_channels else None)
        r_kk, r_q = center.folded(r_k, fmt.key_bits if planes else None) if scaled else (r_k, r_k)
        if kw["residual_k"] is not None and fmt.inputs_rotated:
            kw["residual_k"], kw["residual_v"] = kw["residual_k"].float(), kw["residual_v"].float()
        elif kw["residual_k"] is not None:
            kw["residual_k"], kw["residual_v"] = kw["residual_k"].float() @ r_kk, kw["residual_v"].float() @ r_v
        q_rot = q.float() @ r_k if not scaled else _grouped(q, r_q)
        state = kw.pop("state", None)
        if path == "op":
            result = self._op(q_rot, packed, fmt, kw, with_mass, state)
        elif path == "triton":
            result = rotated_decode_attention_triton(q_rot, packed, fmt, **kw, with_mass=with_mass, key_center=state)
        else:
            result = _twin(q_rot, packed, fmt, *(kw[k] for k in TWIN_ARGS), with_mass=with_mass, planes=planes,
                           ring_in_channels=ring_in_channels, state=state)  # fmt: skip
        out = (result[0] @ r_v.T).to(q.dtype)
        return (out, result[1]) if with_mass else out

    @staticmethod
    def _op(q_rot, p, fmt, kw: dict, with_mass: bool, center):
        """The custom operator (a graph traced on CUDA), the centre and a turning centre's tensors as arguments."""
        op = custom_ops.rotated_decode_attention_with_mass if with_mass else custom_ops.rotated_decode_attention
        turning = turning_key_center(center)
        turn = (None, None)
        if turning is not None and turning.mu is not None:  # the query's weights and the basis rows of the codes
            turn = turning.query_weights(q_rot, rotated=True), turning.basis(kw["start"] + kw["length"], q_rot.device)
        result = op(
            q_rot, p.k, p.k_scale, p.v, p.v_scale, fmt.key_bits, fmt.value_bits, fmt.seed,
            *(kw[k] for k in ("start", "length", "scale", "residual_k", "residual_v", "mask", "block_table", "num_splits")),
            None if center is None or turning is not None else center.rotated, *turn,
        )  # fmt: skip
        return result if with_mass else (result, None)

    @staticmethod
    def _cpu(q, packed, fmt, kw: dict, with_mass: bool, scaled=None):
        """Through the CPU operator (`rotated_cpu`), which rotates q and the output itself; `scaled`: the layer's key
        centre where it scales the keys (q taken as ``q / s``, a residual held as it came times s)."""
        if kw["check"]:
            _check_inputs(q, packed, fmt, *(kw[k] for k in TWIN_ARGS[:-1]))
        q_in, residual_k = q, kw["residual_k"]
        if scaled is not None:
            q_in = scaled.query(q)
            residual_k = residual_k if residual_k is None or fmt.inputs_rotated else scaled.scaled(residual_k)
        out, mass = rotated_cpu.rotated_decode_cpu(
            q_in, packed, fmt, kw["start"], kw["length"], kw["scale"], residual_k, kw["residual_v"], kw["mask"],
            with_mass, kw.get("state"),
        )  # fmt: skip
        out = out if out.dtype == q.dtype else out.to(q.dtype)  # (no call into torch when it is)
        return (out, mass) if with_mass else out

    def encode(self, x, fmt, side, positions=None, state=None):
        if rotated_cpu.encodes(x):
            return (*rotated_cpu.rotated_encode_cpu(scaled_keys(x, fmt, state), fmt, side, positions, state), None)
        return super().encode(x, fmt, side, positions, state)

    def codes_into(self, x, state=None) -> bool:
        """Eager CPU floats, the operators built, and a key centre that is set and does not turn
        (`rotated_cpu.encodes_into`)."""
        return path_of(x, False) == "twin" and rotated_cpu.encodes_into(x, state)

    def encode_into(self, x, fmt, out, start, slots, limit, bad, state=None) -> None:
        """The values side's bits (an evicting cache's slots code keys with a format of the key bits on both sides:
        `side_formats`); `limit` bounds each vector's length (`RotatedFormat.code_limit`)."""
        rotated_cpu.rotated_encode_into_cpu(scaled_keys(x, fmt, state), fmt, "values", out, start, slots, limit, bad,
                                            state)  # fmt: skip

    def encode_kv_into(self, k, v, fmts, out_k, out_v, start, slots, limit, bad, state=None) -> None:
        """Both sides in one operator call where both are rotated formats (each side its bits, as `encode_into`)."""
        if not isinstance(fmts[1], RotatedFormat):  # (the keys' format chose these kernels)
            return super().encode_kv_into(k, v, fmts, out_k, out_v, start, slots, limit, bad, state)
        k = scaled_keys(k, fmts[0], state)
        rotated_cpu.rotated_encode_kv_into_cpu(k, v, fmts, out_k, out_v, start, slots, limit, bad, state)

    def quantize(self, x, fmt, out, side, check, positions=None, state=None):
        path = path_of(x, check)
        if path in TWINS:
            return super().quantize(x, fmt, out, side, check, positions, state)
        return self._cuda(x, fmt, out, side, None, path, check, positions, state)

    def quantize_at(self, x, fmt, out, slots, check, state=None):
        path = path_of(x, check)
        if path in TWINS:
            return super().quantize_at(x, fmt, out, slots, check, state)
        return self._cuda(x, fmt, out, "values", slots, path, check, None, state)

    @staticmethod
    def _cuda(x, fmt, out, side: str, slots, path: str, check: bool, positions=None, center=None):
        """The custom operator while compiling (``check=False``; a turning centre goes to it as the centre of each
        token), else the Triton kernel; `center`: the layer's key centre, given with the keys."""
        if path == "op":
            x = scaled_keys(x, fmt, center)
            codes, norms, _ = _new_out(side, tuple(x.shape), fmt, x.device) if out is None else out
            if center is not None and not fmt.inputs_rotated:
                center.observe(x, fmt.seed, positions)  # the layer's first keys set its centre (once)
            turning = turning_key_center(center) is not None and side == "keys"
            mu = None if center is None else center.at(positions, rotated=False) if turning else center.mu
            custom_ops.quantize_rotated(
                x, fmt.key_bits, fmt.value_bits, fmt.seed, side, codes, norms, slots, mu, fmt.inputs_rotated
            )
            return codes, norms, None
        return quantize_rotated_triton(x, fmt, side, out, slots, check=check, positions=positions, center=center)


def _grouped(q: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, D] times each KV head's matrix r [H, D, D] (its query heads grouped onto it): float32 [B, Hq, D]."""
    B, Hq, D = q.shape
    return (q.float().view(B, r.shape[0], -1, D) @ r).view(B, Hq, -1)


register_kernels(RotatedFormat, RotatedKernels())
