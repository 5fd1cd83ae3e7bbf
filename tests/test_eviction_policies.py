"""Which tokens the evicting layers keep, against brute-force references.

H2O: the reference keeps every key, computes each step's attention with Transformers' eager attention
(masked to what the reference itself kept, per KV head), accumulates the weights and evicts by the
H2O rule; the cache's kept positions must equal the reference's. SnapKV: the same with the eager
attention of the observation window. Sinks: the kept positions are the first real tokens plus the
newest ones, in every row of a left-padded batch.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import eager_attention_forward

from hf_kvplus import H2OCache, SinkCache, SnapKVCache, kvplus_attention

HEADS, KV_HEADS, DIM = 4, 2, 16
GROUP = HEADS // KV_HEADS


def config():
    cfg = LlamaConfig(hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      num_hidden_layers=1, head_dim=DIM, vocab_size=32, intermediate_size=32)
    cfg._attn_implementation = "sdpa"
    return cfg


MODULE = SimpleNamespace(layer_idx=0, num_key_value_groups=GROUP, training=False)


def forward(cache, q, k, v, mask=None):
    """One layer forward through the cache and hf_kvplus's attention, as a model would run it."""
    keys, values = cache.update(k, v, 0)
    return kvplus_attention(MODULE, q, keys, values, mask, scaling=DIM**-0.5)[0]


def kept_positions(cache):
    """Sorted kept positions per (row, KV head), padding slots left out."""
    pos = cache.layers[0].storage.positions
    return [[sorted(p for p in pos[b, h].tolist() if p >= 0) for h in range(pos.shape[1])] for b in range(pos.shape[0])]


class EagerReference:
    """Keeps all keys; attention restricted to a per-(row, KV head) kept set, computed by eager attention."""

    def __init__(self, batch):
        self.keys = torch.zeros(batch, KV_HEADS, 0, DIM, dtype=torch.float64)
        self.values = torch.zeros_like(self.keys)
        self.kept = torch.zeros(batch, KV_HEADS, 0, dtype=torch.bool)
        self.score = torch.zeros(batch, KV_HEADS, 0, dtype=torch.float64)

    def attend(self, q, k, v):
        """Eager attention weights `[batch, q_heads, q, n]` of the new queries over kept + causal new keys."""
        new = k.shape[2]
        self.keys = torch.cat([self.keys, k.double()], 2)
        self.values = torch.cat([self.values, v.double()], 2)
        self.kept = torch.cat([self.kept, torch.ones(*self.kept.shape[:2], new, dtype=torch.bool)], 2)
        self.score = torch.cat([self.score, torch.zeros(*self.score.shape[:2], new, dtype=torch.float64)], 2)
        n = self.keys.shape[2]
        causal = torch.arange(n)[None, :] <= torch.arange(n - new, n)[:, None]
        allowed = self.kept.repeat_interleave(GROUP, dim=1)[:, :, None, :] & causal
        mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
        _, weights = eager_attention_forward(MODULE, q.double(), self.keys, self.values, mask, scaling=DIM**-0.5)
        return weights

    def per_kv_head(self, weights, queries=None):
        w = weights if queries is None else weights[:, :, -queries:]
        return w.sum(2).view(w.shape[0], KV_HEADS, GROUP, -1).sum(2)

    def keep_top(self, ranks, budget, protected):
        """Keeps `protected` positions plus the highest `ranks` among the other kept ones, `budget` in all."""
        for b in range(ranks.shape[0]):
            for h in range(KV_HEADS):
                live = self.kept[b, h].nonzero().flatten().tolist()
                if len(live) <= budget:
                    continue
                fixed = [p for p in live if protected(p)]
                others = sorted((p for p in live if not protected(p)), key=lambda p: -ranks[b, h, p].item())
                keep = set(fixed + others[: budget - len(fixed)])
                self.kept[b, h] = torch.tensor([p in keep for p in range(self.kept.shape[2])])

    def kept_positions(self):
        return [[self.kept[b, h].nonzero().flatten().tolist() for h in range(KV_HEADS)]
                for b in range(self.kept.shape[0])]


def qkv(batch, new):
    return (torch.randn(batch, HEADS, new, DIM), torch.randn(batch, KV_HEADS, new, DIM),
            torch.randn(batch, KV_HEADS, new, DIM))


@pytest.mark.parametrize("budget, recent, prefill, chunk", [(8, 4, 12, 1), (8, 0, 5, 1), (10, 3, 16, 3), (6, 6, 9, 2)])
def test_h2o_keeps_the_top_of_the_true_accumulated_attention(seed, budget, recent, prefill, chunk):
    cache, ref, batch = H2OCache(config(), budget=budget, recent=recent), EagerReference(2), 2
    seen = 0
    for new in [prefill] + [chunk] * 12:
        q, k, v = qkv(batch, new)
        out = forward(cache, q, k, v)
        weights = ref.attend(q, k, v)
        seen += new
        ref.score[:, :, : weights.shape[-1]] += ref.per_kv_head(weights)
        ref.keep_top(ref.score, budget, lambda p, seen=seen: p >= seen - recent)
        assert kept_positions(cache) == ref.kept_positions(), f"seed {seed}, after {seen} tokens"
        expected = weights.float() @ ref.values.float().repeat_interleave(GROUP, 1)
        torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("budget, observation, kernel, pooling", [(10, 4, 3, "avg"), (12, 2, 5, "max"), (7, 6, 1, "avg")])
