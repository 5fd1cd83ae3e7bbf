"""PagedCache: K/V in fixed-size blocks with block tables, shared copy-on-write between rows."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedConfig

from .cache import KVCache
from .errors import CacheMismatchError, ConfigError, UnsupportedOperationError
from .fitted import key_scale_for
from .formats import any_rotated, resolve_format
from .key_scale import KeyScale, same_key_scale
from .layer import KVLayer
from .memory import MemoryReport
from .model_spec import LayerSpec, ModelSpec
from .paging.block_pool import BlockPool
from .paging.group import BlockGroup
from .paging.paged_pool import PagedPool, group_key
from .placement.base import Placement
from .precision import PrecisionRegions, precision_report
from .storage.paged import PagedStorage
from .storage.paged_segment import PagedSegment
from .storage.quantized import DEFAULT_WINDOW, QuantizedStorage


class PagedCache(KVCache):
    """A cache whose layers hold K/V in blocks of a `PagedPool`, through per-row block tables.

    Layers that hold the same tokens (all full layers; the sliding layers of one window) share one
    table per row, so block ids mean the same tokens in each of them. Beam search's reorder,
    `batch_repeat_interleave` and `batch_select_indices` permute or copy tables and share blocks with
    reference counts; a row that writes into a shared, partly filled block first gets its own copy.
    Sliding-window layers free blocks that left their window.

    Without `pool`, the cache builds its own (`block_size`; `num_blocks` or a `max_bytes` budget fix it,
    by default it grows on demand; a fixed pool that runs out raises `CapacityError` naming the blocks needed and free, and the cache
    stays as it was). Pass a `PagedPool` to share blocks with other caches of the same model, and to
    reuse prompt prefixes across calls under a `namespace` (tenant, adapter...): blocks stored under
    one namespace are never served to another.

    >>> pool = PagedPool(model.config)                       # once per model
    >>> cache = PagedCache(config=model.config, pool=pool, namespace="tenant-a")
    >>> cache.reuse_prefix(input_ids)                        # attach stored blocks of the prompt's prefix
    >>> out = model.generate(input_ids, cache=cache)  # prefills only the rest (past_key_values= before 5.24)
    >>> cache.store_prefix(input_ids)                        # offer the prompt's full blocks to later calls

    The store files blocks only under the tokens they hold. A cache cannot see token ids (Transformers hands it
    keys and values), so it is told them: `reuse_prefix(ids)` tells the cache its prompt (even when nothing is
    stored yet), and the cache checks what it sees of the next forward: it must feed the rest of that prompt
    (`len(ids)` tokens in all) and, with several rows, the same tokens in every row (its first layer's keys are
    compared: beams and `num_return_sequences`, which then share the attached blocks). `store_prefix(ids)` stores
    only blocks of that prompt (generated tokens are not known to the cache), refuses ids that differ from it, and
    refuses a cache that was never told its prompt or whose first forward fed another (`UnsupportedOperationError`,
    `CacheMismatchError`). What the cache cannot see is a forward that feeds other tokens of the same count than the
    ids told: `reuse_prefix(ids)` is the promise that `generate` gets `ids`.

    Pools and their prefix stores are thread-safe (`PagedPool`): caches in several threads may share one.

    Paged and quantized (`bits` 8, 4, 2 or "fp8", as `QuantizedCache`): each layer is a `QuantizedStorage`
    whose quantized part is a `PagedSegment`. The newest `window` tokens (at least; up to a block more) stay at
    full precision outside the pool; a block that fills is quantized once into a block of the pool (codes and
    float16 group scales, `group_size` tokens per key group), so `block_size` must be a multiple of `group_size`
    (by default it is 16, or the group size if larger). Decode attends over the quantized blocks in place
    (fused kernel with the block table) plus the window. Lossy, like `QuantizedCache`: the same tokens quantized
    in the same groups give the same values, but a dense `QuantizedCache` flushes whole groups and this one whole
    blocks. A `PagedPool` passed in must hold the same format (`CacheMismatchError` otherwise); without `bits`
    the cache takes the pool's format. `num_blocks`/`max_bytes` count quantized blocks (the full-precision window
    is not in the pool). Prefix reuse only attaches stored blocks that end at least `window` tokens before the end
    of the prompt, so the window stays at full precision and the cache quantizes exactly the tokens that a fresh
    prefill of the whole prompt would have quantized.

    >>> cache = PagedCache(config=model.config, bits=4, window=128)       # int4 blocks, 128 exact recent tokens

    Precision regions (`PrecisionRegions`, as `QuantizedCache`'s), with `bits`: `first_tokens` keeps the first tokens
    of each row of full layers at full precision outside the blocks; `boundary_layers` holds the first and last that
    many layers in full-precision blocks of the same groups (a `PagedStorage` each), or at `boundary_bits` (quantized
    blocks in that format), and `layer_bits` ({layer index: bits}) any layer in a format of its own: the pool holds
    each layer's format (`PagedPool(layer_bits=...)`), and a pool passed in must hold the same. Prefix reuse refuses
    these regions.

    `key_scale` ("auto"): a rotated format's keys coded times the model's fitted per-pair scale, as `QuantizedCache`'s
    (the pool holds it: `PagedPool(key_scale=...)`; spec `key_scale=auto|off|PATH`); with `pool=`, "auto" takes the
    pool's and another must be the pool's (`CacheMismatchError`). `quantized_report()["key_scale"]` names its model.

    `max_tokens` (full precision) reserves each row's blocks for that many tokens at the first fill, so the
    tables never grow and a decode step allocates nothing; more raises `CapacityError`. Beams and samples still
    share the prompt's full blocks; a batch-row operation gives each row its own copy of the blocks it writes
    next. With `compileable=True` (and `max_tokens`, on a model whose layers are all full attention) every step
    reads all `max_tokens` positions, as StaticCache, and the cache declares `is_compileable`: `generate()`
    compiles the decode forward as it does StaticCache's.

    >>> cache = PagedCache(config=model.config, max_tokens=4096, compileable=True)

    A released cache gives its blocks back to the pool (the prefix store keeps the ones it holds).
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        pool: PagedPool | None = None,
        block_size: int | None = None,
        num_blocks: int | None = None,
        max_bytes: int | None = None,
        namespace: str = "default",
        bits: int | str | None = None,
        group_size: int | None = None,
        window: int = DEFAULT_WINDOW,
        placement: Placement | None = None,
        max_tokens: int | None = None,
        compileable: bool = False,
        first_tokens: int = 0,
        boundary_layers: int = 0,
        boundary_bits: int | str | None = None,
        layer_bits: Mapping[int, int | str | None] | None = None,
        key_scale: KeyScale | str | Path | None = "auto",
    ):
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ConfigError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if compileable and max_tokens is None:
            raise ConfigError("PagedCache(compileable=True) needs max_tokens: every decode step reads that many positions")
        if not isinstance(namespace, str):
            raise ConfigError(f"namespace must be a str, got {type(namespace).__name__}")
        self.namespace = namespace
        self._told: _Told | None = None  # the prompt reuse_prefix told (store_prefix stores only its blocks)
        self._owns_pool = pool is None
        spec = ModelSpec.from_config(config)
        self.regions = PrecisionRegions(window, first_tokens, boundary_layers, boundary_bits, layer_bits or {})
        self.regions.check_layers(spec.num_layers)
        lossless = (pool.format if pool is not None and bits is None else resolve_format(spec, bits, group_size)) is None
        if (first_tokens or self.regions.overrides()) and lossless:
            raise ConfigError(
                f"first_tokens={first_tokens}, boundary_layers={boundary_layers} and layer_bits={layer_bits} need bits: "
                "full-precision blocks are exact everywhere"
            )
        holding = {i.index for i in spec.layers if i.holds_kv}
        own = {i: b for i, b in self.regions.own_bits(spec.num_layers).items() if i in holding}
        if pool is None:
            pool = PagedPool(
                config, block_size=block_size, num_blocks=num_blocks, max_bytes=max_bytes, bits=bits,
                group_size=group_size, layer_bits=own or None,
                key_scale=key_scale_for(config, key_scale) if any_rotated(bits, *own.values()) else None,
            )
        else:
            if placement is not None and placement.moves:
                raise ConfigError(
                    f"a PagedCache with placement {placement!r} needs a pool of its own: a shared PagedPool's blocks "
                    "stay where all the caches sharing it attend (leave pool=None)"
                )
            pool.check_model(spec)
            for blocks in pool.blocks.values():  # shared: writes wait for a growth in another thread
                blocks.guard_writes = not blocks.is_fixed
            if bits is not None or group_size is not None:
                pool.check_format(resolve_format(spec, bits, group_size))
            _check_key_scale(config, pool, key_scale)
            if pool.format is not None:
                pool.check_layer_formats(
                    {i: resolve_format(spec, own[i], group_size) if i in own else pool.format for i in pool.layer_formats}
                )
        self.pool = pool
        #: The quantized format of the blocks (None: full precision, lossless).
        self.format = pool.format
        #: Full-precision recent tokens per layer (None when lossless).
        self.window = None
        if self.format is not None:
            if isinstance(window, bool) or not isinstance(window, int) or window < self.format.group_size:
                raise ConfigError(
                    f"window={window!r}: the full-precision recent window must be an int of at least one group "
                    f"(group_size={self.format.group_size} tokens)"
                )
            self.window = window
        if max_tokens is not None and self.format is not None:
            raise ConfigError(
                f"max_tokens applies to full-precision blocks; a quantized PagedCache ({self.format}) fills its blocks "
                "from a full-precision window, so it cannot reserve them ahead"
            )
        self.max_tokens = max_tokens
        self.groups: dict[str, BlockGroup] = {}

        def storage(spec: LayerSpec) -> PagedStorage | QuantizedStorage:
            key = group_key(spec)
            if key not in self.groups:  # sliding layers' windows bound their tables: only full layers reserve ahead
                fixed = max_tokens if key == "full" else None
                self.groups[key] = BlockGroup(self.pool.blocks[key], self.pool.block_size, fixed_tokens=fixed)
            if self.format is None or self.pool.layer_formats[spec.index] is None:  # (a full-precision boundary layer)
                return PagedStorage(self.groups[key], self.pool.layers[spec.index], static=compileable)
            segment = PagedSegment(self.groups[key], self.pool.layers[spec.index])
            return QuantizedStorage(segment, window=window, first=first_tokens if spec.kind == "full" else 0)

        super().__init__(config, storage=storage, placement=placement, compileable=compileable)
        weakref.finalize(self, _release, list(self.groups.values()))

    def __getstate__(self) -> dict:
        """A cache with a pool of its own travels with it (prefix store included); one sharing a `PagedPool` passed in
        cannot: its copy would hold a private copy of the pool that the other caches no longer share."""
        if not self._owns_pool:
            raise UnsupportedOperationError(
                f"this PagedCache shares a PagedPool ({sum(g.pool.num_used for g in self.groups.values())} blocks in "
                f"use under namespace {self.namespace!r}) with other caches, so it cannot be pickled or copied; a "
                "PagedCache built without pool= can"
            )
        state = super().__getstate__()
        state.pop("update", None)  # (the check of the first forward after reuse_prefix: made anew below)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        told = state.get("_told")
        if told is not None and told.fed is None:
            self.update = self._first_forward
        weakref.finalize(self, _release, list(self.groups.values()))

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def reuse_prefix(self, input_ids) -> int:
        """Attaches the stored blocks of the longest stored prefix of `input_ids` (one prompt) to this
        empty cache; returns how many tokens `generate` will not prefill (at least one is left)."""
        ids, store = self._prompt(input_ids), self._store()
        if any(group.tables for group in self.groups.values()):
            raise UnsupportedOperationError(
                f"reuse_prefix needs an empty cache; this one holds {self.get_seq_length()} tokens"
            )
        # At least one token is left to run the model on; a quantized cache also leaves its window to prefill
        # (those tokens stay at full precision, so blocks reaching into them were never quantized by a fresh run).
        keep = 1 if self.window is None else self.window
        blocks = store.lookup(ids[: max(0, len(ids) - keep)], self.namespace)
        reused = len(blocks) * self.block_size
        if reused:
            self.groups["full"].attach(blocks)
            for layer in self.layers:
                if isinstance(layer, KVLayer):
                    layer.attached(reused)
        self._told = _Told(tuple(ids), reused)
        self.update = self._first_forward  # this instance's next update only: the decode steps pay nothing
        return reused

    def _first_forward(self, key_states, value_states, layer_idx, *args, **kwargs):
        """The first `update` after `reuse_prefix`: checks that the forward feeds the rest of the prompt told, in
        every row alike, and fans the attached blocks out to its rows (beams, `num_return_sequences`)."""
        del self.update
        told = self._told
        batch, new = key_states.shape[0], key_states.shape[2]
        problem = None
        if told.reused + new != len(told.ids):
            problem = (
                f"the first forward after reuse_prefix fed {new} tokens after the {told.reused} reused; the prompt "
                f"told has {len(told.ids)}"
            )
        if batch > 1 and not all(torch.equal(key_states[0], key_states[row]) for row in range(1, batch)):
            if told.reused:  # (a sync, once per prompt: the host waits for the prefill here anyway)
                raise CacheMismatchError(
                    f"reuse_prefix attached {told.reused} tokens of one prompt; this forward's {batch} rows hold "
                    "different tokens, so they cannot share them (reuse a prefix for one prompt, its beams or its "
                    "samples)"
                )
            problem = f"the first forward after reuse_prefix fed {batch} rows that differ"
        if batch > 1 and told.reused and problem is None:
            self.batch_repeat_interleave(batch)  # every row starts with the attached prompt blocks
        self._told = replace(told, fed=problem is None, problem=problem)
        return KVCache.update(self, key_states, value_states, layer_idx, *args, **kwargs)

    def activate_past_recording(self) -> None:
        """Assisted and prompt-lookup decoding call this before their prefill; after `reuse_prefix` attached blocks,
        refused: Transformers' assisted decoding gives wrong tokens on a prefilled cache (a DynamicCache's too)."""
        told = getattr(self, "_told", None)
        if told is not None and told.reused and told.fed is None:
            raise UnsupportedOperationError(
                f"assisted and prompt-lookup decoding after reuse_prefix attached {told.reused} tokens: Transformers' "
                "assisted generate gives wrong tokens with a prefilled cache; generate without assistant_model / "
                "prompt_lookup_num_tokens, or give it a cache that reused no prefix"
            )
        super().activate_past_recording()

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        told = getattr(self, "_told", None)
        if told is not None and told.fed and self.get_seq_length() < len(told.ids):
            self._told = replace(told, ids=told.ids[: self.get_seq_length()])  # later tokens are not known

    def reset(self) -> None:
        super().reset()
        self._told = None
        self.__dict__.pop("update", None)
        if self._owns_pool and not any(blocks.num_used for blocks in self.pool.blocks.values()):
            for layer_pool in self.pool.layers.values():  # no block held: the next model may bring another dtype
                if hasattr(layer_pool, "allow_retype"):
                    layer_pool.allow_retype()

    def store_prefix(self, input_ids) -> int:
        """Offers the full blocks this cache holds of its prompt to later calls in the same namespace; returns how
        many blocks were newly stored.

        The prompt is the one `reuse_prefix` told the cache before `generate` fed it (every row holds it): `input_ids`
        (the prompt, or the output that starts with it) must agree with it, and only its blocks are stored, never
        generated tokens, which the cache does not know. A cache never told its prompt, or whose first forward fed
        another, refuses (`UnsupportedOperationError`); ids that differ from the prompt are refused
        (`CacheMismatchError`), so one wrong call cannot file blocks under tokens they do not hold."""
        ids, store = self._prompt(input_ids), self._store()
        told = getattr(self, "_told", None)
        if told is None or not told.fed:
            why = (
                told.problem if told is not None and told.problem else
                "reuse_prefix(ids) was not called before generate" if told is None else "generate has not run since"
            )  # fmt: skip
            raise UnsupportedOperationError(
                f"store_prefix stores blocks under the prompt the cache was told and fed, and this one cannot know "
                f"what its blocks hold ({why}): call cache.reuse_prefix(ids), then generate(ids), then "
                "store_prefix(ids), on one prompt (its beams and samples included)"
            )
        known = told.ids
        for k in range(min(len(ids), len(known))):
            if ids[k] != known[k]:
                raise CacheMismatchError(
                    f"store_prefix got id {ids[k]} at token {k}; the prompt this cache was told and fed holds "
                    f"{known[k]} there: blocks are stored only under the tokens they hold"
                )
        group = self.groups["full"]
        if not group.tables:
            return 0
        held = min(len(ids), len(known), min(member.end for member in group.members))
        full = held // self.block_size
        if not full or group.base:
            return 0
        return store.insert(known[: full * self.block_size], group.tables[0][:full], self.namespace)

    def _store(self):
        if self.regions.overrides():
            own = sorted(self.regions.own_bits(self.model_spec.num_layers))
            raise UnsupportedOperationError(
                f"prefix reuse serves caches whose layers all hold one block format; layers {own} hold their own "
                f"(boundary_layers={self.regions.boundary}, layer_bits={dict(self.regions.layer_bits)})"
            )
        if self.regions.first:
            raise UnsupportedOperationError(
                f"prefix reuse needs blocks that start at the prompt's first token; with first_tokens="
                f"{self.regions.first} the first tokens stay at full precision outside the blocks"
            )
        if self.pool.prefix_store is None:
            raise UnsupportedOperationError(
                f"prefix reuse needs a model whose layers are all full attention; this one has layer groups "
                f"{sorted(self.groups)}"
            )
        return self.pool.prefix_store

    @staticmethod
    def _prompt(input_ids) -> list[int]:
        ids = torch.as_tensor(input_ids)
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1:
            raise ConfigError(f"prefix reuse takes one prompt, [N] or [1, N] token ids; got shape {tuple(ids.shape)}")
        return ids.tolist()

    def memory_report(self) -> MemoryReport:
        """Blocks this cache references (shared ones once); with a pool of its own, also the free blocks."""
        for group in self.groups.values():
            group.trim()  # between steps: free what windows dropped during the last one
        report = super().memory_report()
        if not self._owns_pool:
            return report
        free = sum(
            (layer.blocks.capacity - layer.blocks.num_used) * layer.block_bytes for layer in self.pool.layers.values()
        )
        return replace(report, reserved_bytes=report.reserved_bytes + free)

    def quantized_report(self) -> dict:
        """Bytes at rest of the quantized blocks alone (codes, scales and zero points of the blocks the tables
        reference, shared blocks once; the full-precision window and the tables excluded), per quantized token
        slot and as a fraction of float16 K/V for the same slots; bits per coordinate over every token outside the
        window, exact regions included (`precision_report`, as `QuantizedCache.quantized_report`)."""
        if self.format is None:
            raise UnsupportedOperationError("quantized_report needs a quantized PagedCache (built with bits=...)")
        for group in self.groups.values():
            group.trim()
        return precision_report(self, str(self.format), self.window, self.pool.key_scale)

    def block_pools(self) -> dict[str, BlockPool]:
        """The block pool of each layer group ("full", "sliding:512", ...)."""
        return {key: group.pool for key, group in self.groups.items()}


