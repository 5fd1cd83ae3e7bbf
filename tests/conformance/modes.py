"""The generate modes of the conformance suite.

Each mode is a function ``run_<mode>(model, cache_factory, assistant) -> ModeResult``. It calls
``cache_factory(model)`` for every cache it needs, passes that object explicitly (``**cache_kwargs(cache)``) and
records what a comparison needs. The same function is run once with the reference factory
(``DynamicCache(config=model.config)``) and once with the factory of the case under test; everything else
(prompts, seeds, generation arguments) is identical between the two runs.

``ModeResult.logits[i]`` is always the raw float32 logits that produced generated token ``i`` (one entry per new
token, rows x vocab; for ``manual_loop`` the whole forward output, rows x q_len x vocab). Entry ``i`` therefore has
the same context in both runs as long as the tokens before ``i`` agree, which is what ``compare.py`` relies on.

Lengths are fixed: every generate call has ``min_new_tokens == max_new_tokens`` (this masks eos, so no row stops
early and ``scores`` hold ``-inf`` in the eos column), and the prompts avoid pad/bos/eos ids.

Sequence lengths versus the sliding window (``SLIDING_WINDOW`` = 8): every prompt but ``sample``'s (6 tokens, so
the window is first crossed while decoding) is longer than the window, so the prefill already exceeds it (for
``left_padded`` only the longest row); every mode's prompt + new tokens exceeds it, so the window also slides during
decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import Cache, PreTrainedModel

from hf_kvplus import cache_kwarg, cache_kwargs

from .models import FIRST_ORDINARY_TOKEN, PAD_TOKEN_ID, SLIDING_WINDOW, VOCAB_SIZE

CacheFactory = Callable[[PreTrainedModel], Cache]

MAX_NEW_TOKENS = 10
SAMPLING_SEED = 20240611
PROMPT_SEED = 7


@dataclass
class ModeResult:
    """What one run of a mode produced."""

    mode: str
    #: full sequences (prompt + generated), rows x length; for ``left_padded`` the padded prompt is included
    sequences: torch.Tensor
    #: number of leading columns of ``sequences`` that are the prompt
    prompt_length: int
    #: ``logits[i]``: raw logits that produced generated token ``i`` (see the module docstring)
    logits: tuple[torch.Tensor, ...]
    #: processed scores per generated token (``scores`` mode only)
    scores: tuple[torch.Tensor, ...] | None = None
    #: logits whose context never depends on generated tokens (e.g. the prefix forward of ``continue_prefix``)
    aux_logits: tuple[torch.Tensor, ...] = ()
    #: every cache object the factory built for this run, in order
    caches: list[Cache] = field(default_factory=list)
    #: the cache handed back (by generate, or by every forward of ``manual_loop``; None if they differ)
    returned_cache: Cache | None = None
    #: contract values that must equal the reference's exactly (e.g. ``get_seq_length()`` after each forward)
    info: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_length :]


def make_prompt(length: int, *, seed: int = PROMPT_SEED, batch: int = 1) -> torch.Tensor:
    """Deterministic prompt ids (``batch`` x ``length``) of ordinary tokens (no pad / bos / eos)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_ORDINARY_TOKEN, VOCAB_SIZE, (batch, length), generator=gen, device="cpu")
    return ids.to(torch.get_default_device())  # the same ids on every device


def _fixed_length(n: int = MAX_NEW_TOKENS) -> dict:
    return dict(max_new_tokens=n, min_new_tokens=n)


def _new_cache(factory: CacheFactory, model: PreTrainedModel, caches: list[Cache]) -> Cache:
    cache = factory(model)
    caches.append(cache)
    return cache


def _generate(
    mode: str,
    model: PreTrainedModel,
    cache_factory: CacheFactory,
    input_ids: torch.Tensor,
    *,
    seed: int | None = None,
    **kwargs,
) -> ModeResult:
    """One generate call with a fresh cache from ``cache_factory``; ``seed`` is set right before the call."""
    caches: list[Cache] = []
    cache = _new_cache(cache_factory, model, caches)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            **cache_kwargs(cache),
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )
    return ModeResult(
        mode=mode,
        sequences=out.sequences,
        prompt_length=input_ids.shape[1],
        logits=tuple(out.logits),
        scores=tuple(out.scores) if out.scores is not None else None,
        caches=caches,
        returned_cache=getattr(out, cache_kwarg()),
    )


# --- the modes ---------------------------------------------------------------------------------------------------


def run_greedy(model: PreTrainedModel, cache_factory: CacheFactory, assistant: PreTrainedModel) -> ModeResult:
    """Greedy decoding, batch 1, prompt of 12 (prefill longer than the window)."""
    return _generate(
        "greedy", model, cache_factory, make_prompt(12, seed=1), do_sample=False, **_fixed_length()
    )


def run_sample(model: PreTrainedModel, cache_factory: CacheFactory, assistant: PreTrainedModel) -> ModeResult:
    """Multinomial sampling (top_k=50, temperature 0.9), batch 1, prompt of 6 (window exceeded while decoding)."""
    return _generate(
        "sample",
        model,
        cache_factory,
        make_prompt(6, seed=2),
        seed=SAMPLING_SEED,
        do_sample=True,
        top_k=50,
        temperature=0.9,
        **_fixed_length(),
    )


