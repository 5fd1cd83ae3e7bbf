"""Checks every example policy passes, run by each example's tests: it registers under its spec name, keeps what a
hand computation over the model's own keys or attention says, evicts to its budget in `generate()` on full-precision
and quantized slots, and compiles (a recording backend: the traced graph runs as captured, so tokens must match)."""

import torch
from transformers import CompileConfig, DynamicCache

from hf_kvplus import EvictingCache, cache_kwargs
from hf_kvplus.specs import parse_cache_spec

#: Slot formats every example runs on: full precision, KIVI int4 and a rotated format.
FORMATS = ["", ":bits=int4:group=8", ":bits=k4v2"]


def prompt(batch: int = 1, tokens: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 100, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def full_keys(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's keys `[batch, kv_heads, n, head_dim]` of a prompt, from a full cache."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
    return [layer.keys for layer in cache.layers]


def kept_positions(cache) -> list[list[list[list[int]]]]:
    """Per layer, row and KV head: the sorted positions its slots hold."""
    return [layer.storage.positions.sort(dim=-1).values.tolist() for layer in cache.layers]


def top_positions(scores: torch.Tensor, budget: int) -> list[list[list[int]]]:
    """Per row and KV head, the sorted positions of the `budget` highest `scores` `[batch, kv_heads, n]`."""
    return scores.topk(budget, dim=-1).indices.sort(dim=-1).values.tolist()


def prefilled(model, spec: str, ids: torch.Tensor):
    cache = parse_cache_spec(spec).build(model.config)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
    return cache


def in_generate(model, name: str, slots: str) -> None:
    """Policy `name` on the slot format `slots` (a spec's tail): eager `generate()` evicts to its budget, and a
    compiled one gives eager's tokens."""
    evicts_to_budget(model, f"{name}:10:compress=always{slots}", 10)
    compiles(model, f"{name}:8:compress=always:compile=on{slots}")


def evicts_to_budget(model, spec: str, budget: int, new_tokens: int = 12) -> None:
    """`generate()` with `spec` (compress='always') runs, sees every token and holds `budget` per KV head."""
    ids = prompt(batch=2)
    cache = parse_cache_spec(spec).build(model.config)
    assert isinstance(cache, EvictingCache)
    with torch.no_grad():
        out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    assert out.shape == (2, ids.shape[1] + new_tokens)
    assert cache.get_seq_length() == ids.shape[1] + new_tokens - 1  # (the last token is never fed back)
    assert [layer.storage.held for layer in cache.layers] == [budget] * len(cache.layers)


def compiles(model, spec: str, new_tokens: int = 16) -> None:
    """A compileable spec's decode step compiles to one graph (left padding included) whose tokens are eager's."""
    graphs = []

    def backend(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward

    config = CompileConfig(backend=backend, fullgraph=True, mode=None)
    config._compile_all_devices = True  # generate() compiles on CUDA only, unless told
    ids = prompt(batch=2, tokens=13)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    options = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model.generate(ids, **cache_kwargs(parse_cache_spec(spec).build(model.config)), disable_compile=True,
                               **options)  # fmt: skip
        cache = parse_cache_spec(spec).build(model.config)
        assert cache.is_compileable
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            compiled = model.generate(ids, **cache_kwargs(cache), compile_config=config, **options)
    assert torch.equal(compiled, eager)
    assert 1 <= len(graphs) <= 3, f"{len(graphs)} graphs for {new_tokens} tokens"
