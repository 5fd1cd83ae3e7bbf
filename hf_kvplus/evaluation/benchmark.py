"""Prefill time, time to first token, decode speed and memory of caches, measured in one run.

Each cache runs a greedy prefill + decode loop through `model(..., **cache_kwargs(cache))`; caches
alternate within each repeat after a warm-up, and the medians are reported with the first spec
(the baseline) measured in the same run. Bytes at rest are read off the cache after the run;
peak memory is how far the run took the CUDA allocator (GPU) or the process's RSS (CPU) above
where it started, so it counts the cache and the activations, not the weights.
"""

from __future__ import annotations

import json
import statistics
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..memory import cache_bytes
from ..specs import CacheSpec
from ..transformers_compat import cache_kwargs


@dataclass
class BenchResult:
    """Medians over the repeats of one cache spec."""

    cache: str
    prefill_s: float
    ttft_s: float
    decode_tok_s: float
    bytes_at_rest: int
    bytes_per_token: float
    peak_bytes: int | None
    decode_vs_baseline: float = 1.0
    same_tokens_as_baseline: bool = True


def _proc_status(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _start_peak(device: torch.device) -> int | None:
    """Resets the peak and returns the memory in use now (CUDA allocator, or RSS on Linux)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:  # Linux: writing 5 resets the process's peak RSS (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _proc_status("VmRSS")


def _peak_since(device: torch.device, start: int | None) -> int | None:
    """How far above `start` memory went during the run."""
    if start is None:
        return None
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _proc_status("VmHWM")
    return None if peak is None else max(0, peak - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def run_once(
    model: PreTrainedModel, spec: CacheSpec, prompt: torch.Tensor, new_tokens: int, prefill_chunk: int | None = None
) -> dict:
    """One prefill + `new_tokens` greedy steps; timings, bytes read off the cache, peak memory, tokens.

    `prefill_chunk` feeds the prompt that many tokens per forward (None: one forward), which bounds the
    activations of long prompts; only the last position's logits are computed.
    """
    device = prompt.device
    cache = spec.build(model.config, max_length=prompt.shape[1] + new_tokens + 1)
    memory_start = _start_peak(device)

    def step(input_ids):
        logits = model(input_ids=input_ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits
        return logits[:, -1:].argmax(-1)

    chunk = prefill_chunk or prompt.shape[1]
    start = time.perf_counter()
    for first in range(0, prompt.shape[1], chunk):
        token = step(prompt[:, first : first + chunk])
    _sync(device)
    prefill = time.perf_counter() - start
    tokens = [token]
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = step(token)
        tokens.append(token)
    _sync(device)
    decode = time.perf_counter() - start
    nbytes = cache_bytes(cache)
    return {
        "prefill_s": prefill,
        "ttft_s": prefill,  # the first token comes out of the prefill's last logits
        "decode_tok_s": new_tokens / decode,
        "bytes_at_rest": nbytes,
        # int(): StaticCache gives its length as a tensor, which would make this one (and write it to JSON as text)
        "bytes_per_token": nbytes / (prompt.shape[0] * int(cache.get_seq_length())),
        "peak_bytes": _peak_since(device, memory_start),
        "tokens": torch.cat(tokens, dim=1).cpu(),
    }


def benchmark(
    model: PreTrainedModel,
    prompt: torch.Tensor,
    specs: list[CacheSpec],
    *,
    new_tokens: int = 64,
    repeats: int = 3,
    warmup: int = 1,
    progress: bool = True,
) -> list[BenchResult]:
    """Benchmarks every spec on `prompt` (`[batch, tokens]`); `specs[0]` is the baseline."""
    for _ in range(warmup):
        for spec in specs:
            run_once(model, spec, prompt[:, : min(32, prompt.shape[1])], 4)
    samples = {spec.text: [] for spec in specs}
    for _ in tqdm(range(repeats), desc="bench repeats", disable=not progress, leave=False):
        for spec in specs:
            samples[spec.text].append(run_once(model, spec, prompt, new_tokens))
    baseline = samples[specs[0].text]
    results = []
    for spec in specs:
        runs = samples[spec.text]
        results.append(
            BenchResult(
                cache=spec.text,
                prefill_s=statistics.median(r["prefill_s"] for r in runs),
                ttft_s=statistics.median(r["ttft_s"] for r in runs),
                decode_tok_s=statistics.median(r["decode_tok_s"] for r in runs),
                bytes_at_rest=runs[-1]["bytes_at_rest"],
                bytes_per_token=runs[-1]["bytes_per_token"],
                peak_bytes=max((r["peak_bytes"] for r in runs if r["peak_bytes"] is not None), default=None),
                same_tokens_as_baseline=all(torch.equal(r["tokens"], baseline[0]["tokens"]) for r in runs),
            )
        )
    base_speed = results[0].decode_tok_s
    for result in results:
        result.decode_vs_baseline = result.decode_tok_s / base_speed
    return results


BENCH_COLUMNS = [
    ("cache", "cache", ""),
    ("prefill_s", "prefill s", ".3f"),
    ("ttft_s", "TTFT s", ".3f"),
    ("decode_tok_s", "decode tok/s", ".1f"),
    ("decode_vs_baseline", "x baseline", ".2f"),
    ("bytes_at_rest", "bytes at rest", ","),
    ("bytes_per_token", "bytes/token", ",.0f"),
    ("peak_bytes", "peak extra bytes", ","),
    ("same_tokens_as_baseline", "same tokens", ""),
]


def write_results(results: list[BenchResult], path: str | Path, meta: dict) -> None:
    Path(path).write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=2))


def plot_bench(results: list[BenchResult], path: str | Path, title: str = "") -> None:
    """Two bars per cache: decode speed and bytes per token, each relative to the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["\n".join(textwrap.wrap(r.cache, 36, break_on_hyphens=False)) for r in results]  # specs with paths are long
    lines = sum(name.count("\n") + 1 for name in names)
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, max(4.0, 1.5 + 0.3 * lines)), sharey=True)
    left.barh(names, [r.decode_tok_s for r in results])
    left.set_xlabel("decode tokens/s")
    right.barh(names, [r.bytes_per_token for r in results])
    right.set_xlabel("bytes at rest per token")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
