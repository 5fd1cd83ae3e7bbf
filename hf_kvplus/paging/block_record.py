"""One stored block as bytes: what a persistent prefix store files under a block's key, checked when read back.

`magic | meta length | meta (JSON: the key, each tensor's layer, name, dtype and shape) | payload | XXH3-64 of all
before it`. A record read under another key, cut short, grown or altered is refused with `CorruptFileError`, so a
torn or foreign block never reaches a pool.
"""

from __future__ import annotations

import json

import torch
from xxhash import xxh3_64_intdigest

from ..errors import CorruptFileError

MAGIC = b"KVPLUS-BLOCK-1\n"
_DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.float8_e4m3fn, torch.float8_e5m2,
)}  # fmt: skip


def encode_record(key: str, tensors: list[tuple[int, str, torch.Tensor]]) -> bytes:
    """The record of one block: `tensors` are (layer, name, that layer's tensor of the block)."""
    parts, meta = [], {"key": key, "tensors": []}
    for layer, name, t in tensors:
        data = t.detach().contiguous().cpu()
        meta["tensors"].append([layer, name, str(data.dtype).removeprefix("torch."), list(data.shape)])
        parts.append(data.view(torch.uint8).reshape(-1).numpy().tobytes())
    head = json.dumps(meta, separators=(",", ":")).encode()
    body = MAGIC + len(head).to_bytes(8, "little") + head + b"".join(parts)
    return body + xxh3_64_intdigest(body).to_bytes(8, "little")


def decode_record(data: bytes, key: str) -> list[tuple[int, str, torch.Tensor]]:
    """The tensors of a record, checked: its checksum, its key, and its length against its own meta."""
    if len(data) < len(MAGIC) + 16 or not data.startswith(MAGIC):
        raise CorruptFileError(f"block {key}: {len(data)} bytes that do not start as a stored block")
    body, tail = data[:-8], data[-8:]
    if xxh3_64_intdigest(body) != int.from_bytes(tail, "little"):
        raise CorruptFileError(
            f"block {key}: XXH3 {xxh3_64_intdigest(body):016x}, the record says {int.from_bytes(tail, 'little'):016x}"
        )
    start = len(MAGIC) + 8
    size = int.from_bytes(body[len(MAGIC) : start], "little")
    meta = json.loads(body[start : start + size])
    if meta.get("key") != key:
        raise CorruptFileError(f"block {key}: the record was written under key {meta.get('key')!r}")
    out, offset = [], start + size
    for layer, name, dtype, shape in meta["tensors"]:
        dtype = _DTYPES[dtype]
        n = dtype.itemsize * _numel(shape)
        if offset + n > len(body):
            raise CorruptFileError(f"block {key}: its tensors need {offset + n} bytes, the record holds {len(body)}")
        raw = torch.frombuffer(bytearray(body[offset : offset + n]), dtype=torch.uint8)
        out.append((layer, name, raw.view(dtype).reshape(shape)))
        offset += n
    if offset != len(body):
        raise CorruptFileError(f"block {key}: {len(body) - offset} bytes after its tensors")
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
