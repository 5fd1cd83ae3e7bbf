"""OffloadedCache against DynamicCache: random operation sequences, every key and value bit-identical.

A hypothesis state machine drives the same forward passes (layers 0..L-1 updated in order with the
same random keys/values, 1-5 new tokens or a 40-80 token prompt), crops, beam reorders, batch selections, repeats and resets
through an `OffloadedCache` and a `transformers.DynamicCache` (the model), and checks that what
`update` returns, what `layers[i].keys/.values` read back and the sequence lengths agree bit for bit.
It runs for the host tier (`OffloadedCache(config)`) and for the disk tier (`host_budget` of 0 or a
few KB with a private folder): there it also checks that the disk files hold exactly the bytes
`tier_bytes()` reports on disk, that the layers at rest in host memory fit the budget (all on disk with
budget 0), and that `reset()` / `close()` remove the files.
"""

import shutil
import tempfile
import unittest
from pathlib import Path

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from transformers import DynamicCache, LlamaConfig

from hf_kvplus import OffloadedCache

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 16  # head_dim 16: the smallest the attention kernels accept
MAX_BATCH = 4
#: A layer at batch 1 rests in 2 x [1, 2, 64, 16] float32 buffers = 16 KiB: these budgets put all, most
#: or some layers on disk (bigger batches and grown buffers push more of them out).
BUDGETS = [0, 8 * 1024, 24 * 1024, 40 * 1024, 80 * 1024]


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
    )


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def assert_same(got, want, what):
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if not torch.equal(got, want):  # raised by hand: pytest would print both tensors in full
        differ = (got != want).nonzero()
        raise AssertionError(f"{what}: {len(differ)} elements differ, first at {differ[:3].tolist()}")


