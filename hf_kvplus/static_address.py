"""Tensors that keep their address between decode steps, marked so that compiled graphs writing them are captured."""

from __future__ import annotations

import torch


def mark_static(tensor: torch.Tensor) -> None:
    """Tells dynamo that `tensor` keeps its address between calls, so a compiled graph that writes it in place can
    still be captured as a CUDA graph (inductor skips graphs that mutate inputs not so marked; where the address
    does change, the graph is recorded again). Eager only, as Transformers' StaticCache does it: a traced call
    cannot mark."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)
