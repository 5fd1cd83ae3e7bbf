"""Quantized K/V formats: the byte layout shared by the quantize-and-pack and attention kernels.

KIVI layout (Liu et al., 2024): keys are quantized per channel, in groups of ``group_size`` tokens
(outlier channels of keys get their own range); values per token, in groups of ``group_size``
channels. ``bits`` is 8, 4 or 2 (asymmetric integers: a float16 scale and zero point per group) or
``"fp8"`` (float8 e4m3 codes with a float16 scale per group, no zero point).

Layout of ``T`` tokens of one (row, head) — leading dims are free (``[B, Hkv]`` dense, ``[blocks,
Hkv]`` paged):

- codes, keys and values alike: uint8 ``[..., T, D * bits // 8]`` (fp8: ``[..., T, D]``). With
  ``per = 8 // bits`` codes per byte and ``P = D // per``, byte ``j`` of a token holds channel
  ``i * P + j`` in bits ``i * bits .. (i + 1) * bits - 1`` for ``i = 0 .. per - 1`` (so unpacking a
  byte row with ``per`` shifts and concatenating gives the channels in order).
- key scales/zeros: float16 ``[..., T // group_size, D]`` (token ``t`` uses row ``t // group_size``).
- value scales/zeros: float16 ``[..., T, D // group_size]`` (channel ``c`` uses column ``c // group_size``).

Integer codes: ``q = clamp(floor((x - zero) / scale + 0.5), 0, 2**bits - 1)``, ``x^ = zero + q * scale``.
The group's min and max are taken in float32; the zero point is rounded to float16 *below* the min
and the scale to float16 *above* ``(max - zero) / (2**bits - 1)``, so no value is clamped and
``|x - x^| <= scale / 2`` (plus float32 rounding) for every element: the analytic bound. fp8:
``scale >= amax / 448`` rounded up to float16, ``q = e4m3(x / scale)`` (round to nearest even),
``|x - x^| <= |x| * 2**-4 + scale * 2**-10``.

The functions here are the plain-torch twins (any device); ``kernels/quant_pack.py`` has the Triton
quantize-and-pack kernels, bit-identical to these.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from hf_kvplus.kernels.constants import Constants
from hf_kvplus.kernels.errors import ConfigError, DTypeError, ShapeError
from hf_kvplus.kernels.kv_format import KVFormat, state_kw

__all__ = [
    "BIT_WIDTHS",
    "DEFAULT_GROUP",
    "FP8_LIMIT",
    "FP8_MAX",
    "INT_LIMIT",
    "PackedKV",
    "QuantFormat",
    "dequantize_keys",
    "dequantize_values",
    "pack_codes",
    "quantize_keys",
    "quantize_values",
    "unpack_planes",
]

#: Largest finite float8 e4m3fn value.
FP8_MAX = 448.0
#: The largest magnitude integer codes hold (float16 zero points, less the margin of their directed rounding).
INT_LIMIT = 65000.0
#: fp8's: its float16 scale is at least amax / 448.
FP8_LIMIT = 2.9e7
#: Relative margin for the directed float16 rounding of zero points and scales (2 float16 ulps).
_MARGIN = 2.0**-10
#: Smallest positive float16 (subnormal): the floor of a scale, so a constant group divides by > 0.
_TINY = 2.0**-24
#: Half the float16 subnormal spacing: added before rounding a scale so that it rounds up there too.
_HALF_TINY = 2.0**-25
BIT_WIDTHS = (8, 4, 2, "fp8")
#: Default group size per format: the largest that keeps int8 under 0.56, int4 under 0.32 and int2 under
#: 0.19 of float16's bytes per token (codes plus float16 scales and zero points).
DEFAULT_GROUP = {8: 64, 4: 32, 2: 32, "fp8": 32}


@dataclass(frozen=True)
class QuantFormat(KVFormat):
    """A KIVI format: a bit width (8, 4, 2 or "fp8") and a group size (tokens per key group, channels per value
    group)."""

    bits: int | str
    group_size: int
    # Derived once (plain attributes: the decode path reads them several times per layer and step).
    is_float: bool = field(init=False, repr=False, compare=False)
    code_bits: int = field(init=False, repr=False, compare=False)
    per_byte: int = field(init=False, repr=False, compare=False)  # codes per byte
    qmax: int = field(init=False, repr=False, compare=False)  # the largest integer code
    has_zero: bool = field(init=False, repr=False, compare=False)  # integer codes: a zero point per group

    def __post_init__(self):
        if self.bits not in BIT_WIDTHS or isinstance(self.bits, bool):
            raise ConfigError(f"bits must be one of 8, 4, 2 or 'fp8', got {self.bits!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ConfigError(f"group_size must be a positive int, got {self.group_size!r}")
        is_float = self.bits == "fp8"
        code_bits = 8 if is_float else self.bits
        for name, value in (("is_float", is_float), ("code_bits", code_bits), ("per_byte", 8 // code_bits),
                            ("qmax", 2**code_bits - 1), ("has_zero", not is_float)):  # fmt: skip
            object.__setattr__(self, name, value)

    def packed_dim(self, head_dim: int) -> int:
        return head_dim // self.per_byte

    def code_dim(self, head_dim: int, side: str) -> int:
        """Bytes of one token's codes (keys and values alike)."""
        return self.packed_dim(head_dim)

    def channels(self, code_bytes: int, side: str) -> int:
        """The head dim of `code_bytes` bytes of codes per token."""
        return code_bytes * self.per_byte

    def param_shape(self, side: str, tokens: int, head_dim: int) -> tuple[int, int]:
        """Shape of the float16 scales (and zeros) of `tokens` tokens (a multiple of the group size for keys)."""
        if side == "keys":
            return tokens // self.group_size, head_dim
        return tokens, head_dim // self.group_size

    def code_limit(self) -> tuple[float, bool]:
        return (FP8_LIMIT if self.is_float else INT_LIMIT), False

    def quantize(self, x, side, positions=None):
        return (_quantize_keys if side == "keys" else _quantize_values)(x, self)

    def dequantize(self, codes, scale, zero, side, dtype=torch.float32, *, positions=None):
        return (_dequantize_keys if side == "keys" else _dequantize_values)(codes, scale, zero, self, dtype)

    def planes(self, side: str, head_dim: int) -> int:
        """Codes per byte: plane i holds channels ``i * P ..`` (what `unpack_planes` decodes into)."""
        return self.per_byte

    def check_head_dim(self, head_dim: int) -> None:
        """A value group must tile the head dim, and a byte must hold whole channels."""
        if head_dim % self.group_size:
            raise ConfigError(
                f"group_size {self.group_size} does not divide head_dim {head_dim}: value groups must tile the "
                "channels"
            )
        if head_dim % self.per_byte:
            raise ConfigError(f"head_dim {head_dim} is not a multiple of {self.per_byte} ({self.bits}-bit codes per byte)")

    def bytes_per_token(self, head_dim: int) -> float:
        """Bytes at rest of one token's key and value of one head: codes plus amortized scales/zeros."""
        params = 1 if self.is_float else 2  # scale (+ zero), float16 each
        codes = 2 * self.packed_dim(head_dim)
        key_params = params * 2 * head_dim / self.group_size  # one row per group of tokens
        value_params = params * 2 * head_dim / self.group_size  # head_dim / group_size groups per token
        return codes + key_params + value_params

    def __str__(self) -> str:
        name = "fp8" if self.is_float else f"int{self.bits}"
        return f"{name}/g{self.group_size}"


