"""hf_kvplus's attention path: the registered attention function and its dense implementation."""

from .dense import dense_attention
from .dispatch import ATTN_IMPLEMENTATION, install, kvplus_attention, takes_fused_path, uninstall

__all__ = ["ATTN_IMPLEMENTATION", "dense_attention", "install", "kvplus_attention", "takes_fused_path", "uninstall"]
