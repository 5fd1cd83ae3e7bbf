"""KVzipCache and `reconstruct`: a context compressed before its question, by how the model reads it to repeat it.

KVzip (Kim et al., 2025) scores a prefilled context with a second forward: the model is asked to repeat the context,
the context's tokens are fed again, and each cached token scores the largest attention any repeating query gave it
(`eviction.ReconstructionPolicy`). That forward needs the model, which a cache layer never has: `reconstruct(model,
cache, context_ids, tokenizer)` (or `KVzipCache.compress`) runs it, in chunks of the context so that its memory and
positions stay bounded, drops the repeat's tokens and evicts the cache down to its budget per KV head.

>>> cache = KVzipCache(model.config, budget=820)           # or budget=0.2: a fifth of the context, whatever its length
>>> with torch.no_grad():                                  # (an evicting cache refuses gradients)
...     model(context_ids, cache=cache)                    # the context, held whole
...     cache.compress(model, context_ids, tokenizer)      # the repeat: scored, dropped, evicted to 820 per head
>>> model.generate(torch.cat([context_ids, question_ids], -1), cache=cache, max_new_tokens=20)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig

from .errors import CacheMismatchError, ConfigError, UnsupportedModelError, UnsupportedOperationError
from .evicting_cache import EvictingCache
from .eviction.declare import Setting
from .eviction.reconstruction import ReconstructionPolicy
from .layer import KVLayer
from .model_spec import ModelSpec
from .retention.window import SlidingWindow
from .transformers_compat import cache_kwargs

#: KVzip's instructions (as kvpress words them): before the first chunk, and before a later one, which then goes on
#: with the last `overlap` tokens of the chunk before it.
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
#: How `reconstruct` shares the budget among layers.
BUDGETS = ("uniform", "global")


@dataclass(frozen=True)
class RepeatPrompt:
    """Token ids of the reconstruction's instruction: `first` before the first chunk, `later` before the others
    (followed by the previous chunk's last tokens), then `suffix` (a chat template's turn to the assistant), then the
    chunk itself."""

    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...] = ()

    @classmethod
    def from_tokenizer(cls, tokenizer) -> RepeatPrompt:
        """KVzip's instructions, closed by the tokenizer's chat template (the end of a user turn and the start of the
        assistant's) when it has one, else by a newline."""
        suffix = "\n"
        if getattr(tokenizer, "chat_template", None):
            marker = "\x00kvzip\x00"
            text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
            suffix = text.split(marker, 1)[1]

        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

        return cls(encode(FIRST_PROMPT), encode(LATER_PROMPT), encode(suffix))


class KVzipCache(EvictingCache, policy=ReconstructionPolicy):
    """KVzip: a context prefilled whole, then compressed by `compress(model, context_ids, tokenizer)` to `budget`
    tokens per KV head, ranked by the attention a reconstruction of the context gives them
    (`ReconstructionPolicy`); the first `sinks` positions and the `recent` newest tokens are kept first. The
    reconstruction repeats the context in chunks of `chunk_size` tokens. `budget` is tokens, or a share of the context
    (`budget=0.2`: a fifth of it, sized at the context's prefill, the cache's first forward; `EvictingCache`). `budgets="global"` (default) shares
    `budget x kv_heads x layers` slots among the layers by the scores of all of them together (KVzip's one top-k; each
    layer keeps the mean over its heads of what it won, and that is its budget from then on); `"uniform"` gives each
    layer `budget`.

    Until `compress` runs, every forward appends. After it, `compress="prefill"` (default) lets the question and the
    answer append (the budget bounds the compressed context, not the cache); `compress="always"` evicts back to the
    budget after every forward, tokens that came after the compression leaving as they leave the `recent` window (they
    have no reconstruction score). On a hybrid model (Gemma 3) the full-attention layers are scored and compressed; the
    sliding-window layers keep their window, unchanged by the reconstruction. Assisted decoding is refused.
    """

    settings = (Setting("chunk_size", int, 2048, minimum=1, key="chunk"),
                Setting("budgets", str, "global", choices=BUDGETS))  # fmt: skip

    def __init__(self, config: PreTrainedConfig, **options):
        kinds = {layer.kind for layer in ModelSpec.from_config(config).layers}
        if kinds - {"full", "sliding", "chunked"}:
            raise UnsupportedModelError(
                f"KVzipCache serves models of full-attention layers, sliding-window ones beside them; this one has "
                f"{sorted(kinds)} layers"
            )
        super().__init__(config, **options)

    def compress(self, model, context_ids: torch.Tensor, tokenizer=None, **options) -> None:
        """`reconstruct(model, self, context_ids, tokenizer, **options)`, with the cache's `chunk_size` and `budgets` by
        default."""
        options = {"chunk_size": self.chunk_size, "budgets": self.budgets, **options}
        reconstruct(model, self, context_ids, tokenizer, **options)


def _scored_layers(cache) -> tuple[list[KVLayer], list[KVLayer]]:
    """(the layers a ReconstructionPolicy scores, the sliding-window layers beside them)."""
    layers = list(getattr(cache, "layers", ()))
    scored = [
        layer for layer in layers if isinstance(getattr(layer, "retention", None), ReconstructionPolicy)
    ]
    windowed = [layer for layer in layers if isinstance(getattr(layer, "retention", None), SlidingWindow)]
    if not scored or len(scored) + len(windowed) != len(layers):
        raise ConfigError(
            f"reconstruct needs a cache whose full-attention layers are scored by a ReconstructionPolicy (a "
            f"KVzipCache); {type(cache).__name__} has {len(scored)} of {len(layers) - len(windowed)}"
        )
    return scored, windowed


def _check_model(model, layers: list[KVLayer]) -> None:
    """The cache was built for this model: as many layers, with the same KV heads and head size."""
    spec = ModelSpec.from_config(model.config)
    want = [(layer.num_kv_heads, layer.head_dim) for layer in spec.layers]
    have = [(layer.spec.num_kv_heads, layer.spec.head_dim) for layer in sorted(layers, key=lambda la: la.spec.index)]
    if want != have:
        raise CacheMismatchError(
            f"the cache was built for {len(have)} layers of (kv_heads, head_dim) {sorted(set(have))}, the model has "
            f"{len(want)} of {sorted(set(want))}"
        )


def _drop_newest(layers: list[KVLayer], count: int) -> None:
    """Forgets the `count` newest tokens of every layer (the repeat's: nothing was evicted since they came)."""
    for layer in layers:
        with layer.placement.using(layer.storage):
            layer.storage.drop_back(count)
        layer.seen -= count


def reconstruct(
    model,
    cache,
    context_ids: torch.Tensor,
    tokenizer=None,
    *,
    prompt: RepeatPrompt | None = None,
    chunk_size: int = 2048,
    overlap: int = 8,
    budgets: str = "global",
) -> None:
    """Scores the context a cache holds by a reconstruction of it (KVzip), then evicts it to its budget per KV head.

    `context_ids` `[batch, n]` are the tokens the model is asked to repeat: the context the cache holds, or the part of
    it that matters (say, without a chat template's system turn). They go in chunks of `chunk_size` tokens, one
    forward each after the instruction (`prompt`, by default `RepeatPrompt.from_tokenizer(tokenizer)`; a later chunk's
    starts with the `overlap` last tokens of the one before); each forward's tokens are dropped once it has attended,
    so the cache's positions and memory grow by one chunk at most. Rows are not padded (no attention mask is passed).
    `budgets` (`BUDGETS`): the layers share the sum of their policies' budgets by the scores (`global_budgets`, KVzip's
    default), or each keeps its own ("uniform").
    """
    layers, windowed = _scored_layers(cache)
    _check_model(model, layers + windowed)
    if prompt is None:
        if tokenizer is None:
            raise ConfigError(
                "reconstruct needs the tokenizer (for KVzip's instruction) or prompt=RepeatPrompt(...)"
            )
        prompt = RepeatPrompt.from_tokenizer(tokenizer)
    if context_ids.ndim != 2 or context_ids.shape[1] < 1:
        raise ConfigError(
            f"context_ids are [batch, tokens] with tokens >= 1, got shape {tuple(context_ids.shape)}"
        )
    if budgets not in BUDGETS:
        raise ConfigError(f"budgets must be one of {BUDGETS}, got {budgets!r}")
    if chunk_size < 1 or overlap < 0:
        raise ConfigError(
            f"chunk_size must be >= 1 and overlap >= 0, got chunk_size={chunk_size}, overlap={overlap}"
        )
    held = cache.get_seq_length()
    if held < 1:
        raise UnsupportedOperationError(
            "reconstruct scores a context the cache holds: prefill the context first"
        )
    batch = layers[0].storage.batch_size
    if context_ids.shape[0] != batch:
        raise CacheMismatchError(f"context_ids have {context_ids.shape[0]} rows, the cache holds {batch}")
    n = context_ids.shape[1]
    longest = len(prompt.later if n > chunk_size else prompt.first) + len(prompt.suffix) + min(n, chunk_size)
    longest += min(overlap, chunk_size) if n > chunk_size else 0
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and held + longest > limit:
        raise ConfigError(
            f"the reconstruction needs positions up to {held} held + {longest} of a chunk's forward = "
            f"{held + longest}, "
            f"the model has {limit}: give a smaller chunk_size (now {chunk_size})"
        )
    policies = [layer.retention for layer in layers]
    ids = context_ids.to(model.device)
    for policy in policies:
        policy.scoring = True
    for layer in windowed:  # the window evicts nothing while the repeat passes: its tokens are dropped after each
        layer.record_past = True
    try:
        with torch.no_grad():
            for start in range(0, n, chunk_size):
                head = prompt.first if start == 0 else prompt.later
                lead = torch.tensor([*head], dtype=ids.dtype, device=ids.device).expand(batch, -1)
                tail = ids[:, max(0, start - overlap) : start] if start else ids[:, :0]
                suffix = torch.tensor([*prompt.suffix], dtype=ids.dtype, device=ids.device).expand(batch, -1)
                forward = torch.cat([lead, tail, suffix, ids[:, start : start + chunk_size]], dim=1)
                model(input_ids=forward, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
                _drop_newest(layers + windowed, forward.shape[1])
    finally:
        for policy in policies:
            policy.scoring = False
        for layer in windowed:
            layer.record_past = False
            with layer.placement.using(layer.storage):
                layer.storage.shrink_to_fit()  # the repeat's chunks grew the window's buffers
    shares = global_budgets(layers) if budgets == "global" else [None] * len(layers)
    for layer, share in zip(layers, shares, strict=True):
        with layer.placement.using(layer.storage):
            layer.retention.evict_scored(layer.storage, share)


def global_budgets(layers: list[KVLayer]) -> list[int]:
    """Each layer's budget when the layers share one (KVzip's top-k over every layer and KV head): their policies'
    `budget x kv_heads` slots summed go to the highest ranks of all layers together (sinks and recent first, by their
    `score`), and a layer gets the mean over its heads and rows of the slots it won, rounded, at least sinks + recent +
    1 and at most what it holds; what that adds over the sum of the budgets is taken back from the largest shares. One
    read back of the counts per reconstruction."""
    ranks = []
    for layer in layers:
        with layer.placement.using(layer.storage):
            ranks.append(layer.retention.score(layer.storage).flatten(1))  # [batch, kv_heads x held]
    total = sum(layer.retention.budget * layer.storage.head_dims[0] for layer in layers)
    flat = torch.cat(ranks, dim=1)
    owner = torch.cat([torch.full((r.shape[1],), i, device=flat.device) for i, r in enumerate(ranks)])
    top = flat.topk(min(total, flat.shape[1]), dim=1).indices
    won = torch.zeros(flat.shape[0], len(layers), device=flat.device).scatter_add_(1, owner[top], torch.ones_like(
        top, dtype=torch.float32)).mean(0).tolist()  # fmt: skip
    least = [layer.retention.sinks + layer.retention.recent + 1 for layer in layers]
    shares = [min(layer.storage.held, max(low, round(slots / layer.storage.head_dims[0])))
              for layer, slots, low in zip(layers, won, least, strict=True)]  # fmt: skip
    over = sum(shares) - sum(layer.retention.budget for layer in layers)  # (from rounding and the least ones)
    for i in sorted(range(len(shares)), key=lambda i: -shares[i]):  # taken back from the largest shares
        cut = min(max(0, over), shares[i] - least[i])
        shares[i] -= cut
        over -= cut
    return shares
