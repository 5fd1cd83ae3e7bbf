"""A key scale: per layer, KV head and RoPE pair, the factor a rotated format's keys are coded at (`KeyCenter.scale`),
fitted once per model on a text and saved as safetensors (`evaluation/key_scale_fit.py`, `kvplus key-scale`).

Why: scaling a RoPE pair's two key channels by s and the query's by 1/s leaves every logit the same and commutes
with RoPE, while a rotated format's coding error is about isotropic: spent evenly over the pairs, whatever the queries
read of them. With ``s**2 = rms(q) / rms(k)`` a logit's error variance is least; on Gemma 3 270M, whose QK-norm leaves
its full-attention layers' keys long on pairs the queries barely read, that variance falls 5-26 times there (fitted on
one text, measured on another), and k2v2 on every layer went from +57% to +10% perplexity (docs/benchmarks-lowbit.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import PreTrainedConfig
from xxhash import xxh3_64_hexdigest

from .errors import CacheMismatchError, ConfigError, ShapeError
from .kernels.rotated_format import checked_key_scale
from .model_spec import ModelSpec

#: Version of the file layout `KeyScale.save` writes.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class KeyScale:
    """Per layer index, the key scale float32 [KV heads, head_dim] (the two channels of a RoPE pair equal) of one model
    (`model`, `model_type`, `num_layers`: checked against the config a cache is built for); `measured`: how it was
    fitted (text, tokens)."""

    model: str
    model_type: str
    num_layers: int
    scales: dict[int, torch.Tensor]
    measured: dict = field(default_factory=dict)

    def __post_init__(self):
        for index, scale in self.scales.items():
            if not 0 <= index < self.num_layers:
                raise ConfigError(f"key scale names layer {index}, but {self.model} has {self.num_layers} layers")
            try:
                self.scales[index] = checked_key_scale(scale)
            except (ConfigError, ShapeError) as error:
                raise type(error)(f"layer {index}: {error}") from None

    def check(self, config: PreTrainedConfig) -> None:
        """Refuses a model other than the one it was fitted on (type, layer count, each layer's KV heads and head dim)."""
        spec = ModelSpec.from_config(config)
        model_type = getattr(config, "model_type", "")
        name = getattr(config, "_name_or_path", "") or "this model"
        if spec.num_layers != self.num_layers or model_type != self.model_type:
            raise CacheMismatchError(f"the key scale is for {self.model} ({self.model_type}, {self.num_layers} layers); "
                                     f"{name} is {model_type or 'unknown'} with {spec.num_layers} layers")  # fmt: skip
        for index, scale in self.scales.items():
            layer = spec.layers[index]
            if tuple(scale.shape) != (layer.num_kv_heads, layer.head_dim):
                raise CacheMismatchError(f"the key scale of layer {index} is {tuple(scale.shape)}; {name}'s layer {index} "
                                         f"has {layer.num_kv_heads} KV heads of {layer.head_dim}")  # fmt: skip

    def digest(self) -> str:
        """16 hex digits naming the scales (what a paged pool's persistent prefix blocks were coded with)."""
        tensors = [(index, scale.float().contiguous()) for index, scale in sorted(self.scales.items())]
        return xxh3_64_hexdigest(b"".join(str(index).encode() + t.numpy().tobytes() for index, t in tensors))

    def of(self, index: int) -> torch.Tensor | None:
        """Layer `index`'s scale, or None (a layer without one codes its keys as they come)."""
        return self.scales.get(index)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        meta = {"model": self.model, "model_type": self.model_type, "num_layers": self.num_layers,
                "measured": self.measured, "version": FORMAT_VERSION}  # fmt: skip
        tensors = {f"layer.{index}": scale.float().contiguous() for index, scale in sorted(self.scales.items())}
        save_file(tensors, str(path), metadata={"key_scale": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, path: str | Path) -> KeyScale:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"no key scale file at {path}: `kvplus key-scale --model MODEL --out {path.parent}` writes "
                              f"{path.parent / 'key_scale.safetensors'} (--out is a folder)")  # fmt: skip
        try:
            with safe_open(str(path), "pt") as f:
                meta = json.loads((f.metadata() or {})["key_scale"])
                scales = {int(name.split(".")[1]): f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        except (SafetensorError, KeyError, ValueError, IndexError) as error:
            raise ConfigError(f"{path} is not a key scale ({type(error).__name__}: {error})") from None
        version = meta.pop("version", None)
        if version != FORMAT_VERSION:
            raise ConfigError(f"{path}: key scale layout version {version!r}, this hf_kvplus reads {FORMAT_VERSION}")
        return cls(scales=scales, **meta)


def same_key_scale(a: KeyScale | None, b: KeyScale | None) -> bool:
    """Whether two key scales code keys alike: both None, or the same scales of every layer."""
    if a is None or b is None:
        return a is b
    return a.scales.keys() == b.scales.keys() and all(torch.equal(a.scales[i], b.scales[i]) for i in a.scales)

