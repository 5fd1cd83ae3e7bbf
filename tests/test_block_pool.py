"""BlockPool: reference counts, lowest-id-first reuse, all-or-nothing failures, growth, reclaim."""

import re

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_kvplus.errors import CapacityError, ConfigError, KVPlusError, UnsupportedOperationError
from hf_kvplus.paging import BlockPool


def snapshot(pool):
    return pool.capacity, pool.num_free, [pool.refcount(i) for i in range(pool.capacity)]


def test_allocate_hands_out_lowest_ids_with_count_one():
    pool = BlockPool(8)
    assert pool.is_fixed and pool.capacity == 8 and pool.num_free == 8 and pool.num_used == 0
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.refcount(i) for i in range(4)] == [1, 1, 1, 0]
    assert pool.allocate(0) == []
    assert (pool.num_free, pool.num_used) == (5, 3)
    pool.check()


def test_freed_ids_are_reused_lowest_first():
    pool = BlockPool(8)
    pool.allocate(6)
    assert pool.decref([4, 1, 3]) == [4, 1, 3]
    assert pool.allocate(2) == [1, 3]
    assert pool.allocate(3) == [4, 6, 7]
    pool.check()


def test_reference_counts():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.incref([a, a, b])
    assert (pool.refcount(a), pool.refcount(b)) == (3, 2)
    assert pool.decref([a, b]) == []
    assert pool.decref([b]) == [b]
    assert pool.decref([a, a]) == [a]
    assert pool.num_free == 4
    pool.check()


@pytest.mark.parametrize("bad", [[2], [0, 0], [9], [-1], ["x"], [None]])
def test_double_free_and_unknown_ids_raise_and_change_nothing(bad):
    pool = BlockPool(4)
    pool.allocate(2)  # blocks 0 and 1, one reference each
    before = snapshot(pool)
    with pytest.raises(UnsupportedOperationError):
        pool.decref([1, *bad])  # a valid drop first, then the bad part
    assert snapshot(pool) == before
    pool.check()


def test_free_block_cannot_be_increfed():
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(UnsupportedOperationError, match="incref of block 2, which is free"):
        pool.incref([0, 2])
    assert pool.refcount(0) == 1
    with pytest.raises(UnsupportedOperationError, match="block 4 does not exist in a pool of 4"):
        pool.refcount(4)


def test_double_free_message_names_block():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.decref([a])
    with pytest.raises(UnsupportedOperationError, match="block 0, which is free"):
        pool.decref([a])


def test_exhaustion_names_the_numbers_and_leaves_the_pool_as_it_was():
    pool = BlockPool(512)
    held = pool.allocate(500)
    pool.decref(held[10:14])  # holes in the middle: 16 free
    pool.incref(held[:3])
    before = snapshot(pool)
    with pytest.raises(CapacityError, match=re.escape("needs 37 blocks, 16 free of 512")) as info:
        pool.allocate(37)
    assert isinstance(info.value, KVPlusError)
    assert snapshot(pool) == before
    pool.check()
    assert pool.allocate(16) == list(range(10, 14)) + list(range(500, 512))


def test_errors_for_bad_arguments():
    for bad in (0, -3, 2.5):
        with pytest.raises(ConfigError):
            BlockPool(bad)
    with pytest.raises(ConfigError):
        BlockPool(initial=0)
    with pytest.raises(ConfigError, match="got -1"):
        BlockPool(4).allocate(-1)


def test_from_bytes_builds_a_fixed_pool_from_a_budget():
    pool = BlockPool.from_bytes(10_000, 3_000)
    assert pool.is_fixed and pool.capacity == 3
    with pytest.raises(ConfigError, match="budget of 1000 bytes holds no block of 4096 bytes"):
        BlockPool.from_bytes(1000, 4096)
    with pytest.raises(ConfigError):
        BlockPool.from_bytes(1000, 0)


def test_growable_pool_grows_by_an_eighth_at_least_initial_or_the_shortfall():
    pool = BlockPool(initial=4)
    seen = []
    pool.add_grow_listener(seen.append)
    assert not pool.is_fixed and pool.capacity == 4
    assert pool.allocate(4) == [0, 1, 2, 3] and seen == []
    assert pool.allocate(1) == [4] and seen == [8]  # grows by `initial`
    assert pool.allocate(20) == list(range(5, 25)) and seen == [8, 25]  # grows by the shortfall (17)
    pool.allocate(3)  # 25 // 8 = 3 < initial: grows by 4 more
    assert pool.capacity == 29 and seen[-1] == 29
    pool.check()


def test_large_growable_pool_grows_by_an_eighth():
    pool = BlockPool(initial=64)
    pool.allocate(64 * 9)  # 576 blocks
    capacity = pool.capacity
    pool.allocate(pool.num_free + 1)
    assert pool.capacity == capacity + capacity // 8


