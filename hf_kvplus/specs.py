"""Cache specs: one string syntax that names a cache for every command.

`name[:arg[:arg...]]`, where an argument is positional or `key=value`:

- `dynamic`                 Transformers' DynamicCache (built from the config: sliding layers keep their window)
- `static`                  Transformers' StaticCache, sized for the run (`static:4096` fixes max_cache_len)
- `hf-quantized:quanto:4`   Transformers' QuantizedCache with optimum-quanto at 4 (or 2) bits;
                            `residual=N` (default 128) and `group=N` (default 64) may follow
- `hf-quantized:hqq:4`      the same with HQQ (needs the hqq package)
- `dense`                   hf_kvplus DenseCache (`dense:max_tokens=N` fixes its capacity; with `compile=on` it
                            reads all N positions every step, as StaticCache, and generate() may compile it;
                            N defaults to the run's length then)
- `paged`                   hf_kvplus PagedCache (`paged:block=16:blocks=N`: block size, a fixed pool;
                            `max_tokens=N` reserves N tokens per row at the first fill, and `compile=on` reads
                            them all every step, as `dense` does, N defaulting to the run's length)
- `quantized:int4`          hf_kvplus QuantizedCache: int8, int4, int2 or fp8; `group=N`, `window=N` (default
                            128 full-precision tokens) and `backend=quanto` may follow; `max_tokens=N` and
                            `compile=on` as for `paged`; precision regions: `first=N` (the first N tokens of
                            each row at full precision; k4v2, k3v2 and k2v2 default to 4, `first=0` turns
                            that off), `boundary=N` (the first and last N layers at full
                            precision, or at `boundary_bits=int8|...`); `seed=N` (default 0) picks a rotated
                            format's rotations (`rotation_seed`: layer i rotates with N + i), e.g.
                            `quantized:k4v2:seed=1`; a KIVI format has no rotation and refuses it;
                            `center=turning|fixed`: a rotated format's key centre turns with RoPE (the
                            default where the model and storage allow: not in a paged pool) or not;
                            `calibration=PATH` holds some layers at other bits, as `kvplus calibrate` chose
                            for this model and format (also for `paged-quantized` and `offloaded-quantized`);
                            `calibration=auto`: the model's own, found from its config (`fitted`: SmolLM2-135M's
                            k4v2, k3v2, k2v2 and Gemma 3 270M's k4v2 ship); `key_scale=auto|off|PATH`: a
                            rotated format's keys scaled per RoPE pair as fitted for the model (`auto`, the
                            default: the model's own where one ships, Gemma 3 270M's; `off`: none);
                            `sliding_sinks=N`: each sliding-window layer keeps 16-bit copies of its N coded
                            tokens with the shortest values (Gemma 3's rotated presets: 4; 0 turns it off);
                            `full_sinks=N`: each full-attention layer keeps such copies of N, in place of its
                            exact first tokens (Gemma 3's rotated presets: 16; 0, or `first=N`: its first
                            tokens)
- `paged-quantized:int4`    hf_kvplus PagedCache with quantized blocks (a block that fills is quantized);
                            `group=N`, `window=N`, `block=N`, `blocks=N`, `key_scale=auto|off|PATH` and the
                            precision regions of `quantized`
                            (`first=N`, `boundary=N`: full-precision blocks, `boundary_bits=...`) may follow
- `sink:4:1020`             hf_kvplus SinkCache: 4 attention sinks + a window of 1020 (`positions=original`);
                            `sink:4:20%` (or `sink:4:0.2`): the sinks and the window together a fifth of the prompt;
                            every evicting cache takes `bits=int8|int4|int2|fp8` (and `group=N`) storage, and
                            with it the precision regions of `quantized`: `first=N` (positions 0..N-1 exact and
                            never evicted: N <= the sinks, budget - recent, budget - observation; a sink cache's
                            sinks are exact by default with bits, `first=0` codes them), `boundary=N`,
                            `boundary_bits=...`, `calibration=PATH`, `key_scale=auto|off|PATH` (e.g.
                            `sink:4:1020:bits=k4v2:boundary=1`)
- `h2o:1024`                hf_kvplus H2OCache: a budget of 1024 (`recent=N`, default half the budget); every
                            evicting cache's budget may be a share of the prompt instead, `h2o:20%` or `h2o:0.2`
                            (a fifth kept: kvpress's compression_ratio 0.8; sized at the prompt, `EvictingCache`);
                            sink and h2o take `compile=on`: generate() may compile them (`compileable=True`),
                            and `compress=prefill`: compress after prompts only, decode steps append (kvpress)
- `snapkv:1024`             hf_kvplus SnapKVCache: prompts compressed to 1024 (`observation=N`, `kernel=N`,
                            `pooling=avg|max`)
- `peak:1024`               hf_kvplus PeakCache: peak attention (KVzip's query-agnostic score, one pass; `recent=N`,
                            default an eighth of the budget; `kernel=N` max-pools a prompt's scores;
                            `compress=prefill`)
- `kvzip:1024`              hf_kvplus KVzipCache: KVzip (a reconstruction of the context scores it:
                            `compress(model, ...)` after the prefill; `needle --mode agnostic` runs it); `sinks=N`
                            (default 4), `recent=N` (default 0), `kernel=N`, `chunk=N` (default 2048 tokens per
                            repeat forward), `reduce=max_head|max`, `budgets=global|uniform` (default: one budget
                            shared by the layers by their scores, as KVzip), `compress=always`
- `kvzap:20%`               hf_kvplus KVzapCache: KVzap (KVzip's scores predicted from each token's key and value
                            by the model's surrogate, found from its config (`fitted`: SmolLM2-135M's and Gemma 3
                            270M's ship), or the one at `weights=PATH`, from `kvplus train-surrogate`; no second
                            forward): `sinks=N`
                            (default 4), `recent=N` (default 0), `compress=always` (default prefill),
                            `budgets=global|uniform` (default: layers sized by KVzip's shares, as the surrogate
                            recorded them)
- `offloaded`               hf_kvplus OffloadedCache: K/V in host memory, `lookahead=N` layers fetched ahead;
                            `disk=FOLDER` (`tmp`: the system's temporary folder) adds the disk tier beyond
                            `host=SIZE` bytes of host memory (default 0; K/M/G suffixes)
- `offloaded-quantized:int4`  the same holding int8/int4/int2/fp8 or rotated codes (`group=N`, `window=N`,
                            `seed=N`, `key_scale=auto|off|PATH` and the precision regions of `quantized`)

Later caches register themselves with `register_cache_spec`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from transformers import Cache, DynamicCache, PreTrainedConfig, StaticCache
from transformers import QuantizedCache as HFQuantizedCache

from .cache import DenseCache
from .calibration import Calibration
from .errors import ConfigError
from .evicting_cache import EvictingCache, H2OCache, PeakCache, SinkCache, SnapKVCache
from .eviction.budget import check_budget
from .eviction.declare import POLICIES, Setting
from .fitted import calibrated_layers
from .formats import is_rotated, parse_bits
from .kvzap_cache import KVzapCache
from .kvzip_cache import KVzipCache
from .offloaded_cache import OffloadedCache
from .paged_cache import PagedCache
from .quantized_cache import BACKENDS, QuantizedCache
from .storage.quantized import DEFAULT_WINDOW

#: Builds a cache: (config, positional args, keyword args, max_length needed by the run or None).
CacheBuilder = Callable[[PreTrainedConfig, list[str], dict[str, str], "int | None"], Cache]


@dataclass(frozen=True)
class CacheKind:
    """A family of caches a spec can name."""

    name: str
    build: CacheBuilder
    description: str
    lossless: bool
    baseline: bool  # a Transformers cache that hf_kvplus caches are compared against
    requires: tuple[str, ...] = ()  # importable modules it needs
    policy: type | None = None  # an evicting family's eviction policy (its settings are the spec's options)

    def available(self) -> bool:
        return not self.missing()

    def missing(self) -> list[str]:
        """The modules of `requires` that cannot be imported."""
        return [module for module in self.requires if not _installed(module)]


@dataclass(frozen=True)
class CacheSpec:
    """A parsed spec string; `build(config, max_length)` makes a fresh cache each call."""

    text: str
    kind: CacheKind
    args: list[str] = field(default_factory=list)
    kwargs: dict[str, str] = field(default_factory=dict)

    def build(self, config: PreTrainedConfig, max_length: int | None = None) -> Cache:
        missing = self.kind.missing()
        if missing:
            raise ConfigError(
                f"cache spec {self.text!r} needs the Python modules {missing}, not installed: {install_hint(missing)}"
            )
        return self.kind.build(config, self.args, self.kwargs, max_length)

    @property
    def lossless(self) -> bool:
        return self.kind.lossless

    def __str__(self) -> str:
        return self.text


def _installed(module: str) -> bool:
    """Whether `module` can be imported; `find_spec` of a dotted name raises when its parent package is absent."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


