"""hf_kvplus's rotated K/V formats, as they ship, against the TurboQuant reference, turboquant-torch 0.4.0, as its
own cache behaves for its users; on one protocol (eval/lowbit_compare.py: 4096 tokens of Pride and Prejudice,
SmolLM2-135M, window 128, chunks of 32 and 256, seeds 0 1 2).

    bash scripts/reference_venv.sh turboquant /tmp/tqvenv   # once: the reference imports scipy, which .venv leaves out
    /tmp/tqvenv/bin/python eval/compare_turboquant.py --out eval/results/compare_turboquant \
        --reuse eval/results/lowbit_regions_fixed_centre/runs.jsonl   # or a part: --chunks, --configs, --seeds (eval/README.md)
    /tmp/tqvenv/bin/python eval/compare_turboquant.py --out eval/results/compare_turboquant --report-only
    /tmp/tqvenv/bin/python eval/compare_turboquant.py --dry-run --out /tmp/turboquant_dry   # every row, tiny
    python eval/compare_turboquant.py --ours-only --dry-run --out /tmp/turboquant_dry       # without the reference

Rows, by `--configs` name (`kXvY`: X bits per key coordinate, Y per value coordinate):

- `kXvY`: hf_kvplus `QuantizedCache(bits="kXvY", window, rotation_seed=s)` as it ships (k4v2, k3v2, k2v2: 4 exact
  first tokens; the keys' centre turning with RoPE), over `--seeds`; and **the reference's own cache**, one run (it takes no seed),
  `turboquant.TurboQuantDynamicCache(residual_length=window)` with `compress_all()` called after every forward, its
  one way to compress (its `wrap(model).generate()` calls it only after generating). What its users get, read from
  turboquant/hf_cache.py and kv_cache.py: the cache stores K/V at full precision as a DynamicCache does, so a
  forward attends the whole past as `compress_all()` left it and its own chunk exact, and only then (at the next
  `compress_all()`) is quantized what is older than the newest `residual_length` tokens: a chunk sees the past's
  window at full precision, and quantization comes after attention. `compress_all()` builds one
  `TurboQuantKVCache(head_dim, bit_width, residual_length)` per layer with the same seed (0), so every layer and
  head has the same rotation and codebook; keys are `TurboQuant(unbiased=True)`: X - 1 bits of Lloyd-Max codes after
  a randomized Hadamard rotation, plus a 1-bit QJL sketch of the residual (D projections) and its norm; values
  `TurboQuant(unbiased=False, seed + 100)`: Y bits of codes and a norm. It decodes every layer in full and writes
  the reconstruction back into the DynamicCache, so the next call codes those reconstructions again: a token is
  re-coded at every forward after it leaves the window (chunks of 32: up to 127 times). Its cache takes one
  `bit_width` (keys get one bit more on a model whose query heads are more than twice its K/V heads, when built with
  `from_model`: SmolLM2-135M, 9 over 3, so `from_model(bit_width=2)` is k3v2); to reach k4v2 and k2v2 the rows give
  the `TurboQuantKVCache` that `compress_all()` builds `key_bit_width=X, value_bit_width=Y`, and change nothing else
  (tests/test_compare_scripts.py checks that k3v2 is `from_model(bit_width=2)`, to the last digit).
- `kXvY+mse`, over `--seeds`: the reference's quantizers as eval/compare_turboquant.py simulated them at
  first, in the order of its cache: keys `TurboQuant(D, X, unbiased=False, seed=s)` (all X bits to the codes, no
  QJL), values `TurboQuant(D, Y, unbiased=False, seed=s + 100)`, one pair for every layer and head; a token is coded
  once, after the forward that pushed it out of the newest `window` (so a chunk sees the past's window exact).
- `kXvY+qjl`, over `--seeds`: the same, with its cache's keys, `TurboQuant(D, X, unbiased=True, seed=s)`: what its
  cache would give if `compress_all()` coded only what had not been coded (its rows differ from the cache's by that).

Where the protocols differ from hf_kvplus's: hf_kvplus quantizes what a forward pushes out of the window as `update`
returns, but each query still attends its own window exact (a chunk of n sees the newest `window + n - 1` tokens at
full precision: the same tokens as the reference's, but one); it codes each token once, keeps the 4 first tokens
exact (k4v2, k3v2, k2v2), codes keys with MSE codes only (centred, no QJL), gives each layer its own rotation
(seed + layer) and stores codes packed with float16 norms.

Bits per coordinate (eval/lowbit_compare.py: codes packed, norms at float16, exact regions at their dtype): the
reference ((X D + 2 x 16) + (Y D + 16)) / 2D = (X + Y) / 2 + 24 / D with QJL keys (a key has its norm and its
residual's), (X + Y) / 2 + 16 / D with MSE keys; D = 64 here. The reference itself holds codes as int64 and norms as
float32: the count is of what a packed implementation of its format stores, as for hf_kvplus.

`--no-renorm` sets `hf_kvplus.kernels.rotated_format.RENORMALIZE = False` (an ablation: the stored norm is |x|, not
|x| / |decoded unit vector|); `--no-center` sets `CENTER_KEYS = False` (keys coded without a centre). Writes
`turboquant.json` (every run), `turboquant.md` (the table) and `turboquant.png` (perplexity change against bits per
coordinate, a panel per chunk size) into `--out`.

Publishing a run: its folder goes in eval/results/<experiment>/ (the latest run only; eval/README.md), then
`python eval/report.py` rewrites BENCHMARKS.md from it (CI checks the file with `--check`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import re

import torch
from lowbit_compare import Row, add_arguments, dry, main, ours
from transformers.cache_utils import DynamicCache, DynamicLayer

from hf_kvplus.kernels import rotated_format

CONFIGS = ("k4v2", "k3v2", "k2v2", "k4v2+mse", "k3v2+mse", "k2v2+mse", "k4v2+qjl", "k3v2+qjl", "k2v2+qjl")
TQ_CACHE, TQ_MSE, TQ_QJL = (
    "turboquant-torch cache",
    "turboquant-torch MSE keys, coded once",
    "turboquant-torch QJL keys, coded once",
)


def parse_config(name: str) -> tuple[int, int, bool]:
    """(key bits, value bits, "" | "mse" | "qjl": coded once) of a `--configs` name (also its argparse check)."""
    if found := re.fullmatch(r"k(\d)v(\d)(\+mse|\+qjl)?", name):
        return int(found[1]), int(found[2]), (found[3] or "+")[1:]
    raise argparse.ArgumentTypeError(f"a config is k<X>v<Y>, k<X>v<Y>+mse or k<X>v<Y>+qjl, got {name!r}")


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@contextlib.contextmanager
def coder(key_bits: int, value_bits: int):
    """turboquant.hf_cache's `TurboQuantKVCache` given `key_bit_width` and `value_bit_width` while its
    `compress_all()` runs (it passes neither); everything else as it builds it."""
    import turboquant.hf_cache as hf_cache

    saved = hf_cache.TurboQuantKVCache
    hf_cache.TurboQuantKVCache = functools.partial(saved, key_bit_width=key_bits, value_bit_width=value_bits)
    try:
        yield
    finally:
        hf_cache.TurboQuantKVCache = saved


def compress_every_forward(cache_class):
    """`cache_class` (a TurboQuantDynamicCache) whose `compress_all()` runs before each forward that has a past, as
    a user calls it after every forward; and whose `update` takes Transformers 5.24's `kwargs=`."""

    class EveryForward(cache_class):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx == 0 and self.get_seq_length() > 0:
                self.compress_all()
            return super().update(key_states, value_states, layer_idx)

    return EveryForward