def test_snapkv_keeps_what_the_observation_window_attends_to(seed, budget, observation, kernel, pooling):
    cache, ref, batch = SnapKVCache(config(), budget=budget, observation=observation, kernel_size=kernel,
                                    pooling=pooling), EagerReference(2), 2
    seen = 0
    for new in (24, 1, 1, 9):  # a prompt, two decode steps (appended), a second prompt
        q, k, v = qkv(batch, new)
        forward(cache, q, k, v)
        weights = ref.attend(q, k, v)
        seen += new
        if new > 1:
            mass = ref.per_kv_head(weights, queries=min(new, observation)).float()
            flat = mass.view(-1, 1, mass.shape[-1])
            pad = kernel // 2
            pooled = (F.avg_pool1d(flat, kernel, 1, pad, count_include_pad=False) if pooling == "avg"
                      else F.max_pool1d(flat, kernel, 1, pad)).view(mass.shape)
            # Pooling runs over the slots the cache holds (its kept tokens in position order).
            ranks = torch.full_like(pooled, float("-inf"))
            for b in range(batch):
                for h in range(KV_HEADS):
                    live = ref.kept[b, h].nonzero().flatten()
                    ranks[b, h, live] = pooled_over(mass[b, h, live], kernel, pooling)
            ref.keep_top(ranks, budget, lambda p, seen=seen: p >= seen - observation)
        assert kept_positions(cache) == ref.kept_positions(), f"seed {seed}, after {seen} tokens"


def pooled_over(values, kernel, pooling):
    flat = values.view(1, 1, -1)
    if pooling == "avg":
        return F.avg_pool1d(flat, kernel, 1, kernel // 2, count_include_pad=False).flatten()
    return F.max_pool1d(flat, kernel, 1, kernel // 2).flatten()


def padding_mask(pads, new, held_before):
    """The model's sdpa mask `[batch, 1, new, held + new]` for a left-padded batch (True = attend)."""
    total = held_before + new
    cols = torch.arange(total)
    rows = []
    for pad in pads:
        real = cols >= pad
        rows.append(torch.stack([real & (cols <= held_before + i) for i in range(new)]))
    return torch.stack(rows)[:, None]


def test_sinks_are_each_rows_first_real_tokens_in_a_left_padded_batch(seed):
    num_sinks, window, pads = 3, 5, [0, 4, 9]
    cache = SinkCache(config(), num_sinks=num_sinks, window=window, positions="original")
    prompt = 12
    q, k, v = qkv(3, prompt)
    forward(cache, q, k, v, padding_mask(pads, prompt, 0))
    seen = prompt
    for _ in range(10):
        held = cache.layers[0].storage.length
        q, k, v = qkv(3, 1)
        # Decode steps: the model's mask covers the kept slots (padding first) and the new token.
        forward(cache, q, k, v, torch.ones(3, 1, 1, held + 1, dtype=torch.bool))
        seen += 1
        for b, pad in enumerate(pads):
            real = list(range(pad, seen))
            expected = real if len(real) <= num_sinks + window else real[:num_sinks] + real[-window:]
            assert kept_positions(cache)[b] == [expected] * KV_HEADS, f"row {b} after {seen} tokens"


def test_h2o_decode_step_writes_the_new_token_into_the_evicted_slot(seed):
    """A decode step frees the lowest-ranked slot of each head (chosen on the device) and the next one
    writes its token there: one slot beyond the budget, no slot moved, no buffer reallocated."""
    cache = H2OCache(config(), budget=8, recent=2)
    q, k, v = qkv(1, 8)
    forward(cache, q, k, v)
    store = cache.layers[0].storage
    buffer, capacity = store.fields["keys"].data_ptr(), store.capacity
    for step in range(20):
        hole = store.hole
        q, k, v = qkv(1, 1)
        forward(cache, q, k, v)
        assert (store.held, store.length) == (8, 9)
        assert store.hole.shape == (1, KV_HEADS, 1)
        if step:  # the freed slot of each head took this step's key and value and position
            slots = hole[..., None].expand(-1, -1, 1, DIM)
            assert torch.equal(store.fields["keys"].gather(2, slots), k)
            assert torch.equal(store.fields["values"].gather(2, slots), v)
            assert (store.pos.gather(2, hole) == 8 + step).all()
    assert (store.fields["keys"].data_ptr(), store.capacity) == (buffer, capacity)
