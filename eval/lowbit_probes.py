"""Probes of the rotated formats on one model, behind the per-family defaults (`precision.FAMILY_DEFAULTS`): where a
preset's loss is, by layer kind, keys or values, position and length.

    python eval/lowbit_probes.py runs gemma3-270m austen:prideprejudice 1024 32 'NAME={"bits": "k2v2", ...}' ...
    python eval/lowbit_probes.py layers gemma3-270m austen:prideprejudice 1024
    python eval/lowbit_probes.py bias gemma3-270m austen:prideprejudice 4096
    python eval/lowbit_probes.py drift gemma3-270m austen:prideprejudice 4096
    python eval/lowbit_probes.py heavy gemma3-270m austen:prideprejudice 2048

- `runs`: perplexity change against DynamicCache (chunks of CHUNK) of `QuantizedCache(**kwargs)` for each NAME=JSON
  (`layer_bits` keys as strings, null: full precision), with the paired standard error; one JSON line each. A probe's
  own key, `rotation_seeds` ({"5": 6}: layer 5 rotated with seed 6), gives layers a rotation other than their seed's
  (`rotation_seed + layer`), to see which layers' rotations a preset's spread over seeds comes from.
- `layers`: one cache-free forward on eager attention, queries, keys and values captured; per layer: mean norms, the
  logits' spread, and with 2, 3 or 4-bit rotated keys (or values) outside a 128-token window (and the first 4 tokens of
  full layers) the keys' relative squared error, the logits' error and the attention output's relative squared error.
- `bias`: full-attention layers only: the attention mass on the exact tokens (window, first 4), and the output error
  with 2 and 4-bit keys, plain and with each coded logit lowered by half its expected error variance (a noisy logit's
  softmax weight is inflated by exp(variance / 2) on average).
- `heavy`: full-attention layers only, 2-bit values coded alone outside the window and the first 4 tokens: the 32
  coded tokens that take the most attention (summed over queries), their share of it and of the attention output's
  value error, their text and their values' length against the median; and over the 40 most frequent tokens (each
  occurring 5 times or more), the share of their coding error that is common to every occurrence of a token
  (``|mean error|^2 / mean |error|^2`` per token, weighted by count; independent errors give about 1/count:
  `independent_share`) and the same share of the values themselves.
- `drift`: sliding layers only: the relative error of 2 and 4-bit keys by position, with the fixed centre the cache
  sets from the first keys it codes (positions 4..36) and with a centre of each stretch's own mean, and the share of
  keys coded plain (the fixed centre no nearer than zero).

1 torch thread; run one at a time on a shared machine (`nice -n 10`).
"""

import contextlib
import importlib
import json
import sys

import torch
from transformers import DynamicCache

from hf_kvplus import QuantizedCache
from hf_kvplus.cli.common import tokenize
from hf_kvplus.evaluation.perplexity import perplexity
from hf_kvplus.eviction.rope import RotaryShift
from hf_kvplus.kernels.rotated_format import KeyCenter, RotatedFormat, dequantize_rotated, quantize_rotated
from hf_kvplus.resolve import load_model, load_text

WINDOW, FIRST = 128, 4


def runs(model, ids, chunk: int, configs: list[str]) -> None:
    base = perplexity(model, ids, DynamicCache(config=model.config), chunk_size=chunk, progress=False)
    print(json.dumps({"name": "dynamic", "perplexity": base.perplexity}), flush=True)
    for arg in configs:
        name, _, text = arg.partition("=")
        kwargs = json.loads(text)
        if "layer_bits" in kwargs:
            kwargs["layer_bits"] = {int(k): v for k, v in kwargs["layer_bits"].items()}
        with rotated_with({int(k): v for k, v in kwargs.pop("rotation_seeds", {}).items()}):
            cache = QuantizedCache(model.config, **kwargs)
        result = perplexity(model, ids, cache, chunk_size=chunk, progress=False)
        difference = result.nll.double() - base.nll.double()
        print(json.dumps({"name": name, "delta_pct": 100 * (result.perplexity / base.perplexity - 1),
                          "se_pct": 100 * float(difference.std() / difference.numel() ** 0.5),
                          "bits": cache.quantized_report()["bits_per_coordinate"], "seconds": result.seconds}),
              flush=True)  # fmt: skip


@contextlib.contextmanager
def rotated_with(seeds: dict[int, int]):
    """While a cache is built: layer i's rotated format takes seed `seeds[i]` where given (a cache fixes each layer's
    format as it builds it: `RotatedFormat.for_layer`)."""
    original = RotatedFormat.for_layer

    def for_layer(fmt: RotatedFormat, index: int) -> RotatedFormat:
        made = original(fmt, index)
        return RotatedFormat(made.key_bits, made.value_bits, seeds[index]) if index in seeds else made

    RotatedFormat.for_layer = for_layer
    try:
        yield
    finally:
        RotatedFormat.for_layer = original


