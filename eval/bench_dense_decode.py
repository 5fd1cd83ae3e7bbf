"""Decode speed and bytes at rest: DynamicCache against DenseCache, measured in one run.

Bytes are read off the caches after the run: payload (the tokens held) and headroom (DenseCache's
allocated but unfilled capacity, which appends write into instead of concatenating).

A small random Llama (GQA) prefills a prompt, then decodes greedily one token at a time through
`model(..., **cache_kwargs(cache))`. Each cache is timed `--repeats` times, alternating, after a
warm-up; the table shows the medians and DenseCache's speed as a ratio of DynamicCache's.

    python eval/bench_dense_decode.py --prompt 1024 --new 256 --threads 2 --json eval/results/dense_decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_kvplus import DenseCache, cache_kwargs
from hf_kvplus.evaluation.report import stamp

CACHES = {
    "DynamicCache": lambda config: DynamicCache(config=config),
    "DenseCache": lambda config: DenseCache(config=config),
}


def small_llama(layers: int, hidden: int, heads: int, kv_heads: int, positions: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def run_once(model, make_cache, prompt: torch.Tensor, new_tokens: int) -> dict:
    """Prefill then `new_tokens` greedy decode steps; returns timings and the cache's bytes at rest."""
    cache = make_cache(model.config)
    start = time.perf_counter()
    logits = model(input_ids=prompt, **cache_kwargs(cache), use_cache=True).logits
    prefill_s = time.perf_counter() - start
    token = logits[:, -1:].argmax(-1)
    tokens = [token]
    start = time.perf_counter()
    for _ in range(new_tokens):
        logits = model(input_ids=token, **cache_kwargs(cache), use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        tokens.append(token)
    decode_s = time.perf_counter() - start
    if isinstance(cache, DenseCache):
        report = cache.memory_report()
        payload, headroom = report.payload_bytes + report.metadata_bytes, report.reserved_bytes
    else:
        payload, headroom = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers), 0
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_tok_s": new_tokens / decode_s,
        "payload_bytes": payload,
        "headroom_bytes": headroom,
        "payload_bytes_per_token": payload / cache.get_seq_length(),
        "tokens": torch.cat(tokens, dim=1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--new", type=int, default=256, help="decoded tokens")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cache (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = small_llama(args.layers, args.hidden, args.heads, args.kv_heads, args.prompt + args.new + 1)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    for make in CACHES.values():  # warm-up
        run_once(model, make, prompt[:, :64], 8)

    runs = {name: [] for name in CACHES}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for name, make in CACHES.items():
            runs[name].append(run_once(model, make, prompt, args.new))

    reference = runs["DynamicCache"][0]["tokens"]
    results = {}
    for name, samples in runs.items():
        results[name] = {
            "prefill_s": statistics.median(s["prefill_s"] for s in samples),
            "decode_tok_s": statistics.median(s["decode_tok_s"] for s in samples),
            "payload_bytes": samples[0]["payload_bytes"],
            "headroom_bytes": samples[0]["headroom_bytes"],
            "payload_bytes_per_token": samples[0]["payload_bytes_per_token"],
            "same_tokens_as_DynamicCache": all(torch.equal(s["tokens"], reference) for s in samples),
        }
    base = results["DynamicCache"]["decode_tok_s"]
    for row in results.values():
        row["decode_speed_vs_DynamicCache"] = row["decode_tok_s"] / base

    print(
        f"\nsmall Llama: {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV heads; "
        f"prompt {args.prompt} + {args.new} new tokens; threads {torch.get_num_threads()}; "
        f"median of {args.repeats}"
    )
    header = (
        f"{'cache':<14}{'prefill s':>11}{'decode tok/s':>14}{'x Dynamic':>11}{'payload B':>12}{'headroom B':>12}"
        f"{'payload B/tok':>15}{'same tokens':>13}"
    )
    print(header)
    print("-" * len(header))
    for name, row in results.items():
        print(
            f"{name:<14}{row['prefill_s']:>11.3f}{row['decode_tok_s']:>14.1f}{row['decode_speed_vs_DynamicCache']:>11.2f}"
            f"{row['payload_bytes']:>12,}{row['headroom_bytes']:>12,}{row['payload_bytes_per_token']:>15.0f}"
            f"{str(row['same_tokens_as_DynamicCache']):>13}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**stamp(), "args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
