"""Per-layer bit allocation: how much each layer's format costs a model, measured, and the formats that fit a budget of
bits per coordinate (`kvplus calibrate`, `Calibration`).

Every layer at the cache's `bits`, then one layer at a time at each candidate format (more bits, or fewer: a layer
that loses little at fewer bits funds one that gains much at more): how much of the divergence from the
full-precision model that layer's format removes (KL(full || quantized) of the next-token distributions, mean over
the tokens), and the bits per coordinate it adds. The divergence, not the perplexity: a perplexity change mixes
tokens made likelier and less likely, and on a text the format costs little it is mostly rounding noise, of either
sign. The bits are those the cache holds at `budget_tokens` (by default the calibration's length): the exact first
tokens weigh less per coordinate in a longer cache, so a budget met at 2048 tokens is not spent at 4096. One format
per layer is then chosen to remove the most divergence within `max_bits` (`choose`: an exact multiple-choice
knapsack); the chosen set is measured as a whole (gains add up only roughly). With `rotations` above 1, each
full-attention layer in a rotated format is then measured at `rotations - 1` other rotation seeds (the others at
theirs) and keeps the one of least divergence (`layer_rotations`): the bits do not change, and on Gemma 3 one full
layer's rotation moved the perplexity change the same way on three texts (its frequent tokens get the same error at
every occurrence, which attention adds up). Measure on a text other than the one you report on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..calibration import Calibration
from ..errors import ConfigError
from ..formats import is_rotated, parse_bits
from ..kernels.rotated_format import turning_key_center
from ..model_spec import ModelSpec
from ..precision import PrecisionRegions, family_regions, layer_region_bits
from ..quantized_cache import QuantizedCache, asked_full_sinks
from ..storage.quantized import DEFAULT_WINDOW
from ..transformers_compat import cache_kwargs

#: A rotation candidate's seed: layer index + ROTATION_STRIDE * j (j = 1, 2, ...), apart from every layer's own seed
#: (`rotation_seed + index`) for seeds below it.
ROTATION_STRIDE = 1000


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
    """At most one option per layer (a layer without one stays at the base), removing the most divergence (summed
    `gain`) with the base's bits plus the summed `added_bits` within `max_bits`: the exact multiple-choice knapsack, a
    dynamic programme over the layers keeping every (bits, gain) pair no other beats. Options may add negative bits
    (fewer bits than the base: they fund others). Of equal gains, the fewest bits."""
    budget = max_bits - base_bits + 1e-9
    by_layer: dict[int, list[LayerOption]] = {}
    for option in options:
        by_layer.setdefault(option.layer, []).append(option)
    layers = sorted(by_layer)
    # the most bits the layers after each one can still give back (to drop what cannot come within the budget)
    savings = [0.0] * (len(layers) + 1)
    for index in range(len(layers) - 1, -1, -1):
        savings[index] = savings[index + 1] + max(0.0, -min(o.added_bits for o in by_layer[layers[index]]))
    frontier: list[tuple[float, float, tuple[tuple[int, str], ...]]] = [(0.0, 0.0, ())]  # (bits, gain, picks)
    for index, layer in enumerate(layers):
        states = list(frontier)
        for bits, gain, picks in frontier:
            for option in by_layer[layer]:
                if bits + option.added_bits - savings[index + 1] <= budget:
                    states.append((bits + option.added_bits, gain + option.gain, (*picks, (layer, option.bits))))
        states.sort(key=lambda state: (state[0], -state[1]))
        frontier, best = [], -math.inf
        for state in states:  # keep a state only if it gains more than every state with fewer bits
            if state[1] > best:
                frontier.append(state)
                best = state[1]
    feasible = [state for state in frontier if state[0] <= budget]
    return dict(max(feasible, key=lambda state: (state[1], -state[0]))[2]) if feasible else {}


def bits_per_coordinate(table: dict[str, list[tuple[int, int]]], bits: str, layer_bits: dict[int, str]) -> float:
    """The cache's bits per coordinate with `layer_bits` on top of `bits`, from `layer_bits_table`'s per-layer
    counts."""
    held = [table[layer_bits.get(index, bits)][index] for index in range(len(table[bits]))]
    coordinates = sum(c for _, c in held)
    return sum(b for b, _ in held) / coordinates if coordinates else 0.0


def layer_bits_table(make_cache, formats: Sequence[str], num_layers: int, tokens: int, chunk_size: int, specs,
                     dtype: torch.dtype) -> dict[str, list[tuple[int, int]]]:
    """Per format, per layer, the bits held outside the window and their coordinates (`layer_region_bits`) once the
    cache `make_cache(layer_bits)` holds `tokens` tokens, fed in chunks of `chunk_size`: what the cache holds, counted
    on random keys and values (the bits do not depend on them), every layer at that format, each keeping what its
    retention keeps (a sliding layer its window)."""
    table = {}
    generator = torch.Generator().manual_seed(0)
    for fmt in dict.fromkeys(formats):
        cache = make_cache({spec.index: fmt for spec in specs})
        for start in range(0, tokens, chunk_size):
            count = min(chunk_size, tokens - start)
            for spec in specs:
                keys = torch.randn(1, spec.num_kv_heads, count, spec.head_dim, generator=generator, dtype=dtype)
                values = torch.randn(keys.shape, generator=generator, dtype=dtype)
                layer = cache.layers[spec.index]
                if not layer.is_initialized:
                    layer.lazy_initialization(keys, values)
                layer.storage.append(keys, values)  # (the storage alone: no attention follows)
                layer.retention.evict(layer.storage, count, refill=True)  # a sliding layer keeps its window
        counts = [(0, 0)] * num_layers
        for spec in specs:
            counts[spec.index] = layer_region_bits(cache.layers[spec.index], cache.window)
        table[fmt] = counts
    return table


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
    rotation_seed: int | Sequence[int] = 0,
    budget_tokens: int | None = None,
    reuse: Sequence[Calibration] = (),
    text: str = "",
    progress: bool = True,
    family_defaults: bool = True,
    rotations: int = 1,
) -> tuple[Calibration, list[LayerOption]]:
    """Measures every layer at every candidate on `input_ids` and returns the calibration within `max_bits` at
    `budget_tokens` (default: the length of `input_ids`), and every option measured. Several `rotation_seed`s: each
    option is measured at each and their divergences averaged (a gain of one seed's rounding is not one of the
    format's). `reuse`: earlier calibrations measured the same way (model, text length, chunk, window, first tokens,
    bits), whose options at these candidates and seeds are taken rather than measured again. Runs
    `seeds x (1 + layers x candidates + 1) + 1` perplexity passes, fewer the reused ones, and with `rotations`
    `seeds x full layers x (rotations - 1)` more (and `seeds` to measure the chosen rotations). The base is the cache as
    `QuantizedCache(bits=bits)` builds it, its model family's layer formats and sinks (sliding and full layers') included
    (`precision.FAMILY_DEFAULTS`, counted in the budget as the caches that take the calibration hold them;
    `family_defaults=False`: every layer at `bits`, no sinks): each option changes one layer from there, and the
    calibration's `layer_bits` hold the family's formats with the chosen ones. `rotations` (1: none): rotation seeds
    tried per full-attention layer in a rotated format, its own included, once the formats are chosen (`rotations - 1`
    more passes per such layer and seed); the chosen ones are the calibration's `layer_rotations`."""
    for candidate in (bits, *candidates):
        parse_bits(candidate)
    if isinstance(rotations, bool) or not isinstance(rotations, int) or rotations < 1:
        raise ConfigError(f"rotations (seeds tried per full-attention layer, its own included) must be an int >= 1, "
                          f"got {rotations!r}")  # fmt: skip
    seeds = (rotation_seed,) if isinstance(rotation_seed, int) else tuple(dict.fromkeys(rotation_seed))
    if not seeds:
        raise ConfigError("rotation_seed: give at least one seed")
    spec = ModelSpec.from_config(model.config)
    tokens = int(input_ids.numel())
    budget_tokens = tokens if budget_tokens is None else budget_tokens
    if budget_tokens < 1:
        raise ConfigError(f"budget_tokens must be >= 1, got {budget_tokens}")

    asked = PrecisionRegions(window, full_sinks=asked_full_sinks(first_tokens, None))
    regions = family_regions(model.config, bits, asked) if family_defaults else PrecisionRegions(window)
    family, sinks, full_sinks = dict(regions.layer_bits), regions.sliding_sinks or 0, regions.full_sinks or 0

    def cache(layer_bits=None, seed: int = seeds[0], layer_rotations=None) -> QuantizedCache:
        return QuantizedCache(model.config, bits=bits, window=window, first_tokens=first_tokens, rotation_seed=seed,
                              layer_bits=family | (layer_bits or {}), sliding_sinks=sinks, full_sinks=full_sinks,
                              family_defaults=False, layer_rotations=layer_rotations)  # fmt: skip

    built = cache()
    protocol = {"model": model_name, "bits": bits, "tokens": tokens, "chunk_size": chunk_size, "window": window,
                "first_tokens": first_tokens, "sliding_sinks": sinks, "full_sinks": full_sinks,
                "key_center": key_center(built),
                "key_scale": None if built.key_scale is None else built.key_scale.model,
                "key_scale_digest": None if built.key_scale is None else built.key_scale.digest()}  # fmt: skip
    known: dict[tuple[int, int, str], tuple[float, float]] = {}  # (seed, layer, bits) -> (KL, perplexity change)
    known_base: dict[int, float] = {}
    for earlier in reuse:
        # what earlier ones did not record
        older = {"key_center": "fixed", "key_scale": None, "key_scale_digest": None, "sliding_sinks": 0,
                 "full_sinks": 0}
        theirs = older | earlier.measured | {"model": earlier.model, "bits": earlier.bits}
        differs = {key: theirs.get(key) for key, value in protocol.items() if theirs.get(key) != value}
        if differs:
            raise ConfigError(f"a reused calibration was measured otherwise ({differs}; this one: {protocol})")
        for seed, base in theirs.get("base_kl_by_seed", {str(theirs["rotation_seed"]): theirs["base_kl"]}).items():
            known_base[int(seed)] = base
        for o in theirs.get("options", ()):
            kls = o.get("kl_by_seed", {str(theirs["rotation_seed"]): o["kl"]})
            deltas = o.get("delta_pct_by_seed", {str(theirs["rotation_seed"]): o["delta_pct"]})
            known |= {(int(seed), o["layer"], o["bits"]): (kl, deltas[seed]) for seed, kl in kls.items()}

    layers = [layer for layer in spec.layers if layer.holds_kv]
    dtype = next(model.parameters()).dtype
    table = layer_bits_table(lambda layer_bits: cache(layer_bits), (bits, *candidates, *family.values()),
                             spec.num_layers, budget_tokens, chunk_size, layers, dtype)  # fmt: skip
    base_bits = bits_per_coordinate(table, bits, family)
    if base_bits > max_bits:
        raise ConfigError(f"bits={bits!r} alone holds {base_bits:.3f} bits per coordinate at {budget_tokens} tokens, "
                          f"over max_bits={max_bits}")  # fmt: skip

    reference: list[torch.Tensor] = []  # the full-precision model's log-probabilities, chunk by chunk

    def measure(built) -> tuple[float, float, float]:
        """Perplexity change (%), mean KL from the reference (nats per token), bits per coordinate as measured."""
        nll, kl = chunked_pass(model, input_ids, built, chunk_size, reference)
        report = getattr(built, "quantized_report", None)  # (none for the reference's DynamicCache)
        return 100 * (math.exp(nll) / reference_ppl - 1), kl, report()["bits_per_coordinate"] if report else 16.0

    reference_ppl = math.exp(chunked_pass(model, input_ids, DynamicCache(config=model.config), chunk_size, reference)[0])
    base = {seed: measure(cache(seed=seed)) for seed in seeds}
    for seed in seeds:
        if seed in known_base and not math.isclose(known_base[seed], base[seed][1], rel_tol=1e-6):
            raise ConfigError(f"a reused calibration measured base KL {known_base[seed]} at seed {seed}, this run "
                              f"{base[seed][1]}")  # fmt: skip
    base_delta, base_kl = (statistics.fmean(b[k] for b in base.values()) for k in (0, 1))
    options, by_seed = [], {}
    grid = [(layer.index, candidate) for layer in layers for candidate in candidates
            if candidate != family.get(layer.index, bits)]  # fmt: skip
    for layer, candidate in tqdm(grid, desc="layers", unit="run", disable=not progress):
        for seed in seeds:
            if (seed, layer, candidate) not in known:
                delta, kl, _ = measure(cache({layer: candidate}, seed))
                known[seed, layer, candidate] = (kl, delta)
        by_seed[layer, candidate] = {str(seed): known[seed, layer, candidate] for seed in seeds}
        kl, delta = (statistics.fmean(m[k] for m in by_seed[layer, candidate].values()) for k in (0, 1))
        added = bits_per_coordinate(table, bits, family | {layer: candidate}) - base_bits
        options.append(LayerOption(layer, candidate, delta, kl, base_kl - kl, added))
    chosen = family | choose(options, base_bits, max_bits)
    final_bits = bits_per_coordinate(table, bits, chosen)
    final = [measure(cache(chosen, seed)) for seed in seeds]
    rotated_layers = [layer.index for layer in layers if layer.kind == "full"
                      and (held := chosen.get(layer.index, bits)) is not None and is_rotated(held)]  # fmt: skip
    layer_rotations, rotation_kl = {}, {}
    if rotations > 1 and rotated_layers:
        own_kl = statistics.fmean(f[1] for f in final)
        grid = [(index, index + ROTATION_STRIDE * j) for index in rotated_layers for j in range(1, rotations)]
        for index, rotation in tqdm(grid, desc="rotations", unit="run", disable=not progress):
            kl = statistics.fmean(measure(cache(chosen, seed, {index: rotation}))[1] for seed in seeds)
            rotation_kl.setdefault(index, {"own": own_kl})[str(rotation)] = kl
        for index, kls in rotation_kl.items():
            best = min(kls, key=kls.get)
            if best != "own":
                layer_rotations[index] = int(best)
        if layer_rotations:
            final = [measure(cache(chosen, seed, layer_rotations)) for seed in seeds]
    final_delta, final_kl = (statistics.fmean(f[k] for f in final) for k in (0, 1))
    calibration = Calibration(
        model=model_name, model_type=getattr(model.config, "model_type", ""), num_layers=spec.num_layers, bits=bits,
        layer_bits=chosen, max_bits=max_bits, bits_per_coordinate=final_bits, layer_rotations=layer_rotations,
        measured={
            "text": text, "tokens": tokens, "chunk_size": chunk_size, "window": window,
            "first_tokens": first_tokens, "sliding_sinks": sinks, "full_sinks": full_sinks,
            "key_center": protocol["key_center"],
            "key_scale": protocol["key_scale"],
            "key_scale_digest": protocol["key_scale_digest"], "family_layer_bits": family,
            "rotation_seed": seeds[0] if len(seeds) == 1 else list(seeds),
            "candidates": list(candidates), "budget_tokens": budget_tokens,
            "allocation": "exact multiple-choice knapsack over the layers",
            "objective": "mean KL(full || quantized) of the next-token distributions, nats per token"
                         + (", mean over the rotation seeds" if len(seeds) > 1 else ""),
            "dynamic_perplexity": reference_ppl, "base_delta_pct": base_delta, "base_kl": base_kl,
            "base_kl_by_seed": {str(seed): b[1] for seed, b in base.items()},
            "base_bits": base_bits, "calibrated_delta_pct": final_delta, "calibrated_kl": final_kl,
            "bits_at_calibration_length": {"base": base[seeds[0]][2], "calibrated": final[0][2]},
            "options": [{"layer": o.layer, "bits": o.bits, "delta_pct": o.delta_pct, "kl": o.kl, "gain": o.gain,
                         "added_bits": o.added_bits,
                         "kl_by_seed": {seed: m[0] for seed, m in by_seed[o.layer, o.bits].items()},
                         "delta_pct_by_seed": {seed: m[1] for seed, m in by_seed[o.layer, o.bits].items()}}
                        for o in options],
            "rotations": rotations,
            "rotation_kl": {str(index): kls for index, kls in rotation_kl.items()},
        },
    )  # fmt: skip
    return calibration, options


