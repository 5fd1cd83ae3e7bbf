"""What quantized codes can hold: finite values within the range of their float16 scales, zero points and norms.

Integer codes keep a float16 zero point at or below each group's minimum, so they hold magnitudes up to about
65000; fp8 codes keep a float16 scale of at least amax / 448 (about 2.9e7); rotated codes keep one float16 norm per
vector (norms up to about 65000). optimum-quanto's codes (`backend="quanto"`) keep float32 scales and hold any finite
value. Beyond that, or for NaN and inf, a whole group's (or, for a rotated key's centre, every) token's codes would
decode to inf or NaN.

So a prompt (a forward of more than one token: the host waits at its end anyway) is checked before a quantized layer
stores it, with one read back per layer, and refused with `OutOfRangeError` naming the numbers. A decode step is not
checked (that would be a read back per token): a value that a decode step gave and that leaves the window is coded
as 0 instead (`RangeGuard`), so it never spoils the codes of the other tokens of its group, and counted on the
device; the next prompt or `quantized_report()` raises `OutOfRangeError` for it. Evicting caches' quantized slots
(`SlotStore`) code a decode step's token as it comes, through the same guard.
"""

from __future__ import annotations

import math

import torch

from ..errors import OutOfRangeError
from ..static_address import mark_static


def code_limit(fmt, float32_scales: bool = False) -> tuple[float, bool]:
    """The largest magnitude `fmt` codes hold, and whether it bounds each vector's norm rather than each element
    (`KVFormat.code_limit`; float32 scales hold any finite value)."""
    return (math.inf, False) if float32_scales else fmt.code_limit()


def _sizes(x: torch.Tensor, by_norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element (or per vector) magnitudes, non-finite entries as 0, and which entries are finite."""
    finite = torch.isfinite(x)
    if by_norm:
        finite = finite.all(dim=-1)
        return torch.linalg.vector_norm(torch.where(finite[..., None], x, 0).float(), dim=-1), finite
    return torch.where(finite, x, 0).float().abs(), finite


def check_prompt(layer: int, fmt, limit: float, by_norm: bool, keys, values, pending: torch.Tensor | None) -> None:
    """Refuses a prompt's keys or values that `fmt` cannot code, and what a `RangeGuard` counted since (one read back)."""
    stats = []
    for x in (keys, values):
        size, finite = _sizes(x.detach(), by_norm)
        stats += [size.amax() if size.numel() else size.new_zeros(()), (~finite).sum()]
    stats.append(pending if pending is not None else stats[-1].new_zeros(()))
    big_k, bad_k, big_v, bad_v, pending = torch.stack([s.float() for s in stats]).tolist()
    if bad_k or bad_v or big_k > limit or big_v > limit or pending:
        raise OutOfRangeError(describe(layer, fmt, limit, by_norm, big_k, big_v, int(bad_k), int(bad_v), int(pending)))


def describe(layer, fmt, limit, by_norm, big_k=0.0, big_v=0.0, bad_k=0, bad_v=0, pending=0) -> str:
    what = "vector norms" if by_norm else "magnitudes"
    unit = "vectors" if by_norm else "values"
    parts = [f"keys' largest finite {what[:-1]} {big_k:.4g} ({bad_k} non-finite {unit})",
             f"values' {big_v:.4g} ({bad_v} non-finite)"]  # fmt: skip
    if pending:
        parts.append(f"{pending} earlier decode-step {unit} out of range, coded as 0")
    return (
        f"layer {layer}: {fmt} codes hold finite {what} up to {limit:.4g} (float16 scales, zero points or norms); "
        f"got {', '.join(parts)}. Keep such activations at full precision (DenseCache, or boundary/first-token "
        "regions), use backend='quanto' (float32 scales), or find where the model produced them; reset() the cache"
    )


class RangeGuard:
    """Codes tokens that leave a quantized storage's window: what `fmt` cannot hold becomes 0 (the other tokens' codes
    stay right), counted on the device (`pending`), never read back here."""

    def __init__(self, limit: float, by_norm: bool):
        self.limit, self.by_norm = limit, by_norm
        self.pending: torch.Tensor | None = None  # how many values (vectors) were coded as 0
        self.in_place = False  # a static storage's counter: one tensor at a static address, added to in place

    def place(self, device: torch.device) -> None:
        """Makes the counter a static storage's compiled steps add to in place (`mark_static`: CUDA graphs)."""
        self.pending, self.in_place = torch.zeros((), dtype=torch.long, device=device), True
        mark_static(self.pending)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as coded: what the format cannot hold as 0, counted."""
        ok = self._ok(x)
        self.add((~ok).sum())
        return self._where(ok, x)

    def _ok(self, x: torch.Tensor) -> torch.Tensor:
        """Which values (vectors) the format holds: one comparison, which NaN fails as inf and too large ones do (the
        limit at most the dtype's largest finite value, so that it stays finite in the dtype: a decode step's ops are
        its host cost)."""
        if self.by_norm:
            return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32) <= self.limit
        return x.abs() <= min(self.limit, torch.finfo(x.dtype).max)

    def _where(self, ok: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.where(ok[..., None] if self.by_norm else ok, x, 0)

    def folded(self, dtype: torch.dtype) -> tuple[float, torch.Tensor]:
        """What an operator that codes and guards in one call takes (`dispatch.quantize_values_into`, which bounds
        elements or, for a format whose codes bound norms, vectors, as this guard's `by_norm` says): the limit for
        values of `dtype` (as `_ok` compares) and the counter it adds to in place, made here when nothing is pending
        (what `take` handed out is never added to)."""
        if self.pending is None:
            self.pending = torch.zeros((), dtype=torch.long)
        return (self.limit if self.by_norm else min(self.limit, torch.finfo(dtype).max)), self.pending

    def clean(self, x: torch.Tensor) -> torch.Tensor:
        """`x` with what the format cannot hold as 0, not counted (a static storage counts a token once, as it is
        written, and codes its key group again at each step until the group is full)."""
        return self._where(self._ok(x), x)

    def count(self, x: torch.Tensor) -> None:
        """Counts the values (vectors) of `x` the format cannot hold, on the device."""
        self.add((~self._ok(x)).sum())

    def add(self, bad: torch.Tensor) -> None:
        """Adds `bad` (a 0-d count, on the device) to what is pending."""
        if self.in_place:
            self.pending.add_(bad)
        else:
            self.pending = bad if self.pending is None else self.pending + bad

    def take(self) -> torch.Tensor | None:
        if self.in_place:
            pending = self.pending.clone()
            self.pending.zero_()
            return pending
        pending, self.pending = self.pending, None
        return pending


def raise_pending(layers) -> None:
    """Raises `OutOfRangeError` for the decode-step values the `RangeGuard`s of `layers` coded as 0 (one read back)."""
    storages = [(layer, getattr(layer, "storage", None)) for layer in layers]  # (Transformers' own layers have none)
    guarded = [(layer, storage.range_guard) for layer, storage in storages
               if storage is not None and storage.range_guard is not None]  # fmt: skip
    guarded = [(layer, guard) for layer, guard in guarded if guard.pending is not None]
    if not guarded:
        return
    counts = torch.stack([guard.pending.float() for _, guard in guarded]).tolist()
    for (layer, guard), count in zip(guarded, counts, strict=True):
        if count:
            guard.take()
            raise OutOfRangeError(
                describe(layer.spec.index, layer.storage.formats()[0], guard.limit, guard.by_norm, pending=int(count))
            )
