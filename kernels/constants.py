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
    """A table of constants by key: `get(key, make)` returns the kept value or `make()`, kept if made eagerly.

    `derived=True`: a table whose values are made of other tables' constants (a call's rotations, codebook and byte
    tables in one lookup, where looking each up cost a decode step more than the lookup saves): emptied whenever any
    table is cleared, so that it never keeps what a cleared table no longer holds."""

    #: Every derived table (module-level tables: they live as long as the process).
    _derived: list[Constants] = []

    def __init__(self, derived: bool = False) -> None:
        self._kept: dict[Hashable, T] = {}
        if derived:
            Constants._derived.append(self)

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        value = self._kept.get(key)
        if value is None:
            value = make()
            if not torch.compiler.is_compiling():
                self._kept[key] = value
        return value

    def clear(self) -> None:
        """Forgets every kept constant (an evaluation that swaps what `make` computes, such as a codebook), and what the
        derived tables made of them."""
        self._kept.clear()
        for table in Constants._derived:
            table._kept.clear()
