"""Every decoder architecture of Transformers, served or refused by name, by every family of cache.

For each causal-LM model type (`conformance.zoo`), a tiny random model decodes a left-padded batch greedily with
DynamicCache and with each swept conformance case (`conformance.sweep.SWEEP_CASES`). Every cell must be DynamicCache's
tokens (lossless), within the case's tolerance (lossy), or a typed hf_kvplus error at construction; none may crash,
refuse only once decoding ran, or differ silently. Architectures that cannot be swept are skipped with the reason
(encoder-decoder, recurrent state only, multimodal wrappers, configs the generic shrink cannot make tiny, models on
which Transformers' own DynamicCache fails). The table of every cell is docs/architectures.md
(`python tests/architectures_table.py`).
"""

from __future__ import annotations

import pytest

from conformance.sweep import SWEEP_CASES, cell, reference
from conformance.zoo import MODEL_TYPES, Skipped

#: The sweep must keep serving at least this many architectures (140 on transformers 5.24): a change that made
#: the zoo skip most of them would otherwise pass unnoticed.
MIN_SWEPT = 120


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_cache_serves_or_refuses_at_construction(model_type):
    try:
        ref = reference(model_type)
    except Skipped as skipped:
        pytest.skip(f"{model_type}: {skipped}")
    failed = {name: c.detail for name in SWEEP_CASES if (c := cell(model_type, name, ref)).outcome == "FAILED"}
    assert not failed, f"{model_type}: {failed}"


def test_most_architectures_are_swept():
    swept = []
    for model_type in MODEL_TYPES:
        try:
            reference(model_type)
        except Skipped:
            continue
        swept.append(model_type)
    assert len(swept) >= MIN_SWEPT, f"only {len(swept)} of {len(MODEL_TYPES)} architectures swept"
    assert {"llama", "qwen2", "gemma3_text", "mistral", "qwen3_next", "gpt_oss"} <= set(swept)
