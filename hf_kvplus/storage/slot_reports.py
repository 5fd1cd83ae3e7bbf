"""A `SlotStore`'s reports and offload protocol: bytes at rest, the coded and exact parts (`precision_report`), and
the tensors an offloading placement moves."""

from __future__ import annotations

import torch

from ..memory import MemoryReport, tensor_bytes


class SlotReports:
    """Bytes at rest, and the tensors a placement moves."""

    def formats(self) -> tuple:
        fmt = getattr(self.codec, "fmt", None)  # (a dense codec has none)
        return () if fmt is None else (fmt,)

    def states(self) -> tuple:
        return () if getattr(self.codec, "fmt", None) is None else (self.codec.state,)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-slot tensors by name, and the exact region's (`exact_k`, `exact_v`): what an offloading placement
        moves."""
        exact = {f"exact_{name}": held for name, held in (self.exact or {}).items()}
        return {**self.fields, **exact}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.fields = {name: held for name, held in tensors.items() if not name.startswith("exact_")}
        if self.exact is not None:
            self.exact = {name: tensors[f"exact_{name}"] for name in self.exact}

    def take_written(self) -> dict:
        """Slots are overwritten anywhere (evictions): a changed field is written back whole."""
        return {}

    def memory(self) -> MemoryReport:
        if not self.fields:
            return MemoryReport()
        per_slot = {name: held[:, :, :1].numel() * held.element_size() for name, held in self.fields.items()}
        payload = sum(per_slot[name] for name in self.codec.payload)
        metadata = sum(per_slot.values()) - payload
        held = min(self.held, self.seen)  # (a compileable store's free slots are not tokens)
        exact = sum(x.numel() * x.element_size() for x in (self.exact or {}).values())
        state = tensor_bytes([t for fmt, s in zip(self.formats(), self.states(), strict=True)
                              for t in fmt.state_tensors(s)])  # (a key centre)  # fmt: skip
        return MemoryReport(
            payload_bytes=payload * held + exact,
            reserved_bytes=payload * (self.capacity - held),
            metadata_bytes=metadata * self.capacity + state,
            batch_size=self.batch_size,
        )

    def quantized_part(self) -> tuple[MemoryReport, int]:
        """Bytes of the coded tokens held (codes as payload, scales and zeros as metadata) and their count per row: the
        held tokens less the exact region's (whose slots' codes are not read); nothing at full precision."""
        if not self.fields or self.codec.packed(self.fields) is None:
            return MemoryReport(), 0
        per_slot = {name: held[:, :, :1].numel() * held.element_size() for name, held in self.fields.items()}
        coded = min(self.held, self.seen) - self.exact_part()[0]
        payload = sum(per_slot[name] for name in self.codec.payload)
        metadata = sum(size for name, size in per_slot.items() if name not in self.codec.payload and name not in ("pos", "score"))
        return MemoryReport(payload_bytes=payload * coded, metadata_bytes=metadata * coded, batch_size=self.batch_size), coded