def capture(model, ids, layers=None) -> dict:
    """(query, key, value, scaling) of each attention layer (or of `layers`), from one eager forward."""
    model.set_attn_implementation("eager")
    module = importlib.import_module(type(model.model.layers[0].self_attn).__module__)
    original, held = module.eager_attention_forward, {}

    def hook(attention, query, key, value, attention_mask, scaling=None, **kwargs):
        if layers is None or attention.layer_idx in layers:
            held[attention.layer_idx] = (query.detach().float(), key.detach().float(), value.detach().float(), scaling)
        return original(attention, query, key, value, attention_mask, scaling=scaling, **kwargs)

    module.eager_attention_forward = hook
    try:
        with torch.inference_mode():
            model(input_ids=ids[None], use_cache=False)
    finally:
        module.eager_attention_forward = original
    return held


def coded(x: torch.Tensor, bits: int, side: str, index: int, turns, positions) -> torch.Tensor:
    """x [1, H, T, D] coded and decoded by layer `index`'s rotated format (keys: with its centre, turning with `turns`)."""
    made = RotatedFormat(bits, bits, 0)
    keys, values = made.for_layer(index).side_formats()
    one, center = (keys, made.make_state(turns=turns)) if side == "keys" else (values, None)
    codes, norms = quantize_rotated(x, one, "values", positions, center)
    return dequantize_rotated(codes, norms, one, "values", positions=positions, center=center)


def layer_types(config) -> list[str]:
    return getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers


