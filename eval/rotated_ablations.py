"""Ablations of the rotated formats (issue 18) that were measured and not kept, on compare_turboquant.py's protocol.

    python eval/rotated_ablations.py codebooks --out eval/results/rotated_ablations
    python eval/rotated_ablations.py layer-bits --out eval/results/rotated_ablations

- `codebooks`: uniform codes after the rotation against the Lloyd-Max codebooks, same bytes. The uniform codebook
  has 2**bits evenly spaced levels, centred, with the step that minimises the mean squared error for the rotated
  coordinate's distribution (searched on compare's float64 grid); each `--configs` row over `--seeds`, both
  codebooks in the same run. Also prints each codebook's distortion (MSE x head dim).
- `layer-bits`: `--base` (k4v2) everywhere and one layer at `--up` (k8v8), for every layer in turn and none, one
  seed: how much of the loss each layer holds (the issue's "give the first and last layers more bits").

SmolLM2-135M, the first 4096 tokens of Pride and Prejudice in chunks of 256, a 128-token window, perplexity change
against DynamicCache on the same ids; writes `<ablation>.json` and `<ablation>.md` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from compare_turboquant import parse_config
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvplus import QuantizedCache
from hf_kvplus.cli.common import tokenize
from hf_kvplus.evaluation.perplexity import perplexity
from hf_kvplus.evaluation.report import format_table, stamp
from hf_kvplus.kernels import rotated_format
from hf_kvplus.kernels.rotated_format import RotatedFormat
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
        _, kb, vb = parse_config(name)
        cache = QuantizedCache(model.config, key_bits=kb, value_bits=vb, window=args.window, rotation_seed=seed)
        rows.append(measure(args, model, ids, base, cache, {"codebook": kind, "config": name, "seed": seed}))
    use_codebooks("lloyd-max")
    table = []
    for name in args.configs:
        for kind in ("lloyd-max", "uniform"):
            deltas = [r["delta_pct"] for r in rows if r["config"] == name and r["codebook"] == kind]
            table.append({"config": name, "codebook": kind, "mean": statistics.fmean(deltas),
                          "range": f"{min(deltas):+.3f} .. {max(deltas):+.3f}", "runs": len(deltas)})  # fmt: skip
    columns = [("config", "config", ""), ("codebook", "codebook", ""), ("mean", "delta % mean", "+.3f"),
               ("range", "min .. max", ""), ("runs", "seeds", "d")]  # fmt: skip
    return rows, format_table(table, columns)


def layer_bits(args, model, ids, base) -> tuple[list[dict], str]:
    up = parse_config(args.up)
    _, kb, vb = parse_config(args.base)
    rows = []
    for layer in tqdm([None, *range(model.config.num_hidden_layers)], desc="layers"):
        cache = QuantizedCache(model.config, key_bits=kb, value_bits=vb, window=args.window, rotation_seed=args.seed)
        if layer is not None:  # the one layer's storage recoded at the higher bits (same seed as it had)
            storage = cache.layers[layer].storage
            storage.segment.fmt = RotatedFormat(up[1], up[2], storage.segment.fmt.seed)
        rows.append(measure(args, model, ids, base, cache, {"layer": "none" if layer is None else layer}))
    none = rows[0]["delta_pct"]
    for row in rows:
        row["gain_points"] = row["delta_pct"] - none
    columns = [("layer", "layer up", ""), ("bits", "bits", ".3f"), ("delta_pct", "delta %", "+.3f"),
               ("gain_points", "vs none, points", "+.3f")]  # fmt: skip
    return rows, format_table(rows, columns)


def measure(args, model, ids, base: float, cache, row: dict) -> dict:
    ppl = perplexity(model, ids, cache, mode="chunked", chunk_size=args.chunk, label=str(row)).perplexity
    row.update(perplexity=ppl, delta_pct=100 * (ppl / base - 1), bits=16 * cache.quantized_report()["ratio_to_fp16"])
    tqdm.write(json.dumps(row))
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ablation", choices=["codebooks", "layer-bits"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["k4v2", "k3v2", "k2v2"], help="codebooks: rotated configs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="codebooks: rotation seeds")
    parser.add_argument("--base", default="k4v2", help="layer-bits: every layer's format")
    parser.add_argument("--up", default="k8v8", help="layer-bits: the one layer's format")
    parser.add_argument("--seed", type=int, default=0, help="layer-bits: rotation seed")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m")
    ids = tokenize(tokenizer, load_text("austen:prideprejudice"), args.tokens)
    base = perplexity(model, ids, DynamicCache(config=model.config), mode="chunked", chunk_size=args.chunk).perplexity
    rows, table = (codebooks if args.ablation == "codebooks" else layer_bits)(args, model, ids, base)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**stamp(), "ablation": args.ablation, "args": {k: str(v) for k, v in vars(args).items()}, "dynamic": base}
    (args.out / f"{args.ablation}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    md = (f"{args.ablation}: smollm2-135m on austen:prideprejudice, first {ids.numel()} tokens, chunks of {args.chunk}, "
          f"window {args.window}; DynamicCache perplexity {base:.4f}; {meta['machine']}, {meta['date']}\n\n```\n{table}\n```\n")  # fmt: skip
    (args.out / f"{args.ablation}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
