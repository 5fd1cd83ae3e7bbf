"""``kvplus plan``: weights + KV-cache memory of a model, one row per cache format.

    kvplus plan llama-3.1-8b --context 32768 --format fp16 int8 int4 int2 fp8 --memory 24GB
    kvplus plan llama-3.1-8b --format fp16 int4 k4v2 k3v2 --memory 80GB   # rotated formats: k<X>v<Y>

`register(subparsers)` adds the subcommand to a parser's subparsers; `run(args)` executes it and returns
the exit status (2, with the message on stderr, for inputs the planner refuses).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from ..errors import CapacityError, KVPlusError
from ..evaluation.report import stamp
from ..planner import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_RESIDUAL,
    KV_FORMATS,
    SHIPPED_CONFIGS,
    WEIGHT_BITS,
    Plan,
    format_bytes,
    kv_format,
    load_config,
    max_batch,
    max_context,
    parse_memory,
    plan,
)
from ..planning.units import format_count

#: Shown in the "max context" column when every layer is bounded and any context fits.
ANY_CONTEXT = "any (bounded KV)"
#: Shown in the fit columns when the weights alone exceed the memory.
WEIGHTS_TOO_BIG = "weights > memory"


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except KVPlusError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _format(text: str) -> str:
    """A KV format's canonical name (any rotated k<X>v<Y>, not only the listed ones)."""
    try:
        return kv_format(text).name
    except KVPlusError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def register(subparsers) -> argparse.ArgumentParser:
    """Adds the ``plan`` subcommand to `subparsers` (from ``parser.add_subparsers()``)."""
    parser = subparsers.add_parser(
        "plan",
        help="weights + KV-cache memory of a model, and the largest context or batch that fits",
        description=(
            "Weights + KV-cache bytes of MODEL at a context and batch, one row per cache format. MODEL is a "
            f"shipped config ({', '.join(SHIPPED_CONFIGS)}), a config.json or its folder, or a hub id. "
            "Sizes are printed in decimal units (GB = 10^9 bytes)."
        ),
    )
    parser.add_argument("model", metavar="MODEL", help="shipped config name, config.json / folder, or hub id")
    parser.add_argument("--context", type=int, default=32768, help="tokens per sequence (default 32768)")
    parser.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    parser.add_argument(
        "--format",
        dest="formats",
        nargs="+",
        default=["fp16"],
        type=_format,
        metavar="FORMAT",
        help=(
            f"KV cache format(s), several to compare: {', '.join(KV_FORMATS)}, or any rotated k<X>v<Y> "
            "(X-bit keys, Y-bit values, each 1, 2, 3, 4 or 8) (default fp16)"
        ),
    )
    defaults = ", ".join(f"{name} {size}" for name, size in DEFAULT_GROUP_SIZE.items())
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help=(
            "KIVI formats (int8/int4/int2/fp8, as QuantizedCache stores them): tokens per key group, "
            "channels per value group; must divide head_dim (default: the cache's, the gcd of "
            f"{defaults} with the head dims); the other formats (fp16..., rotated kXvY) have no groups and "
            "ignore it"
        ),
    )
    parser.add_argument(
        "--residual",
        type=int,
        default=DEFAULT_RESIDUAL,
        help=(
            "quantized formats (KIVI and rotated): most recent tokens kept at full precision, counted as fp16 "
            f"(default {DEFAULT_RESIDUAL}, the cache's window)"
        ),
    )
    parser.add_argument(
        "--first-tokens",
        type=int,
        default=None,
        help=(
            "quantized formats: first tokens of each row of full-attention layers kept at full precision (default: "
            "the preset's, as QuantizedCache keeps them: 4 for k4v2, k3v2 and k2v2, 0 otherwise and with --budget)"
        ),
    )
    parser.add_argument("--budget", type=int, default=None, help="eviction budget: tokens kept per layer")
    parser.add_argument("--weights-dtype", default="bf16", choices=list(WEIGHT_BITS), help="default bf16")
    parser.add_argument(
        "--memory",
        type=_memory,
        default=None,
        help="memory to fit, e.g. 24GB (10^9 bytes) or 24GiB (2^30 bytes): adds the largest context, batch",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (tp_plan): every figure is then one rank's, memory included (default 1)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the plans as JSON (-: stdout)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Prints the table (and writes the JSON); returns 0, or 2 with a message on stderr."""
    try:
        rows = _rows(args)
    except KVPlusError as error:
        print(f"kvplus plan: error: {error}", file=sys.stderr)
        return 2
    print(_table(args, rows))
    if args.json is not None:
        document = {
            **stamp(),
            "model": rows[0][0].model,
            "memory_bytes": args.memory,
            "plans": [_record(*row) for row in rows],
        }
        text = json.dumps(document, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


def _first_note(plans: list[Plan]) -> str:
    """"and the first N of each row (full-attention layers) " for the plans that keep exact first tokens."""
    kept = [p for p in plans if p.first_tokens]
    if not kept:
        return ""
    counts = sorted({p.first_tokens for p in kept})
    which = "" if len(kept) == len(plans) else f" ({'/'.join(p.kv_format for p in kept)})"
    return f"and the first {'/'.join(map(str, counts))} of each row{which} "


def _rows(args) -> list[tuple[Plan, int | str | None, int | str | None]]:
    """(plan, largest context, largest batch) per format; the fits are None without --memory."""
    config = load_config(args.model)
    options = dict(group_size=args.group_size, residual=args.residual, budget=args.budget, first_tokens=args.first_tokens)
    options["weights_dtype"] = args.weights_dtype
    options["tp"] = args.tp
    rows = []
    for fmt in dict.fromkeys(args.formats):
        row_plan = plan(config, args.context, args.batch, kv_format=fmt, **options)
        context_fit = batch_fit = None
        if args.memory is not None:
            try:
                context_fit = max_context(config, args.memory, args.batch, kv_format=fmt, **options)
                context_fit = ANY_CONTEXT if context_fit is None else context_fit
                if args.context > 0:
                    batch_fit = max_batch(config, args.memory, args.context, kv_format=fmt, **options)
            except CapacityError:
                context_fit = batch_fit = WEIGHTS_TOO_BIG
        rows.append((row_plan, context_fit, batch_fit))
    return rows


def _record(row_plan: Plan, context_fit, batch_fit) -> dict:
    record = row_plan.to_dict()
    if context_fit is not None:
        record["weights_fit"] = context_fit != WEIGHTS_TOO_BIG
        record["max_context_unbounded"] = context_fit == ANY_CONTEXT
        record["max_context"] = context_fit if isinstance(context_fit, int) else None
        record["max_batch"] = batch_fit if isinstance(batch_fit, int) else 0 if batch_fit else None
    return record


def _summary(first: Plan) -> str:
    kinds = ", ".join(
        f"{k.num_layers} {k.kind}" + (f" (window {k.window:,})" if k.window else "")
        for k in first.layer_kinds
    )
    shapes = sorted({(k.num_kv_heads, k.head_dim) for k in first.layer_kinds})
    heads = ", ".join(f"{kv} KV head{'s' if kv > 1 else ''} x head_dim {hd}" for kv, hd in shapes)
    layers = sum(k.num_layers for k in first.layer_kinds)
    budget = f"; eviction budget {first.budget:,} tokens" if first.budget else ""
    budget += f"; per rank of tp={first.tp} (KV heads and weights split)" if first.tp > 1 else ""
    return (
        f"{first.model} ({first.model_type}): {layers} KV layers: {kinds}; {heads}; "
        f"{first.num_parameters:,} parameters ({first.num_parameters / 1e9:.2f}B), "
        f"weights in {first.weights_dtype}{budget}"
    )


def _table(args, rows) -> str:
    first = rows[0][0]
    header = ["model", "format", "context", "batch", "KV B/token", "excl. window", "vs fp16"]
    header += ["KV total", "weights", "total"]
    if args.memory is not None:
        header += [f"max context @ batch {args.batch:,}", f"max batch @ {args.context:,}"]
    table, beyond = [header], False
    for row_plan, context_fit, batch_fit in rows:
        cells = [
            row_plan.model,
            row_plan.kv_format,
            f"{row_plan.context:,}",
            f"{row_plan.batch:,}",
            format_count(row_plan.kv_bytes_per_token),
            format_count(row_plan.kv_bytes_per_token_excl_residual),
            f"{row_plan.ratio_to_fp16:.3f}",
            format_bytes(row_plan.kv_bytes),
            format_bytes(row_plan.weights_bytes),
            format_bytes(row_plan.total_bytes),
        ]
        if args.memory is not None:
            limit = row_plan.max_position_embeddings
            star = isinstance(context_fit, int) and limit is not None and context_fit > limit
            beyond |= star
            context_text = context_fit
            if isinstance(context_fit, int):
                context_text = f"{context_fit:,}" + ("*" if star else "")
            batch_text = f"{batch_fit:,}" if isinstance(batch_fit, int) else "0" if batch_fit else "-"
            cells += [context_text, batch_text]
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = [_summary(first)]
    for r in table:
        cells = (c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines + [""] + _notes(args, rows, first, beyond))


def _notes(args, rows, first: Plan, beyond: bool) -> list[str]:
    notes = [
        "KV B/token: KV bytes / (batch x context) at this context, everything included. excl. window: one "
        "token held by every KV layer, in the storage format, scales included, fp16 recent window excluded; "
        "vs fp16: that over fp16."
    ]
    quantized = [r[0] for r in rows if r[0].group_size]
    if quantized:
        groups = ", ".join(f"{p.kv_format} {p.group_size}" for p in quantized)
        kinds = []
        if any(p.kv_format != "fp8" for p in quantized):
            kinds.append("int formats asymmetric with an fp16 scale and zero point per group")
        if any(p.kv_format == "fp8" for p in quantized):
            kinds.append("fp8 e4m3 with an fp16 scale per group (no zero point)")
        notes.append(
            f"{'/'.join(p.kv_format for p in quantized)}: as QuantizedCache stores them, KIVI groups of G "
            f"({groups}): keys per channel over groups of G tokens, values per token over groups of G "
            f"channels; {'; '.join(kinds)}; the last {args.residual} tokens {_first_note(quantized)}at full "
            "precision, counted as fp16."
        )
    rotated = [r[0] for r in rows if kv_format(r[0].kv_format).is_rotated]
    if rotated:
        ignored = " (--group-size does not apply)" if args.group_size is not None else ""
        notes.append(
            f"{'/'.join(p.kv_format for p in rotated)}: rotated (TurboQuant class), as QuantizedCache stores "
            "them: kXvY codes every key with X and every value with Y bits per channel after a seeded rotation, "
            f"plus one fp16 norm per vector, no groups{ignored}; the last {args.residual} tokens "
            f"{_first_note(rotated)}at full precision, counted as fp16."
        )
    lossy = [p.kv_format + (" with eviction" if p.budget else "") for p in (r[0] for r in rows)
             if kv_format(p.kv_format).kind != "float" or p.budget]  # fmt: skip
    if lossy:
        notes.append(
            f"quality: {', '.join(dict.fromkeys(lossy))}: lossy; the perplexity costs the docs quote are "
            "SmolLM2-135M's unless they name another model, and other families can lose several times more: measure "
            "yours with `kvplus check-formats --model MODEL --text YOUR_TEXT`."
        )
    if args.memory is not None:
        notes.append(
            f"memory: {format_bytes(args.memory)} ({args.memory:,} bytes) for weights + KV"
            f"{f' on each of {args.tp} ranks' if args.tp > 1 else ''}; activations, "
            "runtime and allocator overhead are not counted."
        )
    if beyond:
        notes.append(f"*: beyond the model's {first.max_position_embeddings:,} trained positions.")
    if any(r[1] == ANY_CONTEXT for r in rows):
        notes.append(f"{ANY_CONTEXT}: every layer is bounded by its window or budget; the full cache fits.")
    notes.append("GB = 10^9 bytes.")
    return [textwrap.fill(note, width=110, subsequent_indent="  ") for note in notes]
