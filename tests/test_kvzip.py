"""KVzip (`ReconstructionPolicy`, `KVzipCache`, `reconstruct`): the policy keeps what its score ranks highest; the
reconstruction scores a context by the largest weight one query head of a repeat gives each cached token, keeps a
token the repeat copies sharply over tokens nobody reads, leaves the budget per head and none of its own tokens; bad
budgets, chunk sizes and models are refused with typed errors that name the numbers."""

import pytest
import torch
from test_eviction_policies import DIM, GROUP, HEADS, KV_HEADS, MODULE, config, kept_positions
from transformers import LlamaConfig, LlamaForCausalLM

from conformance.models import get_model
from conformance.modes import make_prompt
from hf_kvplus import (
    CacheMismatchError,
    ConfigError,
    UnsupportedOperationError,
    cache_kwargs,
    kvplus_attention,
)
from hf_kvplus.eviction.reconstruction import ReconstructionPolicy
from hf_kvplus.kvzip_cache import KVzipCache, RepeatPrompt, global_budgets, reconstruct
from hf_kvplus.specs import parse_cache_spec
from hf_kvplus.storage.slots import SlotStore

PROMPT = RepeatPrompt(first=(1, 2, 3), later=(4, 5), suffix=(6,))


def store_with_scores(scores: torch.Tensor) -> SlotStore:
    """A store holding one token per position 0 .. n - 1 in each (row, KV head), with the given scores."""
    batch, heads, n = scores.shape
    store = SlotStore()
    store.append(torch.randn(batch, heads, n, DIM), torch.randn(batch, heads, n, DIM))
    store.scores.copy_(scores)
    return store


@pytest.mark.parametrize("budget, sinks, recent", [(5, 0, 0), (6, 2, 0), (7, 1, 2)])
def test_the_policy_keeps_the_sinks_the_recent_and_the_highest_scores(seed, budget, sinks, recent):
    n = 20
    scores = torch.rand(2, KV_HEADS, n)
    store = store_with_scores(scores)
    policy = ReconstructionPolicy(budget, sinks, recent)
    policy.evict(store, n, refill=False)  # no reconstruction yet: nothing to rank by, nothing goes
    assert store.length == n
    policy.evict_scored(store)
    for b in range(2):
        for h in range(KV_HEADS):
            fixed = set(range(sinks)) | set(range(n - recent, n))
            ranked = [p for p in scores[b, h].argsort(descending=True).tolist() if p not in fixed]
            want = sorted(fixed | set(ranked[: budget - len(fixed)]))
            assert sorted(store.positions[b, h].tolist()) == want, f"seed {seed}, row {b}, head {h}"


def test_max_head_mass_is_the_largest_weight_of_one_query_head(seed):
    """The attention path's `"max_head"` reduction against eager attention weights: max over the group and queries."""
    cache = KVzipCache(config(), budget=4, sinks=0)
    policy = cache.layers[0].retention
    q, k, v = (
        torch.randn(1, HEADS, 9, DIM),
        torch.randn(1, KV_HEADS, 9, DIM),
        torch.randn(1, KV_HEADS, 9, DIM),
    )
    policy.scoring = True
    keys, values = cache.update(k, v, 0)
    kvplus_attention(MODULE, q, keys, values, None, scaling=DIM**-0.5)
    logits = q @ k.repeat_interleave(GROUP, 1).transpose(-1, -2) * DIM**-0.5
    weights = logits.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    want = weights.view(1, KV_HEADS, GROUP, 9, 9).amax(dim=(2, 3))
    summed = weights.view(1, KV_HEADS, GROUP, 9, 9).sum(2).amax(2)
    assert not torch.allclose(want, summed)  # (the two reductions differ here, so the test tells them apart)
    torch.testing.assert_close(cache.layers[0].storage.scores, want, atol=1e-5, rtol=1e-4)


def copying_model() -> LlamaForCausalLM:
    """A one-layer Llama whose query for token t is the key of token t: each query reads the cached copy of its own
    token sharply (identity projections on a one-hot embedding, no rotary to speak of)."""
    vocab = 32
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=vocab, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=vocab, rope_theta=1e12,
                      max_position_embeddings=512)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab) * 4.0)
        attn = model.model.layers[0].self_attn
        attn.q_proj.weight.copy_(torch.cat([torch.eye(vocab), torch.eye(vocab)]) * 6.0)
        attn.k_proj.weight.copy_(torch.eye(vocab))
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
    return model


