"""Arguments and steps the `kvplus` subcommands share: model, text, threads, output folder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..errors import ConfigError
from ..evaluation.report import stamp
from ..specs import parse_cache_spec

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_TEXT = "austen:prideprejudice"


def add_model_args(parser: argparse.ArgumentParser, text: bool = True) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"built-in name (smollm2-135m, gemma3-270m), local folder or hub id (default {DEFAULT_MODEL})")
    if text:
        parser.add_argument("--text", default=DEFAULT_TEXT,
                            help=f"austen:<book>, a local file or hf:<dataset>[:config][:split] (default {DEFAULT_TEXT})")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=None, help="folder for JSON, CSV and plots")


def add_cache_args(parser: argparse.ArgumentParser, default: list[str] | None) -> None:
    parser.add_argument("--cache", dest="caches", action="append", default=None, metavar="SPEC",
                        help="cache spec, repeatable; the first is the baseline (e.g. dynamic, dense, "
                             "hf-quantized:quanto:4)" + (f"; default {' '.join(default)}" if default else ""))


def cache_specs(args, default: list[str]):
    return [parse_cache_spec(text) for text in (args.caches or default)]


def setup(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def load(args, text: bool = True):
    """(model, tokenizer, text or None) as the arguments name them."""
    from ..resolve import load_model, load_text

    model, tokenizer = load_model(args.model)
    return model, tokenizer, (load_text(args.text) if text else None)


def tokenize(tokenizer, text: str, tokens: int) -> torch.Tensor:
    """The first `tokens` token ids of `text` (1-d)."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    return ids[:tokens]


def scored_tokens(tokenizer, text: str, tokens: int) -> torch.Tensor:
    """The first `tokens` token ids of `text`, refused when the text is shorter: a figure quoted for N tokens is
    measured on N."""
    ids = tokenize(tokenizer, text, tokens)
    if ids.numel() < tokens:
        raise ConfigError(f"--tokens {tokens} asks for more than the text holds: {ids.numel()} tokens")
    return ids


def passages(tokenizer, text: str, tokens: int, batch: int) -> torch.Tensor:
    """`[batch, tokens]`: consecutive passages of `text`, one per row, so that a batch holds distinct prompts (one
    prompt repeated would let a cache that shares or dedups rows look better than it is)."""
    ids = tokenize(tokenizer, text, batch * tokens)  # all of the text where it is shorter
    if ids.numel() < batch * tokens:
        raise ConfigError(
            f"the text has {ids.numel()} tokens; {batch} distinct prompts of {tokens} tokens need {batch * tokens}"
        )
    return ids[: batch * tokens].view(batch, tokens)


def out_dir(args, default: str) -> Path:
    folder = args.out or Path("kvplus-results") / default
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps({**stamp(), **data}, indent=2, default=str))
