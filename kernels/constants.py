"""Constant tensors (shifts, offsets, rotations, codebooks, tables) made once per key and device.

A decode step's ops are its host cost, so the kernels' twins and the storages keep their constants rather than
making them every call. One rule for all of them: a constant is kept only when made eagerly; one made while a graph
is traced is a value of that graph, not a tensor to keep (the next eager call makes and keeps it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class Constants(Generic[T]):
    """A table of constants by key: `get(key, make)` returns the kept value or `make()`, kept if made eagerly."""

    def __init__(self) -> None:
        self._kept: dict[Hashable, T] = {}

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        value = self._kept.get(key)
        if value is None:
            value = make()
            if not torch.compiler.is_compiling():
                self._kept[key] = value
        return value

    def clear(self) -> None:
        """Forgets every kept constant (an evaluation that swaps what `make` computes, such as a codebook)."""
        self._kept.clear()
