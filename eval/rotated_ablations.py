"""Ablations of the rotated formats that were measured and not kept, on compare_turboquant.py's protocol.

    python eval/rotated_ablations.py codebooks --out eval/results/rotated_ablations
    python eval/rotated_ablations.py layer-bits --out eval/results/rotated_ablations
    python eval/rotated_ablations.py centering --out eval/results/rotated_ablations

- `codebooks`: uniform codes after the rotation against the Lloyd-Max codebooks, same bytes. The uniform codebook
  has 2**bits evenly spaced levels, centred, with the step that minimises the mean squared error for the rotated
  coordinate's distribution (searched on compare's float64 grid); each `--configs` row over `--seeds`, both
  codebooks in the same run. Also prints each codebook's distortion (MSE x head dim).
- `layer-bits`: `--base` (k4v2) everywhere and one layer at `--up` (k8v8), for every layer in turn and none, one
  seed: how much of the loss each layer holds (the issue's "give the first and last layers more bits").
- `centering`: where the loss is, and what a coder that subtracts a centre first would gain, simulated: a
  DynamicLayer whose tokens are replaced, as they leave the window, by the rotated format's quantize-then-dequantize
  (the same codes as `QuantizedCache`: `base` reproduces its perplexity exactly), with `--variants`:
  `base`; `sinks` (the first 4 tokens never quantized, keys and values); `center+sinks` (keys coded as
  mu + code(k - mu), mu the per-head mean key of the first quantized tokens but those 4, which stay exact: a shift
  shared by every key of a head leaves the softmax unchanged when the window's keys are shifted alike); `choice`
  (no exact tokens: each key coded as mu + code(k - mu) or code(k), whichever of k - mu and k is shorter, one bit
  a token); `values-centered+sinks` (`center+sinks` on the values as well); `scaled-keys+center+sinks`
  (`center+sinks` with each key channel divided by its spread over those first coded tokens before the rotation,
  and multiplied back after: KVQuant's per-channel scaling); `pre-rope-keys+center+sinks` (`center+sinks`
  on the keys rotated back to position 0, rotated to their positions again after decoding: KVQuant's pre-RoPE keys,
  whose per-channel mean does not turn with the position); `rope-center+sinks` (the same centre, the mean
  of the keys rotated back to position 0, rotated to each key's position and subtracted there: the keys are coded
  after RoPE, as a cache holds them, relative to a centre that turns with the position); `center+choice+sinks`
  (`center+sinks` with `choice`'s plain codes: what `QuantizedCache` does, first 4 tokens exact); and
  `rope-center+choice+sinks` (that, with the format's turning centre, `KeyCenter(RotaryBasis)`: the keys coded and
  decoded by `quantize_rotated`/`dequantize_rotated` at their positions). Each run also records its KL from
  DynamicCache's next-token distributions (millinats per token, far less noisy than the perplexity). `k16vY` rows
  keep keys exact: the values' own share. With `--calibration`, each layer takes its `layer_bits` format.
- `value-codes`: what other codes at the same bits could gain. First, on `--stats-text` (not the
  evaluation's text), each layer's keys and values of a DynamicCache prefill, rotated as `QuantizedCache` rotates
  them (keys less their centre): the mean squared error of the shipped (Beta-model) codebook, of a codebook fitted
  by Lloyd's algorithm to those very coordinates (in-sample: an upper bound of what a fitted codebook gains), and of
  the shipped one scaled per head and rotated coordinate by its spread; and the share of the energy a per-head mean
  leaves (what a centre removes). Then perplexity with `--calibration`'s `layer_bits` on `--configs`' first format,
  the first 4 tokens exact, over `--seeds`, for each of `--code-variants`: `shipped`; `haar` (a Haar-random rotation
  for power-of-two head dims too, instead of the randomized Hadamard transform). (`values-centred`, the values given
  a centre as the keys have one, was measured while a format carried its centres; a layer's centre is now its
  storage's state, given with the keys only, and that variant is retired: its recorded results stay in
  `eval/results/rotated_ablations`.)

SmolLM2-135M, the first 4096 tokens of Pride and Prejudice in chunks of 256, a 128-token window, perplexity change
against DynamicCache on the same ids; writes `<ablation>.json` and `<ablation>.md` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path

import torch
from compare_turboquant import parse_config
from tqdm.auto import tqdm
from transformers import AutoTokenizer, Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

from hf_kvplus import QuantizedCache
from hf_kvplus.calibration import Calibration
from hf_kvplus.cli.common import tokenize
from hf_kvplus.evaluation.calibrate import chunked_pass
from hf_kvplus.evaluation.perplexity import perplexity
from hf_kvplus.evaluation.report import format_table, stamp
from hf_kvplus.eviction.rope import RotaryShift
from hf_kvplus.kernels import rotated_format
from hf_kvplus.kernels.rotated_format import (
    KeyCenter,
    RotatedFormat,
    codebook,
    dequantize_rotated,
    haar_rotation,
    quantize_rotated,
    rotation,
)
from hf_kvplus.kernels.turning_center import RotaryBasis
from hf_kvplus.resolve import load_model, load_text


def density(head_dim: int, grid: int = 200_001) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, weights) of a rotated unit vector's coordinate on a float64 grid, as `rotated_format.lloyd_max` uses."""
    x = torch.linspace(-1, 1, grid, dtype=torch.float64)
    w = (1 - x * x).clamp_min(0) ** ((head_dim - 3) / 2)
    return x, w / w.sum()


