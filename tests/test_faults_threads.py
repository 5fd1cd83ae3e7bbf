"""A shared PagedPool and its prefix store under threads: what a server that hands one pool to its workers does.

What the pool promises: its operations (allocate, incref, decref, reclaim, the prefix store's lookup, insert and
eviction, a collected cache's release) are atomic, so after any interleaving every block is either free exactly once
or referenced, its count equal to the references of the live caches' tables and the store's; and every request
generates DynamicCache's tokens. The switch interval is made tiny so that threads interleave inside operations.
"""

import gc
import sys
import threading
from collections import Counter

import pytest
import torch
from transformers import DynamicCache

from conformance.models import get_model
from hf_kvplus import CapacityError, PagedCache, PagedPool, cache_kwargs
from hf_kvplus.paging import BlockPool, PrefixStore

THREADS, ROUNDS = 3, 16
NEW = 3


def prompts(n=12, length=42):
    """Prompts that share prefixes of 0, 8 and 16 tokens, so lookups hit, miss and extend chains."""
    g = torch.Generator().manual_seed(0)
    stem = torch.randint(3, 128, (1, 16), generator=g)
    out = []
    for k in range(n):
        shared = stem[:, : 8 * (k % 3)]
        out.append(torch.cat([shared, torch.randint(3, 128, (1, length - shared.shape[1]), generator=g)], dim=1))
    return [p.to(torch.get_default_device()) for p in out]


def expected_refs(pool: PagedPool, caches) -> Counter:
    """References each block should hold: one per appearance in a live cache's table, one if stored."""
    refs = Counter()
    for cache in caches:
        for table in cache.groups["full"].tables:
            refs.update(table)
    refs.update(e.block_id for e in pool.prefix_store._entries.values())
    return refs


def check_invariants(pool: PagedPool, caches) -> None:
    blocks = pool.blocks["full"]
    blocks.check()  # each block free exactly once, or counted
    pool.prefix_store.check()
    refs = expected_refs(pool, caches)
    counts = {i: blocks.refcount(i) for i in range(blocks.capacity) if blocks.refcount(i)}
    assert counts == dict(refs), f"reference counts {counts} differ from the live tables and the store {dict(refs)}"


@pytest.fixture
def tiny_switch_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@torch.no_grad()
def test_threads_sharing_one_pool_keep_its_blocks_and_outputs_exact(tiny_switch_interval):
    """THREADS workers, ROUNDS rounds each of reuse_prefix -> generate -> store_prefix on one 60-block pool (the store
    reclaims when it runs short). Mid-round (caches alive) and after each round (caches released, one in a reference
    cycle so that its finalizer runs in the collector on some thread), the invariants hold; every output is
    DynamicCache's."""
    model = get_model("llama")
    pool = PagedPool(model.config, block_size=8, num_blocks=60)
    ps = prompts()
    torch.set_num_threads(1)
    reference = [
        model.generate(p, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=NEW, do_sample=False)
        for p in ps
    ]
    live: dict[int, PagedCache] = {}
    failures: list[BaseException] = []
    lock = threading.Lock()

    def mid_round():
        check_invariants(pool, list(live.values()))

    def end_round():
        gc.collect()
        check_invariants(pool, [])

    middle, end = threading.Barrier(THREADS, action=mid_round), threading.Barrier(THREADS, action=end_round)

    def worker(w):
        try:
            for r in range(ROUNDS):
                k = (w * 5 + r * 7) % len(ps)
                cache = PagedCache(config=model.config, pool=pool)
                cache.reuse_prefix(ps[k])
                out = model.generate(ps[k], **cache_kwargs(cache), max_new_tokens=NEW, do_sample=False)
                assert torch.equal(out, reference[k]), f"worker {w} round {r}: other tokens than DynamicCache"
                cache.store_prefix(ps[k])
                with lock:
                    live[w] = cache
                middle.wait(timeout=60)
                with lock:
                    del live[w]
                if r % 2:
                    cache.cycle = cache  # released by the collector, on whichever thread runs it
                del cache
                end.wait(timeout=60)
        except BaseException as exc:  # noqa: BLE001 (reported below, with the other workers stopped)
            failures.append(exc)
            middle.abort()
            end.abort()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [f for f in failures if not isinstance(f, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    assert pool.prefix_store.stats.hit_blocks > 0 and pool.prefix_store.stats.inserted_blocks > 0


def test_block_pool_and_store_operations_are_atomic_under_threads(tiny_switch_interval):
    """Bare pool and store, no model: threads allocate, share, store, look up, evict and free as fast as they can;
    afterwards every block is free exactly once or held by the store, and nothing raised but `CapacityError`."""
    pool = BlockPool(40)
    store = PrefixStore(pool, block_size=2)
    errors: list[BaseException] = []

    def worker(w):
        try:
            for r in range(3000):
                tokens = [w % 2, r % 5, r % 3, 7]
                try:
                    ids = store.lookup(tokens, "ns")
                    ids += pool.allocate(2 - len(ids))
                except CapacityError:
                    continue
                pool.incref(ids)
                store.insert(tokens, ids, "ns")
                pool.decref(ids)
                pool.decref(ids)
                if r % 17 == 0:
                    store.evict(3)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, repr(errors[0])
    pool.check()
    store.check()
    stored = Counter(e.block_id for e in store._entries.values())
    assert {i: pool.refcount(i) for i in range(pool.capacity) if pool.refcount(i)} == dict(stored)
