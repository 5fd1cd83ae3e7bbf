"""Tiny random models for the conformance suite, built from configs (no hub access, no downloads).

One per architecture family whose cache layout a KV cache has to serve:

- ``llama``   every layer full attention, GQA (4 query heads, 2 KV heads).
- ``mistral`` every layer sliding-window attention (window ``SLIDING_WINDOW``).
- ``qwen2``   hybrid: full and sliding layers mixed through ``layer_types`` (first layer sliding, so the first full layer
              is not layer 0).
- ``gemma3``  Gemma 3 text: sliding and full layers, one KV head, head_dim 32, ``query_pre_attn_scalar``, its own
              embedding scaling and separate local/global RoPE.

All float32, ``eval()``, ``attn_implementation="sdpa"``, weights from a fixed seed. ``initializer_range`` is raised
from the usual 0.02 to ``INIT_RANGE``: with 0.02 the residual stream of a tiny model is dominated by the current
token's embedding, the attention (hence the KV cache) barely moves the logits, and a broken cache could hide inside
the tolerance. With ``INIT_RANGE`` changing one context token moves the last logits by O(1).

Each architecture also has an assistant model for assisted decoding: same family and vocabulary, one layer fewer,
its weights copied from the main model's first layers, embeddings, final norm and head (a LayerSkip-style
self-speculative draft). An assistant with weights from another seed never agrees with a random main model
(measured: every draft token rejected on all four architectures), so the verification paths that keep part of a
multi-token draft (``crop(-k)`` with ``0 < k < n_draft``, ``crop(0)`` after a fully accepted draft) would never run;
the truncated copy gives a mix of full, partial and no acceptance. Its generation config is pinned so that every
assisted ``generate`` drafts the same way: ``num_assistant_tokens_schedule="constant"`` (the default
``"heuristic"`` writes the adapted draft length back into ``assistant.generation_config`` at the end of each call, so
two runs in a row would draft differently), ``num_assistant_tokens=3`` and ``assistant_confidence_threshold=0``
(the default 0.4 stops a low-confidence random draft after one token).

Models are built once per process (``functools.cache``); tests must not modify them.
"""

from __future__ import annotations

import functools

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "gemma3")

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
#: Token ids the prompts may use (no pad / bos / eos).
FIRST_ORDINARY_TOKEN = 3

SLIDING_WINDOW = 8
INIT_RANGE = 0.2
MODEL_SEED = 1234
NUM_ASSISTANT_TOKENS = 3

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=256,
    initializer_range=INIT_RANGE,
    pad_token_id=PAD_TOKEN_ID,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    tie_word_embeddings=False,
)

_FAMILIES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}

# layer_types of the hybrid models (the first layer is sliding, so the first full layer is not layer 0)
_LAYER_TYPES = {
    "qwen2": ["sliding_attention", "full_attention", "sliding_attention"],
    "gemma3": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
}


def make_config(arch: str, *, assistant: bool = False) -> PretrainedConfig:
    """The config of the tiny main model (or of its assistant) of architecture ``arch``."""
    if arch not in _FAMILIES:
        raise ValueError(f"unknown architecture {arch!r}; known: {ARCHITECTURES}")
    config_cls, _ = _FAMILIES[arch]
    if arch == "llama":
        kwargs = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    elif arch == "mistral":
        kwargs = dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=SLIDING_WINDOW,
        )
    elif arch == "qwen2":
        layer_types = _LAYER_TYPES[arch]
        kwargs = dict(
            num_hidden_layers=len(layer_types),
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW,
            max_window_layers=0,
            layer_types=list(layer_types),
        )
    else:  # gemma3
        layer_types = _LAYER_TYPES[arch]
        kwargs = dict(
            num_hidden_layers=len(layer_types),
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=SLIDING_WINDOW,
            layer_types=list(layer_types),
        )
    if assistant:  # the first layers of the main model
        kwargs["num_hidden_layers"] -= 1
        if "layer_types" in kwargs:
            kwargs["layer_types"] = kwargs["layer_types"][: kwargs["num_hidden_layers"]]
    config = config_cls(**_COMMON, **kwargs)
    config._attn_implementation = "sdpa"
    return config


def build_model(arch: str, *, seed: int = MODEL_SEED) -> PreTrainedModel:
    """A fresh tiny random main model (not cached): float32, eval(), sdpa, weights from ``seed``."""
    _, model_cls = _FAMILIES[arch]
    config = make_config(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return _finish(model)


def build_assistant(main: PreTrainedModel, arch: str) -> PreTrainedModel:
    """A fresh assistant for ``main``: its first ``n - 1`` layers, embeddings, final norm and head (copied)."""
    _, model_cls = _FAMILIES[arch]
    config = make_config(arch, assistant=True)
    dropped = f"model.layers.{config.num_hidden_layers}."
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED + 1)
        assistant = model_cls(config)
    state = {k: v for k, v in main.state_dict().items() if not k.startswith(dropped)}
    assistant.load_state_dict(state, strict=True)
    assistant = _finish(assistant)
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.num_assistant_tokens = NUM_ASSISTANT_TOKENS
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return assistant


def _finish(model: PreTrainedModel) -> PreTrainedModel:
    model = model.to(torch.float32).eval()
    model.requires_grad_(False)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


@functools.cache
def get_model(arch: str) -> PreTrainedModel:
    """The main tiny model of ``arch``, built once per process."""
    return build_model(arch)


@functools.cache
def get_assistant(arch: str) -> PreTrainedModel:
    """The assistant model of ``arch`` for assisted decoding, built once per process."""
    return build_assistant(get_model(arch), arch)


def layer_kinds(config: PretrainedConfig) -> list[str]:
    """Per layer ``"sliding(W)"`` or ``"full"``, as `DynamicCache(config=...)` lays the cache out."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    return [
        f"sliding({layer.sliding_window})" if getattr(layer, "is_sliding", False) else "full"
        for layer in cache.layers
    ]
