"""Eviction policies: the scored retentions, which rank a layer's slots once it holds more than its budget."""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch

from ..errors import ConfigError
from ..retention.base import Retention
from ..storage.slots import PAD, SlotStore
from .declare import COMPRESS, Needs, Setting, register_policy

#: Score of slots that must stay (sinks, the recent window) and of padding slots, which go first.
KEEP = float("inf")
DROP = float("-inf")




def check_ranked_budget(what: str, budget: int, sinks: int, recent: int) -> None:
    """Refuses a `budget` below 1, or one that the `sinks` and `recent` tokens kept unranked fill."""
    if budget < 1:
        raise ConfigError(f"the {what} budget must hold at least 1 token, got budget={budget}")
    if sinks < 0 or recent < 0 or sinks + recent >= budget:
        raise ConfigError(
            f"sinks={sinks} + recent={recent} must be >= 0 and leave room for ranked tokens in budget={budget}: "
            f"give sinks + recent <= {budget - 1}"
        )


def check_compress(compress: str) -> str:
    if compress not in COMPRESS:
        raise ConfigError(f"compress must be one of {COMPRESS}, got {compress!r}")
    return compress


class EvictionPolicy(Retention):
    """A scored retention: ranks a layer's slots per (batch row, KV head) with `score()`; the layer keeps
    the `budget` highest, evicting after attention has reported the mass each slot received.

    Padding slots always rank lowest, and ties keep the lowest slot index first, so every head of a
    row evicts padding at the same slots and a row's padding mask stays one `[batch, slots]` tensor.
    A policy reads the slots' positions, scores, `seen` count and rows' `first_real` off the store.

    What a policy is, as data: `settings` (its keywords, checked by caches and spec strings alike), `needs` (what its
    score reads: attention mass of which queries and how reduced, keys, ...), whether `generate()` may compile it
    (`compileable`), and its spec name, given in the class statement (`class P(EvictionPolicy, name="p")`), which
    registers it. `EvictingCache(config, policy=P, budget=..., **settings)` runs any of them.
    """

    #: Its spec name (set by `name=` in the class statement, which registers it), or None.
    name: ClassVar[str | None] = None
    #: Its keywords beyond the budget, as the cache and spec strings take them.
    settings: ClassVar[tuple[Setting, ...]] = ()
    #: Spec strings' positional arguments, by setting name ("budget": the cache's budget).
    positional: ClassVar[tuple[str, ...]] = ("budget",)
    #: What its score reads.
    needs: ClassVar[Needs] = Needs()
    #: Whether a cache running it may be compileable (its shapes are fixed once full; compress='always' needed).
    compileable: ClassVar[bool] = False
    #: Whether its slots keep a score each (a policy ranking by position needs none).
    keeps_scores: ClassVar[bool] = True
    #: Whether its slots count the tokens a mask hid (`SlotStore.hidden`: StreamingLLM's sinks close up on them).
    counts_hidden: ClassVar[bool] = False

    scored = True
    is_croppable = False
    #: Slots kept per row and head once the layer is over budget.
    budget: int
    #: When the layer compresses to its budget: "always" (after every forward: a bounded cache) or "prefill"
    #: (after multi-token forwards only, as kvpress does; one-token decode steps append).
    compress: str = "always"

    #: How the mass of several queries combines into what `observe` gets (`declare.REDUCES`): `needs.mass.reduce`.
    mass_reduce: str = "sum"

    def __init_subclass__(cls, name: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.needs.mass is not None and "mass_reduce" not in cls.__dict__:
            cls.mass_reduce = cls.needs.mass.reduce
        if name is not None:
            cls.name = name
            register_policy(name, cls)

    @classmethod
    def prepare(cls, config, options: dict) -> dict:
        """The keyword arguments `for_layer` builds with, from the checked `options` (one call per cache: what needs
        the model's config, such as rotary parameters, is made here once)."""
        return options

    @classmethod
    def for_layer(cls, spec, tokens: int, options: dict) -> EvictionPolicy:
        """The policy of one layer (`spec`: its `LayerSpec`, None when only checking sizes) keeping `tokens`."""
        return cls(tokens, **options)

    #: What a first-tokens region takes room from: (the ranked tokens' name, the setting of the tokens kept unranked).
    ranked: ClassVar[tuple[str, str]] = ("ranked tokens", "recent")

    def check_first(self, first_tokens: int) -> None:
        """Refuses a first-tokens region (never evicted, ranked with the unranked ones) larger than the ranked room."""
        name, unranked = self.ranked
        kept = getattr(self, unranked, 0)
        check_first_fits(first_tokens, self.budget - kept, f"budget - {unranked} = {self.budget} - {kept}", name)

    def mass_queries(self, new: int) -> int:
        """How many of the last `new` queries must report the attention mass they give (0: none): `needs.mass`."""
        mass = self.needs.mass
        if mass is None or (mass.prompts_only and new <= 1):
            return 0
        last = getattr(self, mass.queries) if isinstance(mass.queries, str) else mass.queries
        return new if last is None else min(new, last)

    def observe(self, store: SlotStore, mass: torch.Tensor, new: int) -> None:
        """Takes the attention mass `[batch, kv_heads, slots]` of the latest forward, joined to the slots' scores as
        `needs.mass.join` says."""
        join = self.needs.mass.join
        if join == "add":
            store.add_scores(mass)
        elif join == "max":
            store.max_scores(mass)
        else:
            store.set_scores(mass)

    #: Set by `EvictingCache.appending()`: no forward evicts, tokens append past the budget.
    paused: bool = False

    #: Whether `score` ranks every KV head of a row alike (by position: StreamingLLM), so that evictions keep the same
    #: positions at the same slots in every head (`SlotStore.aligned`); a policy ranking heads apart clears it.
    uniform: bool = False

    def excess(self, held: int, new: int) -> int:
        """Slots to evict after attending `new` fresh tokens: back down to the budget (when `compress` says so)."""
        if self.paused or (new <= 1 and self.compress == "prefill"):
            return 0
        return max(0, held - self.budget)

    def victim(self, store: SlotStore) -> int | None:
        """The one slot to evict after a one-token step, as a Python int, when the policy knows it without
        looking at the device (it is then the same slot in every row and head); None: rank by `score`."""
        return None

    @abstractmethod
    def score(self, store: SlotStore) -> torch.Tensor:
        """`[batch, kv_heads, slots]` float: higher stays."""

    def ranks(self, store: SlotStore) -> torch.Tensor:
        """What eviction ranks by: `score`, for a policy that protects its own slots (sinks, recent window)."""
        return self.score(store)

    def after_evict(self, store: SlotStore) -> None:  # noqa: B027 - an optional hook
        """Hook run after every eviction (sinks re-rotate here)."""

    def prepare_compiled(self, store: SlotStore) -> None:  # noqa: B027 - an optional hook
        """Hook run by every step of a compileable store (`device_count`), first at its prompt, which is eager, before
        any compiled step: makes (once) the state that compiled steps update in place."""

    def evict(self, store: SlotStore, new: int, refill: bool) -> None:
        """Evicts down to the budget. After a one-token step whose next append refills, the one victim per row
        and head is freed where it lies (`SlotStore.free`), by a Python int when `victim` knows it; otherwise
        the highest scores are kept."""
        if store.device_count:  # (idempotent: its first call, at the eager prompt, makes what it makes)
            self.prepare_compiled(store)
            # One graph for every compiled step: a policy ranking heads apart reads per-head masks from the prompt
            # on, rather than from its first eviction (a second graph).
            store.aligned = store.aligned and self.uniform
        store.settle()  # ranking counts every slot (a hole is normally refilled by the append before)
        count = self.excess(store.length, new)
        if count:
            one = refill and new == 1 and count == 1
            slot = self.victim(store) if one else None
            if slot is not None:  # known without looking at the device: evicted by bookkeeping only
                store.free(slot)
            elif one:  # the next one-token append refills it
                store.free(self.ranks(store).argmin(dim=-1, keepdim=True), uniform=self.uniform)
            else:
                # A stable sort breaks ties (max pooling makes many) towards the lower slot, the older token.
                order = self.ranks(store).sort(dim=-1, descending=True, stable=True).indices
                store.keep(order[..., : store.length - count], uniform=self.uniform)
            self.after_evict(store)
        if store.device_count and refill and self.compress == "always" and store.length <= self.budget:
            # A compileable store holds `budget + 1` slots from the prompt on, the unused ones free (padding, which
            # ranks lowest, so each step's eviction frees one of them while there are any): every decode step
            # refills a freed slot, with the same shapes, whether the prompt was compacted, at the budget or shorter.
            store.fill_free(self.budget + 1)


def check_first_fits(first_tokens, room: int, what: str, ranked: str) -> None:
    """The first-tokens region is never evicted, so it takes room that the policy's ranked tokens would have."""
    if isinstance(first_tokens, int) and not isinstance(first_tokens, bool) and first_tokens > room:
        raise ConfigError(
            f"first_tokens={first_tokens} does not fit: the region is never evicted and takes the room of the "
            f"{ranked}, {what} = {room} slots per head; give first_tokens <= {room}"
        )


def padding_and_recent(store: SlotStore, recent: int, ranks: torch.Tensor) -> torch.Tensor:
    """A copy of `ranks` with the `recent` newest positions and the store's first-tokens region (`SlotStore.first`:
    positions 0 .. first - 1, which it may hold exact) set to KEEP, and padding slots (there are none while the store's
    `first_real` is None) to DROP."""
    pos = store.positions
    ranks = ranks.masked_fill(pos >= store.seen_now() - recent, KEEP) if recent else ranks.clone()
    if store.first:
        ranks.masked_fill_(pos < store.first, KEEP)  # (padding there, PAD, is dropped next)
    return ranks if store.first_real is None else ranks.masked_fill(pos == PAD, DROP)
