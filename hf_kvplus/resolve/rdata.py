"""Read R's lazy-load databases (``Rdata.rdb`` / ``Rdata.rdx``) with the standard library only.

An R package's ``data/`` folder holds its data sets as a lazy-load database:

- ``Rdata.rdx``, the index: one R object in R's serialization format, usually gzip-compressed (as
  ``saveRDS`` writes it): ``list(variables = list(<name> = c(offset, length), ...),
  references = list(...), compressed = TRUE | 2 | 3)``.
- ``Rdata.rdb``, the values: for each name, ``length`` bytes at ``offset``: a 4-byte big-endian
  uncompressed length, then the serialized object compressed with zlib (``compressed = TRUE``), or,
  for ``compressed`` 2 or 3, a type byte (``'Z'`` xz, ``'2'`` bzip2, ``'1'`` zlib, ``'0'`` none) and
  the data.

The serialization format is R's XDR one (``serialize()``, versions 2 and 3): a header ``X\\n``,
three integers (format version, writer's R version, oldest R version that reads it), in version 3
the native encoding, then one item. Each item starts with an integer of flags: the type in the low
byte, then the "is object", "has attributes" and "has tag" bits (8, 9, 10) and the "levels" (12+),
which for a string element carry its encoding. See R's ``src/main/serialize.c``.

R values come back as Python ones: ``NULL`` as ``None``, an atomic vector or list as an
:class:`RVector` (a ``list`` with ``rtype`` and ``attributes``; NA elements are ``None``), a
pairlist or call as an :class:`RPairList`, a symbol as :class:`RSymbol`. Byte code and a few
other internal types are refused with :class:`RDataError`.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import math
import struct
import zlib
from pathlib import Path
from typing import Any

from ..errors import RDataError

# SEXP types (R's Rinternals.h) and the serializer's pseudo-types (serialize.c).
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
SPECIALSXP, BUILTINSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP = 7, 8, 9, 10, 13, 14, 15
STRSXP, DOTSXP, VECSXP, EXPRSXP, BCODESXP, EXTPTRSXP, WEAKREFSXP = 16, 17, 19, 20, 21, 22, 23
RAWSXP, S4SXP = 24, 25
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP, MISSINGARG_SXP = 255, 254, 253, 252, 251
BASENAMESPACE_SXP, NAMESPACESXP, PACKAGESXP, PERSISTSXP = 250, 249, 248, 247
CLASSREFSXP, GENERICREFSXP, BCREPDEF, EMPTYENV_SXP, BASEENV_SXP = 246, 245, 244, 242, 241
ATTRLANGSXP, ATTRLISTSXP, ALTREP_SXP = 240, 239, 238

IS_OBJECT, HAS_ATTR, HAS_TAG = 1 << 8, 1 << 9, 1 << 10
# Encoding bits of a CHARSXP's levels.
BYTES_MASK, LATIN1_MASK, UTF8_MASK, ASCII_MASK = 1 << 1, 1 << 2, 1 << 3, 1 << 6
NA_INTEGER = -(2**31)

_VECTOR_NAMES = {
    LGLSXP: "logical",
    INTSXP: "integer",
    REALSXP: "double",
    CPLXSXP: "complex",
    STRSXP: "character",
    VECSXP: "list",
    EXPRSXP: "expression",
    RAWSXP: "raw",
}
_PAIRLIST_NAMES = {
    LISTSXP: "pairlist",
    LANGSXP: "language",
    CLOSXP: "closure",
    PROMSXP: "promise",
    DOTSXP: "dots",
    ATTRLISTSXP: "pairlist",
    ATTRLANGSXP: "language",
}
_SINGLETONS = {
    GLOBALENV_SXP: "R_GlobalEnv",
    UNBOUNDVALUE_SXP: "R_UnboundValue",
    MISSINGARG_SXP: "R_MissingArg",
    BASENAMESPACE_SXP: "R_BaseNamespace",
    EMPTYENV_SXP: "R_EmptyEnv",
    BASEENV_SXP: "R_BaseEnv",
}


class RVector(list):
    """An R vector or list: its elements, its R type name (``"character"``, ``"list"``...) and attributes."""

    def __init__(self, items=(), rtype: str = "list", attributes: dict | None = None):
        super().__init__(items)
        self.rtype = rtype
        self.attributes = attributes or {}

    @property
    def names(self) -> list | None:
        return self.attributes.get("names")

    def as_dict(self) -> dict:
        """``{name: element}`` of a named vector or list."""
        names = self.names
        if names is None or len(names) != len(self):
            raise RDataError(f"this R {self.rtype} vector of {len(self)} elements has no names")
        return dict(zip(names, self, strict=True))


class RPairList(list):
    """An R pairlist, call or closure: a list of ``(tag or None, value)`` pairs."""

    def __init__(self, items=(), rtype: str = "pairlist", attributes: dict | None = None):
        super().__init__(items)
        self.rtype = rtype
        self.attributes = attributes or {}


class RSymbol(str):
    """An R symbol (a name)."""


class RSpecial(str):
    """One of R's singleton environments or markers (``R_GlobalEnv``, ``R_MissingArg``...)."""