def test_the_reconstruction_keeps_what_the_repeat_copies_and_drops_what_nobody_reads():
    model = copying_model()
    # A context of filler token 7 with rare tokens 20, 21, 22 inside; the repeat asks for a text of the rare tokens
    # only, so its queries read them sharply, and the fillers' keys, read by no query of the repeat, go.
    context = torch.tensor([[7] * 10 + [20] + [7] * 10 + [21] + [7] * 10 + [22] + [7] * 5])
    cache = KVzipCache(model.config, budget=5, sinks=2, budgets="uniform")
    with torch.no_grad():
        model(context, **cache_kwargs(cache))
    repeat = torch.tensor([[20, 21, 22]])
    reconstruct(model, cache, repeat, prompt=PROMPT)
    kept = kept_positions(cache)[0][0]
    assert kept == [0, 1, 10, 21, 32], kept  # the sinks and the three tokens the repeat copies
    assert cache.get_seq_length() == context.shape[1]  # the repeat's tokens are gone
    assert cache.layers[0].storage.held == 5


@pytest.mark.parametrize("chunk_size", [8, 64])
def test_after_compression_it_holds_the_budget_per_head_and_no_repeat_tokens(chunk_size):
    model = get_model("llama")
    prompt = make_prompt(40)
    cache = KVzipCache(model.config, budget=12, sinks=2, recent=2, chunk_size=chunk_size, budgets="uniform")
    with torch.no_grad():
        model(prompt, **cache_kwargs(cache))
        assert [layer.storage.held for layer in cache.layers] == [40] * len(
            cache.layers
        )  # held whole till then
        cache.compress(model, prompt[:, 4:], prompt=PROMPT)
    assert cache.get_seq_length() == 40
    for layer in cache.layers:
        pos = layer.storage.positions
        assert pos.shape[-1] == 12 and layer.storage.held == 12
        assert int(pos.max()) < 40 and int(pos.min()) >= 0  # context positions only: the repeat's were >= 40
        assert (pos[..., :2] == torch.tensor([0, 1])).all() and (
            pos[..., -2:] == torch.tensor([38, 39])
        ).all()
    question = make_prompt(6, seed=5)
    out = model.generate(
        torch.cat([prompt, question], -1), **cache_kwargs(cache), max_new_tokens=3, do_sample=False
    )
    assert out.shape[1] == 49 and cache.layers[0].storage.held == 12 + 6 + 2  # the question and answer append


def test_compress_always_keeps_the_budget_through_decode_steps():
    model = get_model("llama")
    prompt = make_prompt(30)
    cache = KVzipCache(model.config, budget=10, recent=3, compress="always", budgets="uniform")
    with torch.no_grad():
        model(prompt, **cache_kwargs(cache))
        cache.compress(model, prompt, prompt=PROMPT)
    model.generate(torch.cat([prompt, make_prompt(4, seed=2)], -1), **cache_kwargs(cache), max_new_tokens=5,
                   do_sample=False)  # fmt: skip
    assert cache.layers[0].storage.held == 10 and cache.get_seq_length() == 38


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda c: KVzipCache(c, budget=0), ConfigError, r"at least 1 token, got budget=0"),
        (
            lambda c: KVzipCache(c, budget=4, sinks=4),
            ConfigError,
            r"sinks=4 \+ recent=0 .* budget=4: give sinks \+ "
            r"recent <= 3",
        ),
        (lambda c: KVzipCache(c, budget=8, sinks=2, recent=6), ConfigError, r"sinks=2 \+ recent=6"),
        (lambda c: KVzipCache(c, budget=8, compress="always"), ConfigError, "needs recent >= 1"),
        (lambda c: KVzipCache(c, budget=8, kernel_size=2), ConfigError, "positive odd number, got 2"),
        (lambda c: KVzipCache(c, budget=8, reduce="mean"), ConfigError, "got reduce='mean'"),
        (lambda c: KVzipCache(c, budget=8, chunk_size=0), ConfigError, "chunk_size must be >= 1, got chunk_size=0"),
    ],
)
def test_budgets_it_cannot_hold_are_refused_with_the_numbers(build, error, match):
    with pytest.raises(error, match=match):
        build(config())


def test_reconstruct_refuses_a_wrong_model_an_empty_cache_and_positions_past_the_model():
    model = get_model("llama")
    prompt = make_prompt(20)
    with pytest.raises(UnsupportedOperationError, match="prefill the context first"):
        reconstruct(model, KVzipCache(model.config, budget=8), prompt, prompt=PROMPT)
    cache = KVzipCache(config(), budget=8)  # built for another model: 1 layer of 2 KV heads x 16
    with pytest.raises(CacheMismatchError, match=r"built for 1 layers .* model has \d+"):
        reconstruct(model, cache, prompt, prompt=PROMPT)
    with pytest.raises(ConfigError, match="ReconstructionPolicy"):
        reconstruct(model, parse_cache_spec("peak:8").build(model.config), prompt, prompt=PROMPT)
    cache = KVzipCache(model.config, budget=8, chunk_size=200)
    long = make_prompt(200)
    with torch.no_grad():
        model(long, **cache_kwargs(cache))
    limit = model.config.max_position_embeddings
    with pytest.raises(
        ConfigError, match=rf"= 404, the model has {limit}: give a smaller chunk_size \(now 200\)"
    ):
        cache.compress(model, long, prompt=PROMPT)
    assert cache.get_seq_length() == 200 and cache.layers[0].storage.held == 200  # nothing changed


