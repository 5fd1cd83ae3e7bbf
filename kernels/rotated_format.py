"""Rotated K/V formats (the TurboQuant class): a seeded orthogonal rotation, then Lloyd-Max codes per coordinate.

Why: after a random rotation no coordinate of a head vector is an outlier, and every coordinate of the rotated
unit vector follows one known distribution (density proportional to ``(1 - x**2) ** ((D - 3) / 2)`` on
[-1, 1] for head dim D), so a fixed codebook, optimal for that distribution, codes any vector with no
calibration and no per-group scales: one float16 norm per vector (Zandieh et al., TurboQuant, 2025).

Layout of one token's key (or value) of one head, head dim D (a multiple of 8):

- rotation: ``x_rot = x @ R`` with R orthogonal [D, D] from ``rotation(D, seed)``. D a power of two: the
  randomized Hadamard transform, ``R = diag(signs) @ H_D / sqrt(D)`` (signs from the seed). Other D (Phi's 80
  or 96): a Haar-random orthogonal matrix (QR of a seeded Gaussian matrix), which mixes all D coordinates;
  a block Hadamard would mix only within power-of-two blocks.
- codes: coordinate c of ``x_rot / |x|`` coded as the index of its nearest centroid of ``codebook(D, bits)``,
  packed as a little-endian bit stream (code c in bits ``c * bits .. (c + 1) * bits - 1`` of the token's
  ``D * bits / 8`` bytes), uint8 ``[..., T, D * bits // 8]``.
- norm: float16 ``[..., T, 1]``, ``|x| / |codebook[codes]|``: the decoded vector keeps x's norm
  (re-normalized after decoding; measured in BENCHMARKS.md against storing ``|x|``).
- decoding: ``x^ = (norm * codebook[codes]) @ R.T``. Attention stays in the rotated space: ``q . k =
  (q @ R) . (k @ R)``, and the weighted sum of rotated values is rotated back once.
- keys, centred (the layer's state, a ``KeyCenter`` made by ``make_state`` with ``CENTER_KEYS``, which the storage
  holds beside the format): a layer's keys share a large common
  part per head (the same channels are large in every token), which the rotation spreads over every coordinate
  and the norm then scales every code's error by. Each layer keeps one centre per KV head, ``mu`` [H, D], the
  mean key of the first keys it quantizes (a static storage: of the first it holds), and codes each later key
  as ``mu + code(k - mu)`` or as ``code(k)``, whichever of ``k - mu`` and ``k`` is shorter (the attention-sink
  token, far from the mean, keeps its plain code): the choice is the sign of the stored norm (``>= 0``: centred;
  negative: plain, ``-|norm|``), so it costs no byte. Decoding adds ``mu`` (``mu @ R`` in the rotated space)
  where the norm is not negative. The centre is set before the first key is coded and never changes, so every
  code keeps its meaning. Measured in
  BENCHMARKS.md ("Rotated formats with centred keys").

Bit widths 1 to 4 use Lloyd-Max codebooks (shipped for head dims 64, 128 and 256 in
``rotated_codebooks.json``, computed on first use for any other head dim, in float64 on a grid: no scipy);
8 bits is a uniform grid of 256 levels over +-6.5 standard deviations of a coordinate.

The functions here are the plain-torch twins (any device); ``rotated_pack.py`` has the Triton quantize kernel
and ``rotated_attention.py`` the decode attention.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch

from hf_kvplus.kernels.constants import Constants
from hf_kvplus.kernels.errors import ConfigError, ShapeError
from hf_kvplus.kernels.kv_format import KVFormat
from hf_kvplus.kernels.turning_center import TURN_BLOCK, PositionTables, RotaryBasis

__all__ = [
    "ROTATED_BITS",
    "TURN_BLOCK",
    "checked_key_scale",
    "KeyCenter",
    "RotatedFormat",
    "byte_table",
    "codebook",
    "coding_center",
    "dequantize_rotated",
    "haar_rotation",
    "lloyd_max",
    "pack_bits",
    "quantize_rotated",
    "rotation",
    "scaled_keys",
    "turning_key_center",
    "unpack_bits",
]

#: Bits per coordinate a rotated format takes for keys and for values.
ROTATED_BITS = (1, 2, 3, 4, 8)
#: Head dims whose Lloyd-Max codebooks ship in `rotated_codebooks.json`.
SHIPPED_HEAD_DIMS = (64, 128, 256)
#: Store |x| / |codebook[codes]| (the decoded vector keeps x's norm) rather than |x|: see BENCHMARKS.md. An
#: ablation switch of the twins (eval/compare_turboquant.py --no-renorm); the Triton kernel always re-normalizes.
RENORMALIZE = True
#: Whether `RotatedFormat.make_state` gives the layer's keys a centre (see the module doc). An ablation switch read
#: when a cache builds its layers (eval/rotated_ablations.py).
CENTER_KEYS = True
#: Tokens a rotated format's full-precision window hands over at a time (fewer for a window under 32: as many as it
#: holds). Its tokens are coded one by one, but a hand-over every step would cost each decode step two quantize calls
#: and the window's bookkeeping: 32 at a time costs what KIVI int4's groups do (the window holds `window` to
#: `window + 31` exact tokens). The codes do not change.
FLUSH_TOKENS = 32
#: Half-width of the uniform 8-bit grid, in standard deviations of a coordinate (1 / sqrt(D)).
UNIFORM_SIGMAS = 6.5
_TABLES = Path(__file__).with_name("rotated_codebooks.json")


class KeyCenter:
    """One layer's key centre, the layer's state of a rotated format (`RotatedFormat.make_state`), held by the storage
    beside its format: ``mu`` float32 [H, D] (and ``mu @ R`` as ``rotated``) per KV head, or None until the layer's
    first keys are quantized (`observe`). Shared by every storage that holds the layer's codes (one paged pool's
    caches and its prefix store), never changed once set, and kept across `reset` (any centre decodes the codes made
    with it).

    `turns` (a `turning_center.RotaryBasis`): a turning centre, ``mu`` the keys' pre-RoPE mean and the centre of the
    key at index i (a storage's buffer index) that mean turned to position ``origin + i`` (``at``); its codes are made
    and read with the tokens' indices, and attention adds ``e(origin + i) . (W q)`` (``basis``, ``query_weights``; the
    C++ operator reads ``block_basis`` and ``weights``). The basis tables are the basis's own
    (`RotaryBasis.tables`), one copy for every layer of a cache, not this centre's.

    `scale` (optional, float32 [H, D]): a per-channel key scale s, equal on the two channels of each RoPE pair (i and
    i + D/2), so that it commutes with RoPE; keys are coded as ``k * s`` (centre and codes in that space), attention
    reads the query as ``q / s`` (logits unchanged), and a dense read gives ``k^ / s``. Fitted per model so that a
    pair's share of the coding error follows how much the queries read it (``s**2 = rms(q) / rms(k)``:
    `evaluation/key_scale_fit.py`). None: no scale, no extra operation anywhere."""

    __slots__ = ("mu", "rotated", "in_planes", "turns", "origin", "weights", "rotated_weights", "scale", "_folded")

    def __init__(self, turns: RotaryBasis | None = None, origin: int = 0, scale: torch.Tensor | None = None):
        self.scale = None if scale is None else checked_key_scale(scale)
        #: The rotations with the scale folded in, per (plane order, device): what the twin and Triton paths multiply by.
        self._folded: dict = {}
        self.mu: torch.Tensor | None = None
        self.rotated: torch.Tensor | None = None
        #: ``rotated`` with its channels in plane order, per bit width (what a compiled twin adds to its planes).
        self.in_planes: dict[int, torch.Tensor] = {}
        self.turns, self.origin = turns, origin
        #: A turning centre's W [H, D, D] (``c(p) = e(p) @ W``) and ``W @ R``.
        self.weights: torch.Tensor | None = None
        self.rotated_weights: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the centre keeps (what a memory report counts as the layer's state, and a saved cache holds);
        not the shared basis tables (:attr:`tables`), which are derived."""
        kept = (self.mu, self.rotated, *self.in_planes.values(), self.weights, self.rotated_weights, self.scale)
        return tuple(t for t in kept if t is not None)

    def __getstate__(self) -> dict:
        """Without the folded rotations (derived from the scale); a centre saved before scales existed loads with
        none."""
        return {name: getattr(self, name) for name in self.__slots__ if name != "_folded"}

    def __setstate__(self, state: dict) -> None:
        for name in self.__slots__:
            setattr(self, name, state.get(name, {} if name in ("in_planes", "_folded") else None))
        self.origin = state.get("origin", 0)

    @property
    def tables(self) -> PositionTables:
        """A turning centre's position tables (its basis's, shared by the cache's layers)."""
        return self.turns.tables(self.origin)

    def observe(self, x: torch.Tensor, seed: int, positions: torch.Tensor | None = None) -> None:
        """Sets the centre, once, from the first keys quantized (x [B, H, T, D]: averaged over rows and tokens; a
        turning centre's turned back from their indices `positions` [T] first); a no-op after."""
        if self.mu is not None:
            return
        r = rotation(x.shape[-1], seed, x.device)
        if self.turns is None:
            mu = x.float().mean(dim=(0, 2))
            self._set(mu, mu @ r)
            return
        self.mu = self.turns.unturned(x, self._positions(positions, x) + self.origin).mean(dim=(0, 2))
        self.weights = self.turns.weights(self.mu)
        self.rotated_weights = self.weights @ r

    def at(self, positions: torch.Tensor, *, rotated: bool) -> torch.Tensor:
        """A turning centre at indices `positions` [T]: float32 [H, T, D] (`rotated`: in the rotated space)."""
        w = self.rotated_weights if rotated else self.weights
        return torch.einsum("td,hde->hte", self.turns.rows(positions + self.origin), w)

    def basis(self, count: int, device: torch.device) -> torch.Tensor:
        """float32 [D, count]: `PositionTables.basis` of this centre's basis and origin."""
        return self.tables.basis(count, device)

    def prepare(self, count: int, device: torch.device) -> None:
        """`PositionTables.prepare` of this centre's basis and origin (eagerly, where a storage prepares)."""
        self.tables.prepare(count, device)

    def block_basis(
        self, start: int, count: int, device: torch.device, size: int = TURN_BLOCK
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`PositionTables.block_basis` of this centre's basis and origin (what the C++ decode reads)."""
        return self.tables.block_basis(start, count, device, size)

    def query_weights(self, q: torch.Tensor, *, rotated: bool = False) -> torch.Tensor:
        """float32 [B, Hq, D]: ``W q`` of each query head (grouped onto its KV head), so that ``q . c(p)`` is its
        dot product with ``e(p)``; `rotated`: q in the rotated space (``W R`` then, the same products)."""
        B, Hq, D = q.shape
        w = self.rotated_weights if rotated else self.weights
        H = w.shape[0]
        return torch.einsum("bhgd,hed->bhge", q.float().view(B, H, Hq // H, D), w).reshape(B, Hq, D).contiguous()

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        """Keys x [B, H, T, D] as they are coded: ``x * s`` in float32 (x itself without a scale)."""
        return x if self.scale is None else x.float() * self._scale_on(x.device)[:, None, :]

    def unscaled(self, x: torch.Tensor) -> torch.Tensor:
        """Decoded keys [..., H, T, D] back in the model's space: ``x / s`` (x itself without a scale)."""
        return x if self.scale is None else x / self._scale_on(x.device)[:, None, :]

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """The query [B, Hq, D] as the scaled keys are read with: ``q / s`` per KV head's query heads, float32."""
        if self.scale is None:
            return q
        B, Hq, D = q.shape
        scale = self._scale_on(q.device)
        return (q.float().view(B, scale.shape[0], -1, D) / scale[None, :, None, :]).view(B, Hq, D)

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        """The scale on `device` (moved there once, eagerly: a loaded scale starts on the CPU)."""
        scale = self.scale
        if scale.device != device:
            scale = scale.to(device)
            if not torch.compiler.is_compiling():
                self.scale = scale
        return scale

    def folded(self, r: torch.Tensor, plane_bits: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(``diag(s) R``, ``diag(1 / s)`` R) per KV head, [H, D, D], for the rotation `r` (in the plane order of
        `plane_bits`): scaled keys' and the query's rotations in one product each. Kept per order and device (made
        eagerly; a traced step makes its own)."""
        key = (plane_bits, r.device)
        made = self._folded.get(key)
        if made is None:
            s = self._scale_on(r.device)[:, :, None]
            made = (s * r, r / s)
            if not torch.compiler.is_compiling():
                self._folded[key] = made
        return made

    def _positions(self, positions: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        if positions is None:
            raise ConfigError("a turning key centre codes and reads keys at their positions: none were given")
        if positions.shape != x.shape[-2:-1]:
            raise ShapeError(f"positions must be [{x.shape[-2]}] (one per token), got {tuple(positions.shape)}")
        return positions

    def _set(self, mu: torch.Tensor, rotated: torch.Tensor) -> None:
        self.mu, self.rotated = mu, rotated
        self.in_planes = {bits: in_plane_order(rotated, bits).contiguous() for bits in (1, 2, 3, 4)}

    @staticmethod
    def given(center: torch.Tensor | None, seed: int, *, rotated: bool = False) -> KeyCenter | None:
        """A centre of a given tensor [H, D], or [H, T, D] (one per token: a turning centre at the tokens coded)
        (`rotated`: in the rotated space), or None (the custom ops' argument)."""
        if center is None:
            return None
        made = KeyCenter()
        r = rotation(center.shape[-1], seed, center.device)
        made._set(*((center @ r.T, center) if rotated else (center, center @ r)))
        return made

    def __repr__(self) -> str:
        kind = "KeyCenter" if self.turns is None else "KeyCenter(turning)"
        kind += "" if self.scale is None else "[scaled]"
        return f"{kind}({'unset' if self.mu is None else tuple(self.mu.shape)})"


def checked_key_scale(scale) -> torch.Tensor:
    """A key scale (`KeyCenter`'s) as float32 [H, D], or a `ConfigError`/`ShapeError` naming what is wrong: a 2-d
    tensor of finite, positive numbers, the same on channels i and i + D/2 (a RoPE pair, which RoPE turns together:
    a scale that differs there would not commute with it)."""
    if not isinstance(scale, torch.Tensor) or scale.dim() != 2 or scale.shape[-1] % 2:
        shape = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ShapeError(f"a key scale must be a tensor [KV heads, head_dim] with an even head_dim, got {shape}")
    scale = scale.detach().float()
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bad.any():
        head, channel = (int(i) for i in bad.nonzero()[0])
        raise ConfigError(f"a key scale must be finite and positive: {int(bad.sum())} of its {scale.numel()} numbers "
                          f"are not (first: head {head}, channel {channel}: {float(scale[head, channel])})")
    half = scale.shape[-1] // 2
    apart = (scale[:, :half] != scale[:, half:]).nonzero()
    if apart.numel():
        head, channel = (int(i) for i in apart[0])
        raise ConfigError(f"a key scale must be the same on each RoPE pair's channels (i and i + {half}): head {head} "
                          f"has {float(scale[head, channel])} on channel {channel} and "
                          f"{float(scale[head, channel + half])} on {channel + half}")
    return scale


def turning_key_center(state) -> KeyCenter | None:
    """A layer's state where it is a key centre that turns with RoPE, set or not (any format's state: None else)."""
    return state if isinstance(state, KeyCenter) and state.turns is not None else None


@dataclass(frozen=True)
class RotatedFormat(KVFormat):
    """Key and value bit widths (1, 2, 3, 4 or 8 each) of a rotated format, and the rotation's seed.

    Shares the interface the storages use with `QuantFormat`: one "group" is one token (a norm per vector), so
    every token leaves the full-precision window on its own. A value: a layer's key centre is the layer's state
    (`make_state`, a `KeyCenter` the storage holds beside the format), given to the methods that code or read keys
    as ``state`` (the centre of the codes a call codes or reads: callers give it with the keys only).
    `inputs_rotated` (`with_rotated_inputs`): the vectors it quantizes, and attention's exact window, come rotated
    already (``x @ R``; a centre then subtracted as ``KeyCenter.rotated``, so it must be set), as a static
    storage's ring holds them: nothing is rotated at a decode step but the query and the output."""

    key_bits: int
    value_bits: int
    seed: int = 0
    inputs_rotated: bool = field(default=False, repr=False, compare=False)
    turns_keys: ClassVar[bool] = True

    def __post_init__(self):
        for side, bits in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if isinstance(bits, bool) or bits not in ROTATED_BITS:
                raise ConfigError(f"{side} must be one of {ROTATED_BITS} for a rotated format, got {bits!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")

    def prepare(self, key_dim: int, value_dim: int, device: torch.device) -> None:
        """Makes the rotations (every plane order) and codebooks of both sides on `device`, where shapes become
        fixed (a layer's first call): made later, at a decode step's first flush, they would be a host-to-device
        copy (a wait for the device) and, for a head dim that is not shipped, a Lloyd-Max run inside the step. On
        the CPU also the byte tables (`dispatch.prepare` builds the C++ operators there too)."""
        for dim, bits in ((key_dim, self.key_bits), (value_dim, self.value_bits)):
            rotation(dim, self.seed, device)
            codebook(dim, bits, device)
            if torch.device(device).type == "cpu":
                byte_table(dim, bits, device)

    def with_rotated_inputs(self) -> RotatedFormat:
        """This format taking rotated vectors."""
        return replace(self, inputs_rotated=True)

    def bits_of(self, side: str) -> int:
        return self.key_bits if side == "keys" else self.value_bits

    def code_dim(self, head_dim: int, side: str) -> int:
        """Bytes of one token's codes."""
        return head_dim * self.bits_of(side) // 8

    def channels(self, code_bytes: int, side: str) -> int:
        """The head dim of `code_bytes` bytes of codes per token."""
        return code_bytes * 8 // self.bits_of(side)

    def param_shape(self, side: str, tokens: int, head_dim: int) -> tuple[int, int]:
        """Shape of the float16 parameters of `tokens` tokens: one norm each."""
        return tokens, 1

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % 8:
            raise ConfigError(
                f"head_dim {head_dim} is not a multiple of 8: a rotated format packs 8 codes into whole bytes"
            )

    def bytes_per_token(self, head_dim: int) -> float:
        """Bytes at rest of one token's key and value of one head: codes plus two float16 norms."""
        return self.code_dim(head_dim, "keys") + self.code_dim(head_dim, "values") + 4

    def code_limit(self) -> tuple[float, bool]:
        """One float16 norm per vector: the limit bounds each vector's norm."""
        return super().code_limit()[0], True

    def quantize(self, x, side, positions=None, state=None):
        return (*quantize_rotated(x, self, side, positions, state), None)

    def dequantize(self, codes, scale, zero, side, dtype=torch.float32, *, positions=None, state=None):
        return dequantize_rotated(codes, scale, self, side, dtype, positions=positions, center=state)

    def attended(self, codes, scale, zero, side, *, per_token=False, planes=False, positions=None, state=None):
        """Left in the rotated space (attention rotates q in and the output back once); keys coded one token at a
        time are coded as keys (with the key bits) already."""
        return dequantize_rotated(codes, scale, self, side, rotated_space=True, planes=planes, positions=positions,
                                  center=state)  # fmt: skip

    def planes(self, side: str, head_dim: int) -> int:
        return planes_of(head_dim, self.bits_of(side))

    def indexed_keys(self, state) -> bool:
        return turning_key_center(state) is not None

    def flush_tokens(self, window: int, unit: int) -> int:
        return min(FLUSH_TOKENS, window)

    def ring_format(self) -> RotatedFormat:
        return self.with_rotated_inputs()

    def to_ring(
        self, keys: torch.Tensor, values: torch.Tensor, first: Callable[[], int], state: KeyCenter | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (``x @ R`` in the model's dtype: one rounding), so that a decode step rotates only the query and
        the output; the key centre (`state`), if not set yet, set from these keys as they were (at their indices)."""
        center, dtype = state, keys.dtype
        keys = scaled_keys(keys, self, center)  # (a ring holds keys rotated and scaled, as attention reads them)
        if center is not None and center.mu is None:
            start = first()
            center.observe(keys, self.seed, torch.arange(start, start + keys.shape[2], device=keys.device))
        r_k, r_v = (rotation(x.shape[-1], self.seed, x.device) for x in (keys, values))
        return rotated(keys, r_k).to(dtype), rotated(values, r_v).to(values.dtype)

    def from_ring(
        self, keys: torch.Tensor, values: torch.Tensor, state: KeyCenter | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of `to_ring` (the keys' scale, `state`'s, taken off)."""
        r_k, r_v = (rotation(x.shape[-1], self.seed, x.device) for x in (keys, values))
        k = keys.float() @ r_k.T
        k = k if state is None or state.scale is None else state.unscaled(k)
        return k.to(keys.dtype), (values.float() @ r_v.T).to(values.dtype)

    def prepare_indices(self, count: int, device, state: KeyCenter | None = None) -> None:
        center = turning_key_center(state)
        if center is not None:
            center.prepare(count, device)

    def state_tensors(self, state: KeyCenter | None) -> tuple[torch.Tensor, ...]:
        """The key centre's tensors (the centre, its rotated copies, a turning centre's W and W R)."""
        return () if state is None else state.tensors()

    def derived_tensors(self, state: KeyCenter | None = None) -> tuple[torch.Tensor, ...]:
        """A turning centre's basis tables (its `RotaryBasis`'s, shared by the cache's layers)."""
        center = turning_key_center(state)
        return () if center is None else center.turns.derived_tensors()

    def for_layer(self, index: int) -> RotatedFormat:
        """This format with the rotation seed of layer `index` (each layer rotates differently)."""
        return RotatedFormat(self.key_bits, self.value_bits, self.seed + index)

    def make_state(
        self, *, turns: RotaryBasis | None = None, origin: int = 0, key_scale: torch.Tensor | None = None
    ) -> KeyCenter | None:
        """A layer's key centre, unset (with `CENTER_KEYS` or a `key_scale`; else None): turning with `turns`, index 0
        at position `origin`; `key_scale` [H, D]: the keys' scale (`KeyCenter`)."""
        return KeyCenter(turns, origin, key_scale) if CENTER_KEYS or key_scale is not None else None

    def side_formats(self) -> tuple[RotatedFormat, RotatedFormat]:
        """(keys, values) as formats whose values-side functions code them: each side's bits on both sides (the
        keys' codes take the layer's state, given with them)."""
        return (RotatedFormat(self.key_bits, self.key_bits, self.seed),
                RotatedFormat(self.value_bits, self.value_bits, self.seed))  # fmt: skip

    def __str__(self) -> str:
        return f"k{self.key_bits}v{self.value_bits}"


# ---------------------------------------------------------------------------------------------------
# Rotations and codebooks (made once per head dim, seed and device, eagerly)
# ---------------------------------------------------------------------------------------------------

_ROTATIONS: Constants[dict[int, torch.Tensor]] = Constants()  # by (head_dim, seed, device): R in each plane order
_CODEBOOKS: Constants[tuple[torch.Tensor, torch.Tensor]] = Constants()


def rotation(
    head_dim: int, seed: int, device: torch.device | str = "cpu", *, plane_bits: int | None = None
) -> torch.Tensor:
    """The orthogonal float32 [D, D] matrix R of (head_dim, seed): ``x_rot = x @ R`` (see the module doc); with
    `plane_bits`, its columns in the plane order of codes of that width (:func:`plane_order`: it takes vectors
    straight into the order :func:`decoded_planes` decodes in). Every order is made with R, eagerly, so that a
    compiled graph reads them as they are."""
    device = torch.device(device)
    k = 1 if plane_bits is None else planes_of(head_dim, plane_bits)

    def make() -> dict[int, torch.Tensor]:
        base = _make_rotation(head_dim, seed).to(device, non_blocking=True)
        return {1: base, **{planes_of(head_dim, bits): in_plane_order(base, bits).contiguous() for bits in (1, 2, 3, 4)}}

    return _ROTATIONS.get((head_dim, seed, device), make)[k]


def rotated(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x.float() @ r``. In a graph compiled off CUDA, for a decode step's few vectors (the new token that the static
    quantized storage's ring takes rotated; the sinks an evicting cache reads back in `dequantize_rotated`, and,
    where the C++ operators are not built, what it codes in `quantize_rotated`), as a product and a sum, which
    inductor fuses into the kernels around them: a matrix product is an external call there, whose dispatch costs
    more than the arithmetic of a head's rotation (a sink on k4v2 slots from 1.32-1.33x to 1.21-1.25x of StaticCache at 1K, paired runs).
    The twin attention's rotations of the queries and of the output stay matrix products: done this way as well, a
    sink on k4v2 slots went from 1.47x to 1.59-1.62x; the CPU operator rotates them inside."""
    x = x.float()
    if torch.compiler.is_compiling() and not x.is_cuda and x.numel() <= _FUSED_ROTATION_ELEMENTS:
        return (x.unsqueeze(-1) * r).sum(-2)
    return x @ r


#: Up to this many elements (rows x head_dim) a compiled CPU graph rotates by `rotated`'s product and sum.
_FUSED_ROTATION_ELEMENTS = 1 << 14


def _make_rotation(d: int, seed: int) -> torch.Tensor:
    """On the CPU (the caller moves it), whatever torch's default device: the generator is a CPU one."""
    if d & (d - 1) == 0:
        generator = torch.Generator().manual_seed(0x5EED0000 + seed)
        h = torch.ones(1, 1, dtype=torch.float64, device="cpu")
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (d,), generator=generator, device="cpu").to(torch.float64) * 2 - 1
        return (signs[:, None] * h / math.sqrt(d)).float()
    return haar_rotation(d, seed)


def haar_rotation(d: int, seed: int) -> torch.Tensor:
    """A Haar-random orthogonal float32 [d, d] of `seed` (QR of a seeded Gaussian matrix), on the CPU: the rotation of
    head dims that are not powers of two (an ablation's alternative for the others)."""
    generator = torch.Generator().manual_seed(0x5EED0000 + seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64, device="cpu"))
    return (q * torch.sign(torch.diagonal(r))).float()  # signs fixed: Haar-distributed


def codebook(head_dim: int, bits: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids float32 [2**bits], decision boundaries float32 [2**bits - 1]) for coordinates of a rotated unit
    vector of `head_dim` dims: shipped, or computed on first use (Lloyd-Max; 8 bits: a uniform grid)."""
    device = torch.device(device)

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        values = _centroids(head_dim, bits)
        if bits <= 4:  # what a compiled decode reads as constants
            _ODD_POLYNOMIALS.setdefault((head_dim, bits), _interpolated(values))
        centroids = torch.tensor(values, dtype=torch.float64, device="cpu")
        return tuple(t.float().to(device, non_blocking=True) for t in (centroids, (centroids[1:] + centroids[:-1]) / 2))

    return _CODEBOOKS.get((head_dim, bits, device), make)


def _centroids(head_dim: int, bits: int) -> list[float]:
    if bits == 8:
        half = UNIFORM_SIGMAS / math.sqrt(head_dim)
        return torch.linspace(-half, half, 256, dtype=torch.float64).tolist()
    if head_dim in SHIPPED_HEAD_DIMS:
        return _shipped()[str(head_dim)][str(bits)]
    return lloyd_max(head_dim, bits)


_SHIPPED: dict | None = None


def _shipped() -> dict:
    global _SHIPPED
    if _SHIPPED is None:
        _SHIPPED = json.loads(_TABLES.read_text())["centroids"]
    return _SHIPPED


def lloyd_max(head_dim: int, bits: int, *, grid: int = 200_001, iterations: int = 300) -> list[float]:
    """Lloyd-Max centroids (ascending) of `bits` bits for one coordinate of a uniformly random unit vector in
    R^head_dim, on a float64 grid over [-1, 1]: the density is ``(1 - x**2) ** ((D - 3) / 2)``."""
    if head_dim < 3:
        raise ConfigError(f"a rotated format needs head_dim >= 3, got {head_dim}")
    x = torch.linspace(-1, 1, grid, dtype=torch.float64)
    w = (1 - x * x).clamp_min(0) ** ((head_dim - 3) / 2)
    w = w / w.sum()
    cdf = torch.cumsum(w, 0)
    levels = 2**bits
    # Start from the quantiles; each step puts boundaries at midpoints and centroids at the cells' means. A cell's
    # mass and first moment are differences of prefix sums at its ends (not a pass over the grid: 20x faster).
    centroids = x[torch.searchsorted(cdf, (torch.arange(levels, dtype=torch.float64) + 0.5) / levels)]
    zero = torch.zeros(1, dtype=torch.float64)
    mass_below, moment_below = torch.cat([zero, cdf]), torch.cat([zero, torch.cumsum(w * x, 0)])
    first, last = torch.tensor([0]), torch.tensor([grid])
    for _ in range(iterations):
        # cell j holds the grid points in (boundary j-1, boundary j]
        ends = torch.cat([first, torch.searchsorted(x, (centroids[1:] + centroids[:-1]) / 2, right=True), last])
        mass = mass_below[ends[1:]] - mass_below[ends[:-1]]
        moment = moment_below[ends[1:]] - moment_below[ends[:-1]]
        centroids = torch.where(mass > 0, moment / mass.clamp_min(1e-300), centroids)
    return ((centroids - centroids.flip(0)) / 2).tolist()  # the density is even: so is the codebook


# ---------------------------------------------------------------------------------------------------
# Bit streams
# ---------------------------------------------------------------------------------------------------


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., D]`` (each < 2**bits, D a multiple of 8) to the bit stream uint8 ``[..., D * bits // 8]``:
    each run of 8 codes makes one word of ``8 * bits`` bits, stored as `bits` little-endian bytes."""
    if bits == 8:
        return codes.to(torch.uint8)
    groups = codes.to(torch.int64).unflatten(-1, (-1, 8))  # [..., D / 8, 8]
    word = (groups << _offsets(8, bits, codes.device)).sum(-1)  # disjoint bits: the sum is an or
    return ((word[..., None] >> _offsets(bits, 8, codes.device)) & 255).to(torch.uint8).flatten(-2)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: int64 codes ``[..., P * 8 // bits]``."""
    if bits == 8:
        return packed.to(torch.int64)
    word = (packed.to(torch.int64).unflatten(-1, (-1, bits)) << _offsets(bits, 8, packed.device)).sum(-1)
    return ((word[..., None] >> _offsets(8, bits, packed.device)) & (2**bits - 1)).flatten(-2)


_OFFSETS: Constants[torch.Tensor] = Constants()


def _offsets(count: int, step: int, device: torch.device) -> torch.Tensor:
    """int64 ``[0, step, 2 * step, ...]`` of `count` entries, made once per device."""
    return _OFFSETS.get(
        (count, step, device), lambda: torch.arange(0, count * step, step, dtype=torch.int64, device=device)
    )


# ---------------------------------------------------------------------------------------------------
# Quantize and dequantize (twins)
# ---------------------------------------------------------------------------------------------------


def quantize_rotated(
    x: torch.Tensor, fmt: RotatedFormat, side: str, positions: torch.Tensor | None = None,
    center: KeyCenter | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Head vectors ``[..., T, D]`` to (codes uint8 ``[..., T, D * bits // 8]``, norms float16 ``[..., T, 1]``); with
    a `center` (a layer's key centre; x then [B, H, T, D]): relative to it where that is shorter, the norm negative
    where not (a turning centre: at the tokens' `positions` [T])."""
    D = x.shape[-1]
    fmt.check_head_dim(D)
    bits = fmt.bits_of(side)
    centroids, boundaries = codebook(D, bits, x.device)
    x = scaled_keys(x, fmt, center)
    xf, norm, sign = centered(x, fmt, positions, center)
    unit = (xf if fmt.inputs_rotated else rotated(xf, rotation(D, fmt.seed, x.device))) / norm.clamp_min(1e-30)
    codes = _bucketized(unit, boundaries)
    if RENORMALIZE:
        norm = norm / torch.linalg.vector_norm(centroids[codes], dim=-1, keepdim=True).clamp_min(1e-30)
    return pack_bits(codes, bits), signed_norms(norm.to(torch.float16), sign)


def scaled_keys(x: torch.Tensor, fmt: RotatedFormat, center: KeyCenter | None) -> torch.Tensor:
    """Keys as a rotated format codes them: times the layer's key scale (`KeyCenter.scale`) where it has one and the
    keys do not come rotated (a ring's rotated keys were scaled as they went in: `RotatedFormat.to_ring`)."""
    if center is None or center.scale is None or fmt.inputs_rotated:
        return x
    return center.scaled(x)


def _bucketized(x: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """``torch.bucketize(x, boundaries)``: compiled, as the count of boundaries below each value, which inductor
    fuses into the kernel that makes `x` (bucketize is a call of its own in the graph)."""
    if torch.compiler.is_compiling():
        return (x[..., None] > boundaries).sum(-1)
    return torch.bucketize(x, boundaries)


#: The smallest float16 (a subnormal): a plain key's norm is at least this before it turns negative, so that a
#: zero key's code still reads as plain.
PLAIN_NORM = 2.0**-24


def signed_norms(norm: torch.Tensor, sign: torch.Tensor | None) -> torch.Tensor:
    """float16 norms with each plain code's (sign < 0) made negative: ``-max(norm, PLAIN_NORM)``."""
    if sign is None:
        return norm
    return torch.where(sign < 0, -norm.clamp_min(PLAIN_NORM), norm)


def centered(
    x: torch.Tensor, fmt: RotatedFormat, positions: torch.Tensor | None = None, center: KeyCenter | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(what the codes code, float32; its length [..., T, 1]; the sign of each token's norm: +1 relative to the
    centre, -1 plain, or None without a `center`); the centre is :func:`coding_center`'s."""
    mu = coding_center(x, fmt, positions, center)
    xf = x.float()
    if mu is None:
        return xf, torch.linalg.vector_norm(xf, dim=-1, keepdim=True), None
    shifted = xf - (mu if mu.dim() == 3 else mu[:, None, :])
    shifted_length = torch.linalg.vector_norm(shifted, dim=-1, keepdim=True)
    length = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    shorter = shifted_length <= length
    return (torch.where(shorter, shifted, xf), torch.where(shorter, shifted_length, length),
            torch.where(shorter, 1.0, -1.0))  # fmt: skip


def coding_center(
    x: torch.Tensor, fmt: RotatedFormat, positions: torch.Tensor | None = None, center: KeyCenter | None = None
) -> torch.Tensor | None:
    """The centre [H, D] that codes of x are relative to, in x's space (a turning centre: [H, T, D], at the tokens'
    `positions` [T]), or None without a `center`. The first call with an unset `center` sets it from its keys (x [B,
    H, T, D]); rotated inputs (`RotatedFormat.inputs_rotated`) take the set centre, rotated."""
    if center is None:
        return None
    if x.dim() != 4:
        raise ShapeError(f"centred codes take [B, H, T, D] vectors, got shape {tuple(x.shape)}")
    if fmt.inputs_rotated and center.mu is None:
        raise ConfigError("rotated keys are coded relative to a centre set from the keys as they were; none is set")
    if center.turns is not None:
        positions = center._positions(positions, x)
        center.observe(x, fmt.seed, positions)
        return center.at(positions, rotated=fmt.inputs_rotated)
    if fmt.inputs_rotated:
        return center.rotated
    center.observe(x, fmt.seed)
    return center.mu


def decoded_units(codes: torch.Tensor, head_dim: int, bits: int) -> torch.Tensor:
    """The codebook values of packed codes ``[..., P]``: float32 ``[..., D]``, one table lookup per byte (3 bits:
    per 12 bits), which on a CPU costs a fraction of unpacking every code and looking it up."""
    if bits == 3:  # 8 codes in 3 bytes: a 24-bit word, two 12-bit halves of 4 codes each
        b = codes.int().unflatten(-1, (-1, 3))
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        index = torch.stack([word & 4095, word >> 12], dim=-1)
    else:
        index = codes.int()
    table = byte_table(head_dim, bits, codes.device)  # index_select: a third of advanced indexing's time on a CPU
    looked_up = table.index_select(0, index.reshape(-1)).view(*index.shape, table.shape[1])
    return looked_up.flatten(-3 if bits == 3 else -2)


def planes_of(head_dim: int, bits: int) -> int:
    """How many planes a decode in plane order splits a vector into: the codes of one byte (3 bits: of one 12-bit
    half of a 24-bit word), so plane e holds channels ``p * planes + e``; 1 (channels in order) where a plane would
    be shorter than 8 channels: measured on the CPU, that was slower in plane order."""
    k = 4 if bits == 3 else 8 // bits
    return k if head_dim // k >= 8 else 1


def in_plane_order(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Vectors ``[..., D]`` with their channels in plane order (:func:`plane_order`), as a reshape of a transposed
    view (which inductor folds into the kernel that reads it)."""
    D = x.shape[-1]
    k = planes_of(D, bits)
    return x if k == 1 else x.unflatten(-1, (D // k, k)).transpose(-1, -2).flatten(-2)


def from_plane_order(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`in_plane_order`: vectors in plane order back in channel order."""
    D = x.shape[-1]
    k = planes_of(D, bits)
    return x if k == 1 else x.unflatten(-1, (k, D // k)).transpose(-1, -2).flatten(-2)


def plane_order(head_dim: int, bits: int, device: torch.device) -> torch.Tensor:
    """int64 [D]: the channels in plane order (``x[..., plane_order]`` is ``x`` as :func:`decoded_planes` lays it
    out)."""
    k = planes_of(head_dim, bits)
    return torch.arange(head_dim, device=device).view(head_dim // k, k).t().reshape(-1)


def decoded_planes(codes: torch.Tensor, head_dim: int, bits: int) -> torch.Tensor:
    """The codebook values of packed codes ``[..., P]`` as float32 ``[..., planes, n]``, plane e holding channels
    ``p * planes + e`` (:func:`planes_of`). Compiled, one pointwise expression over that shape: each plane a loop
    over the bytes (3 bits: the 12-bit halves of each 24-bit word) in order (:func:`decoded_units`' channels in
    order made inductor index the bytes by ``channel // planes`` and the table by ``channel % planes``, one
    element at a time), and each code's value the codebook's interpolating polynomial (:func:`odd_polynomial`):
    a table gather inductor runs element by element, and a tree of selects on the code's bits kept every centroid
    live, which at 32-lane tiles spilled registers (head dim 128: the key kernel 650 us a layer, measured)."""
    k = planes_of(head_dim, bits)
    if bits == 3:  # 8 codes in 3 bytes: halves of 12 bits, 4 codes each, in stream order
        b = codes.int().unflatten(-1, (-1, 3))
        b0, b1, b2 = b.unbind(-1)
        units = torch.stack([b0 | ((b1 & 15) << 8), (b1 >> 4) | (b2 << 4)], dim=-1).flatten(-2)
    else:
        units = codes.int()
    shifts = torch.arange(0, k * bits, bits, dtype=torch.int32, device=codes.device).view(k, 1)
    t = (((units.unsqueeze(-2) >> shifts) & (2**bits - 1)) * 2 - (2**bits - 1)).float()
    coefficients = odd_polynomial(head_dim, bits)
    u, p = t * t, coefficients[-1]
    for a in reversed(coefficients[:-1]):  # Horner's rule in u = t**2
        p = u * p + a
    return t * p


_ODD_POLYNOMIALS: dict[tuple[int, int], tuple[float, ...]] = {}


def odd_polynomial(head_dim: int, bits: int) -> tuple[float, ...]:
    """Coefficients ``a_i`` (lowest first) of the polynomial that gives code j's centroid as ``t * sum_i a_i *
    (t * t) ** i`` with ``t = 2 j - (2**bits - 1)``: a codebook is odd (centroid j is minus centroid
    ``2**bits - 1 - j``), so its ``2**(bits - 1)`` magnitudes fix one of that degree (Newton's divided differences in
    float64, in plain Python: traceable, so a graph can make them; evaluated in float32, every centroid within 2e-7
    of the largest, tested). Decoding by it costs a multiply and an add per coefficient, no select and no table."""
    key = (head_dim, bits)
    coefficients = _ODD_POLYNOMIALS.get(key)
    if coefficients is None:
        coefficients = _ODD_POLYNOMIALS[key] = _interpolated(_centroids(head_dim, bits))
    return coefficients


def _interpolated(centroids: list[float]) -> tuple[float, ...]:
    """:func:`odd_polynomial`'s coefficients from an odd codebook's centroids."""
    n = len(centroids)
    half = n // 2
    ts = [2 * j - (n - 1) for j in range(half, n)]
    us = [float(t * t) for t in ts]
    newton = [centroids[half + i] / t for i, t in enumerate(ts)]
    for level in range(1, half):
        for i in range(half - 1, level - 1, -1):
            newton[i] = (newton[i] - newton[i - 1]) / (us[i] - us[i - level])
    poly = [0.0] * half
    for i in reversed(range(half)):  # poly = poly * (u - us[i]) + newton[i]
        poly = [(poly[j - 1] if j else 0.0) - us[i] * poly[j] for j in range(half)]
        poly[0] += newton[i]
    return tuple(poly)


_BYTE_TABLES: Constants[torch.Tensor] = Constants()


def byte_table(head_dim: int, bits: int, device: torch.device) -> torch.Tensor:
    """float32 ``[2**width, width // bits]``: the codebook values of every `width`-bit chunk of the stream (8 bits;
    12 for 3-bit codes), in stream order."""

    def make() -> torch.Tensor:
        width = 12 if bits == 3 else 8
        centroids, _ = codebook(head_dim, bits, device)
        chunks = torch.arange(2**width, device=device)[:, None]
        return centroids[(chunks >> _offsets(width // bits, bits, device)) & (2**bits - 1)]

    return _BYTE_TABLES.get((head_dim, bits, device), make)


def dequantize_rotated(
    codes: torch.Tensor, norms: torch.Tensor, fmt: RotatedFormat, side: str, dtype=torch.float32, *,
    rotated_space: bool = False, planes: bool = False, positions: torch.Tensor | None = None,
    center: KeyCenter | None = None,
) -> torch.Tensor:  # fmt: skip
    """Inverse of :func:`quantize_rotated`: ``[..., T, D]`` in `dtype`; with `rotated_space`, left rotated
    (``x^ @ R``: what attention in the rotated space reads); with `planes` too, its channels in plane order
    (:func:`plane_order`). `center`: the centre the codes are relative to (a layer's key centre), or None; a turning
    centre's codes are read at the tokens' `positions` [T]."""
    bits = fmt.bits_of(side)
    D = codes.shape[-1] * 8 // bits
    if codes.shape[-1] * 8 % bits:
        raise ShapeError(f"{codes.shape[-1]} bytes per token do not hold whole {bits}-bit codes")
    norms = norms.float()
    centred = center is not None and center.mu is not None
    k = planes_of(D, bits) if planes and rotated_space else 1
    turning = None
    if centred and center.turns is not None:  # [H, T, D], in the space (and plane order) decoded into
        turning = center.at(center._positions(positions, codes), rotated=rotated_space)
        turning = in_plane_order(turning, bits) if k > 1 else turning
    if k > 1:  # decoded, scaled and centred in [..., planes, P]; flattened last
        x = decoded_planes(codes, D, bits) * (norms.abs() if centred else norms)[..., None]
        if centred:
            mu = center.in_planes[bits].view(-1, 1, k, D // k) if turning is None else turning.unflatten(-1, (k, -1))
            x = x + (norms >= 0).float()[..., None] * mu
        return x.to(dtype).flatten(-2)
    x = decoded_units(codes, D, bits) * (norms.abs() if centred else norms)
    if not rotated_space:
        x = rotated(x, rotation(D, fmt.seed, codes.device).T)
    if centred:  # one pass: the centre added where the norm is not negative
        mu = (center.rotated if rotated_space else center.mu)[:, None, :] if turning is None else turning
        x = x.addcmul_((norms >= 0).float(), mu)
    if center is not None and center.scale is not None and not rotated_space:  # (attention reads q / s instead)
        x = center.unscaled(x)
    return x.to(dtype)
