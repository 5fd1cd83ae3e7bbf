"""The protocol of a KV format, and the registry of formats by name.

Why: every quantized storage holds its codes in one layout (`quant_format.PackedKV`: codes, scales and optional zero
points of `[rows, kv_heads, tokens, ...]`) and reaches them through the methods here, so that a storage, a report or
an attention path never asks which format it holds. A new format is one subclass of :class:`KVFormat` (its shapes,
bytes, quantize and dequantize) registered under a name with :func:`register_format`; `bits="<name>"` and the spec
string `quantized:<name>` then reach it. Its decode runs the plain-torch twin (`quant_attention`) on every device,
traced inline by torch.compile, unless kernels are registered for its class (`format_kernels.register_kernels`).

Sides: "keys" (per channel in groups of `group_size` tokens, or however the format codes keys) and "values" (one
token at a time). An evicting cache's slots code keys one token at a time too: with `side_formats()[0]`'s values
side, and attention reads them with :meth:`KVFormat.attended` ``per_token=True``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_kvplus.kernels.errors import ConfigError

__all__ = [
    "KVFormat", "kernels_for", "register_format", "register_kernels", "registered_format", "registered_formats",
    "state_kw",
]  # fmt: skip


class KVFormat:
    """One KV format: code and parameter shapes, bytes per token, quantize and dequantize, and what its decode needs
    prepared. Subclasses are immutable values (equal formats code alike); what a layer learns while it codes (a key
    centre) is the layer's state, made by :meth:`make_state`, held by the storage beside the format and given to the
    methods that read it (``state``: given only when not None, so a format without state need not take it); memory
    reports count :meth:`state_tensors`.
    """

    #: Tokens per key group: what a token leaves a full-precision window with, and the tokens of one row of key
    #: parameters (1: each token on its own).
    group_size: int = 1
    #: Whether codes come with a float16 zero point per group beside the scale (`PackedKV.k_zero`/`v_zero`).
    has_zero: bool = False
    #: Whether :meth:`make_state` takes a rotary basis (``turns=``, ``origin=``) for a key centre that turns with RoPE.
    turns_keys: bool = False

    # ------------------------------------------------------------------ shapes and bytes
    def code_dim(self, head_dim: int, side: str) -> int:
        """uint8 bytes of one token's codes of one head."""
        raise NotImplementedError

    def channels(self, code_bytes: int, side: str) -> int:
        """The head dim of `code_bytes` bytes of codes per token (the inverse of :meth:`code_dim`)."""
        raise NotImplementedError

    def param_shape(self, side: str, tokens: int, head_dim: int) -> tuple[int, int]:
        """Shape of the float16 scales (and zeros) of `tokens` tokens of one head."""
        raise NotImplementedError

    def check_head_dim(self, head_dim: int) -> None:
        """Raises `ConfigError` naming the numbers when the format cannot code vectors of `head_dim`."""

    def bytes_per_token(self, head_dim: int) -> float:
        """Bytes at rest of one token's key and value of one head: codes plus amortized parameters."""
        raise NotImplementedError

    def code_limit(self) -> tuple[float, bool]:
        """The largest magnitude the codes hold, and whether it bounds each vector's norm rather than each element
        (what a storage's range guard refuses beyond)."""
        return 65000.0, False

    # ------------------------------------------------------------------ coding
    def quantize(
        self, x: torch.Tensor, side: str, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Vectors ``[..., T, D]`` to (uint8 codes, float16 scales, float16 zeros or None) of `side` (`positions`: the
        tokens' buffer indices, for a format whose codes depend on them). A format with a layer's state takes it as
        ``state=`` (the state of the codes coded: the keys')."""
        raise NotImplementedError

    def dequantize(self, codes, scale, zero, side: str, dtype=torch.float32, *, positions=None) -> torch.Tensor:
        """The inverse of :meth:`quantize`: ``[..., T, D]`` in `dtype` (``state=`` as there)."""
        raise NotImplementedError

    def attended(self, codes, scale, zero, side: str, *, per_token: bool = False, planes: bool = False,
                 positions=None, **state) -> torch.Tensor:  # fmt: skip
        """float32 ``[..., T, D]`` as the twin attention reads a side: keys coded one token at a time with
        `per_token` (an evicting cache's slots); `planes`: traced off CUDA, in the channel order of
        :meth:`planes` (a permutation shared by q, keys, values and the output); ``state=``: as :meth:`dequantize`."""
        side = "values" if per_token and side == "keys" else side
        return self.dequantize(codes, scale, zero, side, torch.float32, positions=positions, **state)

    def planes(self, side: str, head_dim: int) -> int:
        """Planes of a side's channels as :meth:`attended` with `planes` lays them out (1: channels in order)."""
        return 1

    def indexed_keys(self, state) -> bool:
        """Whether a key's codes depend on its buffer index under the layer's `state` (a key centre that turns with
        RoPE): a storage then codes and reads keys at their indices and never moves a code to another index."""
        return False

    def key_positions(self, first, count: int, device, state=None) -> torch.Tensor | None:
        """Buffer indices ``first .. first + count - 1`` (`first` an int or a 0-d tensor: no sync) where the keys'
        codes depend on them (:meth:`indexed_keys`), else None (nothing made on a decode step)."""
        return first + torch.arange(count, device=device) if self.indexed_keys(state) else None

    # ------------------------------------------------------------------ per layer
    def for_layer(self, index: int) -> KVFormat:
        """The format of layer `index` (a value: e.g. a rotation seed of its own); the same format by default."""
        return self

    def make_state(self, **context):
        """A layer's state, fresh (`context`: what it is made from, e.g. a rotary basis, ``turns=``/``origin=``
        where :attr:`turns_keys`), which the storage holds beside the format; None (no state) by default."""
        return None

    def side_formats(self) -> tuple[KVFormat, KVFormat]:
        """(keys, values) as formats whose values side codes them one token at a time (an evicting cache's slots;
        the keys' codes take the layer's state)."""
        return self, self

    def holds_state(self, state) -> bool:
        """Whether a layer's `state` is one (a key centre, one per KV head): its codes then cannot be coded or read
        regrouped across heads or sides."""
        return state is not None

    def state_tensors(self, state) -> tuple[torch.Tensor, ...]:
        """The tensors of a layer's `state` (counted in memory reports; none by default)."""
        return ()

    def derived_tensors(self, state=None) -> tuple[torch.Tensor, ...]:
        """Tables the format's decode reads that are derived from the model alone (a turning key centre's position
        tables, shared by every layer of a cache): made again after a load, so neither saved nor bytes at rest; a
        report counts them once per cache, apart (`quantized_report()["derived_bytes"]`). None by default."""
        return ()

    def prepare_indices(self, count: int, device, state=None) -> None:
        """Makes and keeps, eagerly, what a decode over buffer indices ``0 .. count - 1`` reads of the layer's `state`
        (a turning key centre's basis): a static storage reads every index at every step."""

    def prepare(self, key_dim: int, value_dim: int, device) -> None:
        """Makes on `device`, where shapes become fixed (a layer's first call), the tables its coding and decode read,
        so that no decode step and no graph compiled later makes them."""

    # ------------------------------------------------------------------ the full-precision window
    def flush_tokens(self, window: int, unit: int) -> int:
        """Tokens a full-precision window of `window` tokens hands over at a time, a multiple of `unit`."""
        return unit

    def ring_format(self) -> KVFormat:
        """The format that codes what :meth:`to_ring` made (a static storage codes its ring's tokens)."""
        return self

    def to_ring(
        self, keys: torch.Tensor, values: torch.Tensor, first: Callable[[], int], state=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as a static storage's full-precision ring holds them, and attention reads them as the
        residual; as they are by default. `first()` is the buffer index of the first token, asked only by a format that
        needs it (a compiled step that read the storage's count would be specialized on it, and compiled again);
        `state`: the layer's (a key centre set from these keys if not yet)."""
        return keys, values

    def from_ring(self, keys: torch.Tensor, values: torch.Tensor, state=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of :meth:`to_ring` (`state`: the layer's, as given to it)."""
        return keys, values


def state_kw(state) -> dict:
    """``{"state": state}``, or nothing for None: a format without a layer's state need not take the keyword."""
    return {} if state is None else {"state": state}


#: Registered formats by name: a maker of the format from `group_size` (None: its default) and the head dims it must
#: code.
_NAMED: dict[str, Callable[..., KVFormat]] = {}


def register_format(name: str, make: Callable[..., KVFormat]) -> None:
    """Registers `make(group_size, head_dims) -> KVFormat` under `name` (lower case, what `bits=` and the spec
    strings name it by); registering a name again replaces it (a module reloaded)."""
    if not isinstance(name, str) or not name.strip() or name != name.strip().lower():
        raise ConfigError(f"a format's name is a non-empty lower-case string without spaces around, got {name!r}")
    if not callable(make):
        raise ConfigError(f"format {name!r}: make must be callable (group_size, head_dims) -> KVFormat, got {make!r}")
    _NAMED[name] = make


def registered_format(name: str) -> Callable[..., KVFormat] | None:
    """The maker registered under `name`, or None."""
    return _NAMED.get(name)


def registered_formats() -> tuple[str, ...]:
    """The registered names, in order of registration."""
    return tuple(_NAMED)


#: The kernels of each format class (`format_kernels.FormatKernels`), found along the class's MRO and cached by class.
_KERNELS: dict[type, object] = {}
_FOUND: dict[type, object] = {}


def register_kernels(cls: type, kernels) -> None:
    """Registers `kernels` (a `format_kernels.FormatKernels`) for format class `cls` and its subclasses."""
    if not (isinstance(cls, type) and issubclass(cls, KVFormat)):
        raise ConfigError(f"kernels are registered for a KVFormat subclass, got {cls!r}")
    _KERNELS[cls] = kernels
    _FOUND.clear()


def kernels_for(fmt: KVFormat):
    """The kernels registered for `fmt`'s class or the nearest base (`KVFormat`'s: the plain-torch twins)."""
    kernels = _FOUND.get(type(fmt))
    if kernels is None:
        if not isinstance(fmt, KVFormat):
            raise ConfigError(f"fmt must be a KVFormat (a QuantFormat, a RotatedFormat, ...), got {type(fmt).__name__}")
        found = next((_KERNELS[c] for c in type(fmt).__mro__ if c in _KERNELS), None)
        if found is None:  # (kernels/dispatch.py registers the built-in ones: `builtin_kernels`)
            raise ConfigError(f"no kernels are registered for {type(fmt).__name__} or a base: import "
                              "hf_kvplus.kernels.dispatch first, or register_kernels() for it")
        kernels = _FOUND[type(fmt)] = found
    return kernels
