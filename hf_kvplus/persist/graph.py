"""A cache's objects as JSON plus a list of tensor storages: what pickle would save, without code in the file.

Every object travels through the same `__getstate__` / `__setstate__` (or `__reduce__`) that pickling and copying
use, so whatever state a storage, retention or placement holds is saved without a list of attribute names to keep
in step. A decoded object may only be of a class defined in hf_kvplus (or one of Transformers' cache layers), built
with `__new__` and given its state; a function or method is looked up by name on such a class or module. Nothing
named by the file is called except those classes' own `__setstate__` and the constructors `__reduce__` names.

Tensors are saved by storage: two views of one buffer (a storage's memoized windows) stay views of one buffer, and one
tensor held twice stays one tensor. An
object whose class defines `__persist_state__` is saved from what that gives instead of `__getstate__`: its state, and
(tensor, bytes) pairs whose bytes the file holds for the tensor's storage (a disk tier's files, read back checked,
instead of what their memory mapping shows).
"""

from __future__ import annotations

import collections
import enum
import functools
import importlib
import math
import pathlib
import types
from dataclasses import dataclass, field

import torch

from ..errors import FileFormatError, UnsupportedOperationError

#: Modules whose classes and functions a file may name.
_OWN = "hf_kvplus."
_FOREIGN_CLASSES = {"transformers.cache_utils": ("DummyLayer", "LinearAttentionLayer", "CacheLayerMixin")}


@dataclass
class Encoded:
    """The graph as JSON, the storages its tensors view (by index) and one record per tensor."""

    root: object
    storages: list[torch.UntypedStorage] = field(default_factory=list)
    tensors: list[dict] = field(default_factory=list)
    #: Storage index -> the uint8 host tensor to write for it (bytes read back checked) instead of the storage.
    replaced: dict[int, torch.Tensor] = field(default_factory=dict)


def encode(obj: object) -> Encoded:
    out = Encoded(root=None)
    encoder = _Encoder(out)
    out.root = encoder.value(obj, "cache")
    for key, data in encoder.replacements.items():
        if key in encoder.storage_index:
            out.replaced[encoder.storage_index[key]] = data
    return out


def _storage_key(storage: torch.UntypedStorage) -> tuple:
    return (storage.device.type, storage.device.index, storage.data_ptr(), storage.nbytes())


def decode(root: object, tensors: list[torch.Tensor]) -> object:
    """`tensors[i]` is the tensor of record i, already made (see `file.read`)."""
    return _Decoder(tensors).value(root)


def _name_of(item) -> str:
    return f"{item.__module__}:{item.__qualname__}"


def _allowed(module: str, qualname: str) -> bool:
    return module.startswith(_OWN) or qualname in _FOREIGN_CLASSES.get(module, ())


def _resolve(name: str) -> object:
    """The class or function a file names, if it is one a file may name; never imports outside hf_kvplus."""
    module, _, qualname = name.partition(":")
    if not _allowed(module, qualname):
        raise FileFormatError(f"the file names {name!r}, which is not an hf_kvplus class or function")
    try:
        item = importlib.import_module(module)
        for part in qualname.split("."):
            item = getattr(item, part)
    except (ImportError, AttributeError) as e:
        raise FileFormatError(f"the file names {name!r}, which this hf_kvplus does not have ({e})") from None
    if getattr(item, "__module__", None) != module:
        raise FileFormatError(f"the file names {name!r}, which is defined elsewhere ({item!r})")
    return item


def _own_reduce(cls: type) -> bool:
    """Whether an hf_kvplus class says how it travels by `__reduce__` (a memo that travels empty, a disk folder)."""
    return any("__reduce__" in vars(k) for k in cls.__mro__ if k.__module__.startswith(_OWN))


def _slots(cls: type) -> list[str]:
    names = []
    for k in cls.__mro__:
        slots = vars(k).get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s not in ("__dict__", "__weakref__")]
    return names