@dataclass(frozen=True)
class PackedKV:
    """Quantized keys and values of one layer as the attention kernels read them (zeros None for fp8).

    Dense storage: ``[B, Hkv, T, ...]`` buffers (token ``t``'s key group is row ``t // group_size`` of
    ``k_scale``/``k_zero``). Paged storage: pools ``[blocks, Hkv, block_size, ...]`` with ``block_size``
    a multiple of the group size (a block's key groups are rows ``offset // group_size`` of its
    ``k_scale``/``k_zero`` block, ``[blocks, Hkv, block_size // group_size, D]``).
    """

    k: torch.Tensor  # uint8 [..., T, D // per]
    k_scale: torch.Tensor  # float16 [..., T // group_size, D]
    k_zero: torch.Tensor | None
    v: torch.Tensor  # uint8 [..., T, Dv // per]
    v_scale: torch.Tensor  # float16 [..., T, Dv // group_size]
    v_zero: torch.Tensor | None

    @classmethod
    def allocate(cls, fmt, rows: int, heads: int, tokens: int, key_dim: int, value_dim: int, device, make=torch.empty):
        """Code and parameter buffers `[rows, heads, tokens, ...]` made by `make`: batch rows of `tokens` positions
        (contiguous and static storage), or a pool's blocks of `tokens` = block size. `tokens` is a multiple of the
        group size. The one layout every quantized storage of hf_kvplus holds, whatever it addresses tokens by."""

        def params(side: str, dim: int) -> torch.Tensor:
            return make(rows, heads, *fmt.param_shape(side, tokens, dim), dtype=torch.float16, device=device)

        return cls(
            k=make(rows, heads, tokens, fmt.code_dim(key_dim, "keys"), dtype=torch.uint8, device=device),
            k_scale=params("keys", key_dim),
            k_zero=params("keys", key_dim) if fmt.has_zero else None,
            v=make(rows, heads, tokens, fmt.code_dim(value_dim, "values"), dtype=torch.uint8, device=device),
            v_scale=params("values", value_dim),
            v_zero=params("values", value_dim) if fmt.has_zero else None,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The buffers by field name (no zeros for fp8): what an offloading placement moves."""
        return {name: t for name in PACKED_NAMES if (t := getattr(self, name)) is not None}

    def select_rows(self, indices: torch.Tensor) -> PackedKV:
        """New buffers holding rows `indices` (a batch reorder or a new batch size)."""
        return PackedKV(*(None if t is None else t.index_select(0, indices) for t in (getattr(self, n) for n in PACKED_NAMES)))

    def span(self, group_size: int, a: int, z: int) -> PackedKV:
        """Views on tokens `a .. z - 1`, both on key-group boundaries."""
        g = group_size
        return PackedKV(
            self.k[:, :, a:z], self.k_scale[:, :, a // g : z // g], _rows(self.k_zero, a // g, z // g),
            self.v[:, :, a:z], self.v_scale[:, :, a:z], _rows(self.v_zero, a, z),
        )  # fmt: skip

    def span_bytes(self, group_size: int, lo: int, hi: int) -> tuple[int, int]:
        """Bytes of tokens `lo .. hi - 1` (`lo` on a group boundary): codes, and scales plus zeros."""
        g = group_size
        codes = (self.k[:, :, lo:hi].numel() + self.v[:, :, lo:hi].numel()) * self.k.element_size()
        key_params = sum(t[:, :, lo // g : hi // g].numel() * 2 for t in (self.k_scale, self.k_zero) if t is not None)
        value_params = sum(t[:, :, lo:hi].numel() * 2 for t in (self.v_scale, self.v_zero) if t is not None)
        return codes, key_params + value_params

    def dequantized(
        self, fmt, lo: int, hi: int, dtype: torch.dtype, index: int = 0, state=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `lo .. hi - 1` of whole-group buffers as dense `[rows, heads, hi - lo, dim]` K/V (indices counted
        from `index` at the buffers' first token, for a format whose codes depend on them; `state`: the layer's)."""
        positions = fmt.key_positions(index, self.k.shape[2], self.k.device, state)
        k = fmt.dequantize(self.k, self.k_scale, self.k_zero, "keys", dtype, positions=positions, **state_kw(state))
        v = fmt.dequantize(self.v, self.v_scale, self.v_zero, "values", dtype)
        return k[:, :, lo:hi], v[:, :, lo:hi]


def _rows(t: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return None if t is None else t[:, :, lo:hi]


#: The field names of a `PackedKV`, in order (the tensors a storage of codes holds).
PACKED_NAMES = tuple(f.name for f in fields(PackedKV))


def _check_float(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise DTypeError(f"{what} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 2:
        raise ShapeError(f"{what} must be [..., tokens, head_dim], got shape {tuple(x.shape)}")


def pack_codes(codes: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """uint8 codes ``[..., D]`` (each < 2**bits) to packed bytes ``[..., D // per]`` (see module doc)."""
    per = fmt.per_byte
    if per == 1:
        return codes.to(torch.uint8)
    parts = codes.to(torch.uint8).unflatten(-1, (per, -1))  # [..., per, P]: part i = channels i*P..
    packed = parts[..., 0, :]
    for i in range(1, per):  # out of place: the first part is a view of `codes`
        packed = packed | (parts[..., i, :] << (i * fmt.code_bits))
    return packed


def unpack_planes(packed: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Packed bytes ``[..., P]`` to uint8 codes ``[..., per, P]``: plane i holds channels ``i * P .. (i + 1) * P - 1``
    (``flatten(-2)`` puts them in channel order).

    One shift by ``[per, 1]`` amounts and one mask, whatever ``per`` (two ops: a decode step's host cost). The
    dequantizers decode in this shape and flatten last: compiled, a loop over the channels in order would index
    the bytes by ``channel % P`` and the shifts by ``channel // P``, which inductor runs element by element."""
    per = fmt.per_byte
    if per == 1:
        return packed.unsqueeze(-2)
    return (packed.unsqueeze(-2) >> _shifts(per, fmt.code_bits, packed.device)) & fmt.qmax


_SHIFTS: Constants[torch.Tensor] = Constants()


def _shifts(per: int, bits: int, device: torch.device) -> torch.Tensor:
    """uint8 ``[per, 1]``: the shift of each code in a byte, made once per device."""
    return _SHIFTS.get(
        (per, bits, device),
        lambda: torch.arange(0, per * bits, bits, dtype=torch.uint8, device=device).view(per, 1),
    )


def _params_int(lo: torch.Tensor, hi: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 (scale, zero) with zero <= lo and zero + qmax * scale >= hi (float32 in, float16 out)."""
    zero = (lo - lo.abs() * _MARGIN - _TINY).to(torch.float16)
    scale = ((hi - zero.float()) / qmax * (1 + _MARGIN) + _HALF_TINY).clamp_min(_TINY).to(torch.float16)
    return scale, zero


def _encode_int(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int) -> torch.Tensor:
    q = torch.floor((x - zero.float()) / scale.float() + 0.5)
    return q.clamp_(0, qmax).to(torch.uint8)


def _scale_fp8(amax: torch.Tensor) -> torch.Tensor:
    return (amax / FP8_MAX * (1 + _MARGIN) + _HALF_TINY).clamp_min(_TINY).to(torch.float16)


def _encode_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    y = (x / scale.float()).clamp_(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def _decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: QuantFormat) -> torch.Tensor:
    # float32 codes times float16 scales promote to float32. A code has at most 8 significant bits and a
    # float16 scale 11, so the product is exact and `zero + code * scale` rounds once, FMA or not.
    if fmt.is_float:
        return codes.view(torch.float8_e4m3fn).float() * scale
    return torch.addcmul(zero, codes.float(), scale)


def quantize_keys(
    x: torch.Tensor, fmt: KVFormat, *, positions: torch.Tensor | None = None, state=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keys ``[..., T, D]`` to (codes, scale, zero) of any format (KIVI: per channel per group of tokens, T a multiple
    of the group size; `positions`: the tokens' indices, for a format whose codes depend on them; `state`: the
    layer's, a rotated format's key centre)."""
    _check_float(x, "keys")
    return fmt.quantize(x, "keys", positions, **state_kw(state))


def quantize_values(
    x: torch.Tensor, fmt: KVFormat, *, positions: torch.Tensor | None = None, state=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Values ``[..., T, D]`` to (codes, scale, zero) of any format (KIVI: per token per group of channels; `state`:
    given where the values side codes keys, an evicting cache's slots)."""
    _check_float(x, "values")
    return fmt.quantize(x, "values", positions, **state_kw(state))


def dequantize_keys(codes, scale, zero, fmt: KVFormat, dtype=torch.float32, *, positions=None, state=None) -> torch.Tensor:
    """Inverse of :func:`quantize_keys`: ``[..., T, D]`` in ``dtype``."""
    return fmt.dequantize(codes, scale, zero, "keys", dtype, positions=positions, **state_kw(state))


def dequantize_values(codes, scale, zero, fmt: KVFormat, dtype=torch.float32, *, state=None) -> torch.Tensor:
    """Inverse of :func:`quantize_values`: ``[..., T, D]`` in ``dtype``."""
    return fmt.dequantize(codes, scale, zero, "values", dtype, **state_kw(state))


def _quantize_keys(x: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    T, D = x.shape[-2:]
    if T % fmt.group_size:
        raise ShapeError(f"keys hold {T} tokens, not a multiple of the group size {fmt.group_size}")
    fmt.check_head_dim(D)
    xf = x.float().unflatten(-2, (T // fmt.group_size, fmt.group_size))  # [..., groups, G, D]
    if fmt.is_float:
        scale = _scale_fp8(xf.abs().amax(dim=-2))
        codes = _encode_fp8(xf, scale.unsqueeze(-2)).flatten(-3, -2)
        return codes, scale, None
    scale, zero = _params_int(xf.amin(dim=-2), xf.amax(dim=-2), fmt.qmax)
    codes = _encode_int(xf, scale.unsqueeze(-2), zero.unsqueeze(-2), fmt.qmax).flatten(-3, -2)
    return pack_codes(codes, fmt), scale, zero


def _quantize_values(x: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    D = x.shape[-1]
    fmt.check_head_dim(D)
    xf = x.float().unflatten(-1, (D // fmt.group_size, fmt.group_size))  # [..., T, groups, G]
    if fmt.is_float:
        scale = _scale_fp8(xf.abs().amax(dim=-1))
        codes = _encode_fp8(xf, scale.unsqueeze(-1)).flatten(-2)
        return codes, scale, None
    scale, zero = _params_int(xf.amin(dim=-1), xf.amax(dim=-1), fmt.qmax)
    codes = _encode_int(xf, scale.unsqueeze(-1), zero.unsqueeze(-1), fmt.qmax).flatten(-2)
    return pack_codes(codes, fmt), scale, zero


def _dequantize_keys(codes, scale, zero, fmt: QuantFormat, dtype) -> torch.Tensor:
    q = unpack_planes(codes, fmt).unflatten(-3, (scale.shape[-2], fmt.group_size))  # [..., groups, G, per, P]
    s, z = (None if t is None else t.unflatten(-1, q.shape[-2:]).unsqueeze(-3) for t in (scale, zero))
    return _decode(q, s, z, fmt).flatten(-2).flatten(-3, -2).to(dtype)


def _dequantize_values(codes, scale, zero, fmt: QuantFormat, dtype) -> torch.Tensor:
    q, G = unpack_planes(codes, fmt), fmt.group_size
    per, P = q.shape[-2:]
    if P % G == 0:  # whole groups in each plane: codes [..., T, per, P / G, G], params [..., T, per, P / G, 1]
        q, params = q.unflatten(-1, (P // G, G)), lambda t: t.unflatten(-1, (per, P // G)).unsqueeze(-1)
    elif G % P == 0:  # whole planes in each group: codes [..., T, groups, G / P, P], params [..., T, groups, 1, 1]
        q, params = q.unflatten(-2, (per * P // G, G // P)), lambda t: t[..., None, None]
    else:  # neither: channels in order, codes [..., T, groups, G], params [..., T, groups, 1]
        q, params = q.flatten(-2).unflatten(-1, (per * P // G, G)), lambda t: t.unsqueeze(-1)
    x = _decode(q, params(scale), None if zero is None else params(zero), fmt)
    return x.flatten(codes.dim() - 1).to(dtype)
