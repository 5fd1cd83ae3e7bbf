"""QuantizedStorage against a plain list of the tokens it was given: what stays exact, what is quantized
(within the format's analytic bound), and that a quantized group never changes again."""

import pytest
import torch
from kernel_checks import reference

from hf_kvplus import ConfigError
from hf_kvplus.attention.route import attend
from hf_kvplus.kernels.quant_format import QuantFormat
from hf_kvplus.storage.packed_segment import PackedSegment
from hf_kvplus.storage.quantized import QuantizedStorage
from hf_kvplus.storage.quanto_segment import QuantoSegment
from hf_kvplus.storage.reads import PackedRead

FORMATS = [8, 4, 2, "fp8"]
SEGMENTS = {"kvplus": PackedSegment, "quanto": QuantoSegment}


def kv(batch, tokens, heads=2, dim=16):
    k, v = torch.randn(batch, heads, tokens, dim), torch.randn(batch, heads, tokens, dim)
    k[..., 3] *= 20  # an outlier key channel, as real keys have
    return k, v


def bound(x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Elementwise error bound of a group quantizer for data whose groups span at most `x`'s range:
    half a step of the widest group, asymmetric (span) or symmetric (2 x absmax, quanto's 8-bit types);
    a loose, format-level bound for whole tensors (the kernels' tests check the exact per-group one)."""
    span = max((x.amax() - x.amin()).item(), 2 * x.abs().amax().item())
    if fmt.is_float:
        return x.abs() * 2**-4 + x.abs().amax() / 448 * 2**-9 + 1e-6
    return torch.full_like(x, span / fmt.qmax / 2 * 1.01 + 1e-6)


def storage(bits=4, group=4, window=8, backend="kvplus"):
    return QuantizedStorage(SEGMENTS[backend](QuantFormat(bits, group)), window=window)


@pytest.mark.parametrize("backend", SEGMENTS)
@pytest.mark.parametrize("bits", FORMATS)
def test_recent_window_is_exact_and_older_tokens_within_bound(bits, backend, seed):
    s, keys, values = storage(bits, backend=backend), [], []
    for n in [13, 1, 1, 1, 5, 1, 30, 1]:
        k, v = kv(2, n)
        s.append(k, v)
        keys.append(k)
        values.append(v)
        all_k, all_v = torch.cat(keys, 2), torch.cat(values, 2)
        got_k, got_v = s.view(s.length)
        assert s.length == all_k.shape[2] and got_k.shape == all_k.shape
        recent = s.recent.length
        assert recent >= min(s.window, s.length), "fewer exact tokens than the window promises"
        assert recent < s.window + 4 or s.segment.length == 0
        assert torch.equal(got_k[:, :, -recent:], all_k[:, :, -recent:]), f"seed {seed}"
        assert torch.equal(got_v[:, :, -recent:], all_v[:, :, -recent:])
        old = s.length - recent
        if old:
            assert ((got_k[:, :, :old] - all_k[:, :, :old]).abs() <= bound(all_k[:, :, :old], s.fmt)).all()
            assert ((got_v[:, :, :old] - all_v[:, :, :old]).abs() <= bound(all_v[:, :, :old], s.fmt)).all()
            assert not torch.equal(got_k[:, :, :old], all_k[:, :, :old]), "quantized tokens came back exact"


def test_a_quantized_group_never_changes_again(seed):
    s = storage(4)
    s.append(*kv(1, 20))
    first = s.segment.dequantized(0, 8)
    for _ in range(40):
        s.append(*kv(1, 1))
    assert s.segment.length > 40
    later = s.segment.dequantized(0, 8)
    assert torch.equal(first[0], later[0]) and torch.equal(first[1], later[1])


@pytest.mark.parametrize("backend", SEGMENTS)
def test_drop_front_back_and_batch_ops_follow_the_reference(backend, seed):
    s = storage(8, backend=backend)
    k, v = kv(3, 37)
    s.append(k, v)
    exact_k = s.view(s.length)[0].clone()  # what the storage holds (quantized past included)
    s.drop_front(6)  # into the first group
    assert s.length == 31
    s.append(*kv(3, 1))  # compaction point
    assert torch.equal(s.view(s.length)[0][:, :, :30], exact_k[:, :, 6:36])
    s.index_batch(torch.tensor([2, 0, 0]))
    # (quanto re-quantizes on batch ops: same grid, up to float rounding)
    held = s.view(s.length)[0]
    assert torch.allclose(held[:, :, :30], exact_k[[2, 0, 0], :, 6:36], atol=1e-5, rtol=1e-5)
    s.index_batch(torch.tensor([1]))
    assert torch.allclose(s.view(s.length)[0][:, :, :30], exact_k[[0], :, 6:36], atol=1e-5, rtol=1e-5)
    # Roll back through the window into the quantized tokens, mid-group: what stays reads the same.
    before = s.view(s.length)[0]
    removed = s.recent.length + 3
    s.drop_back(removed)
    after = s.view(s.length)[0]
    assert s.length == after.shape[2] == before.shape[2] - removed
    assert torch.allclose(after, before[:, :, : after.shape[2]], atol=1e-5, rtol=1e-5)


def test_rollback_into_a_group_keeps_its_head_and_requantizes_it_later(seed):
    s = storage(4, group=4, window=4)
    k, v = kv(1, 20)
    s.append(k, v)  # 16 quantized, 4 exact
    held = s.view(20)[0].clone()
    s.drop_back(6)  # 4 exact + 2 of the last quantized group
    assert s.length == 14 and s.segment.length == 12 and s.recent.length == 2
    assert torch.allclose(s.view(14)[0], held[:, :, :14], atol=1e-6)


def test_decode_reads_the_segment_in_place_and_matches_attention_over_the_view(seed):
    s = storage(4, group=4, window=4)
    s.append(*kv(2, 30))
    s.append(*kv(2, 1))
    read = s.read(20, 1)
    assert isinstance(read, PackedRead) and read.length + read.recent_k.shape[2] == 20
    assert read.keys.shape == (2, 2, 20, 16) and read.keys.stride(-1) == 0, "decode must not build a dense copy"
    dense_k, dense_v = s.view(20)
    q = torch.randn(2, 4, 1, 16)
    out, _ = attend(read, None, q, None, 0.25)
    ref = reference(q[:, :, 0], dense_k, dense_v, 0.25)
    assert ((out[:, 0].double() - ref).norm() / ref.norm()).item() < 1e-5


def test_decode_survives_eviction_between_update_and_attention(seed):
    """A sliding layer drops its oldest token after `update` returned; attention still sees it."""
    s = storage(4, group=4, window=4)
    s.append(*kv(1, 30))
    s.append(*kv(1, 1))
    dense_k, dense_v = s.view(24)
    read = s.read(24, 1)
    s.drop_front(s.length - 23)
    q = torch.randn(1, 2, 1, 16)
    out, _ = attend(read, None, q, None, 0.25)
    ref = reference(q[:, :, 0], dense_k, dense_v, 0.25)
    assert ((out[:, 0].double() - ref).norm() / ref.norm()).item() < 1e-5
    gathered_k, gathered_v = read.dense()  # what a call the kernel cannot serve attends to
    assert torch.equal(gathered_k, dense_k) and torch.equal(gathered_v, dense_v)


def test_prefill_attends_to_the_fresh_chunk_and_the_past_window_at_full_precision(seed):
    s = storage(4, group=4, window=4)
    past_k, past_v = kv(1, 10)
    s.append(past_k, past_v)
    k, v = kv(1, 12)
    s.append(k, v)  # most of this chunk, and the past's window, are quantized at once
    got_k, got_v = s.read(22, 12).dense()
    assert torch.equal(got_k[:, :, -12:], k) and torch.equal(got_v[:, :, -12:], v)
    # the first query's window: itself and the 3 tokens before it
    assert torch.equal(got_k[:, :, 7:10], past_k[:, :, 7:]) and torch.equal(got_v[:, :, 7:10], past_v[:, :, 7:])
    assert torch.equal(got_k[:, :, :7], s.view(22)[0][:, :, :7])
    assert not torch.equal(got_k[:, :, 7:10], s.view(22)[0][:, :, 7:10]), "the past's window was not quantized"


@pytest.mark.parametrize("window", [3, 0, 4.0, True])
def test_a_window_smaller_than_a_group_is_refused(window):
    with pytest.raises(ConfigError, match="at least one group"):
        QuantizedStorage(PackedSegment(QuantFormat(4, 4)), window=window)


def test_memory_counts_codes_scales_and_the_window(seed):
    s = storage(4, group=4, window=8)
    s.append(*kv(2, 40))
    report = s.memory()
    fmt, seg = s.fmt, s.segment.memory()
    tokens = s.segment.length * 2 * 2  # tokens x batch x heads
    assert seg.payload_bytes == tokens * 2 * fmt.packed_dim(16)
    assert seg.metadata_bytes == tokens * (fmt.bytes_per_token(16) - 2 * fmt.packed_dim(16))
    assert report.payload_bytes == seg.payload_bytes + s.recent.length * 2 * 2 * 2 * 16 * 4
    assert report.total_bytes >= report.payload_bytes + report.metadata_bytes
