"""Per-layer bit allocation: how much each layer's format costs a model, measured, and the upgrades that fit a budget of
bits per coordinate (`kvplus calibrate`, `Calibration`).

Every layer at the cache's `bits`, then one layer at a time at each candidate format: the perplexity that layer's
upgrade removes, over the bits it adds (both read off the caches). The upgrades with the most gain per bit are taken
greedily, at most one per layer, while the bits fit `max_bits`; the chosen set is then measured as a whole (gains add
up only roughly). Measure on a text other than the one you report on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..calibration import Calibration
from ..errors import ConfigError
from ..formats import parse_bits
from ..model_spec import ModelSpec
from ..quantized_cache import QuantizedCache
from ..storage.quantized import DEFAULT_WINDOW
from .perplexity import perplexity


@dataclass(frozen=True)
class LayerOption:
    """One layer at a candidate format: the perplexity change it measured (all other layers at the base bits), its
    gain over the base (percentage points removed) and the bits per coordinate it adds."""

    layer: int
    bits: str
    delta_pct: float
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

    def measure(built, label: str) -> tuple[float, float]:
        result = perplexity(model, input_ids, built, mode="chunked", chunk_size=chunk_size, label=label, progress=False)
        report = getattr(built, "quantized_report", None)  # (none for the DynamicCache reference)
        return result.perplexity, report()["bits_per_coordinate"] if report else 16.0

    reference, _ = measure(DynamicCache(config=model.config), "dynamic")
    base_ppl, base_bits = measure(cache(), bits)
    if base_bits > max_bits:
        raise ConfigError(f"bits={bits!r} alone holds {base_bits:.3f} bits per coordinate, over max_bits={max_bits}")
    change = lambda ppl: 100 * (ppl / reference - 1)  # noqa: E731
    layers = [layer.index for layer in spec.layers if layer.holds_kv]
    options = []
    grid = [(layer, candidate) for layer in layers for candidate in candidates]
    for layer, candidate in tqdm(grid, desc="layers", unit="run", disable=not progress):
        ppl, measured_bits = measure(cache({layer: candidate}), f"layer {layer} at {candidate}")
        options.append(LayerOption(layer, candidate, change(ppl), change(base_ppl) - change(ppl), measured_bits - base_bits))
    chosen = choose(options, base_bits, max_bits)
    final_ppl, final_bits = measure(cache(chosen), "calibrated")
    calibration = Calibration(
        model=model_name, model_type=getattr(model.config, "model_type", ""), num_layers=spec.num_layers, bits=bits,
        layer_bits=chosen, max_bits=max_bits, bits_per_coordinate=final_bits,
        measured={
            "text": text, "tokens": int(input_ids.numel()), "chunk_size": chunk_size, "window": window,
            "first_tokens": first_tokens, "rotation_seed": rotation_seed, "candidates": list(candidates),
            "dynamic_perplexity": reference, "base_delta_pct": change(base_ppl), "base_bits": base_bits,
            "calibrated_delta_pct": change(final_ppl),
            "options": [{"layer": o.layer, "bits": o.bits, "delta_pct": o.delta_pct, "gain": o.gain,
                         "added_bits": o.added_bits} for o in options],
        },
    )  # fmt: skip
    return calibration, options
