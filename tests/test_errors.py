"""Models a cache cannot serve, and caches used on the wrong model, fail early with typed errors."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conformance.models import build_model, make_config
from hf_kvplus import CacheMismatchError, DenseCache, KVPlusError, UnsupportedModelError, cache_kwargs


def llama_config(**overrides):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1)
    return LlamaConfig(**{**base, **overrides})


def test_errors_share_one_base():
    assert issubclass(UnsupportedModelError, KVPlusError) and issubclass(CacheMismatchError, KVPlusError)


def test_kernel_errors_are_the_packages_errors():
    """The kernels define the errors they raise (they import nothing above them); hf_kvplus.errors re-exports the
    very classes, so an ``except hf_kvplus.errors.ShapeError`` catches a kernel's."""
    from hf_kvplus import errors
    from hf_kvplus.kernels import errors as kernel_errors

    for name in ("KVPlusError", "ConfigError", "ShapeError", "DTypeError", "DeviceError", "KernelUnavailableError"):
        assert getattr(errors, name) is getattr(kernel_errors, name)
    assert issubclass(errors.ShapeError, ValueError) and issubclass(errors.DTypeError, TypeError)
    assert issubclass(errors.KernelUnavailableError, RuntimeError) and issubclass(errors.DeviceError, KVPlusError)


def test_model_without_attention_layers_is_refused():
    config = llama_config()
    config.layer_types = ["mlp", "mlp"]
    with pytest.raises(UnsupportedModelError, match="none of its 2 layers is an attention layer"):
        DenseCache(config=config)


def test_layer_types_hf_kvplus_cannot_hold_are_refused():
    config = llama_config()
    config.layer_types = ["hybrid", "full_attention"]
    with pytest.raises(UnsupportedModelError, match=r"\['hybrid'\] \(of 2 layers\)"):
        DenseCache(config=config)
    config.layer_types = ["linear_attention", "linear_attention"]
    with pytest.raises(UnsupportedModelError, match="none of its 2 layers is an attention layer"):
        DenseCache(config=config)


def test_linear_attention_layers_get_transformers_own_layer():
    """A linear-attention hybrid's recurrent layers keep Transformers' LinearAttentionLayer (as DynamicCache does);
    hf_kvplus holds the attention layers (the sweep runs real hybrids: test_architectures.py)."""
    from transformers.cache_utils import LinearAttentionLayer

    from hf_kvplus import KVLayer

    config = llama_config()
    config.layer_types = ["linear_attention", "full_attention"]
    cache = DenseCache(config=config)
    assert type(cache.layers[0]) is LinearAttentionLayer and type(cache.layers[1]) is KVLayer


def test_head_dim_outside_the_kernels_range_is_refused():
    with pytest.raises(UnsupportedModelError, match="head_dim 512 is outside the 16..256 range"):
        DenseCache(config=llama_config(head_dim=512))


def test_query_heads_must_be_a_multiple_of_kv_heads():
    with pytest.raises(UnsupportedModelError, match="3 query heads are not a multiple of 2 KV heads"):
        DenseCache(config=llama_config(hidden_size=48, num_attention_heads=3, num_key_value_heads=2))


def test_cache_for_another_models_heads_fails_at_the_first_call():
    cache = DenseCache(config=make_config("llama"))
    gemma = build_model("gemma3")
    with pytest.raises(CacheMismatchError, match="built for 2 KV heads of head_dim 16"):
        gemma.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, **cache_kwargs(cache))


def test_cache_for_fewer_layers_fails_at_the_first_call():
    cache = DenseCache(config=llama_config(num_hidden_layers=1))
    model = LlamaForCausalLM(llama_config(num_hidden_layers=3)).eval()
    with pytest.raises(CacheMismatchError, match="layer_idx 1 is out of range: .* 1 layers"):
        model(torch.tensor([[5, 6, 7]]), **cache_kwargs(cache))
