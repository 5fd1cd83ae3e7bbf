"""KVLayer against Transformers' own DynamicLayer / DynamicSlidingWindowLayer, driven by random steps."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from hf_kvplus import (
    DenseStorage,
    KeepAll,
    KVLayer,
    LayerSpec,
    OnDevice,
    SlidingWindow,
    UnsupportedOperationError,
    cache_kwargs,
)
from hf_kvplus.errors import CacheMismatchError, ShapeError

HEADS, DIM = 2, 4


def make_pair(window):
    if window is None:
        spec = LayerSpec(index=0, kind="full", window=None, num_kv_heads=HEADS, head_dim=DIM)
        return KVLayer(spec, DenseStorage(), KeepAll(), OnDevice()), DynamicLayer()
    spec = LayerSpec(index=0, kind="sliding", window=window, num_kv_heads=HEADS, head_dim=DIM)
    return KVLayer(spec, DenseStorage(), SlidingWindow(window), OnDevice()), DynamicSlidingWindowLayer(window)


steps = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.integers(1, 12)),
        st.tuples(st.just("crop"), st.integers(0, 3)),
        st.tuples(st.just("reorder"), st.permutations([0, 1, 2])),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(window=st.sampled_from([None, 2, 4, 9]), record=st.booleans(), ops=steps)
def test_layer_matches_transformers_layer(window, record, ops):
    ours, theirs = make_pair(window)
    if record:
        ours.activate_past_recording()
        if window is not None:
            theirs.activate_past_recording()
    since_crop = 0
    for op, arg in ops:
        if op == "update":
            assert ours.get_mask_sizes(arg) == theirs.get_mask_sizes(arg)
            k, v = torch.randn(3, HEADS, arg, DIM), torch.randn(3, HEADS, arg, DIM)
            got, want = ours.update(k, v), theirs.update(k.clone(), v.clone())
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            since_crop += arg
        elif op == "crop":
            # Roll back at most what was added since the last crop (what assisted decoding does).
            remove = min(arg, since_crop) if record else 0
            # Transformers' sliding layer cannot crop before its first update, nor once full unless recording.
            can_theirs = theirs.is_initialized and (window is None or theirs.get_seq_length() < window or record)
            if not can_theirs:
                continue
            ours.crop(-remove)
            theirs.crop(-remove)
            since_crop = 0
        elif ours.get_seq_length():
            beam_idx = torch.tensor(arg)
            ours.reorder_cache(beam_idx)
            theirs.reorder_cache(beam_idx)
        assert ours.get_seq_length() == theirs.get_seq_length()
        if theirs.keys is not None and theirs.keys.numel():
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_sliding_layer_holds_only_its_window():
    layer, _ = make_pair(window=4)
    layer.update(torch.randn(1, HEADS, 50, DIM), torch.randn(1, HEADS, 50, DIM))
    for _ in range(10):
        layer.update(torch.randn(1, HEADS, 1, DIM), torch.randn(1, HEADS, 1, DIM))
    assert layer.get_seq_length() == 60
    assert layer.storage.length == 3
    assert layer.get_mask_sizes(1) == (4, 57)
    assert layer.memory().tokens_held == 3 and layer.memory().tokens_seen == 60


def test_crop_past_what_a_window_dropped_is_refused_with_numbers():
    layer, _ = make_pair(window=4)
    layer.update(torch.randn(1, HEADS, 10, DIM), torch.randn(1, HEADS, 10, DIM))
    with pytest.raises(UnsupportedOperationError, match=r"holds 3 tokens; removing 2 would leave 1 but the next step needs 3"):
        layer.crop(-2)
    assert layer.get_seq_length() == 10 and layer.storage.length == 3


def test_batch_repeat_interleave_and_select():
    layer, _ = make_pair(window=None)
    k = torch.randn(2, HEADS, 5, DIM)
    layer.update(k, k.clone())
    layer.batch_repeat_interleave(3)
    assert torch.equal(layer.keys, k.repeat_interleave(3, dim=0))
    layer.batch_select_indices(torch.tensor([True, False, False, False, True, False]))
    assert torch.equal(layer.keys, k[[0, 1]])


def test_wrong_shapes_are_refused():
    layer, _ = make_pair(window=None)
    with pytest.raises(CacheMismatchError, match="built for 2 KV heads of head_dim 4"):
        layer.update(torch.randn(1, 3, 5, DIM), torch.randn(1, 3, 5, DIM))
    with pytest.raises(ShapeError, match=r"got \(2, 5, 4\)"):
        layer.update(torch.randn(1, HEADS, 5, DIM)[0], torch.randn(1, HEADS, 5, DIM)[0])
    with pytest.raises(ShapeError, match="disagree"):
        layer.update(torch.randn(1, HEADS, 5, DIM), torch.randn(1, HEADS, 4, DIM))


def test_reset_forgets_everything():
    layer, _ = make_pair(window=None)
    layer.update(torch.randn(1, HEADS, 5, DIM), torch.randn(1, HEADS, 5, DIM))
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.keys is None and layer.memory().total_bytes == 0


@pytest.mark.parametrize("window", [None, 6])
def test_slots_serve_an_ordered_retention_like_dense_storage(window):
    """Slot storage is a `KVStorage`: under keep-all or a window it attends like dense storage (the layer's one
    route: update, the storage's read, `attention.route`), and drops the oldest tokens when the window says so."""
    from conformance.models import get_model
    from hf_kvplus import KVCache, SlotStore

    model = get_model("llama")
    retention = (lambda spec: KeepAll()) if window is None else (lambda spec: SlidingWindow(window))
    caches = [KVCache(model.config, storage=lambda spec, make=make: make(), retention=retention) for make in (DenseStorage, SlotStore)]
    ids = torch.randint(3, 120, (2, 13), generator=torch.Generator().manual_seed(5), device="cpu")
    ids = ids.to(torch.get_default_device())
    logits = [[model(ids[:, :9], **cache_kwargs(cache)).logits[:, -1]] for cache in caches]
    for t in range(9, 13):
        for cache, out in zip(caches, logits, strict=True):
            out.append(model(ids[:, t : t + 1], **cache_kwargs(cache)).logits[:, -1])
    for got, want in zip(logits[1], logits[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    dense, slots = caches[0].layers[0], caches[1].layers[0]
    assert slots.storage.held == dense.storage.length == (13 if window is None else window - 1)
    torch.testing.assert_close(slots.keys, dense.keys)


class _Attention(torch.nn.Module):
    """An attention module as the dispatcher hands it to the layer (4 query heads over 2 KV heads)."""

    layer_idx, num_key_value_groups, is_causal = 0, 2, True


def _in_place_layer():
    """Layer 0 of a PagedCache: its reads are placeholders that only hf_kvplus's attention reads."""
    from transformers import LlamaConfig

    from hf_kvplus import PagedCache

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1)
    config._attn_implementation = "sdpa"  # as a loaded model's: decode steps take the fused path
    return PagedCache(config, block_size=8).layers[0]


def _step(layer, n=1):
    keys, values = layer.update(torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16))
    return torch.randn(1, 4, n, 16), keys, values


def _prefilled():
    """The layer after a prompt attended through hf_kvplus: its decode steps read the blocks in place."""
    layer = _in_place_layer()
    layer.attend(_Attention(), *_step(layer, 9), None, 0.25)
    return layer


@pytest.mark.parametrize("changed", ["keys", "values"])
def test_a_model_that_changes_what_an_in_place_read_returned_is_refused(changed):
    """A model whose code transforms the keys or values the cache returned before attending (repeats, splits) would
    attend to placeholders: the layer refuses, naming which, instead of computing on them."""
    from hf_kvplus import UnsupportedModelError

    layer = _prefilled()
    query, keys, values = _step(layer)
    keys, values = (keys.clone(), values) if changed == "keys" else (keys, values.clone())
    with pytest.raises(UnsupportedModelError, match=f"the model changed the {changed} this cache returned"):
        layer.attend(_Attention(), query, keys, values, None, 0.25)


def test_an_in_place_read_attended_outside_hf_kvplus_is_refused_at_the_next_update():
    """A model whose attention never comes through hf_kvplus read placeholders: its next update says so."""
    from hf_kvplus import UnsupportedModelError

    layer = _prefilled()
    layer.attend(_Attention(), *_step(layer), None, 0.25)  # a decode step through hf_kvplus: fine
    _step(layer)  # one whose attention goes elsewhere
    with pytest.raises(UnsupportedModelError, match="did not go through hf_kvplus, so it attended to placeholders"):
        _step(layer)


def test_families_whose_attention_bypasses_the_cache_take_dense_caches_only():
    from transformers import DiffLlamaConfig

    from hf_kvplus import DenseCache, PagedCache, QuantizedCache, SinkCache, UnsupportedModelError

    config = DiffLlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    assert DenseCache(config) is not None
    for build in (lambda: PagedCache(config), lambda: QuantizedCache(config, bits=4), lambda: SinkCache(config)):
        with pytest.raises(UnsupportedModelError, match="differential attention splits the cached values"):
            build()
