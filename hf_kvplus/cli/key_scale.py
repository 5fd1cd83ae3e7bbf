"""`kvplus key-scale`: fit a model's key scale (`key_scale.KeyScale`: per layer, KV head and RoPE pair, the factor a
rotated format codes its keys at) on a text, and save it where `QuantizedCache(key_scale="auto")` and the quantized
specs find it (`fitted.user_dir(config, "key_scale")`, in the user cache folder) or into `--out`. The defaults are
what the shipped Gemma 3 270M scale was fitted with."""

from __future__ import annotations

import time

import torch

from ..evaluation.key_scale_fit import fit_key_scale
from ..fitted import user_dir
from . import common


def register(subparsers) -> None:
    parser = subparsers.add_parser("key-scale", help="fit the per-pair key scale of a model's rotated caches")
    common.add_model_args(parser)
    parser.set_defaults(text="austen:persuasion")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the text to fit on (default 2048)")
    parser.set_defaults(func=run)


def run(args) -> int:
    common.setup(args)
    model, tokenizer, text = common.load(args)
    start = time.perf_counter()
    ids = common.scored_tokens(tokenizer, text, args.tokens)
    scale = fit_key_scale(model, ids, args.model, {"text": args.text})
    scale.measured.update({"threads": torch.get_num_threads(), "seconds": round(time.perf_counter() - start, 1)})
    folder = args.out or user_dir(model.config, "key_scale")
    folder.mkdir(parents=True, exist_ok=True)
    path = scale.save(folder / ".key_scale.safetensors.tmp").replace(folder / "key_scale.safetensors")
    ranges = {index: [round(float(s.min()), 3), round(float(s.max()), 3)] for index, s in scale.scales.items()}
    print(f"scale range per layer: {ranges}")
    if args.out is None:
        print(f"wrote {path}: QuantizedCache(model.config, bits='k4v2') and --cache quantized:k4v2 use it for this model")
    else:
        print(f"wrote {path} (use it: --cache 'quantized:k4v2:key_scale={path}' or QuantizedCache(config, "
              f"bits='k4v2', key_scale='{path}'))")  # fmt: skip
    return 0
