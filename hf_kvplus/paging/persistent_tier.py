"""A prefix store's blocks beyond the process: written to a back end when stored, read back into the pool on a miss.

Keys are `<scope>/<block hash>`: the scope names the model (its config's fingerprint), the block size, each layer's
block format and the dtype of full-precision blocks, so a pool reads only blocks it could have written itself
(int4 blocks stay int4); the block hash chains the namespace and every token up to the block's end, as in memory, so
a tenant never computes another's key. A record that fails its checks, or that does not fit the pool's tensors, is
dropped from the back end and counted, never copied into a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CapacityError, CorruptFileError
from .block_pool import BlockPool
from .block_record import decode_record, encode_record


@dataclass
class TierStats:
    read_blocks: int = 0  #: blocks read back into the pool
    written_blocks: int = 0  #: blocks written to the back end
    refused_blocks: int = 0  #: records refused (damaged, or another layout) and dropped


class PersistentTier:
    """Copies whole blocks between a pool's layer tensors (`layers`: index -> `LayerPool` / `QuantLayerPool`, all on
    `blocks`) and `backend` (`FolderBlocks`, `RedisBlocks`: `get`, `put`, `touch`, `discard`)."""

    def __init__(self, backend, scope: str, blocks: BlockPool, layers: dict, dtype: torch.dtype):
        self.backend, self.scope, self.blocks, self.layers, self.dtype = backend, scope, blocks, layers, dtype
        self.device = torch.get_default_device()
        self.stats = TierStats()

    def key(self, block_hash: bytes) -> str:
        return f"{self.scope}/{block_hash.hex()}"

    def write(self, stored: list[tuple[bytes, int]]) -> None:
        """Writes blocks (hash, block id) of the pool, then marks them used from the last back to the first. What the
        back end raises (`DiskTierError` for a full folder) reaches the caller once the blocks are stored in memory."""
        items = [(self.key(h), encode_record(self.key(h), self._block(b))) for h, b in stored]
        self.backend.put(items)
        self.backend.touch([k for k, _ in reversed(items)])
        self.stats.written_blocks += len(items)

    def read(self, block_hash: bytes) -> int | None:
        """A newly allocated block (one reference, the caller's) holding the stored block, or None."""
        key = self.key(block_hash)
        data = self.backend.get(key)
        if data is None:
            return None
        try:
            tensors = decode_record(data, key)
        except CorruptFileError:
            self._refuse(key)
            return None
        self._allocate_tensors()
        targets = [(self.layers[layer].tensors().get(name), t) for layer, name, t in tensors]
        want = {(i, name) for i, layer in self.layers.items() for name in layer.tensors()}
        if {(layer, name) for layer, name, _ in tensors} != want or any(
            target is None or target.dtype != t.dtype or target.shape[1:] != t.shape for target, t in targets
        ):
            self._refuse(key)
            return None
        try:
            (block,) = self.blocks.allocate(1)
        except CapacityError:
            return None
        for layer, name, t in tensors:  # (allocate may have grown the pool: its tensors are fetched again)
            self.layers[layer].tensors()[name][block].copy_(t)
        self.stats.read_blocks += 1
        return block

    def touch(self, hashes: list[bytes]) -> None:
        self.backend.touch([self.key(h) for h in hashes])

    def _block(self, block: int) -> list[tuple[int, str, torch.Tensor]]:
        return [(i, name, t[block]) for i, layer in sorted(self.layers.items()) for name, t in layer.tensors().items()]

    def _allocate_tensors(self) -> None:
        """A pool that holds no block yet allocates its tensors for the stored ones (their dtype, this device)."""
        for layer in self.layers.values():
            if not layer.tensors():
                like = torch.zeros(1, layer.num_kv_heads, 1, layer.head_dim, dtype=self.dtype, device=self.device)
                layer.ensure(like, like)

    def _refuse(self, key: str) -> None:
        self.backend.discard(key)
        self.stats.refused_blocks += 1