def distortion(levels: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """Mean squared error of coding x to its nearest level."""
    return float((w * (x - levels[torch.bucketize(x, (levels[1:] + levels[:-1]) / 2)]) ** 2).sum())


def uniform_levels(head_dim: int, bits: int) -> list[float]:
    """The least-MSE centred uniform codebook of `bits` bits (step searched over 0.05 .. 4 standard deviations)."""
    x, w = density(head_dim)
    steps = torch.linspace(0.05, 4.0, 4000, dtype=torch.float64) / head_dim**0.5
    index = torch.arange(2**bits, dtype=torch.float64) - (2**bits - 1) / 2
    best = min(steps.tolist(), key=lambda step: distortion(index * step, x, w))
    return (index * best).tolist()


def use_codebooks(kind: str) -> None:
    """Lloyd-Max (the shipped tables) or uniform codebooks for bits 1-4, from now on in this process."""
    rotated_format._CODEBOOKS.clear()
    rotated_format._BYTE_TABLES.clear()
    rotated_format._centroids = (
        _lloyd_max_centroids if kind == "lloyd-max" else lambda d, b: _lloyd_max_centroids(d, b) if b == 8 else uniform_levels(d, b)
    )  # fmt: skip


_lloyd_max_centroids = rotated_format._centroids


def codebooks(args, model, ids, base) -> tuple[list[dict], str]:
    head_dim = model.config.head_dim
    x, w = density(head_dim)
    for bits in (2, 3, 4):
        lm = distortion(torch.tensor(_lloyd_max_centroids(head_dim, bits), dtype=torch.float64), x, w)
        un = distortion(torch.tensor(uniform_levels(head_dim, bits), dtype=torch.float64), x, w)
        tqdm.write(f"head dim {head_dim}, {bits} bits: MSE x D Lloyd-Max {lm * head_dim:.5f}, uniform {un * head_dim:.5f}")
    rows = []
    plan = [(kind, name, s) for name in args.configs for kind in ("lloyd-max", "uniform") for s in args.seeds]
    for kind, name, seed in tqdm(plan, desc="runs"):
        use_codebooks(kind)
        kb, vb, _ = parse_config(name)
        cache = QuantizedCache(model.config, key_bits=kb, value_bits=vb, window=args.window, rotation_seed=seed)
        rows.append(measure(args, model, ids, base, cache, {"codebook": kind, "config": name, "seed": seed}))
    use_codebooks("lloyd-max")
    return rows, over_seeds(rows, args.configs, "codebook", ("lloyd-max", "uniform"))


def over_seeds(rows: list[dict], configs, column: str, kinds, *, kl: bool = False) -> str:
    """The table of each (config, kind in `column`): its delta's mean, min and max over the seeds (and with `kl`, the
    mean KL from DynamicCache's next-token distributions, millinats per token)."""
    table = []
    for name in configs:
        for kind in kinds:
            runs = [r for r in rows if r["config"] == name and r[column] == kind]
            deltas = [r["delta_pct"] for r in runs]
            table.append({"config": name, column: kind, "mean": statistics.fmean(deltas),
                          "range": f"{min(deltas):+.3f} .. {max(deltas):+.3f}", "runs": len(deltas),
                          "kl": statistics.fmean(r.get("kl_mnat", math.nan) for r in runs)})  # fmt: skip
    columns = [("config", "config", ""), (column, column, ""), ("mean", "delta % mean", "+.3f"),
               ("range", "min .. max", ""), ("runs", "seeds", "d"), *([("kl", "KL mnat/token", ".3f")] if kl else [])]  # fmt: skip
    return format_table(table, columns)


def layer_bits(args, model, ids, base) -> tuple[list[dict], str]:
    up = parse_config(args.up)
    kb, vb, _ = parse_config(args.base)
    rows = []
    for layer in tqdm([None, *range(model.config.num_hidden_layers)], desc="layers"):
        cache = QuantizedCache(model.config, key_bits=kb, value_bits=vb, window=args.window, rotation_seed=args.seed)
        if layer is not None:  # the one layer's storage recoded at the higher bits (same seed as it had)
            storage = cache.layers[layer].storage
            storage.segment.fmt = RotatedFormat(up[0], up[1], storage.segment.fmt.seed)
        rows.append(measure(args, model, ids, base, cache, {"layer": "none" if layer is None else layer}))
    none = rows[0]["delta_pct"]
    for row in rows:
        row["gain_points"] = row["delta_pct"] - none
    columns = [("layer", "layer up", ""), ("bits", "bits", ".3f"), ("delta_pct", "delta %", "+.3f"),
               ("gain_points", "vs none, points", "+.3f")]  # fmt: skip
    return rows, format_table(rows, columns)


#: The `centering` variants, and the first tokens each keeps exact.
VARIANTS = {"base": 0, "sinks": 4, "center+sinks": 4, "choice": 0, "values-centered+sinks": 4,
            "scaled-keys+center+sinks": 4, "pre-rope-keys+center+sinks": 4, "rope-center+sinks": 4,
            "center+choice+sinks": 4, "rope-center+choice+sinks": 4}


def roundtrip(x: torch.Tensor, bits: int, seed: int) -> torch.Tensor:
    """``x`` through the rotated format's quantize then dequantize (float32); 16 bits: unchanged."""
    if bits == 16:
        return x.float()
    fmt = RotatedFormat(bits, bits, seed)
    codes, norms = quantize_rotated(x.float().contiguous(), fmt, "keys")
    return dequantize_rotated(codes, norms, fmt, "keys")


class CenteringLayer(DynamicLayer):
    """Tokens older than the newest `window` replaced once by their coding under `variant` (see the module doc);
    layer `index` rotates with `seed + index`, as `QuantizedCache`'s layers do."""

    def __init__(self, index: int, key_bits: int, value_bits: int, seed: int, window: int, variant: str,
                 rope: RotaryShift | None = None):  # fmt: skip
        super().__init__()
        self.rope = rope  # the model's rotary embedding (`pre-rope-keys+center+sinks`)
        self.bits, self.seed, self.window, self.variant = (key_bits, value_bits), seed + index, window, variant
        self.coded = VARIANTS[variant]  # tokens before `coded` are done (the first ones kept exact)
        self.centers: list[torch.Tensor | None] = [None, None]
        self.scales: torch.Tensor | None = None  # the keys' per-channel spread (`scaled-keys+center+sinks`)
        #: the keys' format and turning centre (`rope-center+choice+sinks`)
        self.turning: tuple[RotatedFormat, KeyCenter] | None = None

    def code(self, x: torch.Tensor, side: int) -> torch.Tensor:
        keys_centered = self.variant in ("center+sinks", "choice", "values-centered+sinks", "scaled-keys+center+sinks",
                                         "pre-rope-keys+center+sinks", "rope-center+sinks", "center+choice+sinks",
                                         "rope-center+choice+sinks")  # fmt: skip
        centered = keys_centered if side == 0 else self.variant == "values-centered+sinks"
        if not centered or self.bits[side] == 16:
            return roundtrip(x, self.bits[side], self.seed)
        if self.centers[side] is None:  # the mean of the first tokens coded (those after the exact ones)
            self.centers[side] = x.float().mean(dim=2, keepdim=True)
        mu = self.centers[side]
        if self.variant == "scaled-keys+center+sinks" and side == 0:  # each channel coded at unit spread
            if self.scales is None:
                self.scales = (x.float() - mu).std(dim=2, keepdim=True).clamp_min(1e-6)
            return mu + self.scales * roundtrip((x - mu) / self.scales, self.bits[side], self.seed)
        return self.shifted(x, mu, side)

    def shifted(self, x: torch.Tensor, mu: torch.Tensor, side: int) -> torch.Tensor:
        """x coded relative to mu; with a `choice` variant, plainly where x is shorter than x - mu."""
        shifted = mu + roundtrip(x - mu, self.bits[side], self.seed)
        if "choice" not in self.variant or side == 1:
            return shifted
        shorter = (x - mu).norm(dim=-1, keepdim=True) <= x.norm(dim=-1, keepdim=True)
        return torch.where(shorter, shifted, roundtrip(x, self.bits[side], self.seed))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start = self.get_seq_length()
        keys, values = super().update(key_states, value_states)
        end = keys.shape[-2] - self.window
        if end > self.coded:
            part = slice(self.coded, end)
            positions = torch.arange(self.coded, end).expand(*keys.shape[:2], -1)
            if self.variant == "pre-rope-keys+center+sinks":  # coded before RoPE, turned back to their positions
                before = self.code(self.rope.unturned(keys[:, :, part], positions), 0)
                keys[:, :, part] = self.rope.unturned(before, -positions).to(keys.dtype)
            elif self.variant == "rope-center+sinks" and self.bits[0] != 16:  # the pre-RoPE centre, turned
                if self.centers[0] is None:
                    self.centers[0] = self.rope.unturned(keys[:, :, part], positions).mean(dim=2, keepdim=True)
                mu = self.rope.unturned(self.centers[0].expand_as(keys[:, :, part]), -positions)
                keys[:, :, part] = self.shifted(keys[:, :, part].float(), mu, 0).to(keys.dtype)
            elif self.variant == "rope-center+choice+sinks" and self.bits[0] != 16:  # the format's turning centre
                if self.turning is None:
                    basis = RotaryBasis(self.rope.inv_freq, keys.shape[-1])
                    self.turning = RotatedFormat(self.bits[0], self.bits[0], self.seed), KeyCenter(basis)
                tokens = torch.arange(self.coded, end)
                fmt, center = self.turning
                codes, norms = quantize_rotated(keys[:, :, part], fmt, "keys", tokens, center)
                decoded = dequantize_rotated(codes, norms, fmt, "keys", positions=tokens, center=center)
                keys[:, :, part] = decoded.to(keys.dtype)
            else:
                keys[:, :, part] = self.code(keys[:, :, part], 0).to(keys.dtype)
            values[:, :, part] = self.code(values[:, :, part], 1).to(values.dtype)
            self.coded = end
        return torch.cat([keys[:, :, :start], key_states], -2), torch.cat([values[:, :, :start], value_states], -2)


def centering(args, model, ids, base) -> tuple[list[dict], str]:
    rows = []
    plan = [(name, v, s) for name in args.configs for v in args.variants for s in args.seeds]
    rope = RotaryShift.from_config(model.config)
    reference: list[torch.Tensor] = []  # DynamicCache's log-probabilities, for each run's KL from them
    chunked_pass(model, ids, DynamicCache(config=model.config), args.chunk, reference)
    layer_bits = Calibration.load(args.calibration).layer_bits if args.calibration else {}
    for name, variant, seed in tqdm(plan, desc="runs"):
        bits = [re.fullmatch(r"k(\d+)v(\d+)", str(layer_bits.get(i, name))).groups()
                for i in range(model.config.num_hidden_layers)]  # fmt: skip
        layers = [CenteringLayer(i, int(kb), int(vb), seed, args.window, variant, rope) for i, (kb, vb) in enumerate(bits)]
        nll, kl = chunked_pass(model, ids, Cache(layers=layers), args.chunk, reference)
        ppl = math.exp(nll)
        rows.append({"config": name, "variant": variant, "seed": seed, "perplexity": ppl,
                     "delta_pct": 100 * (ppl / base - 1), "kl_mnat": 1000 * kl})  # fmt: skip
        tqdm.write(json.dumps(rows[-1]))
    return rows, over_seeds(rows, args.configs, "variant", args.variants, kl=True)


def code_statistics(model, ids, seed: int, bits_list=(2, 3)) -> list[dict]:
    """Per side and bits, the mean over layers of the coordinate MSE (unit vectors, rotated) of the shipped codebook,
    of one fitted to the coordinates, and of the shipped one scaled per (head, coordinate); and the energy share a
    per-head centre leaves."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[None], past_key_values=cache, use_cache=True)
    rows = []
    for side in ("keys", "values"):
        per_layer = []
        for index, layer in enumerate(cache.layers):
            x = (layer.keys if side == "keys" else layer.values)[0, :, 4:].float()  # [H, T, D], sinks left out
            mu = x.mean(1, keepdim=True)
            left = float((x - mu).square().sum() / x.square().sum())
            if side == "keys":  # keys are coded relative to their centre
                x = x - mu
            unit = x @ rotation(x.shape[-1], seed + index)
            unit = unit / unit.norm(dim=-1, keepdim=True)
            spread = unit.std(1, keepdim=True) * unit.shape[-1] ** 0.5
            errors = {}
            for bits in bits_list:
                book = codebook(unit.shape[-1], bits)[0]
                scaled = coding_error(unit / spread, book, mean=False) * spread.square()
                errors[bits] = (coding_error(unit, book), coding_error(unit, fitted_levels(unit.flatten(), 2**bits)),
                                float(scaled.mean()))  # fmt: skip
            per_layer.append((left, errors))
        for bits in bits_list:
            shipped, fitted, scaled = (statistics.fmean(e[bits][i] for _, e in per_layer) for i in range(3))
            rows.append({"side": side, "bits": bits, "shipped": shipped, "fitted_pct": 100 * (fitted / shipped - 1),
                         "scaled_pct": 100 * (scaled / shipped - 1),
                         "centred_energy": statistics.fmean(left for left, _ in per_layer)})  # fmt: skip
    return rows


def coding_error(x: torch.Tensor, levels: torch.Tensor, *, mean: bool = True):
    """Squared error of coding each entry of x to its nearest level: the mean, or per entry."""
    error = (x - levels[torch.bucketize(x, (levels[1:] + levels[:-1]) / 2)]).square()
    return float(error.mean()) if mean else error


def fitted_levels(x: torch.Tensor, count: int, iterations: int = 60) -> torch.Tensor:
    """Lloyd's algorithm on the samples x (made symmetric, as the shipped codebooks are), from their quantiles."""
    x = torch.cat([x, -x])
    sample = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))[:200_000]]
    levels = torch.quantile(sample, (torch.arange(count) + 0.5) / count)
    for _ in range(iterations):
        cell = torch.bucketize(x, (levels[1:] + levels[:-1]) / 2)
        total = torch.zeros(count).index_add_(0, cell, x)
        seen = torch.zeros(count).index_add_(0, cell, torch.ones_like(x))
        levels = torch.where(seen > 0, total / seen.clamp_min(1), levels)
    return levels


