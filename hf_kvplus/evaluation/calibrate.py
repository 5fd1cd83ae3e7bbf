"""Per-layer bit allocation: how much each layer's format costs a model, measured, and the upgrades that fit a budget of
bits per coordinate (`kvplus calibrate`, `Calibration`).

Every layer at the cache's `bits`, then one layer at a time at each candidate format: how much of the divergence from
the full-precision model that layer's upgrade removes (KL(full || quantized) of the next-token distributions, mean over
the tokens), over the bits it adds (read off the cache). The divergence, not the perplexity: a perplexity change mixes
tokens made likelier and less likely, and on a text the format costs little it is mostly rounding noise, of either
sign. The upgrades with the most gain per bit are taken greedily, at most one per layer, while the bits fit
`max_bits`; the chosen set is then measured as a whole (gains add up only roughly). Measure on a text other than the
one you report on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..calibration import Calibration
from ..errors import ConfigError
from ..formats import parse_bits
from ..model_spec import ModelSpec
from ..quantized_cache import QuantizedCache
from ..storage.quantized import DEFAULT_WINDOW
from ..transformers_compat import cache_kwargs


@dataclass(frozen=True)
class LayerOption:
    """One layer at a candidate format, all other layers at the base bits: the perplexity change and the divergence
    from the full-precision model (`kl`, nats per token) it measured, its `gain` (the base's divergence less its own)
    and the bits per coordinate it adds."""

    layer: int
    bits: str
    delta_pct: float
    kl: float
    gain: float
    added_bits: float

    @property
    def gain_per_bit(self) -> float:
        """Gain over added bits; an option that adds no bits ranks first if it gains, last if not."""
        if self.added_bits <= 0:
            return float("inf") if self.gain > 0 else float("-inf")
        return self.gain / self.added_bits


def choose(options: Sequence[LayerOption], base_bits: float, max_bits: float) -> dict[int, str]:
    """The greedy allocation: options by gain per added bit, best first; one per layer, gains > 0, within `max_bits`."""
    chosen: dict[int, str] = {}
    total = base_bits
    for option in sorted(options, key=lambda o: o.gain_per_bit, reverse=True):
        if option.gain <= 0 or option.layer in chosen or total + option.added_bits > max_bits + 1e-9:
            continue
        chosen[option.layer] = option.bits
        total += option.added_bits
    return chosen


def calibrate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    model_name: str,
    bits: str = "k4v2",
    candidates: Sequence[str] = ("k4v3",),
    max_bits: float = 3.5,
    chunk_size: int = 256,
    window: int = DEFAULT_WINDOW,
    first_tokens: int | None = None,
    rotation_seed: int = 0,
    text: str = "",
    progress: bool = True,
) -> tuple[Calibration, list[LayerOption]]:
    """Measures every layer at every candidate on `input_ids` and returns the calibration within `max_bits` (and
    every option measured). Runs `1 + layers x candidates + 2` perplexity passes."""
    for candidate in (bits, *candidates):
        parse_bits(candidate)
    spec = ModelSpec.from_config(model.config)

    def cache(layer_bits=None) -> QuantizedCache:
        return QuantizedCache(model.config, bits=bits, window=window, first_tokens=first_tokens,
                              rotation_seed=rotation_seed, layer_bits=layer_bits)  # fmt: skip

    reference: list[torch.Tensor] = []  # the full-precision model's log-probabilities, chunk by chunk

    def measure(built) -> tuple[float, float, float]:
        """Perplexity change (%), mean KL from the reference (nats per token), bits per coordinate."""
        nll, kl = _chunked_pass(model, input_ids, built, chunk_size, reference)
        report = getattr(built, "quantized_report", None)  # (none for the reference's DynamicCache)
        return 100 * (math.exp(nll) / reference_ppl - 1), kl, report()["bits_per_coordinate"] if report else 16.0

    reference_ppl = math.exp(_chunked_pass(model, input_ids, DynamicCache(config=model.config), chunk_size, reference)[0])
    base_delta, base_kl, base_bits = measure(cache())
    if base_bits > max_bits:
        raise ConfigError(f"bits={bits!r} alone holds {base_bits:.3f} bits per coordinate, over max_bits={max_bits}")
    layers = [layer.index for layer in spec.layers if layer.holds_kv]
    options = []
    grid = [(layer, candidate) for layer in layers for candidate in candidates]
    for layer, candidate in tqdm(grid, desc="layers", unit="run", disable=not progress):
        delta, kl, measured_bits = measure(cache({layer: candidate}))
        options.append(LayerOption(layer, candidate, delta, kl, base_kl - kl, measured_bits - base_bits))
    chosen = choose(options, base_bits, max_bits)
    final_delta, final_kl, final_bits = measure(cache(chosen))
    calibration = Calibration(
        model=model_name, model_type=getattr(model.config, "model_type", ""), num_layers=spec.num_layers, bits=bits,
        layer_bits=chosen, max_bits=max_bits, bits_per_coordinate=final_bits,
        measured={
            "text": text, "tokens": int(input_ids.numel()), "chunk_size": chunk_size, "window": window,
            "first_tokens": first_tokens, "rotation_seed": rotation_seed, "candidates": list(candidates),
            "objective": "mean KL(full || quantized) of the next-token distributions, nats per token",
            "dynamic_perplexity": reference_ppl, "base_delta_pct": base_delta, "base_kl": base_kl,
            "base_bits": base_bits, "calibrated_delta_pct": final_delta, "calibrated_kl": final_kl,
            "options": [{"layer": o.layer, "bits": o.bits, "delta_pct": o.delta_pct, "kl": o.kl, "gain": o.gain,
                         "added_bits": o.added_bits} for o in options],
        },
    )  # fmt: skip
    return calibration, options


@torch.inference_mode()
def _chunked_pass(model, input_ids, cache, chunk_size: int, reference: list[torch.Tensor]) -> tuple[float, float]:
    """Feeds `input_ids` in chunks through `cache`: the mean NLL of tokens 1.. and the mean KL(reference || this) of the
    next-token distributions over positions 0..N-2. With `reference` empty, fills it with this pass's log-probabilities
    (float16, on the CPU) and returns a KL of 0."""
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    total, filling = ids.shape[1], not reference
    nll = kl = 0.0
    for index, start in enumerate(range(0, total, chunk_size)):
        piece = ids[:, start : start + chunk_size]
        logits = model(input_ids=piece, **cache_kwargs(cache), use_cache=True).logits[0].float()
        scored = min(piece.shape[1], total - 1 - start)  # positions whose next token is in the text
        log_p = F.log_softmax(logits[:scored], dim=-1)
        nll -= log_p.gather(1, ids[0, start + 1 : start + 1 + scored, None]).sum().item()
        if filling:
            reference.append(log_p.to(torch.float16).cpu())
        else:
            ref = reference[index].to(log_p.device).float()
            kl += (ref.exp() * (ref - log_p)).sum().item()
    return nll / (total - 1), kl / (total - 1)
