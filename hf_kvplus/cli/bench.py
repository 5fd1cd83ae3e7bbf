"""`kvplus bench`: prefill, time to first token, decode speed and memory per cache."""

from __future__ import annotations

from dataclasses import asdict

import torch

from ..evaluation.benchmark import BENCH_COLUMNS, benchmark, plot_bench
from ..evaluation.report import format_table
from ..specs import available_cache_specs
from . import common


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="decode speed and bytes at rest per cache, baseline first")
    common.add_model_args(parser)
    common.add_cache_args(parser, None)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="rows, each a distinct passage of the text")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.set_defaults(func=run)


def run(args) -> int:
    common.setup(args)
    specs = common.cache_specs(args, available_cache_specs())
    model, tokenizer, text = common.load(args)
    prompt = common.passages(tokenizer, text, args.prompt_tokens, args.batch)
    prompt = prompt.to(next(model.parameters()).device)
    results = benchmark(model, prompt, specs, new_tokens=args.new_tokens, repeats=args.repeats, warmup=args.warmup)
    title = (f"{args.model}: prompt {prompt.shape[1]} x batch {args.batch}, {args.new_tokens} new tokens, "
             f"median of {args.repeats}, threads {torch.get_num_threads()}")
    print("\n" + title)
    rows = [asdict(r) for r in results]
    print(format_table(rows, BENCH_COLUMNS))
    folder = common.out_dir(args, "bench")
    common.write_json(folder / "bench.json", {"title": title, "results": rows})
    plot_bench(results, folder / "bench.png", title)
    print(f"\nwrote {folder}/bench.json and bench.png")
    return 0
