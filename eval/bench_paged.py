"""PagedCache against Transformers' caches, in one run: beam search, parallel samples, padded batches.

    python eval/bench_paged.py --threads 2 --json eval/results/paged_cpu.json

1. Beam search (`--beams 4`) from a `--prompt`-token prompt, `--new` tokens: decode tokens/s and the
   time spent inside `reorder_cache`, PagedCache vs DynamicCache (same tokens required).
2. Sampling with `num_return_sequences=--samples` (seeded): bytes at rest after generate.
3. A left-padded batch of 8 prompts of lengths 100..2000: bytes at rest of DynamicCache, a StaticCache
   sized for the longest row and PagedCache, against the bytes of the tokens actually held.
4. Prefix reuse: time to first token of a second call whose prompt shares `--prefix` tokens with the
   first, against the first call (PagedCache on one PagedPool, `reuse_prefix` / `store_prefix`).
Random weights in the shape of `--model`'s config (default SmolLM2-135M), float32. A PagedCache's bytes
at rest include its pool's free blocks (headroom it grew into); "held blocks' bytes" are the blocks
its tables reference.

Publishing a run: its folder goes in eval/results/<experiment>/ (the latest run only; eval/README.md), then
`python eval/report.py` rewrites BENCHMARKS.md from it (CI checks the file with `--check`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from hf_kvplus import PagedCache, PagedPool, cache_kwargs
from hf_kvplus.evaluation.report import format_table, stamp
from hf_kvplus.memory import cache_bytes
from hf_kvplus.planner import load_config


class ReorderTimer:
    """Wraps a cache's `reorder_cache` and adds up the seconds spent in it."""

    def __init__(self, cache):
        self.seconds, self.calls = 0.0, 0
        original = cache.reorder_cache

        def timed(beam_idx):
            start = time.perf_counter()
            original(beam_idx)
            self.seconds += time.perf_counter() - start
            self.calls += 1

        cache.reorder_cache = timed


CACHES = {
    "DynamicCache": lambda config, length: DynamicCache(config=config),
    "PagedCache": lambda config, length: PagedCache(config=config),
}


@torch.inference_mode()
def beam_search(model, prompt, new_tokens, beams):
    rows = []
    sequences = {}
    for name, make in CACHES.items():
        cache = make(model.config, prompt.shape[1] + new_tokens)
        timer = ReorderTimer(cache)
        start = time.perf_counter()
        out = model.generate(prompt, **cache_kwargs(cache), num_beams=beams, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, early_stopping=False)
        seconds = time.perf_counter() - start
        sequences[name] = out
        rows.append({"cache": name, "seconds": seconds, "tok_s": new_tokens / seconds,
                     "reorder_s": timer.seconds, "reorder_calls": timer.calls,
                     "bytes_at_rest": cache_bytes(cache)})
    for row in rows:
        row["same_tokens"] = torch.equal(sequences[row["cache"]], sequences["DynamicCache"])
    return rows


@torch.inference_mode()
def samples(model, prompt, new_tokens, count):
    rows = []
    for name, make in CACHES.items():
        cache = make(model.config, prompt.shape[1] + new_tokens)
        torch.manual_seed(0)
        model.generate(prompt, **cache_kwargs(cache), do_sample=True, num_return_sequences=count,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        rows.append({"cache": name, "bytes_at_rest": cache_bytes(cache), "rows": count,
                     "tokens_per_row": cache.get_seq_length()})
    return rows


@torch.inference_mode()
def padded_batch(model, lengths):
    longest = max(lengths)
    ids = torch.randint(10, model.config.vocab_size, (len(lengths), longest), generator=torch.Generator().manual_seed(2))
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, longest - length :] = 1
    ids = ids.masked_fill(mask == 0, 0)
    makers = {**CACHES, "StaticCache": lambda config, length: StaticCache(config=config, max_cache_len=length)}
    config = model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * model.dtype.itemsize
    rows = []
    for name, make in makers.items():
        cache = make(model.config, longest + 1)
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache))
        report = cache.memory_report() if hasattr(cache, "memory_report") else None
        rows.append({"cache": name, "bytes_at_rest": cache_bytes(cache),
                     "payload_bytes": report.payload_bytes + report.metadata_bytes if report else cache_bytes(cache),
                     "real_token_bytes": sum(lengths) * per_token,
                     "padded_token_bytes": len(lengths) * longest * per_token})
    return rows


@torch.inference_mode()
def prefix_reuse(model, prefix, suffix):
    pool = PagedPool(model.config)
    generator = torch.Generator().manual_seed(3)
    shared = torch.randint(10, model.config.vocab_size, (1, prefix), generator=generator)
    rows = []
    for call in ("first call", "second call"):
        ids = torch.cat([shared, torch.randint(10, model.config.vocab_size, (1, suffix), generator=generator)], 1)
        cache = PagedCache(config=model.config, pool=pool, namespace="bench")
        start = time.perf_counter()
        reused = cache.reuse_prefix(ids)
        model.generate(ids, **cache_kwargs(cache), max_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - start
        cache.store_prefix(ids)
        rows.append({"call": call, "prompt": ids.shape[1], "reused_tokens": reused, "ttft_s": ttft})
    for row in rows:
        row["vs_first"] = row["ttft_s"] / rows[0]["ttft_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a shipped config name or config.json")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=1500, help="tokens the two prompts of the reuse test share")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(args.model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    prompt = torch.randint(10, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))

    results = {"beam_search": beam_search(model, prompt, args.new, args.beams),
               "samples": samples(model, prompt[:, :512], 32, args.samples),
               "padded_batch": padded_batch(model, [100 + i * 1900 // 7 for i in range(8)]),
               "prefix_reuse": prefix_reuse(model, args.prefix, 100)}
    print(f"\nbeam search: {args.beams} beams, prompt {args.prompt}, {args.new} new tokens")
    print(format_table(results["beam_search"], [("cache", "cache", ""), ("tok_s", "tok/s", ".2f"),
                                               ("reorder_s", "reorder s", ".3f"), ("reorder_calls", "calls", "d"),
                                               ("bytes_at_rest", "bytes at rest", ","), ("same_tokens", "same", "")]))
    print(f"\nsampling: num_return_sequences={args.samples}, prompt 512, 32 new tokens")
    print(format_table(results["samples"], [("cache", "cache", ""), ("bytes_at_rest", "bytes at rest", ","),
                                           ("tokens_per_row", "tokens/row", "d")]))
    print("\nleft-padded batch of 8 prompts, 100..2000 tokens")
    print(format_table(results["padded_batch"], [("cache", "cache", ""), ("bytes_at_rest", "bytes at rest", ","),
                                                ("payload_bytes", "held blocks' bytes", ","),
                                                ("real_token_bytes", "real tokens' bytes", ","),
                                                ("padded_token_bytes", "padded bytes", ",")]))
    print(f"\nprefix reuse: two prompts sharing {args.prefix} tokens (+100 of their own), time to first token")
    print(format_table(results["prefix_reuse"], [("call", "call", ""), ("prompt", "prompt", "d"),
                                                ("reused_tokens", "reused", "d"), ("ttft_s", "TTFT s", ".3f"),
                                                ("vs_first", "x first", ".3f")]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**stamp(), "args": vars(args), "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
