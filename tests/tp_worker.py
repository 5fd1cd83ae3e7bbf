"""One rank of the tensor-parallel test (`test_tensor_parallel.py` runs it under `torchrun --nproc-per-node 2`).

argv: the saved tiny model's folder, the JSON file rank 0 writes, then cache specs. Each rank loads the model
with `tp_plan="auto"` (its share of the KV heads) and, for comparison, unsharded. Per spec, rank 0 records: the
greedy tokens under TP, with DynamicCache under TP, and with the same cache on the unsharded model; and the KV
payload bytes the cache holds on this rank and unsharded.
"""

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DynamicCache

from hf_kvplus import cache_kwargs
from hf_kvplus.specs import parse_cache_spec

NEW_TOKENS = 24


def generate(model, ids, cache):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **cache_kwargs(cache))[0].tolist()


def main(folder: str, out: str, specs: list[str]) -> None:
    sharded = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32)
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(0)
    ids = torch.randint(3, sharded.config.vocab_size, (1, 72))
    max_length = ids.shape[1] + NEW_TOKENS
    rows = {"dynamic": generate(sharded, ids, DynamicCache(config=sharded.config)), "caches": {}}
    for text in specs:
        spec = parse_cache_spec(text)
        cache, alone = spec.build(sharded.config, max_length), spec.build(whole.config, max_length)
        rows["caches"][text] = {
            "lossless": spec.lossless,
            "tp": generate(sharded, ids, cache),
            "unsharded": generate(whole, ids, alone),
            "tp_payload_bytes": cache.memory_report().payload_bytes,
            "unsharded_payload_bytes": alone.memory_report().payload_bytes,
        }
    rows["world_size"] = dist.get_world_size()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
