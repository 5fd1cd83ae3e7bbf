"""hf_kvplus's rotated K/V formats, as they ship, against tiny-turboquant 0.18.0's `TinyKVCache` drop-in cache, on
one protocol (eval/lowbit_compare.py: 4096 tokens of Pride and Prejudice, SmolLM2-135M, window 128, chunks of 32 and
256; hf_kvplus over seeds 0 1 2, tiny-turboquant has no randomness).

    bash scripts/reference_venv.sh tiny-turboquant /tmp/tinyvenv   # once: tiny-turboquant in its own venv
    /tmp/tinyvenv/bin/python eval/compare_tiny_turboquant.py --out eval/results/compare_tiny_turboquant \
        --reuse eval/results/lowbit_regions_fixed_centre/runs.jsonl   # or a part: --chunks, --configs, --seeds (eval/README.md)
    /tmp/tinyvenv/bin/python eval/compare_tiny_turboquant.py --out eval/results/compare_tiny_turboquant --report-only
    /tmp/tinyvenv/bin/python eval/compare_tiny_turboquant.py --dry-run --out /tmp/tiny_dry   # every row, tiny
    python eval/compare_tiny_turboquant.py --ours-only --dry-run --out /tmp/tiny_dry         # without it

What tiny-turboquant's cache does (read from tiny_turboquant/cache.py and affine.py): KIVI-style affine integer
codes, no rotation. New tokens join a full-precision residual (the model's dtype); whenever it holds `residual_len +
block_size` tokens (128 + 128) or more, its oldest block of 128 is quantized, before the forward attends: keys per
channel over the block's 128 tokens, values per token over all channels (or groups of `value_group_size`), with a
float16 scale and zero point each, codes bit-packed (2, 3 or 4 bits). Every `update` dequantizes the whole tail and
returns it with the residual: quantization comes before attention, and a chunk attends exact to the newest 128 to
255 tokens only, its own included (a chunk of 256 after a residual of 128 sees the past's window and its own first
128 tokens quantized; a prompt forwarded at once attends to itself quantized but for its last 128 to 255 tokens).
`protect_first` / `protect_last` keep whole layers at full precision (0 in every preset). Its presets
(`TinyKVCache(compression=...)`): safe K4V4, balanced K4V3, compact K3V3 (values per token), aggressive K3V2 with
value groups of 32; and `recommend_bits(mode="storage")` gives K4V2 (raw `key_bits=4, value_bits=2`, values per
token) to a model whose key norms are 8 times its value norms. Where hf_kvplus differs: it rotates each head vector
and codes it with a Lloyd-Max codebook and one float16 norm (keys about a per-head centre turning with RoPE), gives
each query its own window exact (a chunk of n sees the newest `window + n - 1` tokens at full precision, the past's
window included), and its k4v2 and k3v2 presets keep the 4 first tokens exact.

Rows, by `--configs` name: `tiny:<preset>` (`TinyKVCache.for_model(model, compression=preset)`), `tiny:k<X>v<Y>`
(`key_bits=X, value_bits=Y`), with `+protect<N>` (`protect_first=N, protect_last=N`); `kXvY`: hf_kvplus
`QuantizedCache(bits="kXvY", window, rotation_seed=s)` as it ships (k4v2, k3v2: 4 exact first tokens; the keys'
centre turning with RoPE), over `--seeds`.
Transformers 5.24's attention calls `cache.update(k, v, layer_idx, kwargs=...)`, which `TinyKVCache.update` (no
`**kwargs`) refuses with a TypeError; the rows use a subclass whose `update` drops that argument (it held nothing
`TinyKVCache` reads) and changes nothing else.

Bits per coordinate, counted as for hf_kvplus (eval/lowbit_compare.py): over every token outside the residual
window, the bytes `TinyKVCache` holds for it (its packed codes, float16 scales and zero points; `memory_report()`'s
`compressed_storage_bytes`), and for a protected layer the same tokens at the dtype it holds them in. Per-token value
scales cost 2 x 16 / 64 = 0.5 bit per value coordinate here, groups of 32 one bit; keys' 2 x 16 / 128 = 0.25 bit.

Writes `tiny_turboquant.json` (every run), `tiny_turboquant.md` (the table) and `tiny_turboquant.png` into `--out`.
Publishing a run: its folder goes in eval/results/<experiment>/ (the latest run only; eval/README.md), then
`python eval/report.py` rewrites BENCHMARKS.md from it (CI checks the file with `--check`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re

from lowbit_compare import Row, add_arguments, dry, main, ours

CONFIGS = ("tiny:safe", "tiny:balanced", "tiny:compact", "tiny:aggressive", "tiny:k4v2", "tiny:aggressive+protect1",
           "k4v4", "k4v3", "k4v2", "k3v2")  # fmt: skip
TINY = "tiny-turboquant"
PATTERN = r"tiny:(safe|balanced|compact|aggressive|k(\d)v(\d))(\+protect(\d))?"


def parse_config(name: str) -> str:
    """The argparse check of a `--configs` name."""
    if re.fullmatch(PATTERN, name) or re.fullmatch(r"k\dv\d", name):
        return name
    raise argparse.ArgumentTypeError(
        f"a config is tiny:<preset>[+protect<N>], tiny:k<X>v<Y> or k<X>v<Y>, got {name!r}"
    )


def tiny_cache(model, name: str, window: int):
    """`TinyKVCache.for_model(model, ...)` of a `tiny:` config name, its `update` taking Transformers 5.24's
    `kwargs=` (module docstring)."""
    from tiny_turboquant import TinyKVCache

    class Shimmed(TinyKVCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states, value_states, layer_idx)

    found = re.fullmatch(PATTERN, name)
    options = (
        {"compression": found[1]}
        if found[2] is None
        else {"key_bits": int(found[2]), "value_bits": int(found[3])}
    )
    if found[5]:
        options |= {"protect_first": int(found[5]), "protect_last": int(found[5])}
    return Shimmed.for_model(model, residual_len=window, **options)


def tiny_bits(cache) -> float:
    """Bits per coordinate of every token outside the residual window (module docstring)."""
    outside = max(layer._n_quantized for layer in cache.layers)
    bits = coordinates = 0
    for layer in cache.layers:
        batch, heads, _, dim = layer._residual_keys.shape
        count = outside * batch * heads * dim * 2
        if layer.skip_quantization:
            bits += count * layer._residual_keys.element_size() * 8
        else:
            assert layer._n_quantized == outside
            bits += layer.memory_report()["compressed_storage_bytes"] * 8
        coordinates += count
    return bits / coordinates


def plan(args) -> list[Row]:
    mine, theirs = [], []
    for name in args.configs:
        if name.startswith("tiny:"):
            theirs.append(Row(TINY, name.removeprefix("tiny:"), None,
                              lambda m, name=name: tiny_cache(m, name, args.window), tiny_bits))  # fmt: skip
        else:
            mine += ours(name, args.seeds, args.window)
    return (mine if not args.theirs_only else []) + (theirs if not args.ours_only else [])


NOTES = (
    "Cells: perplexity change against DynamicCache, mean [min .. max] over seeds (runs). hf_kvplus: "
    "QuantizedCache(bits=config, rotation_seed=s) as it ships (k4v2, k3v2: 4 exact first tokens; keys' centre "
    "turning with RoPE); "
    "tiny-turboquant: TinyKVCache.for_model(model, compression=preset) (safe K4V4, balanced K4V3, compact K3V3, "
    "aggressive K3V2 with value groups of 32), k4v2: key_bits=4, value_bits=2; +protect1: protect_first=1, "
    "protect_last=1; residual_len 128. bits/coord: every token outside the window, codes packed, scales, zero "
    "points and norms at float16, exact first tokens and protected layers at float32 "
    "(eval/compare_tiny_turboquant.py's docstring). (reused): hf_kvplus's runs from eval/lowbit_regions.py's "
    "runs.jsonl, same protocol and DynamicCache perplexity."
)


def cli(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), type=parse_config,
                        help=f"rows to run (default {' '.join(CONFIGS)})")  # fmt: skip
    args = parser.parse_args(argv)
    dry(args)
    wants_tiny = not args.ours_only and not args.report_only
    if wants_tiny and importlib.util.find_spec("tiny_turboquant") is None:
        parser.error("tiny-turboquant is not importable here: run with the python of "
                     "scripts/reference_venv.sh tiny-turboquant's venv, or pass --ours-only")  # fmt: skip
    extra = {}
    if importlib.util.find_spec("tiny_turboquant") is not None:
        extra["versions_other"] = {"tiny-turboquant": importlib.metadata.version("tiny-turboquant")}
    main(args, lambda: plan(args), "tiny_turboquant", NOTES, extra)


if __name__ == "__main__":
    cli()
