"""The machine a GPU pass ran on, and its ceilings: device copy and pinned host-to-device bandwidth.

    python eval/gpu_env.py --out gpu-pass            # on the GPU
    python eval/gpu_env.py --out /tmp/p --dry-run    # CPU check (host memory copies)

The benchmarks that follow compare against these numbers: decode attention is memory-bound, so a
kernel is judged by the fraction of the device copy bandwidth it reaches; an offloaded cache by the
fraction of the pinned host-to-device bandwidth.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shutil
import statistics
import subprocess

import torch
from gpu_common import add_common_args, copy_gb_per_s, median_ms, prepare, write_step

STEP = "env"
PACKAGES = ("torch", "triton", "transformers", "accelerate", "optimum-quanto", "hf-kvplus")


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpu_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": f"CPU ({platform.processor() or platform.machine()})", "cores": os.cpu_count()}
    props = torch.cuda.get_device_properties(device)
    info = {
        "name": props.name,
        "capability": f"sm_{props.major}{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": props.total_memory / 2**30,
        "l2_mib": getattr(props, "L2_cache_size", 0) / 2**20,
        "cuda": torch.version.cuda,
    }
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"]
        info["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    return info


def pinned_bandwidth(nbytes: int, repeats: int) -> dict:
    """Host-to-device GB/s of pinned copies (median of `repeats`, CUDA events), and of one pageable copy
    for contrast: the ceiling an offloaded cache's per-step transfers are compared against."""
    source = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
    source.random_()
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target.copy_(source, non_blocking=True)  # warm-up: the copy engine and the pinned mapping
    rates = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(nbytes / (start.elapsed_time(end) * 1e-3) / 1e9)
    pageable = source.clone(memory_format=torch.contiguous_format)  # a plain (unpinned) host tensor
    pageable_ms = median_ms(lambda: target.copy_(pageable), torch.device("cuda"), 5, 50)
    back_ms = median_ms(lambda: source.copy_(target, non_blocking=True), torch.device("cuda"), 5, 50)
    return {
        "bytes": nbytes,
        "gb_per_s": statistics.median(rates),
        "max_gb_per_s": max(rates),
        "pageable_gb_per_s": nbytes / (pageable_ms * 1e-3) / 1e9,
        "device_to_pinned_gb_per_s": nbytes / (back_ms * 1e-3) / 1e9,
    }


def matmul_tflops(device: torch.device, n: int) -> float:
    """bf16 (CPU: float32) n x n x n product on random data: the compute ceiling, for context."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / (median_ms(lambda: a @ b, device) * 1e-3) / 1e12


def markdown(result: dict) -> str:
    gpu, bw = result["gpu"], result["bandwidth"]
    lines = [
        "## Environment",
        "",
        f"- device: {gpu['name']}" + (f", {gpu['capability']}, {gpu['sm_count']} SMs, {gpu['memory_gib']:.0f} GiB, "
                                      f"CUDA {gpu['cuda']}" if "capability" in gpu else ""),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v),
        f"- device copy bandwidth (read + write, {bw['copy_bytes'] / 2**30:.2f} GiB): {bw['copy_gb_per_s']:.0f} GB/s",
    ]
    pinned = bw.get("pinned")
    if pinned:
        lines += [
            f"- pinned host-to-device: {pinned['gb_per_s']:.1f} GB/s (median; max {pinned['max_gb_per_s']:.1f}), "
            f"pageable {pinned['pageable_gb_per_s']:.1f} GB/s, device-to-pinned {pinned['device_to_pinned_gb_per_s']:.1f} GB/s",
        ]
    else:
        lines.append("- pinned host-to-device: n/a (no CUDA)")
    lines.append(f"- dense matmul ({result['matmul_n']}^3): {result['matmul_tflops']:.3g} TFLOP/s")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--gib", type=float, default=1.0, help="size of each timed copy")
    parser.add_argument("--repeats", type=int, default=10, help="pinned copies timed")
    args = parser.parse_args(argv)
    device = prepare(args.dry_run, "gpu_env.py")
    nbytes = int((1 / 64 if args.dry_run else args.gib) * 2**30)
    from hf_kvplus.evaluation.report import stamp

    torch.manual_seed(0)
    result = {
        **stamp(),
        "dry_run": args.dry_run,
        "gpu": gpu_info(device),
        "versions": versions(),
        "bandwidth": {
            "copy_bytes": nbytes,
            "copy_gb_per_s": copy_gb_per_s(nbytes, device),
            "pinned": None if device.type != "cuda" else pinned_bandwidth(nbytes, args.repeats),
        },
        "matmul_n": 256 if args.dry_run else 8192,
    }
    result["matmul_tflops"] = matmul_tflops(device, result["matmul_n"])
    md = markdown(result)
    write_step(args.out, STEP, result, md)
    print(md)


if __name__ == "__main__":
    main()
