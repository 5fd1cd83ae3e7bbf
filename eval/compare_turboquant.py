"""hf_kvplus's rotated K/V formats (and KIVI) against the TurboQuant reference, turboquant-torch 0.4.0, on one protocol.

    bash scripts/turboquant_venv.sh /tmp/tqvenv   # once: the reference imports scipy, which .venv leaves out
    /tmp/tqvenv/bin/python eval/compare_turboquant.py --out eval/results/turboquant_smollm2
    python eval/compare_turboquant.py --ours-only --no-renorm --configs k4v2 k3v2 k2v2 --out eval/results/turboquant_smollm2_norenorm
    /tmp/tqvenv/bin/python eval/compare_turboquant.py --dry-run --out /tmp/turboquant_dry   # every row, tiny

Protocol: `--model` on the first `--tokens` tokens of `--text`, fed in chunks of `--chunk` tokens, each attending
to the cache of the earlier chunks (and to itself at full precision); perplexity change against DynamicCache on the
same ids. Every quantized cache keeps the newest `--window` tokens at full precision and quantizes a token once, as
it leaves that window. Rows, by `--configs` name:

- `kivi4`, `kivi2`: hf_kvplus `QuantizedCache(bits=b)`, KIVI-style with its default groups of 32.
- `kXvY`, over `--seeds`: hf_kvplus `QuantizedCache(key_bits=X, value_bits=Y, rotation_seed=s)`; and the reference,
  a DynamicLayer whose tokens are replaced, as they leave the window, by TurboQuant's quantize-then-dequantize:
  keys by `TurboQuant(D, X, unbiased=False, seed=s)` (all X bits to the MSE codes, no QJL residual bit), values by
  `TurboQuant(D, Y, unbiased=False, seed=s + 100)` (the seeds its TurboQuantKVCache gives them), one pair of
  quantizers for every layer and head, as its TurboQuantDynamicCache does.
- `kXvY+qjl`, first seed only: the reference with its QJL keys, `TurboQuant(D, X, unbiased=True, seed=s)`: X - 1
  bits of MSE codes plus a 1-bit QJL sketch of the residual (D projections), decoded with the QJL correction.

Bits per coordinate (a coordinate of a key or of a value): hf_kvplus, 16 x `quantized_report()["ratio_to_fp16"]`
after the run (codes, scales, zero points and norms as stored, the full-precision window left out). The reference:
codes at their bit width, packed, plus one float16 norm per head vector and side (QJL keys: two, the vector's and
its residual's), so ((X D + 16) + (Y D + 16)) / 2D = (X + Y) / 2 + 16 / D, or 8 / D more with QJL keys. The
reference itself keeps codes as int64 and norms as float32; the simulation uses its float32 norms as they are.

`--no-renorm` sets `hf_kvplus.kernels.rotated_format.RENORMALIZE = False` (an ablation: the stored norm is |x|, not
|x| / |decoded unit vector|, which is what the reference stores); `--no-center` sets `CENTER_KEYS = False` (keys
coded without a centre, as before stop 33's centred keys). Writes `turboquant.json` (every run),
`turboquant.md` (the table) and `turboquant.png` (perplexity change against bits per coordinate) into `--out`.

Publishing a run: its folder goes in eval/results/<experiment>/ (the latest run only; eval/README.md), then
`python eval/report.py` rewrites BENCHMARKS.md from it (CI checks the file with `--check`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

from hf_kvplus import QuantizedCache
from hf_kvplus.cli.common import tokenize
from hf_kvplus.evaluation.perplexity import perplexity
from hf_kvplus.evaluation.report import format_table, stamp
from hf_kvplus.kernels import rotated_format
from hf_kvplus.resolve import load_model, load_text

CONFIGS = ("kivi4", "kivi2", "k4v4", "k4v2", "k3v3", "k3v2", "k2v4", "k2v2", "k3v3+qjl")
KIVI, ROTATED, REF_MSE, REF_QJL = ("hf_kvplus KIVI", "hf_kvplus rotated", "TurboQuant reference (MSE keys)",
                                   "TurboQuant reference (QJL keys)")  # fmt: skip
NO_RENORM, NO_CENTER = " (no renorm)", " (no centre)"


class ReferenceLayer(DynamicLayer):
    """A DynamicLayer whose tokens older than the newest `window` are replaced, once, by TurboQuant's
    quantize-then-dequantize. The chunk being fed is returned at full precision, as hf_kvplus's prefill attends,
    so that the two differ only in how the past is coded."""

    def __init__(self, key_quantizer, value_quantizer, window: int):
        super().__init__()
        self.key_quantizer, self.value_quantizer, self.window = key_quantizer, value_quantizer, window
        self.quantized = 0  # tokens 0 .. quantized - 1 hold the reference's reconstruction

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start = self.get_seq_length()
        keys, values = super().update(key_states, value_states)
        end = keys.shape[-2] - self.window
        if end > self.quantized:
            keys[:, :, self.quantized : end] = roundtrip(self.key_quantizer, keys[:, :, self.quantized : end])
            values[:, :, self.quantized : end] = roundtrip(self.value_quantizer, values[:, :, self.quantized : end])
            self.quantized = end
        return torch.cat([keys[:, :, :start], key_states], -2), torch.cat([values[:, :, :start], value_states], -2)


def roundtrip(quantizer, x: torch.Tensor) -> torch.Tensor:
    """`x` ([..., D]) through the reference's quantize then dequantize, in float32."""
    flat = x.reshape(-1, x.shape[-1]).float()
    return quantizer.dequantize(quantizer.quantize(flat)).reshape(x.shape).to(x.dtype)


