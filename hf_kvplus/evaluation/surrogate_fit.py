"""Fitting a KVzap surrogate (`Surrogate`): KVzip's true scores of some texts, then ridge regression per (layer, KV
head) of each token's log score on its features (`eviction.kvzap.kvzap_features`), solved with torch.linalg, and the
layers' shares of one budget that KVzip's one top-k over every layer gives them at each kept fraction (`KEEP_GRID`).

The true scores come from a `KVzipCache` whose budget is the whole chunk: its reconstruction scores every token and
evicts none, so the slots still hold each token's key, value, position and score. Fit on texts other than the ones
you evaluate on (the needle's haystack is Pride and Prejudice; the default texts are Persuasion and Emma). Austen's
novels hold almost no numbers, which KVzip keeps in the heads that copy them (a pass key): `with_numbers` sprinkles
random ones into a chunk so that the fit sees some (on SmolLM2-135M, a pass key at 20% of a 2048-token context: 0 of 5
found without them, 2 of 5 with a third of the chunks so).
"""

from __future__ import annotations

import random

import torch
from tqdm.auto import tqdm

from ..errors import ConfigError
from ..eviction.kvzap import kvzap_features, predict
from ..eviction.rope import RotaryShift
from ..kvzip_cache import KVzipCache, RepeatPrompt
from ..model_spec import ModelSpec
from ..surrogate import KEEP_GRID, Surrogate, feature_size
from ..transformers_compat import cache_kwargs

#: Positions left out of the fit and the measures: the sinks, which every cache keeps whatever their score.
SKIPPED = 4
#: Smallest score whose log is fitted (KVzip's scores are attention weights, ~1e-6 at least on SmolLM2).
FLOOR = 1e-8


