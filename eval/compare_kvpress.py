"""hf_kvplus's evicting caches against NVIDIA kvpress's presses at equal budgets, on the same token ids.

    python eval/compare_kvpress.py --kvpress-python /tmp/kvpvenv/bin/python --threads 1 --continuation 32 \
        --out eval/results/kvpress_smollm2
    python eval/compare_kvpress.py --out /tmp/k --context 256 --continuation 16 --depths 0.5   # hf_kvplus half only
    python eval/compare_kvpress.py --kvpress-python /tmp/kvpvenv/bin/python --threads 1 --continuation 32 \
        --only 'knorm|tova|keydiff|Knorm|TOVA|KeyDiff' --out eval/results/kvpress_example_policies   # the examples

kvpress 0.5.5 needs transformers < 5.3, so its half runs in a venv of its own (`scripts/kvpress_venv.sh` makes
one) on the converted model folder hf_kvplus keeps for `--model`, reading the token ids this half wrote; this file
is that half's script too (`--role kvpress`: it imports neither hf_kvplus nor anything newer than kvpress allows).

Both halves treat a prompt the same way: one forward over what is compressed, which a press compresses (kvpress
compresses during the first prefill; KVzip then replays the context) and a `compress=prefill` cache compresses too (a
`KVzipCache` by `compress()` right after it), then decoding one token at a time at the original positions, without
compressing (kvpress's pipeline decodes so). A ratio r keeps (1 - r) x the compressed tokens per layer and KV head,
kvpress's `compression_ratio` (`--ratios 0.5 0.8`: 50% and 20% kept). Per method and ratio:

- continuation perplexity: `--context` tokens of `--text` as the prompt, then the next `--continuation` tokens fed
  one at a time and scored (the first by the prompt's last logits);
- needle accuracy, in both `--modes`: `hf_kvplus.evaluation.needle`'s pass-key prompts of `--context` tokens with
  the key at each `--depths`, greedy `--new-tokens` answers, right when the first number is the key. "aware": the
  whole prompt (the question in it) is the compressed forward; "agnostic" (kvpress's own pipeline): the context is
  compressed, then the question (and the chat template's turn to the assistant) is appended uncompressed.

Writes `compare.json`, `compare.csv`, `compare.md` and `compare.png` into `--out`.

Publishing a run: its folder goes in eval/results/<experiment>/ (the latest run only; eval/README.md), then
`python eval/report.py` rewrites BENCHMARKS.md from it (CI checks the file with `--check`).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

#: kvpress presses compared, by name: (class name, keyword arguments besides compression_ratio).
PRESSES = {
    "kvpress StreamingLLM": ("StreamingLLMPress", {"n_sink": 4}),
    "kvpress SnapKV": ("SnapKVPress", {"window_size": 64}),
    "kvpress ObservedAttention": ("ObservedAttentionPress", {}),
    "kvpress Knorm": ("KnormPress", {}),
    "kvpress TOVA": ("TOVAPress", {}),
    "kvpress ExpectedAttention": ("ExpectedAttentionPress", {}),
    "kvpress KVzip": ("KVzipPress", {}),
    "kvpress KeyDiff": ("KeyDiffPress", {}),
}

#: The example policies (examples/: written outside the package, registered by importing their files).
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def kvplus_specs(budget: int) -> dict[str, str]:
    """hf_kvplus's evicting caches at `budget` tokens, compressing each prompt only (kvpress's setting)."""
    return {
        "hf_kvplus sink (positions=original)": f"sink:4:{budget - 4}:positions=original:compress=prefill",
        "hf_kvplus sink (positions=cache)": f"sink:4:{budget - 4}:compress=prefill",
        "hf_kvplus h2o": f"h2o:{budget}:compress=prefill",
        "hf_kvplus snapkv": f"snapkv:{budget}:observation={min(64, budget // 2)}",  # kvpress's window: 64
        "hf_kvplus snapkv (max over 15)": f"snapkv:{budget}:observation={min(64, budget // 2)}:pooling=max:kernel=15",
        "hf_kvplus kvzip": f"kvzip:{budget}",
        "hf_kvplus knorm (example)": f"knorm:{budget}",  # kvpress's KnormPress
        "hf_kvplus tova (example)": f"tova:{budget}",  # kvpress's TOVAPress
        "hf_kvplus keydiff (example)": f"keydiff:{budget}",  # kvpress's KeyDiffPress
    }


def chosen(names, only: str | None) -> list[str]:
    """The method `names` that `only` (a regular expression, searched) selects; all without it."""
    return [name for name in names if only is None or re.search(only, name)]


# -------------------------------------------------------------------------------- shared by both halves


@torch.no_grad()
def continuation_nll(model, ids: list[int], context: int, half) -> list[float]:
    """NLL of tokens `context ..` of `ids`: the first `context` as one compressed prompt, then one at a time.
    `half` makes a cache for a compressed forward of n tokens (`half.fresh(n)`: the model's keyword arguments that
    pass it, each half knows the name) and runs that forward (`half.prefill`)."""
    tokens = torch.tensor([ids])
    with_cache = half.fresh(context)
    logits = half.prefill(with_cache, ids[:context])
    nll = []
    for t in range(context, tokens.shape[1]):
        nll.append(float(-torch.log_softmax(logits.float(), -1)[ids[t]]))
        if t + 1 < tokens.shape[1]:
            out = model(tokens[:, t : t + 1], **with_cache, position_ids=torch.tensor([[t]]))
            logits = out.logits[0, -1]
    return nll


@torch.no_grad()
def greedy_answer(model, tokenizer, prompt: list[int], new_tokens: int, half, question: int = 0) -> str:
    """`new_tokens` greedy tokens after `prompt`, decoded at the original positions. `question` 0: the prompt is one
    compressed forward (query-aware); else its last `question` tokens are appended uncompressed after the rest was
    compressed (query-agnostic, kvpress's pipeline)."""
    split = len(prompt) - question
    with_cache = half.fresh(split)
    logits = half.prefill(with_cache, prompt[:split])
    if question:
        with half.appending(with_cache):
            logits = model(torch.tensor([prompt[split:]]), **with_cache, position_ids=torch.arange(split, len(prompt))[None],
                           logits_to_keep=1).logits[0, -1]  # fmt: skip
    answer = [int(logits.argmax())]
    for i in range(new_tokens - 1):
        position = torch.tensor([[len(prompt) + i]])
        logits = model(torch.tensor([[answer[-1]]]), **with_cache, position_ids=position).logits[0, -1]
        answer.append(int(logits.argmax()))
    return tokenizer.decode(answer, skip_special_tokens=True)


def is_correct(answer: str, key: str) -> bool:
    """`evaluation.needle.is_correct`, which the kvpress half cannot import."""
    found = re.search(r"\d+", answer)
    return found is not None and found.group() == key


def evaluate(model, tokenizer, inputs: dict, half, new_tokens: int) -> dict:
    """Continuation perplexity and needle answers, per mode, of one method."""
    start = time.perf_counter()
    nll = continuation_nll(model, inputs["text_ids"], inputs["context"], half)
    result = {"continuation_ppl": math.exp(sum(nll) / len(nll))}
    for mode in inputs["modes"]:
        answers = [greedy_answer(model, tokenizer, n["ids"], new_tokens, half, n["question"] if mode == "agnostic" else 0)
                   for n in inputs["needles"]]  # fmt: skip
        right = [is_correct(a, n["key"]) for a, n in zip(answers, inputs["needles"], strict=True)]
        result[f"needle_{mode}"] = sum(right) / len(right)
        result[f"answers_{mode}"] = answers
    result["seconds"] = time.perf_counter() - start
    return result


class Half:
    """How one half makes a cache (`fresh(n)`: the model's keyword arguments for a cache whose compressed forward
    has n tokens), runs the compressed forward (`prefill`: its last logits) and appends uncompressed (`appending`)."""

    def __init__(self, fresh, prefill, appending=lambda with_cache: contextlib.nullcontext()):
        self.fresh, self.prefill, self.appending = fresh, prefill, appending


# -------------------------------------------------------------------------------- the kvpress half


def run_kvpress(inputs_path: Path, model_dir: str, out: Path, new_tokens: int, threads: int,
                only: str | None = None) -> None:
    import kvpress
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.set_num_threads(threads)
    inputs = json.loads(inputs_path.read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    models = {}

    def model_for(attn: str):
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                attn_implementation=attn).eval()  # fmt: skip
        return models[attn]

    def fresh(n):  # kvpress's transformers (< 5.3) takes the cache under this name only
        return {"past_key_values": DynamicCache()}

    rows = []
    for ratio in inputs["ratios"]:
        for name in chosen(PRESSES, only):
            cls, kwargs = PRESSES[name]
            attn = "eager" if cls == "ObservedAttentionPress" else "sdpa"
            model = model_for(attn)
            press = getattr(kvpress, cls)(compression_ratio=ratio, **kwargs)

            def prefill(with_cache, ids, press=press, model=model):
                with press(model):  # (KVzipPress replays the context as the block closes)
                    logits = model(input_ids=torch.tensor([ids]), **with_cache, logits_to_keep=1).logits
                return logits[0, -1]

            result = evaluate(model, tokenizer, inputs, Half(fresh, prefill), new_tokens)
            rows.append({"method": name, "ratio": ratio, **result})
            print(f"{name} r={ratio}: ppl {result['continuation_ppl']:.3f} needle "
                  + " ".join(f"{m} {result[f'needle_{m}']:.0%}" for m in inputs["modes"]), file=sys.stderr, flush=True)
    versions = {"kvpress": getattr(kvpress, "__version__", "0.5.5"), "transformers": __import__("transformers").__version__}
    out.write_text(json.dumps({"versions": versions, "rows": rows}, indent=1))


# -------------------------------------------------------------------------------- the hf_kvplus half


def build_inputs(tokenizer, args) -> dict:
    from hf_kvplus.evaluation.needle import needle_ids, passkey_prompt, prompt_frame
    from hf_kvplus.resolve import load_text

    text = tokenizer(load_text(args.text), add_special_tokens=False)["input_ids"]
    total = args.context + args.continuation
    haystack = text[total : total + args.context]  # the needle prompts' haystack: text after the continuation
    frame = prompt_frame(tokenizer)
    keys = [str(10000 + (7919 * (i + 1)) % 90000) for i in range(len(args.depths))]
    needles = [{"key": key, "depth": depth, "question": len(frame[1]),
                "ids": passkey_prompt(frame, haystack, needle_ids(tokenizer, key), args.context, depth)[0][0].tolist()}
               for key, depth in zip(keys, args.depths, strict=True)]  # fmt: skip
    return {"text_ids": text[:total], "context": args.context, "needles": needles, "ratios": args.ratios,
            "modes": args.modes}  # fmt: skip


def run_kvplus(model, tokenizer, inputs: dict, new_tokens: int, only: str | None = None) -> list[dict]:
    sys.path.insert(0, str(EXAMPLES))
    import keydiff  # noqa: F401 - each registers its policy's spec name
    import knorm  # noqa: F401
    import tova  # noqa: F401
    from tqdm import tqdm
    from transformers import DynamicCache

    from hf_kvplus import EvictingCache, KVzipCache, cache_kwargs
    from hf_kvplus.evaluation.needle import template_prefix
    from hf_kvplus.specs import parse_cache_spec

    def cache_of(with_cache):
        return next(iter(with_cache.values()))

    def prefill(with_cache, ids):
        tokens = torch.tensor([ids])
        logits = model(tokens, **with_cache, logits_to_keep=1).logits[0, -1]
        cache = cache_of(with_cache)
        if isinstance(cache, KVzipCache):  # the user's turn (the question too, when aware) replayed and scored
            cache.compress(model, tokens[:, template_prefix(tokenizer, tokens) :], tokenizer)
        return logits

    def appending(with_cache):
        cache = cache_of(with_cache)
        return cache.appending() if isinstance(cache, EvictingCache) else contextlib.nullcontext()

    def spec_cache(ratio, name):
        def fresh(n):
            return cache_kwargs(parse_cache_spec(kvplus_specs(round((1 - ratio) * n))[name]).build(model.config))

        return fresh

    methods = [("full cache (DynamicCache)", None, lambda n: cache_kwargs(DynamicCache(config=model.config)))]
    methods += [(name, ratio, spec_cache(ratio, name)) for ratio in inputs["ratios"]
                for name in chosen(kvplus_specs(64), only)]  # fmt: skip
    rows = []
    for name, ratio, fresh in tqdm(methods, desc="hf_kvplus", file=sys.stderr):
        rows.append({"method": name, "ratio": ratio, **evaluate(model, tokenizer, inputs, Half(fresh, prefill, appending),
                                                               new_tokens)})  # fmt: skip
    return rows


COLUMNS = [("method", "method", ""), ("ratio", "ratio", ".2f"), ("budget", "budget", "d"),
           ("continuation_ppl", "continuation ppl", ".3f"), ("ppl_delta_pct", "vs full %", "+.2f"),
           ("needle_aware", "needle aware", ".0%"), ("needle_agnostic", "needle agnostic", ".0%"),
           ("seconds", "seconds", ".0f")]  # fmt: skip


def report(rows: list[dict], inputs: dict, args, extra: dict) -> str:
    from hf_kvplus.evaluation.report import format_table, stamp

    full = next(r for r in rows if r["ratio"] is None)
    for row in rows:
        row["budget"] = inputs["context"] if row["ratio"] is None else round((1 - row["ratio"]) * inputs["context"])
        row["ppl_delta_pct"] = 100 * (row["continuation_ppl"] / full["continuation_ppl"] - 1)
    ordered = [full] + sorted((r for r in rows if r is not full), key=lambda r: (r["ratio"], r["method"]))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**stamp(), **extra, "model": args.model, "text": args.text, "context": inputs["context"],
            "continuation": args.continuation, "depths": args.depths, "modes": inputs["modes"]}  # fmt: skip
    (args.out / "compare.json").write_text(json.dumps({**meta, "rows": ordered}, indent=1))
    with open(args.out / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[key for key, _, _ in COLUMNS])
        writer.writeheader()
        writer.writerows({key: row.get(key) for key, _, _ in COLUMNS} for row in ordered)
    table = format_table(ordered, COLUMNS)
    md = (f"{args.model} on {args.text}: prompts of {inputs['context']} tokens compressed once, {args.continuation} "
          f"continuation tokens scored, needle at depths {args.depths} ({', '.join(inputs['modes'])}); {meta['machine']}, {meta['date']}\n\n"
          f"```\n{table}\n```\n")  # fmt: skip
    (args.out / "compare.md").write_text(md)
    plot(ordered, args.out / "compare.png", f"{args.model}: {inputs['context']}-token prompts compressed once",
         inputs["modes"][-1])
    return md