def key_center(cache: QuantizedCache) -> str:
    """`turning` where a layer's keys are coded relative to a centre turning with RoPE, else `fixed` (calibrations
    measured before the turning centre say nothing: fixed)."""
    turning = any(turning_key_center(state) is not None for layer in cache.layers
                  for state in (layer.storage.states() if hasattr(layer, "storage") else ()))  # fmt: skip
    return "turning" if turning else "fixed"


@torch.inference_mode()
def chunked_pass(model, input_ids, cache, chunk_size: int, reference: list[torch.Tensor],
                 token_nll: list[torch.Tensor] | None = None) -> tuple[float, float]:
    """Feeds `input_ids` in chunks through `cache`: the mean NLL of tokens 1.. and the mean KL(reference || this) of the
    next-token distributions over positions 0..N-2. With `reference` empty, fills it with this pass's log-probabilities
    (float16, on the CPU) and returns a KL of 0. `token_nll` collects each chunk's per-token NLL (on the CPU)."""
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    total, filling = ids.shape[1], not reference
    nll = kl = 0.0
    for index, start in enumerate(range(0, total, chunk_size)):
        piece = ids[:, start : start + chunk_size]
        logits = model(input_ids=piece, **cache_kwargs(cache), use_cache=True).logits[0].float()
        scored = min(piece.shape[1], total - 1 - start)  # positions whose next token is in the text
        log_p = F.log_softmax(logits[:scored], dim=-1)
        token = -log_p.gather(1, ids[0, start + 1 : start + 1 + scored, None])[:, 0]
        nll += token.sum().item()
        if token_nll is not None:
            token_nll.append(token.cpu())
        if filling:
            reference.append(log_p.to(torch.float16).cpu())
        else:
            ref = reference[index].to(log_p.device).float()
            kl += (ref.exp() * (ref - log_p)).sum().item()
    return nll / (total - 1), kl / (total - 1)
