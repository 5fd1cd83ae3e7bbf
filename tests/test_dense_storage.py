"""DenseStorage against a plain list-of-tokens model of what it should hold."""

import pytest
import torch

from hf_kvplus import CacheMismatchError, CapacityError, DenseStorage


def kv(batch, tokens, heads=2, dim=8):
    return torch.randn(batch, heads, tokens, dim), torch.randn(batch, heads, tokens, dim)


def test_append_view_and_growth_keep_every_token():
    storage, keys, values = DenseStorage(), [], []
    for n in [5, 1, 1, 70, 1, 200, 3]:
        k, v = kv(2, n)
        storage.append(k, v)
        keys.append(k)
        values.append(v)
        full_k, full_v = storage.view(storage.length)
        assert torch.equal(full_k, torch.cat(keys, 2)) and torch.equal(full_v, torch.cat(values, 2))
    assert storage.length == 281 and storage.capacity >= 281
    assert torch.equal(storage.view(4)[0], torch.cat(keys, 2)[:, :, -4:])


def test_views_are_slices_of_the_buffer_not_copies():
    storage = DenseStorage()
    storage.append(*kv(1, 10))
    k, _ = storage.view(10)
    assert k.untyped_storage().data_ptr() == storage.keys.untyped_storage().data_ptr()


def test_drop_front_and_back_then_compaction_keeps_order():
    storage, reference = DenseStorage(), []
    for step in range(300):
        k, v = kv(1, 1 if step else 500)
        storage.append(k, v)
        reference.append(k)
        if storage.length > 7:  # a window of 7 tokens
            storage.drop_front(storage.length - 7)
            reference = [torch.cat(reference, 2)[:, :, -7:]]
    assert torch.equal(storage.view(7)[0], torch.cat(reference, 2)[:, :, -7:])
    assert storage.capacity <= 128, "a windowed layer must not keep a prefill-sized buffer"
    storage.drop_back(3)
    assert torch.equal(storage.view(4)[0], torch.cat(reference, 2)[:, :, -7:-3])


def test_index_batch_reorders_selects_and_repeats():
    storage = DenseStorage()
    k, v = kv(3, 6)
    storage.append(k, v)
    storage.index_batch(torch.tensor([2, 2, 0]))
    assert torch.equal(storage.view(6)[0], k[[2, 2, 0]])
    storage.index_batch(torch.tensor([1]))
    assert torch.equal(storage.view(6)[1], v[[2]])
    storage.index_batch(torch.tensor([0, 0]))
    assert torch.equal(storage.view(6)[0], k[[2, 2]])


def test_fixed_capacity_raises_with_numbers_and_stays_consistent():
    storage = DenseStorage(max_tokens=10)
    k, v = kv(1, 8)
    storage.append(k, v)
    with pytest.raises(CapacityError, match=r"needs 11 slots; max_tokens is 10"):
        storage.append(*kv(1, 3))
    assert storage.length == 8 and torch.equal(storage.view(8)[0], k)
    storage.append(*kv(1, 2))
    assert storage.length == 10 and storage.capacity == 10


def test_mismatched_tensors_are_refused():
    storage = DenseStorage()
    storage.append(*kv(1, 4))
    with pytest.raises(CacheMismatchError, match="kv_heads=2"):
        storage.append(*kv(1, 1, heads=3))
    k, v = kv(1, 1)
    with pytest.raises(CacheMismatchError, match="torch.float64"):
        storage.append(k.double(), v.double())


def test_headroom_stays_an_eighth_of_the_held_tokens_plus_a_granule():
    storage = DenseStorage()
    storage.append(*kv(1, 1000))
    for _ in range(3000):
        storage.append(*kv(1, 1))
        assert storage.capacity - storage.length <= storage.length // 8 + 2 * 64


def test_memory_counts_payload_and_headroom():
    storage = DenseStorage()
    assert storage.memory().total_bytes == 0
    storage.append(*kv(2, 10, heads=3, dim=16))
    report = storage.memory()
    per_token = 2 * 2 * 3 * 16 * 4  # K and V, batch 2, 3 heads, head_dim 16, float32
    assert report.payload_bytes == 10 * per_token
    assert report.payload_bytes + report.reserved_bytes == storage.keys.nbytes + storage.values.nbytes
    storage.reset()
    assert storage.memory().total_bytes == 0 and storage.length == 0
