"""Evaluation: perplexity on long texts, needle retrieval and benchmarks of caches, what a lossy cache costs the
model at hand (`check_formats`), with tables, JSON and plots."""

from .benchmark import BenchResult, benchmark, plot_bench
from .format_check import FormatCheck, FormatCost, check_formats
from .needle import (
    KeptShare,
    NeedleResult,
    NeedleTrial,
    needle_grid,
    passkey_prompt,
    plot_accuracy_bytes,
    plot_needle,
)
from .perplexity import MODES, PerplexityResult, cache_free_nll, perplexity, plot_perplexity
from .report import format_table, stamp
from .retrieval_tasks import TASKS, RetrievalTask, retrieval_task

__all__ = [
    "MODES",
    "TASKS",
    "BenchResult",
    "FormatCheck",
    "FormatCost",
    "KeptShare",
    "NeedleResult",
    "NeedleTrial",
    "PerplexityResult",
    "RetrievalTask",
    "benchmark",
    "cache_free_nll",
    "check_formats",
    "format_table",
    "needle_grid",
    "passkey_prompt",
    "perplexity",
    "plot_bench",
    "plot_accuracy_bytes",
    "plot_needle",
    "plot_perplexity",
    "retrieval_task",
    "stamp",
]
