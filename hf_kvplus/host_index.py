"""Python bookkeeping (block ids, block tables, slot lists) sent to the device as an index tensor without making
the host wait for it.

`torch.tensor(ids, device="cuda")` copies from pageable host memory synchronously: the host waits for the
device's queue to drain (`torch.cuda.set_sync_debug_mode` reports it). Made on the CPU and sent with
`non_blocking=True`, the copy is queued behind the work already there, and the host goes on.
"""

from __future__ import annotations

import torch


def index_tensor(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (a list of ints, or a list of equal-length lists) as a tensor on `device`, queued, not waited on."""
    host = torch.tensor(values, dtype=dtype, device="cpu")  # (on the CPU whatever torch's default device is)
    return host if torch.device(device).type == "cpu" else host.to(device, non_blocking=True)
