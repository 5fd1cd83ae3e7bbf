"""The registry of caches under test: one `CacheCase` per cache, in `CASES`.

To put a new cache under the conformance suite, append a `CacheCase` to `CASES`: it is then run against
`transformers.DynamicCache` over every architecture of `models.ARCHITECTURES` and every mode of `modes.MODES`
(`pytest tests/test_conformance.py -k <name>`).

A case is a factory plus the promise it makes:

- ``lossless=True`` (dense storage, no eviction): tokens identical to the reference in every mode, and every
  compared logits/scores tensor within ``logits_atol``/``logits_rtol`` (at most 1e-5, float32).
- ``lossless=False`` (quantized, evicting...): the case declares its tolerance. Tokens must agree on at least
  ``min_token_agreement`` of the generated positions (all rows pooled), and the logits of every step whose context is
  still identical to the reference's (every step up to and including the first step where some row's token
  differs; for ``beam`` only the first step once any token differs) must be within ``logits_atol``/``logits_rtol``.
- ``unsupported_modes``: modes the cache refuses by design. For those the suite asserts that running the mode raises
  a ``hf_kvplus.errors.KVPlusError`` subclass (a refusal must be loud and typed, never a silent wrong answer).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import Cache, DynamicCache, PreTrainedModel

from .modes import MODES

#: Tolerance a lossless case is held to (float32 logits).
LOSSLESS_ATOL = 1e-5
LOSSLESS_RTOL = 1e-5


@dataclass(frozen=True)
class CacheCase:
    """One cache under test.

    Attributes:
        name: id used in test ids (``<name>-<arch>-<mode>``); unique, no spaces.
        make: ``make(model)`` builds a fresh, empty cache for ``model`` (may read ``model.config``, ``model.dtype``,
            ``model.device``). Called once per run (``continue_prefix`` reuses the one cache for the prefix forward
            and the generate call).
        lossless: the cache keeps every token exactly; see the module docstring for what each setting asserts.
        logits_atol, logits_rtol: tolerance of logits and scores against the reference (``torch.testing.assert_close``).
        min_token_agreement: minimum fraction of generated token positions equal to the reference's (lossy only;
            1.0 for lossless).
        unsupported_modes: names of modes (keys of ``modes.MODES``) the cache refuses with a ``KVPlusError``.
        note: free text shown in reports (why lossy, why a mode is refused...).
    """

    name: str
    make: Callable[[PreTrainedModel], Cache]
    lossless: bool = True
    logits_atol: float = LOSSLESS_ATOL
    logits_rtol: float = LOSSLESS_RTOL
    min_token_agreement: float = 1.0
    unsupported_modes: frozenset[str] = field(default_factory=frozenset)
    note: str = ""

    def __post_init__(self):
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"case name must be non-empty without spaces, got {self.name!r}")
        object.__setattr__(self, "unsupported_modes", frozenset(self.unsupported_modes))
        unknown = self.unsupported_modes - set(MODES)
        if unknown:
            raise ValueError(
                f"case {self.name!r}: unknown unsupported_modes {sorted(unknown)}; modes are {list(MODES)}"
            )
        if not 0.0 <= self.min_token_agreement <= 1.0:
            raise ValueError(
                f"case {self.name!r}: min_token_agreement must be in [0, 1], got {self.min_token_agreement}"
            )
        if self.logits_atol < 0 or self.logits_rtol < 0:
            raise ValueError(f"case {self.name!r}: tolerances must be >= 0")
        if self.lossless and (
            self.min_token_agreement != 1.0
            or self.logits_atol > LOSSLESS_ATOL
            or self.logits_rtol > LOSSLESS_RTOL
        ):
            raise ValueError(
                f"case {self.name!r} is lossless: it needs min_token_agreement=1.0 and logits tolerances <= "
                f"{LOSSLESS_ATOL}/{LOSSLESS_RTOL} (got {self.min_token_agreement}, {self.logits_atol}, "
                f"{self.logits_rtol}); declare lossless=False for a lossy cache"
            )


def reference_cache(model: PreTrainedModel) -> Cache:
    """The reference every case is compared with: Transformers' own cache, built from the config (so sliding-window
    layers are `DynamicSlidingWindowLayer`s, as when generate builds its default cache)."""
    return DynamicCache(config=model.config)


def _dense_cache(model: PreTrainedModel) -> Cache:
    from hf_kvplus import DenseCache

    return DenseCache(config=model.config)


def _paged_cache(model: PreTrainedModel, **kwargs) -> Cache:
    from hf_kvplus import PagedCache

    return PagedCache(config=model.config, **kwargs)


def _all_full(model: PreTrainedModel) -> bool:
    """Whether every KV layer of the model is full attention (what `compileable=True` serves)."""
    from hf_kvplus.model_spec import ModelSpec

    return all(spec.kind == "full" for spec in ModelSpec.from_config(model.config).layers if spec.holds_kv)


def _paged_static_cache(model: PreTrainedModel) -> Cache:
    """PagedCache(max_tokens=64) reading all 64 positions every step (`compileable=True`) where the model's layers
    are all full attention; on models with sliding layers, which that refuses, the reserved tables alone."""
    return _paged_cache(model, block_size=8, max_tokens=64, compileable=_all_full(model))


def _quantized_cache(model: PreTrainedModel, **kwargs) -> Cache:
    from hf_kvplus import QuantizedCache

    return QuantizedCache(config=model.config, group_size=4, window=4, **kwargs)


# Quantized caches on these deliberately chaotic models (one changed context token moves logits by O(1)): a window
# of 4 and groups of 4 quantize all but the last 4-7 tokens of every prompt. Tokens are not promised (a single
# flipped beam or sample changes a whole row); the logits of every step with an identical context are, at the
# worst deviation measured over all architectures and modes times about 2 (int8 0.073, fp8 0.71, int4 1.07,
# quanto int4 1.01).
_QUANTIZED_NOTE = "hf_kvplus.QuantizedCache, groups of 4, window 4: lossy, logits bounded on identical contexts"

def _offloaded(**kwargs):
    from hf_kvplus import Offloaded

    if "host_budget" in kwargs:
        kwargs["folder"] = tempfile.gettempdir()
    return Offloaded(**kwargs)


def _offloaded_cache(model: PreTrainedModel, **kwargs) -> Cache:
    from hf_kvplus import OffloadedCache

    return OffloadedCache(model.config, **kwargs)


def _evicting_cache(model: PreTrainedModel, name: str, **kwargs) -> Cache:
    import hf_kvplus

    return getattr(hf_kvplus, name)(model.config, **kwargs)


# H2O and SnapKV refuse assisted decoding (prompt lookup is assisted decoding too) when it starts.
_NOT_CROPPABLE = ("assisted", "prompt_lookup")
# Evicting caches with a budget of 8 on 12-20 token sequences: the model sees different tokens, so neither tokens
# nor logits are promised; what is checked is that every mode runs (or is refused up front) without error.
_EVICTING_NOTE = "budget of 8: lossy by design; every mode must run, with declared refusals"

CASES: list[CacheCase] = [
    CacheCase(
        name="dense",
        make=lambda model: _dense_cache(model),
        note="hf_kvplus.DenseCache: dense storage, lossless; must match DynamicCache exactly",
    ),
    CacheCase(
        name="paged",
        make=lambda model: _paged_cache(model, block_size=8),
        note="hf_kvplus.PagedCache, blocks of 8 (sequences span several blocks; beams share and copy on write)",
    ),
    CacheCase(
        name="paged-fixed",
        make=lambda model: _paged_cache(model, block_size=16, num_blocks=64),
        note="hf_kvplus.PagedCache, default block size, a fixed pool of 64 blocks per layer group",
    ),
    CacheCase(
        name="paged-reserved",
        make=lambda model: _paged_cache(model, block_size=8, max_tokens=64),
        note="hf_kvplus.PagedCache(max_tokens=64): every row's blocks reserved at the first fill; batch-row "
        "operations unshare the blocks ahead",
    ),
    CacheCase(
        name="paged-static",
        make=_paged_static_cache,
        note="hf_kvplus.PagedCache(max_tokens=64, compileable=True): all 64 positions read every step, masked by "
        "the model (reserved tables alone on models with sliding layers)",
    ),
    CacheCase(
        name="quantized-int8",
        make=lambda model: _quantized_cache(model, bits=8),
        lossless=False, logits_atol=0.15, logits_rtol=0.0, min_token_agreement=0.0, note=_QUANTIZED_NOTE,
    ),
    CacheCase(
        name="quantized-fp8",
        make=lambda model: _quantized_cache(model, bits="fp8"),
        lossless=False, logits_atol=1.5, logits_rtol=0.0, min_token_agreement=0.0, note=_QUANTIZED_NOTE,
    ),
    CacheCase(
        name="quantized-int4",
        make=lambda model: _quantized_cache(model, bits=4),
        lossless=False, logits_atol=2.0, logits_rtol=0.0, min_token_agreement=0.0, note=_QUANTIZED_NOTE,
    ),
    CacheCase(
        name="quantized-int4-static",
        make=lambda model: _quantized_cache(model, bits=4, max_tokens=64, compileable=_all_full(model)),
        lossless=False, logits_atol=2.0, logits_rtol=0.0, min_token_agreement=0.0,
        note=_QUANTIZED_NOTE + "; max_tokens=64: static codes and a ring window on full layers (compileable where "
        "all layers are full)",
    ),
    CacheCase(
        name="quantized-int4-regions",
        make=lambda model: _quantized_cache(model, bits=4, first_tokens=4, boundary_layers=1),
        lossless=False, logits_atol=2.0, logits_rtol=0.0, min_token_agreement=0.0,
        note=_QUANTIZED_NOTE + "; the first 4 tokens of each row and the first and last layers at full precision",
    ),
    CacheCase(
        name="paged-quantized-int8-first",
        make=lambda model: _paged_cache(model, bits=8, group_size=4, window=4, block_size=8, first_tokens=4),
        lossless=False, logits_atol=0.15, logits_rtol=0.0, min_token_agreement=0.0,
        note="hf_kvplus.PagedCache(bits=8, first_tokens=4): as paged-quantized-int8, the first 4 tokens of each row "
        "outside the blocks at full precision",
    ),
    CacheCase(
        name="quantized-int4-quanto",
        make=lambda model: _quantized_cache(model, bits=4, backend="quanto"),
        lossless=False, logits_atol=2.0, logits_rtol=0.0, min_token_agreement=0.0,
        note=_QUANTIZED_NOTE + "; optimum-quanto's quantizers",
    ),
    CacheCase(
        name="paged-quantized-int8",
        make=lambda model: _paged_cache(model, bits=8, group_size=4, window=4, block_size=8),
        lossless=False, logits_atol=0.15, logits_rtol=0.0, min_token_agreement=0.0,
        note="hf_kvplus.PagedCache(bits=8): int8 groups of 4 in blocks of 8, window 4 (a block that fills is "
        "quantized); lossy like quantized-int8, logits bounded on identical contexts",
    ),
    CacheCase(
        name="sink-roomy",
        make=lambda model: _evicting_cache(model, "SinkCache", num_sinks=4, window=60),
        note="hf_kvplus.SinkCache(4 + 60): the budget exceeds every sequence, so nothing is evicted: lossless",
    ),
    CacheCase(
        name="h2o-roomy",
        make=lambda model: _evicting_cache(model, "H2OCache", budget=64),
        unsupported_modes=_NOT_CROPPABLE, note="hf_kvplus.H2OCache(64): nothing is evicted: lossless",
    ),
    CacheCase(
        name="snapkv-roomy",
        make=lambda model: _evicting_cache(model, "SnapKVCache", budget=64, observation=4),
        unsupported_modes=_NOT_CROPPABLE, note="hf_kvplus.SnapKVCache(64): nothing is evicted: lossless",
    ),
    CacheCase(
        name="sink-roomy-int8",
        make=lambda model: _evicting_cache(model, "SinkCache", num_sinks=4, window=60, bits=8, group_size=16),
        lossless=False, logits_atol=0.15, logits_rtol=0.0, min_token_agreement=0.0,
        note="hf_kvplus.SinkCache(4 + 60, bits=8): nothing evicted, every token int8 per token in groups of 16 "
        "channels; lossy like quantized-int8, logits bounded on identical contexts",
    ),
    CacheCase(
        name="sink-tight",
        make=lambda model: _evicting_cache(model, "SinkCache", num_sinks=2, window=6),
        lossless=False, logits_atol=float("inf"), min_token_agreement=0.0, note=_EVICTING_NOTE,
    ),
    CacheCase(
        name="h2o-tight",
        make=lambda model: _evicting_cache(model, "H2OCache", budget=8),
        lossless=False, logits_atol=float("inf"), min_token_agreement=0.0, unsupported_modes=_NOT_CROPPABLE,
        note=_EVICTING_NOTE,
    ),
    CacheCase(
        name="sink-tight-prefill",
        make=lambda model: _evicting_cache(model, "SinkCache", num_sinks=2, window=6, compress="prefill"),
        lossless=False, logits_atol=float("inf"), min_token_agreement=0.0,
        note=_EVICTING_NOTE + "; compress='prefill': each prompt compressed, decode steps append",
    ),
    CacheCase(
        name="h2o-tight-prefill",
        make=lambda model: _evicting_cache(model, "H2OCache", budget=8, compress="prefill"),
        lossless=False, logits_atol=float("inf"), min_token_agreement=0.0, unsupported_modes=_NOT_CROPPABLE,
        note=_EVICTING_NOTE + "; compress='prefill': each prompt compressed, decode steps append",
    ),
    CacheCase(
        name="snapkv-tight",
        make=lambda model: _evicting_cache(model, "SnapKVCache", budget=8, observation=2, kernel_size=3),
        lossless=False, logits_atol=float("inf"), min_token_agreement=0.0, unsupported_modes=_NOT_CROPPABLE,
        note=_EVICTING_NOTE,
    ),
    CacheCase(
        name="offloaded",
        make=lambda model: _offloaded_cache(model),
        note="hf_kvplus.OffloadedCache: dense storage at rest in host memory, one layer fetched ahead; lossless",
    ),
    CacheCase(
        name="offloaded-disk",
        make=lambda model: _offloaded_cache(model, host_budget=4096, folder=tempfile.gettempdir()),
        note="hf_kvplus.OffloadedCache with 4 KB of host memory: most layers rest in memory-mapped files; lossless",
    ),
    CacheCase(
        name="offloaded-int8",
        make=lambda model: _offloaded_cache(model, bits=8, group_size=4, window=4),
        lossless=False, logits_atol=0.15, logits_rtol=0.0, min_token_agreement=0.0,
        note="hf_kvplus.OffloadedCache(bits=8): the packed codes rest offloaded; lossy like quantized-int8",
    ),
    CacheCase(
        name="paged-offloaded-disk",
        make=lambda model: _paged_cache(model, block_size=8, placement=_offloaded(host_budget=0)),
        note="hf_kvplus.PagedCache(placement=Offloaded) with every layer's blocks on disk; the tables stay: lossless",
    ),
    CacheCase(
        name="sink-roomy-offloaded",
        make=lambda model: _evicting_cache(model, "SinkCache", num_sinks=4, window=60, placement=_offloaded()),
        note="hf_kvplus.SinkCache(4 + 60, placement=Offloaded): the slots rest offloaded, nothing evicted: lossless",
    ),
    # Add new caches above this line.
    # ---- HARNESS SELF-CHECK, not a project cache (temporary; kept until removed on purpose) ---------------------------
    # The reference cache against itself: checks the harness (every mode runs on every architecture and is
    # deterministic: same seeds, same RNG consumption, same prompts), independently of any project cache.
    CacheCase(
        name="dynamic-self-check",
        make=lambda model: DynamicCache(config=model.config),
        note="HARNESS SELF-CHECK (not a project cache): transformers.DynamicCache against itself",
    ),
]