def test_the_repeat_prompt_closes_a_chat_template_turn():
    class Chat:
        chat_template = "yes"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return f"<s>user: {messages[0]['content']}</s><s>assistant: "

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) for c in text]}

    prompt = RepeatPrompt.from_tokenizer(Chat())
    assert bytes(prompt.suffix).decode() == "</s><s>assistant: "
    assert bytes(prompt.first).decode() == "\n\nRepeat the previous context exactly."


def test_specs_name_it():
    cache = parse_cache_spec("kvzip:64:sinks=2:recent=4:kernel=3:chunk=512:reduce=max:bits=int4").build(
        config()
    )
    policy = cache.layers[0].retention
    assert isinstance(cache, KVzipCache) and cache.format is not None and cache.chunk_size == 512
    assert (policy.budget, policy.sinks, policy.recent, policy.kernel_size, policy.mass_reduce) == (
        64,
        2,
        4,
        3,
        "max",
    )
    with pytest.raises(ConfigError, match="reduce must be one of"):
        parse_cache_spec("kvzip:64:reduce=sum")


def test_global_budgets_share_the_layers_slots_by_their_scores(seed):
    """Two layers of one budget each: the layer whose scores rank higher wins the slots of the other (down to sinks +
    recent + 1), and the sum stays what the uniform budgets hold."""
    cfg = config()
    cfg.num_hidden_layers = 2
    cache = KVzipCache(cfg, budget=6, sinks=1, recent=1, budgets="global")
    n = 16
    for index in range(2):
        cache.update(torch.randn(1, KV_HEADS, n, DIM), torch.randn(1, KV_HEADS, n, DIM), index)
    layers = cache.layers
    layers[0].storage.scores.copy_(torch.rand(1, KV_HEADS, n) + 1.0)  # every score of layer 0 above layer 1's
    layers[1].storage.scores.copy_(torch.rand(1, KV_HEADS, n))
    assert global_budgets(layers) == [
        9,
        3,
    ]  # 12 slots per head: layer 1 keeps its sink, its newest and one more
    layers[1].storage.scores.add_(2.0)
    assert global_budgets(layers) == [3, 9]
    for layer, budget in zip(layers, [3, 9], strict=True):
        layer.retention.evict_scored(layer.storage, budget)
        assert layer.storage.held == budget and layer.retention.budget == budget


def test_on_a_hybrid_model_the_full_layers_compress_and_the_sliding_ones_keep_their_window():
    """Gemma 3 (sliding, sliding, full, sliding): the reconstruction scores and evicts the full layer; each sliding
    layer holds the same keys and values after it as before (the repeat neither pushes context out of the window nor
    stays), and generation goes on over both."""
    model = get_model("gemma3")
    prompt = make_prompt(30)
    cache = KVzipCache(model.config, budget=8, sinks=2, budgets="uniform")
    with torch.no_grad():
        model(prompt, **cache_kwargs(cache))
        sliding = [layer for layer in cache.layers if layer.is_sliding]
        before = [(layer.keys.clone(), layer.values.clone(), layer.seen) for layer in sliding]
        cache.compress(model, prompt, prompt=PROMPT, chunk_size=16)
    assert sliding and cache.get_seq_length() == 30
    for layer, (keys, values, seen) in zip(sliding, before, strict=True):
        assert layer.seen == seen and torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert not layer.record_past
    full = [layer for layer in cache.layers if not layer.is_sliding]
    assert [layer.storage.held for layer in full] == [8] * len(full)
    out = model.generate(torch.cat([prompt, make_prompt(4, seed=3)], -1), **cache_kwargs(cache), max_new_tokens=3,
                         do_sample=False)  # fmt: skip
    assert out.shape[1] == 37


def test_the_repeat_leaves_no_headroom_in_the_sliding_layers():
    """The repeat's chunks go through the sliding layers' buffers and are dropped after each forward: what they grew
    is given back, so a compressed hybrid model holds at rest about what its windows and budgets need (on Gemma 3
    270M at 16K, 0.15 kept, the sliding layers' headroom was 2.5x the tokens held before it was)."""
    model = get_model("gemma3")
    prompt = make_prompt(120)
    cache = KVzipCache(model.config, budget=8, sinks=2, budgets="uniform")
    with torch.no_grad():
        for start in range(0, 120, 10):  # a prefill in small chunks: the windows' buffers stay small
            model(prompt[:, start : start + 10], **cache_kwargs(cache))
        sliding = [layer for layer in cache.layers if layer.is_sliding]
        before = [layer.storage.memory().reserved_bytes for layer in sliding]
        cache.compress(model, prompt, prompt=PROMPT, chunk_size=120)  # one forward of the whole context
    after = [layer.storage.memory().reserved_bytes for layer in sliding]
    assert sliding and all(a <= b for a, b in zip(after, before, strict=True)), (before, after)