CACHE_KINDS: dict[str, CacheKind] = {}


def install_hint(modules: list[str]) -> str:
    """`pip install 'hf-kvplus[extra]'` for the extras of the installed distribution that provide `modules`
    (a requirement `optimum-quanto` provides the module `optimum.quanto`), else `pip install` of the modules."""
    try:
        requirements = importlib.metadata.requires("hf-kvplus") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    wanted, extras = {m.lower() for m in modules}, []
    for requirement in requirements:
        name, _, marker = requirement.partition(";")
        extra = re.search(r"extra == ['\"]([\w-]+)['\"]", marker)
        module = re.split(r"[<>=!~ \[]", name.strip(), maxsplit=1)[0].replace("-", ".").lower()
        if extra and module in wanted and extra.group(1) not in extras:
            extras.append(extra.group(1))
    if extras:
        return " or ".join(f"pip install 'hf-kvplus[{extra}]'" for extra in extras[:2])
    return f"pip install {' '.join(modules)}"


def register_cache_spec(kind: CacheKind) -> None:
    """Adds (or replaces) a cache family under `kind.name`."""
    CACHE_KINDS[kind.name] = kind


def parse_cache_spec(text: str) -> CacheSpec:
    """Parses `name[:arg...]`; unknown names and malformed arguments raise `ConfigError`."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"a cache spec is a non-empty string, got {text!r}; known: {sorted(CACHE_KINDS)}")
    name, *parts = text.strip().split(":")
    if name not in _known():
        raise ConfigError(f"unknown cache {name!r} in spec {text!r}; known: {sorted(CACHE_KINDS)}")
    args, kwargs = [], {}
    for part in parts:
        if "=" in part:
            key, _, value = part.partition("=")
            if not key or not value:
                raise ConfigError(f"malformed argument {part!r} in cache spec {text!r}: expected key=value")
            kwargs[key] = value
        elif kwargs:
            raise ConfigError(f"positional argument {part!r} after key=value arguments in cache spec {text!r}")
        else:
            args.append(part)
    spec = CacheSpec(text=text.strip(), kind=CACHE_KINDS[name], args=args, kwargs=kwargs)
    _validate(spec)
    return spec


def available_cache_specs() -> list[str]:
    """One default spec per registered cache family whose modules are installed."""
    defaults = {
        "hf-quantized": ["hf-quantized:quanto:4", "hf-quantized:quanto:2"],
        "quantized": ["quantized:int8", "quantized:fp8", "quantized:int4", "quantized:int2"],
        "paged-quantized": ["paged-quantized:int4"],
        "sink": ["sink:4:252", "sink:4:252:bits=int4"],
        "h2o": ["h2o:256"],
        "snapkv": ["snapkv:256"],
        "peak": ["peak:256"],
        "kvzip": ["kvzip:256"],
        "kvzap": [],  # (needs a surrogate fitted on the model: shipped for two models only, `fitted`)
        "offloaded": ["offloaded", "offloaded:disk=tmp"],
        "offloaded-quantized": ["offloaded-quantized:int4"],
    }
    specs = []
    for name, kind in _known().items():
        if kind.available():
            specs.extend(defaults.get(name, [name] if kind.policy is None else [f"{name}:256"]))
    return [s for s in specs if parse_cache_spec(s).kind.available()]


def _int(spec_text: str, what: str, value: str, minimum: int = 1) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{what} in cache spec {spec_text!r} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"{what} in cache spec {spec_text!r} must be >= {minimum}, got {number}")
    return number


def _check_bits(spec: CacheSpec, bits: str) -> None:
    try:
        parse_bits(bits)
    except ConfigError as exc:
        raise ConfigError(f"cache spec {spec.text!r}: {exc}") from None


def _check_arity(spec: CacheSpec, max_args: int, keys: set[str]) -> None:
    if len(spec.args) > max_args:
        raise ConfigError(
            f"cache spec {spec.text!r} takes at most {max_args} positional arguments, got {len(spec.args)}"
        )
    unknown = set(spec.kwargs) - keys
    if unknown:
        raise ConfigError(f"unknown options {sorted(unknown)} in cache spec {spec.text!r}; accepted: {sorted(keys)}")


#: Precision-region options of the quantized specs (`PrecisionRegions`).
REGION_OPTIONS = {"first", "boundary", "boundary_bits"}


def _check_regions(spec: CacheSpec) -> None:
    for key in ("first", "boundary"):
        if key in spec.kwargs:
            _int(spec.text, key, spec.kwargs[key], minimum=0)
    if "boundary_bits" in spec.kwargs:
        _check_bits(spec, spec.kwargs["boundary_bits"])


#: The calibrated quantized specs' option: `calibration=PATH`, a file `kvplus calibrate` wrote (`Calibration`).
CALIBRATION_OPTION = {"calibration"}


def _check_calibration(spec: CacheSpec, bits: str | None = None) -> None:
    """`calibration=PATH`: a calibration file, for the spec's bits (its first argument, or `bits`); `calibration=auto`
    is found when the cache is built, from the model's config."""
    if spec.kwargs.get("calibration", "auto") != "auto":
        Calibration.load(spec.kwargs["calibration"]).check_bits(spec.args[0] if bits is None else bits)


