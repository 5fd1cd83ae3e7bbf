"""Peak attention: KVzip's query-agnostic score, in one pass.

KVzip (Kim et al., 2025, "Query-Agnostic KV Cache Compression with Context Reconstruction") ranks a cached key by
the largest attention weight any query gives it while the model reconstructs the context (a second forward that
repeats it), not by a sum: a key one later token reads sharply (a number copied, a name repeated) outranks one many
tokens read diffusely, and sums favour early tokens, which every later query sees. This policy keeps that score but
takes its queries from the forward that brings the tokens in (the prompt's own queries, causally; then each decode
step's): no second forward, so it works inside `generate()` and on every storage, and it never sees a question that
comes after the compression (query-agnostic in kvpress's pipeline). What it drops against KVzip: a reconstruction's
queries read every context token, not just the earlier ones, so here the last tokens before a compression have few
readers; the `recent` newest tokens are kept for that reason. It is not KVzap (a trained surrogate of KVzip's scores):
nothing is learned.

The mass a query gives a key is summed over the query heads of the key's KV head group (what the decode kernels
report); the score is its maximum over queries, optionally max-pooled over `kernel_size` neighbouring slots at a
prompt, so that a kept token keeps its neighbours (a five-digit key is five tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..storage.slots import SlotStore
from .declare import Mass, Needs, Setting, compress_setting
from .policy import EvictionPolicy, check_compress, padding_and_recent


class PeakAttentionPolicy(EvictionPolicy, name="peak"):
    """Keeps `budget - recent` tokens with the largest peak attention and the `recent` newest, per KV head.

    `compress="always"` evicts after every forward (a bounded cache, decode steps included); `"prefill"` after
    prompts only, decode steps appending (kvpress's setting). `recent` None: an eighth of the budget.
    """

    settings = (Setting("recent", int, None, minimum=0), Setting("kernel_size", int, 1, minimum=1, key="kernel"),
                compress_setting("always"))  # fmt: skip
    needs = Needs(mass=Mass(queries=None, reduce="max", join="max"))

    @classmethod
    def for_layer(cls, spec, tokens: int, options: dict) -> PeakAttentionPolicy:
        recent = tokens // 8 if options["recent"] is None else options["recent"]
        return cls(tokens, recent, options["kernel_size"], options["compress"])

    def __init__(self, budget: int, recent: int, kernel_size: int = 1, compress: str = "always"):
        self.compress = check_compress(compress)
        if budget < 1:
            raise ConfigError(f"the peak-attention budget must hold at least 1 token, got budget={budget}")
        if not 0 <= recent < budget:
            raise ConfigError(
                f"the recent window must leave room for ranked tokens: recent within 0..budget - 1 = {budget - 1}, "
                f"got recent={recent}"
            )
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ConfigError(f"kernel_size must be a positive odd number, got {kernel_size}")
        self.budget, self.recent, self.kernel_size = budget, recent, kernel_size

    def observe(self, store: SlotStore, mass: torch.Tensor, new: int) -> None:
        if self.kernel_size > 1 and new > 1:  # a prompt: its slots are in position order
            batch, heads, slots = mass.shape
            pad = self.kernel_size // 2
            mass = F.max_pool1d(mass.reshape(batch * heads, 1, slots), self.kernel_size, stride=1, padding=pad)
            mass = mass.view(batch, heads, slots)
        store.max_scores(mass)

    def score(self, store: SlotStore) -> torch.Tensor:
        return padding_and_recent(store, self.recent, store.scores)

    def __repr__(self) -> str:
        compress = ", compress='prefill'" if self.compress == "prefill" else ""
        kernel = f", kernel_size={self.kernel_size}" if self.kernel_size > 1 else ""
        return f"PeakAttentionPolicy(budget={self.budget}, recent={self.recent}{kernel}{compress})"
