"""KVzap (`KVzapPolicy`, `KVzapCache`, `Surrogate`, `fit_surrogate`): the policy keeps what its surrogate's score ranks
highest, at prefill and at decode steps; it refuses budgets it cannot hold and a weights file fitted on another model,
with typed errors that name the numbers; it works through `generate()` in both compress modes on every slot format,
with no host read in a decode step; and a surrogate fitted on a tiny model's KVzip scores ranks held-out tokens far
better than chance."""

import pytest
import test_decode_syncs as syncs
import torch
from test_eviction_policies import DIM, KV_HEADS, config
from test_kvzip import PROMPT, copying_model
from transformers import DynamicCache

from conformance.models import PAD_TOKEN_ID, get_model
from conformance.modes import make_prompt
from hf_kvplus import (
    ArtifactNotFoundError,
    CacheMismatchError,
    ConfigError,
    KVzapCache,
    ShapeError,
    Surrogate,
    cache_kwargs,
)
from hf_kvplus.evaluation.surrogate_fit import fit_surrogate, layer_shares, ranking_quality, with_numbers
from hf_kvplus.eviction.kvzap import KVzapPolicy
from hf_kvplus.eviction.rope import RotaryShift
from hf_kvplus.model_spec import ModelSpec
from hf_kvplus.specs import parse_cache_spec
from hf_kvplus.storage.slots import SlotStore
from hf_kvplus.surrogate import KEEP_GRID


def random_surrogate(cfg, seed: int = 0) -> Surrogate:
    spec = ModelSpec.from_config(cfg)
    heads, dim = spec.layers[0].num_kv_heads, spec.layers[0].head_dim
    weights = torch.randn(spec.num_layers, heads, 3 * dim + 1, generator=torch.Generator().manual_seed(seed))
    shares = torch.ones(len(KEEP_GRID), spec.num_layers)
    return Surrogate("tiny", cfg.model_type, spec.num_layers, heads, dim, "rope_kv", weights, shares)


def value_channel_weights(heads: int = KV_HEADS, dim: int = DIM) -> torch.Tensor:
    """Weights whose prediction is a token's value channel 0: features are (key, key before RoPE, value)."""
    weights = torch.zeros(heads, 3 * dim + 1)
    weights[:, 2 * dim] = 1.0
    return weights


@pytest.mark.parametrize("budget, sinks, recent", [(5, 0, 0), (6, 2, 0), (7, 1, 2)])
def test_the_policy_keeps_the_sinks_the_recent_and_the_highest_predicted_scores(seed, budget, sinks, recent):
    n = 20
    keys, values = torch.randn(2, KV_HEADS, n, DIM), torch.randn(2, KV_HEADS, n, DIM)
    store = SlotStore()
    store.append(keys, values)
    policy = KVzapPolicy(budget, value_channel_weights(), RotaryShift.from_config(config()), sinks, recent)
    policy.evict(store, n, refill=False)
    for b in range(2):
        for h in range(KV_HEADS):
            fixed = set(range(sinks)) | set(range(n - recent, n))
            ranked = [p for p in values[b, h, :, 0].argsort(descending=True).tolist() if p not in fixed]
            want = sorted(fixed | set(ranked[: budget - len(fixed)]))
            assert sorted(store.positions[b, h].tolist()) == want, f"seed {seed}, row {b}, head {h}"
    torch.testing.assert_close(store.scores, values[..., 0].gather(2, store.positions))  # scored as predicted


def test_a_decode_step_token_is_scored_and_competes_with_the_kept_ones():
    """compress="always": a decode token with the highest predicted score stays, the kept token ranked lowest goes."""
    n, budget = 12, 6
    keys, values = torch.randn(1, KV_HEADS, n, DIM), torch.randn(1, KV_HEADS, n, DIM)
    store = SlotStore()
    store.append(keys, values)
    policy = KVzapPolicy(budget, value_channel_weights(), RotaryShift.from_config(config()), 0, 0, "always")
    policy.evict(store, n, refill=True)
    lowest = store.positions.gather(2, store.scores.argmin(-1, keepdim=True))
    new_value = torch.randn(1, KV_HEADS, 1, DIM)
    new_value[..., 0] = 100.0
    store.append(torch.randn(1, KV_HEADS, 1, DIM), new_value)
    policy.evict(store, 1, refill=True)
    store.settle()
    kept = store.positions
    assert (kept == n).any(-1).all() and not (kept == lowest).any(-1).any() and store.length == budget


