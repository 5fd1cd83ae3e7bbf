"""Every decoder architecture of Transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, as a tiny random model.

`tiny_model(model_type)` builds one from the architecture's default config, shrunk through the arguments its config
class knows (2 layers of width 64, 4 query and 2 KV heads of 16 dims, 128 tokens, 4 experts of which 2 are routed,
small MLA ranks, the conformance models' initializer range and special tokens, `is_decoder` for the BERT family's
causal-LM heads); a `layer_types` list keeps one
layer of every kind the default has, so hybrid models keep their attention and their other layers. What cannot
be swept says why (`Skipped`): encoder-decoder models, models that keep no `transformers.Cache` (recurrent state
only), multimodal wrappers (their text decoder is swept under its own name where Transformers has one), and
configs the generic shrink cannot make small or runnable, each with the error.
"""

from __future__ import annotations

import functools
import warnings

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .models import BOS_TOKEN_ID, EOS_TOKEN_ID, INIT_RANGE, MODEL_SEED, PAD_TOKEN_ID, VOCAB_SIZE

#: Every causal-LM model type, sorted.
MODEL_TYPES: tuple[str, ...] = tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
#: A tiny model has at most this many parameters (an architecture whose shrink leaves more is skipped).
MAX_PARAMETERS = 5_000_000

_SHRINK = {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 256,
    "initializer_range": INIT_RANGE, "pad_token_id": PAD_TOKEN_ID, "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID, "tie_word_embeddings": False, "is_decoder": True,
    # mixtures of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "top_k": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    # multi-head latent attention
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    # partial rotary, windows
    "rotary_dim": 8, "sliding_window": 8, "attention_chunk_size": 8, "window_size": 8, "sliding_window_size": 8,
    # per-layer and auxiliary embeddings, wide feed-forwards of other names
    "vocab_size_per_layer_input": VOCAB_SIZE, "hidden_size_per_layer_input": 16, "unpadded_vocab_size": VOCAB_SIZE,
    "pronunciation_vocab_size": 32, "pronunciation_embed_dim": 32, "shape_vocab_size": 32, "shape_embed_dim": 32,
    "ffn_hidden_size": 128, "expert_ffn_hidden_size": 64, "shared_experts_intermediate_size": 64,
    "router_hidden_size": 32, "index_topk": 8,
}  # fmt: skip


class Skipped(Exception):
    """An architecture the sweep does not run, and why."""


def _wrapper_reason(config: PretrainedConfig) -> str | None:
    towers = [name for name in ("vision_config", "audio_config", "vq_config", "speech_config") if hasattr(config, name)]
    if not towers:
        return None
    text = next((t for t in MODEL_TYPES if t == f"{config.model_type}_text"), None)
    covered = f"; its text decoder is swept as {text!r}" if text else ""
    return f"multimodal wrapper ({', '.join(towers)}){covered}"


def _layer_types(default: list[str]) -> list[str]:
    """One layer of each kind in `default`, in order of first appearance, at least two layers."""
    kinds = list(dict.fromkeys(default))
    return kinds + kinds[-1:] * max(0, 2 - len(kinds))


@functools.cache
def tiny_config(model_type: str) -> PretrainedConfig:
    """The shrunk config of `model_type` (raises `Skipped` with the reason where there is none to sweep)."""
    cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            default = cls()
        except Exception as error:  # (a config class whose defaults do not validate)
            raise Skipped(f"no default config: {type(error).__name__}: {_first_line(error)}") from None
        if getattr(default, "is_encoder_decoder", False):
            raise Skipped("encoder-decoder")
        reason = _wrapper_reason(default)
        if reason:
            raise Skipped(reason)
        settable = [
            name for name in _SHRINK if _has(default, name) and not isinstance(getattr(cls, name, None), property)
        ]
        kwargs = {name: _SHRINK[name] for name in settable}
        if _has(default, "kv_lora_rank"):  # latent attention: every head has its keys; head_dim is derived
            kwargs.pop("head_dim", None)
            kwargs.pop("num_key_value_heads", None)
        kinds = getattr(default, "layer_types", None)
        if isinstance(kinds, list) and kinds and not isinstance(getattr(cls, "layer_types", None), property):
            kwargs["layer_types"] = _layer_types(kinds)
            kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
        try:
            return cls(**kwargs)
        except Exception as error:  # the generic shrink broke a constraint of this config class
            raise Skipped(f"no tiny config: {type(error).__name__}: {_first_line(error)}") from None


def _has(config: PretrainedConfig, name: str) -> bool:
    """`hasattr`, for configs whose per-layer attributes refuse a global read (they count as present)."""
    try:
        return hasattr(config, name)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError: it varies across layers
        return True


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0][:160]


@functools.cache
def tiny_model(model_type: str) -> PreTrainedModel:
    """A tiny random float32 model of `model_type` (built once; tests must not modify it)."""
    config = tiny_config(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):
                size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        except Exception as error:
            raise Skipped(f"does not build: {type(error).__name__}: {_first_line(error)}") from None
        if size > MAX_PARAMETERS:
            raise Skipped(f"{size / 1e6:.0f}M parameters after the generic shrink (> {MAX_PARAMETERS / 1e6:.0f}M)")
        torch.manual_seed(MODEL_SEED)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            caches = model._supports_default_dynamic_cache()
        except Exception as error:
            raise Skipped(f"does not build: {type(error).__name__}: {_first_line(error)}") from None
    if not caches:
        raise Skipped("keeps no transformers.Cache (recurrent state only)")
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model