class _Encoder:
    def __init__(self, out: Encoded):
        self.out = out
        self.memo: dict[int, int] = {}  # id(obj) -> object number
        self.keep: list = []  # the objects numbered, alive until the end (ids stay unique)
        self.storage_index: dict[tuple, int] = {}
        self.tensor_index: dict[int, int] = {}  # id(tensor) -> its record
        self.replacements: dict[tuple, torch.Tensor] = {}  # storage key -> the bytes to write for it

    def value(self, obj, path: str):
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return obj if type(obj) is int else self._enum_or_fail(obj, path)
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"$float": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return {"$tensor": self._tensor(obj, path)}
        if isinstance(obj, torch.dtype):
            return {"$dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"$device": str(obj)}
        if isinstance(obj, torch.Size):
            return {"$size": list(obj)}
        if isinstance(obj, bytes):
            return {"$bytes": obj.hex()}
        if isinstance(obj, enum.Enum):
            return self._enum_or_fail(obj, path)
        if isinstance(obj, pathlib.PurePath):
            return {"$path": str(obj)}
        if isinstance(obj, tuple) and type(obj) is not tuple and hasattr(type(obj), "_fields"):  # a NamedTuple
            self._check_name(type(obj), path)
            return {"$namedtuple": _name_of(type(obj)), "items": [self.value(x, path) for x in obj]}
        if isinstance(obj, slice):
            return {"$slice": [self.value(x, path) for x in (obj.start, obj.stop, obj.step)]}
        if id(obj) in self.memo:
            return {"$ref": self.memo[id(obj)]}
        if type(obj) in (list, tuple, set, frozenset):
            items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
            encoded = [self.value(x, f"{path}[{i}]") for i, x in enumerate(items)]
            return {f"${type(obj).__name__}": encoded}
        if type(obj) in (dict, collections.OrderedDict, collections.Counter):
            number = self._number(obj)  # dicts may be shared (a placement's by-storage table)
            pairs = [[self.value(k, path), self.value(v, f"{path}[{k!r}]")] for k, v in obj.items()]
            return {"$dict": pairs, "kind": type(obj).__name__, "id": number}
        if type(obj) is functools.partial:  # (a policy factory bound to a cache's settings)
            return {"$partial": self.value(obj.func, path), "args": self.value(list(obj.args), path),
                    "keywords": self.value(dict(obj.keywords), path)}  # fmt: skip
        if isinstance(obj, types.MethodType):
            return {"$method": [self.value(obj.__self__, path), obj.__func__.__name__]}
        if isinstance(obj, (types.FunctionType, type)):
            self._check_name(obj, path)
            return {"$name": _name_of(obj)}
        return self._object(obj, path)

    def _enum_or_fail(self, obj, path: str):
        if isinstance(obj, enum.Enum):
            self._check_name(type(obj), path)
            return {"$enum": _name_of(type(obj)), "name": obj.name}
        return int(obj)

    def _check_name(self, item, path: str) -> None:
        if not _allowed(item.__module__, item.__qualname__) or "<" in item.__qualname__:
            raise UnsupportedOperationError(
                f"{path} is {item!r}, which a saved cache cannot name (only hf_kvplus's own classes and functions)"
            )

    def _number(self, obj) -> int:
        self.memo[id(obj)] = number = len(self.keep)
        self.keep.append(obj)
        return number

    def _object(self, obj, path: str):
        cls = type(obj)
        self._check_name(cls, path)
        number = self._number(obj)
        if _own_reduce(cls):
            made, args = obj.__reduce__()[:2]
            self._check_name(made, path)
            return {"$call": _name_of(made), "args": self.value(list(args), path), "id": number}
        if callable(getattr(cls, "__persist_state__", None)):
            state, replacements = obj.__persist_state__()
            for tensor, data in replacements:
                storage = tensor.untyped_storage()
                if data.dtype != torch.uint8 or data.numel() != storage.nbytes():
                    raise UnsupportedOperationError(
                        f"{path}: {data.numel()} {data.dtype} values given for a storage of {storage.nbytes()} bytes"
                    )
                self.replacements[_storage_key(storage)] = data
            return {"$object": _name_of(cls), "state": self.value(state, path), "setstate": True, "id": number}
        if cls.__getstate__ is not object.__getstate__:
            state = obj.__getstate__()
            return {"$object": _name_of(cls), "state": self.value(state, path), "setstate": True, "id": number}
        attrs = dict(getattr(obj, "__dict__", {}))
        attrs.update({name: getattr(obj, name) for name in _slots(cls) if hasattr(obj, name)})
        encoded = {name: self.value(v, f"{path}.{name}") for name, v in attrs.items()}
        return {"$object": _name_of(cls), "attrs": encoded, "id": number}

    def _tensor(self, t: torch.Tensor, path: str) -> int:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            raise UnsupportedOperationError(f"{path} is a {type(t).__name__}, a tensor subclass a saved cache cannot hold")
        known = self.tensor_index.get(id(t))
        if known is not None:  # one tensor named twice loads as one object (dynamo guards on `a is b`), not two views
            return known
        self.tensor_index[id(t)] = len(self.out.tensors)
        self.keep.append(t)
        storage = t.untyped_storage()
        key = _storage_key(storage)
        if storage.nbytes() == 0 or key not in self.storage_index:
            self.storage_index[key] = len(self.out.storages)
            self.out.storages.append(storage)
        self.out.tensors.append({
            "storage": self.storage_index[key], "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "stride": list(t.stride()), "offset": t.storage_offset(), "device": str(t.device),
        })  # fmt: skip
        return len(self.out.tensors) - 1


class _Decoder:
    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.memo: dict[int, object] = {}

    def value(self, obj):
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, list):  # (never written bare; a file that does is refused below)
            raise FileFormatError("a bare JSON list in the cache graph")
        tag = next((k for k in obj if k.startswith("$")), None)
        handler = getattr(self, "_" + (tag or "$")[1:], None)
        if handler is None:
            raise FileFormatError(f"unknown entry {tag!r} in the cache graph")
        return handler(obj)

    def _float(self, o):
        return float(o["$float"])

    def _tensor(self, o):
        return self.tensors[o["$tensor"]]

    def _dtype(self, o):
        return _dtype(o["$dtype"])

    def _device(self, o):
        return torch.device(o["$device"])

    def _size(self, o):
        return torch.Size(o["$size"])

    def _bytes(self, o):
        return bytes.fromhex(o["$bytes"])

    def _path(self, o):
        return pathlib.Path(o["$path"])

    def _namedtuple(self, o):
        cls = _resolve(o["$namedtuple"])
        if not (isinstance(cls, type) and issubclass(cls, tuple)):
            raise FileFormatError(f"the file names {o['$namedtuple']!r} as a named tuple; it is not one")
        return tuple.__new__(cls, [self.value(x) for x in o["items"]])

    def _slice(self, o):
        return slice(*(self.value(x) for x in o["$slice"]))

    def _ref(self, o):
        return self.memo[o["$ref"]]

    def _list(self, o):
        return [self.value(x) for x in o["$list"]]

    def _tuple(self, o):
        return tuple(self.value(x) for x in o["$tuple"])

    def _set(self, o):
        return {self.value(x) for x in o["$set"]}

    def _frozenset(self, o):
        return frozenset(self.value(x) for x in o["$frozenset"])

    def _dict(self, o):
        kinds = {"dict": dict, "OrderedDict": collections.OrderedDict, "Counter": collections.Counter}
        made = self.memo[o["id"]] = kinds[o["kind"]]()
        for k, v in o["$dict"]:
            made[self.value(k)] = self.value(v)
        return made

    def _method(self, o):
        owner, name = self.value(o["$method"][0]), o["$method"][1]
        if name.startswith("__") or not callable(getattr(type(owner), name, None)):
            raise FileFormatError(f"the file names method {name!r}, which {type(owner).__name__} does not have")
        return getattr(owner, name)

    def _partial(self, o):
        func = self.value(o["$partial"])
        if not callable(func):
            raise FileFormatError(f"the file binds arguments to {func!r}, which is not a function")
        return functools.partial(func, *self.value(o["args"]), **self.value(o["keywords"]))

    def _name(self, o):
        return _resolve(o["$name"])

    def _enum(self, o):
        return _resolve(o["$enum"])[o["name"]]

    def _call(self, o):
        made = _resolve(o["$call"])
        if not isinstance(made, type):
            raise FileFormatError(f"the file asks to call {o['$call']!r}, which is not a class")
        obj = self.memo[o["id"]] = made(*self.value(o["args"]))
        return obj

    def _object(self, o):
        cls = _resolve(o["$object"])
        if not isinstance(cls, type):
            raise FileFormatError(f"the file names {o['$object']!r} as a class; it is not one")
        obj = self.memo[o["id"]] = cls.__new__(cls)
        if o.get("setstate"):
            state = self.value(o["state"])
            if getattr(cls, "__setstate__", None) is not None:
                obj.__setstate__(state)
            else:
                _set_attrs(obj, state)
        else:
            _set_attrs(obj, {name: self.value(v) for name, v in o["attrs"].items()})
        return obj


def _set_attrs(obj, attrs: dict) -> None:
    if not isinstance(attrs, dict):
        raise FileFormatError(f"the state of a {type(obj).__name__} is a {type(attrs).__name__}, not a dict")
    for name, v in attrs.items():
        object.__setattr__(obj, name, v)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise FileFormatError(f"the file names dtype {name!r}, which torch does not have")
    return dtype
