"""The cache: one `KVLayer` per model layer, built from the model config like Transformers' caches."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from .attention.dispatch import takes_fused_path
from .errors import CacheMismatchError, ConfigError, GradientError, UnsupportedModelError
from .fingerprint import fingerprint
from .layer import KVLayer
from .memory import MemoryReport
from .model_spec import LayerSpec, ModelSpec
from .persist import save_cache
from .placement.base import Placement, TierBytes
from .placement.device import OnDevice
from .retention.base import Retention
from .retention.keep_all import KeepAll
from .retention.window import SlidingWindow
from .storage.base import KVStorage
from .storage.dense import DenseStorage

try:  # Transformers' placeholder for layers without a KV cache of their own (transformers >= 5.22)
    from transformers.cache_utils import DummyLayer
except ImportError:  # pragma: no cover - depends on the installed transformers
    DummyLayer = None
try:  # Transformers' layers for a recurrent state (linear-attention hybrids)
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:  # pragma: no cover - depends on the installed transformers
    LinearAttentionLayer = None


def model_retention(spec: LayerSpec) -> Retention:
    """What the model itself needs: everything for full layers, the window for sliding/chunked ones."""
    return KeepAll() if spec.kind == "full" else SlidingWindow(spec.window)


def check_compileable(model_spec: ModelSpec, placement: Placement) -> None:
    """Refuses `compileable=True` where a decode step's shapes or places cannot stay fixed."""
    if placement.moves:
        raise ConfigError(
            f"compileable=True needs the K/V on the device; {placement!r} moves them by side stream and event, "
            "which a compiled graph would not see"
        )
    sliding = [spec.index for spec in model_spec.layers if spec.holds_kv and spec.kind != "full"]
    if sliding:
        raise UnsupportedModelError(
            f"compileable=True: layers {sliding} of this model are sliding-window layers, which hf_kvplus keeps "
            "in growing buffers that generate() cannot compile"
        )