def run_beam(model: PreTrainedModel, cache_factory: CacheFactory, assistant: PreTrainedModel) -> ModeResult:
    """Beam search, 3 beams, 2 returned sequences: generate calls ``cache.reorder_cache(beam_idx)`` every step."""
    return _generate(
        "beam",
        model,
        cache_factory,
        make_prompt(9, seed=3),
        do_sample=False,
        num_beams=3,
        num_return_sequences=2,
        **_fixed_length(),
    )


def run_sample_multi(
    model: PreTrainedModel, cache_factory: CacheFactory, assistant: PreTrainedModel
) -> ModeResult:
    """Sampling with 3 returned sequences: the prompt is expanded to 3 rows before the (empty) cache is filled."""
    return _generate(
        "sample_multi",
        model,
        cache_factory,
        make_prompt(10, seed=4),
        seed=SAMPLING_SEED,
        do_sample=True,
        num_return_sequences=3,
        top_k=50,
        **_fixed_length(),
    )


def run_assisted(
    model: PreTrainedModel, cache_factory: CacheFactory, assistant: PreTrainedModel
) -> ModeResult:
    """Assisted (speculative) greedy decoding with the tiny assistant; the assistant keeps its own DynamicCache.

    On the main model's cache generate calls ``activate_past_recording()`` once, then per round a multi-token
    verification forward (draft + 1 tokens) followed by ``crop(-rejected)`` (``crop(0)`` included).
    """
    return _generate(
        "assisted",
        model,
        cache_factory,
        make_prompt(10, seed=5),
        assistant_model=assistant,
        do_sample=False,
        **_fixed_length(12),
    )


def prompt_lookup_prompt() -> torch.Tensor:
    """A prompt made of repeated n-grams, so prompt-lookup decoding finds matches and proposes drafts."""
    a = make_prompt(5, seed=6)[0]
    b = make_prompt(3, seed=16)[0]
    return torch.cat([a, b, a, b[:1], a, a[:2]])[None]  # 5+3+5+1+5+2 = 21 tokens, ends on a's leading 2-gram


