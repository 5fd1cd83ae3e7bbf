"""Exact regions on the low-bit rotated formats: which first tokens and boundary layers pay, per
bit class, on two texts and over rotation seeds.

    python eval/lowbit_regions.py --out eval/results/lowbit_regions_fixed_centre
    python eval/lowbit_regions.py --out eval/results/lowbit_regions_fixed_centre --chunks 256   # more rows, same folder
    python eval/lowbit_regions.py --out eval/results/lowbit_regions_fixed_centre --report-only  # tables from what is there
    python eval/lowbit_regions.py --dry-run --out /tmp/lowbit_dry                      # every row, tiny

Protocol (the issue's): `--model` on the first `--tokens` tokens of each `--texts`, fed in chunks of each `--chunks`
(32: decode-like; 256: prefill-like), a `--window`-token full-precision window; perplexity change against
DynamicCache on the same ids and chunks (measured once per text and chunk size). Each row is
`QuantizedCache(bits=<config>, window, first_tokens=<first>, boundary_layers=..., boundary_bits=...,
rotation_seed=<seed>)` for every `--configs` x `--firsts` x `--boundaries` x `--seeds`; a boundary is `0` (none),
`1` (the first and last layer at the model's precision), `1@int8` (at int8: `boundary_bits=int8`) or `cal=NAME`
(the layers `kvplus calibrate` chose, read from `--calibrations/NAME/calibration.json`: `layer_bits`). Every
region is given explicitly, so a preset's default never enters a row; so is the keys' centre (`--centers`: `turning`,
the cache's default, and or `fixed`, `turning_keys=False`; rows from before the turning centre have none: fixed). Bits per coordinate:
`quantized_report()["bits_per_coordinate"]` after the run: every token outside the window, the exact regions
counted at their dtype (float32 here, as the model runs on the CPU).

Each run also records `se_pct`, the standard error of its change in points: the spread of its per-token log-likelihood
differences from DynamicCache's over the square root of their count (paired, on the same tokens). DynamicCache's
per-token values are kept in `dynamic_nll.json.gz` in `--out` (measured again where missing).

Runs are appended to `runs.jsonl` in `--out` as they finish, and a rerun skips the rows already there (so a long
grid can be stopped, and extended with other options into the same folder). Writes `lowbit_regions.json` (every
run and the settings), `lowbit_regions.md` (mean and min .. max over seeds, per text and chunk size) and
`lowbit_regions.png` (perplexity change against bits, per text and chunk size).

Publishing a run: its folder goes in eval/results/<experiment>/ (the latest run only; eval/README.md), then
`python eval/report.py` rewrites BENCHMARKS.md from it (CI checks the file with `--check`).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
from pathlib import Path

import torch
from regions_table import regions_table
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvplus import QuantizedCache
from hf_kvplus.calibration import Calibration
from hf_kvplus.cli.common import tokenize
from hf_kvplus.evaluation.perplexity import perplexity
from hf_kvplus.evaluation.report import format_table, stamp
from hf_kvplus.resolve import load_model, load_text

#: Where `cal=NAME` boundaries are read from (`--calibrations`).
CALIBRATIONS = Path(__file__).parent / "results" / "calibrate_smollm2_rotated"


def parse_boundary(text: str) -> tuple[int, str | None]:
    """`0`, `1`, `1@int8` -> (layers, bits or None); `cal=NAME` -> (0, None) (see `region_options`)."""
    if text.startswith("cal="):
        return 0, None
    layers, _, bits = text.partition("@")
    return int(layers), bits or None


def calibration_path(boundary: str, folder: Path = CALIBRATIONS) -> Path:
    return folder / boundary.removeprefix("cal=") / "calibration.json"


def region_options(boundary: str, bits: str, folder: Path = CALIBRATIONS) -> dict:
    """`QuantizedCache`'s layer arguments for a boundary: boundary layers, or a calibration's `layer_bits` (one made for
    `bits`)."""
    if boundary.startswith("cal="):
        calibration = Calibration.load(calibration_path(boundary, folder))
        calibration.check_bits(bits)
        return {"layer_bits": calibration.layer_bits}
    layers, bits = parse_boundary(boundary)
    return {"boundary_layers": layers, "boundary_bits": bits}


def label(row: dict) -> str:
    """The cache spec a row measures (the `seed=` option of the quantized specs)."""
    layers, bits = parse_boundary(row["boundary"])
    boundary = f":boundary={layers}" + (f":boundary_bits={bits}" if bits else "")
    if row["boundary"].startswith("cal="):
        boundary = f":calibration={calibration_path(row['boundary']).relative_to(Path(__file__).parent.parent)}"
    return (f"quantized:{row['config']}:window={row['window']}:first={row['first']}{boundary}:seed={row['seed']}"
            f":center={center(row)}")  # fmt: skip


def center(row: dict) -> str:
    """The key centre a row's cache had: `turning` or `fixed` (rows measured before the turning centre: fixed)."""
    return row.get("center", "fixed")


