"""Peak memory per phase of bench_e2e_gpu's run, and the attention each layer takes: where a cache's peak comes from.

    python eval/peak_phases_gpu.py --out gpu-pass                 # paged and quantized:int4 x DynamicCache, 16K, B=8
    python eval/peak_phases_gpu.py --out /tmp/p --dry-run         # CPU check: the tiny model

The same model, prompt and chunked prefill as `bench_e2e_gpu.py` (its `build_model`), one spec after another. Per
phase (the prefill; the first decode step, which compiles its kernels; the later steps): the peak of the CUDA
allocator above where the phase started and the milliseconds per forward, next to the cache's bytes at rest and one
layer's dense K/V (what SDPA reads in a prefill chunk), so a prefill peaking near at rest + one layer frees each
layer's gathered copy with the layer; the calls `attention.route` makes (a decode kernel, or SDPA over a gathered
copy); and the objects Python's cycle collector found unreachable (a read left in a reference cycle shows there).
Sized (4 layers) to take well under a minute on a GPU; not yet run on one.
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import time

import torch
from bench_e2e_gpu import build_model, free_memory
from gpu_common import add_common_args, prepare, write_step

STEP = "peak_phases"
ROUTES = ("decode_attention", "paged_decode_attention", "quantized_decode_attention", "sdpa_attention_forward",
          "slot_decode", "slot_prefill")  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=4, help="decode steps: the first, then the later ones")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--specs", nargs="+", default=["dynamic", "paged", "quantized:int4"])
    args = p.parse_args(argv)
    if args.dry_run:
        args.context, args.prefill_chunk, args.new_tokens = 64, 32, 3
    return args


class Phases:
    """Peak memory above each phase's start (CUDA allocator; None on the CPU), route calls and cyclic garbage."""

    def __init__(self, device):
        self.device, self.rows, self.calls = device, {}, collections.Counter()

    def start(self):
        self.calls.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated() if self.device.type == "cuda" else None
        self.began = time.perf_counter()

    def end(self, name, forwards):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - self.began) * 1e3 / forwards
        peak = torch.cuda.max_memory_allocated() - self.base if cuda else None
        self.rows[name] = dict(peak_mib=None if peak is None else peak / 2**20, ms_per_forward=ms,
                               calls=dict(self.calls), cyclic_garbage=gc.collect())  # fmt: skip


def counting(phases):
    """Wraps the route's kernel and SDPA calls so that each is counted by name."""
    from hf_kvplus.attention import route

    for name in ROUTES:
        fn = getattr(route, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            phases.calls[_name] += 1
            return _fn(*args, **kwargs)

        setattr(route, name, counted)


@torch.inference_mode()
def main(argv=None) -> None:
    args = parse_args(argv)
    device = prepare(args.dry_run, "peak_phases_gpu.py")
    from hf_kvplus.evaluation.report import stamp
    from hf_kvplus.memory import cache_bytes
    from hf_kvplus.specs import parse_cache_spec
    from hf_kvplus.transformers_compat import cache_kwargs

    model = build_model(args, device)
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.context), generator=torch.Generator().manual_seed(8))
    prompt = prompt.to(device)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layer_kv = 2 * args.batch * cfg.num_key_value_heads * (args.context + args.new_tokens) * head_dim * model.dtype.itemsize
    phases = Phases(device)
    counting(phases)
    result = {**stamp(), "dry_run": args.dry_run, "args": vars(args), "layer_kv_mib": layer_kv / 2**20, "rows": []}
    for text in args.specs:
        cache = parse_cache_spec(text).build(cfg, max_length=args.context + args.new_tokens + 1)

        def step(ids, cache=cache):
            return model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)

        phases.rows = {}
        phases.start()
        for first in range(0, args.context, args.prefill_chunk):
            token = step(prompt[:, first : first + args.prefill_chunk])
        phases.end("prefill", -(-args.context // args.prefill_chunk))
        phases.start()
        token = step(token)
        phases.end("first decode step", 1)
        phases.start()
        for _ in range(args.new_tokens - 1):
            token = step(token)
        phases.end("later decode steps", args.new_tokens - 1)
        result["rows"].append({"cache": text, "at_rest_mib": cache_bytes(cache) / 2**20, "phases": phases.rows})
        print(text, result["rows"][-1], file=sys.stderr)
        del cache, step
        free_memory(device)
        write_step(args.out, STEP, result, markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    lines = [f"## Peak per phase (MiB above the phase's start; one layer's dense K/V: {result['layer_kv_mib']:,.1f})",
             "", "| cache | at rest | phase | peak | ms per forward | route calls | cyclic garbage |",
             "| --- | ---: | --- | ---: | ---: | --- | ---: |"]  # fmt: skip
    for row in result["rows"]:
        for name, phase in row["phases"].items():
            peak = "-" if phase["peak_mib"] is None else f"{phase['peak_mib']:,.0f}"
            calls = ", ".join(f"{k} {v}" for k, v in sorted(phase["calls"].items()))
            lines.append(f"| {row['cache']} | {row['at_rest_mib']:,.0f} | {name} | {peak} | {phase['ms_per_forward']:.1f} | "
                         f"{calls} | {phase['cyclic_garbage']} |")  # fmt: skip
    return "\n".join(lines + [""])


if __name__ == "__main__":
    main()