class ReferenceCache(Cache):
    """turboquant-torch's quantizers on the protocol's window (see the module docstring), for a full-attention model."""

    def __init__(self, config, key_bits: int, value_bits: int, seed: int, window: int, qjl: bool = False):
        from turboquant import TurboQuant

        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        keys = TurboQuant(head_dim, key_bits, unbiased=qjl, seed=seed)
        values = TurboQuant(head_dim, value_bits, unbiased=False, seed=seed + 100)
        super().__init__(layers=[ReferenceLayer(keys, values, window) for _ in range(config.num_hidden_layers)])
        key_norms = 2 if qjl else 1
        self.bits_per_coordinate = (key_bits + value_bits) / 2 + 16 * (key_norms + 1) / (2 * head_dim)


def parse_config(name: str) -> tuple[str, int, int]:
    """("kivi" | "rotated" | "qjl", key bits, value bits) of a `--configs` name (also its argparse check)."""
    if found := re.fullmatch(r"kivi(\d)", name):
        return "kivi", int(found[1]), int(found[1])
    if found := re.fullmatch(r"k(\d)v(\d)(\+qjl)?", name):
        return ("qjl" if found[3] else "rotated"), int(found[1]), int(found[2])
    raise argparse.ArgumentTypeError(f"a config is kivi<b>, k<X>v<Y> or k<X>v<Y>+qjl, got {name!r}")


def plan(args, config) -> list[tuple[str, str, int | None, object]]:
    """(series, config, seed, cache factory) of every run, ours first."""
    ours, reference = [], []
    rotated = ROTATED + (NO_RENORM if args.no_renorm else "") + (NO_CENTER if args.no_center else "")
    for name in args.configs:
        kind, kb, vb = parse_config(name)
        if kind == "kivi":
            ours.append((KIVI, name, None, lambda b=kb: QuantizedCache(config, bits=b, window=args.window)))
        elif kind == "rotated":
            for s in args.seeds:
                ours.append((rotated, name, s, lambda kb=kb, vb=vb, s=s: QuantizedCache(
                    config, key_bits=kb, value_bits=vb, window=args.window, rotation_seed=s)))  # fmt: skip
                reference.append((REF_MSE, name, s, lambda kb=kb, vb=vb, s=s: ReferenceCache(
                    config, kb, vb, s, args.window)))  # fmt: skip
        else:
            s = args.seeds[0]
            reference.append((REF_QJL, name, s, lambda kb=kb, vb=vb, s=s: ReferenceCache(
                config, kb, vb, s, args.window, qjl=True)))  # fmt: skip
    return ours if args.ours_only else ours + reference