def _calibrated(config, bits, kwargs, cache: str | None = None) -> dict:
    """`layer_bits` and `layer_rotations` from a spec's `calibration=PATH|auto`, checked against the model and the
    bits; `cache` names a cache that rotates every layer with its own seed (no `layer_rotations`): a calibration that
    chose rotations is refused there rather than taken in part."""
    if "calibration" not in kwargs:
        return {}
    layer_bits, rotations = calibrated_layers(config, bits, kwargs["calibration"],
                                              key_scale=kwargs.get("key_scale", "auto"))  # fmt: skip
    if not rotations:
        return {"layer_bits": layer_bits}
    if cache is not None:
        raise ConfigError(f"calibration={kwargs['calibration']} rotates layers {sorted(rotations)} with seeds of their "
                          f"own, which {cache} does not take: use it with a quantized or offloaded cache, or a "
                          "calibration made without --rotations")  # fmt: skip
    return {"layer_bits": layer_bits, "layer_rotations": rotations}


def _budget(spec_text: str, what: str, value: str) -> int | float:
    """A budget: tokens ("1024") or a share of the prompt ("20%", "0.2"; `eviction.budget`)."""
    try:
        budget = float(value[:-1]) / 100 if value.endswith("%") else float(value) if "." in value else int(value)
    except ValueError:
        raise ConfigError(f"{what} in cache spec {spec_text!r} is tokens (1024) or a share of the prompt (20% or 0.2), "
                          f"got {value!r}") from None  # fmt: skip
    try:
        return check_budget(budget, what)
    except ConfigError as error:
        raise ConfigError(f"cache spec {spec_text!r}: {error}") from None


