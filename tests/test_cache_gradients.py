"""Gradients through a cache: a prompt and decode steps in grad mode, then one backward.

Lossless caches (dense, paged and offloaded, static buffers included) give DynamicCache's logits and gradients;
lossy ones (quantized codes, evicting retentions) refuse in grad mode with `GradientError` before the cache changes,
and still serve the same model under `torch.no_grad()`.
"""

import pytest
import torch
from transformers import DynamicCache

from conformance.models import build_model
from hf_kvplus import GradientError, cache_kwargs
from hf_kvplus.specs import parse_cache_spec

PROMPT, STEPS = 40, 3

LOSSLESS = [
    "dense", "dense:max_tokens=64:compile=on", "paged:block=8", "paged:max_tokens=64:compile=on", "offloaded",
    "offloaded:lookahead=2",
]  # fmt: skip
LOSSY = [
    "quantized:int8:window=16", "quantized:int4:window=16", "quantized:int2:window=16", "quantized:fp8:window=16",
    "quantized:k4v2:window=16", "quantized:int4:window=16:max_tokens=64:compile=on", "quantized:int4:window=16:boundary=1",
    "quantized:int4:window=16:backend=quanto", "paged-quantized:int4:window=16:block=16", "sink:4:28",
    "sink:4:28:compile=on", "h2o:32", "h2o:32:compile=on", "snapkv:32:observation=8", "offloaded-quantized:int4:window=16",
    "offloaded:disk=tmp:host=0", "offloaded:disk=tmp:host=1G",  # (files keep no history)
]  # fmt: skip


@pytest.fixture(scope="module")
def model():
    model = build_model("llama")
    model.requires_grad_(True)
    return model


def tokens(seed, n):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def forward_backward(model, cache, trainable=None):
    """The prompt, then `STEPS` decode steps, all in grad mode; one backward through the sum of their losses.
    Returns the logits and the gradient of every parameter that requires one."""
    model.zero_grad(set_to_none=True)
    ids = tokens(0, PROMPT + STEPS)
    logits = [model(ids[:, :PROMPT], **cache_kwargs(cache)).logits]
    for i in range(PROMPT, PROMPT + STEPS):
        logits.append(model(ids[:, i : i + 1], **cache_kwargs(cache)).logits)
    logits = torch.cat(logits, dim=1)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def assert_same_gradients(got, want, spec):
    logits, grads = got
    want_logits, want_grads = want
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"{spec} logits: {m}")
    assert grads.keys() == want_grads.keys(), f"{spec}: gradients for {sorted(want_grads.keys() - grads.keys())} missing"
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{spec} {n}: {m}")


@pytest.mark.parametrize("spec", LOSSLESS)
def test_lossless_caches_give_dynamic_caches_gradients(model, spec):
    want = forward_backward(model, DynamicCache(config=model.config))
    got = forward_backward(model, parse_cache_spec(spec).build(model.config, max_length=64))
    assert_same_gradients(got, want, spec)


def test_gradients_of_the_query_alone(model):
    """Only q_proj trains: the keys need no gradient, but SDPA saved them for the query's, so later appends must not
    write what it saved."""
    for name, p in model.named_parameters():
        p.requires_grad_("q_proj" in name)
    try:
        want = forward_backward(model, DynamicCache(config=model.config))
        for spec in ("dense", "paged:block=8", "dense:max_tokens=64:compile=on"):
            assert_same_gradients(forward_backward(model, parse_cache_spec(spec).build(model.config, max_length=64)), want, spec)
        with pytest.raises(GradientError, match=r"layer 0 .*int4/g16 codes.*torch\.no_grad\(\)"):
            forward_backward(model, parse_cache_spec("quantized:int4:window=16").build(model.config))
    finally:
        model.requires_grad_(True)


def test_eager_attention_gets_copies_it_can_save(model):
    eager = build_model("llama")
    eager.set_attn_implementation("eager")
    eager.requires_grad_(True)
    want = forward_backward(eager, DynamicCache(config=eager.config))
    for spec in ("dense", "paged:block=8", "offloaded"):
        assert_same_gradients(forward_backward(eager, parse_cache_spec(spec).build(eager.config)), want, spec)


@pytest.mark.parametrize("spec", LOSSY)
def test_lossy_caches_refuse_in_grad_mode_and_serve_under_no_grad(model, spec):
    cache = parse_cache_spec(spec).build(model.config, max_length=64)
    with pytest.raises(GradientError, match=r"cannot carry gradients.*torch\.no_grad\(\).*lossless cache"):
        model(tokens(0, PROMPT), **cache_kwargs(cache))
    assert cache.get_seq_length() == 0  # refused before any layer changed
    with torch.no_grad():
        fresh = parse_cache_spec(spec).build(model.config, max_length=64)
        got, want = (model(tokens(0, PROMPT), **cache_kwargs(c)).logits for c in (cache, fresh))
    assert torch.equal(got, want), f"{spec}: the refused cache then computed other logits than a fresh one"