class KVCache(Cache):
    """A `transformers.Cache` whose layers are chosen per layer as storage x retention x placement.

    `storage(spec)` and `retention(spec)` build one object per attention layer, so a layout can differ
    between full and sliding layers; `placement` is shared. The named caches of this package are
    such combinations; a new combination needs no new class.

    A placement that moves bytes (`Offloaded`) is scheduled from `update`: updating layer i releases
    the layer updated before it (its attention has been issued by then), prefetches the next
    `placement.lookahead` layers (wrapping around to layer 0 for the next step) and acquires layer i.
    Updating the first layer calls `placement.begin()` once the last layer is released and before any
    layer changes, so a placement that raises there leaves the cache as the last forward left it.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        storage: Callable[[LayerSpec], KVStorage],
        retention: Callable[[LayerSpec], Retention] = model_retention,
        placement: Placement | None = None,
        compileable: bool = False,
    ):
        self.model_spec = ModelSpec.from_config(config)
        self.model_fingerprint = fingerprint(config)  # what `save` records and a load checks the config against
        placement = placement or OnDevice()
        if compileable:
            check_compileable(self.model_spec, placement)
        self._compileable = compileable
        self._in_place = takes_fused_path(config)
        layers = [
            self._build_layer(spec, storage, retention, placement) if spec.holds_kv else self._transformers_layer(spec)
            for spec in self.model_spec.layers
        ]
        in_place = [spec.index for spec, layer in zip(self.model_spec.layers, layers, strict=True)
                    if getattr(getattr(layer, "storage", None), "reads_in_place", False)]  # fmt: skip
        if in_place and self.model_spec.dense_only:
            raise UnsupportedModelError(
                f"{self.model_spec.model_type}: {self.model_spec.dense_only}, so its attention cannot read the "
                f"{type(layers[in_place[0]].storage).__name__} of layers {in_place} in place (only hf_kvplus's "
                "attention does); dense caches (DenseCache, OffloadedCache) serve it"
            )
        super().__init__(layers=layers)
        self.placement = placement
        self._placed = [i for i, layer in enumerate(self.layers) if getattr(layer, "placement", None) is placement]
        self._position = {layer_idx: position for position, layer_idx in enumerate(self._placed)}
        self._active: int | None = None  # the layer updated last, whose device copy is in use
        # Why this cache refuses gradients (a lossy layer, a placement that keeps no history), or None: checked in
        # grad mode before the first layer changes.
        lossy = [layer.gradient_refusal() for layer in self.layers if isinstance(layer, KVLayer) and layer.lossy]
        self._gradient_refusal = lossy[0] if lossy else placement.gradient_refusal()
        if placement.moves:
            for i in self._placed:
                placement.register(self.layers[i].storage)

    # ------------------------------------------------------------------ pickling and copies
    # A used cache travels whole (tensors, bookkeeping, placement) and the copy continues with the same logits. What
    # cannot travel refuses in `__getstate__` with `UnsupportedOperationError` (a disk tier's files, a shared pool);
    # memos (`EagerMemo`, whose weak references could not travel) travel empty.

    def __reduce_ex__(self, protocol):
        """Pickles the state through `torch.save`, which keeps views of one buffer views of one buffer (plain pickle
        gives each tensor its own storage, so a storage's memoized views would stop seeing its writes)."""
        buffer = io.BytesIO()
        torch.save(self.__getstate__(), buffer)
        return _restore_cache, (type(self), buffer.getvalue())

    def __deepcopy__(self, memo):
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def put_at_rest(self) -> None:
        """Puts the layer in use since the last forward back where the placement rests it (a save then holds each
        layer's bytes once); the next forward fetches it again."""
        if self.placement.moves and self._active is not None:
            self.placement.release(self.layers[self._active].storage)
            self._active = None

    def save(self, path, spec: str | None = None):
        """Writes the cache to `path` (safetensors and a JSON header; `hf_kvplus.load_cache` reads it back)."""
        return save_cache(self, path, spec=spec)

    def _transformers_layer(self, spec: LayerSpec):
        """Transformers' own layer for a layer without per-token KV: a recurrent state (`LinearAttentionLayer`) or
        none (`DummyLayer`, shared-KV and attention-free layers)."""
        layer_class = LinearAttentionLayer if spec.kind == "linear" else DummyLayer
        if layer_class is None:
            raise UnsupportedModelError(
                f"layer {spec.index} of this {self.model_spec.model_type} holds no KV cache of its own ({spec.kind}); "
                "serving it needs transformers >= 5.22 (its DummyLayer and LinearAttentionLayer)"
            )
        return layer_class()

    def _build_layer(self, spec: LayerSpec, storage, retention, placement: Placement):
        """The cache layer of one attention layer."""
        return KVLayer(
            spec, storage(spec), retention(spec), placement, compileable=self._compileable, in_place=self._in_place
        )

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise CacheMismatchError(
                f"layer_idx {layer_idx} is out of range: this cache was built for a {self.model_spec.model_type} "
                f"config with {len(self.layers)} layers"
            )
        if self._gradient_refusal is not None and torch.is_grad_enabled() and (
            key_states.requires_grad or value_states.requires_grad
        ):
            raise GradientError(self._gradient_refusal)
        if self.placement.moves and layer_idx in self._position:
            self._stage(layer_idx, key_states.device)
        # Straight to the layer: what Transformers' `Cache.update` adds (its own offloading, layers built on first
        # use) is never on here, and a decode step's Python calls are its host cost.
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def _stage(self, layer_idx: int, device) -> None:
        placement, placed = self.placement, self._placed
        placement.attach(device)
        position = self._position[layer_idx]
        if self._active is not None and self._active != layer_idx:
            placement.release(self.layers[self._active].storage)
        self._active = layer_idx
        if position == 0:  # every layer at rest now, none changed yet: the placement may refuse the forward here
            placement.begin()
        for step in range(1, min(placement.lookahead, len(placed) - 1) + 1):
            placement.prefetch(self.layers[placed[(position + step) % len(placed)]].storage)
        placement.acquire(self.layers[layer_idx].storage)

    def tier_bytes(self) -> TierBytes:
        """Bytes of K/V per tier (device copies, host memory, disk), read off the placement."""
        return self.placement.tier_bytes(self.layers[i].storage for i in self._placed)

    def memory_report(self) -> MemoryReport:
        """Bytes at rest summed over layers (payload, headroom, metadata), with tokens seen and held."""
        report = MemoryReport()
        for layer in self.layers:
            if callable(getattr(layer, "memory", None)):
                report = report + layer.memory()
        return report

    @property
    def nbytes(self) -> int:
        """Every byte the cache holds at rest, metadata and headroom included."""
        return self.memory_report().total_bytes

    @property
    def bytes_per_token(self) -> float:
        """Bytes at rest per token seen by each batch row."""
        return self.memory_report().bytes_per_token


def _restore_cache(cls: type, data: bytes) -> KVCache:
    """Unpickles a `KVCache` that `KVCache.__reduce_ex__` saved."""
    cache = cls.__new__(cls)
    cache.__setstate__(torch.load(io.BytesIO(data), weights_only=False))
    return cache


class DenseCache(KVCache):
    """Full-precision K/V kept as they come, appended in place, attended by hf_kvplus's attention path.

    Lossless: greedy output is token-identical to `DynamicCache`. Sliding-window layers keep only
    their window. `max_tokens` fixes each layer's capacity (allocated once; exceeding it raises
    `CapacityError`); by default layers grow as needed.

    `compileable=True` (with `max_tokens`, on a model whose layers are all full attention) reads the whole
    buffer at every step, as Transformers' StaticCache does, and declares `is_compileable`: `generate()`
    then compiles the decode forward (on CUDA by default, on CPU with `CompileConfig._compile_all_devices`).
    Eager steps then attend over all `max_tokens` positions, so it is opt-in.

    >>> cache = DenseCache(config=model.config)
    >>> model.generate(**inputs, cache=cache)  # past_key_values=cache before Transformers 5.24
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        *,
        max_tokens: int | None = None,
        placement: Placement | None = None,
        compileable: bool = False,
    ):
        if compileable and max_tokens is None:
            raise ConfigError("DenseCache(compileable=True) needs max_tokens: every decode step reads that many positions")
        super().__init__(
            config, storage=lambda spec: DenseStorage(max_tokens=max_tokens, static=compileable), placement=placement,
            compileable=compileable,
        )  # fmt: skip