def _check_seed(spec: CacheSpec) -> None:
    """`seed=N`: an integer >= 0, and only for a rotated format (a KIVI format has no rotation to seed)."""
    if "seed" not in spec.kwargs:
        return
    _int(spec.text, "seed", spec.kwargs["seed"], minimum=0)
    if not is_rotated(spec.args[0]):
        raise ConfigError(f"cache spec {spec.text!r}: seed={spec.kwargs['seed']} picks a rotated format's rotations; "
                          f"{spec.args[0]!r} is not rotated (give k<key bits>v<value bits>, e.g. k4v2)")  # fmt: skip


def _seed(kwargs) -> int:
    return int(kwargs.get("seed", 0))


def _regions(kwargs, preset: bool = True) -> dict:
    """`QuantizedCache`'s precision-region arguments from a spec's options; without `first=`, the preset's first tokens
    (None: 4 for k4v2, k3v2 and k2v2) where the cache has presets, else 0."""
    first = int(kwargs["first"]) if "first" in kwargs else (None if preset else 0)
    return {"first_tokens": first, "boundary_layers": int(kwargs.get("boundary", 0)),
            "boundary_bits": kwargs.get("boundary_bits")}  # fmt: skip


def _validate(spec: CacheSpec) -> None:
    name = spec.kind.name
    if name in ("dynamic",):
        _check_arity(spec, 0, set())
    elif name == "static":
        _check_arity(spec, 1, set())
        if spec.args:
            _int(spec.text, "max_cache_len", spec.args[0])
    elif name in ("dense", "paged"):
        keys = {"max_tokens"} | ({"block", "blocks"} if name == "paged" else set())
        _check_arity(spec, 0, keys | {"compile"})
        for key in keys & set(spec.kwargs):
            _int(spec.text, key, spec.kwargs[key])
        if spec.kwargs.get("compile", "off") not in ("on", "off"):
            raise ConfigError(f"cache spec {spec.text!r}: compile must be one of ('on', 'off'), got {spec.kwargs['compile']!r}")
    elif name == "quantized":
        _check_arity(spec, 1, {"group", "window", "backend", "max_tokens", "compile", "seed", "center", "key_scale",
                               "sliding_sinks", "full_sinks"} | REGION_OPTIONS | CALIBRATION_OPTION)
        if len(spec.args) != 1:
            raise ConfigError(f"cache spec {spec.text!r}: expected quantized:<int8|int4|int2|fp8>, e.g. quantized:int4")
        _check_bits(spec, spec.args[0])
        _check_seed(spec)
        if spec.kwargs.get("center", "turning") not in ("turning", "fixed"):
            raise ConfigError(f"cache spec {spec.text!r}: center must be 'turning' or 'fixed', got {spec.kwargs['center']!r}")
        for key in ("group", "window", "max_tokens"):
            if key in spec.kwargs:
                _int(spec.text, key, spec.kwargs[key])
        for key in ("sliding_sinks", "full_sinks"):
            if key in spec.kwargs:
                _int(spec.text, key, spec.kwargs[key], minimum=0)
        _check_regions(spec)
        _check_calibration(spec)
        if spec.kwargs.get("backend", "kvplus") not in BACKENDS:
            raise ConfigError(f"cache spec {spec.text!r}: backend must be one of {BACKENDS}")
        if spec.kwargs.get("compile", "off") not in ("on", "off"):
            raise ConfigError(f"cache spec {spec.text!r}: compile must be one of ('on', 'off'), got {spec.kwargs['compile']!r}")
    elif name == "paged-quantized":
        _check_arity(spec, 1, {"group", "window", "block", "blocks", "key_scale"} | REGION_OPTIONS | CALIBRATION_OPTION)
        if len(spec.args) != 1:
            raise ConfigError(
                f"cache spec {spec.text!r}: expected paged-quantized:<int8|int4|int2|fp8>, e.g. paged-quantized:int4"
            )
        _check_bits(spec, spec.args[0])
        for key in ("group", "window", "block", "blocks"):
            if key in spec.kwargs:
                _int(spec.text, key, spec.kwargs[key])
        _check_regions(spec)
        _check_calibration(spec)
    elif spec.kind.policy is not None:
        _validate_evicting(spec)
    elif name in ("offloaded", "offloaded-quantized"):
        quantized = name == "offloaded-quantized"
        _check_arity(
            spec, int(quantized), {"lookahead", "host", "disk"} | ({"group", "window", "seed", "key_scale"} | REGION_OPTIONS | CALIBRATION_OPTION if quantized else set())
        )
        if quantized and len(spec.args) != 1:
            raise ConfigError(f"cache spec {spec.text!r}: expected {name}:<int8|int4|int2|fp8>, e.g. {name}:int4")
        if quantized:
            _check_bits(spec, spec.args[0])
            _check_seed(spec)
            _check_regions(spec)
            _check_calibration(spec)
        for key in {"lookahead", "group", "window"} & set(spec.kwargs):
            _int(spec.text, key, spec.kwargs[key], minimum=0 if key == "lookahead" else 1)
        if "host" in spec.kwargs:
            if "disk" not in spec.kwargs:
                raise ConfigError(f"cache spec {spec.text!r}: host=SIZE is the budget before the disk tier; give disk=FOLDER")
            _size(spec.text, spec.kwargs["host"])
    elif name == "hf-quantized":
        _check_arity(spec, 2, {"residual", "group"})
        if len(spec.args) != 2 or spec.args[0] not in ("quanto", "hqq"):
            raise ConfigError(
                f"cache spec {spec.text!r}: expected hf-quantized:<quanto|hqq>:<bits>, e.g. hf-quantized:quanto:4"
            )
        bits = _int(spec.text, "bits", spec.args[1])
        allowed = (2, 4) if spec.args[0] == "quanto" else (1, 2, 3, 4, 8)
        if bits not in allowed:
            raise ConfigError(f"cache spec {spec.text!r}: {spec.args[0]} supports {allowed} bits, got {bits}")
        for key in ("residual", "group"):
            if key in spec.kwargs:
                _int(spec.text, key, spec.kwargs[key])


