"""Query-aware key scaling, probed on a model whose attention normalizes queries and keys per channel (QK-norm:
Gemma 3): can a per-layer, per-RoPE-pair key scale make the rotated formats' coded keys cost less?

    python eval/key_scaling.py gains gemma3-270m austen:persuasion austen:prideprejudice 2048 --save /tmp/s.pt
    python eval/key_scaling.py runs gemma3-270m /tmp/s.pt --texts austen:prideprejudice --specs k2v2 k3v2 k4v2 \
        --out /tmp/key_scaling/runs.jsonl
    python eval/key_scaling.py shipped gemma3-270m --texts austen:prideprejudice --out /tmp/key_scaling/shipped.jsonl

Why it can: scaling a RoPE pair's two key coordinates (i and i + D/2, rotated together by rotate_half) by s and the
query's by 1/s leaves every logit q.k unchanged and commutes with RoPE. A rotated format's coding error is about
isotropic, its variance proportional to the coded key's squared norm (the key less its centre), so a logit's error
variance goes as (sum_p rms(q_p)^2 / s_p^2) (sum_p rms(k_p)^2 s_p^2): least at s_p^2 = rms(q_p) / rms(k_p), where it
is (sum_p rms(q_p) rms(k_p))^2 (Cauchy-Schwarz). The gain, the factor that variance can fall by, is
(sum rms(q_p)^2)(sum rms(k_p)^2) / (sum rms(q_p) rms(k_p))^2 (1: no gain).

- `gains`: one cache-free forward on each text (the first TOKENS tokens), queries and keys taken after the norms and
  before RoPE (a pair's RMS is the same after it); per layer the pairs' RMS (queries pooled over the KV head's query
  heads), the gain with raw keys and with keys less their mean (the full layers' turning centre is the keys' pre-RoPE
  mean), the scales fitted on FIT_TEXT (centred keys on full-attention layers, raw on sliding ones, whose fixed centre
  goes stale), and the factor those scales change the variance by on EVAL_TEXT; then the largest change of a token's
  log-likelihood on EVAL_TEXT when the scales are folded in (float precision: the model is the same). `--save` keeps
  the scales.
- `runs`: the scales folded into the model (each layer's key norm's effective scale, 1 + weight, times s; the query
  norm's divided by s), then perplexity against DynamicCache (chunks of CHUNK, window 128, rotation `--seeds`) of
  `QuantizedCache(bits=SPEC)` as it ships (family defaults) and with one format on every layer, the unfolded and the
  folded model alternately; first DynamicCache (`--check-dynamic`: on both, whose perplexities must agree to float
  precision). `--configs NAME=JSON` adds caches (`QuantizedCache` keyword arguments, `layer_bits` keys as strings,
  e.g. 'full k3v2={"bits": "k2v2", "layer_bits": {"5": "k3v2", "11": "k3v2", "17": "k3v2"}}'). One JSON line per
  run into `--out`.
- `shipped`: the scale as the rotated format holds it (`QuantizedCache(key_scale=...)`, the model unchanged): each
  cache of `runs` with `key_scale="off"` and then as it ships (`"auto"`: the model's fitted scale, if one ships; the
  record says which it took), same seeds; `--key-scale PATH` takes a scale file instead of the shipped one;
  `--configs NAME=JSON` adds caches as `runs` does, `--scaled-only` runs each with the scale alone, e.g.

    python eval/key_scaling.py shipped gemma3-270m --specs --scaled-only --out /tmp/mix.jsonl \
        --configs 'full k3v3={"bits": "k3v2", "layer_bits": {"5": "k3v3", "11": "k3v3", "17": "k3v3"}}'

1 torch thread; run one at a time on a shared machine.
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

import torch
from lowbit_probes import layer_types
from transformers import DynamicCache

from hf_kvplus import QuantizedCache
from hf_kvplus.cli.common import tokenize
from hf_kvplus.evaluation.key_scale_fit import fit_key_scale, forward_with, pair_rms, queries_and_keys
from hf_kvplus.evaluation.perplexity import cache_free_nll, perplexity
from hf_kvplus.resolve import load_model, load_text


def gain(rq: torch.Tensor, rk: torch.Tensor) -> float:
    """The gain of the best scales, the mean over KV heads."""
    return float(((rq**2).sum(-1) * (rk**2).sum(-1) / (rq * rk).sum(-1) ** 2).mean())


def variance_factor(rq: torch.Tensor, rk: torch.Tensor, s: torch.Tensor) -> float:
    """How much the scales `s` [H, D/2] change the logit error variance, for pairs with these RMS (mean over heads)."""
    return float(((rq**2 / s**2).sum(-1) * (rk**2 * s**2).sum(-1) / ((rq**2).sum(-1) * (rk**2).sum(-1))).mean())


def key_rms(k: torch.Tensor, centred: bool) -> torch.Tensor:
    """k [H, T, D] -> the pairs' RMS [H, D/2], less the keys' mean if `centred`."""
    return pair_rms(k - k.mean(dim=1, keepdim=True) if centred else k)


def fit(model, ids) -> dict[int, torch.Tensor]:
    """Per layer, s [KV heads, D/2]: the package's fit (`fit_key_scale`, the keys' mean square kept), one per pair."""
    half = model.config.head_dim // 2
    return {index: s[..., :half] for index, s in fit_key_scale(model, ids, "probe").scales.items()}


def gains(model, fit_ids, eval_ids) -> dict[int, torch.Tensor]:
    types, scales = layer_types(model.config), fit(model, fit_ids)
    for index, (q, k) in sorted(queries_and_keys(model, eval_ids).items()):
        full = types[index] == "full_attention"
        rq, raw, centred = pair_rms(q), key_rms(k, False), key_rms(k, True)
        used = centred if full else raw
        print(json.dumps({"layer": index, "kind": "full" if full else "sliding",
                          "gain_raw": round(gain(rq, raw), 3), "gain_centred": round(gain(rq, centred), 3),
                          "fitted_factor": round(variance_factor(rq, used, scales[index]), 3),
                          "zero_pairs": int(((rq == 0) | (used == 0)).sum()),
                          "s_range": [round(float(x), 3) for x in scales[index][(rq > 0) & (used > 0)].aminmax()],
                          "q_rms": round(float(rq.square().mean().sqrt()), 2),
                          "k_rms": round(float(used.square().mean().sqrt()), 2)}), flush=True)  # fmt: skip
    if not all(hasattr(layer.self_attn, "q_norm") for layer in model.model.layers):
        return scales
    plain = cache_free_nll(model, eval_ids)
    with folded(model, scales):
        moved = cache_free_nll(model, eval_ids)
    print(json.dumps({"folded_max_nll_difference": float((moved - plain).abs().max()),
                      "perplexity": float(plain.double().mean().exp()),
                      "folded_perplexity": float(moved.double().mean().exp())}), flush=True)  # fmt: skip
    return scales


def value_fit(model, fit_ids, eval_ids) -> dict[int, torch.Tensor]:
    """Per layer, t [KV heads, D]: value channel c scaled by t_c in v_proj and its o_proj columns by 1/t_c (exact: no
    norm on Gemma 3's values). The output error variance of isotropic value errors goes as (sum_c w_c^2 / t_c^2)
    (sum_c rms(v_c)^2 t_c^2), w_c the norm of channel c's o_proj columns over the KV head's query heads: least at
    t_c^2 = w_c / rms(v_c). Prints the gain and the fitted scales' factor on `eval_ids`."""
    d, kv = model.config.head_dim, model.config.num_key_value_heads

    def rms(ids):
        held, hooks = {}, []
        for index, layer in enumerate(model.model.layers):
            hooks.append(layer.self_attn.v_proj.register_forward_hook(
                lambda _m, _i, out, index=index: held.__setitem__(index, out[0].float().view(-1, kv, d))))  # fmt: skip
        forward_with(model, ids, hooks)
        return {i: v.square().mean(0).sqrt() for i, v in held.items()}

    out = {}
    fitted, measured = rms(fit_ids), rms(eval_ids)
    for index, layer in enumerate(model.model.layers):
        w = layer.self_attn.o_proj.weight.detach().float().square().sum(0).view(kv, -1, d).sum(1).sqrt()
        rv = fitted[index].clamp_min(1e-6 * float(fitted[index].max()))
        t = (w.clamp_min(1e-6 * float(w.max())) / rv).sqrt()
        out[index] = t / ((rv**2 * t**2).sum(-1, keepdim=True) / (rv**2).sum(-1, keepdim=True)).sqrt()
        print(json.dumps({"layer": index, "value_gain": round(gain(w, measured[index]), 3),
                          "value_fitted_factor": round(variance_factor(w, measured[index], out[index]), 3)}),
              flush=True)  # fmt: skip
    return out


@contextmanager
def folded(model, scales: dict[int, torch.Tensor], values: dict[int, torch.Tensor] | None = None):
    """The model with each layer's key norm scaled by s per pair and its query norm by 1/s (logits unchanged); with
    `values`, v_proj's rows scaled by t and o_proj's columns by 1/t (outputs unchanged)."""
    if any(s.shape[0] != 1 for s in scales.values()):
        raise ValueError("the norms are shared by a layer's heads: folding takes one KV head's scales")
    kept = []
    with torch.no_grad():
        for index, s in scales.items():
            attention, full = model.model.layers[index].self_attn, torch.cat([s[0], s[0]]).double()
            for weight, factor in ((attention.q_norm.weight, 1 / full), (attention.k_norm.weight, full)):
                kept.append((weight, weight.clone()))
                weight.copy_((1 + weight.double()) * factor - 1)
        for index, t in (values or {}).items():
            attention = model.model.layers[index].self_attn
            group = model.config.num_attention_heads // t.shape[0]
            for weight, factor in ((attention.v_proj.weight, t.reshape(-1, 1)),
                                   (attention.o_proj.weight, 1 / t.repeat_interleave(group, 0).reshape(1, -1))):
                kept.append((weight, weight.clone()))
                weight.copy_(weight.double() * factor.double())
    try:
        yield model
    finally:
        with torch.no_grad():
            for weight, original in kept:
                weight.copy_(original)


def runs(model, tokenizer, scales, values, args) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def record(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with args.out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")

    for text in args.texts:
        ids = tokenize(tokenizer, load_text(text), args.tokens)
        base = perplexity(model, ids, DynamicCache(config=model.config), chunk_size=args.chunk, progress=False)
        record({"text": text, "spec": "dynamic", "folded": False, "perplexity": base.perplexity,
                "seconds": round(base.seconds)})  # fmt: skip
        if args.check_dynamic:
            with folded(model, scales, values):
                same = perplexity(model, ids, DynamicCache(config=model.config), chunk_size=args.chunk, progress=False)
            record({"text": text, "spec": "dynamic", "folded": True, "perplexity": same.perplexity,
                    "max_nll_difference": float((same.nll - base.nll).abs().max()), "seconds": round(same.seconds)})
        cases = [(f"{spec} {'family' if d else 'one format'}", {"bits": spec, "family_defaults": d})
                 for spec in args.specs for d in (True, False)]  # fmt: skip
        cases += configs(args.configs)
        for seed in args.seeds:
            for name, kwargs in cases:
                for fold in (False, True)[1 if args.folded_only else 0 :]:
                    cache = QuantizedCache(model.config, window=args.window, rotation_seed=seed, **kwargs)
                    with folded(model, scales if fold else {}, values if fold else None):
                        result = perplexity(model, ids, cache, chunk_size=args.chunk, progress=False)
                    ratio = result.perplexity / base.perplexity
                    difference = result.nll.double() - base.nll.double()
                    record({"text": text, "cache": name, "seed": seed, "folded": fold,
                            "values_folded": fold and values is not None,
                            "delta_pct": round(100 * (ratio - 1), 3),
                            "se_pct": round(100 * ratio * float(difference.std() / difference.numel() ** 0.5), 3),
                            "bits": round(cache.quantized_report()["bits_per_coordinate"], 3),
                            "seconds": round(result.seconds)})  # fmt: skip


def configs(given: list[str]) -> list[tuple[str, dict]]:
    """`--configs NAME=JSON` as (name, `QuantizedCache` keyword arguments), `layer_bits` keys made ints."""
    cases = []
    for arg in given:
        name, _, kwargs = arg.partition("=")
        kwargs = json.loads(kwargs)
        if "layer_bits" in kwargs:
            kwargs["layer_bits"] = {int(k): v for k, v in kwargs["layer_bits"].items()}
        cases.append((name, kwargs))
    return cases


def shipped(model, tokenizer, args) -> None:
    """Perplexity change of each cache without the key scale and with it, alternately (see the module doc)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def record(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with args.out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")

    scaled = "auto" if args.key_scale is None else str(args.key_scale)
    for text in args.texts:
        ids = tokenize(tokenizer, load_text(text), args.tokens)
        base = perplexity(model, ids, DynamicCache(config=model.config), chunk_size=args.chunk, progress=False)
        record({"text": text, "spec": "dynamic", "perplexity": base.perplexity, "seconds": round(base.seconds)})
        cases = [(f"{spec} {'family' if d else 'one format'}", {"bits": spec, "family_defaults": d})
                 for spec in args.specs for d in (True, False)]  # fmt: skip
        if args.cases:  # these, in this order
            cases = [next(case for case in cases if case[0] == name) for name in args.cases]
        cases += configs(args.configs)
        for seed in args.seeds:
            for name, kwargs in cases:
                for key_scale in (scaled,) if args.scaled_only else ("off", scaled):
                    cache = QuantizedCache(model.config, window=args.window, rotation_seed=seed, key_scale=key_scale,
                                           **kwargs)  # fmt: skip
                    result = perplexity(model, ids, cache, chunk_size=args.chunk, progress=False)
                    ratio = result.perplexity / base.perplexity
                    difference = result.nll.double() - base.nll.double()
                    report = cache.quantized_report()
                    record({"text": text, "cache": name, "seed": seed, "key_scale_asked": key_scale,
                            "key_scale": report["key_scale"], "delta_pct": round(100 * (ratio - 1), 3),
                            "se_pct": round(100 * ratio * float(difference.std() / difference.numel() ** 0.5), 3),
                            "perplexity": result.perplexity, "bits": round(report["bits_per_coordinate"], 3),
                            "seconds": round(result.seconds)})  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="probe", required=True)
    g = sub.add_parser("gains")
    g.add_argument("model")
    g.add_argument("fit_text")
    g.add_argument("eval_text")
    g.add_argument("tokens", type=int)
    g.add_argument("--save", type=Path)
    g.add_argument("--save-values", type=Path, help="fit value scales too (v_proj rows, o_proj columns) and keep them")
    r = sub.add_parser("runs")
    r.add_argument("model")
    r.add_argument("scales", type=Path)
    r.add_argument("--texts", nargs="+", default=["austen:prideprejudice"])
    r.add_argument("--specs", nargs="*", default=["k2v2", "k3v2", "k4v2"])
    r.add_argument("--tokens", type=int, default=4096)
    r.add_argument("--chunk", type=int, default=32)
    r.add_argument("--window", type=int, default=128)
    r.add_argument("--seeds", type=int, nargs="+", default=[0], help="rotation seeds")
    r.add_argument("--configs", nargs="*", default=[], help="NAME=JSON: more caches, QuantizedCache keyword arguments "
                   "(layer_bits keys as strings)")  # fmt: skip
    r.add_argument("--folded-only", action="store_true", help="the folded model only (its unfolded runs done before)")
    r.add_argument("--check-dynamic", action="store_true", help="DynamicCache on the folded model too")
    r.add_argument("--value-scales", type=Path, help="value scales to fold too (`gains --save-values`)")
    r.add_argument("--out", type=Path, required=True)
    sh = sub.add_parser("shipped")
    sh.add_argument("model")
    sh.add_argument("--texts", nargs="+", default=["austen:prideprejudice"])
    sh.add_argument("--specs", nargs="*", default=["k2v2", "k3v2", "k4v2"])
    sh.add_argument("--tokens", type=int, default=4096)
    sh.add_argument("--chunk", type=int, default=32)
    sh.add_argument("--window", type=int, default=128)
    sh.add_argument("--seeds", type=int, nargs="+", default=[0], help="rotation seeds")
    sh.add_argument("--key-scale", type=Path, help="a key scale file (default: the model's shipped one)")
    sh.add_argument("--cases", nargs="*", default=[], help="only these caches, in this order (e.g. 'k4v2 family' "
                    "'k2v2 one format')")  # fmt: skip
    sh.add_argument("--configs", nargs="*", default=[], help="NAME=JSON: more caches after --specs/--cases, "
                    "QuantizedCache keyword arguments (layer_bits keys as strings)")  # fmt: skip
    sh.add_argument("--scaled-only", action="store_true", help="each cache with the scale only (not also off)")
    sh.add_argument("--out", type=Path, required=True)
    for p in (g, r, sh):
        p.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    if args.probe == "shipped":
        shipped(model, tokenizer, args)
    elif args.probe == "gains":
        scales = gains(model, *(tokenize(tokenizer, load_text(t), args.tokens) for t in (args.fit_text, args.eval_text)))
        if args.save:
            torch.save(scales, args.save)
        if args.save_values:
            ids = [tokenize(tokenizer, load_text(t), args.tokens) for t in (args.fit_text, args.eval_text)]
            values = value_fit(model, *ids)
            plain = cache_free_nll(model, ids[1])
            with folded(model, scales, values):
                moved = cache_free_nll(model, ids[1])
            print(json.dumps({"keys_and_values_folded_max_nll_difference": float((moved - plain).abs().max())}))
            torch.save(values, args.save_values)
    else:
        values = torch.load(args.value_scales) if args.value_scales else None
        runs(model, tokenizer, torch.load(args.scales), values, args)


if __name__ == "__main__":
    main()
