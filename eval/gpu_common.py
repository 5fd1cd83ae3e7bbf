"""What the GPU benchmarks share: the dry-run switch, timing, and how a step writes its result.

Every GPU benchmark in eval/ is one step of `scripts/gpu_pass.sh`. Each takes `--out DIR` and
`--dry-run`: the dry run is the same code at tiny sizes on the CPU (Triton kernels under the
interpreter), so CI runs every step and a script cannot rot between lent GPUs. A step writes
`DIR/<step>.json` (its stamp, arguments and rows) and `DIR/<step>.md` (the same as tables), which
`eval/gpu_pass_report.py` merges into the pass's one JSON and one Markdown file.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

#: Llama 3.1 8B's shape (the benchmarks build it with random weights: nothing is downloaded).
LLAMA_31_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, max_position_embeddings=131072,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip


def add_common_args(parser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="folder the step writes <step>.json/.md into")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes on the CPU (Triton under the interpreter): checks the script"
    )


def prepare(dry_run: bool, script: str) -> torch.device:
    """The device a step runs on; a dry run turns the Triton interpreter on before any kernel is imported."""
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA device (or --dry-run for the CPU check)")
    return torch.device("cuda")


def median_ms(fn: Callable[[], object], device: torch.device, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median milliseconds of `fn()`: CUDA events through triton's do_bench on a GPU; one host-timed run
    on the CPU (dry runs only, where kernels are interpreted: such a time says nothing about a GPU)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def copy_gb_per_s(nbytes: int, device: torch.device, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Device copy bandwidth over `nbytes`: (bytes read + bytes written) / time, the ceiling of a
    memory-bound kernel that reads `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.random_()  # not zeros: see METHOD.md
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup_ms, rep_ms)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN if `out` holds a non-finite value."""
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return ((out.double() - ref).norm() / ref.norm()).item()


def write_step(out: Path, step: str, result: dict, markdown: str) -> None:
    """`out/<step>.json` and `out/<step>.md`; called after every row, so a step cut off by its time limit
    still leaves what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{step}.json").write_text(json.dumps(result, indent=2, default=str))
    (out / f"{step}.md").write_text(markdown)