def plot(rows: list[dict], path: Path, title: str, mode: str = "agnostic") -> None:
    """Continuation perplexity against the full cache (lines) and needle accuracy in `mode` (bars), by ratio and
    method; hf_kvplus solid, kvpress dashed and hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    full = next(r for r in rows if r["ratio"] is None)
    methods = list(dict.fromkeys(r["method"] for r in rows if r["ratio"] is not None))
    ratios = sorted({r["ratio"] for r in rows if r["ratio"] is not None})
    colors = plt.get_cmap("tab10")
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        ours = method.startswith("hf_kvplus")
        by_ratio = {r["ratio"]: r for r in rows if r["method"] == method}
        left.plot(ratios, [by_ratio[x]["ppl_delta_pct"] for x in ratios], "-" if ours else "--", marker="o",
                  color=colors(i), label=method)  # fmt: skip
        right.bar([j + (i - (len(methods) - 1) / 2) * width for j in range(len(ratios))],
                  [by_ratio[x][f"needle_{mode}"] for x in ratios], width, color=colors(i),
                  hatch=None if ours else "//", edgecolor="white")  # fmt: skip
    left.axhline(0, color="black", linewidth=0.8)
    right.axhline(full[f"needle_{mode}"], color="black", linewidth=1, linestyle=":", label="full cache")
    left.set(xlabel="compression ratio (fraction of the prompt evicted)", ylabel="continuation perplexity vs full, %",
             xticks=ratios)  # fmt: skip
    right.set(xlabel="compression ratio", ylabel=f"needle accuracy ({mode})", ylim=(0, 1.05), xticks=range(len(ratios)),
              xticklabels=[f"{x:.2f}" for x in ratios])  # fmt: skip
    right.legend(loc="upper right", fontsize=8)
    figure.legend(*left.get_legend_handles_labels(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=("kvplus", "kvpress"), default="kvplus")
    parser.add_argument("--out", type=Path, required=True, help="output folder (kvpress role: the JSON file)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default="austen:emma")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.8])
    parser.add_argument("--modes", nargs="+", choices=("aware", "agnostic"), default=["aware", "agnostic"])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", help="a regular expression: only the methods it finds in their names (both halves; "
                        "the full cache always runs)")
    parser.add_argument("--kvpress-python", default=None, help="the kvpress venv's python; without it, hf_kvplus only")
    parser.add_argument("--inputs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "kvpress":
        run_kvpress(args.inputs, args.model_dir, args.out, args.new_tokens, args.threads, args.only)
        return
    from hf_kvplus.resolve import load_model
    from hf_kvplus.resolve.models import converted_model_dir

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    inputs = build_inputs(tokenizer, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "inputs.json").write_text(json.dumps(inputs))
    rows = run_kvplus(model, tokenizer, inputs, args.new_tokens, args.only)
    extra = {}
    if args.kvpress_python:
        del model
        command = [args.kvpress_python, __file__, "--role", "kvpress", "--inputs", str(args.out / "inputs.json"),
                   "--model-dir", str(converted_model_dir(args.model)), "--out", str(args.out / "kvpress.json"),
                   "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]  # fmt: skip
        command += ["--only", args.only] if args.only else []
        subprocess.run(command, check=True)
        kvpress_result = json.loads((args.out / "kvpress.json").read_text())
        rows += kvpress_result["rows"]
        extra["kvpress_versions"] = kvpress_result["versions"]
    print(report(rows, inputs, args, extra))


if __name__ == "__main__":
    main()
