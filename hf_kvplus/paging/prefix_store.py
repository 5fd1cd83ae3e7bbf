"""Full KV blocks kept for reuse across requests: a hash-chained prefix store with LRU eviction.

A block of `block_size` tokens is identified by `h_i = blake2b(h_{i-1}, namespace, tokens of block
i)`, so a hash names the whole prefix up to and including its block, not just the block's own tokens:
two requests share block i only if they agree on every token before it. The namespace (tenant,
adapter, model: any str) enters every hash, so identical tokens under two namespaces never share.
Only full blocks are stored; the partly filled last block of a sequence is still being written.

A stored block is immutable: a cache holding one that must change its tokens (`crop` into it) copies
it first. The store holds one pool reference per stored block; a block whose only reference is the
store's is "idle" and may be evicted or reclaimed by the pool.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, replace

from ..errors import ConfigError, UnsupportedOperationError
from .block_pool import BlockPool

#: The parent hash of a sequence's first block.
ROOT = bytes(16)


def block_hash(parent: bytes, namespace: str, tokens: Sequence[int]) -> bytes:
    """16-byte blake2b of `parent | len(ns) | ns | len(tokens) | tokens as int64`, all fixed-width or
    length-prefixed, so no two different (parent, namespace, tokens) triples share an encoding
    ("a" + [98, ...] and "ab" + [...] differ in the namespace length field)."""
    ns = namespace.encode("utf-8", "surrogatepass")
    try:
        packed = struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error as exc:
        raise ConfigError(f"token ids must be integers in the int64 range ({exc})") from None
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(len(ns).to_bytes(8, "little"))
    digest.update(ns)
    digest.update(len(tokens).to_bytes(8, "little"))
    digest.update(packed)
    return digest.digest()


def chain_hashes(token_ids: Sequence[int], namespace: str, block_size: int) -> list[bytes]:
    """The hash of every full block of `token_ids` (the partly filled last block has none)."""
    tokens, namespace = _token_list(token_ids), _check_namespace(namespace)
    hashes, parent = [], ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, namespace, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class PrefixStoreStats:
    """Counts since the store was built (`clear()` keeps them)."""

    lookups: int = 0  #: calls to `lookup`
    query_blocks: int = 0  #: full blocks those lookups asked about
    hit_blocks: int = 0  #: of those, blocks served from the store
    inserted_blocks: int = 0  #: blocks newly stored by `insert`
    evicted_blocks: int = 0  #: blocks let go by `evict`, by `max_blocks` and by the pool's reclaim
    reclaimed_blocks: int = 0  #: of those, blocks given back because the pool ran short
    tier_hit_blocks: int = 0  #: of the hits, blocks read back from the persistent tier (another process's, or evicted)

    @property
    def miss_blocks(self) -> int:
        """Full blocks asked about that had to be computed (the first miss and every block after it)."""
        return self.query_blocks - self.hit_blocks

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0


@dataclass(slots=True)
class _Entry:
    block_id: int
    parent: bytes | None  # None for a sequence's first block
    children: int = 0  # stored entries whose parent is this one


class PrefixStore:
    """Stored full blocks by prefix hash, per namespace, evicted least recently used leaf first.

    Eviction rule: only an idle block (pool refcount 1: the store's own reference) with no stored
    children is evicted, least recently used first. So every stored block's parent is stored, and
    every stored block is reachable by `lookup`: the store never holds pool blocks that no lookup
    can return. Touching a chain (`lookup`, `insert`) marks its blocks used from the last one back to
    the first, so a parent is always more recent than its children, and one pass in LRU order
    evicts a chain from its tail. A parent stays while a live cache holds one of its children.

    The store registers itself as `pool`'s reclaimer: a fixed pool that runs short evicts idle
    blocks here before it raises `CapacityError`. `max_blocks` bounds the store itself (needed on a
    growable pool, which grows instead of reclaiming).

    Thread-safe: every operation holds the pool's lock (`BlockPool.hold`), the one lock of the pool and its store,
    so a lookup, an insert and the pool's reclaim are atomic together.

    `tier` (a `PersistentTier`, which `PagedPool(prefix_backend=...)` attaches) keeps the blocks beyond the process:
    `insert` writes each newly stored block to it, and `lookup` continues a chain that memory does not hold from it,
    block by block, reading each into a new pool block that the store then holds as if inserted here.
    """

    def __init__(self, pool: BlockPool, block_size: int, max_blocks: int | None = None, tier=None):
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size!r}")
        if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks < 0):
            raise ConfigError(f"max_blocks must be None or >= 0, got {max_blocks!r}")
        self.pool = pool
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._by_block: dict[int, bytes] = {}
        self._stats = PrefixStoreStats()
        self.tier = tier
        pool.set_reclaimer(self._reclaim)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def stats(self) -> PrefixStoreStats:
        """A snapshot of the counters."""
        with self.pool.hold():
            return replace(self._stats)

    def lookup(self, token_ids: Sequence[int], namespace: str) -> list[int]:
        """Block ids of the longest stored chain of full blocks that prefixes `token_ids`.

        The caller receives one pool reference to each returned block (decref them when done). To
        keep at least one token to run the model on (for its logits), look up `token_ids[:-1]`.
        """
        with self.pool.hold():
            tokens, namespace = _token_list(token_ids), _check_namespace(namespace)
            bs, blocks, hashes, parent = self.block_size, [], [], ROOT
            try:
                for start in range(0, len(tokens) - bs + 1, bs):
                    parent = block_hash(parent, namespace, tokens[start : start + bs])
                    entry = self._entries.get(parent)
                    if entry is None and self.tier is not None:
                        entry = self._read_from_tier(parent, hashes[-1] if hashes else None)
                    if entry is None:
                        break
                    self.pool.incref([entry.block_id])  # (now: a pool short of blocks may reclaim idle ones below)
                    blocks.append(entry.block_id)
                    hashes.append(parent)
            except BaseException:  # (a back end that cannot be read: the caller gets no references to drop)
                self._touch(hashes)  # (the blocks read so far stay stored, each parent more recent than its child)
                self.pool.decref(blocks)
                raise
            self._touch(hashes)
            if self.tier is not None and blocks:
                self.tier.touch(hashes[::-1])  # a parent ends more recent than its children there too
            self._stats.lookups += 1
            self._stats.query_blocks += len(tokens) // bs
            self._stats.hit_blocks += len(blocks)
            return blocks

    def insert(self, token_ids: Sequence[int], block_ids: Iterable[int], namespace: str) -> int:
        """Stores the full blocks of a sequence whose block `i` holds tokens `[i*bs, (i+1)*bs)`.

        Returns how many blocks were newly stored; the store takes one reference on each. Blocks
        whose prefix is already stored (possibly in another block id) are left as they are, only
        marked used. With `max_blocks`, idle blocks are evicted first; if that does not make room,
        only the first new blocks that fit are stored. The caller keeps its own references.
        """
        with self.pool.hold():
            tokens, namespace = _token_list(token_ids), _check_namespace(namespace)
            block_ids = list(block_ids)
            full = len(tokens) // self.block_size
            if len(block_ids) < full:
                raise ConfigError(
                    f"{len(tokens)} tokens fill {full} blocks of {self.block_size}, "
                    f"but only {len(block_ids)} block ids were given"
                )
            chain = list(zip(chain_hashes(tokens, namespace, self.block_size), block_ids[:full], strict=True))
            known = 0  # a stored block's parent is always stored, so the stored part is a prefix
            while known < len(chain) and chain[known][0] in self._entries:
                known += 1
            new = chain[known:]
            self._check_new_blocks([b for _, b in new])
            if self.max_blocks is not None and len(self) + len(new) > self.max_blocks:
                protect = {chain[known - 1][0]} if known else set()
                self._evict(len(self) + len(new) - self.max_blocks, protect)
                new = new[: max(0, self.max_blocks - len(self))]
            self.pool.incref([b for _, b in new])
            for k, (h, b) in enumerate(new, start=known):
                parent = chain[k - 1][0] if k else None
                self._entries[h] = _Entry(b, parent)
                self._by_block[b] = h
                if parent is not None:
                    self._entries[parent].children += 1
            self._touch([h for h, _ in chain[: known + len(new)]])
            self._stats.inserted_blocks += len(new)
            if self.tier is not None and new:
                self.tier.write(new)
            return len(new)

    def evict(self, n: int) -> int:
        """Frees up to `n` idle leaf blocks, least recently used first; returns how many."""
        with self.pool.hold():
            return self._evict(n)

    def clear(self) -> None:
        """Drops every stored block: idle ones go back to the pool, live ones lose the store's reference."""
        with self.pool.hold():
            blocks = [e.block_id for e in self._entries.values()]
            self._entries.clear()
            self._by_block.clear()
            self.pool.decref(blocks)

    def check(self) -> None:
        """Raises AssertionError unless the chains, children counts, recency order and references agree."""
        with self.pool.hold():
            children = Counter(e.parent for e in self._entries.values() if e.parent is not None)
            position = {h: k for k, h in enumerate(self._entries)}
            for h, e in self._entries.items():
                if e.parent is not None and e.parent not in self._entries:
                    raise AssertionError(f"block {e.block_id} is stored but its parent is not")
                if e.parent is not None and position[e.parent] < position[h]:
                    raise AssertionError(f"block {e.block_id} is more recently used than its parent")
                if e.children != children[h]:
                    raise AssertionError(f"block {e.block_id} counts {e.children} children, has {children[h]}")
                if self._by_block.get(e.block_id) != h or self.pool.refcount(e.block_id) < 1:
                    raise AssertionError(f"block {e.block_id} is stored without its reference")
            if len(self._by_block) != len(self._entries):
                raise AssertionError("a block id is stored under two prefixes")
            if self.max_blocks is not None and len(self) > self.max_blocks:
                raise AssertionError(f"{len(self)} blocks stored, max_blocks is {self.max_blocks}")

    # ---------------------------------------------------------- internals
    def _read_from_tier(self, block: bytes, parent: bytes | None) -> _Entry | None:
        """The block read back from the tier and stored here (the store's reference), or None."""
        if self.max_blocks is not None and len(self) >= self.max_blocks and not self._evict(1, {parent}):
            return None
        block_id = self.tier.read(block)
        if block_id is None:
            return None
        entry = self._entries[block] = _Entry(block_id, parent)
        self._by_block[block_id] = block
        if parent is not None:
            self._entries[parent].children += 1
        self._stats.tier_hit_blocks += 1
        return entry

    def _touch(self, hashes: list[bytes]) -> None:
        for h in reversed(hashes):  # tail first: a parent ends more recent than its children
            self._entries.move_to_end(h)

    def _evict(self, n: int, protect: Container[bytes] = frozenset()) -> int:
        victims: list[bytes] = []
        gone = Counter()  # children of a parent already chosen in this pass
        for h, e in self._entries.items():
            if len(victims) >= n:
                break
            if h in protect or e.children > gone[h] or self.pool.refcount(e.block_id) != 1:
                continue
            victims.append(h)
            if e.parent is not None:
                gone[e.parent] += 1
        blocks = []
        for h in victims:  # children come before their parents here
            e = self._entries.pop(h)
            del self._by_block[e.block_id]
            if e.parent is not None:
                self._entries[e.parent].children -= 1
            blocks.append(e.block_id)
        self.pool.decref(blocks)
        self._stats.evicted_blocks += len(blocks)
        return len(blocks)

    def _reclaim(self, needed: int) -> int:
        freed = self._evict(needed)
        self._stats.reclaimed_blocks += freed
        return freed

    def _check_new_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.pool.refcount(b) == 0:
                raise UnsupportedOperationError(f"insert of block {b}, which is free: insert blocks you hold")
            if b in self._by_block:
                raise UnsupportedOperationError(
                    f"block {b} is already stored for another prefix (copy a stored block before changing it)"
                )
        if len(set(blocks)) != len(blocks):
            raise UnsupportedOperationError(f"insert lists a block twice: {blocks}")


def _token_list(token_ids: Sequence[int]) -> list[int]:
    return token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)


def _check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str):
        raise ConfigError(f"namespace must be a str, got {type(namespace).__name__}")
    return namespace