#: The `value-codes` perplexity variants.
CODE_VARIANTS = ("shipped", "haar")


def code_variant(variant: str) -> None:
    """Makes this process's rotated formats those of `variant` (see the module doc), from now on."""
    rotated_format._ROTATIONS.clear()
    rotated_format._make_rotation = haar_rotation if variant == "haar" else _shipped_rotation


_shipped_rotation = rotated_format._make_rotation


def value_codes(args, model, ids, base) -> tuple[list[dict], str]:
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    stats = code_statistics(model, tokenize(tokenizer, load_text(args.stats_text), 2048), args.seeds[0])
    columns = [("side", "side", ""), ("bits", "bits", "d"), ("shipped", "MSE shipped", ".5f"),
               ("fitted_pct", "fitted codebook %", "+.1f"), ("scaled_pct", "scaled per coordinate %", "+.1f"),
               ("centred_energy", "energy a centre leaves", ".2f")]  # fmt: skip
    stats_table = format_table(stats, columns)
    tqdm.write(stats_table)
    name = args.configs[0]
    kb, vb, _ = parse_config(name)
    layer_bits = Calibration.load(args.calibration).layer_bits if args.calibration else None
    rows = []
    for variant, seed in tqdm([(v, s) for v in args.code_variants for s in args.seeds], desc="runs"):
        code_variant(variant)
        cache = QuantizedCache(model.config, key_bits=kb, value_bits=vb, window=args.window, first_tokens=4,
                               layer_bits=layer_bits, rotation_seed=seed)  # fmt: skip
        rows.append(measure(args, model, ids, base, cache, {"variant": variant, "config": name, "seed": seed}))
    code_variant("shipped")
    return [*stats, *rows], f"{stats_table}\n\n{over_seeds(rows, [name], 'variant', args.code_variants)}"


