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


#: Bound on the attention mass's relative error (see test_kernel_attention_mass.py's docstring).
MASS_BOUND = 1e-5


def reference_mass(q, k, scale, mask=None):
    """float64 sum over each KV head's query group of softmax(q k^T * scale + mask): [B, Hkv, N]."""
    B, Hq, _ = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    s = torch.einsum("bhd,bhnd->bhn", q.double(), k.double().repeat_interleave(G, dim=1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    if mask is not None:
        p = torch.where(mask.any(dim=-1)[:, None, None], p, torch.zeros_like(p))
    return p.view(B, Hkv, G, N).sum(dim=2)


def check_mass(mass, q, k, scale, mask, seed, what="", *, bound=MASS_BOUND):
    """Shape, dtype, finiteness, error against float64 (relative, under `bound`), exact zeros where masked, group
    sums = G."""
    B, Hq, _ = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    assert mass.shape == (B, Hkv, N), f"{what}: mass shape {tuple(mass.shape)}"
    assert mass.dtype == torch.float32
    assert torch.isfinite(mass).all(), f"{what}: non-finite mass (seed {seed})"
    ref = reference_mass(q, k, scale, mask)
    err = rel_err(mass, ref)
    assert err < bound, f"{what}: mass rel err {err:.3g} >= {bound} for {q.dtype} (seed {seed})"
    live = torch.ones(B, dtype=torch.bool) if mask is None else mask.any(dim=-1)
    if mask is not None:
        dropped = (~mask)[:, None, :].expand(B, Hkv, N)
        assert torch.equal(mass[dropped], torch.zeros_like(mass[dropped])), f"{what}: mass on masked keys"
    sums = mass.double().sum(dim=-1)  # [B, Hkv]
    torch.testing.assert_close(sums[live], torch.full_like(sums[live], float(G)), rtol=1e-5, atol=0)
    assert torch.equal(mass[~live], torch.zeros_like(mass[~live])), f"{what}: mass on a fully masked row"
