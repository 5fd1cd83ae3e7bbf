"""Perplexity of a model on a long text, through a cache.

Two modes feed the same tokens differently:

- **chunked**: prefill chunks of `chunk_size` tokens, each attending to what the cache kept of the
  past; measures what the cache stores.
- **streaming**: a few tokens at a time (`chunk_size`, default 1), as StreamingLLM evaluates: the
  mode evicting caches need, since every token is scored against what survived before it.
- **continuation**: the first `prompt_tokens` in one forward (a prompt, which a prefill-compressing
  cache compresses once, as kvpress does), then the rest a few tokens at a time (`chunk_size`,
  default 1); `continuation_perplexity` scores only the tokens after the prompt.

Token i+1 is scored by the logits at token i, also across chunk boundaries, so both modes score
the same N-1 tokens as one cache-free forward pass (`cache_free_nll`).
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import Cache, PreTrainedModel

from ..errors import ConfigError, ShapeError
from ..transformers_compat import cache_kwargs

MODES = {"chunked": 256, "streaming": 1, "continuation": 1}  # mode -> default chunk size


@dataclass
class PerplexityResult:
    """Per-token negative log-likelihood (nats) of tokens 1..N-1, with segment and overall perplexity."""

    nll: torch.Tensor
    mode: str
    chunk_size: int
    segment_size: int
    cache: str
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.nll.numel()

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.double().mean().item())

    def segments(self) -> list[dict]:
        """Perplexity per `segment_size` scored tokens: start and end token index, perplexity."""
        rows = []
        for start in range(0, self.tokens, self.segment_size):
            part = self.nll[start : start + self.segment_size].double()
            rows.append({"start": start + 1, "end": start + part.numel(), "perplexity": math.exp(part.mean().item())})
        return rows

    @property
    def continuation_perplexity(self) -> float | None:
        """Perplexity of the tokens after the prompt (continuation mode), else None."""
        prompt = self.extra.get("prompt_tokens")
        return None if prompt is None else math.exp(self.nll[prompt - 1 :].double().mean().item())

    def summary(self) -> dict:
        row = {
            "cache": self.cache,
            "mode": self.mode,
            "chunk_size": self.chunk_size,
            "tokens_scored": self.tokens,
            "perplexity": self.perplexity,
            "seconds": self.seconds,
            **self.extra,
        }
        if self.continuation_perplexity is not None:
            row["continuation_perplexity"] = self.continuation_perplexity
        return row

    def to_json(self, path: str | Path, meta: dict | None = None) -> None:
        """`meta` (a run's stamp), summary, segments and every token's NLL."""
        data = {**(meta or {}), **self.summary(), "segment_size": self.segment_size, "segments": self.segments(),
                "nll": self.nll.tolist()}
        Path(path).write_text(json.dumps(data, indent=1))

    def to_csv(self, path: str | Path) -> None:
        """One row per scored token: its index and NLL."""
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["token_index", "nll"])
            writer.writerows((i + 1, value) for i, value in enumerate(self.nll.tolist()))


def plot_perplexity(results: list[PerplexityResult], path: str | Path, title: str = "") -> None:
    """Segment perplexity over position, one line per result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for result in results:
        segments = result.segments()
        axis.plot([s["end"] for s in segments], [s["perplexity"] for s in segments], marker="o", label=result.cache)
    axis.set_xlabel("position (tokens)")
    axis.set_ylabel(f"perplexity per {results[0].segment_size} tokens")
    axis.set_yscale("log")
    axis.set_title(title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")


@torch.inference_mode()
def perplexity(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: Cache | Callable[[], Cache] | None,
    *,
    mode: str = "chunked",
    chunk_size: int | None = None,
    segment_size: int = 1024,
    label: str | None = None,
    progress: bool = True,
    prompt_tokens: int | None = None,
) -> PerplexityResult:
    """Scores `input_ids` (1-d, or `[1, N]`) through `cache` (a Cache, or a factory called once).

    With `cache=None` the model keeps no cache and each chunk sees only itself (a baseline for
    "no memory"); pass `DynamicCache(config=model.config)` for the full-cache reference.
    `prompt_tokens` (continuation mode only, and required there) is the prompt's length.
    """
    if mode not in MODES:
        raise ConfigError(f"unknown perplexity mode {mode!r}; expected one of {sorted(MODES)}")
    ids = _as_row(input_ids)
    chunk = MODES[mode] if chunk_size is None else chunk_size
    if chunk < 1 or segment_size < 1:
        raise ConfigError(f"chunk_size and segment_size must be >= 1, got {chunk} and {segment_size}")
    total = ids.shape[1]
    if total < 2:
        raise ShapeError(f"perplexity needs at least 2 tokens, got {total}")
    if (mode == "continuation") != (prompt_tokens is not None):
        raise ConfigError(f"prompt_tokens is given in the continuation mode, and only there (mode {mode!r})")
    if prompt_tokens is not None and not 1 <= prompt_tokens < total:
        raise ConfigError(f"prompt_tokens must leave a continuation: 1 <= prompt_tokens < {total}, got {prompt_tokens}")
    starts = list(range(0, total, chunk)) if prompt_tokens is None else [0, *range(prompt_tokens, total, chunk)]
    cache_obj = cache() if callable(cache) else cache
    device = next(model.parameters()).device
    ids = ids.to(device)
    pieces, previous_last = [], None
    start_time = time.perf_counter()
    bar = tqdm(total=total, desc=f"ppl {label or mode}", unit="tok", disable=not progress, leave=False)
    for start, end in zip(starts, [*starts[1:], total], strict=True):
        piece = ids[:, start:end]
        out = model(input_ids=piece, **cache_kwargs(cache_obj), use_cache=cache_obj is not None)
        logits = out.logits[0]
        if previous_last is not None:  # the previous chunk's last logits score this chunk's first token
            pieces.append(_token_nll(previous_last[None], piece[0, :1]))
        pieces.append(_token_nll(logits[:-1], piece[0, 1:]))
        previous_last = logits[-1]
        bar.update(piece.shape[1])
    bar.close()
    nll = torch.cat(pieces).cpu()
    return PerplexityResult(
        nll=nll,
        mode=mode,
        chunk_size=chunk,
        segment_size=segment_size,
        cache=label or type(cache_obj).__name__,
        seconds=time.perf_counter() - start_time,
        extra={} if prompt_tokens is None else {"prompt_tokens": prompt_tokens},
    )


@torch.inference_mode()
def cache_free_nll(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token NLL of tokens 1..N-1 from one forward pass over all tokens, without a cache."""
    ids = _as_row(input_ids).to(next(model.parameters()).device)
    logits = model(input_ids=ids, use_cache=False).logits[0]
    return _token_nll(logits[:-1], ids[0, 1:]).cpu()


def _as_row(input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.ndim == 1:
        return input_ids[None]
    if input_ids.ndim == 2 and input_ids.shape[0] == 1:
        return input_ids
    raise ShapeError(f"perplexity scores one sequence: expected [N] or [1, N] token ids, got {tuple(input_ids.shape)}")


__all__ = ["MODES", "PerplexityResult", "cache_free_nll", "perplexity", "plot_perplexity"]
