"""Prefill over slots with attention mass (H2O's and SnapKV's prefill), against an explicit float64 softmax.

`slot_prefill` computes the output and the per-key mass of the fresh queries in query chunks, each building its
own rows of the causal and padding mask. The chunk budget is shrunk here so that one prefill runs in many chunks,
uneven ones included; the output and the mass must not depend on it. Bound: the float32 softmax of the same inputs
(1e-5 relative to the float64 one, measured below 1e-6).
"""

from __future__ import annotations

import pytest
import torch

import hf_kvplus.attention.slots as slots
from hf_kvplus.storage.reads import SlotRead

HEADS, KV_HEADS, DIM = 4, 2, 16


def reference(query, keys, values, valid, scaling, mass_queries):
    """Output `[batch, q, heads, dim]` and mass `[batch, kv_heads, n]` in float64, with the whole mask at once."""
    batch, heads, q, _ = query.shape
    n, group = keys.shape[2], heads // keys.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (keys, values))
    allowed = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]  # [q, n]
    allowed = allowed & (torch.ones(batch, n, dtype=torch.bool) if valid is None else valid)[:, None, :]
    logits = (query.double() @ k.transpose(-1, -2) * scaling).masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(logits, -1).nan_to_num(0.0)  # a query with no valid key: zeros
    mass = probs[:, :, q - mass_queries :].sum(2).view(batch, keys.shape[1], group, n).sum(2)
    return (probs @ v).transpose(1, 2), mass


@pytest.mark.parametrize("elements", [1, 3 * HEADS * 40 * 2, 1 << 30])  # one query a chunk, 3 a chunk, one chunk
@pytest.mark.parametrize(
    "q, held, mass_queries, padded",
    [
        (40, 0, 40, False),  # H2O's first prefill
        (40, 0, 40, True),  # left-padded: the padding queries see no key
        (25, 15, 25, True),  # a second prefill over held slots
        (40, 0, 7, True),  # SnapKV: the first queries through SDPA, the observation window with mass
    ],
)
def test_chunked_prefill_gives_the_float64_output_and_mass(monkeypatch, seed, elements, q, held, mass_queries, padded):
    monkeypatch.setattr(slots, "CPU_CHUNK_ELEMENTS", elements)
    batch, n = 2, q + held
    query = torch.randn(batch, HEADS, q, DIM)
    keys, values = torch.randn(batch, KV_HEADS, n, DIM), torch.randn(batch, KV_HEADS, n, DIM)
    valid = None
    if padded:
        valid = torch.ones(batch, n, dtype=torch.bool)
        valid[1, :22] = False  # row 1: 22 padding slots, reaching into the fresh tokens when held < 22
    out, mass = slots.slot_prefill(query, SlotRead(keys, values, lambda: valid), DIM**-0.5, mass_queries=mass_queries)
    expected_out, expected_mass = reference(query, keys, values, valid, DIM**-0.5, mass_queries)
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5, msg=f"seed {seed}: output")
    torch.testing.assert_close(mass.double(), expected_mass, atol=1e-5, rtol=1e-5, msg=f"seed {seed}: mass")
    if padded and held < 22:
        assert out[1, : 22 - held].abs().max() == 0, "a padding query with no valid key must give zeros"