#: The named evicting caches, by their policy's spec name; any other registered policy runs in `EvictingCache`.
NAMED_EVICTING = {cache.policy.name: cache for cache in (SinkCache, H2OCache, SnapKVCache, PeakCache, KVzipCache,
                                                         KVzapCache)}  # fmt: skip
#: Every evicting spec's options besides its policy's settings: storage, precision regions, calibration.
STORAGE_OPTIONS = {"bits", "group", "key_scale"} | REGION_OPTIONS | CALIBRATION_OPTION
#: What a positional argument's example is in an error message, by name (a setting's own default otherwise).
EXAMPLES = {"budget": "1024", "window": "1020"}


def _evicting_settings(policy) -> dict[str, Setting]:
    """The spec keys of a policy's settings and of its named cache's own, to their `Setting`s."""
    cache = NAMED_EVICTING.get(policy.name, EvictingCache)
    return {setting.spec_key: setting for setting in (*policy.settings, *cache.settings)}


def _validate_evicting(spec: CacheSpec) -> None:
    """Checks an evicting spec against what its policy declares: positional arguments, settings and their bounds."""
    policy = spec.kind.policy
    declared, positional = _evicting_settings(policy), policy.positional
    _check_arity(spec, len(positional), (set(declared) - set(positional)) | STORAGE_OPTIONS
                 | ({"compile"} if policy.compileable else set()))  # fmt: skip
    if len(spec.args) != len(positional):
        example = ":".join(EXAMPLES.get(what) or str(declared[what].default) for what in positional)
        raise ConfigError(f"cache spec {spec.text!r}: expected {spec.kind.name}:<{'>:<'.join(positional)}>, e.g. "
                          f"{spec.kind.name}:{example}")  # fmt: skip
    for what, value in zip(positional, spec.args, strict=True):
        if what in EXAMPLES:  # (a sink spec's share sizes its sinks and window together)
            _budget(spec.text, what, value)
        else:
            declared[what].parse(value, spec.text)
    for key in set(declared) & set(spec.kwargs):
        declared[key].parse(spec.kwargs[key], spec.text)
    if "group" in spec.kwargs:
        _int(spec.text, "group", spec.kwargs["group"], minimum=0)
    if spec.kwargs.get("compile", "off") not in ("on", "off"):
        raise ConfigError(f"cache spec {spec.text!r}: compile must be one of ('on', 'off'), got {spec.kwargs['compile']!r}")
    if "bits" in spec.kwargs:
        _check_bits(spec, spec.kwargs["bits"])
    elif "calibration" in spec.kwargs:
        raise ConfigError(f"cache spec {spec.text!r}: calibration= gives layers their own bits; it needs bits=")
    _check_calibration(spec, spec.kwargs.get("bits"))
    _check_regions(spec)


