"""The K/V tensors of one layer's blocks: `[blocks, kv_heads, block_size, head_dim]` each."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..errors import CacheMismatchError
from ..host_index import index_tensor
from ..static_address import mark_static
from .block_pool import BlockPool


class BlockTensors(ABC):
    """Block-wise copies and clears over a pool's tensors (`tensors()`, each `[blocks, ...]`), one indexed
    write per tensor however many blocks: what copy-on-write and padding release call."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """The pool's tensors by name (none before the first write)."""

    num_kv_heads: int

    def shard_heads(self, local: int) -> None:
        """This rank holds `local` of the layer's KV heads (tensor parallel): its blocks, not yet allocated, are
        sized for them."""
        if local == self.num_kv_heads:
            return
        if self.tensors():
            raise CacheMismatchError(
                f"this pool's layer already holds blocks of {self.num_kv_heads} KV heads; a tensor-parallel rank "
                f"with {local} cannot share it (build one pool per rank)"
            )
        self.num_kv_heads = local

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Block `targets[i]` becomes a copy of block `sources[i]`."""
        tensors = self.tensors()
        if tensors:
            device = next(iter(tensors.values())).device
            src, dst = index_tensor(sources, device), index_tensor(targets, device)
            for t in tensors.values():
                t[dst] = t[src]

    def zero_blocks(self, blocks: list[int]) -> None:
        """The blocks hold zeros (a quantized block then dequantizes to zeros)."""
        tensors = self.tensors()
        if tensors:
            ids = index_tensor(blocks, next(iter(tensors.values())).device)
            for t in tensors.values():
                t[ids] = 0


class LayerPool(BlockTensors):
    """One layer's block tensors, sized to its `BlockPool` and grown with it.

    Allocated at the first write (dtype and device come from the model), so a pool can be built from
    a config alone and outlive the caches that use it (prefix reuse across calls).
    """

    def __init__(self, blocks: BlockPool, block_size: int, num_kv_heads: int, head_dim: int):
        self.blocks = blocks
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.retype = False
        blocks.add_grow_listener(self._grow)

    def ensure(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Allocates the tensors like `keys`/`values`, or checks that they match what is held."""
        if self.k is None or self.retype:
            with self.blocks.hold():  # two threads' first writes allocate once
                self._allocate(keys, values)
        elif keys.dtype != self.k.dtype or keys.device != self.k.device:
            raise CacheMismatchError(
                f"new keys are {keys.dtype} on {keys.device}, the pool holds {self.k.dtype} on {self.k.device} "
                f"({self.blocks.num_used} blocks in use: a pool takes another dtype only when it holds none)"
            )

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        retype, self.retype = self.retype, False
        if self.k is not None and not (retype and (keys.dtype != self.k.dtype or keys.device != self.k.device)):
            return
        shape = (self.blocks.capacity, self.num_kv_heads, self.block_size)
        self.k = keys.new_zeros(*shape, self.head_dim)  # zeros: a static read sees unwritten slots (masked)
        self.v = values.new_zeros(*shape, values.shape[-1])
        mark_static(self.k, self.v)  # written in place by decode steps, compiled ones included

    def allow_retype(self) -> None:
        """The next write may bring another dtype or device (the pool's one cache was reset and no block is held):
        the tensors are then made anew for it."""
        self.retype = True

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K and V in this layer (0 before the first write)."""
        return 0 if self.k is None else (self.k[0].numel() + self.v[0].numel()) * self.k.element_size()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The block tensors by name: what an offloading placement moves (the tables stay)."""
        return {} if self.k is None else {"k": self.k, "v": self.v}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.k, self.v = tensors.get("k"), tensors.get("v")

    def _grow(self, capacity: int) -> None:
        if self.k is None:
            return
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(capacity, *old.shape[1:])
            new[: old.shape[0]] = old
            setattr(self, name, new)
            mark_static(new)