def _check_key_scale(config: PreTrainedConfig, pool: PagedPool, key_scale) -> None:
    """A cache on a shared pool reads the keys as the pool coded them: a `key_scale` other than "auto" (the pool's,
    whatever it holds) must be the pool's, where the pool holds a rotated format."""
    if not pool.rotated or isinstance(key_scale, str) and key_scale == "auto":
        return
    asked = key_scale_for(config, key_scale)
    if not same_key_scale(asked, pool.key_scale):
        have = "none" if pool.key_scale is None else f"{pool.key_scale.model}'s"
        want = "none" if asked is None else f"{asked.model}'s"
        raise CacheMismatchError(f"this PagedPool codes its keys with key scale {have}; the cache asks for {want} "
                                 "(other scales): build the pool with the same key_scale, or leave it out of the "
                                 "cache to use the pool's")  # fmt: skip


@dataclass(frozen=True)
class _Told:
    """The prompt `reuse_prefix` told the cache: its ids, how many tokens were attached, whether the next forward
    fed the rest of it (None before that forward), and if not, why."""

    ids: tuple[int, ...]
    reused: int
    fed: bool | None = None
    problem: str | None = None


def _release(groups: list[BlockGroup]) -> None:
    """Gives a collected cache's blocks back to their pools (`BlockPool.release`: the collector may run this on any
    thread, in the middle of a pool operation too)."""
    for group in groups:
        group.reset(collected=True)
