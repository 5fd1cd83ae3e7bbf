"""Helpers shared by the kernel tests: error bounds, relative error, masks."""

import torch

#: ||out - ref|| / ||ref|| bounds against a float64 reference, per dtype.
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def left_padding(B, N, pads):
    mask = torch.ones(B, N, dtype=torch.bool)
    for b, pad in enumerate(pads):
        mask[b, :pad] = False
    return mask