class OffloadedVsDynamic(RuleBasedStateMachine):
    """One OffloadedCache and one DynamicCache, kept in lock step."""

    tier = "host"
    device = "cpu"

    def __init__(self):
        super().__init__()
        self.config = tiny_config()
        self.folder = tempfile.mkdtemp(prefix="kvplus-stateful-") if self.tier == "disk" else None
        self.cache = None

    # ------------------------------------------------------------------ setup
    @initialize(
        lookahead=st.integers(0, 3),
        budget=st.sampled_from(BUDGETS),
        batch=st.integers(1, 3),
    )
    def build(self, lookahead, budget, batch):
        if self.tier == "disk":
            self.budget = budget
            self.cache = OffloadedCache(
                self.config, lookahead=lookahead, host_budget=budget, folder=self.folder
            )
            assert self.cache.placement.disk is not None
        else:
            self.budget = None
            self.cache = OffloadedCache(self.config, lookahead=lookahead)
        self.model = DynamicCache(config=self.config)
        self.batch = batch
        self.seq = 0  # tokens held per layer (every forward updates every layer)

    # ------------------------------------------------------------------ rules
    @rule(new=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
    def forward(self, new, seed):
        """One forward pass: layers updated in order, the returned keys/values compared right away."""
        gen = torch.Generator().manual_seed(seed)
        for i in range(LAYERS):
            k = torch.randn(self.batch, KV_HEADS, new, HEAD_DIM, generator=gen, device="cpu").to(self.device)
            v = torch.randn(self.batch, KV_HEADS, new, HEAD_DIM, generator=gen, device="cpu").to(self.device)
            got_k, got_v = self.cache.update(k.clone(), v.clone(), i)
            want_k, want_v = self.model.update(k.clone(), v.clone(), i)
            assert_same(got_k, want_k, f"update keys of layer {i}")
            assert_same(got_v, want_v, f"update values of layer {i}")
        self.seq += new

    @rule(new=st.integers(40, 80), seed=st.integers(0, 2**32 - 1))
    def long_prefill(self, new, seed):
        """A long prompt: the 64-token buffers grow, so whole tensors are replaced (and rewritten to disk)."""
        self.forward(new, seed)

    @precondition(lambda self: self.seq > 0)
    @rule(data=st.data())
    def crop(self, data):
        remove = data.draw(st.integers(0, self.seq), label="remove")
        keep = self.seq - remove
        # `crop(-n)` removes n; the legacy positive form is the length to keep (DynamicCache refuses it).
        legacy = keep > 0 and data.draw(st.booleans(), label="legacy")
        self.cache.crop(keep if legacy else -remove)
        self.model.crop(-remove)
        self.seq = keep

    @precondition(lambda self: self.seq > 0)
    @rule(data=st.data())
    def reorder(self, data):
        if data.draw(st.booleans(), label="permutation"):
            order = data.draw(st.permutations(range(self.batch)), label="beam_idx")
        else:  # beam search keeps some beams twice and drops others
            order = data.draw(
                st.lists(st.integers(0, self.batch - 1), min_size=self.batch, max_size=self.batch)
            )
        beam_idx = torch.tensor(order, dtype=torch.long, device=self.device)
        self.cache.reorder_cache(beam_idx)
        self.model.reorder_cache(beam_idx.clone())

    @precondition(lambda self: self.seq > 0)
    @rule(data=st.data())
    def batch_select(self, data):
        if data.draw(st.booleans(), label="mask"):
            mask = data.draw(st.lists(st.booleans(), min_size=self.batch, max_size=self.batch).filter(any))
            indices = torch.tensor(mask, dtype=torch.bool, device=self.device)
            size = sum(mask)
        else:
            rows = data.draw(
                st.lists(st.integers(0, self.batch - 1), min_size=1, max_size=self.batch), label="rows"
            )
            indices = torch.tensor(rows, dtype=torch.long, device=self.device)
            size = len(rows)
        self.cache.batch_select_indices(indices)
        self.model.batch_select_indices(indices.clone())
        self.batch = size

    @precondition(lambda self: self.seq > 0 and self.batch * 2 <= MAX_BATCH)
    @rule(repeats=st.integers(1, 2))
    def repeat_interleave(self, repeats):
        self.cache.batch_repeat_interleave(repeats)
        self.model.batch_repeat_interleave(repeats)
        self.batch *= repeats

    @rule(batch=st.integers(1, 3))
    def reset(self, batch):
        self.cache.reset()
        self.model.reset()
        self.seq = 0
        self.batch = batch  # a fresh cache may serve another batch size
        assert self.cache.tier_bytes().host == 0 and self.cache.tier_bytes().disk == 0
        if self.tier == "disk":
            assert self.cache.placement.disk.files() == [], "reset() left disk tier files behind"

    @rule()
    def read_back(self):
        """Every layer's held keys and values, read through `layers[i].keys/.values`, as DynamicCache's."""
        for i in range(LAYERS):
            ours, theirs = self.cache.layers[i], self.model.layers[i]
            if self.seq == 0:
                assert ours.keys is None and ours.values is None
                assert theirs.keys is None or theirs.keys.numel() == 0
                continue
            assert_same(ours.keys, theirs.keys, f"keys of layer {i}")
            assert_same(ours.values, theirs.values, f"values of layer {i}")

    # ------------------------------------------------------------------ invariants
    @invariant()
    def lengths_agree(self):
        if self.cache is None:
            return
        for i in range(LAYERS):
            assert self.cache.get_seq_length(i) == self.model.get_seq_length(i) == self.seq, f"layer {i}"
            for q in (1, 3):
                assert self.cache.layers[i].get_mask_sizes(q) == self.model.layers[i].get_mask_sizes(q)

    @invariant()
    def tiers_account_for_the_bytes(self):
        """Where each layer at rest is, per `tier_bytes()`, against the bytes its storage holds.

        The layer in use (acquired: the one updated last, until the next update) is counted as it is now:
        in host memory when used in place, as a working copy on the (CPU) device when it rests on disk.
        """
        if self.cache is None:
            return
        placement = self.cache.placement
        resting_on_host = 0
        for i, layer in enumerate(self.cache.layers):
            storage = layer.storage
            held = nbytes(storage.tensors())
            tiers = placement.tier_bytes([storage])
            if placement.is_acquired(storage):
                working = tiers.device if placement._rest(storage).on_disk else tiers.host
                assert working == held, f"layer {i} in use holds {held} bytes, tier_bytes() {tiers}"
                continue
            assert tiers.host + tiers.disk == held, (
                f"layer {i} at rest holds {held} bytes, tier_bytes() {tiers}"
            )
            if self.tier == "host":
                assert tiers.disk == 0, f"layer {i}: {tiers}"
            resting_on_host += tiers.host
        if self.tier == "host":
            assert self.cache.tier_bytes().disk == 0
            return
        tiers = self.cache.tier_bytes()
        files = placement.disk.files()
        on_disk = sum(f.stat().st_size for f in files)
        assert on_disk == tiers.disk, f"disk files hold {on_disk} bytes, tier_bytes() says {tiers.disk}"
        # A released layer goes to disk whenever host memory would otherwise exceed the budget, so the
        # layers at rest in host memory fit the budget (with budget 0: every layer at rest is on disk).
        assert resting_on_host <= self.budget, (resting_on_host, self.budget)

    def teardown(self):
        try:
            if self.cache is not None:
                self.cache.close()
                if self.tier == "disk":  # (the tier's private folder is made on the first spill, if any)
                    left = sorted(Path(self.folder).glob("kvplus-*")) if Path(self.folder).exists() else []
                    assert not left, f"close() left {left} behind"
        finally:
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
                assert not Path(self.folder).exists()


class DiskOffloadedVsDynamic(OffloadedVsDynamic):
    tier = "disk"


# With CUDA the placement takes its other path: pinned host buffers, copies in on a side stream,
# write-backs of the written regions on another. The machines are the same, fed CUDA tensors.
class CudaOffloadedVsDynamic(OffloadedVsDynamic):
    device = "cuda"


class CudaDiskOffloadedVsDynamic(DiskOffloadedVsDynamic):
    device = "cuda"


needs_cuda = unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")

TestHostTier = OffloadedVsDynamic.TestCase
TestHostTier.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestDiskTier = DiskOffloadedVsDynamic.TestCase
TestDiskTier.settings = settings(max_examples=80, stateful_step_count=25, deadline=None)
TestHostTierCuda = needs_cuda(CudaOffloadedVsDynamic.TestCase)
TestHostTierCuda.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestDiskTierCuda = needs_cuda(CudaDiskOffloadedVsDynamic.TestCase)
TestDiskTierCuda.settings = settings(max_examples=80, stateful_step_count=25, deadline=None)
