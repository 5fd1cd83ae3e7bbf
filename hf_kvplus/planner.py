"""Memory planner: weights + KV-cache bytes for a model, context, batch and cache format.

    >>> from hf_kvplus import planner
    >>> p = planner.plan("llama-3.1-8b", context=32768)               # fp16 KV, bf16 weights
    >>> p.kv_bytes_per_token, p.kv_bytes                               # 131072.0, 4294967296 (4.29 GB)
    >>> planner.max_context("llama-3.1-8b", "24GB", kv_format="int4")  # largest context that fits
    >>> planner.plan("llama-3.1-8b", 32768, kv_format="k4v2").ratio_to_fp16  # rotated: 0.1953125
    >>> planner.max_batch("gemma-3-27b", "80GiB", context=32768, budget=1024)

Models: a shipped short name (`SHIPPED_CONFIGS`: llama-3.1-8b, llama-3.1-70b, mistral-7b (v0.3),
qwen2.5-7b, gemma-3-4b, gemma-3-12b, gemma-3-27b, gemma-3-270m, smollm2-135m), a config.json or the
folder holding it, a hub id, or a config object. Formats (fp32, fp16, bf16, KIVI fp8/int8/int4/int2, rotated
"k<X>v<Y>" such as "k4v2", or any format registered by name with `kernels.kv_format.register_format`) and their byte
layouts:
:mod:`hf_kvplus.planning.formats`; what a plan counts: :mod:`hf_kvplus.planning.plan`.
"""

from .planning.configs import SHIPPED_CONFIGS, ShippedConfig, load_config, shipped_config_path
from .planning.formats import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_RESIDUAL,
    KV_FORMATS,
    WEIGHT_BITS,
    KVFormat,
    kv_format,
)
from .planning.parameters import ParameterCount, count_parameters
from .planning.plan import LayerKindPlan, Plan, max_batch, max_context, plan
from .planning.units import format_bytes, parse_memory

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_RESIDUAL",
    "KVFormat",
    "KV_FORMATS",
    "LayerKindPlan",
    "ParameterCount",
    "Plan",
    "SHIPPED_CONFIGS",
    "ShippedConfig",
    "WEIGHT_BITS",
    "count_parameters",
    "format_bytes",
    "kv_format",
    "load_config",
    "max_batch",
    "max_context",
    "parse_memory",
    "plan",
    "shipped_config_path",
]