def reference_cache(config, key_bits: int, value_bits: int, window: int):
    """turboquant-torch's own cache, compressed after every forward, with `TurboQuantKVCache(key_bit_width=key_bits,
    value_bit_width=value_bits)` per layer (its seed, 0)."""
    from turboquant import TurboQuantDynamicCache

    class Coded(compress_every_forward(TurboQuantDynamicCache)):
        def compress_all(self):
            with coder(key_bits, value_bits):
                return super().compress_all()

    cache = Coded(bit_width=key_bits, residual_length=window)
    cache.bits_per_coordinate = (key_bits + value_bits) / 2 + 24 / head_dim(config)
    return cache


def literal_cache(model, bit_width: int, window: int):
    """`TurboQuantDynamicCache.from_model(model, bit_width, residual_length=window)` exactly, compressed after every
    forward (what tests/test_compare_scripts.py compares `reference_cache` with)."""
    from turboquant import TurboQuantDynamicCache, detect_model_kv_info

    return compress_every_forward(TurboQuantDynamicCache)(
        bit_width=bit_width, residual_length=window, model_info=detect_model_kv_info(model)
    )


class OnceLayer(DynamicLayer):
    """A DynamicLayer whose tokens older than the newest `window` are replaced, once, by TurboQuant's
    quantize-then-dequantize, at the start of the forward after the one that pushed them out."""

    def __init__(self, key_quantizer, value_quantizer, window: int):
        super().__init__()
        self.key_quantizer, self.value_quantizer, self.window = key_quantizer, value_quantizer, window
        self.quantized = 0  # tokens 0 .. quantized - 1 hold the reference's reconstruction

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.get_seq_length() - self.window
        if end > self.quantized:
            for stored, quantizer in ((self.keys, self.key_quantizer), (self.values, self.value_quantizer)):
                stored[:, :, self.quantized : end] = roundtrip(quantizer, stored[:, :, self.quantized : end])
            self.quantized = end
        return super().update(key_states, value_states)