@pytest.mark.parametrize("compress", ["prefill", "always"])
@pytest.mark.parametrize("bits", [None, 8, 4, 2, "fp8", "k4v2"])
def test_generate_runs_in_both_modes_on_every_slot_format(compress, bits):
    model = get_model("llama")
    cache = KVzapCache(model.config, random_surrogate(model.config), budget=16, recent=2, compress=compress, bits=bits)
    prompt = make_prompt(40)
    out = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=5, do_sample=False)
    assert out.shape[1] == 45 and cache.get_seq_length() == 44
    held = {layer.storage.held for layer in cache.layers}
    assert held == ({16} if compress == "always" else {16 + 4})  # "prefill": the decode steps append


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda c, s: KVzapCache(c, s, budget=0), ConfigError, r"at least 1 token, got budget=0"),
        (lambda c, s: KVzapCache(c, s, budget=4, sinks=4), ConfigError, r"sinks=4 \+ recent=0 .* give sinks \+ recent <= 3"),
        (lambda c, s: KVzapCache(c, s, budget=8, sinks=2, recent=6), ConfigError, r"sinks=2 \+ recent=6 .* budget=8"),
        (lambda c, s: KVzapCache(c, s, budget=8, sinks=0, recent=4, bits=4, first_tokens=5), ConfigError,
         r"first_tokens=5 does not fit.*budget - recent = 8 - 4 = 4"),
        (lambda c, s: KVzapCache(c, s, budget=8, compress="sometimes"), ConfigError, r"compress must be one of"),
        (lambda c, s: KVzapPolicy(8, torch.zeros(KV_HEADS, 7), RotaryShift.from_config(c)), ShapeError,
         r"\[kv_heads, 3 x head_dim \+ 1 = 49\], got \(2, 7\)"),
        (lambda c, s: Surrogate("tiny", "llama", 1, KV_HEADS, DIM, "rope_kv", torch.zeros(1, KV_HEADS, 48),
                                torch.ones(len(KEEP_GRID), 1)), ConfigError, r"are \(1, 2, 49\), got \(1, 2, 48\)"),
        (lambda c, s: Surrogate("tiny", "llama", 1, KV_HEADS, DIM, "rope_kv", s.weights, torch.ones(len(KEEP_GRID), 2)),
         ConfigError, r"shares are \[100 kept fractions, 1 layers\], got \(100, 2\)"),
        (lambda c, s: KVzapCache(c, s, budget=8, budgets="some"), ConfigError, r"budgets must be one of"),
    ],
)  # fmt: skip
def test_budgets_and_weights_it_cannot_hold_are_refused_with_the_numbers(build, error, match):
    with pytest.raises(error, match=match):
        build(config(), random_surrogate(config()))


def test_global_budgets_size_each_layer_by_its_recorded_share():
    """Shares of 1.5, 0.5 and 1 give a 40-token prompt budgets of 24, 8 and 16 for a mean of 16 (the shares at the
    kept fraction 16 / 40); "uniform" gives 16 each; decode steps keep them (compress="always")."""
    model = get_model("llama")
    surrogate = random_surrogate(model.config)
    layers = surrogate.num_layers
    shares = torch.tensor([1.5, 0.5, 1.0][:layers]).expand(len(KEEP_GRID), layers).clone()
    fitted = Surrogate("tiny", "llama", layers, surrogate.kv_heads, surrogate.head_dim, "rope_kv", surrogate.weights,
                       shares)  # fmt: skip
    for budgets, want in (("global", [24, 8, 16][:layers]), ("uniform", [16] * layers)):
        cache = KVzapCache(model.config, fitted, budget=16, recent=2, compress="always", budgets=budgets)
        model.generate(make_prompt(40), **cache_kwargs(cache), max_new_tokens=4, do_sample=False)
        assert [layer.storage.held for layer in cache.layers] == want, budgets


def test_layer_shares_are_each_layers_part_of_one_top_k_over_the_mean():
    scores = torch.stack([torch.full((2, 10), 5.0), torch.full((2, 10), 1.0), torch.rand(2, 10)])  # layer 0 highest
    shares = layer_shares(scores)
    assert shares.shape == (len(KEEP_GRID), 3)
    torch.testing.assert_close(shares.mean(-1), torch.ones(len(KEEP_GRID), dtype=torch.float64))
    third = KEEP_GRID.index(0.33)  # 20 of 60 tokens: all of layer 0's, three times the mean
    assert shares[third].tolist() == [3.0, 0.0, 0.0] and shares[-1].tolist() == [1.0, 1.0, 1.0]


def test_numbers_are_sprinkled_into_a_chunk_of_the_length_asked():
    class Digits:  # a tokenizer that spells a number as its digits, ids 100 + digit
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [100 + int(c) for c in text.strip()]}

    chunk = with_numbers(list(range(50)) * 10, 120, 10, Digits(), seed=1)
    assert chunk.shape == (1, 120)
    digits = (chunk >= 100).sum().item()
    assert 5 * 6 <= digits <= 5 * 24 and not torch.equal(chunk, with_numbers(list(range(50)) * 10, 120, 10, Digits(), 2))
    with pytest.raises(ConfigError, match="50 tokens of text do not fill a chunk of 120"):
        with_numbers(list(range(50)), 120, 10, Digits())


