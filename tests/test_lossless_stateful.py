"""Lossless caches against DynamicCache under random operation sequences, through a model.

A hypothesis state machine drives the tiny Llama with one hf_kvplus cache and one `transformers.DynamicCache` in
lock step: prompts and decode steps (the same random tokens for every row of the model's batch, distinct per row),
crops, beam reorders, batch selections and repeats, resets, and pickle round trips and deep copies that replace the
cache by its copy. After every forward the last logits must agree (float32; the decode kernels and SDPA add in
another order, so within 1e-4), and the sequence lengths must be equal. Crops and reorders are the operations
`generate()` uses (assisted decoding, beam search), pickles and copies what users do between turns.

The caches: dense (growable), paged (blocks of 8, so crops and reorders cut and share blocks, copy-on-write),
offloaded to host memory with a layer of lookahead, and the static (compileable) dense storage.
"""

from __future__ import annotations

import copy
import pickle
import unittest

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from transformers import DynamicCache

from conformance.models import FIRST_ORDINARY_TOKEN, VOCAB_SIZE, get_model
from hf_kvplus import cache_kwargs
from hf_kvplus.specs import parse_cache_spec

MAX_BATCH, MAX_TOKENS = 4, 160
SPECS = ["dense", "paged:block=8", "offloaded:lookahead=1", f"dense:max_tokens={MAX_TOKENS}:compile=on"]


class LosslessVsDynamic(RuleBasedStateMachine):
    """One hf_kvplus cache (`spec`) and one DynamicCache, kept in lock step through the tiny Llama."""

    spec = SPECS[0]

    def __init__(self):
        super().__init__()
        self.model = get_model("llama")
        self.cache = None

    @initialize(batch=st.integers(1, 3))
    def build(self, batch):
        self.cache = parse_cache_spec(self.spec).build(self.model.config, max_length=MAX_TOKENS)
        self.reference = DynamicCache(config=self.model.config)
        self.batch, self.seq = batch, 0

    def _forward(self, new: int, seed: int) -> None:
        ids = torch.randint(
            FIRST_ORDINARY_TOKEN, VOCAB_SIZE, (self.batch, new), generator=torch.Generator().manual_seed(seed)
        )
        with torch.no_grad():
            got = self.model(ids, **cache_kwargs(self.cache)).logits[:, -1]
            want = self.model(ids, **cache_kwargs(self.reference)).logits[:, -1]
        self.seq += new
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{self.spec}, {new} new tokens: {m}")

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: self.seq + 1 <= MAX_TOKENS)
    @rule(seed=st.integers(0, 2**31 - 1))
    def decode_step(self, seed):
        self._forward(1, seed)

    @precondition(lambda self: self.seq + 40 <= MAX_TOKENS)
    @rule(new=st.integers(2, 40), seed=st.integers(0, 2**31 - 1))
    def prompt(self, new, seed):
        """A prompt, or a later turn's chunk (prefill over the past)."""
        self._forward(new, seed)

    @precondition(lambda self: self.seq > 0)
    @rule(data=st.data())
    def crop(self, data):
        remove = data.draw(st.integers(0, self.seq - 1), label="remove")  # (0: nothing, as Transformers' crop(0))
        self.cache.crop(-remove)
        self.reference.crop(-remove)
        self.seq -= remove

    @precondition(lambda self: self.seq > 0)
    @rule(data=st.data())
    def reorder(self, data):
        """Beam search: some rows kept twice, others dropped."""
        order = data.draw(st.lists(st.integers(0, self.batch - 1), min_size=self.batch, max_size=self.batch))
        self.cache.reorder_cache(torch.tensor(order))
        self.reference.reorder_cache(torch.tensor(order))

    @precondition(lambda self: self.seq > 0)
    @rule(data=st.data())
    def batch_select(self, data):
        rows = data.draw(st.lists(st.integers(0, self.batch - 1), min_size=1, max_size=self.batch), label="rows")
        self.cache.batch_select_indices(torch.tensor(rows))
        self.reference.batch_select_indices(torch.tensor(rows))
        self.batch = len(rows)

    @precondition(lambda self: self.seq > 0 and self.batch * 2 <= MAX_BATCH)
    @rule()
    def repeat_interleave(self):
        self.cache.batch_repeat_interleave(2)
        self.reference.batch_repeat_interleave(2)
        self.batch *= 2

    @rule(batch=st.integers(1, 3))
    def reset(self, batch):
        self.cache.reset()
        self.reference.reset()
        self.batch, self.seq = batch, 0

    @rule(how=st.sampled_from(["pickle", "deepcopy"]))
    def copy_and_continue_with_the_copy(self, how):
        self.cache = pickle.loads(pickle.dumps(self.cache)) if how == "pickle" else copy.deepcopy(self.cache)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def lengths_agree(self):
        if self.cache is not None:
            assert self.cache.get_seq_length() == self.reference.get_seq_length() == self.seq


def _case(spec: str) -> type[unittest.TestCase]:
    machine = type(f"Stateful_{spec}", (LosslessVsDynamic,), {"spec": spec})
    machine.TestCase.settings = settings(
        max_examples=12, stateful_step_count=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    return machine.TestCase


TestDense = _case(SPECS[0])
TestPaged = _case(SPECS[1])
TestOffloaded = _case(SPECS[2])
TestStaticDense = _case(SPECS[3])
