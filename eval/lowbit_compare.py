"""What eval/compare_turboquant.py and eval/compare_tiny_turboquant.py share: the protocol, hf_kvplus's side, reusing
eval/lowbit_regions.py's runs of it, the run log and the table and plot.

Protocol: `--model` on the first `--tokens` tokens of `--text`, fed in chunks of each `--chunks` (32: decode-like;
256: prefill-like), each chunk attending to the cache of the earlier ones; perplexity change against DynamicCache on
the same ids and chunks, measured once per chunk size in the same run. hf_kvplus's rows are `QuantizedCache(
bits="kXvY", window=--window, rotation_seed=s)` as it ships (the k4v2, k3v2 and k2v2 presets keep 4 exact first
tokens, `PRESET_FIRST_TOKENS`; the keys' centre turns with RoPE on a model that has it: `center` in each run), over
`--seeds`.

Bits per coordinate (a coordinate of a key or of a value), counted the same way for every cache: over every token
outside the full-precision recent window, the codes at their packed width plus their metadata (norms, scales, zero
points) at float16, and any token kept exact outside the window (first tokens, protected layers) at the dtype it is
held in (float32 here, as the model runs on the CPU). hf_kvplus: `quantized_report()["bits_per_coordinate"]`.

Runs are appended to `runs.jsonl` in `--out` as they finish and a rerun skips those there (a grid can be stopped, or
split over processes into the same folder, then `--report-only`). `--reuse` takes hf_kvplus's rows from
eval/lowbit_regions.py's `runs.jsonl` where its protocol is the same (text, tokens, window, chunk, config, seed, the
preset's first tokens, no boundary layers, the key centre), after checking that its DynamicCache perplexity is this
run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvplus import QuantizedCache
from hf_kvplus.cli.common import tokenize
from hf_kvplus.evaluation.perplexity import perplexity
from hf_kvplus.evaluation.report import stamp
from hf_kvplus.quantized_cache import preset_first_tokens, turning_basis
from hf_kvplus.resolve import load_model, load_text

OURS = "hf_kvplus"
BASE = "DynamicCache"
SAME_BASE = 1e-6  # relative: a reused run's DynamicCache perplexity against this run's


class Row:
    """One planned run: `series` (a library), `config` (its name for the setting), `seed` (None: deterministic),
    `make(model)` the cache, `bits(cache)` its bits per coordinate after the run."""

    def __init__(self, series: str, config: str, seed: int | None, make: Callable, bits: Callable):
        self.series, self.config, self.seed, self.make, self.bits = series, config, seed, make, bits


def ours(config: str, seeds: list[int], window: int) -> list[Row]:
    """hf_kvplus's `QuantizedCache(bits=config)` as it ships, one row per seed."""
    return [Row(OURS, config, s, lambda model, s=s: QuantizedCache(model.config, bits=config, window=window,
                                                                   rotation_seed=s),
                lambda cache: cache.quantized_report()["bits_per_coordinate"]) for s in seeds]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, required=True, help="output folder (runs.jsonl is extended there)"
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default="austen:prideprejudice")
    parser.add_argument("--tokens", type=int, default=4096, help="score the first N tokens of the text")
    parser.add_argument(
        "--window", type=int, default=128, help="full-precision recent tokens of every quantized cache"
    )
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 256], help="tokens per forward")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="rotation seeds of the seeded rows"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ours-only", action="store_true", help="skip the other library's rows")
    parser.add_argument("--theirs-only", action="store_true", help="skip hf_kvplus's rows")
    parser.add_argument(
        "--reuse", type=Path, help="eval/lowbit_regions.py's runs.jsonl: hf_kvplus's rows from there"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="write the tables from runs.jsonl, measure nothing"
    )
    parser.add_argument("--dry-run", action="store_true", help="every row tiny: 300 tokens, window 32, chunks of 16 "
                                                               "and 64, the first seed")  # fmt: skip


def dry(args) -> None:
    if args.dry_run:
        args.tokens, args.window, args.chunks, args.seeds = 300, 32, [16, 64], args.seeds[:1]


def key(row: dict) -> tuple:
    return (
        row["series"],
        row["config"],
        row["seed"],
        row["chunk"],
        row["text"],
        row["tokens"],
        row["window"],
        row.get("center", "fixed") if row["series"] == OURS else None,
    )