def _evicting(policy, config, args, kwargs, max_length):
    """The named cache of `policy` (or `EvictingCache` running it) from a checked spec's arguments."""
    declared = _evicting_settings(policy)
    options = {}
    for what, value in zip(policy.positional, args, strict=True):
        if what == "budget":
            options["budget"] = _budget(policy.name, what, value)
        elif what == "window":  # tokens after the sinks, or a share of the prompt for the sinks and the window
            size = _budget(policy.name, what, value)
            options["budget" if isinstance(size, float) else "window"] = size
        else:
            options[what] = declared[what].parse(value, policy.name)
    for key in set(declared) & set(kwargs):
        options[declared[key].name] = declared[key].parse(kwargs[key], policy.name)
    if "compile" in kwargs:
        options["compileable"] = kwargs["compile"] == "on"
    cache = NAMED_EVICTING.get(policy.name)
    if cache is None:
        return EvictingCache(config, policy, **options, **_storage(config, kwargs))
    return cache(config, **options, **_storage(config, kwargs))


def evicting_kind(policy, description: str | None = None) -> CacheKind:
    """The spec family of a registered eviction policy (named by its spec name)."""
    description = description or f"EvictingCache with the eviction policy {policy.__name__}"
    return CacheKind(policy.name, partial(_evicting, policy), description, False, False, policy=policy)


