"""How a slot holds a token's key and value: at full precision (`DenseCodec`), or quantized per token
(`TokenQuantCodec`: each token's key and value stand alone, so any slot can be overwritten in place)."""

from __future__ import annotations

import torch

from ..kernels.dispatch import (
    quantize_kv_into,
    quantize_values,
    quantize_values_at,
    quantize_values_into,
    takes_values_into,
)
from ..kernels.quant_format import PACKED_NAMES, PackedKV, QuantFormat, dequantize_values
from ..kernels.rotated_format import RotatedFormat
from .eager_memo import EagerMemo

#: The formats whose kernels code a decode token straight into the slots (`dispatch.quantize_values_into`): exactly
#: these classes (a subclass may code differently from the operator its base's kernels run).
_CODED_INTO = (QuantFormat, RotatedFormat)


class DenseCodec:
    """Keys and values as they come."""

    payload = ("keys", "values")
    key_fields = ("keys",)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": keys, "values": values}

    def encode_keys(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": keys}

    def decode_keys(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return fields["keys"]

    def decode_values(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return fields["values"]

    def guards(self, x: torch.Tensor) -> bool:
        """Full precision holds any value: nothing to guard."""
        return False

    def write(self, fields: dict[str, torch.Tensor], span: slice, keys: torch.Tensor, values: torch.Tensor,
              guard=None) -> None:  # fmt: skip
        """Keys and values into slots `span` of `fields`."""
        fields["keys"][:, :, span] = keys
        fields["values"][:, :, span] = values

    def write_keys(self, fields: dict[str, torch.Tensor], span: slice | None, keys: torch.Tensor) -> None:
        """Keys into slots `span` of `fields` (None: `fields` are cut to those slots already)."""
        (fields["keys"] if span is None else fields["keys"][:, :, span]).copy_(keys)

    def write_at(self, fields: dict[str, torch.Tensor], slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 guard=None) -> None:  # fmt: skip
        """Keys and values into slots `slots` [batch, kv_heads, 1] (eagerly: by `scatter_`, one index for both)."""
        index = slots[..., None].expand(*keys.shape)
        fields["keys"].scatter_(2, index, keys)
        fields["values"].scatter_(2, index if values.shape == keys.shape else slots[..., None].expand(*values.shape), values)

    def packed(self, fields: dict[str, torch.Tensor]) -> None:
        """Full precision has no codes for a kernel to read."""
        return None

    def __repr__(self) -> str:
        return "DenseCodec()"


class TokenQuantCodec:
    """Keys and values quantized per token over groups of channels (int8/int4/int2 or fp8).

    Per-token keys (not KIVI's per-channel groups) because an evicting layer overwrites single
    slots: a group spanning tokens would have to be re-quantized whenever one of them is evicted. A rotated
    format is per token on both sides already; its keys are coded with the key bits (`fmt.side_formats()`), and
    with the layer's `state` (`KVFormat.make_state`: a rotated format's key centre), which the codec holds.
    """

    def __init__(self, fmt: QuantFormat, state=None):
        self.fmt, self.state = fmt, state
        self._formats = dict(zip(("k", "v"), fmt.side_formats(), strict=True))
        self._states = {"k": state, "v": None, "kv": None}  # the state goes with the keys
        self.payload = ("k", "v")
        self.key_fields = ("k", "k_scale", "k_zero")
        self._fields = {name: (name, f"{name}_scale", f"{name}_zero") for name in self.payload}  # per quantize call
        # Both sides in formats whose coding the CPU operator writes straight into the slots, guard folded in.
        self._into = all(type(f) in _CODED_INTO for f in self._formats.values())

    def guards(self, x: torch.Tensor) -> bool:
        """Whether `write`/`write_at`/`write_keys` of `x` code it straight into the slots, a `RangeGuard` given to them
        folded into the same call (`dispatch.quantize_values_into`); else the caller guards first. Asked once per
        input dtype, device and dims and whether a key centre is set (`EagerMemo`: every layer and step asks)."""
        if not self._into:
            return False
        memo = self.__dict__.get("_guards")
        if memo is None:  # (made on first use: a codec saved before has none)
            memo = self._guards = EagerMemo()
        key = (x.dtype, x.device, x.dim(), getattr(self.state, "mu", None) is not None)
        return memo.get(key, takes_values_into, x, self.fmt, self.state)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Both quantized by one call when they have the same shape and format, keys without a centre (tokens
        stand alone, so the codes are those of two calls; a decode step's ops are its host cost), then split."""
        k_fmt, v_fmt = self._formats["k"], self._formats["v"]
        if keys.shape != values.shape or k_fmt != v_fmt or k_fmt.holds_state(self.state):
            return {**self._encode("k", keys), **self._encode("v", values)}
        n = keys.shape[2]
        both = self._encode("kv", torch.cat([keys, values], dim=2))  # fields kv, kv_scale, kv_zero: [.., 2n, ..]
        return {
            name + field[2:]: part[:, :, :n] if name == "k" else part[:, :, n:]
            for name in ("k", "v")
            for field, part in both.items()
        }

    def encode_keys(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._encode("k", keys)

    def _encode(self, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale, zero = quantize_values(x.contiguous(), self._formats.get(name, self.fmt), check=False,
                                             state=self._states[name])  # fmt: skip
        fields = {name: codes, f"{name}_scale": scale}
        if zero is not None:
            fields[f"{name}_zero"] = zero
        return fields

    def _decode(self, fields, name, dtype):
        zero = fields.get(f"{name}_zero")
        return dequantize_values(fields[name], fields[f"{name}_scale"], zero, self._formats[name], dtype=dtype,
                                 state=self._states[name])  # fmt: skip

    def decode_keys(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self._decode(fields, "k", dtype)

    def decode_values(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self._decode(fields, "v", dtype)

    def write(self, fields: dict[str, torch.Tensor], span: slice, keys: torch.Tensor, values: torch.Tensor,
              guard=None) -> None:  # fmt: skip
        """Keys and values quantized straight into slots `span` of `fields`: the quantize kernel writes the slots'
        codes, scales and zeros, so nothing is copied after it (a decode step's ops are its host cost). `guard`: a
        `RangeGuard` to code through, where `guards` said so (so it is not asked again)."""
        if guard is not None or self.guards(keys):
            self._both_into_rows(fields, keys, values, span.start, None, guard)
            return
        rows = (span.start, span.stop - span.start)
        self._quantize_into(fields, rows, "k", keys)
        self._quantize_into(fields, rows, "v", values)

    def write_keys(self, fields: dict[str, torch.Tensor], span: slice | None, keys: torch.Tensor) -> None:
        """Keys quantized into slots `span` of `fields` (None: `fields` are cut to those slots already)."""
        if self.guards(keys):
            self._into_rows(fields, "k", keys, 0 if span is None else span.start, None, None)
            return
        self._quantize_into(fields, None if span is None else (span.start, span.stop - span.start), "k", keys)

    def write_at(self, fields: dict[str, torch.Tensor], slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 guard=None) -> None:  # fmt: skip
        """Keys and values quantized straight into slots `slots` [batch, kv_heads, 1]: one kernel each writes the
        codes, scales and zeros at the slot (a decode step's ops are its host cost). `guard`: as in `write`."""
        if guard is not None or self.guards(keys):
            self._both_into_rows(fields, keys, values, 0, slots, guard)
            return
        for name, x in (("k", keys), ("v", values)):
            out = tuple(fields.get(field) for field in self._fields[name])
            quantize_values_at(x.contiguous(), self._formats[name], out, slots, check=False, state=self._states[name])

    def _into_rows(self, fields, name, x, start, slots, guard) -> None:
        """`x` coded by the CPU operator into rows `start ..` (or `slots`) of side `name`'s fields, through `guard`."""
        limit, bad = (None, None) if guard is None else guard.folded(x.dtype)
        quantize_values_into(
            x, self._formats[name], self._out(fields, name), start, slots, limit=limit, bad=bad,
            state=self._states[name],
        )  # fmt: skip

    def _both_into_rows(self, fields, keys, values, start, slots, guard) -> None:
        """`_into_rows` of both sides, in one operator call where one format codes both (`dispatch.quantize_kv_into`)."""
        limit, bad = (None, None) if guard is None else guard.folded(keys.dtype)
        fmts = (self._formats["k"], self._formats["v"])
        (kc, ks, kz), (vc, vs, vz) = self._fields["k"], self._fields["v"]  # (`_out` of each, inline: every step)
        out_k, out_v = (fields[kc], fields[ks], fields.get(kz)), (fields[vc], fields[vs], fields.get(vz))
        quantize_kv_into(keys, values, fmts, out_k, out_v, start, slots, limit=limit, bad=bad, state=self._states["k"])

    def _out(self, fields, name) -> tuple:
        """Side `name`'s (codes, scale, zero or None) among `fields`, which the operators code into."""
        codes, scale, zero = self._fields[name]
        return fields[codes], fields[scale], fields.get(zero)

    def _quantize_into(self, fields, rows, name, x) -> None:
        """`x` coded into rows `rows` = (first, count) of side `name`'s fields (None: all of them). A tuple and
        `narrow`, not a slice: traced, a slice of a symbolic start compared with None specializes the start, and a
        sink cache's decode step then compiled anew at every slot of its ring."""
        codes, scale, zero = self._out(fields, name)
        if rows is not None:
            codes, scale, zero = (None if t is None else t.narrow(2, *rows) for t in (codes, scale, zero))
        quantize_values(x.contiguous(), self._formats[name], out=(codes, scale, zero), check=False,
                        state=self._states[name])  # fmt: skip

    def packed(self, fields: dict[str, torch.Tensor]) -> PackedKV:
        """The codes as the quantized decode kernel reads them (keys per token)."""
        return PackedKV(*(fields.get(name) for name in PACKED_NAMES))

    def __repr__(self) -> str:
        return f"TokenQuantCodec({self.fmt})"
