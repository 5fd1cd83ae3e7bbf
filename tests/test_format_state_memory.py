"""A layer's format state (a rotated format's key centre: the centre, its rotated copies, a turning centre's W and W R)
is bytes at rest: the memory report counts it, so that the report equals every tensor a quantized layer holds (what a
saved cache writes). A turning centre's position tables are derived from the model's RoPE alone: one copy per cache,
held by its rotary basis, not saved, counted once apart (`quantized_report()["derived_bytes"]`)."""

import pytest
import torch
from transformers import LlamaConfig

from hf_kvplus import QuantizedCache, SinkCache
from hf_kvplus.kernels.rotated_format import turning_key_center
from hf_kvplus.memory import tensor_bytes


def config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2, head_dim=64,
        vocab_size=64, intermediate_size=64,
    )  # fmt: skip


def held_bytes(cache) -> tuple[int, int]:
    """(bytes of every tensor the layers' storages hold, bytes of their formats' state)."""
    storage = sum(tensor_bytes(list(layer.storage.tensors().values())) for layer in cache.layers)
    state = sum(tensor_bytes(list(f.state_tensors(s))) for layer in cache.layers
                for f, s in zip(layer.storage.formats(), layer.storage.states(), strict=True))
    return storage, state


@pytest.mark.parametrize("max_tokens", [None, 512], ids=["growing", "static"])
@pytest.mark.parametrize("bits", ["k4v2", "int4"])
def test_memory_report_counts_the_format_state(bits, max_tokens, on_cpu):
    cache = QuantizedCache(config(), bits=bits, max_tokens=max_tokens)
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        keys = torch.randn(1, 3, 300, 64, generator=g) + torch.linspace(-2, 2, 64)
        cache.update(keys.half(), torch.randn(1, 3, 300, 64, generator=g).half(), layer)
    storage, state = held_bytes(cache)
    if bits == "k4v2":  # a key centre per layer: [3, 64] float32 and its copies, W and W R [3, 64, 64] float32
        assert state >= 2 * 2 * 3 * 64 * 64 * 4
    else:
        assert state == 0
    assert cache.memory_report().total_bytes == storage + state


@pytest.mark.parametrize("bits", ["k4v2", "int4"])
def test_evicting_slots_count_the_format_state(bits, on_cpu):
    """Rotated slots hold their layer's key centre too: a sink cache's report is its slots' tensors and that state."""
    cache = SinkCache(config(), num_sinks=4, window=124, bits=bits)
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        keys = torch.randn(1, 3, 300, 64, generator=g) + torch.linspace(-2, 2, 64)
        cache.update(keys.half(), torch.randn(1, 3, 300, 64, generator=g).half(), layer)
    storage, state = held_bytes(cache)
    assert (state > 0) == (bits == "k4v2")
    assert cache.memory_report().total_bytes == storage + state


def test_position_tables_are_one_copy_per_cache_and_not_bytes_at_rest(on_cpu):
    """Every layer's turning centre reads one table object (the cache's rotary basis's); the report counts the centres
    per layer but the tables nowhere in bytes at rest, and once in `derived_bytes`."""
    cache = QuantizedCache(config(), bits="k4v2", max_tokens=512)  # a static storage prepares the tables at its fill
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        keys = torch.randn(1, 3, 300, 64, generator=g) + torch.linspace(-2, 2, 64)
        cache.update(keys.half(), torch.randn(1, 3, 300, 64, generator=g).half(), layer)
    centers = [turning_key_center(layer.storage.states()[0]) for layer in cache.layers]
    assert all(c is not None and c.mu is not None for c in centers)
    assert centers[0] is not centers[1]  # each layer its own centre ...
    assert centers[0].tables is centers[1].tables  # ... and one copy of the position tables
    tables = tensor_bytes(list(centers[0].tables.tensors()))
    assert tables > 0
    storage, state = held_bytes(cache)
    assert state == sum(tensor_bytes(list(c.tensors())) for c in centers)
    assert cache.memory_report().total_bytes == storage + state  # the tables are not bytes at rest ...
    assert cache.quantized_report()["derived_bytes"] == tables  # ... and counted once, not once per layer
