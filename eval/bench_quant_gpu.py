"""GPU benchmarks of the quantized cache (CUDA only), baselines measured in the same run.

1. Kernel: the fused int4 (and int8/int2/fp8) decode-attention kernel reading packed codes in place,
   against SDPA over fp16 K/V holding the same tokens, at 8K and 32K context: time, K/V bytes read
   per step and achieved GB/s (bytes read / time), and the dequantized result checked against a
   float64 reference first.
2. End to end: decode tokens/s of a Llama-3.1-8B-shaped model with random bf16 weights, batch 8,
   16K context: QuantizedCache int4 against DynamicCache and Transformers' QuantizedCache (quanto,
   int4). The goal: int4 faster than bf16 DynamicCache at that size.

    python eval/bench_quant_gpu.py --out eval/results/quant_gpu.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="path of the JSON file to write")
    p.add_argument("--contexts", default="8192,32768", help="kernel benchmark context lengths")
    p.add_argument("--formats", default="4,8,2,fp8", help="kernel benchmark formats")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--e2e-context", type=int, default=16384)
    p.add_argument("--e2e-new", type=int, default=32, help="decoded tokens per end-to-end run")
    p.add_argument("--e2e-layers", type=int, default=32, help="layers of the 8B-shaped model (fewer: faster)")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, in ms")
    p.add_argument("--rep", type=int, default=200, help="do_bench measuring time, in ms")
    return p.parse_args(argv)


def progress(items, desc):
    from tqdm import tqdm

    return tqdm(items, desc=desc, file=sys.stderr)


def packed_cache(B, Hkv, N, D, fmt, dtype):
    """Random K/V of N tokens quantized into dense PackedKV buffers; returns (packed, dequantized K, V)."""
    from hf_kvplus.kernels.quant_format import PackedKV, dequantize_keys, dequantize_values
    from hf_kvplus.kernels.quant_pack import quantize_keys, quantize_values

    k = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype)
    kc, ks, kz = quantize_keys(k, fmt)
    vc, vs, vz = quantize_values(v, fmt)
    packed = PackedKV(kc, ks, kz, vc, vs, vz)
    return packed, dequantize_keys(kc, ks, kz, fmt, dtype), dequantize_values(vc, vs, vz, fmt, dtype)


def kernel_rows(args):
    import triton.testing

    from hf_kvplus.kernels.quant_attention import quantized_decode_attention_triton
    from hf_kvplus.kernels.quant_format import QuantFormat
    from hf_kvplus.quantized_cache import DEFAULT_GROUP, parse_bits

    B, Hq, Hkv, D = args.batch, args.q_heads, args.kv_heads, args.head_dim
    rows, checks = [], []
    jobs = [(int(n), parse_bits(f)) for n in args.contexts.split(",") for f in args.formats.split(",")]
    for N, bits in progress(jobs, "kernel"):
        fmt = QuantFormat(bits, DEFAULT_GROUP[bits])
        packed, k, v = packed_cache(B, Hkv, N, D, fmt, torch.float16)
        q = torch.randn(B, Hq, D, device="cuda", dtype=torch.float16)
        scale = 1 / math.sqrt(D)
        out = quantized_decode_attention_triton(q, packed, fmt, start=0, length=N, scale=scale)
        G = Hq // Hkv
        kd, vd = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
        ref = torch.softmax(torch.einsum("bhd,bhnd->bhn", q.double(), kd) * scale, -1)
        ref = torch.einsum("bhn,bhnd->bhd", ref, vd)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        checks.append({"N": N, "format": str(fmt), "rel_err": err, "ok": err < 2e-3})
        del kd, vd, ref
        q4 = q[:, :, None]
        quant_bytes = sum(t.numel() * t.element_size() for t in vars(packed).values() if t is not None)
        fp16_bytes = k.numel() * 2 * 2
        fused = functools.partial(quantized_decode_attention_triton, q, packed, fmt, start=0, length=N, scale=scale)
        sdpa = functools.partial(F.scaled_dot_product_attention, q4, k, v, scale=scale, enable_gqa=True)
        ms_q = triton.testing.do_bench(fused, warmup=args.warmup, rep=args.rep, return_mode="median")
        ms_s = triton.testing.do_bench(sdpa, warmup=args.warmup, rep=args.rep, return_mode="median")
        for impl, ms, nbytes in (("fused " + str(fmt), ms_q, quant_bytes), ("sdpa fp16", ms_s, fp16_bytes)):
            rows.append({"N": N, "B": B, "impl": impl, "time_us": ms * 1e3, "kv_bytes": nbytes,
                         "gb_per_s": nbytes / (ms * 1e-3) / 1e9, "speedup_vs_sdpa": ms_s / ms})
        del packed, k, v, fused, sdpa
        torch.cuda.empty_cache()
    return rows, checks


def llama8b(layers):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


@torch.inference_mode()
def e2e_rows(args):
    from transformers import DynamicCache
    from transformers import QuantizedCache as HFQuantizedCache

    from hf_kvplus import QuantizedCache

    model = llama8b(args.e2e_layers)
    caches = {
        "DynamicCache bf16": lambda: DynamicCache(config=model.config),
        "hf_kvplus int4": lambda: QuantizedCache(model.config, bits=4),
        "Transformers QuantizedCache quanto int4": lambda: HFQuantizedCache(backend="quanto", config=model.config, nbits=4),
    }
    prompt = torch.randint(0, 32000, (args.batch, args.e2e_context), device="cuda")
    rows = []
    for name, make in progress(list(caches.items()), "end to end"):
        cache = make()
        try:
            for start in range(0, args.e2e_context, 2048):  # chunked prefill keeps activations small
                logits = model(prompt[:, start : start + 2048], past_key_values=cache).logits[:, -1:]
            token = logits.argmax(-1)
            times = []
            for _ in range(args.e2e_new):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            step = statistics.median(times[2:])
            from hf_kvplus.memory import cache_bytes

            rows.append({"cache": name, "decode_step_ms": step * 1e3, "tok_per_s": args.batch / step,
                         "cache_bytes": cache_bytes(cache), "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
        except torch.OutOfMemoryError as exc:
            rows.append({"cache": name, "error": f"out of memory: {exc}".splitlines()[0]})
        del cache
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = rows[0].get("tok_per_s")
    for row in rows:
        if base and "tok_per_s" in row:
            row["speed_vs_dynamic"] = row["tok_per_s"] / base
    return rows


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_quant_gpu.py needs a CUDA device")
    import transformers
    import triton

    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    props = torch.cuda.get_device_properties(0)
    rows, checks = kernel_rows(args)
    e2e = [] if args.skip_e2e else e2e_rows(args)
    print(f"\n{props.name}, torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
    for c in checks:
        print(f"  check N={c['N']} {c['format']}: rel err {c['rel_err']:.2e} {'ok' if c['ok'] else 'FAIL'}")
    print(f"\n{'N':>6} {'impl':22} {'time us':>9} {'MB read':>9} {'GB/s':>7} {'x sdpa':>7}")
    for r in rows:
        print(f"{r['N']:6d} {r['impl']:22} {r['time_us']:9.1f} {r['kv_bytes'] / 1e6:9.1f} {r['gb_per_s']:7.0f} "
              f"{r['speedup_vs_sdpa']:7.2f}")
    for r in e2e:
        print(r)
    result = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "python": platform.python_version(),
              "args": vars(args), "accuracy": checks, "kernel": rows, "end_to_end": e2e}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")
    if not all(c["ok"] for c in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