def layers(model, ids) -> None:
    held, types, positions = capture(model, ids), layer_types(model.config), torch.arange(ids.numel())
    distance = positions[:, None] - positions[None, :]
    for index, (q, k, v, scaling) in sorted(held.items()):
        full = types[index] == "full_attention"
        window = model.config.sliding_window if not full else None
        allowed = (distance >= 0) & ((distance < window) if window else True)
        exact = (distance < WINDOW) | ((positions[None, :] < FIRST) if full else False)
        outside = allowed & ~exact
        group = q.shape[1] // k.shape[1]
        query, keys, values = q[0], k[0].repeat_interleave(group, 0), v[0].repeat_interleave(group, 0)
        logits = torch.einsum("htd,hsd->hts", query, keys) * scaling
        weights = torch.softmax(logits.masked_fill(~allowed, -1e30), -1)
        out = weights @ values
        row = {"layer": index, "kind": "full" if full else "sliding", "q_norm": float(query.norm(dim=-1).mean()),
               "k_norm": float(keys.norm(dim=-1).mean()), "v_norm": float(values.norm(dim=-1).mean()),
               "logit_std": float(logits[:, allowed].std())}  # fmt: skip
        turns = RotaryShift.from_config(model.config) if full else None
        for bits in (2, 3, 4):
            kq = coded(k, bits, "keys", index, turns, positions)[0].repeat_interleave(group, 0)
            vq = coded(v, bits, "values", index, None, positions)[0].repeat_interleave(group, 0)
            mixed = torch.where(exact, logits, torch.einsum("htd,hsd->hts", query, kq) * scaling)
            out_k = torch.softmax(mixed.masked_fill(~allowed, -1e30), -1) @ values
            out_v = (weights * exact) @ values + (weights * outside) @ vq
            row |= {f"k{bits}_relmse": float(((kq - keys) ** 2).sum() / (keys**2).sum()),
                    f"k{bits}_logit_err": float((mixed - logits)[:, outside].std()) if outside.any() else 0.0,
                    f"k{bits}_out": float(((out_k - out) ** 2).sum() / (out**2).sum()),
                    f"v{bits}_out": float(((out_v - out) ** 2).sum() / (out**2).sum())}  # fmt: skip
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def bias(model, ids) -> None:
    types, positions = layer_types(model.config), torch.arange(ids.numel())
    held = capture(model, ids, [i for i, t in enumerate(types) if t == "full_attention"])
    distance = positions[:, None] - positions[None, :]
    allowed = distance >= 0
    exact = (distance < WINDOW) | (positions[None, :] < FIRST)
    outside = allowed & ~exact
    for index, (q, k, v, scaling) in sorted(held.items()):
        group = q.shape[1] // k.shape[1]
        query, keys, values = q[0], k[0].repeat_interleave(group, 0), v[0].repeat_interleave(group, 0)
        logits = torch.einsum("htd,hsd->hts", query, keys) * scaling
        weights = torch.softmax(logits.masked_fill(~allowed, -1e30), -1)
        out = weights @ values
        row = {"layer": index, "tokens": ids.numel(), "mass_exact": float((weights * exact).sum(-1).mean())}
        for bits in (2, 4):
            kq = coded(k, bits, "keys", index, RotaryShift.from_config(model.config), positions)[0]
            kq = kq.repeat_interleave(group, 0)
            mixed = torch.where(exact, logits, torch.einsum("htd,hsd->hts", query, kq) * scaling)
            noisy = torch.softmax(mixed.masked_fill(~allowed, -1e30), -1)
            variance = scaling**2 * (query**2).sum(-1)[:, :, None] * ((kq - keys) ** 2).sum(-1)[:, None, :] / q.shape[-1]
            lowered = torch.softmax((mixed - 0.5 * variance * outside).masked_fill(~allowed, -1e30), -1)
            row |= {f"k{bits}_logit_err": float((mixed - logits)[:, outside].std()),
                    f"k{bits}_mass_exact": float((noisy * exact).sum(-1).mean()),
                    f"k{bits}_out": float(((noisy @ values - out) ** 2).sum() / (out**2).sum()),
                    f"k{bits}_out_lowered": float(((lowered @ values - out) ** 2).sum() / (out**2).sum())}  # fmt: skip
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def heavy(model, ids, tokenizer) -> None:
    types, positions = layer_types(model.config), torch.arange(ids.numel())
    held = capture(model, ids, [i for i, t in enumerate(types) if t == "full_attention"])
    distance = positions[:, None] - positions[None, :]
    allowed = distance >= 0
    outside = allowed & ~((distance < WINDOW) | (positions[None, :] < FIRST))
    counts = torch.bincount(ids[FIRST:])
    frequent = [t for t in counts.argsort(descending=True)[:40].tolist() if counts[t] >= 5]
    for index, (q, k, v, scaling) in sorted(held.items()):
        group = q.shape[1] // k.shape[1]
        query, keys = q[0], k[0].repeat_interleave(group, 0)
        weights = torch.softmax((torch.einsum("htd,hsd->hts", query, keys) * scaling).masked_fill(~allowed, -1e30), -1)
        error = coded(v, 2, "values", index, None, positions) - v  # [1, H, T, D]
        spread = (weights * outside) @ error[0].repeat_interleave(group, 0)  # each query's output error
        mass = (weights * outside).sum((0, 1))
        top = mass.argsort(descending=True)[:32]
        keep = torch.ones(ids.numel(), dtype=torch.bool)
        keep[top] = False
        rest = (weights * outside * keep) @ error[0].repeat_interleave(group, 0)
        lengths = v[0].norm(dim=-1).mean(0)

        def common(x: torch.Tensor) -> float:
            shared = total = 0.0
            for token in frequent:
                at = (ids == token).nonzero()[:, 0]
                at = at[at >= FIRST]
                shared += float((x[:, at].mean(1) ** 2).sum()) * at.numel()
                total += float((x[:, at] ** 2).sum(-1).mean(-1).sum()) * at.numel()
            return shared / total

        row = {"layer": index, "top32_attention_share": float(mass[top].sum() / mass.sum()),
               "top32_value_error_share": float(1 - (rest**2).sum() / (spread**2).sum()),
               "top32_value_length_vs_median": float(lengths[top].median() / lengths.median()),
               "top32_tokens": [tokenizer.decode([t]) for t in ids[top[:12]].tolist()],
               "common_error_share": common(error[0]), "common_value_share": common(v[0]),
               "independent_share": len(frequent) / sum(int((ids[FIRST:] == t).sum()) for t in frequent)}  # fmt: skip
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def drift(model, ids) -> None:
    types, tokens = layer_types(model.config), ids.numel()
    held = capture(model, ids, [i for i, t in enumerate(types) if t != "full_attention"])
    stretches = [(a, min(a + 512, tokens)) for a in range(0, tokens, max(512, tokens // 4))]
    for index, (_, k, _, _) in sorted(held.items()):
        row = {"layer": index}
        for bits in (2, 4):
            keys, center = RotatedFormat(bits, bits, 0).for_layer(index).side_formats()[0], KeyCenter()
            center.observe(k[:, :, FIRST : FIRST + 32], keys.seed)  # the first keys the cache codes
            codes, norms = quantize_rotated(k, keys, "values", None, center)
            decoded = dequantize_rotated(codes, norms, keys, "values", center=center)
            for a, b in stretches:
                row[f"k{bits}_fixed_{a}"] = float(((decoded - k)[:, :, a:b] ** 2).sum() / (k[:, :, a:b] ** 2).sum())
                if bits == 2:
                    row[f"plain_{a}"] = float((norms[0, :, a:b] < 0).float().mean())
                    own, own_center = RotatedFormat(bits, bits, 0).for_layer(index).side_formats()[0], KeyCenter()
                    own_center.observe(k[:, :, a:b], own.seed)
                    c, n = quantize_rotated(k[:, :, a:b], own, "values", None, own_center)
                    mine = dequantize_rotated(c, n, own, "values", center=own_center)
                    row[f"k2_own_{a}"] = float(((mine - k[:, :, a:b]) ** 2).sum() / (k[:, :, a:b] ** 2).sum())
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    probe, name, text, tokens = argv[0], argv[1], argv[2], int(argv[3])
    torch.set_num_threads(1)
    model, tokenizer = load_model(name)
    ids = tokenize(tokenizer, load_text(text), tokens)
    if probe == "runs":
        runs(model, ids, int(argv[4]), argv[5:])
    elif probe == "heavy":
        heavy(model, ids, tokenizer)
    else:
        {"layers": layers, "bias": bias, "drift": drift}[probe](model, ids)


if __name__ == "__main__":
    main()
