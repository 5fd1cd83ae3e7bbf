"""A value kept between eager steps and never by a traced one: the rule for every memo of the decode step."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

_EMPTY = object()


class EagerMemo:
    """What `make(*args)` gave for the last `key`: a decode step's checks and index tensors are host work, done again
    only when their key changes (a batch operation, a new buffer). A traced step neither reads nor keeps it: it makes
    the value every time, so the graph computes it (a graph keeps no state of its own, and a kept tensor would be an
    input guarded at every step).

    `anchor`, a buffer that the value was made for, is held weakly and compared by identity: it keeps no memory alive
    and cannot name a later tensor at the same address. A memo does not travel: a pickled or deep-copied one is empty
    (a weak reference could not be pickled, and would name the original's buffer), so the copy makes its value again.
    """

    __slots__ = ("_key", "_anchor", "_value")

    def __init__(self):
        self._key: Any = _EMPTY
        self._anchor: weakref.ref | None = None
        self._value: Any = None

    def __reduce__(self):
        return EagerMemo, ()

    def get(self, key: Hashable, make: Callable, *args, anchor: torch.Tensor | None = None) -> Any:
        if torch.compiler.is_compiling():
            return make(*args)
        if key != self._key or (anchor is not None and self._anchor() is not anchor):
            self._value = make(*args)
            self._key, self._anchor = key, None if anchor is None else weakref.ref(anchor)
        return self._value
