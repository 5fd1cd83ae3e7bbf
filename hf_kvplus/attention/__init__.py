"""hf_kvplus's attention path: the registered attention function and the dispatcher that picks the kernel."""

from .dispatch import ATTN_IMPLEMENTATION, install, kvplus_attention, takes_fused_path, uninstall
from .route import dense_attention

__all__ = ["ATTN_IMPLEMENTATION", "dense_attention", "install", "kvplus_attention", "takes_fused_path", "uninstall"]
