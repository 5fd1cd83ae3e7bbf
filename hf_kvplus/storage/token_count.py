"""A static storage's count of tokens: a Python int for eager bookkeeping, a device tensor for compiled steps."""

from __future__ import annotations

import torch

from ..errors import CapacityError
from ..static_address import mark_static


class TokenCount:
    """Tokens a storage holds: `value`, a Python int that eager code reads for free, and for a static storage
    (once `place`d) `tensor` too, a 0-d int64 on its device at a static address, which a decode step takes its
    write positions from.

    A compiled decode step advances only the tensor. An int that a graph reads or writes becomes an input of
    the graph, and CUDA graphs record the graph anew for each of its values; a device counter, as
    Transformers' StaticCache keeps one, leaves one graph for every step. The int is then behind, and the
    next eager read of `value` brings it up to date with one device-to-host copy. No decode step reads it:
    `generate()` reads it after the loop, `crop` and the batch operations between steps.
    """

    __slots__ = ("_value", "tensor", "_behind")

    def __init__(self):
        self._value = 0
        self.tensor: torch.Tensor | None = None
        self._behind = False  # compiled steps advanced the tensor only

    def place(self, device: torch.device) -> None:
        """Makes the device counter (at the storage's first append), at a static address for compiled graphs."""
        self.tensor = torch.full((), self.value, dtype=torch.long, device=device)
        mark_static(self.tensor)

    @property
    def value(self) -> int:
        if self._behind:  # (never in a compiled step: the read would break its graph)
            self._value, self._behind = int(self.tensor), False
        return self._value

    @value.setter
    def value(self, tokens: int) -> None:
        self._value, self._behind = tokens, False
        if self.tensor is not None:
            self.tensor.fill_(tokens)

    def check_room(self, new: int, max_tokens: int) -> None:
        """Raises `CapacityError`, in an eager step, when `new` more tokens would not fit in `max_tokens` positions. A
        compiled step checks nothing (it reads no int): past them, its write fails on the device, as StaticCache's."""
        if not torch.compiler.is_compiling() and self.value + new > max_tokens:
            raise CapacityError(f"{self.value + new} tokens per row do not fit in the cache's max_tokens={max_tokens}")

    def positions(self, new: int) -> torch.Tensor:
        """`[new]` positions of the next `new` tokens, on the device."""
        if new == 1:  # (one op; a copy, not a view of the counter that `advance` changes)
            return self.tensor.reshape(1).clone()
        return self.tensor + torch.arange(new, device=self.tensor.device)

    def advance(self, new: int) -> None:
        """Counts `new` tokens written: in the int alone while there is no device count, else on the device (in place:
        the address stays) and, in an eager step, in the int as well."""
        if self.tensor is None:
            self._value += new
            return
        self.tensor.add_(new)
        if torch.compiler.is_compiling():
            self._behind = True
        elif not self._behind:
            self._value += new


def counted(doc: str) -> property:
    """A storage's token count as the int attribute its code reads and sets (`end`, a slot store's `seen`), kept by
    the storage's `count`."""

    def get(self) -> int:
        count = self.count  # (the int straight away unless compiled steps left it behind: read every step)
        return count.value if count._behind else count._value

    def put(self, tokens: int) -> None:
        self.count.value = tokens

    return property(get, put, doc=doc)
