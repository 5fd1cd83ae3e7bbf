"""The quantized segment through optimum-quanto's quantizers (`backend="quanto"`), for comparison."""

from __future__ import annotations

import torch

from ..errors import CacheMismatchError, ConfigError
from ..kernels.quant_format import QuantFormat
from ..memory import MemoryReport, tensor_bytes
from .quantized import QuantizedSegment
from .reads import DenseRead, Read


def _quanto():
    try:
        import optimum.quanto as quanto
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("backend='quanto' needs optimum-quanto: pip install 'hf-kvplus[quanto]'") from exc
    return quanto


class QuantoSegment(QuantizedSegment):
    """The same KIVI grouping as `PackedSegment` (keys per channel over groups of tokens, values per token
    over groups of channels), quantized by optimum-quanto: `MaxOptimizer` + `quantize_weight` for int4 and
    int2 (asymmetric), absmax scales for int8 and fp8 (symmetric, quanto's 8-bit types take no zero point).

    Each flush is kept as one pair of quanto tensors; attention dequantizes them (quanto has no fused
    attention), so this backend measures quanto's quantizers, not a kernel.
    """

    #: Quanto keeps float32 scales: every finite value codes (`value_range`).
    float32_scales = True

    def __init__(self, fmt: QuantFormat):
        q = _quanto()
        self.fmt = fmt
        self.qtype = {2: q.qint2, 4: q.qint4, 8: q.qint8, "fp8": q.qfloat8_e4m3fn}[fmt.bits]
        self.chunks: list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int]] = []  # (qk, qv, shape, tokens)
        self.front = 0  # tokens dropped from the first chunk

    def __getstate__(self) -> dict:
        """Quanto's tensors are wrapper subclasses that neither pickle nor deep-copy: they travel as their parts."""
        state = dict(self.__dict__)
        state["chunks"] = [(_parts(qk), _parts(qv), shape, n) for qk, qv, shape, n in self.chunks]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.chunks = [(_joined(qk), _joined(qv), shape, n) for qk, qv, shape, n in self.chunks]

    @property
    def length(self) -> int:
        return sum(chunk[3] for chunk in self.chunks) - self.front

    @property
    def front_offset(self) -> int:
        return self.front % self.fmt.group_size

    @property
    def batch_size(self) -> int:
        return self.chunks[0][2][0] if self.chunks else 0

    def append(self, keys: torch.Tensor, values: torch.Tensor, same_rows: list[int] | None = None) -> None:
        self._release_dropped()
        if self.chunks and keys.shape[0] != self.batch_size:
            raise CacheMismatchError(f"new keys have batch {keys.shape[0]}, the cache holds {self.batch_size} rows")
        if not self.chunks:
            self.dtype = keys.dtype
        shape = tuple(keys.shape)
        g = self.fmt.group_size
        # keys: per channel over groups of tokens -> rows of g tokens of one channel
        k_rows = keys.transpose(2, 3).reshape(*shape[:2], shape[3], shape[2] // g, g).reshape(-1, g)
        v_rows = values.reshape(-1, g)  # per token over groups of channels
        self.chunks.append((self._quantize(k_rows), self._quantize(v_rows), shape, shape[2]))

    def _quantize(self, rows: torch.Tensor):
        q = _quanto()
        if self.fmt.bits in (2, 4):
            scale, shift = q.MaxOptimizer()(rows, self.qtype, 0, self.fmt.group_size)
            return q.quantize_weight(rows, self.qtype, 0, scale, shift, self.fmt.group_size)
        return q.quantize_weight(rows, self.qtype, 0, q.absmax_scale(rows, self.qtype, 0))

    def _chunk(self, index: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self._dequantize(self.chunks[index], dtype)

    def _dequantize(self, chunk, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        qk, qv, (B, H, n, D), _ = chunk
        g = self.fmt.group_size
        k = qk.dequantize().reshape(B, H, D, n // g, g).reshape(B, H, D, n).transpose(2, 3)
        v = qv.dequantize().reshape(B, H, n, -1)
        return k.to(dtype), v.to(dtype)

    def dequantized(self, first: int, last: int, dtype: torch.dtype | None = None):
        dtype = dtype or self.dtype
        lo, hi = first + self.front, last + self.front
        ks, vs, offset = [], [], 0
        for i, chunk in enumerate(self.chunks):
            n = chunk[3]
            if offset < hi and offset + n > lo:
                k, v = self._chunk(i, dtype)
                a, b = max(lo - offset, 0), min(hi - offset, n)
                ks.append(k[:, :, a:b])
                vs.append(v[:, :, a:b])
            offset += n
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def read(self, first, count, recent_k, recent_v, dense) -> Read:
        return DenseRead(*dense())  # quanto's codes have no kernel here: dequantize

    def drop_front(self, count: int) -> None:
        self.front += count  # whole chunks are released at the next append

    def _release_dropped(self) -> None:
        while self.chunks and self.front >= self.chunks[0][3]:
            self.front -= self.chunks.pop(0)[3]

    def truncate(self, keep: int) -> None:
        """Keeps whole groups; a flush cut in its middle is quantized again from its kept groups, which
        min/max quantization maps back onto the same grid."""
        total = keep + self.front
        offset = 0
        for i, chunk in enumerate(self.chunks):
            n = chunk[3]
            if offset + n >= total:
                if total - offset < n:
                    k, v = self._chunk(i, self.dtype)
                    cut = total - offset
                    del self.chunks[i:]
                    if cut:
                        self.append(k[:, :, :cut].contiguous(), v[:, :, :cut].contiguous())
                else:
                    del self.chunks[i + 1 :]
                break
            offset += n
        if not self.chunks:
            self.front = 0

    def index_batch(self, indices: torch.Tensor) -> None:
        """Rows are selected on the dequantized chunks, quantized again onto the same grid (quanto tensors
        cannot be indexed along the batch)."""
        self._release_dropped()
        chunks, front = self.chunks, self.front
        self.chunks, self.front = [], 0
        for chunk in chunks:
            k, v = (t.index_select(0, indices.to(t.device)) for t in self._dequantize(chunk, self.dtype))
            self.append(k.contiguous(), v.contiguous())
        self.front = front

    def reset(self) -> None:
        self.chunks = []
        self.front = 0

    def memory(self) -> MemoryReport:
        if not self.chunks:
            return MemoryReport()
        payload = metadata = 0
        for qk, qv, _, _ in self.chunks:
            for qt in (qk, qv):
                names, _ = qt.__tensor_flatten__()
                for name in names:
                    nbytes = tensor_bytes(getattr(qt, name))
                    if name == "_data":
                        payload += nbytes
                    else:
                        metadata += nbytes
        return MemoryReport(payload_bytes=payload, metadata_bytes=metadata, batch_size=self.batch_size)


def _parts(t: torch.Tensor):
    """A wrapper tensor subclass as (class, its inner tensors' parts, context, size, stride); a plain tensor as is."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return t
    names, context = t.__tensor_flatten__()
    return (type(t), {name: _parts(getattr(t, name)) for name in names}, context, tuple(t.size()), tuple(t.stride()))


def _joined(parts) -> torch.Tensor:
    """The tensor `_parts` took apart."""
    if isinstance(parts, torch.Tensor):
        return parts
    cls, inner, context, size, stride = parts
    return cls.__tensor_unflatten__({name: _joined(p) for name, p in inner.items()}, context, size, stride)
