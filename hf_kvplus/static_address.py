"""Tensors that keep their address between decode steps, marked so that compiled graphs writing them are captured."""

from __future__ import annotations

import torch


def mark_static(*tensors: torch.Tensor) -> None:
    """Tells dynamo that `tensors` keep their addresses between calls, so a compiled graph that writes them in place
    can still be captured as a CUDA graph (inductor skips graphs that mutate inputs not so marked; where the address
    does change, the graph is recorded again). Eager only, as Transformers' StaticCache does it: a traced call
    cannot mark."""
    if not torch.compiler.is_compiling():
        for tensor in tensors:
            torch._dynamo.mark_static_address(tensor)
