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


def reference(q, k, v, scale, mask=None):
    """float64 softmax(q k^T * scale + mask) v for q [B, Hq, D], K/V [B, Hkv, N, D] repeated per query group."""
    G = q.shape[1] // k.shape[1]
    kd = k.double().repeat_interleave(G, dim=1)
    vd = v.double().repeat_interleave(G, dim=1)
    s = torch.einsum("bhd,bhnd->bhn", q.double(), kd) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    if mask is not None:
        # A row with no key to attend to is defined as zeros (softmax over all -inf is NaN).
        p = torch.where(mask.any(dim=-1)[:, None, None], p, torch.zeros_like(p))
    return torch.einsum("bhn,bhnd->bhd", p, vd)


def check(out, q, Dv, ref, seed, what=""):
    """Shape, dtype, layout, finiteness, then ||out-ref||/||ref|| under the dtype's bound."""
    B, Hq, _ = q.shape
    assert out.shape == (B, Hq, Dv), f"{what}: shape {tuple(out.shape)}"
    assert out.dtype == q.dtype
    assert out.is_contiguous()
    assert torch.isfinite(out).all(), f"{what}: non-finite output (seed {seed})"
    err = rel_err(out, ref)
    assert err < BOUND[q.dtype], f"{what}: rel err {err:.3g} >= {BOUND[q.dtype]} for {q.dtype} (seed {seed})"
    return err
