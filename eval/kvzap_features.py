"""Which features of a token predict its KVzip score best (the choice behind `Surrogate`'s "rope_kv" features).

    # 1. true KVzip scores, keys, values, positions and each layer's attention input (hidden state) per chunk
    python eval/kvzap_features.py collect austen:persuasion 0 2048 /tmp/kvzap/persuasion_0.pt
    # 2. ridge per (layer, KV head) on the train chunks, measured on the test chunks
    python eval/kvzap_features.py evaluate TRAIN.pt,... TEST.pt,... post,pre,pairs,pre+logpos,post+pre,hidden 1e-2

Feature sets: `post` the key as cached (after RoPE) and the value; `pre` the key rotated back to position 0 and the
value; `pairs` the norms of the key's rotary pairs (RoPE-invariant) and the value; `pre+logpos` `pre` and log(1 +
position); `post+pre` both keys and the value (`Surrogate`'s "rope_kv"); `hidden` the layer's normed hidden state (a
forward hook: what KVzap's own surrogate reads). Measured per (layer, KV head) on the test chunks, the first 4
positions (sinks) left out: Spearman's rank correlation and the recall of the true top 20%, averaged; the worst
layer's Spearman; and both over every layer and head ranked together ("global"). Results:
eval/results/kvzap/features.md.
"""

from __future__ import annotations

import sys

import torch

from hf_kvplus import KVzipCache, cache_kwargs
from hf_kvplus.evaluation.surrogate_fit import ridge_solve
from hf_kvplus.eviction.rope import RotaryShift
from hf_kvplus.resolve import load_model, load_text

SINKS = 4


def collect(text: str, start: int, n: int, out: str) -> None:
    model, tok = load_model("smollm2-135m")
    ids = tok(load_text(text), return_tensors="pt", add_special_tokens=False)["input_ids"][:, start : start + n]
    hidden = {}

    def hook(index):
        def keep(module, args, kwargs):
            hidden.setdefault(index, kwargs["hidden_states"][0].detach().clone())

        return keep

    hooks = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
             for i, layer in enumerate(model.model.layers)]  # fmt: skip
    cache = KVzipCache(model.config, budget=n, budgets="uniform")
    with torch.no_grad():
        model(ids, **cache_kwargs(cache), logits_to_keep=1)
    for h in hooks:
        h.remove()
    cache.compress(model, ids, tok)  # the whole chunk is the budget: every token scored, none evicted
    records = []
    for i, layer in enumerate(cache.layers):
        store = layer.storage
        keys, values = store.held_view()
        records.append({"keys": keys[0].clone(), "values": values[0].clone(), "pos": store.positions[0].clone(),
                        "scores": store.scores[0].clone(), "hidden": hidden[i]})  # fmt: skip
    torch.save(records, out)


def features(record: dict, kind: str, rotary: RotaryShift) -> torch.Tensor:
    keys, values, pos = record["keys"].float(), record["values"].float(), record["pos"]
    pre = rotary.unturned(keys[None], pos[None])[0]
    half = keys.shape[-1] // 2
    pairs = torch.hypot(keys[..., :half], keys[..., half:])
    logpos = torch.log1p(pos.float())[..., None]
    return {"post": lambda: torch.cat([keys, values], -1), "pre": lambda: torch.cat([pre, values], -1),
            "pairs": lambda: torch.cat([pairs, values], -1), "pre+logpos": lambda: torch.cat([pre, values, logpos], -1),
            "post+pre": lambda: torch.cat([keys, pre, values], -1),
            "hidden": lambda: record["hidden"].float()[None].expand(keys.shape[0], -1, -1)}[kind]()  # fmt: skip


def fit(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    xb = torch.cat([x, torch.ones_like(x[..., :1])], -1).double()
    return ridge_solve(xb.transpose(1, 2) @ xb, (xb.transpose(1, 2) @ y.double()[..., None])[..., 0], ridge)


def spearman(a, b):
    ra, rb = (x.argsort(-1).argsort(-1).float() for x in (a, b))
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


def recall(guess, truth, keep=0.2):
    k = int(keep * truth.shape[-1])
    top = torch.zeros_like(truth, dtype=torch.bool).scatter_(-1, truth.topk(k).indices, True)
    return top.gather(-1, guess.topk(k).indices).float().mean(-1)


def evaluate(train_files: str, test_files: str, kinds: str, ridge: float) -> None:
    model, _ = load_model("smollm2-135m")
    rotary = RotaryShift.from_config(model.config)
    train, test = ([torch.load(f) for f in files.split(",")] for files in (train_files, test_files))

    def xy(chunks, layer, kind):
        x = torch.cat([features(c[layer], kind, rotary)[:, SINKS:] for c in chunks], 1)
        return x, torch.cat([c[layer]["scores"][:, SINKS:].clamp_min(1e-6).log() for c in chunks], 1)

    print("| features | Spearman | worst layer | recall of the top 20% | global recall | global Spearman |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for kind in kinds.split(","):
        rho, rec, guesses, truths = [], [], [], []
        for layer in range(len(train[0])):
            weights = fit(*xy(train, layer, kind), ridge)
            x, y = xy(test, layer, kind)
            guess = (torch.cat([x, torch.ones_like(x[..., :1])], -1) @ weights[..., None])[..., 0]
            rho.append(spearman(guess, y))
            rec.append(recall(guess, y))
            guesses.append(guess)
            truths.append(y)
        rho, rec = torch.stack(rho), torch.stack(rec)
        guess, truth = torch.cat(guesses).flatten(), torch.cat(truths).flatten()
        print(f"| {kind} | {rho.mean():.3f} | {rho.mean(1).min():.3f} | {rec.mean():.3f} | {recall(guess, truth):.3f} | "
              f"{spearman(guess, truth):.3f} |")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "collect":
        collect(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        evaluate(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
