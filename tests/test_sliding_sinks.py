"""A layer's sinks kept beside the codes (`QuantizedStorage(sinks=)`): 16-bit copies of the coded tokens with the
shortest values (a sliding-window layer's, a full-attention layer's in place of its exact first tokens).

Each storage with sinks is checked against a twin without them fed the same tokens (the same codes): everything it
reads is the twin's, but the tokens its copies hold, which read as the copies (the tokens in float16: these tests'
tokens are float32); the copies are the shortest values coded
(the longest over heads, per row); a decode through the kernel route, with the model's mask and after tokens were
dropped between `update` and attention, is attention over that dense view; what the segment drops or rolls back is
not read from a copy again; rows follow batch operations; bits count the copies.
"""

import pytest
import torch
from kernel_checks import reference

from hf_kvplus import ConfigError, OffloadedCache, QuantizedCache
from hf_kvplus.attention.route import attend
from hf_kvplus.kernels.quant_format import QuantFormat
from hf_kvplus.kernels.rotated_format import RotatedFormat
from hf_kvplus.precision import layer_region_bits
from hf_kvplus.specs import parse_cache_spec
from hf_kvplus.storage.packed_segment import PackedSegment
from hf_kvplus.storage.quantized import QuantizedStorage
from hf_kvplus.storage.reads import PackedRead

FORMATS = {"int4": lambda: QuantFormat(4, 4), "k3v2": lambda: RotatedFormat(3, 2, 1)}


def pair(fmt: str, sinks: int = 3, window: int = 8) -> tuple[QuantizedStorage, QuantizedStorage]:
    """A storage with `sinks` and its twin without, of the same format."""
    return (QuantizedStorage(PackedSegment(FORMATS[fmt]()), window=window, sinks=sinks),
            QuantizedStorage(PackedSegment(FORMATS[fmt]()), window=window))  # fmt: skip