def _known() -> dict[str, CacheKind]:
    """Every family: the registered ones, and a family for each eviction policy registered since (by importing the
    file that defines it)."""
    for name, policy in POLICIES.items():
        if name not in CACHE_KINDS:
            register_cache_spec(evicting_kind(policy))
    return CACHE_KINDS


#: Byte suffixes of sizes in specs (binary: K = 1024).
SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(spec_text: str, value: str) -> int:
    """`4096`, `64K`, `512M`, `8G` as bytes."""
    number, suffix = (value[:-1], value[-1].upper()) if value[-1:].isalpha() else (value, "")
    if suffix not in SIZE_SUFFIXES or not number.isdigit():
        raise ConfigError(f"cache spec {spec_text!r}: a size is bytes with an optional K/M/G suffix, got {value!r}")
    return int(number) * SIZE_SUFFIXES[suffix]


def _offloaded(config, args, kwargs, max_length):
    disk = kwargs.get("disk")
    options = {
        "lookahead": int(kwargs.get("lookahead", 1)),
        "folder": tempfile.gettempdir() if disk == "tmp" else disk,
        "host_budget": None if disk is None else _size("offloaded", kwargs.get("host", "0")),
    }
    if args:
        options |= {"bits": args[0], "group_size": int(kwargs["group"]) if "group" in kwargs else None,
                    "window": int(kwargs.get("window", DEFAULT_WINDOW)), "rotation_seed": _seed(kwargs),
                    "key_scale": kwargs.get("key_scale", "auto"), **_regions(kwargs), **_calibrated(config, args[0], kwargs)}
    return OffloadedCache(config, **options)


def _storage(config, kwargs) -> dict:
    """An evicting cache's storage arguments: bits, group size and precision regions (`first=` absent: the cache's
    default, 0 but for a sink cache's quantized slots, whose sinks stay exact), with a calibration's `layer_bits`."""
    regions = _regions(kwargs, preset=False)
    if "first" not in kwargs:
        del regions["first_tokens"]
    return {"bits": kwargs.get("bits"), "group_size": int(kwargs["group"]) if "group" in kwargs else None,
            "key_scale": kwargs.get("key_scale", "auto"), **regions,
            **_calibrated(config, kwargs.get("bits"), kwargs, cache="an evicting cache")}  # fmt: skip


def _static_options(kwargs, max_length) -> dict:
    """`max_tokens` and `compileable` of a dense or paged spec: with `compile=on`, sized for the run (as `static`)."""
    compileable = kwargs.get("compile") == "on"
    if "max_tokens" in kwargs:
        max_tokens = int(kwargs["max_tokens"])
    elif compileable and max_length is not None:
        max_tokens = max_length
    else:
        max_tokens = None
    return {"max_tokens": max_tokens, "compileable": compileable}


def _dense(config, args, kwargs, max_length):
    return DenseCache(config=config, **_static_options(kwargs, max_length))


def _paged(config, args, kwargs, max_length):
    return PagedCache(
        config=config, block_size=int(kwargs.get("block", 16)),
        num_blocks=int(kwargs["blocks"]) if "blocks" in kwargs else None, **_static_options(kwargs, max_length),
    )  # fmt: skip