def test_growth_listener_failure_rolls_back_the_growth():
    pool = BlockPool(initial=2)
    pool.allocate(1)
    grown = []

    def storage_grows(capacity):
        grown.append(capacity)

    def out_of_memory(capacity):
        raise MemoryError(f"no room for {capacity} blocks")

    pool.add_grow_listener(storage_grows)
    pool.add_grow_listener(out_of_memory)
    before = snapshot(pool)
    with pytest.raises(MemoryError):
        pool.allocate(3)
    assert snapshot(pool) == before and grown == [4]
    pool.check()
    pool.remove_grow_listener(out_of_memory)
    assert pool.allocate(3) == [1, 2, 3]
    assert grown == [4, 4]


def test_fixed_pool_asks_the_reclaimer_before_failing():
    pool = BlockPool(6)
    store_held = pool.allocate(4)  # pretend only a prefix store holds these
    asked = []

    def reclaimer(needed):
        asked.append(needed)
        freed = store_held[:needed]
        del store_held[:needed]
        pool.decref(freed)
        return len(freed)

    pool.set_reclaimer(reclaimer)
    assert pool.allocate(2) == [4, 5] and asked == []  # enough free: not asked
    assert pool.allocate(3) == [0, 1, 2] and asked == [3]
    with pytest.raises(CapacityError, match=re.escape("needs 3 blocks, 1 free of 6 (1 held only by the prefix store were reclaimed)")):
        pool.allocate(3)
    assert asked == [3, 3] and pool.num_free == 1 and store_held == []
    pool.check()


def test_one_reclaimer_per_pool():
    pool = BlockPool(2)
    pool.set_reclaimer(lambda needed: 0)
    with pytest.raises(UnsupportedOperationError):
        pool.set_reclaimer(lambda needed: 0)
    pool.set_reclaimer(None)
    pool.set_reclaimer(lambda needed: 0)


def test_growable_pool_grows_instead_of_reclaiming():
    pool = BlockPool(initial=2)
    pool.set_reclaimer(lambda needed: pytest.fail("a growable pool must not reclaim"))
    assert pool.allocate(3) == [0, 1, 2]


def test_everything_freed_returns_the_pool_to_empty():
    pool = BlockPool(initial=8)
    tables = [pool.allocate(n) for n in (3, 9, 1, 20)]
    pool.incref(tables[1][:4])  # a forked sequence shares a prefix
    for table in tables:
        pool.decref(table)
    pool.decref(tables[1][:4])
    assert pool.num_free == pool.capacity and pool.num_used == 0
    pool.check()


class PoolModel(RuleBasedStateMachine):
    """Random allocate / incref / decref against a dict of counts; `check()` after every step."""

    fixed = True

    @initialize(capacity=st.integers(1, 12))
    def build(self, capacity):
        self.pool = BlockPool(capacity) if self.fixed else BlockPool(initial=capacity)
        self.counts = {}  # id -> count, live ids only

    def free_ids(self):
        return sorted(set(range(self.pool.capacity)) - set(self.counts))

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        free = self.free_ids()
        if n > len(free) and self.fixed:
            with pytest.raises(CapacityError, match=f"needs {n} blocks, {len(free)} free of {self.pool.capacity}"):
                self.pool.allocate(n)
            return
        old_capacity = self.pool.capacity
        ids = self.pool.allocate(n)
        free += list(range(old_capacity, self.pool.capacity))
        assert ids == free[:n]
        self.counts.update(dict.fromkeys(ids, 1))

    @precondition(lambda self: self.counts)
    @rule(data=st.data())
    def incref(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.counts)), max_size=4))
        self.pool.incref(ids)
        for i in ids:
            self.counts[i] += 1

    @precondition(lambda self: self.counts)
    @rule(data=st.data())
    def decref(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.counts)), max_size=4))
        need = {i: ids.count(i) for i in ids}
        if any(need[i] > self.counts[i] for i in need):
            with pytest.raises(UnsupportedOperationError):
                self.pool.decref(ids)
            return
        freed = self.pool.decref(ids)
        expected = []
        for i in ids:
            self.counts[i] -= 1
            if self.counts[i] == 0:
                del self.counts[i]
                expected.append(i)
        assert freed == expected

    @rule(data=st.data())
    def decref_a_free_block(self, data):
        free = self.free_ids()
        if free:
            with pytest.raises(UnsupportedOperationError):
                self.pool.decref([data.draw(st.sampled_from(free))])

    @invariant()
    def agrees_with_the_model(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check()
        assert [self.pool.refcount(i) for i in range(self.pool.capacity)] == [
            self.counts.get(i, 0) for i in range(self.pool.capacity)
        ]
        assert self.pool.num_used == len(self.counts)

    def teardown(self):
        if hasattr(self, "pool"):
            for i, count in list(self.counts.items()):
                self.pool.decref([i] * count)
            assert self.pool.num_free == self.pool.capacity
            self.pool.check()


class GrowablePoolModel(PoolModel):
    fixed = False


TestFixedPool = PoolModel.TestCase
TestFixedPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestGrowablePool = GrowablePoolModel.TestCase
TestGrowablePool.settings = settings(max_examples=75, stateful_step_count=40, deadline=None)
