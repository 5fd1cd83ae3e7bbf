"""Assertions of the conformance suite: does a case's run conform to the reference run?"""

from __future__ import annotations

import torch

from .cases import CacheCase
from .modes import ModeResult


def assert_cache_used(result: ModeResult) -> None:
    """The cache objects the factory built were really the ones the model used and handed back."""
    assert result.caches, f"{result.mode}: the run built no cache"
    for i, cache in enumerate(result.caches):
        seen = cache.get_seq_length()
        assert seen > 0, (
            f"{result.mode}: cache #{i} ({type(cache).__name__}) has get_seq_length() == {seen} after the run: "
            "the model did not write into the cache it was given"
        )
    assert result.returned_cache is result.caches[-1], (
        f"{result.mode}: the cache handed back ({type(result.returned_cache).__name__}) is not the object passed in "
        f"({type(result.caches[-1]).__name__})"
    )


def shared_context_steps(ref: ModeResult, got: ModeResult) -> int:
    """How many leading entries of ``logits`` have the same context in both runs: every step up to and including
    the first step where some row's token differs (its logits were computed from an identical prefix). For
    ``beam`` and ``fanout_beams``, where the running beams behind a step are not visible in the output, only the first step once any
    token differs."""
    differs = (ref.new_tokens != got.new_tokens).any(dim=0)
    if not bool(differs.any()):
        return len(ref.logits)
    if ref.mode in ("beam", "fanout_beams"):
        return 1
    return int(differs.nonzero()[0, 0]) + 1


def _close(case: CacheCase, mode: str, what: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(
        got,
        ref,
        atol=case.logits_atol,
        rtol=case.logits_rtol,
        msg=lambda m: (
            f"[{case.name}] {mode}: {what} differ from DynamicCache's (atol={case.logits_atol}, "
            f"rtol={case.logits_rtol}):\n{m}"
        ),
    )


def _first_divergence(ref: ModeResult, got: ModeResult) -> str:
    differs = (ref.new_tokens != got.new_tokens).any(dim=0)
    step = int(differs.nonzero()[0, 0])
    rows = (ref.new_tokens[:, step] != got.new_tokens[:, step]).nonzero().flatten().tolist()
    detail = (
        f"first at generated token {step} (rows {rows}): got {got.new_tokens[:, step].tolist()}, "
        f"reference {ref.new_tokens[:, step].tolist()}"
    )
    if step < len(ref.logits) and step < len(got.logits) and ref.logits[step].shape == got.logits[step].shape:
        diff = (got.logits[step] - ref.logits[step]).abs().max().item()
        detail += f"; max |logits diff| at that step: {diff:.3e}"
    return detail


def assert_conforms(case: CacheCase, ref: ModeResult, got: ModeResult) -> None:
    """Raise AssertionError unless ``got`` (a run with ``case``'s cache) conforms to ``ref`` (the DynamicCache run)
    under the case's promise (see ``cases.py``)."""
    mode = ref.mode
    assert got.mode == mode, (got.mode, mode)
    assert got.sequences.shape == ref.sequences.shape, (
        f"[{case.name}] {mode}: sequences shape {tuple(got.sequences.shape)} != reference {tuple(ref.sequences.shape)}"
    )
    assert got.prompt_length == ref.prompt_length
    assert torch.equal(got.sequences[:, : got.prompt_length], ref.sequences[:, : ref.prompt_length]), (
        f"[{case.name}] {mode}: the prompt part of the output differs from the reference"
    )
    assert len(got.logits) == len(ref.logits), (
        f"[{case.name}] {mode}: {len(got.logits)} logits steps, reference has {len(ref.logits)}"
    )

    # 1. tokens
    if case.lossless:
        assert torch.equal(got.new_tokens, ref.new_tokens), (
            f"[{case.name}] {mode}: generated tokens differ from DynamicCache's, {_first_divergence(ref, got)}\n"
            f"got       {got.new_tokens.tolist()}\nreference {ref.new_tokens.tolist()}"
        )
    else:
        agreement = (got.new_tokens == ref.new_tokens).float().mean().item()
        assert agreement >= case.min_token_agreement, (
            f"[{case.name}] {mode}: {agreement:.1%} of generated tokens agree with DynamicCache's, the case promises "
            f">= {case.min_token_agreement:.1%}; {_first_divergence(ref, got)}"
        )

    # 2. logits (and scores) of every step with a shared context
    n_shared = shared_context_steps(ref, got)
    if not case.lossless and mode in ("beam", "fanout_beams"):
        # A lossy cache may reorder the hidden running beams even when the returned ones agree: only the first
        # step's context is known to be identical.
        n_shared = min(n_shared, 1)
    for i in range(n_shared):
        _close(case, mode, f"logits of step {i} (of {len(ref.logits)})", got.logits[i], ref.logits[i])
    if ref.scores is not None:
        assert got.scores is not None and len(got.scores) == len(ref.scores), (
            f"[{case.name}] {mode}: scores missing"
        )
        for i in range(n_shared):
            _close(case, mode, f"scores of step {i} (of {len(ref.scores)})", got.scores[i], ref.scores[i])
    assert len(got.aux_logits) == len(ref.aux_logits)
    for i, (g, r) in enumerate(zip(got.aux_logits, ref.aux_logits, strict=True)):
        _close(case, mode, f"auxiliary logits #{i}", g, r)

    # 3. contract values (get_seq_length() after each forward, ...)
    assert got.info == ref.info, f"[{case.name}] {mode}: {got.info} != reference {ref.info}"