def key(row: dict) -> tuple:
    return (row["text"], row["chunk"], row["tokens"], row["window"], row["config"], row["first"], row["boundary"],
            row["seed"], center(row))  # fmt: skip


def standard_error(nll: torch.Tensor, base: list[float]) -> float:
    """The standard error of the mean per-token difference of `nll` from `base` (nats): std / sqrt(count)."""
    difference = nll.double() - torch.tensor(base, dtype=torch.float64)
    return float(difference.std() / difference.numel() ** 0.5)


def read_runs(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (config, first, boundary, text, chunk): mean, min and max over seeds, bits."""
    table = []
    groups = dict.fromkeys((r["config"], r["first"], r["boundary"], r["text"], r["chunk"], center(r)) for r in runs
                           if r["config"] != "dynamic")  # fmt: skip
    for config, first, boundary, text, chunk, kind in sorted(groups, key=lambda g: (g[0], g[3], g[4], g[1], g[2], g[5])):
        mine = [r for r in runs if (r["config"], r["first"], r["boundary"], r["text"], r["chunk"], center(r)) ==
                (config, first, boundary, text, chunk, kind)]  # fmt: skip
        deltas = [r["delta_pct"] for r in mine]
        table.append({"config": config, "first": first, "boundary": boundary, "center": kind,
                      "text": text.removeprefix("austen:"),
                      "chunk": chunk, "bits": statistics.fmean(r["bits_per_coordinate"] for r in mine),
                      "mean": statistics.fmean(deltas), "range": f"{min(deltas):+.3f} .. {max(deltas):+.3f}",
                      "seeds": len(mine), "seed0": next((r["delta_pct"] for r in mine if r["seed"] == 0), None),
                      "se0": next((r.get("se_pct") for r in mine if r["seed"] == 0), None)})  # fmt: skip
    return table


COLUMNS = [("config", "config", ""), ("first", "first", "d"), ("boundary", "boundary", ""), ("center", "key centre", ""),
           ("text", "text", ""),
           ("chunk", "chunk", "d"), ("bits", "bits/coord", ".3f"), ("mean", "delta % mean", "+.3f"),
           ("range", "min .. max", ""), ("seed0", "seed 0", "+.3f"), ("se0", "+- se", ".3f"),
           ("seeds", "seeds", "d")]  # fmt: skip


def wide(runs: list[dict]) -> str:
    """The exact-regions table (`regions_table`) of the quantized runs, as markdown."""
    header, rows = regions_table([r for r in runs if r["config"] != "dynamic"])
    lines = ["| " + " | ".join(header) + " |", "| --- | ---: | --- | ---: |" + " ---: |" * (len(header) - 4)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def report(runs: list[dict], meta: dict, out: Path) -> str:
    bases = [r for r in runs if r["config"] == "dynamic"]
    base_text = "; ".join(f"{r['text']} chunks of {r['chunk']}: {r['perplexity']:.4f}" for r in bases)
    title = (f"{meta['model']}, first {meta['tokens']} tokens, window {meta['window']}, rotated formats with exact "
             f"regions; DynamicCache perplexity {base_text}")  # fmt: skip
    table = format_table(summarize([r for r in runs if r["config"] != "dynamic"]), COLUMNS)
    notes = ("delta %: perplexity change against DynamicCache on the same ids and chunks, mean and min .. max over "
             "the rotation seeds; first: exact first tokens of each row; boundary: the first and last N layers at "
             "full precision (N@int8: at int8); bits/coord: quantized_report()['bits_per_coordinate'] (every token "
             "outside the window, exact regions at float32), mean over seeds.")
    md = (f"{title}; {meta['machine']}, {meta['date']}\n\n```\n{table}\n```\n\n{notes}\n\n"
          f"Per text (c: chunk size): mean over seeds [min .. max] (seeds), and the mean of the seed-by-seed change "
          f"(points) from the same config without regions (a boundary row: with its first tokens alone):\n\n{wide(runs)}\n")  # fmt: skip
    (out / "lowbit_regions.md").write_text(md)
    (out / "lowbit_regions.json").write_text(json.dumps({**meta, "runs": runs}, indent=1))
    plot(runs, out / "lowbit_regions.png", title)
    return md


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Perplexity change (mean over seeds) against bits per coordinate, one panel per text and chunk size, one
    marker per config and colour per region setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarize([r for r in runs if r["config"] != "dynamic"])
    panels = list(dict.fromkeys((r["text"], r["chunk"]) for r in rows))
    if not panels:
        return
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False, sharey=True)
    settings = list(dict.fromkeys((r["first"], r["boundary"]) for r in rows))
    colors, markers = plt.get_cmap("tab10"), {"k4v2": "s", "k3v2": "o", "k2v2": "^"}
    for axis, (text, chunk) in zip(axes[0], panels, strict=True):
        for r in (r for r in rows if (r["text"], r["chunk"]) == (text, chunk)):
            i = settings.index((r["first"], r["boundary"]))
            axis.scatter(r["bits"], r["mean"], color=colors(i % 10), marker=markers.get(r["config"], "x"), s=40,
                         edgecolor="black", linewidth=0.4,
                         label=f"first {r['first']}, boundary {r['boundary']}")  # fmt: skip
        handles, names = axis.get_legend_handles_labels()
        unique = dict(zip(names, handles, strict=True))
        axis.legend(unique.values(), unique.keys(), fontsize=6)
        axis.axhline(0, color="black", linewidth=0.8)
        axis.set(title=f"{text}, chunks of {chunk} (square k4v2, circle k3v2, triangle k2v2)",
                 xlabel="bits per coordinate (exact regions counted)")  # fmt: skip
        axis.title.set_fontsize(7)
        axis.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("perplexity change vs DynamicCache, %, mean over seeds")
    figure.suptitle(title, fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (runs.jsonl is extended there)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--texts", nargs="+", default=["austen:prideprejudice", "austen:emma"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--chunks", type=int, nargs="+", default=[32])
    parser.add_argument("--configs", nargs="+", default=["k4v2", "k3v2"], help="rotated formats (k4v2, k3v2, k2v2)")
    parser.add_argument("--firsts", type=int, nargs="+", default=[0, 4], help="exact first tokens")
    parser.add_argument("--calibrations", type=Path, default=CALIBRATIONS,
                        help="folder of the `cal=NAME` boundaries' calibrations (NAME/calibration.json)")
    parser.add_argument("--boundaries", nargs="+", default=["0", "1"], type=lambda t: parse_boundary(t) and t,
                        help="boundary layers: 0, 1, 1@int8 (the boundary layers at int8) or cal=NAME (a calibration)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="rotation seeds")
    parser.add_argument("--centers", nargs="+", default=["turning"], choices=["turning", "fixed"],
                        help="the keys' centre: turning with RoPE (the cache's default) or fixed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--report-only", action="store_true", help="write the tables from runs.jsonl, measure nothing")
    parser.add_argument("--dry-run", action="store_true", help="every row tiny: 300 tokens, window 64, seed 0")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.tokens, args.window, args.seeds = 300, 64, args.seeds[:1]
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    runs = read_runs(log)
    meta = {**stamp(), "model": args.model, "tokens": args.tokens, "window": args.window,
            "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    if args.report_only:
        print(report(runs, meta, args.out))
        return
    done = {key(r) for r in runs}
    model, tokenizer = load_model(args.model)
    # Rows ordered chunk size, then seed, then text: a grid stopped early has every setting on every text at seed 0.
    plan = [{"text": text, "chunk": chunk, "tokens": args.tokens, "window": args.window, "config": config,
             "first": first, "boundary": boundary, "seed": seed, "center": kind}
            for chunk, seed, text in itertools.product(args.chunks, args.seeds, args.texts)
            for config, first, boundary, kind in itertools.product(args.configs, args.firsts, args.boundaries,
                                                                   args.centers)]  # fmt: skip
    todo = [row for row in plan if key(row) not in done]
    ids, bases = {}, {(r["text"], r["chunk"], r["tokens"], r["window"]): r for r in runs if r["config"] == "dynamic"}
    nll_file = args.out / "dynamic_nll.json.gz"
    base_nll = json.loads(gzip.decompress(nll_file.read_bytes())) if nll_file.exists() else {}

    def record(row: dict) -> None:
        runs.append(row)
        with log.open("a") as handle:
            handle.write(json.dumps(row) + "\n")

    for row in tqdm(todo, desc="runs", unit="run"):
        text, chunk = row["text"], row["chunk"]
        if text not in ids:
            ids[text] = tokenize(tokenizer, load_text(text), args.tokens)
        where = (text, chunk, args.tokens, args.window)
        name = f"{text} c{chunk} t{args.tokens}"
        if where not in bases or name not in base_nll:  # DynamicCache once per text and chunk size
            result = perplexity(model, ids[text], DynamicCache(config=model.config), mode="chunked", chunk_size=chunk,
                                label=f"dynamic {text} {chunk}")  # fmt: skip
            base_nll[name] = result.nll.tolist()
            nll_file.write_bytes(gzip.compress(json.dumps(base_nll).encode(), mtime=0))
            if where not in bases:
                bases[where] = {"text": text, "chunk": chunk, "tokens": args.tokens, "window": args.window,
                                "config": "dynamic", "first": 0, "boundary": "0", "seed": None,
                                "perplexity": result.perplexity, "seconds": result.seconds}  # fmt: skip
                record(bases[where])
        cache = QuantizedCache(model.config, bits=row["config"], window=args.window, first_tokens=row["first"],
                               rotation_seed=row["seed"], turning_keys=row["center"] == "turning",
                               **region_options(row["boundary"], row["config"], args.calibrations))  # fmt: skip
        result = perplexity(model, ids[text], cache, mode="chunked", chunk_size=chunk, label=label(row))
        ratio = result.perplexity / bases[where]["perplexity"]
        row |= {"spec": label(row), "perplexity": result.perplexity, "seconds": result.seconds,
                "delta_pct": 100 * (ratio - 1), "se_pct": 100 * ratio * standard_error(result.nll, base_nll[name]),
                "bits_per_coordinate": cache.quantized_report()["bits_per_coordinate"]}  # fmt: skip
        record(row)
        tqdm.write(f"{text} chunk {chunk} {row['spec']}: ppl {row['perplexity']:.4f} ({row['delta_pct']:+.3f}% "
                   f"+- {row['se_pct']:.3f}), "
                   f"{row['bits_per_coordinate']:.3f} bits, {row['seconds']:.0f} s")  # fmt: skip
    print(report(runs, meta, args.out))
    print(f"wrote {args.out}/lowbit_regions.json, .md and .png")


if __name__ == "__main__":
    main()