def bits_per_coordinate(cache) -> float:
    if isinstance(cache, ReferenceCache):
        return cache.bits_per_coordinate
    return 16 * cache.quantized_report()["ratio_to_fp16"]


COLUMNS = [("config", "config", ""), ("ours", "ours", ""), ("ours_bits", "bits", ".3f"),
           ("ours_mean", "ours delta %", "+.3f"), ("ours_range", "ours min .. max", ""),
           ("ref_bits", "ref bits", ".3f"), ("ref_mean", "ref delta %", "+.3f"), ("ref_range", "ref min .. max", ""),
           ("runs", "runs", "d")]  # fmt: skip


def summarize(runs: list[dict]) -> list[dict]:
    """One table row per config: ours (KIVI or rotated) and the reference, mean and range over seeds."""
    table = []
    for name in dict.fromkeys(r["config"] for r in runs if r["config"] != "dynamic"):
        row = {"config": name}
        for side, series in (("ours", lambda s: s.startswith("hf_kvplus")), ("ref", lambda s: s.startswith("Turbo"))):
            mine = [r for r in runs if r["config"] == name and series(r["series"])]
            if not mine:
                continue
            deltas = [r["delta_pct"] for r in mine]
            row[f"{side}_bits"] = statistics.fmean(r["bits_per_coordinate"] for r in mine)
            row[f"{side}_mean"] = statistics.fmean(deltas)
            row[f"{side}_range"] = f"{min(deltas):+.3f} .. {max(deltas):+.3f}"
            row["runs"] = len(mine)
            if side == "ours":
                row["ours"] = mine[0]["series"].removeprefix("hf_kvplus ")
        table.append(row)
    return table


