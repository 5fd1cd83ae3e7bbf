"""OffloadedCache and the Offloaded placement where the host is the compute device: host tier, disk tier,
compositions, errors. Always on the CPU, whatever device the suite runs on (the CUDA path, with pinned memory
and side streams, is tested in test_cuda_paths.py and test_offloaded_stateful.py)."""

from __future__ import annotations

import errno
import gc
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_kvplus.placement.disk as disk_module
from hf_kvplus import (
    ConfigError,
    DenseCache,
    DiskTierError,
    H2OCache,
    Offloaded,
    OffloadedCache,
    PagedCache,
    PagedPool,
    QuantizedCache,
    SinkCache,
    UnsupportedOperationError,
    cache_kwargs,
)

LAYERS = 4
pytestmark = pytest.mark.usefixtures("on_cpu")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )
    with torch.device("cpu"):
        return LlamaForCausalLM(config).eval()


@pytest.fixture
def prompt():
    return torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1), device="cpu")


def generate(model, ids, cache, **kwargs):
    kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0} | kwargs
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), **kwargs)


def held(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def assert_same_kv(cache, reference) -> None:
    for (k, v), ref in zip(held(cache), reference.layers, strict=True):
        assert torch.equal(k, ref.keys) and torch.equal(v, ref.values)


def test_host_tier_is_identical_to_dynamic_and_holds_every_byte_on_the_host(model, prompt):
    expected = generate(model, prompt, DynamicCache(config=model.config))
    reference = DenseCache(model.config)  # the same storage on the device: the same attention path, bit for bit
    generate(model, prompt, reference)
    cache = OffloadedCache(model.config)
    assert torch.equal(generate(model, prompt, cache), expected)
    assert_same_kv(cache, reference)
    tiers = cache.tier_bytes()
    # Without CUDA the host is the compute device: no copies, every byte at rest in host memory.
    assert tiers.device == 0 and tiers.disk == 0
    assert tiers.host == cache.nbytes > 0


def test_disk_tier_spills_beyond_the_budget_reads_ahead_and_removes_its_files(model, prompt, tmp_path):
    expected = generate(model, prompt, DynamicCache(config=model.config))
    reference = DenseCache(model.config)
    generate(model, prompt, reference)
    cache = OffloadedCache(model.config, host_budget=0, folder=tmp_path)
    assert torch.equal(generate(model, prompt, cache), expected)
    assert_same_kv(cache, reference)
    tiers = cache.tier_bytes()
    assert tiers.host == 0 and tiers.disk == cache.nbytes > 0
    files = cache.placement.disk.files()
    assert len(files) == 2 * LAYERS and sum(f.stat().st_size for f in files) == tiers.disk
    cache.reset()
    assert cache.placement.disk.files() == [] and cache.tier_bytes().disk == 0
    root = cache.placement.disk.root
    assert root.exists()
    del cache
    gc.collect()
    assert not root.exists(), "the disk tier's folder outlived the cache"


def test_a_host_budget_keeps_the_first_layers_in_memory_and_spills_the_rest(model, prompt, tmp_path):
    probe = OffloadedCache(model.config)
    generate(model, prompt, probe)
    per_layer = probe.nbytes // LAYERS
    cache = OffloadedCache(model.config, host_budget=2 * per_layer, folder=tmp_path)
    expected = generate(model, prompt, DynamicCache(config=model.config))
    assert torch.equal(generate(model, prompt, cache), expected)
    tiers = cache.tier_bytes()
    assert 0 < tiers.host <= 2 * per_layer and tiers.host + tiers.disk == cache.nbytes


@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_at_most_lookahead_plus_one_layers_have_working_copies(model, prompt, tmp_path, lookahead):
    cache = OffloadedCache(model.config, lookahead=lookahead, host_budget=0, folder=tmp_path)
    placement, resident = cache.placement, []
    update = cache.update

    def counting_update(*args, **kwargs):
        out = update(*args, **kwargs)
        rests = [placement._rest(cache.layers[i].storage) for i in range(LAYERS)]
        resident.append(sum(r.installed is not None or r.fetch is not None for r in rests if r.on_disk))
        return out

    cache.update = counting_update
    generate(model, prompt, cache, max_new_tokens=6)
    assert max(resident) == lookahead + 1


def test_disk_reads_start_ahead_of_use(model, prompt, tmp_path):
    cache = OffloadedCache(model.config, lookahead=1, host_budget=0, folder=tmp_path)
    generate(model, prompt, cache, max_new_tokens=2)  # every layer is on disk from here on
    placement, misses = cache.placement, []
    start = placement._start_fetch

    def recording(rest):
        misses.append(placement._prefetching is False)
        start(rest)

    placement._prefetching = False
    prefetch = placement.prefetch

    def flagged_prefetch(storage):
        placement._prefetching = True
        try:
            prefetch(storage)
        finally:
            placement._prefetching = False

    placement._start_fetch, placement.prefetch = recording, flagged_prefetch
    with torch.no_grad():
        for token in range(3):
            cache_position = torch.tensor([cache.get_seq_length()])
            model(torch.full((2, 1), token), **cache_kwargs(cache), cache_position=cache_position)
    # Each step reads every layer once, all from a prefetch (layer 0 from the last layer's step).
    assert len(misses) == 3 * LAYERS and not any(misses)


def test_quantized_codes_cross_the_bus_and_match_the_quantized_cache(model, prompt):
    expected = generate(model, prompt, QuantizedCache(model.config, bits=4, group_size=16, window=16))
    cache = OffloadedCache(model.config, bits=4, group_size=16, window=16)
    assert torch.equal(generate(model, prompt, cache), expected)
    rest = cache.layers[1].storage.tensors()  # what the placement moves (here, with no copies, uses in place)
    assert rest["segment.k"].dtype == torch.uint8 and rest["segment.v"].dtype == torch.uint8
    assert rest["segment.k_scale"].dtype == torch.float16
    head_dim = model.config.head_dim
    assert rest["segment.k"].shape[-1] == head_dim // 2  # two int4 codes per byte: 1/8 of float32 on the bus
    assert cache.tier_bytes().host == cache.nbytes


def test_paged_blocks_move_and_tables_stay(model, prompt, tmp_path):
    expected = generate(model, prompt, PagedCache(model.config, block_size=8), num_beams=3)
    cache = PagedCache(model.config, block_size=8, placement=Offloaded(host_budget=0, folder=tmp_path))
    assert torch.equal(generate(model, prompt, cache, num_beams=3), expected)
    rest = cache.placement._rest(cache.layers[0].storage).rest
    assert set(rest) == {"k", "v"}  # the block tensors; the tables are the group's
    assert cache.tier_bytes().disk > 0


def test_evicting_cache_composes(model, prompt, tmp_path):
    expected = generate(model, prompt, H2OCache(model.config, budget=16), max_new_tokens=20)
    cache = H2OCache(model.config, budget=16, placement=Offloaded(host_budget=0, folder=tmp_path))
    assert torch.equal(generate(model, prompt, cache, max_new_tokens=20), expected)
    assert cache.tier_bytes().disk > 0
    sink = SinkCache(model.config, num_sinks=2, window=10, placement=Offloaded())
    assert torch.equal(
        generate(model, prompt, sink, max_new_tokens=20),
        generate(model, prompt, SinkCache(model.config, num_sinks=2, window=10), max_new_tokens=20),
    )


def test_a_full_disk_is_a_typed_error_raised_before_the_next_forward_and_the_cache_stays_whole(
    model, prompt, tmp_path, monkeypatch
):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    reference = DenseCache(model.config)
    cache = OffloadedCache(model.config, host_budget=0, folder=tmp_path)
    ids = torch.cat([prompt, torch.ones(2, 1, dtype=prompt.dtype)], dim=1)
    with torch.no_grad():
        model(prompt, **cache_kwargs(reference))
        monkeypatch.setattr(disk_module, "open", no_space, raising=False)
        model(prompt, **cache_kwargs(cache))  # every spill fails: the layers stay in host memory
        with pytest.raises(DiskTierError, match=r"could not write \d+ bytes .* bytes are free"):
            model(ids[:, -1:], **cache_kwargs(cache))
        assert [cache.get_seq_length(i) for i in range(LAYERS)] == [prompt.shape[1]] * LAYERS
        assert cache.tier_bytes().disk == 0 and cache.placement.disk.files() == []
        monkeypatch.undo()  # space again: the cache carries on and spills
        assert_same_kv(cache, reference)
        out = model(ids[:, -1:], **cache_kwargs(cache)).logits
        expected = model(ids[:, -1:], **cache_kwargs(reference)).logits
    assert torch.equal(out, expected)
    assert_same_kv(cache, reference)


def test_an_unusable_folder_is_refused_at_construction(model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(DiskTierError, match="a-file"):
        OffloadedCache(model.config, host_budget=0, folder=blocker / "kv")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lookahead": -1}, "lookahead"),
        ({"lookahead": 1.5}, "lookahead"),
        ({"host_budget": 1024}, "both host_budget and folder"),
        ({"folder": "/tmp"}, "both host_budget and folder"),
        ({"host_budget": -1, "folder": "/tmp"}, "host_budget"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Offloaded(**kwargs)


def test_storages_that_cannot_move_are_refused_at_construction(model):
    pytest.importorskip("optimum.quanto")
    with pytest.raises(UnsupportedOperationError, match="QuantoSegment"):
        QuantizedCache(model.config, bits=4, backend="quanto", placement=Offloaded())
    with pytest.raises(ConfigError, match="pool of its own"):
        PagedCache(model.config, pool=PagedPool(model.config), placement=Offloaded())


def test_on_device_caches_report_every_byte_on_the_device(model, prompt):
    cache = QuantizedCache(model.config, bits=8)
    generate(model, prompt, cache)
    assert cache.tier_bytes().device == cache.nbytes and cache.tier_bytes().host == 0


def test_written_regions_are_what_goes_back(model, prompt, tmp_path):
    """A decode step writes one token per layer back to the disk tier, not the layer."""
    cache = OffloadedCache(model.config, host_budget=0, folder=tmp_path)
    generate(model, prompt, cache, max_new_tokens=2)
    files = {Path(f): f.stat().st_mtime_ns for f in cache.placement.disk.files()}
    placement = cache.placement
    rest = placement._rest(cache.layers[1].storage)
    before = rest.rest["keys"].clone()
    with torch.no_grad():
        model(torch.ones(2, 1, dtype=torch.long), **cache_kwargs(cache), cache_position=torch.tensor([cache.get_seq_length()]))
        model(torch.ones(2, 1, dtype=torch.long), **cache_kwargs(cache), cache_position=torch.tensor([cache.get_seq_length()]))
    after = rest.rest["keys"]
    assert after.shape == before.shape, "the layer's file was rewritten instead of written in place"
    end = cache.layers[1].storage.end
    assert torch.equal(after[:, :, : end - 2], before[:, :, : end - 2])
    assert not torch.equal(after[:, :, end - 2 : end], before[:, :, end - 2 : end])
    assert set(map(Path, cache.placement.disk.files())) == set(files)  # same files, written in place


@pytest.mark.parametrize("bits", [None, 4])
def test_inference_mode_tensors_without_version_counters_are_written_back_right(model, tmp_path, bits):
    """Inference-mode tensors keep no version counter: write-backs go by the written regions, or whole."""
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2), device="cpu")
    options = {} if bits is None else {"bits": bits, "group_size": 16, "window": 16}
    caches = [
        QuantizedCache(model.config, **options) if bits else DenseCache(model.config),
        OffloadedCache(model.config, host_budget=0, folder=tmp_path, **options),
    ]
    runs = []
    with torch.inference_mode():
        for cache in caches:
            chunks = [model(ids[:, i : i + 8], **cache_kwargs(cache)).logits for i in range(0, 40, 8)]
            chunks += [model(ids[:, t : t + 1], **cache_kwargs(cache)).logits for t in range(20)]
            runs.append(torch.cat(chunks, dim=1))
    assert torch.equal(runs[0], runs[1])