def measure(args, model, ids, base: float, cache, row: dict) -> dict:
    ppl = perplexity(model, ids, cache, mode="chunked", chunk_size=args.chunk, label=str(row)).perplexity
    row.update(perplexity=ppl, delta_pct=100 * (ppl / base - 1), bits=16 * cache.quantized_report()["ratio_to_fp16"])
    tqdm.write(json.dumps(row))
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ablation", choices=["codebooks", "layer-bits", "centering", "value-codes"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--text", default="austen:prideprejudice", help="the evaluation's text")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["k4v2", "k3v2", "k2v2"],
                        help="codebooks, centering: rotated configs (centering: k16vY keeps keys exact)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="codebooks, centering: rotation seeds")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="centering: coder variants")
    parser.add_argument("--base", default="k4v2", help="layer-bits: every layer's format")
    parser.add_argument("--up", default="k8v8", help="layer-bits: the one layer's format")
    parser.add_argument("--seed", type=int, default=0, help="layer-bits: rotation seed")
    parser.add_argument("--code-variants", nargs="+", default=list(CODE_VARIANTS), choices=CODE_VARIANTS,
                        help="value-codes: perplexity variants")
    parser.add_argument("--calibration", type=Path, help="value-codes, centering: a calibration.json, whose layer_bits to use")
    parser.add_argument("--stats-text", default="austen:persuasion", help="value-codes: the statistics' text")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m")
    ids = tokenize(tokenizer, load_text(args.text), args.tokens)
    base = perplexity(model, ids, DynamicCache(config=model.config), mode="chunked", chunk_size=args.chunk).perplexity
    ablations = {"codebooks": codebooks, "layer-bits": layer_bits, "centering": centering, "value-codes": value_codes}
    run = ablations[args.ablation]
    rows, table = run(args, model, ids, base)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**stamp(), "ablation": args.ablation, "args": {k: str(v) for k, v in vars(args).items()}, "dynamic": base}
    (args.out / f"{args.ablation}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    md = (f"{args.ablation}: smollm2-135m on {args.text}, first {ids.numel()} tokens, chunks of {args.chunk}, "
          f"window {args.window}; DynamicCache perplexity {base:.4f}; {meta['machine']}, {meta['date']}\n\n```\n{table}\n```\n")  # fmt: skip
    (args.out / f"{args.ablation}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
