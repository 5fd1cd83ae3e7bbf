"""What a lossy cache costs the model at hand on the user's own text (`check_formats`, `kvplus check-formats`).

The project's low-bit figures are measured on SmolLM2-135M, and the same preset costs other families, and other texts,
several times more or less (k2v2 at 4K tokens of a novel: +2.5% on SmolLM2-135M, several times that on Gemma 3 270M).
A short chunked pass per spec on the user's ids, against DynamicCache on the same ids (calibrate.py's pass: the
perplexity change, the KL of the next-token distributions, and the per-token NLL for the paired standard error), with
the bits per coordinate read off the cache (`quantized_report`), says before a preset is trusted whether it is within a
threshold there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm
from transformers import Cache, DynamicCache, PreTrainedModel

from ..errors import ConfigError, UnsupportedOperationError
from ..quantized_cache import QuantizedCache
from ..specs import CacheSpec, parse_cache_spec
from .calibrate import chunked_pass

#: The presets a user picks, as they ship for the model (its family's layer formats and key scale included).
DEFAULT_SPECS = ("quantized:int4", "quantized:int2", "quantized:k4v2", "quantized:k3v2", "quantized:k2v2")


@dataclass(frozen=True)
class FormatCost:
    """One cache on one text: the perplexity change from DynamicCache (%) with its paired standard error (points),
    the mean KL(full || this) of the next-token distributions (nats per token), the bits per coordinate it held
    (None for a cache without `quantized_report`), the model family whose layer formats it took (or None), and
    whether the change is over `threshold_pct`."""

    spec: str
    tokens: int
    delta_pct: float
    se_pct: float
    kl: float
    bits_per_coordinate: float | None
    family_defaults: str | None
    threshold_pct: float

    @property
    def over(self) -> bool:
        return self.delta_pct > self.threshold_pct

    def message(self) -> str:
        family = f" (with {self.family_defaults}'s layer formats)" if self.family_defaults else ""
        bits = "" if self.bits_per_coordinate is None else f" at {self.bits_per_coordinate:.2f} bits per coordinate"
        verdict = (f"over the {self.threshold_pct:g}% threshold: calibrate it for this model (`kvplus calibrate`), or "
                   "take a format with more bits" if self.over else f"within the {self.threshold_pct:g}% threshold")
        return (f"{self.spec}{family}: {self.delta_pct:+.2f}% perplexity (+- {self.se_pct:.2f}){bits} on "
                f"{self.tokens} tokens of your text; {verdict}")


@dataclass(frozen=True)
class FormatCheck:
    """`check_formats`' result: one `FormatCost` per spec, measured against DynamicCache's `reference_perplexity` on
    the same `tokens` ids fed in chunks of `chunk_size`."""

    model: str
    tokens: int
    chunk_size: int
    threshold_pct: float
    reference_perplexity: float
    costs: tuple[FormatCost, ...]

    def over(self) -> list[FormatCost]:
        """The specs whose perplexity change is over the threshold."""
        return [cost for cost in self.costs if cost.over]

    def advice(self) -> list[str]:
        """A line per spec over the threshold, naming the specs within it (fewest bits first) to use instead."""
        within = sorted((c for c in self.costs if not c.over), key=lambda c: (c.bits_per_coordinate or math.inf))
        instead = " or ".join(f"{c.spec} ({c.delta_pct:+.1f}%)" for c in within[:2])
        other = (f"use {instead}" if instead else
                 "no spec checked is within it: calibrate (`kvplus calibrate`) or keep a lossless cache")  # fmt: skip
        return [f"{c.spec} costs {c.delta_pct:+.1f}% perplexity on this model and text "
                f"(threshold {self.threshold_pct:g}%): {other}" for c in self.over()]  # fmt: skip

    def to_markdown(self) -> str:
        lines = [f"{self.model}, {self.tokens} tokens in chunks of {self.chunk_size}, against DynamicCache "
                 f"(perplexity {self.reference_perplexity:.3f}); threshold {self.threshold_pct:g}%", "",
                 "| spec | perplexity change | +- | KL, mnat/token | bits per coordinate | verdict |",
                 "| --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
        for c in self.costs:
            bits = "-" if c.bits_per_coordinate is None else f"{c.bits_per_coordinate:.2f}"
            lines.append(f"| `{c.spec}` | {c.delta_pct:+.2f}% | {c.se_pct:.2f} | {1e3 * c.kl:.3f} | {bits} | "
                         f"{'over' if c.over else 'within'} |")  # fmt: skip
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"model": self.model, "tokens": self.tokens, "chunk_size": self.chunk_size,
                "threshold_pct": self.threshold_pct, "reference_perplexity": self.reference_perplexity,
                "costs": [asdict(c) | {"over": c.over} for c in self.costs],
                "over": [c.spec for c in self.over()]}  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def check_formats(model: PreTrainedModel, input_ids: torch.Tensor, specs: Sequence[str | CacheSpec] | None = None, *,
                  threshold_pct: float = 1.0, tokens: int = 1024, chunk_size: int = 32, model_name: str | None = None,
                  progress: bool = True) -> FormatCheck:  # fmt: skip
    """Each lossy cache of `specs` (cache spec strings; default `DEFAULT_SPECS`) on the first `tokens` of `input_ids`
    (the user's own text: 1,024 tokens take about 20 s of one CPU core a spec for a 270M model), fed in chunks of
    `chunk_size`, against DynamicCache on the same ids. Refuses a lossless spec, fewer ids than `tokens`, and
    `tokens` a cache's full-precision window would hold whole (nothing coded: nothing measured)."""
    parsed = [s if isinstance(s, CacheSpec) else parse_cache_spec(s) for s in (DEFAULT_SPECS if specs is None else specs)]
    lossless = [s.text for s in parsed if s.lossless]
    if lossless or not parsed:
        raise ConfigError(f"check_formats measures lossy caches; {lossless} {'are lossless' if lossless else 'given'}"
                          ": nothing to measure")  # fmt: skip
    ids = _first_tokens(input_ids, tokens)
    caches = [(s.text, s.build(model.config, max_length=tokens)) for s in parsed]
    for text, cache in caches:
        _check_window(text, cache, tokens)
    bar = tqdm(total=len(caches) + 1, desc="check-formats", unit="pass", disable=not progress)
    reference, reference_nll = _reference(model, ids, chunk_size)
    bar.update()
    costs = []
    for text, cache in caches:
        costs.append(_cost(model, ids, text, cache, chunk_size, reference, reference_nll, threshold_pct))
        bar.update()
    bar.close()
    name = model_name or getattr(model.config, "_name_or_path", "") or model.config.model_type
    return FormatCheck(name, tokens, chunk_size, threshold_pct, math.exp(reference_nll.double().mean().item()),
                       tuple(costs))  # fmt: skip


def check_format(model: PreTrainedModel, input_ids: torch.Tensor, bits: str, *, threshold_pct: float = 1.0,
                 chunk_size: int = 32, window: int | None = None, **cache_options) -> FormatCost:
    """What `QuantizedCache(model.config, bits=bits, window=window, **cache_options)` costs on all of `input_ids`
    (`kvplus calibrate --check`): options a spec string does not name (`family_defaults=False`) included."""
    if window is not None:
        cache_options["window"] = window
    ids = _first_tokens(input_ids, input_ids.numel())
    cache = QuantizedCache(model.config, bits=bits, **cache_options)
    _check_window(str(bits), cache, ids.numel())
    reference, reference_nll = _reference(model, ids, chunk_size)
    return _cost(model, ids, str(bits), cache, chunk_size, reference, reference_nll, threshold_pct)


def _first_tokens(input_ids: torch.Tensor, tokens: int) -> torch.Tensor:
    ids = input_ids.reshape(-1)
    if tokens < 2 or ids.numel() < tokens:
        raise ConfigError(f"a format check reads the first {tokens} tokens (at least 2) of the text; it holds "
                          f"{ids.numel()}")  # fmt: skip
    return ids[:tokens]


def _check_window(spec: str, cache: Cache, tokens: int) -> None:
    window = getattr(cache, "window", 0) or 0
    if tokens <= window:
        raise ConfigError(f"{spec} holds the newest {window} tokens at full precision: a check on {tokens} tokens "
                          f"codes none of them; give more than {window} tokens")  # fmt: skip


def _reference(model, ids, chunk_size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """DynamicCache's log-probabilities (for the KL) and per-token NLL."""
    if chunk_size < 1:
        raise ConfigError(f"chunk_size must be >= 1, got {chunk_size}")
    reference, nll = [], []
    chunked_pass(model, ids, DynamicCache(config=model.config), chunk_size, reference, nll)
    return reference, torch.cat(nll).double()


def _cost(model, ids, spec: str, cache: Cache, chunk_size: int, reference, reference_nll: torch.Tensor,
          threshold_pct: float) -> FormatCost:
    nll = []
    _, kl = chunked_pass(model, ids, cache, chunk_size, reference, nll)
    difference = torch.cat(nll).double() - reference_nll
    ratio = math.exp(difference.mean().item())
    se = 100 * ratio * difference.std().item() / difference.numel() ** 0.5
    report = getattr(cache, "quantized_report", None)
    try:
        held = report() if report else {}
    except UnsupportedOperationError:  # an evicting cache without coded storage
        held = {}
    return FormatCost(spec, int(ids.numel()), 100 * (ratio - 1), se, kl, held.get("bits_per_coordinate"),
                      held.get("family_defaults"), threshold_pct)  # fmt: skip


__all__ = ["DEFAULT_SPECS", "FormatCheck", "FormatCost", "check_format", "check_formats"]
