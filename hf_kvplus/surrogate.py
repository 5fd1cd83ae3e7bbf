"""KVzap's surrogate (Jegou et al., 2026): per (layer, KV head), a linear model that predicts a token's log KVzip score
from its own key and value, fitted offline (`kvplus train-surrogate`) and saved as safetensors.

KVzip scores a context by a second forward that repeats it (`KVzipCache`): more than twice a prefill. A token's
score is mostly a property of the token, which its key and value carry (both are linear projections of the layer's
normed hidden state), so a model fitted on those predicts it at the cost of one small matrix product per layer.
A surrogate holds for one model: `check` refuses another.

KVzip shares one budget among the layers by their scores together (one top-k over every layer and head), and on
SmolLM2-135M that matters more than the per-head ranking (a pass key at 20%: 3 of 5 with shared budgets, 0 of 5 with a
budget per layer, same true scores). A layer's share is mostly a property of the layer, so the fit records it too:
`shares[i, l]` is layer l's budget, as a multiple of the mean, when the true KVzip scores of the fitted texts are
ranked together and `KEEP_GRID[i]` of them kept. A cache then sizes each layer at its prefill without waiting for the
others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import PreTrainedConfig

from .errors import CacheMismatchError, ConfigError
from .model_spec import ModelSpec

#: Version of the layout `Surrogate.save` writes.
FORMAT_VERSION = 1
#: What a surrogate reads of a token, per KV head: "rope_kv" its key as cached (after RoPE), the same key rotated back
#: to position 0 (before RoPE: a linear map of the layer's normed hidden state) and its value. Measured on SmolLM2-135M
#: (eval/results/kvzap/features.md): the three together rank best, the key after RoPE alone next.
FEATURES = ("rope_kv",)
#: Kept fractions of a context (0.01 .. 1) at which a surrogate records each layer's share of one budget over every
#: layer (`Surrogate.shares`).
KEEP_GRID = tuple(round(0.01 * i, 2) for i in range(1, 101))


@dataclass(frozen=True)
class Surrogate:
    """`weights` `[layers, kv_heads, features + 1]` float32 (the last column the intercept) predict a token's log
    KVzip score from `features` (`FEATURES`) of its key and value, for the model `model` (`model_type`, `num_layers`
    layers of `kv_heads` KV heads of `head_dim`); `shares` `[len(KEEP_GRID), layers]` are the layers' shares of one
    budget (see the module's docstring; each row's mean over the full-attention layers is 1, a sliding-window
    layer's share 0); `measured` records how it was fitted and how well it
    ranks."""

    model: str
    model_type: str
    num_layers: int
    kv_heads: int
    head_dim: int
    features: str
    weights: torch.Tensor
    shares: torch.Tensor
    measured: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.features not in FEATURES:
            raise ConfigError(f"surrogate features must be one of {FEATURES}, got {self.features!r}")
        want = (self.num_layers, self.kv_heads, feature_size(self.head_dim) + 1)
        if tuple(self.weights.shape) != want:
            raise ConfigError(
                f"surrogate weights for {self.num_layers} layers x {self.kv_heads} KV heads of {self.features!r} "
                f"features (head_dim {self.head_dim}) are {want}, got {tuple(self.weights.shape)}"
            )
        if tuple(self.shares.shape) != (len(KEEP_GRID), self.num_layers):
            raise ConfigError(
                f"surrogate shares are [{len(KEEP_GRID)} kept fractions, {self.num_layers} layers], got "
                f"{tuple(self.shares.shape)}"
            )

    def check(self, config: PreTrainedConfig) -> None:
        """Refuses a model other than the one it was fitted on (by type, layers, KV heads and head size)."""
        spec = ModelSpec.from_config(config)
        model_type = getattr(config, "model_type", "")
        geometry = {(layer.num_kv_heads, layer.head_dim) for layer in spec.layers}
        if (model_type, spec.num_layers, geometry) != (self.model_type, self.num_layers,
                                                       {(self.kv_heads, self.head_dim)}):  # fmt: skip
            name = getattr(config, "_name_or_path", "") or "this model"
            raise CacheMismatchError(
                f"the surrogate is for {self.model} ({self.model_type}, {self.num_layers} layers of {self.kv_heads} KV "
                f"heads x {self.head_dim}); {name} is {model_type or 'unknown'} with {spec.num_layers} layers of "
                f"(kv_heads, head_dim) {sorted(geometry)}: fit one for it with `kvplus train-surrogate --model MODEL`"
            )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        meta = {"model": self.model, "model_type": self.model_type, "num_layers": self.num_layers,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "features": self.features,
                "measured": self.measured, "version": FORMAT_VERSION}  # fmt: skip
        tensors = {"weights": self.weights.float().contiguous(), "shares": self.shares.float().contiguous()}
        save_file(tensors, str(path), metadata={"kvzap": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, path: str | Path) -> Surrogate:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"no surrogate file at {path}: `kvplus train-surrogate --model MODEL --out {path.parent}` "
                              f"writes {path.parent / 'surrogate.safetensors'} (--out is a folder); without --out it "
                              "writes where KVzapCache(config) finds it")  # fmt: skip
        try:
            with safe_open(str(path), "pt") as f:
                meta = json.loads((f.metadata() or {})["kvzap"])
                weights, shares = f.get_tensor("weights"), f.get_tensor("shares")
        except (SafetensorError, KeyError, ValueError) as error:
            raise ConfigError(f"{path} is not a KVzap surrogate ({type(error).__name__}: {error})") from None
        version = meta.pop("version", None)
        if version != FORMAT_VERSION:
            raise ConfigError(f"{path}: surrogate layout version {version!r}, this hf_kvplus reads {FORMAT_VERSION}")
        return cls(weights=weights, shares=shares, **meta)


def feature_size(head_dim: int) -> int:
    """How many numbers "rope_kv" reads of one token (a key twice and a value, `head_dim` each)."""
    return 3 * head_dim
