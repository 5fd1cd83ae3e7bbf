"""What KVzip's reconstruction costs at prefill: a context's prefill into a `KVzipCache` plus `compress` (the second
forward that repeats it), against DynamicCache's prefill of the same tokens, in the same run.

    python eval/kvzip_prefill.py --threads 1 --tokens 4096 --repeats 3 --cache kvzip:820 \
        --out eval/results/needle48/kvzip_prefill.json

The context is the first `--tokens` tokens of the text; the reconstruction repeats all of them (chunks of the cache's
`chunk`). The two are timed alternately, `--repeats` times each; the ratio is of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_kvplus import cache_kwargs
from hf_kvplus.evaluation.report import stamp
from hf_kvplus.resolve import load_model, load_text
from hf_kvplus.specs import parse_cache_spec


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default="austen:prideprejudice")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--cache", default="kvzip:820", help="a kvzip spec")
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
    spec = parse_cache_spec(args.cache)
    times: dict[str, list[float]] = {"dynamic": [], "kvzip_prefill": [], "kvzip_compress": []}
    with torch.no_grad():
        for _ in range(args.repeats):
            start = time.perf_counter()
            model(ids, **cache_kwargs(DynamicCache(config=model.config)), logits_to_keep=1)
            times["dynamic"].append(time.perf_counter() - start)
            cache = spec.build(model.config)
            start = time.perf_counter()
            model(ids, **cache_kwargs(cache), logits_to_keep=1)
            middle = time.perf_counter()
            cache.compress(model, ids, tokenizer)
            times["kvzip_prefill"].append(middle - start)
            times["kvzip_compress"].append(time.perf_counter() - middle)
    median = {name: statistics.median(values) for name, values in times.items()}
    total = median["kvzip_prefill"] + median["kvzip_compress"]
    result = {**stamp(), "tokens": ids.shape[1], "cache": args.cache, "seconds": times, "median": median,
              "kvzip_total": total, "ratio": total / median["dynamic"]}  # fmt: skip
    print(json.dumps({k: result[k] for k in ("tokens", "cache", "median", "kvzip_total", "ratio")}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