def kvzip_targets(model, tokenizer, ids: torch.Tensor, prompt: RepeatPrompt | None = None
                  ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Per full-attention layer (by index; a hybrid model's sliding-window layers are not scored), (features
    `[kv_heads, n, f]`, log KVzip scores `[kv_heads, n]`) of the tokens of `ids` `[1, n]` past the first `SKIPPED`:
    one prefill and one reconstruction (`KVzipCache.compress`, its instruction `prompt` or the tokenizer's) that
    evicts nothing."""
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] <= SKIPPED + 1:
        raise ConfigError(f"a scored chunk is [1, n] token ids with n > {SKIPPED + 1}, got shape {tuple(ids.shape)}")
    cache = KVzipCache(model.config, budget=ids.shape[1], budgets="uniform")
    ids = ids.to(model.device)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache), logits_to_keep=1)
        cache.compress(model, ids, tokenizer, prompt=prompt)
    rotary = RotaryShift.from_config(model.config)
    out = {}
    for layer in cache.layers:
        if layer.spec.kind != "full":
            continue
        store = layer.storage
        keys, values = store.slots()
        features = kvzap_features(keys, values, store.positions, rotary)[0, :, SKIPPED:]
        out[layer.spec.index] = (features, store.scores[0, :, SKIPPED:].clamp_min(FLOOR).log())
    return out


def with_numbers(ids: list[int], tokens: int, every: int, tokenizer, seed: int = 0) -> torch.Tensor:
    """`[1, tokens]`: `ids` (1-d, long enough) with a random five-digit number (" 48213", as the tokenizer encodes it)
    after every `every / 2 .. 3 every / 2` tokens, cut at `tokens`."""
    if every < 2:
        raise ConfigError(f"numbers go every >= 2 tokens, got every={every}")
    rng, out, at = random.Random(seed), [], 0
    while len(out) < tokens:
        if at >= len(ids):
            raise ConfigError(f"{len(ids)} tokens of text do not fill a chunk of {tokens} with numbers")
        step = rng.randint(every // 2, every * 3 // 2)
        out += list(ids[at : at + step])
        out += tokenizer(f" {rng.randint(10000, 99999)}", add_special_tokens=False)["input_ids"]
        at += step
    return torch.tensor([out[:tokens]])


def fit_surrogate(model, tokenizer, chunks: list[torch.Tensor], *, name: str, ridge: float = 1e-3,
                  measured: dict | None = None, prompt: RepeatPrompt | None = None) -> Surrogate:  # fmt: skip
    """A `Surrogate` for `model` (called `name`) fitted on the KVzip scores of `chunks` (each `[1, n]` token ids):
    per (layer, KV head), least squares with an intercept and a ridge of `ridge` x the mean of the normal matrix's
    diagonal (the intercept unpenalized), accumulated over the chunks in float64; the shares are `layer_shares` of
    the true scores, averaged over the chunks weighted by their tokens. On a hybrid model only the full-attention
    layers are fitted (the sliding-window ones keep their window: their weights and shares are 0)."""
    spec = ModelSpec.from_config(model.config)
    geometry = {(layer.num_kv_heads, layer.head_dim) for layer in spec.layers}
    if len(geometry) != 1:
        raise ConfigError(f"a surrogate serves layers of one (kv_heads, head_dim); this model has {sorted(geometry)}")
    if not chunks:
        raise ConfigError("fitting a surrogate needs at least one chunk of text")
    heads, head_dim = geometry.pop()
    size = feature_size(head_dim) + 1
    gram = torch.zeros(spec.num_layers, heads, size, size, dtype=torch.float64)
    moment = torch.zeros(spec.num_layers, heads, size, dtype=torch.float64)
    shares = torch.zeros(len(KEEP_GRID), spec.num_layers, dtype=torch.float64)
    tokens = 0
    full = [layer.index for layer in spec.layers if layer.kind == "full"]
    for ids in tqdm(chunks, desc="kvzip scores", unit="chunk"):
        targets = kvzip_targets(model, tokenizer, ids, prompt)
        for index, (features, target) in targets.items():
            x = torch.cat((features, features.new_ones(*features.shape[:2], 1)), dim=-1).double().cpu()
            gram[index] += x.transpose(1, 2) @ x
            moment[index] += (x.transpose(1, 2) @ target.double().cpu()[..., None])[..., 0]
        shares[:, full] += ids.shape[1] * layer_shares(torch.stack([targets[i][1].cpu() for i in full]))
        tokens += ids.shape[1]
    weights = torch.zeros(spec.num_layers, heads, size)
    weights[full] = ridge_solve(gram[full], moment[full], ridge)
    record = {"chunks": len(chunks), "tokens": tokens, "ridge": ridge, "fitted_layers": full, **(measured or {})}
    return Surrogate(name, getattr(model.config, "model_type", ""), spec.num_layers, heads, head_dim, "rope_kv",
                     weights, (shares / tokens).float(), record)  # fmt: skip


def ridge_solve(gram: torch.Tensor, moment: torch.Tensor, ridge: float) -> torch.Tensor:
    """float32 weights `[..., f + 1]` of least squares from the normal equations (`gram` `[..., f + 1, f + 1]` and
    `moment` `[..., f + 1]` of features with a last column of ones, float64), with a ridge of `ridge` x the mean of
    the features' diagonal entries; the intercept (last) is not penalized."""
    penalty = ridge * gram.diagonal(dim1=-2, dim2=-1)[..., :-1].mean(-1)[..., None, None]
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype)
    eye[-1, -1] = 0
    return torch.linalg.solve(gram + penalty * eye, moment[..., None])[..., 0].float()


def layer_shares(scores: torch.Tensor) -> torch.Tensor:
    """`[len(KEEP_GRID), layers]`: for scores `[layers, kv_heads, n]` ranked together, the tokens each layer holds in
    the top `KEEP_GRID[i]` of all, over the mean per layer (KVzip's global budgets as multiples of a uniform one)."""
    layers = scores.shape[0]
    owner = torch.arange(layers).repeat_interleave(scores[0].numel())
    order = owner[scores.flatten().argsort(descending=True, stable=True)]
    out = []
    for keep in KEEP_GRID:
        count = max(1, round(keep * order.numel()))
        out.append(order[:count].bincount(minlength=layers).double() * layers / count)
    return torch.stack(out)


def ranking_quality(surrogate: Surrogate, model, tokenizer, chunks: list[torch.Tensor], keep: float = 0.2,
                    prompt: RepeatPrompt | None = None) -> dict:  # fmt: skip
    """How well `surrogate` ranks the tokens of `chunks` against their true KVzip scores, per (layer, KV head):
    Spearman's rank correlation and the share of the true top `keep` that the predicted top `keep` holds (recall),
    each averaged over layers, heads and chunks; and the worst layer's mean of each."""
    surrogate.check(model.config)
    spearman, recall = [], []
    for ids in chunks:
        for index, (features, target) in kvzip_targets(model, tokenizer, ids, prompt).items():
            guess = predict(features[None], surrogate.weights[index].to(features.device))[0]
            spearman.append(_spearman(guess, target))
            recall.append(_recall(guess, target, keep))
    layers = len(spearman) // len(chunks)  # (the scored ones)
    spearman, recall = torch.stack(spearman).view(-1, layers, surrogate.kv_heads), torch.stack(recall).view(
        -1, layers, surrogate.kv_heads)  # fmt: skip
    return {"spearman": spearman.mean().item(), "recall": recall.mean().item(), "keep": keep,
            "worst_layer_spearman": spearman.mean((0, 2)).min().item(),
            "worst_layer_recall": recall.mean((0, 2)).min().item()}  # fmt: skip


def _spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rank correlation of each row of `a` with the same row of `b` (`[heads, n]` each)."""
    ra, rb = (x.argsort(-1).argsort(-1).double() for x in (a, b))
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


def _recall(guess: torch.Tensor, truth: torch.Tensor, keep: float) -> torch.Tensor:
    """Per row: the share of `truth`'s top `keep` that `guess`'s top `keep` holds."""
    k = max(1, round(keep * truth.shape[-1]))
    top = torch.zeros_like(truth, dtype=torch.bool).scatter_(-1, truth.topk(k).indices, True)
    return top.gather(-1, guess.topk(k).indices).double().mean(-1)
