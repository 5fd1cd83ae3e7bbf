"""What scoring a context costs at prefill: each evicting cache's prefill of a context (plus `compress`, the second
forward that repeats it, for caches that have one: KVzip) against DynamicCache's prefill of the same tokens, in the
same run (the target: within 1.5x at 4K).

    python eval/scoring_prefill.py --threads 1 --tokens 4096 --repeats 2 \
        --cache h2o:820 --cache snapkv:820 --cache peak:820 --cache kvzip:820 \
        --out eval/results/needle_accuracy_bytes/scoring_prefill

The context is the first `--tokens` tokens of the text. The caches are timed in turn, DynamicCache first, `--repeats`
rounds; each ratio is of the medians. Writes `scoring_prefill.json` and `scoring_prefill.md` in `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvplus import cache_kwargs
from hf_kvplus.evaluation.report import format_table, stamp
from hf_kvplus.resolve import load_model, load_text
from hf_kvplus.specs import parse_cache_spec

BASELINE = "dynamic"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default="austen:prideprejudice")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--cache", action="append", required=True, help="an evicting cache spec (repeatable)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    ids = tokenizer(load_text(args.text), return_tensors="pt", add_special_tokens=False)["input_ids"][
        :, : args.tokens
    ]
    specs = {text: parse_cache_spec(text) for text in args.cache}
    seconds: dict[str, list[float]] = {name: [] for name in (BASELINE, *specs)}
    with torch.no_grad(), tqdm(total=args.repeats * len(seconds), desc="prefills") as bar:
        for _ in range(args.repeats):
            for name in seconds:
                cache = DynamicCache(config=model.config) if name == BASELINE else specs[name].build(model.config)
                start = time.perf_counter()
                model(ids, **cache_kwargs(cache), logits_to_keep=1)
                if hasattr(cache, "compress"):
                    cache.compress(model, ids, tokenizer)
                seconds[name].append(time.perf_counter() - start)
                bar.update()
    median = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = {name: median[name] / median[BASELINE] for name in specs}
    result = {**stamp(), "tokens": ids.shape[1], "seconds": seconds, "median": median, "ratio": ratio}
    rows = [{"cache": name, "seconds": median[name], "ratio": ratio.get(name, 1.0)} for name in seconds]
    text = format_table(rows, [("cache", "cache", ""), ("seconds", "prefill s (median)", ".1f"),
                               ("ratio", "x DynamicCache", ".2f")])  # fmt: skip
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scoring_prefill.json").write_text(json.dumps(result, indent=2))
        (args.out / "scoring_prefill.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