class REnvironment:
    """An R environment as serialized: enclosing env, frame (pairlist), hash table, attributes."""

    def __init__(self, locked: bool):
        self.locked = locked
        self.enclos: Any = None
        self.frame: Any = None
        self.hashtab: Any = None
        self.attributes: dict = {}


class RReference:
    """A persistent reference (how a lazy-load database stores environments): its key strings."""

    def __init__(self, keys: list):
        self.keys = keys

    def __repr__(self) -> str:
        return f"RReference({self.keys!r})"


def decompress_file_bytes(data: bytes) -> bytes:
    """The bytes of an R data file, undoing whichever compression ``saveRDS``/``save`` used."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    return data


def unserialize(data: bytes) -> Any:
    """The R object serialized in ``data`` (XDR format ``X\\n``, versions 2 and 3)."""
    return _Reader(data).read_top()


class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0
        self.refs: list = []
        self.native_encoding = "utf-8"

    # -- primitives ---------------------------------------------------------------------------
    def _take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise RDataError(f"R data truncated: wanted {n} bytes at offset {self.pos} of {len(self.data)}")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def _int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector: two more integers, upper and lower 32 bits
            upper, lower = struct.unpack(">II", self._take(8))
            return (upper << 32) + lower
        if n < -1:
            raise RDataError(f"negative vector length {n} at offset {self.pos - 4}")
        return n

    def read_top(self) -> Any:
        magic = self._take(2)
        if magic != b"X\n":
            kind = {b"A\n": "ASCII", b"B\n": "native binary", b"RD": "save() (RDX2/RDX3)"}.get(magic)
            raise RDataError(
                f"not R's XDR serialization format (starts {magic!r}"
                + (f", the {kind} format, which this reader does not handle)" if kind else ")")
            )
        version, _writer, _min_reader = self._int(), self._int(), self._int()
        if version == 3:
            self.native_encoding = self._take(self._int()).decode("ascii", "replace") or "utf-8"
        elif version != 2:
            raise RDataError(f"R serialization format version {version}; this reader handles 2 and 3")
        return self._item()

    # -- items --------------------------------------------------------------------------------
    def _item(self) -> Any:
        return self._item_with_flags(self._int())

    def _item_with_flags(self, flags: int) -> Any:
        kind = flags & 0xFF
        levels = flags >> 12
        has_attr = bool(flags & HAS_ATTR)
        if kind == NILVALUE_SXP:
            return None
        if kind in _SINGLETONS:
            return RSpecial(_SINGLETONS[kind])
        if kind == REFSXP:
            index = flags >> 8 or self._int()
            if not 1 <= index <= len(self.refs):
                raise RDataError(f"reference #{index} to an object not read yet ({len(self.refs)} so far)")
            return self.refs[index - 1]
        if kind in (PERSISTSXP, NAMESPACESXP, PACKAGESXP):
            keys = self._string_vec()
            value = RReference(keys) if kind == PERSISTSXP else RSpecial(f"{_kind_name(kind)}:{keys}")
            self.refs.append(value)
            return value
        if kind == SYMSXP:
            name = self._item()
            symbol = RSymbol(name if isinstance(name, str) else "")
            self.refs.append(symbol)
            return symbol
        if kind == ENVSXP:
            env = REnvironment(locked=bool(self._int()))
            self.refs.append(env)
            env.enclos, env.frame, env.hashtab = self._item(), self._item(), self._item()
            env.attributes = _attributes(self._item())
            return env
        if kind in (LISTSXP, LANGSXP, CLOSXP, PROMSXP, DOTSXP, ATTRLISTSXP, ATTRLANGSXP):
            return self._pairlist(flags)
        if kind == ALTREP_SXP:
            return self._altrep()
        if kind == CHARSXP:
            return self._charsxp(levels)
        if kind == EXTPTRSXP:
            value = RSpecial("externalptr")
            self.refs.append(value)
            self._item(), self._item()  # protected value, tag
        elif kind == WEAKREFSXP:
            value = RSpecial("weakref")
            self.refs.append(value)
        elif kind in (SPECIALSXP, BUILTINSXP):
            value = RSpecial(self._take(self._int()).decode("latin-1"))
        elif kind in (LGLSXP, INTSXP):
            n = self._length()
            ints = struct.unpack(f">{n}i", self._take(4 * n))
            if kind == LGLSXP:
                value = RVector((None if x == NA_INTEGER else bool(x) for x in ints), "logical")
            else:
                value = RVector((None if x == NA_INTEGER else x for x in ints), "integer")
        elif kind == REALSXP:
            n = self._length()
            value = RVector(struct.unpack(f">{n}d", self._take(8 * n)), "double")
        elif kind == CPLXSXP:
            n = self._length()
            parts = struct.unpack(f">{2 * n}d", self._take(16 * n))
            value = RVector((complex(parts[i], parts[i + 1]) for i in range(0, 2 * n, 2)), "complex")
        elif kind == RAWSXP:
            value = RVector(self._take(self._length()), "raw")
        elif kind in (STRSXP, VECSXP, EXPRSXP):
            n = self._length()
            value = RVector((self._item() for _ in range(n)), _VECTOR_NAMES[kind])
        elif kind == S4SXP:
            value = RVector((), "S4")
        elif kind in (BCODESXP, BCREPDEF):
            raise RDataError(
                "R byte code is not supported by this reader (it reads data, not compiled functions)"
            )
        else:
            raise RDataError(
                f"unknown or unsupported R type {kind} (flags {flags:#x}) at offset {self.pos - 4}"
            )
        if has_attr:
            value.attributes = _attributes(self._item())
        return value

    def _string_vec(self) -> list:
        if self._int() != 0:
            raise RDataError("names in persistent string vectors are not supported (R does not write them)")
        return [self._item() for _ in range(self._int())]

    def _charsxp(self, levels: int) -> str | None:
        n = self._int()
        if n == -1:
            return None  # NA_character_
        raw = self._take(n)
        if levels & UTF8_MASK:
            return raw.decode("utf-8", "replace")
        if levels & (LATIN1_MASK | BYTES_MASK):
            return raw.decode("latin-1")
        if levels & ASCII_MASK:
            return raw.decode("ascii", "replace")
        try:
            return raw.decode(self.native_encoding)
        except (LookupError, UnicodeDecodeError):
            return raw.decode("utf-8", "replace")

    def _pairlist(self, flags: int) -> RPairList:
        # Walk the CDR chain in a loop: a long pairlist would otherwise recurse once per element.
        kind = flags & 0xFF
        result = RPairList(rtype=_PAIRLIST_NAMES[kind])
        first = True
        while True:
            attributes = self._item() if flags & HAS_ATTR else None
            tag = self._item() if flags & HAS_TAG else None
            value = self._item()
            if first and attributes is not None:
                result.attributes = _attributes(attributes)
            first = False
            result.append((str(tag) if tag is not None else None, value))
            flags = self._int()
            if (flags & 0xFF) not in (LISTSXP, ATTRLISTSXP) or kind in (CLOSXP, PROMSXP):
                tail = self._item_with_flags(flags)
                if tail is not None:  # an improper list (a closure's body, a promise's value)
                    result.append((None, tail))
                return result

    def _altrep(self) -> Any:
        info, state, attr = self._item(), self._item(), self._item()
        class_name = str(info[0][1]) if isinstance(info, RPairList) and info else "?"
        value = _expand_altrep(class_name, state)
        value.attributes = _attributes(attr)
        return value


def _kind_name(kind: int) -> str:
    return {NAMESPACESXP: "namespace", PACKAGESXP: "package"}.get(kind, str(kind))


def _attributes(pairlist: Any) -> dict:
    if pairlist is None:
        return {}
    if not isinstance(pairlist, RPairList):
        raise RDataError(f"attributes should be a pairlist, found {type(pairlist).__name__}")
    return {tag: value for tag, value in pairlist}


def _expand_altrep(class_name: str, state: Any) -> RVector:
    """The plain vector behind an ALTREP object (compact sequences, wrappers, deferred strings)."""
    if class_name in ("compact_intseq", "compact_realseq"):
        n, start, step = (state[0], state[1], state[2]) if len(state) == 3 else (None, None, None)
        if n is None:
            raise RDataError(f"unexpected state for ALTREP {class_name}: {state!r}")
        kind = "integer" if class_name == "compact_intseq" else "double"
        cast = int if kind == "integer" else float
        return RVector((cast(start + i * step) for i in range(int(n))), kind)
    if class_name.startswith("wrap_"):  # state: pairlist (wrapped vector . metadata)
        wrapped = state[0][1] if isinstance(state, RPairList) else state[0]
        return RVector(wrapped, getattr(wrapped, "rtype", "list"))
    if class_name == "deferred_string":  # state: pairlist (numeric vector . info)
        numbers = state[0][1] if isinstance(state, RPairList) else state
        return RVector((_format_number(x) for x in numbers), "character")
    raise RDataError(f"ALTREP class {class_name!r} is not supported by this reader")


def _format_number(x: Any) -> str | None:
    if x is None:
        return None
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "Inf" if x > 0 else "-Inf"
        return f"{x:.15g}"
    return str(x)


class LazyLoadDB:
    """An R lazy-load database: ``LazyLoadDB("data/Rdata")`` reads ``Rdata.rdx`` and, on demand,
    objects from ``Rdata.rdb``."""

    def __init__(self, stem: str | Path):
        stem = Path(stem)
        if stem.suffix in (".rdb", ".rdx"):
            stem = stem.with_suffix("")
        self.rdb = stem.with_suffix(".rdb")
        self.rdx = stem.with_suffix(".rdx")
        for path in (self.rdb, self.rdx):
            if not path.is_file():
                raise RDataError(f"R lazy-load database file {path} does not exist")
        index = unserialize(decompress_file_bytes(self.rdx.read_bytes()))
        if not isinstance(index, RVector) or index.names is None:
            raise RDataError(f"{self.rdx} does not hold a lazy-load index (a named list)")
        index = index.as_dict()
        if "variables" not in index:
            raise RDataError(f"{self.rdx} has no 'variables' entry; it has {sorted(index)}")
        self.variables: dict[str, tuple[int, int]] = {
            name: (int(where[0]), int(where[1])) for name, where in _named(index["variables"]).items()
        }
        self.references: dict[str, tuple[int, int]] = {
            name: (int(where[0]), int(where[1])) for name, where in _named(index.get("references")).items()
        }
        compressed = index.get("compressed")
        flag = compressed[0] if isinstance(compressed, RVector) and compressed else True
        self.compression = 1 if flag is True else int(flag) if flag else 0

    def names(self) -> list[str]:
        return list(self.variables)

    def __contains__(self, name: str) -> bool:
        return name in self.variables

    def __getitem__(self, name: str) -> Any:
        if name not in self.variables:
            raise KeyError(f"{name!r} is not in {self.rdb.name}; it holds {sorted(self.variables)}")
        offset, length = self.variables[name]
        with open(self.rdb, "rb") as handle:
            handle.seek(offset)
            blob = handle.read(length)
        if len(blob) != length:
            raise RDataError(f"{self.rdb} is truncated: {name!r} needs bytes {offset}..{offset + length}")
        return unserialize(_decompress_entry(blob, self.compression, name))

    def read_all(self) -> dict[str, Any]:
        return {name: self[name] for name in self.variables}


def _named(value: Any) -> dict:
    if value is None:
        return {}
    if isinstance(value, RVector):
        return value.as_dict() if len(value) else {}
    raise RDataError(f"expected a named list in the lazy-load index, found {type(value).__name__}")


def _decompress_entry(blob: bytes, compression: int, name: str) -> bytes:
    if len(blob) < 4:
        raise RDataError(f"entry {name!r} is {len(blob)} bytes, too short for its length header")
    expected = struct.unpack(">I", blob[:4])[0]
    body = blob[4:]
    if compression in (2, 3):  # a type byte precedes the data
        method, body = body[:1], body[1:]
        decoders = {b"Z": lzma.decompress, b"2": bz2.decompress, b"1": zlib.decompress, b"0": bytes}
        if method not in decoders:
            raise RDataError(f"entry {name!r}: unknown compression type byte {method!r}")
        data = decoders[method](body)
    elif compression == 1:
        data = zlib.decompress(body)
    else:
        data = body
    if len(data) != expected:
        raise RDataError(f"entry {name!r} decompressed to {len(data)} bytes, its header says {expected}")
    return data


def read_lazyload(stem: str | Path) -> dict[str, Any]:
    """Every object of the lazy-load database ``stem`` (``.../data/Rdata``, with or without a suffix)."""
    return LazyLoadDB(stem).read_all()