def test_a_weights_file_round_trips_and_refuses_another_model(tmp_path):
    surrogate = random_surrogate(config())
    path = surrogate.save(tmp_path / "tiny.safetensors")
    loaded = Surrogate.load(path)
    assert torch.equal(loaded.weights, surrogate.weights) and torch.equal(loaded.shares, surrogate.shares)
    assert loaded.num_layers == 1 and loaded.features == "rope_kv"
    KVzapCache(config(), path, budget=8)  # the model it was fitted on
    other = config()
    other.num_hidden_layers = 2
    with pytest.raises(CacheMismatchError, match=r"for tiny \(llama, 1 layers of 2 KV heads x 16\); this model is "
                                                 r"llama with 2 layers"):  # fmt: skip
        KVzapCache(other, path, budget=8)
    with pytest.raises(ConfigError, match="no surrogate file at .*kvplus train-surrogate"):
        Surrogate.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="is not a KVzap surrogate"):
        Surrogate.load(tmp_path / "junk.safetensors")


def test_specs_name_it(tmp_path):
    path = random_surrogate(config()).save(tmp_path / "tiny.safetensors")
    cache = parse_cache_spec(f"kvzap:8:weights={path}:sinks=2:recent=1:compress=always:bits=int4").build(config())
    assert isinstance(cache, KVzapCache) and cache.format is not None
    assert repr(cache.layers[0].retention) == "KVzapPolicy(budget=8, sinks=2, recent=1, compress='always')"
    with pytest.raises(ArtifactNotFoundError, match="no KVzap surrogate for .*`kvplus train-surrogate"):
        parse_cache_spec("kvzap:8").build(config())  # no path: this model's, and none ships for it


def zipf_chunks(count: int, n: int, vocab: int, seed: int) -> list[torch.Tensor]:
    """Token ids 8 .. vocab - 1 drawn with probability ~ 1 / rank (1 .. 6 are the repeat prompt's)."""
    probs = 1.0 / torch.arange(1, vocab - 7, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    return [8 + torch.multinomial(probs, n, replacement=True, generator=generator)[None] for _ in range(count)]


def test_a_fitted_surrogate_ranks_held_out_tokens_far_better_than_chance():
    """On the copying model a reconstruction's query for token t splits its attention among the cached copies of t,
    so a rare token scores high and a frequent one low: a token's key says which it is, and the fit learns it."""
    model = copying_model()
    vocab = model.config.vocab_size
    surrogate = fit_surrogate(model, None, zipf_chunks(8, 64, vocab, seed=0), name="copying", prompt=PROMPT)
    quality = ranking_quality(surrogate, model, None, zipf_chunks(2, 64, vocab, seed=1), prompt=PROMPT)
    assert quality["spearman"] > 0.6 and quality["recall"] > 0.5, quality  # chance: 0 and 0.2
    shuffled = Surrogate("copying", "llama", 1, 1, vocab, "rope_kv", surrogate.weights[..., torch.randperm(
        surrogate.weights.shape[-1], generator=torch.Generator().manual_seed(0))], surrogate.shares)  # fmt: skip
    chance = ranking_quality(shuffled, model, None, zipf_chunks(2, 64, vocab, seed=1), prompt=PROMPT)
    assert chance["spearman"] < quality["spearman"] - 0.3, (chance, quality)
    with pytest.raises(ConfigError, match="at least one chunk"):
        fit_surrogate(model, None, [], name="copying")


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("options", ["compress=always", "compress=always:recent=2:bits=int4:group=8", "bits=k4v2"])
def test_decode_steps_add_no_host_reads(tmp_path, options, padded):
    """Scoring each decode step's token reads nothing back: the same host reads per step as DynamicCache's."""
    model = get_model("llama")
    path = random_surrogate(model.config).save(tmp_path / "tiny.safetensors")
    ids = make_prompt(syncs.PROMPT, batch=2)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
        ids = ids.masked_fill(mask == 0, PAD_TOKEN_ID)
    forced = make_prompt(syncs.STEPS, batch=2, seed=5)
    baseline = syncs.decode_syncs(model, DynamicCache(config=model.config), ids, mask, forced)
    cache = parse_cache_spec(f"kvzap:8:weights={path}:{options}").build(model.config)
    got = syncs.decode_syncs(model, cache, ids, mask, forced)
    extra = [(step, dict(c - b)) for step, (c, b) in enumerate(zip(got, baseline, strict=True)) if c - b]
    assert not extra, f"{options}: host reads beyond DynamicCache's, by decode step: {extra}"
    assert cache.get_seq_length() == syncs.PROMPT + syncs.STEPS