def tokens(batch: int, n: int, heads: int = 2, dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values whose value lengths differ widely, so that the shortest are a clear choice."""
    k = torch.randn(batch, heads, n, dim)
    v = torch.randn(batch, heads, n, dim) * torch.rand(batch, 1, n, 1).pow(2) * 4
    return k, v


def feed(stores, k, v):
    for s in stores:
        s.append(k, v)


def expected_view(s: QuantizedStorage, twin: QuantizedStorage, exact: tuple[torch.Tensor, torch.Tensor], last: int):
    """The twin's view of the `last` newest tokens with the sinks' tokens as their float16 copies (`exact`: every token
    held, in order)."""
    k, v = (t.clone() for t in twin.view(last))
    n = s.segment.length
    coded = last - min(last, s.recent.length)
    for row in range(k.shape[0]):
        for index in s.sink_index[row].tolist():
            at = index - (n - coded)
            if 0 <= at < coded:
                k[row, :, at] = exact[0][row, :, index + (exact[0].shape[2] - s.length)].half().float()
                v[row, :, at] = exact[1][row, :, index + (exact[1].shape[2] - s.length)].half().float()
    return k, v


@pytest.mark.parametrize("fmt", FORMATS)
def test_copies_hold_the_shortest_coded_values_and_read_over_the_codes(fmt, seed):
    s, twin = pair(fmt)
    held_k, held_v = [], []
    for n in [20, 1, 1, 7, 1, 13, 1, 1, 1]:
        k, v = tokens(2, n)
        feed((s, twin), k, v)
        held_k.append(k)
        held_v.append(v)
        all_k, all_v = torch.cat(held_k, 2), torch.cat(held_v, 2)
        assert s.length == twin.length == all_k.shape[2]
        coded = s.segment.length
        assert s.held_sinks == min(3, coded)
        # no token dropped: the copies are the shortest values of the coded tokens, longest over heads, per row
        lengths = all_v[:, :, :coded].norm(dim=-1).amax(dim=1)
        want = lengths.topk(s.held_sinks, dim=1, largest=False).indices.sort(dim=1).values
        assert torch.equal(s.sink_index.sort(dim=1).values, want)
        got = s.view(s.length)
        expected = expected_view(s, twin, (all_k, all_v), s.length)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert not torch.equal(got[1], twin.view(twin.length)[1]), "no copy read over its codes"


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "left-padded"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_is_attention_over_the_view_with_exact_sinks(fmt, padded, seed):
    """The kernel route (codes with the sinks' masked, then the copies and the window as the residual) gives what
    attention over the dense view gives; with a sliding window dropping tokens between `update` and attention."""
    s, twin = pair(fmt)
    k, v = tokens(2, 40)
    feed((s, twin), k, v)
    feed((s, twin), *tokens(2, 1))
    last = 30
    dense_k, dense_v = s.view(last)
    read = s.read(last, 1)
    assert isinstance(read, PackedRead) and read.recent_k.shape[2] == s.held_sinks + s.recent.length  # copies, window
    assert read.keys.shape[2] == read.values.shape[2] == last, "the placeholders must span the tokens read"
    s.drop_front(s.length - last + 1)  # the sliding window moves on before the layer attends
    mask = None
    if padded:
        mask = torch.ones(2, 1, 1, last, dtype=torch.bool)
        mask[1, ..., :5] = False
    q = torch.randn(2, 4, 1, 16)
    out, _ = attend(read, None, q, mask, 0.25)
    keep = None if mask is None else mask[:, 0, 0]
    ref = reference(q[:, :, 0], dense_k, dense_v, 0.25, keep)
    assert ((out[:, 0].double() - ref).norm() / ref.norm()).item() < 1e-5
    gathered = read.dense()
    assert torch.equal(gathered[0], dense_k) and torch.equal(gathered[1], dense_v)


@pytest.mark.parametrize("dropped", [3, 38], ids=["some-coded", "every-coded"])
def test_a_chunk_reads_what_it_was_given_whatever_the_window_drops_before_attention(dropped, seed):
    """A chunk's read (the SDPA path: `dense()`), taken before its sliding window drops tokens, gives the tokens as
    they were, the copies over their codes; dropping every coded token drops the copies from the storage too."""
    s, twin = pair("k3v2", window=8)
    feed((s, twin), *tokens(1, 30))
    feed((s, twin), *tokens(1, 12))
    last = s.length
    read = s.read(last, 12)
    want = read.dense()  # (the tokens this chunk pushed out of the window exact, as its queries attend them)
    assert not torch.equal(want[1], twin.read(last, 12).dense()[1]), "no copy read over its codes"
    s.drop_front(dropped)
    assert s.length == last - dropped and (s.held_sinks == 0) == (dropped == 38)
    got = read.dense()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_dropped_and_rolled_back_tokens_are_not_read_from_a_copy(seed):
    s, twin = pair("int4", sinks=4, window=4)
    k, v = tokens(1, 40)
    feed((s, twin), k, v)
    for store in (s, twin):
        store.drop_front(30)  # past most copies' tokens
    got = s.view(s.length)
    want = expected_view(s, twin, (k[:, :, 30:], v[:, :, 30:]), s.length)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (s.sink_index < 0).any(), "the drop left every copy in view: the test does not test it"
    k, v = tokens(1, 30)
    feed((s, twin), k, v)
    for store in (s, twin):
        store.drop_back(store.length - store.segment.length + 6)  # into the coded tokens, mid-group
    assert s.length == twin.length
    assert not (s.sink_index >= s.segment.length).any(), "a copy of a rolled-back token is still indexed"
    got, plain = s.view(s.length), twin.view(twin.length)
    copied = torch.zeros(s.length, dtype=torch.bool)
    copied[s.sink_index[0][(s.sink_index[0] >= 0) & (s.sink_index[0] < s.segment.length)]] = True
    assert torch.equal(got[1][:, :, ~copied], plain[1][:, :, ~copied])
    feed((s, twin), *tokens(1, 12))  # more tokens leave the window: the gone copies are the first replaced
    assert ((s.sink_index >= 0) & (s.sink_index < s.segment.length)).all()


def test_rows_follow_batch_operations(seed):
    s, twin = pair("k3v2")
    k, v = tokens(3, 30)
    feed((s, twin), k, v)
    for store in (s, twin):
        store.index_batch(torch.tensor([2, 0, 2]))
    want = expected_view(s, twin, (k[[2, 0, 2]], v[[2, 0, 2]]), s.length)
    got = s.view(s.length)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(s.sink_index[0], s.sink_index[2])


@pytest.mark.parametrize(("sinks", "first"), [(-1, 0), (2.0, 0), (True, 0), (4, 4)])
def test_bad_sinks_are_refused(sinks, first):
    with pytest.raises(ConfigError, match="sinks"):
        QuantizedStorage(PackedSegment(QuantFormat(4, 4)), window=8, first=first, sinks=sinks)


def test_bits_count_the_copies_as_bits_of_tokens_already_counted(seed):
    s, twin = pair("int4", sinks=4)
    feed((s, twin), *tokens(2, 60))

    class Layer:  # what `layer_region_bits` reads of a layer
        def __init__(self, storage):
            self.storage = storage
            self.spec = type("Spec", (), {"num_kv_heads": 2, "head_dim": 16})

    bits, coordinates = layer_region_bits(Layer(s), 8)
    twin_bits, twin_coordinates = layer_region_bits(Layer(twin), 8)
    assert coordinates == twin_coordinates
    assert bits - twin_bits == 4 * 2 * (2 * 2 * 16) * 16  # 4 copies x 2 rows x K and V coordinates x float16
    assert s.memory().payload_bytes - twin.memory().payload_bytes == 4 * 2 * (2 * 2 * 16) * 2


def test_gemma3_rotated_presets_keep_sinks_on_both_kinds_of_layer():
    """Sliding layers 4 copies beside the codes; full layers 16 in place of their first tokens, which a static storage
    (`max_tokens`) keeps; each count as asked, 0 turning it off."""
    from hf_kvplus.planning.configs import load_config
    from hf_kvplus.storage.static_quantized import StaticQuantizedStorage

    gemma = load_config("gemma-3-270m")
    kinds = gemma.layer_types

    def by_kind(cache) -> dict[str, set[tuple[int, int]]]:
        held = {}
        for layer, kind in zip(cache.layers, kinds, strict=True):
            held.setdefault(kind, set()).add((layer.storage.sinks, layer.storage.first))
        return held

    for bits in ("k2v2", "k3v2", "k4v2"):
        cache = QuantizedCache(gemma, bits=bits)
        assert by_kind(cache) == {"sliding_attention": {(4, 0)}, "full_attention": {(16, 0)}}
        assert cache.quantized_report()["family_defaults"] == "Gemma 3"
    assert by_kind(QuantizedCache(gemma, bits="k2v2", full_sinks=0)) == {"sliding_attention": {(4, 0)},
                                                                         "full_attention": {(0, 4)}}  # fmt: skip
    assert by_kind(QuantizedCache(gemma, bits="k2v2", full_sinks=8, sliding_sinks=0)) == {
        "sliding_attention": {(0, 0)}, "full_attention": {(8, 0)}}  # fmt: skip
    assert all(layer.storage.sinks == 0 for layer in QuantizedCache(gemma, bits="int4").layers)
    assert all(layer.storage.sinks == 0 for layer in QuantizedCache(gemma, bits="k2v2", family_defaults=False).layers)
    static = QuantizedCache(gemma, bits="k3v2", max_tokens=1024)
    full = [layer.storage for layer, kind in zip(static.layers, kinds, strict=True) if kind == "full_attention"]
    assert all(isinstance(s, StaticQuantizedStorage) and s.first == 4 for s in full)
    spec = parse_cache_spec("quantized:k3v2:sliding_sinks=2:full_sinks=6").build(gemma)
    assert by_kind(spec) == {"sliding_attention": {(2, 0)}, "full_attention": {(6, 0)}}
    # first tokens asked for are what the full layers keep, not the family's sinks in their place; both: refused
    asked = {"sliding_attention": {(4, 0)}, "full_attention": {(0, 8)}}
    assert by_kind(QuantizedCache(gemma, bits="k4v2", first_tokens=8)) == asked
    assert by_kind(parse_cache_spec("quantized:k4v2:first=8").build(gemma)) == asked
    assert by_kind(OffloadedCache(gemma, bits="k4v2", first_tokens=8)) == asked
    assert by_kind(OffloadedCache(gemma, bits="k4v2"))["full_attention"] == {(16, 0)}
    assert by_kind(QuantizedCache(gemma, bits="k4v2", first_tokens=0, full_sinks=12))["full_attention"] == {(12, 0)}
    with pytest.raises(ConfigError, match="full_sinks=16 .*first_tokens=4"):
        QuantizedCache(gemma, bits="k4v2", first_tokens=4, full_sinks=16)
    for bad in ("sliding_sinks=-1", "full_sinks=-1"):
        with pytest.raises(ConfigError, match="sinks"):
            parse_cache_spec(f"quantized:k3v2:{bad}")


def test_no_family_default_elsewhere():
    from hf_kvplus.planning.configs import load_config

    smol = load_config("smollm2-135m")
    assert all(layer.storage.sinks == 0 for layer in QuantizedCache(smol, bits="k2v2").layers)


@pytest.mark.parametrize(("sliding", "full"), [(2, 0), (0, 3)], ids=["sliding-sinks", "full-sinks"])
def test_a_gemma3_cache_with_sinks_decodes_saves_and_loads(tmp_path, sliding, full):
    """Through the tiny Gemma 3 (sliding windows of 8, an exact window of 4: its sliding layers code 4 tokens and drop
    them as the window moves on; its full layers code every token but the window): prefill in chunks, decode steps
    through the kernels, and a saved copy continuing with the same logits."""
    from conformance.models import build_model
    from hf_kvplus import load_cache
    from hf_kvplus.transformers_compat import cache_kwargs

    model = build_model("gemma3")
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    cache = QuantizedCache(model.config, bits="k3v2", window=4, sliding_sinks=sliding, full_sinks=full)
    kind = "sliding_attention" if sliding else "full_attention"
    held = [layer.storage for layer, t in zip(cache.layers, model.config.layer_types, strict=True)
            if t == kind and layer.storage.sinks]  # fmt: skip
    assert held and all(s.first == 0 for s in held)
    with torch.inference_mode():
        for start in range(0, 48, 16):
            model(input_ids=ids[:, start : start + 16], **cache_kwargs(cache), use_cache=True)
        assert any(s.held_sinks for s in held), "no sink held: the test does not test them"
        cache.save(tmp_path / "cache.safetensors")
        loaded = load_cache(tmp_path / "cache.safetensors", model.config)
        assert [s.held_sinks for s in held] == [layer.storage.held_sinks for layer in loaded.layers
                                                   if layer.storage.sinks]  # fmt: skip
        for token in torch.randint(3, 128, (6, 2, 1), generator=torch.Generator().manual_seed(1)):
            want = model(input_ids=token, **cache_kwargs(cache), use_cache=True).logits
            got = model(input_ids=token, **cache_kwargs(loaded), use_cache=True).logits
            assert torch.equal(got, want) and torch.isfinite(got).all()
