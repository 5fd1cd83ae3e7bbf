"""PrefixStore: longest full-block prefix hits, namespace isolation, LRU leaf-first eviction, reclaim."""

import re

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hf_kvplus.errors import CapacityError, ConfigError, UnsupportedOperationError
from hf_kvplus.paging import BlockPool, PrefixStore, block_hash, chain_hashes
from hf_kvplus.paging.prefix_store import ROOT

BS = 4


def fill(pool, store, tokens, namespace="m", release=True):
    """A cache computes `tokens` into fresh blocks and registers them; returns its block ids."""
    blocks = pool.allocate(-(-len(tokens) // BS))
    store.insert(tokens, blocks, namespace)
    if release:
        pool.decref(blocks)
    return blocks


def consistent(pool, store):
    pool.check()
    store.check()


def test_hits_on_shared_prefixes_of_different_lengths():
    pool = BlockPool(32)
    store = PrefixStore(pool, BS)
    prompt = list(range(100, 126))  # 6 full blocks and 2 tokens
    blocks = fill(pool, store, prompt)
    assert len(store) == 6
    for n_tokens, n_blocks in [(4, 1), (7, 1), (8, 2), (23, 5), (24, 6), (26, 6), (40, 6)]:
        query = prompt[:n_tokens] + [7] * max(0, n_tokens - len(prompt))
        hit = store.lookup(query, "m")
        assert hit == blocks[:n_blocks]
        pool.decref(hit)
    diverged = prompt[:13] + [0] + prompt[14:]  # token 13 lives in block 3
    hit = store.lookup(diverged, "m")
    assert hit == blocks[:3]
    pool.decref(hit)
    consistent(pool, store)


def test_lookup_gives_the_caller_a_reference():
    pool = BlockPool(8)
    store = PrefixStore(pool, BS)
    blocks = fill(pool, store, list(range(8)))
    assert [pool.refcount(b) for b in blocks] == [1, 1]
    hit = store.lookup(list(range(8)), "m")
    assert [pool.refcount(b) for b in hit] == [2, 2]
    pool.decref(hit)
    assert pool.num_used == 2 and len(store) == 2


def test_misses_and_stats():
    pool = BlockPool(16)
    store = PrefixStore(pool, BS)
    fill(pool, store, list(range(12)))
    assert store.lookup([99] + list(range(1, 12)), "m") == []  # first block differs
    assert store.lookup([0, 1, 2], "m") == []  # no full block asked
    hit = store.lookup(list(range(8)) + [5, 5, 5, 5, 5], "m")
    pool.decref(hit)
    stats = store.stats
    assert (stats.lookups, stats.query_blocks, stats.hit_blocks, stats.miss_blocks) == (3, 6, 2, 4)
    assert stats.hit_rate == pytest.approx(2 / 6)
    assert (stats.inserted_blocks, stats.evicted_blocks, stats.reclaimed_blocks) == (3, 0, 0)
    stats.lookups = 100  # a snapshot, not the live counters
    assert store.stats.lookups == 3


def test_partial_last_block_is_never_stored_nor_returned():
    pool = BlockPool(8)
    store = PrefixStore(pool, BS)
    tokens = list(range(7))  # one full block, three tokens in the second
    blocks = pool.allocate(2)
    assert store.insert(tokens, blocks, "m") == 1
    assert len(store) == 1 and pool.refcount(blocks[1]) == 1  # the store took no reference on it
    for query in (tokens, tokens + [7]):
        hit = store.lookup(query, "m")
        assert hit == blocks[:1]
        pool.decref(hit)
    assert store.insert(list(range(3)), blocks[:1], "m") == 0  # not even one full block


def test_namespaces_are_isolated():
    pool = BlockPool(16)
    store = PrefixStore(pool, BS)
    tokens = list(range(8))
    a_blocks = fill(pool, store, tokens, "a")
    for other in ("ab", "", "A", "a ", "a\x00", "b"):
        assert store.lookup(tokens, other) == []
    ab_blocks = fill(pool, store, tokens, "ab")
    assert set(ab_blocks).isdisjoint(a_blocks) and len(store) == 4
    for namespace, blocks in (("a", a_blocks), ("ab", ab_blocks)):
        hit = store.lookup(tokens, namespace)
        assert hit == blocks
        pool.decref(hit)
    consistent(pool, store)


def test_namespace_enters_every_block_hash_unambiguously():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    assert chain_hashes(tokens, "a", 4)[1] != chain_hashes(tokens, "ab", 4)[1]
    # Without the namespace's length in the encoding these two would be the same bytes:
    # "x" | count 1 | token 0   and   "x\x01\x00..." | count 0.
    assert block_hash(ROOT, "x", [0]) != block_hash(ROOT, "x\x01" + "\x00" * 7, [])
    assert block_hash(ROOT, "", [0]) != block_hash(ROOT, "\x00", [])
    # The chain, not just the block's own tokens: the same block after different prefixes differs.
    assert chain_hashes([0, 0, 5, 5], "a", 2)[1] != chain_hashes([1, 1, 5, 5], "a", 2)[1]
    assert block_hash(ROOT, "a", [5, 5]) != chain_hashes([0, 0, 5, 5], "a", 2)[1]


def test_inserting_a_prefix_already_stored_stores_nothing_new():
    pool = BlockPool(16)
    store = PrefixStore(pool, BS)
    first = fill(pool, store, list(range(8)))
    second = pool.allocate(3)  # another request computed the same prompt before the first was stored
    assert store.insert(list(range(12)), second, "m") == 1  # only its third block is new
    assert [pool.refcount(b) for b in second] == [1, 1, 2]
    hit = store.lookup(list(range(12)), "m")
    assert hit == [*first, second[2]]
    pool.decref(hit)
    pool.decref(second)
    consistent(pool, store)


def test_insert_refuses_bad_blocks_and_changes_nothing():
    pool = BlockPool(8)
    store = PrefixStore(pool, BS)
    stored = fill(pool, store, list(range(4)), release=False)
    with pytest.raises(ConfigError, match="12 tokens fill 3 blocks of 4, but only 2 block ids were given"):
        store.insert(list(range(12)), pool.allocate(2), "m")
    with pytest.raises(UnsupportedOperationError, match="which is free"):
        store.insert(list(range(8)), [stored[0], 7], "m")
    # A cache that rewrote a stored block in place (crop without copying) is caught, not stored.
    with pytest.raises(UnsupportedOperationError, match=f"block {stored[0]} is already stored"):
        store.insert([9, 9, 9, 9], stored, "m")
    with pytest.raises(ConfigError, match="namespace must be a str"):
        store.lookup([1, 2, 3, 4], None)
    assert len(store) == 1 and store.stats.inserted_blocks == 1
    consistent(pool, store)


def test_eviction_is_least_recently_used_first():
    pool = BlockPool(16)
    store = PrefixStore(pool, BS)
    seqs = {name: [k] * BS for k, name in enumerate("abc")}
    blocks = {name: fill(pool, store, seq)[0] for name, seq in seqs.items()}
    pool.decref(store.lookup(seqs["a"], "m"))  # a becomes the most recently used
    assert store.evict(1) == 1
    assert store.lookup(seqs["b"], "m") == [] and pool.refcount(blocks["b"]) == 0
    assert store.evict(1) == 1
    assert store.lookup(seqs["c"], "m") == []
    pool.decref(store.lookup(seqs["a"], "m"))
    assert len(store) == 1 and store.stats.evicted_blocks == 2


def test_a_chain_is_evicted_from_its_tail():
    pool = BlockPool(16)
    store = PrefixStore(pool, BS)
    chain = fill(pool, store, list(range(12)))
    other = fill(pool, store, [50] * BS)  # used after the chain
    assert store.evict(1) == 1 and pool.refcount(chain[2]) == 0  # the chain's tail, not its root
    hit = store.lookup(list(range(12)), "m")
    assert hit == chain[:2]
    pool.decref(hit)  # the chain is now more recent than `other`
    assert store.evict(1) == 1 and pool.refcount(other[0]) == 0 and len(store) == 2
    consistent(pool, store)


def test_eviction_never_touches_blocks_a_cache_still_uses():
    pool = BlockPool(16)
    store = PrefixStore(pool, BS)
    fill(pool, store, list(range(12)))
    live = store.lookup(list(range(8)), "m")  # a cache holds the first two blocks
    assert store.evict(10) == 1  # only the idle tail goes
    assert [pool.refcount(b) for b in live] == [2, 2]
    pool.decref(live)
    assert store.evict(10) == 2 and len(store) == 0 and pool.num_free == 16


def test_a_parent_stays_while_a_cache_holds_its_child():
    pool = BlockPool(8)
    store = PrefixStore(pool, BS)
    blocks = fill(pool, store, list(range(8)), release=False)
    pool.decref(blocks[:1])  # a sliding-window cache dropped the first block, keeps the second
    assert store.evict(8) == 0  # child is live; its idle parent stays so the child stays reachable
    hit = store.lookup(list(range(8)), "m")
    assert hit == blocks
    pool.decref(hit)
    pool.decref(blocks[1:])
    assert store.evict(8) == 2
    consistent(pool, store)


def test_max_blocks_bounds_the_store():
    pool = BlockPool(initial=8)
    store = PrefixStore(pool, BS, max_blocks=3)
    held = pool.allocate(5)
    assert store.insert(list(range(20)), held, "m") == 3  # nothing idle to evict: the first three fit
    pool.decref(held)
    assert len(store) == 3 and pool.refcount(held[3]) == 0
    assert fill(pool, store, [7] * 8) and len(store) == 3  # evicted the first prompt's last two blocks
    hit = store.lookup(list(range(20)), "m")
    assert hit == held[:1]
    pool.decref(hit)
    assert store.stats.evicted_blocks == 2
    consistent(pool, store)
    pool = BlockPool(4)
    assert PrefixStore(pool, BS, max_blocks=0).insert([1] * 8, pool.allocate(2), "m") == 0


def test_max_blocks_keeps_the_stored_part_of_the_chain_being_extended():
    pool = BlockPool(8)
    store = PrefixStore(pool, BS, max_blocks=2)
    fill(pool, store, list(range(4)))  # idle, least recently used, and the parent of what comes
    fill(pool, store, [9] * 4)
    blocks = pool.allocate(2)
    assert store.insert(list(range(8)), blocks, "m") == 1  # evicts [9]*4, not the parent
    hit = store.lookup(list(range(8)), "m")
    assert len(hit) == 2 and hit[1] == blocks[1]
    pool.decref(hit)
    pool.decref(blocks)
    consistent(pool, store)


def test_a_full_pool_of_stored_blocks_serves_a_new_request_by_reclaiming():
    pool = BlockPool(8)
    store = PrefixStore(pool, BS)
    old = fill(pool, store, list(range(16)))  # 4 blocks
    recent = fill(pool, store, list(range(100, 116)))  # 4 blocks, more recent
    assert pool.num_free == 0 and len(store) == 8
    new = pool.allocate(5)  # evicts the 4 old blocks and the tail of the recent prompt
    assert sorted(new) == sorted(old + recent[3:])
    assert store.stats.reclaimed_blocks == 5 == store.stats.evicted_blocks
    hit = store.lookup(list(range(100, 116)), "m")
    assert hit == recent[:3]
    pool.decref(hit)
    assert store.lookup(list(range(16)), "m") == []
    consistent(pool, store)


def test_reclaim_cannot_take_live_blocks_and_the_error_says_so():
    pool = BlockPool(8)
    store = PrefixStore(pool, BS)
    fill(pool, store, list(range(8)))  # 2 idle stored blocks
    live = fill(pool, store, list(range(50, 66)), release=False)  # 4 stored blocks a cache uses
    message = "needs 5 blocks, 4 free of 8 (2 held only by the prefix store were reclaimed)"
    with pytest.raises(CapacityError, match=re.escape(message)):
        pool.allocate(5)
    assert [pool.refcount(b) for b in live] == [2] * 4 and len(store) == 4
    consistent(pool, store)


def test_clear_and_release_return_every_block():
    pool = BlockPool(initial=4)
    store = PrefixStore(pool, BS)
    fill(pool, store, list(range(40)))
    live = store.lookup(list(range(12)), "m")
    store.clear()
    assert len(store) == 0 and [pool.refcount(b) for b in live] == [1, 1, 1]
    pool.decref(live)
    assert pool.num_free == pool.capacity
    consistent(pool, store)


class StoreModel(RuleBasedStateMachine):
    """Requests of random prompts share a small fixed pool through the store.

    Safety: every block a lookup returns holds exactly the tokens (and namespace) asked for, whatever
    the interleaving of inserts, releases, evictions, reclaims and `max_blocks`. No leaks: every
    reference is a live request's or the store's, and releasing everything empties the pool.
    """

    @initialize(max_blocks=st.none() | st.integers(0, 8))
    def build(self, max_blocks):
        self.pool = BlockPool(12)
        self.store = PrefixStore(self.pool, 2, max_blocks=max_blocks)
        self.content = {}  # block id -> (namespace, every token up to the end of this block)
        self.live = []  # (namespace, tokens, block ids) of requests holding one reference per block

    @rule(namespace=st.sampled_from(["", "a", "ab"]), tokens=st.lists(st.integers(0, 2), max_size=9))
    def request(self, namespace, tokens):
        hit = self.store.lookup(tokens, namespace)
        for i, b in enumerate(hit):
            assert self.content[b] == (namespace, tuple(tokens[: 2 * (i + 1)]))
        try:
            fresh = self.pool.allocate(-(-len(tokens) // 2) - len(hit))
        except CapacityError:
            self.pool.decref(hit)
            return
        blocks = hit + fresh
        for i in range(len(hit), len(blocks)):
            self.content[blocks[i]] = (namespace, tuple(tokens[: 2 * (i + 1)]))
        self.live.append((namespace, tokens, blocks))

    @rule(data=st.data())
    def insert(self, data):
        if self.live:
            namespace, tokens, blocks = data.draw(st.sampled_from(self.live))
            self.store.insert(tokens, blocks, namespace)

    @rule(data=st.data())
    def release(self, data):
        if self.live:
            _, _, blocks = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
            self.pool.decref(blocks)

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        assert self.store.evict(n) <= n

    @rule(n=st.integers(1, 12))
    def pressure(self, n):
        try:
            self.pool.decref(self.pool.allocate(n))
        except CapacityError:
            pass

    @rule()
    def clear(self):
        self.store.clear()

    @invariant()
    def references_add_up(self):
        if hasattr(self, "pool"):
            consistent(self.pool, self.store)
            refs = sum(self.pool.refcount(b) for b in range(self.pool.capacity))
            assert refs == sum(len(blocks) for _, _, blocks in self.live) + len(self.store)

    def teardown(self):
        if hasattr(self, "pool"):
            for _, _, blocks in self.live:
                self.pool.decref(blocks)
            self.store.clear()
            assert self.pool.num_free == self.pool.capacity


TestStoreModel = StoreModel.TestCase
TestStoreModel.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
