"""Caches in float16, bfloat16 and float32 on the suite's device, judged against float64.

Token identity with DynamicCache is the conformance suite's test (float32). In half precision the fused
attention path and SDPA round differently, so tokens of a random model may part at a near tie; what must
hold is that a lossless cache is no further from the float64 computation than Transformers' DynamicCache
in the same dtype. Logits are teacher-forced (prefill, then fixed tokens one at a time), so one rounding
difference cannot change what the later steps see.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from conformance.models import get_model
from conformance.modes import make_prompt
from hf_kvplus import cache_kwargs
from hf_kvplus.specs import parse_cache_spec

#: Lossless specs: every token stays, at full precision (evicting caches with room for all of them).
LOSSLESS = ["dense", "paged", "offloaded", "sink:4:1000", "h2o:1000", "snapkv:1000"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def teacher_forced_logits(model, cache, prompt, forced) -> torch.Tensor:
    """Last-position logits of the prefill and of each forced token fed one at a time, as float64."""
    with torch.no_grad():
        out = [model(input_ids=prompt, **cache_kwargs(cache), use_cache=True).logits[:, -1]]
        for i in range(forced.shape[1]):
            out.append(model(input_ids=forced[:, i : i + 1], **cache_kwargs(cache), use_cache=True).logits[:, -1])
    return torch.stack(out).double()


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def models():
    base = get_model("llama")
    return {dtype: copy.deepcopy(base).to(dtype) for dtype in [torch.float64, *DTYPES]}


@pytest.fixture(scope="module")
def dynamic_logits(models):
    """DynamicCache's teacher-forced logits per dtype (float64 included), computed once."""
    prompt, forced = make_prompt(20, batch=2), make_prompt(6, batch=2, seed=99)
    return prompt, forced, {
        dtype: teacher_forced_logits(model, DynamicCache(config=model.config), prompt, forced)
        for dtype, model in models.items()
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("spec", LOSSLESS)
def test_lossless_cache_is_as_close_to_float64_as_dynamic_cache(models, dynamic_logits, spec, dtype):
    prompt, forced, logits = dynamic_logits
    reference, base = logits[torch.float64], logits[dtype]
    cache = parse_cache_spec(spec).build(models[dtype].config)
    ours = teacher_forced_logits(models[dtype], cache, prompt, forced)
    assert torch.isfinite(ours).all()
    err_base, err_ours = rel(base, reference), rel(ours, reference)
    assert err_ours <= 2 * err_base + 1e-6, f"{spec} {dtype}: {err_ours:.2e} vs DynamicCache {err_base:.2e}"
