"""Perplexity through a cache equals one cache-free forward (1e-4 relative), in every mode."""

import json
import math

import pytest
import torch
from transformers import DynamicCache

from conformance.models import ARCHITECTURES, build_model
from hf_kvplus import ConfigError, DenseCache, ShapeError, SinkCache
from hf_kvplus.evaluation import cache_free_nll, perplexity, plot_perplexity


def tokens(n, seed):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed), device="cpu")


def direct_nll(model, ids):
    """Independent reference: log-softmax of one forward, gathered at the next token."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].double()
    return -logits.log_softmax(-1).gather(1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("mode, chunk", [("chunked", 32), ("chunked", 7), ("streaming", None), ("streaming", 3)])
def test_perplexity_through_a_cache_equals_a_cache_free_forward(arch, mode, chunk):
    model = build_model(arch)
    ids = tokens(90, seed=hash((arch, mode)) % 1000)
    want = direct_nll(model, ids)
    for make in (lambda: DynamicCache(config=model.config), lambda: DenseCache(config=model.config)):
        result = perplexity(model, ids, make, mode=mode, chunk_size=chunk, progress=False)
        assert result.tokens == 89
        torch.testing.assert_close(result.nll.double(), want, atol=1e-4, rtol=1e-4)
        assert abs(result.perplexity / math.exp(want.mean().item()) - 1) < 1e-4
    assert torch.allclose(cache_free_nll(model, ids).double(), want, atol=1e-5)


def test_without_a_cache_each_chunk_forgets_the_past():
    model = build_model("llama")
    ids = tokens(64, seed=3)
    forgetful = perplexity(model, ids, None, chunk_size=16, progress=False)
    remembering = perplexity(model, ids, DynamicCache(config=model.config), chunk_size=16, progress=False)
    assert torch.allclose(forgetful.nll[:15], remembering.nll[:15], atol=1e-5)
    assert not torch.allclose(forgetful.nll[16:], remembering.nll[16:], atol=1e-3)


def test_segments_outputs_and_plot(tmp_path):
    model = build_model("llama")
    result = perplexity(model, tokens(41, seed=4), DynamicCache(config=model.config), segment_size=16,
                        label="dynamic", progress=False)
    segments = result.segments()
    assert [(s["start"], s["end"]) for s in segments] == [(1, 16), (17, 32), (33, 40)]
    assert segments[1]["perplexity"] == pytest.approx(math.exp(result.nll[16:32].double().mean().item()))
    result.to_json(tmp_path / "r.json")
    result.to_csv(tmp_path / "r.csv")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["perplexity"] == pytest.approx(result.perplexity) and len(data["nll"]) == 40
    assert (tmp_path / "r.csv").read_text().count("\n") == 41
    plot_perplexity([result], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_bad_arguments():
    model = build_model("llama")
    with pytest.raises(ConfigError, match="unknown perplexity mode 'fast'"):
        perplexity(model, tokens(10, 0), None, mode="fast")
    with pytest.raises(ShapeError, match="at least 2 tokens, got 1"):
        perplexity(model, tokens(1, 0), None)
    with pytest.raises(ShapeError, match=r"got \(2, 5\)"):
        perplexity(model, torch.zeros(2, 5, dtype=torch.long), None)
    with pytest.raises(ConfigError, match="must be >= 1, got 0"):
        perplexity(model, tokens(10, 0), None, chunk_size=0)
    with pytest.raises(ConfigError, match="continuation mode, and only there"):
        perplexity(model, tokens(10, 0), None, mode="continuation")
    with pytest.raises(ConfigError, match="continuation mode, and only there"):
        perplexity(model, tokens(10, 0), None, prompt_tokens=4)
    with pytest.raises(ConfigError, match=r"1 <= prompt_tokens < 10, got 10"):
        perplexity(model, tokens(10, 0), None, mode="continuation", prompt_tokens=10)


@pytest.mark.parametrize("chunk", [None, 4])
def test_the_continuation_mode_feeds_the_prompt_whole_then_scores_the_rest(chunk):
    model = build_model("llama")
    ids = tokens(60, seed=3)
    want = direct_nll(model, ids)
    result = perplexity(model, ids, lambda: DynamicCache(config=model.config), mode="continuation", chunk_size=chunk,
                        prompt_tokens=40, progress=False)
    torch.testing.assert_close(result.nll.double(), want, atol=1e-4, rtol=1e-4)
    assert result.continuation_perplexity == pytest.approx(math.exp(want[39:].mean().item()), rel=1e-4)
    assert result.summary()["prompt_tokens"] == 40 and "continuation_perplexity" in result.summary()
    # The prompt is one forward: a prefill-compressing cache compresses it once, then keeps every token fed one at a
    # time (fed in chunks of 4, each chunk is a multi-token forward and compresses again).
    prefill = SinkCache(model.config, num_sinks=2, window=14, compress="prefill")
    always = SinkCache(model.config, num_sinks=2, window=14)
    kept = {}
    for name, cache in (("prefill", prefill), ("always", always)):
        perplexity(model, ids, cache, mode="continuation", prompt_tokens=40, chunk_size=chunk, progress=False)
        kept[name] = cache.layers[0].storage.held
    assert kept == {"prefill": 16 + 20 if chunk is None else 16, "always": 16}
