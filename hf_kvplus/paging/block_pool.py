"""Block ids with reference counts: the allocator under a paged KV cache.

A block is a slot of `block_size` tokens in every layer's K/V tensors; the pool only hands out its
integer id. Several caches (beams, requests sharing a prompt, the prefix store) may point at one
block, so each id carries a reference count and goes back to the free list when the count reaches
zero. The pool never touches tensors: the paged storage sizes its tensors by `capacity` and grows
them from a grow listener.

A pool is shared by caches that may live in several threads (a server's workers): every operation holds the
pool's `lock` (a reentrant lock, which the prefix store on the pool takes too), so it is atomic. A decode step
calls the pool only when a row starts a new block.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections import Counter
from collections.abc import Callable, Iterable

import torch

from ..errors import CapacityError, ConfigError, UnsupportedOperationError


class BlockPool:
    """Hands out block ids `0..capacity-1` with reference counts; lowest free id first.

    `BlockPool(512)` is a fixed pool: it never grows, and an allocation it cannot serve raises
    `CapacityError` (after asking its reclaimer, the prefix store, to give back blocks only it holds).
    `BlockPool()` is growable: it starts at `initial` blocks and, when an allocation finds too few
    free, grows by `max(shortfall, capacity // 8, initial)` blocks, the rule `DenseStorage` uses for
    tokens, so at most about an eighth of a large pool is growth headroom and the copies that
    growing the K/V tensors costs stay amortized O(1) per block. A growable pool never asks the
    reclaimer: it grows instead (bound a prefix store on it with `max_blocks`).

    The free list is a min-heap, so allocation is deterministic (lowest ids first) and every
    operation is O(log capacity) per id. Every operation that fails raises before changing anything.
    The heap is sifted in Python (`_heap_push`, `_heap_pop`), not by the C `heapq`, which
    `torch.compile` cannot trace: a decode step that starts a block stays one graph.

    Thread-safe: each operation runs under `lock` (reentrant: the reclaimer and the grow listeners run inside
    `allocate`'s hold). `release` is the path of a collected cache's finalizer, which the collector may run in
    the middle of a pool operation on the same thread: there it waits in a queue that the next operation drains.
    """

    def __init__(self, num_blocks: int | None = None, *, initial: int = 64):
        if num_blocks is not None:
            if not isinstance(num_blocks, int) or num_blocks < 1:
                raise ConfigError(f"a fixed block pool needs num_blocks >= 1, got {num_blocks!r}")
            initial = num_blocks
        elif not isinstance(initial, int) or initial < 1:
            raise ConfigError(f"a growable block pool needs initial >= 1, got {initial!r}")
        self._fixed = num_blocks is not None
        self._initial = initial
        self._refs: list[int] = [0] * initial  # reference count per id; 0 = free
        self._free: list[int] = list(range(initial))  # min-heap of the ids whose count is 0
        self._reclaimer: Callable[[int], int] | None = None
        self._listeners: list[Callable[[int], None]] = []
        self.lock = threading.RLock()
        self._deferred: list[int] = []  # ids released by a finalizer while this thread was inside an operation
        #: Whether caches hold the lock while they write the pool's tensors: a growable pool shared between caches
        #: (`PagedCache` with `pool=` sets it), whose growth in one thread replaces the tensors another writes.
        self.guard_writes = False

    def hold(self):
        """The pool's lock, with the finalizers' queued releases dropped first. A step that `torch.compile` traces
        takes no lock (dynamo cannot enter one): a compiled decode on a pool shared across threads is unguarded."""
        if torch.compiler.is_compiling():
            return contextlib.nullcontext()
        self.lock.acquire()
        try:
            self._drain()
        except BaseException:
            self.lock.release()
            raise
        return _Held(self.lock)

    def __getstate__(self) -> dict:
        with self.hold():
            state = dict(self.__dict__)
        del state["lock"], state["_deferred"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()
        self._deferred = []

    @classmethod
    def from_bytes(cls, budget_bytes: int, bytes_per_block: int) -> BlockPool:
        """A fixed pool of as many blocks as `budget_bytes` holds (all layers' K and V of one block)."""
        if bytes_per_block <= 0:
            raise ConfigError(f"bytes_per_block must be positive, got {bytes_per_block!r}")
        num_blocks = int(budget_bytes // bytes_per_block)
        if num_blocks < 1:
            raise ConfigError(
                f"a budget of {budget_bytes} bytes holds no block of {bytes_per_block} bytes"
            )
        return cls(num_blocks)

    # ------------------------------------------------------------------ state
    @property
    def capacity(self) -> int:
        return len(self._refs)

    @property
    def num_free(self) -> int:
        with self.hold():
            return len(self._free)

    @property
    def num_used(self) -> int:
        with self.hold():
            return len(self._refs) - len(self._free)

    @property
    def is_fixed(self) -> bool:
        return self._fixed

    def refcount(self, block_id: int) -> int:
        """References held on `block_id` (0 when free)."""
        with self.hold():
            return self._refs[self._index(block_id)]

    def __repr__(self) -> str:
        kind = "fixed" if self._fixed else "growable"
        return f"BlockPool({kind}, {self.num_free} free of {self.capacity})"

    # ------------------------------------------------------------ hooks
    def set_reclaimer(self, reclaimer: Callable[[int], int] | None) -> None:
        """`reclaimer(needed) -> freed`: asked by a fixed pool that is short of `needed` blocks.

        It frees (through `decref`) up to `needed` blocks that nobody but itself holds and returns
        how many it freed. One reclaimer per pool; `None` detaches it.
        """
        with self.lock:
            if reclaimer is not None and self._reclaimer is not None and reclaimer != self._reclaimer:
                raise UnsupportedOperationError("this block pool already has a reclaimer (one prefix store per pool)")
            self._reclaimer = reclaimer

    def add_grow_listener(self, callback: Callable[[int], None]) -> None:
        """`callback(new_capacity)` runs after every growth, before the allocation that caused it returns.

        The paged storage grows its per-layer K/V tensors there. If a callback raises, the pool
        shrinks back to its old capacity (listeners that already grew keep their larger tensors,
        which is harmless) and the allocation fails with that exception.
        """
        with self.lock:
            self._listeners.append(callback)

    def remove_grow_listener(self, callback: Callable[[int], None]) -> None:
        with self.lock:
            self._listeners.remove(callback)

    # -------------------------------------------------------- operations
    def allocate(self, n: int) -> list[int]:
        """`n` free ids, lowest first, each with reference count 1; all or nothing."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"allocate needs a block count >= 0, got {n!r}")
        with self.hold():
            if n > len(self._free):
                self._make_room(n)
            ids = [_heap_pop(self._free) for _ in range(n)]
            for i in ids:
                self._refs[i] = 1
            return ids

    def incref(self, ids: Iterable[int]) -> None:
        """One more reference on each id (an id listed twice gets two); every id must be in use."""
        with self.hold():
            ids = [self._index(i) for i in ids]
            for i in ids:
                if self._refs[i] == 0:
                    raise UnsupportedOperationError(f"incref of block {i}, which is free (not allocated)")
            for i in ids:
                self._refs[i] += 1

    def decref(self, ids: Iterable[int]) -> list[int]:
        """Drops one reference per listed id; returns the ids that became free (in listed order).

        Dropping more references than a block has (a double free, or a free block) raises
        `UnsupportedOperationError` and changes nothing, so a bug cannot silently corrupt the counts.
        """
        with self.hold():
            return self._decref(ids)

    def release(self, ids: Iterable[int]) -> None:
        """`decref` for a finalizer (a collected cache's blocks): safe wherever the collector runs it. Inside an
        operation of this pool on the same thread (the collector ran in its middle) the ids wait in a queue that the
        next operation drains; elsewhere they are dropped at once."""
        ids = list(ids)
        if self.lock._is_owned():
            self._deferred.extend(ids)
            return
        with self.hold():
            self._decref(ids)

    def _drain(self) -> None:
        """Drops the references that finalizers queued (under the lock, before an operation changes anything)."""
        if self._deferred:
            ids, self._deferred = self._deferred, []
            self._decref(ids)

    def _decref(self, ids: Iterable[int]) -> list[int]:
        ids = [self._index(i) for i in ids]
        for i, times in Counter(ids).items():
            if times > self._refs[i]:
                held = self._refs[i]
                what = "which is free" if held == 0 else f"which holds only {held}"
                raise UnsupportedOperationError(f"decref drops {times} reference(s) of block {i}, {what}")
        freed = []
        for i in ids:
            self._refs[i] -= 1
            if self._refs[i] == 0:
                _heap_push(self._free, i)
                freed.append(i)
        return freed

    def check(self) -> None:
        """Raises AssertionError unless the free list is exactly the set of ids with count 0."""
        with self.hold():
            self._check()

    def _check(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"free list holds duplicates: {sorted(Counter(self._free) - Counter(free))}")
        zero = {i for i, r in enumerate(self._refs) if r == 0}
        if free != zero:
            raise AssertionError(
                f"free list and counts disagree: free but counted {sorted(free - zero)}, "
                f"count 0 but not free {sorted(zero - free)}"
            )
        if any(r < 0 for r in self._refs):
            raise AssertionError("negative reference count")
        if any(self._free[(k - 1) // 2] > self._free[k] for k in range(1, len(self._free))):
            raise AssertionError("free list lost its heap order")

    # ---------------------------------------------------------- internals
    def _index(self, block_id: int) -> int:
        try:
            i = operator.index(block_id)
        except TypeError:
            raise UnsupportedOperationError(f"block id must be an int, got {block_id!r}") from None
        if not 0 <= i < len(self._refs):
            raise UnsupportedOperationError(f"block {i} does not exist in a pool of {len(self._refs)}")
        return i

    def _make_room(self, n: int) -> None:
        """Reclaims (fixed pool) or grows (growable pool) until `n` ids are free, or raises."""
        if self._fixed:
            reclaimed = 0
            if self._reclaimer is not None:
                reclaimed = self._reclaimer(n - len(self._free))
            if n > len(self._free):
                note = f" ({reclaimed} held only by the prefix store were reclaimed)" if self._reclaimer else ""
                raise CapacityError(f"needs {n} blocks, {len(self._free)} free of {self.capacity}{note}")
            return
        old = len(self._refs)
        new = old + max(n - len(self._free), old // 8, self._initial)
        self._refs.extend([0] * (new - old))
        self._free.extend(range(old, new))  # larger than every id in the heap: still a heap
        try:
            for callback in list(self._listeners):
                callback(new)
        except BaseException:
            del self._refs[old:]
            self._free = sorted(i for i in self._free if i < old)  # sorted: a heap
            raise


class _Held:
    """Releases a lock acquired by `BlockPool.hold` (a plain object: cheaper than a generator context manager)."""

    __slots__ = ("lock",)

    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.lock.release()


def _heap_push(heap: list[int], item: int) -> None:
    """`heapq.heappush` in Python, traceable by dynamo."""
    heap.append(item)
    k = len(heap) - 1
    while k:
        parent = (k - 1) // 2
        if heap[parent] <= item:
            break
        heap[k] = heap[parent]
        k = parent
    heap[k] = item


def _heap_pop(heap: list[int]) -> int:
    """`heapq.heappop` in Python, traceable by dynamo."""
    last = heap.pop()
    if not heap:
        return last
    top, size, k = heap[0], len(heap), 0
    while 2 * k + 1 < size:
        child = 2 * k + 1
        if child + 1 < size and heap[child + 1] < heap[child]:
            child += 1
        if last <= heap[child]:
            break
        heap[k] = heap[child]
        k = child
    heap[k] = last
    return top