def roundtrip(quantizer, x: torch.Tensor) -> torch.Tensor:
    """`x` ([..., D]) through the reference's quantize then dequantize, in float32."""
    flat = x.reshape(-1, x.shape[-1]).float()
    return quantizer.dequantize(quantizer.quantize(flat)).reshape(x.shape).to(x.dtype)


def once_cache(config, key_bits: int, value_bits: int, seed: int, window: int, qjl: bool = False):
    """The `+mse` and `+qjl` rows: turboquant-torch's quantizers, each token coded once (module docstring)."""
    from turboquant import TurboQuant

    keys = TurboQuant(head_dim(config), key_bits, unbiased=qjl, seed=seed)
    values = TurboQuant(head_dim(config), value_bits, unbiased=False, seed=seed + 100)
    cache = DynamicCache(config=config)
    cache.layers = [OnceLayer(keys, values, window) for _ in range(config.num_hidden_layers)]
    cache.bits_per_coordinate = (key_bits + value_bits) / 2 + (24 if qjl else 16) / head_dim(config)
    return cache


def plan(args) -> list[Row]:
    """Every run at one chunk size, hf_kvplus's first."""
    mine, theirs = [], []
    for name in args.configs:
        kb, vb, once = parse_config(name)
        if once:
            theirs += [Row(TQ_QJL if once == "qjl" else TQ_MSE, name.partition("+")[0], s,
                           lambda m, kb=kb, vb=vb, s=s, once=once: once_cache(m.config, kb, vb, s, args.window,
                                                                              qjl=once == "qjl"),
                           lambda cache: cache.bits_per_coordinate) for s in args.seeds]  # fmt: skip
            continue
        mine += ours(name, args.seeds, args.window)
        theirs.append(Row(TQ_CACHE, name, 0, lambda m, kb=kb, vb=vb: reference_cache(m.config, kb, vb, args.window),
                          lambda cache: cache.bits_per_coordinate))  # fmt: skip
    return (mine if not args.theirs_only else []) + (theirs if not args.ours_only else [])


NOTES = (
    "Cells: perplexity change against DynamicCache, mean [min .. max] over seeds (runs). hf_kvplus: "
    "QuantizedCache(bits=config, rotation_seed=s) as it ships (k4v2, k3v2, k2v2: 4 exact first tokens; keys' "
    "centre turning with RoPE); "
    "turboquant-torch cache: its TurboQuantDynamicCache with compress_all() after every forward (QJL keys, "
    "one rotation for all layers, every token past the window re-coded at each call), its TurboQuantKVCache "
    "given key_bit_width and value_bit_width (seed 0, its own); MSE (QJL) keys, coded once: its quantizers "
    "without (with) QJL keys, each token coded once after the forward that pushed it out of the window. "
    "bits/coord: codes packed, norms at float16, exact first tokens at float32 (eval/compare_turboquant.py's "
    "docstring). (reused): hf_kvplus's runs taken from eval/lowbit_regions.py's runs.jsonl, same protocol and "
    "DynamicCache perplexity."
)


def cli(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        type=lambda name: parse_config(name) and name,
        help=f"rows to run (default {' '.join(CONFIGS)})",
    )
    parser.add_argument(
        "--no-renorm", action="store_true", help="store |x| as the rotated formats' norm (ablation)"
    )
    parser.add_argument("--no-center", action="store_true", help="code the rotated formats' keys without a centre "
                                                                  "(ablation)")  # fmt: skip
    args = parser.parse_args(argv)
    dry(args)
    wants_reference = not args.ours_only and not args.report_only
    if wants_reference and importlib.util.find_spec("turboquant") is None:
        parser.error("turboquant-torch is not importable here: run with the python of `bash scripts/reference_venv.sh "
                     "turboquant`'s venv, or pass --ours-only")  # fmt: skip
    if args.no_renorm:
        rotated_format.RENORMALIZE = False
    if args.no_center:
        rotated_format.CENTER_KEYS = False
    if (args.no_renorm or args.no_center) and args.reuse:
        parser.error("--reuse takes runs of the shipped formats: not with --no-renorm or --no-center")
    extra = {"renormalize": rotated_format.RENORMALIZE, "center_keys": rotated_format.CENTER_KEYS}
    if importlib.util.find_spec("turboquant") is not None:
        extra["versions_other"] = {"turboquant-torch": __import__("turboquant").__version__}
    main(args, lambda: plan(args), "turboquant", NOTES, extra)


if __name__ == "__main__":
    cli()
