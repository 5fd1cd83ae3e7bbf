"""Parameter count of a decoder, from its config.

Counted by formula for the families whose layout is known (Llama, Mistral, Qwen2, Qwen3, Gemma 1/2/3):
token embeddings, an untied lm_head, per layer the q/k/v/o projections with the biases the
architecture has (Qwen2: q/k/v biases always; Llama, Qwen3, Gemma: ``attention_bias``), per-head q/k
norms (Qwen3, Gemma 3), the gated MLP (gate, up, down; Llama's ``mlp_bias``), the layer norms (two per
layer, four for Gemma 2/3) and the final norm. Any other model type is instantiated on PyTorch's meta
device (no memory, no weights) and its parameters counted. Multimodal configs count the text decoder
only (`config.get_text_config()`): vision towers and projectors are not included.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedConfig

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class ParameterCount:
    """Parameters of a text decoder, by part. `method` is "formula" or "meta-device model"."""

    embedding: int
    layers: int
    lm_head: int
    final_norm: int
    method: str = "formula"

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.lm_head + self.final_norm


@dataclass(frozen=True)
class _Family:
    qkv_bias: bool | str  # True/False, or the config attribute that decides
    o_bias: bool | str
    mlp_bias: bool | str = False
    qk_norm: bool = False
    norms_per_layer: int = 2


FAMILIES: dict[str, _Family] = {
    "llama": _Family("attention_bias", "attention_bias", "mlp_bias"),
    "mistral": _Family(False, False),
    "qwen2": _Family(True, False),
    "qwen3": _Family("attention_bias", "attention_bias", qk_norm=True),
    "gemma": _Family("attention_bias", "attention_bias"),
    "gemma2": _Family("attention_bias", "attention_bias", norms_per_layer=4),
    "gemma3_text": _Family("attention_bias", "attention_bias", qk_norm=True, norms_per_layer=4),
}


def count_parameters(config: PreTrainedConfig) -> ParameterCount:
    """Parameters of the text decoder of `config`: by formula for known families, else on the meta device."""
    text = config.get_text_config(decoder=True)
    family = FAMILIES.get(getattr(text, "model_type", None))
    if family is None:
        return _count_on_meta_device(text)
    return _count_by_formula(text, family)


def _flag(text: PreTrainedConfig, value: bool | str) -> bool:
    return bool(getattr(text, value, False)) if isinstance(value, str) else value


def _count_by_formula(text: PreTrainedConfig, family: _Family) -> ParameterCount:
    hidden, vocab = text.hidden_size, text.vocab_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim

    attention = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    if _flag(text, family.qkv_bias):
        attention += q_dim + 2 * kv_dim
    if _flag(text, family.o_bias):
        attention += hidden
    if family.qk_norm:
        attention += 2 * head_dim
    inter = text.intermediate_size
    mlp = 3 * hidden * inter + (2 * inter + hidden if _flag(text, family.mlp_bias) else 0)
    norms = family.norms_per_layer * hidden
    layer = attention + mlp + norms

    embedding = vocab * hidden
    tied = getattr(text, "tie_word_embeddings", False)
    return ParameterCount(
        embedding=embedding,
        layers=text.num_hidden_layers * layer,
        lm_head=0 if tied else embedding,
        final_norm=hidden,
    )


def _count_on_meta_device(text: PreTrainedConfig) -> ParameterCount:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(text)
    except Exception as error:  # any failure to build it means: cannot count it
        raise UnsupportedModelError(
            f"cannot count the parameters of model_type {text.model_type!r}: no formula for it (known: "
            f"{', '.join(FAMILIES)}) and building it on the meta device failed: {error}"
        ) from error
    embeddings = model.get_input_embeddings()
    head = model.get_output_embeddings()
    embedding = sum(p.numel() for p in embeddings.parameters()) if embeddings is not None else 0
    shared = head is not None and embeddings is not None and head.weight is embeddings.weight
    lm_head = 0 if head is None or shared else sum(p.numel() for p in head.parameters())
    total = sum(p.numel() for p in model.parameters())
    return ParameterCount(
        embedding=embedding, layers=total - embedding - lm_head, lm_head=lm_head, final_norm=0,
        method="meta-device model",
    )