def run_prompt_lookup(
    model: PreTrainedModel, cache_factory: CacheFactory, assistant: PreTrainedModel
) -> ModeResult:
    """Prompt-lookup decoding (``prompt_lookup_num_tokens=3``): drafts from n-grams of the prompt, verified in one
    forward, rejected ones cropped, as in assisted decoding."""
    return _generate(
        "prompt_lookup",
        model,
        cache_factory,
        prompt_lookup_prompt(),
        do_sample=False,
        prompt_lookup_num_tokens=3,
        **_fixed_length(12),
    )


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of lengths 12, 7 and 4, left-padded with the pad token; returns (input_ids, attention_mask)."""
    lengths = (12, 7, 4)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = make_prompt(length, seed=30 + row)[0]
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def run_left_padded(
    model: PreTrainedModel, cache_factory: CacheFactory, assistant: PreTrainedModel
) -> ModeResult:
    """Greedy decoding of a left-padded batch of 3 prompts (12, 7, 4 real tokens) with attention_mask."""
    input_ids, attention_mask = left_padded_batch()
    return _generate(
        "left_padded",
        model,
        cache_factory,
        input_ids,
        attention_mask=attention_mask,
        pad_token_id=PAD_TOKEN_ID,
        do_sample=False,
        **_fixed_length(),
    )


def _prefix_then_generate(
    mode: str,
    model: PreTrainedModel,
    cache_factory: CacheFactory,
    prompt: torch.Tensor,
    prefix_length: int,
    fan_out: int = 1,
    **generate_kwargs,
) -> ModeResult:
    """Fill one cache with a forward over ``prompt[:, :prefix_length]``, repeat its rows ``fan_out`` times with
    ``batch_repeat_interleave`` if asked, then ``generate`` the full prompt from that cache."""
    caches: list[Cache] = []
    cache = _new_cache(cache_factory, model, caches)
    with torch.no_grad():
        prefix_out = model(input_ids=prompt[:, :prefix_length], **cache_kwargs(cache), use_cache=True)
        seen_after_prefix = cache.get_seq_length()
        if fan_out > 1:
            cache.batch_repeat_interleave(fan_out)
        out = model.generate(
            prompt,
            **cache_kwargs(cache),
            return_dict_in_generate=True,
            output_logits=True,
            do_sample=False,
            **generate_kwargs,
            **_fixed_length(),
        )
    return ModeResult(
        mode=mode,
        sequences=out.sequences,
        prompt_length=prompt.shape[1],
        logits=tuple(out.logits),
        aux_logits=(prefix_out.logits,),
        caches=caches,
        returned_cache=getattr(out, cache_kwarg()),
        info={"seq_length_after_prefix": seen_after_prefix},
    )


def run_continue_prefix(
    model: PreTrainedModel, cache_factory: CacheFactory, assistant: PreTrainedModel
) -> ModeResult:
    """Fill the cache with a forward over a 10-token prefix (longer than the window), then ``generate`` the full
    14-token prompt with that same cache. generate feeds only the ``len(prompt) - cache.get_seq_length()`` tokens the
    cache has not seen, so ``get_seq_length()`` must count tokens seen, not tokens kept."""
    return _prefix_then_generate("continue_prefix", model, cache_factory, make_prompt(14, seed=8), 10)


def run_fanout_beams(
    model: PreTrainedModel, cache_factory: CacheFactory, assistant: PreTrainedModel
) -> ModeResult:
    """Fill the cache at batch 1, fan it out with ``cache.batch_repeat_interleave(3)`` (how a user reuses a filled
    prompt for beams: generate itself never calls it), then beam-search the full prompt with 3 beams from it."""
    return _prefix_then_generate(
        "fanout_beams", model, cache_factory, make_prompt(14, seed=10), 10, fan_out=3,
        num_beams=3, num_return_sequences=2,
    )


def run_scores(model: PreTrainedModel, cache_factory: CacheFactory, assistant: PreTrainedModel) -> ModeResult:
    """Greedy decoding of a batch of 2 unpadded prompts with a repetition penalty, returning processed ``scores``
    (which differ from the raw logits, and hold -inf for eos while ``min_new_tokens`` is not reached)."""
    return _generate(
        "scores",
        model,
        cache_factory,
        make_prompt(11, seed=9, batch=2),
        do_sample=False,
        repetition_penalty=1.3,
        output_scores=True,
        **_fixed_length(),
    )


MANUAL_PREFILL = 10
MANUAL_STEPS_BEFORE_CHUNK = 4
MANUAL_CHUNK = 3
MANUAL_STEPS_AFTER_CHUNK = 4


def run_manual_loop(
    model: PreTrainedModel, cache_factory: CacheFactory, assistant: PreTrainedModel
) -> ModeResult:
    """A hand-written loop of ``model(input_ids=..., **cache_kwargs(cache), use_cache=True)``, batch 2, no
    position_ids and no attention_mask (the model derives positions from ``cache.get_seq_length()``):

    prefill of 10 tokens, 4 greedy steps of one token, one chunk of 3 tokens (the greedy token + 2 fixed ones:
    a chunked prefill over a non-empty cache), 4 more greedy steps. Every forward's logits are recorded.
    """
    prompt = make_prompt(MANUAL_PREFILL, seed=10, batch=2)
    chunk_tail = make_prompt(MANUAL_CHUNK - 1, seed=11, batch=2)
    caches: list[Cache] = []
    cache = _new_cache(cache_factory, model, caches)
    logits: list[torch.Tensor] = []
    generated: list[torch.Tensor] = []
    seq_lengths: list[int] = []
    returned: list[Cache] = []
    with torch.no_grad():

        def step(ids: torch.Tensor) -> torch.Tensor:
            out = model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
            returned.append(getattr(out, cache_kwarg()))
            step_logits = out.logits.float()
            logits.append(step_logits)
            seq_lengths.append(cache.get_seq_length())
            token = step_logits[:, -1].argmax(-1, keepdim=True)
            generated.append(token)
            return token

        token = step(prompt)
        for _ in range(MANUAL_STEPS_BEFORE_CHUNK):
            token = step(token)
        token = step(torch.cat([token, chunk_tail], dim=-1))
        for _ in range(MANUAL_STEPS_AFTER_CHUNK):
            token = step(token)
    return ModeResult(
        mode="manual_loop",
        # the prompt, then the greedy token of each forward (the chunk's two fixed tokens are not listed)
        sequences=torch.cat([prompt, *generated], dim=-1),
        prompt_length=prompt.shape[1],
        logits=tuple(logits),
        caches=caches,
        returned_cache=returned[-1] if all(r is returned[-1] for r in returned) else None,
        info={"seq_lengths": seq_lengths},
    )


ModeRunner = Callable[[PreTrainedModel, CacheFactory, PreTrainedModel], ModeResult]

MODES: dict[str, ModeRunner] = {
    "greedy": run_greedy,
    "sample": run_sample,
    "beam": run_beam,
    "sample_multi": run_sample_multi,
    "assisted": run_assisted,
    "prompt_lookup": run_prompt_lookup,
    "left_padded": run_left_padded,
    "continue_prefix": run_continue_prefix,
    "fanout_beams": run_fanout_beams,
    "scores": run_scores,
    "manual_loop": run_manual_loop,
}

#: expected ``get_seq_length()`` after each forward of ``manual_loop``
MANUAL_EXPECTED_SEQ_LENGTHS = (
    [MANUAL_PREFILL + i for i in range(MANUAL_STEPS_BEFORE_CHUNK + 1)]
    + [MANUAL_PREFILL + MANUAL_STEPS_BEFORE_CHUNK + MANUAL_CHUNK]
    + [
        MANUAL_PREFILL + MANUAL_STEPS_BEFORE_CHUNK + MANUAL_CHUNK + i + 1
        for i in range(MANUAL_STEPS_AFTER_CHUNK)
    ]
)

assert SLIDING_WINDOW < MANUAL_PREFILL
