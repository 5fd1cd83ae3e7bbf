"""Perplexity cost of the evicting caches at fixed budgets, against DynamicCache, in one run.

    python eval/evict_budgets.py --tokens 4096 --budgets 0.2 0.5 --threads 2 --out eval/results/evict_budgets_4k

Each method is run the way it is meant to be: SinkCache and H2OCache in streaming mode (`--stream`
tokens per forward, so every token is scored against what survived before it), SnapKVCache in chunked
mode (`--chunk` tokens per forward: each chunk is a prompt it compresses). DynamicCache is scored in
both modes as the baseline of each. Budgets are fractions of `--tokens` (SinkCache: 4 sinks + the rest
as window; H2OCache: half recent, half heavy hitters). Writes a table (stdout and Markdown), JSON and
a bar plot.

Publishing a run: its folder goes in eval/results/<experiment>/ (the latest run only; eval/README.md), then
`python eval/report.py` rewrites BENCHMARKS.md from it (CI checks the file with `--check`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_kvplus import H2OCache, SinkCache, SnapKVCache
from hf_kvplus.evaluation.perplexity import perplexity
from hf_kvplus.evaluation.report import format_table, stamp
from hf_kvplus.resolve import load_model, load_text

COLUMNS = [("method", "method", ""), ("budget", "budget", "d"), ("fraction", "of tokens", ".0%"),
           ("mode", "mode", ""), ("perplexity", "perplexity", ".4f"), ("baseline", "dynamic", ".4f"),
           ("increase_pct", "increase %", "+.2f"), ("held", "tokens held", "d")]


def methods(budget: int) -> list[tuple[str, str, object]]:
    """(name, mode, factory(config)) of each method at `budget` tokens per layer and KV head."""
    return [
        ("SinkCache", "streaming", lambda c: SinkCache(c, num_sinks=4, window=budget - 4)),
        ("H2OCache", "streaming", lambda c: H2OCache(c, budget=budget)),
        ("SnapKVCache", "chunked", lambda c: SnapKVCache(c, budget=budget)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default="austen:prideprejudice")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.2, 0.5])
    parser.add_argument("--stream", type=int, default=16, help="tokens per forward in streaming mode")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per forward in chunked mode")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("kvplus-results/evict_budgets"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    ids = tokenizer(load_text(args.text), return_tensors="pt", add_special_tokens=False)["input_ids"][0][: args.tokens]
    chunks = {"streaming": args.stream, "chunked": args.chunk}
    baseline = {mode: perplexity(model, ids, lambda: DynamicCache(config=model.config), mode=mode,
                                 chunk_size=chunk, label=f"dynamic {mode}").perplexity
                for mode, chunk in chunks.items()}
    rows = [{"method": "DynamicCache", "budget": ids.numel(), "fraction": 1.0, "mode": mode, "perplexity": ppl,
             "baseline": ppl, "increase_pct": 0.0, "held": ids.numel()} for mode, ppl in baseline.items()]
    for fraction in args.budgets:
        budget = round(fraction * ids.numel())
        for name, mode, factory in methods(budget):
            holder = {}

            def build(factory=factory, holder=holder):
                holder["cache"] = factory(model.config)
                return holder["cache"]

            result = perplexity(model, ids, build, mode=mode, chunk_size=chunks[mode], label=f"{name} {budget}")
            rows.append({"method": name, "budget": budget, "fraction": fraction, "mode": mode,
                         "perplexity": result.perplexity, "baseline": baseline[mode],
                         "increase_pct": 100 * (result.perplexity / baseline[mode] - 1),
                         "held": holder["cache"].memory_report().tokens_held})
    title = (f"{args.model} on {args.text}, first {ids.numel()} tokens; streaming {args.stream} tokens per "
             f"forward, chunked {args.chunk}")
    table = format_table(rows, COLUMNS)
    print("\n" + title + "\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "evict_budgets.json").write_text(json.dumps({**stamp(), "title": title, "rows": rows}, indent=2))
    (args.out / "evict_budgets.md").write_text(f"{title}\n\n```\n{table}\n```\n")
    plot(rows, args.out / "evict_budgets.png", title)
    print(f"wrote {args.out}/evict_budgets.json, .md and .png")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evicting = [r for r in rows if r["method"] != "DynamicCache"]
    fractions = sorted({r["fraction"] for r in evicting})
    names = list(dict.fromkeys(r["method"] for r in evicting))
    figure, axis = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(fractions)
    for i, fraction in enumerate(fractions):
        values = [next(r["increase_pct"] for r in evicting if r["method"] == n and r["fraction"] == fraction)
                  for n in names]
        axis.bar([j + i * width for j in range(len(names))], values, width, label=f"budget {fraction:.0%}")
    axis.set_xticks([j + width * (len(fractions) - 1) / 2 for j in range(len(names))], names)
    axis.set_ylabel("perplexity increase over DynamicCache (%)")
    axis.set_title(title, fontsize=8)
    axis.grid(True, axis="y", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
