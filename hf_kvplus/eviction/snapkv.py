"""SnapKV: at each prompt, keep the tokens its last `observation` queries attend to most."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..storage.slots import PAD, SlotStore
from .declare import Mass, Needs, Setting
from .policy import EvictionPolicy, padding_and_recent

POOLING = ("avg", "max")


class SnapKVPolicy(EvictionPolicy, name="snapkv"):
    """Compresses the cache to `budget` tokens per KV head after every multi-token forward (a prompt).

    The observation window (the prompt's last `observation` tokens) is kept; the other tokens are
    ranked by the attention the window's queries give them, summed over each KV head's query group
    and pooled over `kernel_size` neighbouring slots so that a selected token keeps its context.
    Single-token decode steps only append, as in the paper: memory is bounded in the prompt length.
    """

    compress = "prefill"
    settings = (Setting("observation", int, 32, minimum=1), Setting("kernel_size", int, 7, minimum=1, key="kernel"),
                Setting("pooling", str, "avg", choices=POOLING))  # fmt: skip
    needs = Needs(mass=Mass(queries="observation", reduce="sum", join="replace", prompts_only=True))
    ranked = ("selected tokens", "observation")

    def __init__(self, budget: int, observation: int = 32, kernel_size: int = 7, pooling: str = "avg"):
        if observation < 1:
            raise ConfigError(f"the observation window must hold at least 1 token, got observation={observation}")
        if budget <= observation:
            raise ConfigError(f"the SnapKV budget ({budget}) must exceed the observation window ({observation})")
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ConfigError(f"kernel_size must be a positive odd number, got {kernel_size}")
        if pooling not in POOLING:
            raise ConfigError(f"pooling must be one of {POOLING}, got {pooling!r}")
        self.budget, self.observation, self.kernel_size, self.pooling = budget, observation, kernel_size, pooling

    def observe(self, store: SlotStore, mass: torch.Tensor, new: int) -> None:
        batch, heads, slots = mass.shape
        flat = mass.reshape(batch * heads, 1, slots)
        pad = self.kernel_size // 2
        if self.pooling == "avg":
            # Padding slots are not neighbours: average over the real slots of each window only.
            real = (store.positions != PAD).float().reshape(batch * heads, 1, slots)
            total = F.avg_pool1d(flat, self.kernel_size, stride=1, padding=pad, count_include_pad=False)
            count = F.avg_pool1d(real, self.kernel_size, stride=1, padding=pad, count_include_pad=False)
            pooled = total / count.clamp(min=1e-6)
        else:  # masses are >= 0 and padding slots get 0: they never raise a maximum
            pooled = F.max_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        store.scores.copy_(pooled.view(batch, heads, slots))

    def score(self, store: SlotStore) -> torch.Tensor:
        return padding_and_recent(store, self.observation, store.scores)

    def __repr__(self) -> str:
        return (
            f"SnapKVPolicy(budget={self.budget}, observation={self.observation}, kernel_size={self.kernel_size}, "
            f"pooling={self.pooling!r})"
        )