def read_runs(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def shipped_center(config) -> str:
    """The key centre hf_kvplus's rows ship with on this model: "turning" with RoPE where it can, else "fixed"."""
    return "fixed" if turning_basis(config, None, rotated=True) is None else "turning"


def reused(args, row: Row, chunk: int, base: dict, center: str) -> dict | None:
    """hf_kvplus's run of `row` at `chunk` from `--reuse`, if its protocol is this one's (`center`: the key centre
    the row ships with; a run without one had the fixed centre)."""
    if args.reuse is None or row.series != OURS:
        return None
    theirs = read_runs(args.reuse)
    where = {"text": args.text, "chunk": chunk, "tokens": base["tokens"], "window": args.window}
    their_base = next(
        (r for r in theirs if r["config"] == "dynamic" and all(r[k] == v for k, v in where.items())), None
    )
    if their_base is None or abs(their_base["perplexity"] / base["perplexity"] - 1) > SAME_BASE:
        return None
    want = where | {"config": row.config, "seed": row.seed, "first": preset_first_tokens(row.config, None),
                    "boundary": "0"}  # fmt: skip
    found = next((r for r in theirs if all(r.get(k) == v for k, v in want.items())
                  and r.get("center", "fixed") == center), None)  # fmt: skip
    if found is None:
        return None
    return {"perplexity": found["perplexity"], "seconds": found["seconds"],
            "bits_per_coordinate": found["bits_per_coordinate"], "reused": str(args.reuse)}  # fmt: skip


def run(args, plan: list[Row], log: Path) -> list[dict]:
    """Every row of `plan` at every chunk size not already in `log`, and DynamicCache once per chunk size."""
    runs = read_runs(log)
    done = {key(r) for r in runs}
    model, tokenizer = load_model(args.model)
    ids = tokenize(tokenizer, load_text(args.text), args.tokens)
    tokens = ids.numel()
    center = shipped_center(model.config)

    def record(row: dict) -> dict:
        runs.append(row)
        with log.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        return row

    for chunk in args.chunks:
        where = {"chunk": chunk, "text": args.text, "tokens": tokens, "window": args.window}
        base = next(
            (r for r in runs if r["series"] == BASE and all(r[k] == v for k, v in where.items())), None
        )
        if base is None:
            result = perplexity(model, ids, DynamicCache(config=model.config), mode="chunked", chunk_size=chunk,
                                label=f"dynamic chunk {chunk}")  # fmt: skip
            base = record({"series": BASE, "config": "dynamic", "seed": None, **where, "perplexity": result.perplexity,
                           "seconds": result.seconds, "delta_pct": 0.0, "bits_per_coordinate": 32.0})  # fmt: skip
        for row in tqdm(plan, desc=f"chunk {chunk}", unit="run"):
            entry = {"series": row.series, "config": row.config, "seed": row.seed, **where}
            if row.series == OURS:
                entry["center"] = center
            if key(entry) in done:
                continue
            got = reused(args, row, chunk, base, center)
            if got is None:
                cache = row.make(model)
                result = perplexity(model, ids, cache, mode="chunked", chunk_size=chunk,
                                    label=f"{row.series} {row.config} {row.seed}")  # fmt: skip
                got = {
                    "perplexity": result.perplexity,
                    "seconds": result.seconds,
                    "bits_per_coordinate": row.bits(cache),
                }
            entry |= got | {"delta_pct": 100 * (got["perplexity"] / base["perplexity"] - 1)}
            record(entry)
            tqdm.write(f"chunk {chunk} {row.series} {row.config} seed {row.seed}: ppl {entry['perplexity']:.4f} "
                       f"({entry['delta_pct']:+.3f}%), {entry['bits_per_coordinate']:.3f} bits, "
                       f"{entry['seconds']:.0f} s" + (" (reused)" if "reused" in entry else ""))  # fmt: skip
    return runs


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (series, config): bits (mean over runs) and, per chunk size, mean, min, max and count."""
    table = []
    quantized = [r for r in runs if r["series"] != BASE]
    for series, config in dict.fromkeys((r["series"], r["config"]) for r in quantized):
        mine = [r for r in quantized if (r["series"], r["config"]) == (series, config)]
        row = {"series": series, "config": config, "bits": statistics.fmean(r["bits_per_coordinate"] for r in mine),
               "reused": any("reused" in r for r in mine)}  # fmt: skip
        for chunk in sorted({r["chunk"] for r in mine}):
            deltas = [r["delta_pct"] for r in mine if r["chunk"] == chunk]
            row[chunk] = {
                "mean": statistics.fmean(deltas),
                "min": min(deltas),
                "max": max(deltas),
                "n": len(deltas),
            }
        table.append(row)
    return table


def cell(stats: dict | None) -> str:
    """`+0.63% [+0.58 .. +0.70] (3)`, or `+0.63% (1)` for one run."""
    if stats is None:
        return ""
    if stats["n"] == 1:
        return f"{stats['mean']:+.2f}% (1)"
    return f"{stats['mean']:+.2f}% [{stats['min']:+.2f} .. {stats['max']:+.2f}] ({stats['n']})"


def markdown(runs: list[dict], meta: dict, notes: str) -> str:
    chunks = sorted({r["chunk"] for r in runs if r["series"] != BASE})
    bases = {r["chunk"]: r["perplexity"] for r in runs if r["series"] == BASE}
    title = (f"{meta['model']} on {meta['text']}, first {meta['tokens']} tokens, window {meta['window']}; DynamicCache "
             + ", ".join(f"{bases[c]:.4f} (chunks of {c})" for c in chunks if c in bases))  # fmt: skip
    lines = ["| cache | config | bits/coord | " + " | ".join(f"chunks of {c}" for c in chunks) + " |",
             "| --- | --- | ---: |" + " ---: |" * len(chunks)]  # fmt: skip
    for row in summarize(runs):
        lines.append(f"| {row['series']} | {row['config']}{' (reused)' if row['reused'] else ''} | {row['bits']:.3f} | "
                     + " | ".join(cell(row.get(c)) for c in chunks) + " |")  # fmt: skip
    return f"{title}; {meta['machine']}, {meta['date']}\n\n" + "\n".join(lines) + f"\n\n{notes}\n"


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Perplexity change against bits per coordinate, one panel per chunk size: every run a small point, each
    (series, config)'s mean a large marker, labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quantized = [r for r in runs if r["series"] != BASE]
    chunks = sorted({r["chunk"] for r in quantized})
    if not chunks:
        return
    figure, axes = plt.subplots(1, len(chunks), figsize=(7 * len(chunks), 5), squeeze=False, sharey=True)
    colors = plt.get_cmap("tab10")
    series = list(dict.fromkeys(r["series"] for r in quantized))
    for axis, chunk in zip(axes[0], chunks, strict=True):
        for i, name in enumerate(series):
            mine = [r for r in quantized if r["series"] == name and r["chunk"] == chunk]
            if not mine:
                continue
            axis.scatter([r["bits_per_coordinate"] for r in mine], [r["delta_pct"] for r in mine], s=10, alpha=0.5,
                         color=colors(i % 10))  # fmt: skip
            for j, config in enumerate(dict.fromkeys(r["config"] for r in mine)):
                of = [r for r in mine if r["config"] == config]
                x = statistics.fmean(r["bits_per_coordinate"] for r in of)
                y = statistics.fmean(r["delta_pct"] for r in of)
                axis.scatter([x], [y], s=55, marker="soD^v<>"[i % 7], color=colors(i % 10), edgecolor="black",
                             linewidth=0.5, label=name if j == 0 else None)  # fmt: skip
                axis.annotate(config, (x, y), textcoords="offset points", xytext=(5, 4 - 12 * (i % 2)), fontsize=7,
                              color=colors(i % 10))  # fmt: skip
        axis.axhline(0, color="black", linewidth=0.8)
        axis.set_yscale("symlog", linthresh=1)
        axis.set(
            title=f"chunks of {chunk}",
            xlabel="bits per coordinate (codes + float16 metadata + exact regions)",
        )
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    axes[0][0].set_ylabel("perplexity change vs DynamicCache, % (symlog)")
    figure.suptitle(title, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def publish(runs: list[dict], args, name: str, notes: str, extra: dict | None = None) -> str:
    """Writes `<name>.json` (every run and the settings), `<name>.md` and `<name>.png` into `--out`."""
    tokens = next((r["tokens"] for r in runs), args.tokens)
    meta = {**stamp(), "model": args.model, "text": args.text, "tokens": tokens, "window": args.window,
            "chunks": sorted({r["chunk"] for r in runs}), "seeds": args.seeds, **(extra or {})}  # fmt: skip
    md = markdown(runs, meta, notes)
    (args.out / f"{name}.md").write_text(md)
    (args.out / f"{name}.json").write_text(json.dumps({**meta, "runs": runs}, indent=1))
    plot(runs, args.out / f"{name}.png", md.splitlines()[0][:160])
    return md


def main(args, plan: Callable[[], list[Row]], name: str, notes: str, extra: dict | None = None) -> None:
    """Measure (unless `--report-only`) and publish."""
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    runs = read_runs(log) if args.report_only else run(args, plan(), log)
    print(publish(runs, args, name, notes, extra))
    print(f"wrote {args.out}/{name}.json, .md and .png")