def report(runs: list[dict], meta: dict, out: Path) -> str:
    base = next(r for r in runs if r["config"] == "dynamic")
    title = (f"{meta['model']} on {meta['text']}, first {meta['tokens']} tokens, chunks of {meta['chunk']}, "
             f"full-precision window {meta['window']}; DynamicCache perplexity {base['perplexity']:.4f}")  # fmt: skip
    table = format_table(summarize(runs), COLUMNS)
    notes = ("delta %: perplexity change against DynamicCache; ours: hf_kvplus (rotated: QuantizedCache(key_bits, "
             "value_bits, rotation_seed)); ref: turboquant-torch 0.4.0 simulated on the same window (k*v*: MSE keys, "
             "+qjl: QJL keys). bits: per key or value coordinate, codes + scales/zero points/norms at float16 "
             "(ours: 16 x quantized_report ratio_to_fp16; ref: (X + Y) / 2 + 16 / 64, + 8 / 64 with QJL keys).")
    md = f"{title}; {meta['machine']}, {meta['date']}\n\n```\n{table}\n```\n\n{notes}\n"
    (out / "turboquant.md").write_text(md)
    plot(runs, out / "turboquant.png", title)
    return md


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Perplexity change against bits per coordinate: every seed a small point, each config's mean a large marker
    (no lines: several configs share a bit count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 5.5))
    colors = plt.get_cmap("tab10")
    quantized = [r for r in runs if r["config"] != "dynamic"]
    for i, series in enumerate(dict.fromkeys(r["series"] for r in quantized)):
        mine = [r for r in quantized if r["series"] == series]
        axis.scatter([r["bits_per_coordinate"] for r in mine], [r["delta_pct"] for r in mine], s=12, alpha=0.5,
                     color=colors(i))  # fmt: skip
        means = []
        for name in dict.fromkeys(r["config"] for r in mine):
            of = [r for r in mine if r["config"] == name]
            means.append((statistics.fmean(r["bits_per_coordinate"] for r in of), statistics.fmean(r["delta_pct"] for r in of), name))
        reference = series.startswith("Turbo")
        axis.scatter([m[0] for m in means], [m[1] for m in means], s=60, marker="o" if reference else "s",
                     color=colors(i), edgecolor="black", linewidth=0.5, label=series)  # fmt: skip
        for x, y, name in means:  # reference labels below their marker, ours above
            axis.annotate(name, (x, y), textcoords="offset points", xytext=(6, -10 if reference else 4), fontsize=7,
                          color=colors(i))  # fmt: skip
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_yscale("symlog", linthresh=1)
    axis.set(xlabel="bits per coordinate (codes + float16 scales / norms)",
             ylabel="perplexity change vs DynamicCache, % (symlog)")  # fmt: skip
    axis.set_title(title, fontsize=8)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default="austen:prideprejudice")
    parser.add_argument("--tokens", type=int, default=4096, help="score the first N tokens of the text")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="rotation seeds of the kXvY rows")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), type=lambda name: parse_config(name) and name,
                        help=f"rows to run (default {' '.join(CONFIGS)})")
    parser.add_argument("--window", type=int, default=128, help="full-precision recent tokens of every quantized cache")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per forward")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ours-only", action="store_true", help="skip the reference rows")
    parser.add_argument("--no-renorm", action="store_true", help="store |x| as the rotated formats' norm (ablation)")
    parser.add_argument("--no-center", action="store_true", help="code the rotated formats' keys without a centre "
                                                                  "(ablation)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="every row at a tiny size: 300 tokens, 1 seed, "
                                                               "window 32, chunks of 64")  # fmt: skip
    args = parser.parse_args(argv)
    if args.dry_run:
        args.tokens, args.seeds, args.window, args.chunk = 300, args.seeds[:1], 32, 64
    if not args.ours_only and importlib.util.find_spec("turboquant") is None:
        parser.error("turboquant-torch is not importable here: run with the python of scripts/turboquant_venv.sh's "
                     "venv, or pass --ours-only")  # fmt: skip
    torch.set_num_threads(args.threads)
    if args.no_renorm:
        rotated_format.RENORMALIZE = False
    if args.no_center:
        rotated_format.CENTER_KEYS = False
    model, tokenizer = load_model(args.model)
    ids = tokenize(tokenizer, load_text(args.text), args.tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**stamp(), "model": args.model, "text": args.text, "tokens": ids.numel(), "chunk": args.chunk,
            "window": args.window, "seeds": args.seeds, "renormalize": rotated_format.RENORMALIZE,
            "center_keys": rotated_format.CENTER_KEYS}  # fmt: skip
    if not args.ours_only:
        meta["versions"]["turboquant-torch"] = __import__("turboquant").__version__

    def measure(series: str, name: str, seed: int | None, cache) -> dict:
        result = perplexity(model, ids, cache, mode="chunked", chunk_size=args.chunk, label=f"{series} {name} {seed}")
        return {"series": series, "config": name, "seed": seed, "perplexity": result.perplexity,
                "seconds": result.seconds}  # fmt: skip

    def save() -> None:  # after every run: a long run that stops keeps what it measured
        (args.out / "turboquant.json").write_text(json.dumps({**meta, "runs": runs}, indent=1))

    base = measure("DynamicCache", "dynamic", None, DynamicCache(config=model.config))
    runs = [{**base, "delta_pct": 0.0, "bits_per_coordinate": 32.0}]  # float32, as the model runs
    save()
    for series, name, seed, make in tqdm(plan(args, model.config), desc="caches", unit="run"):
        cache = make()
        row = measure(series, name, seed, cache)
        row["delta_pct"] = 100 * (row["perplexity"] / base["perplexity"] - 1)
        row["bits_per_coordinate"] = bits_per_coordinate(cache)
        runs.append(row)
        tqdm.write(f"{series} {name} seed {seed}: ppl {row['perplexity']:.4f} ({row['delta_pct']:+.3f}%), "
                   f"{row['bits_per_coordinate']:.3f} bits, {row['seconds']:.0f} s")  # fmt: skip
        save()
    print(report(runs, meta, args.out))
    print(f"wrote {args.out}/turboquant.json, .md and .png")


if __name__ == "__main__":
    main()