def _static(config, args, kwargs, max_length):
    if args:
        length = int(args[0])
    elif max_length is not None:
        length = max_length
    else:
        raise ConfigError("cache spec 'static' needs a length: give static:<max_cache_len> or run with a known length")
    return StaticCache(config=config, max_cache_len=length)


def _quantized(config, args, kwargs, max_length):
    return QuantizedCache(
        config=config,
        bits=args[0],
        group_size=int(kwargs["group"]) if "group" in kwargs else None,
        window=int(kwargs.get("window", DEFAULT_WINDOW)),
        backend=kwargs.get("backend", "kvplus"),
        rotation_seed=_seed(kwargs),
        turning_keys={"turning": True, "fixed": False}.get(kwargs.get("center")),
        key_scale=kwargs.get("key_scale", "auto"),
        sliding_sinks=int(kwargs["sliding_sinks"]) if "sliding_sinks" in kwargs else None,
        full_sinks=int(kwargs["full_sinks"]) if "full_sinks" in kwargs else None,
        **_static_options(kwargs, max_length),
        **_regions(kwargs),
        **_calibrated(config, args[0], kwargs),
    )


def _paged_quantized(config, args, kwargs, max_length):
    return PagedCache(
        config=config,
        bits=args[0],
        group_size=int(kwargs["group"]) if "group" in kwargs else None,
        window=int(kwargs.get("window", DEFAULT_WINDOW)),
        block_size=int(kwargs["block"]) if "block" in kwargs else None,
        num_blocks=int(kwargs["blocks"]) if "blocks" in kwargs else None,
        key_scale=kwargs.get("key_scale", "auto"),
        **_regions(kwargs, preset=False),  # paged blocks have no preset first tokens yet
        **_calibrated(config, args[0], kwargs, cache="a paged cache"),
    )


def _hf_quantized(config, args, kwargs, max_length):
    backend, bits = args[0], int(args[1])
    if backend == "hqq" and not _installed("hqq"):
        raise ConfigError("cache spec hf-quantized:hqq needs the hqq package, not installed")
    return HFQuantizedCache(
        backend=backend,
        config=config,
        nbits=bits,
        residual_length=int(kwargs.get("residual", 128)),
        q_group_size=int(kwargs.get("group", 64)),
    )


for _kind in (
    CacheKind("dynamic", lambda c, a, k, n: DynamicCache(config=c), "Transformers DynamicCache", True, True),
    CacheKind("static", _static, "Transformers StaticCache", True, True),
    CacheKind(
        "hf-quantized", _hf_quantized, "Transformers QuantizedCache (quanto or HQQ backend)", False, True,
        requires=("optimum.quanto",),
    ),
    CacheKind(
        "dense",
        _dense,
        "hf_kvplus DenseCache: full precision, appended in place",
        True,
        False,
    ),
    CacheKind(
        "paged",
        _paged,
        "hf_kvplus PagedCache: blocks with tables, shared copy-on-write",
        True,
        False,
    ),
    CacheKind("quantized", _quantized, "hf_kvplus QuantizedCache: KIVI int8/int4/int2 or fp8", False, False),
    CacheKind("paged-quantized", _paged_quantized, "hf_kvplus PagedCache with quantized blocks", False, False),
    CacheKind("offloaded", _offloaded, "hf_kvplus OffloadedCache: K/V in host memory (and on disk), fetched ahead",
              True, False),
    CacheKind("offloaded-quantized", _offloaded, "hf_kvplus OffloadedCache holding quantized codes", False, False),
):
    register_cache_spec(_kind)
for _cache, _description in (
    (SinkCache, "hf_kvplus SinkCache: attention sinks + recent window (StreamingLLM)"),
    (H2OCache, "hf_kvplus H2OCache: heavy hitters + recent window"),
    (SnapKVCache, "hf_kvplus SnapKVCache: prompts compressed by their last tokens' attention"),
    (PeakCache, "hf_kvplus PeakCache: peak attention, KVzip's query-agnostic score in one pass"),
    (KVzipCache, "hf_kvplus KVzipCache: KVzip, the context scored by a reconstruction of it"),
    (KVzapCache, "hf_kvplus KVzapCache: KVzap, KVzip's scores predicted by a surrogate at prefill"),
):
    register_cache_spec(evicting_kind(_cache.policy, _description))
