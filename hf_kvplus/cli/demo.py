"""`kvplus demo`, the main job: every cache of the project against the baselines on a real model and text.

For each available cache spec (Transformers' `dynamic` first as the baseline): perplexity on the
first tokens of the text (chunked), bytes at rest per token read off the cache, and greedy decode
speed; a table, a plot and JSON.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from ..evaluation.benchmark import benchmark
from ..evaluation.perplexity import perplexity
from ..evaluation.report import format_table
from ..specs import available_cache_specs, parse_cache_spec
from . import common

COLUMNS = [
    ("cache", "cache", ""),
    ("kind", "kind", ""),
    ("perplexity", "perplexity", ".3f"),
    ("ppl_delta_pct", "ppl delta %", "+.3f"),
    ("bytes_per_token", "bytes/token", ",.0f"),
    ("bytes_vs_baseline", "x bytes", ".3f"),
    ("decode_tok_s", "decode tok/s", ".1f"),
    ("decode_vs_baseline", "x speed", ".2f"),
    ("same_tokens_as_baseline", "same tokens", ""),
]


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="the main job: every cache vs the baselines (perplexity, bytes, speed)")
    common.add_model_args(parser)
    common.add_cache_args(parser, None)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens scored for perplexity")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk of the perplexity run")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt of the speed run")
    parser.add_argument("--new-tokens", type=int, default=32, help="decoded tokens of the speed run")
    parser.set_defaults(func=run)


def run(args) -> int:
    started = time.perf_counter()
    common.setup(args)
    texts = args.caches or available_cache_specs()
    if "dynamic" not in texts[:1]:
        texts = ["dynamic"] + [t for t in texts if t != "dynamic"]
    specs = [parse_cache_spec(t) for t in texts]
    model, tokenizer, text = common.load(args)
    ids = common.tokenize(tokenizer, text, max(args.tokens, args.prompt_tokens))
    rows = []
    for spec in specs:
        result = perplexity(model, ids[: args.tokens], lambda spec=spec: spec.build(model.config, max_length=args.tokens),
                            chunk_size=args.chunk, label=spec.text)
        rows.append({"cache": spec.text, "kind": "lossless" if spec.lossless else "lossy",
                     "perplexity": result.perplexity})
    prompt = ids[None, : args.prompt_tokens]
    speeds = benchmark(model, prompt, specs, new_tokens=args.new_tokens, repeats=1, warmup=1)
    base_ppl, base_bytes = rows[0]["perplexity"], speeds[0].bytes_per_token
    for row, speed in zip(rows, speeds, strict=True):
        row.update({k: v for k, v in asdict(speed).items() if k != "cache"})
        row["ppl_delta_pct"] = 100 * (row["perplexity"] / base_ppl - 1)
        row["bytes_vs_baseline"] = speed.bytes_per_token / base_bytes
    wall = time.perf_counter() - started
    title = (f"{args.model} on {args.text}: perplexity over {args.tokens} tokens (chunks of {args.chunk}); "
             f"speed: prompt {args.prompt_tokens} + {args.new_tokens} tokens; threads {torch.get_num_threads()}")
    print("\n" + title)
    print(format_table(rows, COLUMNS))
    print(f"\nwall time {wall:.0f} s")
    folder = common.out_dir(args, "demo")
    common.write_json(folder / "demo.json", {"title": title, "wall_s": wall, "rows": rows})
    _plot(rows, folder / "demo.png", title)
    print(f"wrote {folder}/demo.json and demo.png")
    return 0


def _plot(rows: list[dict], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["cache"] for r in rows]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    for axis, key, label in zip(
        axes,
        ("ppl_delta_pct", "bytes_per_token", "decode_tok_s"),
        ("perplexity change vs dynamic (%)", "bytes at rest per token", "decode tokens/s"),
        strict=True,
    ):
        axis.barh(names, [r[key] for r in rows], color=["#888" if r["cache"] == "dynamic" else "#3a7" for r in rows])
        axis.set_xlabel(label)
        axis.grid(True, axis="x", alpha=0.3)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
