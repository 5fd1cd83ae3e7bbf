"""Evaluation: perplexity on long texts and benchmarks of caches, with tables, JSON and plots."""

from .benchmark import BenchResult, benchmark, plot_bench
from .perplexity import MODES, PerplexityResult, cache_free_nll, perplexity, plot_perplexity
from .report import format_table, stamp

__all__ = [
    "MODES",
    "BenchResult",
    "PerplexityResult",
    "benchmark",
    "cache_free_nll",
    "format_table",
    "perplexity",
    "plot_bench",
    "plot_perplexity",
    "stamp",
]
