"""Ahead-of-time compile gate: every Triton kernel specialization hf_kvplus can launch, built for GPUs, no GPU needed.

Why: the test suite runs the kernels under the Triton interpreter, which accepts code that a GPU
build rejects and says nothing of registers, spills or shared memory. This gate compiles each
specialization the launch code can ask for with ``triton.compile`` of an ``ASTSource`` for a
``GPUTarget``; the ptxas shipped in the triton wheel does the last step, so it runs on any Linux
machine (CI included).

    python -m hf_kvplus.kernels.aot [--arch sm_80 sm_90 ...] [--json FILE] [--quick] [--kernel NAME ...] [--jobs N]

prints one row per specialization and target (registers and spilled bytes from ptxas' log, shared
memory, compile seconds) and a summary; exit status 1 on any error: a failed compile, or more shared
memory than the target gives one block (the JIT would refuse that launch). A specialization that
needs a newer GPU than the target (float8 e4m3 codes need sm_89+) gets that as its status. ``--quick``
compiles a covering subset (each constexpr value, pointer-type combination and option set of each
kernel at least once; what CI runs).

Where the specializations come from: the library's own Triton entry points run on meta tensors
while every kernel of ``kernels/*.py`` is replaced by a recorder, so each launch's arguments,
constexprs, ``num_warps`` and options are exactly what the launch code and its planners produce
(nothing is copied here that could drift). Each recorded launch is specialized as the JIT would
(triton's own ``native_specialize_impl``: an int 1 becomes a constexpr, ints and pointers divisible
by 16 get the divisibility hint). Representative shapes: batch 2, 2 KV heads, decode over 4099
keys, 17 full-precision residual tokens; one launch stands for those that differ only in that value
specialization. The launches:

- dense decode attention, with and without the attention mass (split kernel with scores, merge with
  log-sum-exp), paged decode attention at the default block size, quantized decode attention
  (int8/int4/int2/fp8 at the default group size; its residual runs the dense split kernel) dense and
  paged at the default block size, and over an evicting cache's slots (keys per token, no residual):
  each dtype x head dim 64/128/256 x query-group tile the planner picks x with and without a mask;
- the paged store (one decode token) and the quantize-and-pack kernels (keys; values at every token
  tile the launch picks, for fp16, and the largest for bf16/fp32): each dtype x head dim (x format);
- rotated formats: decode attention in the rotated space (q float32; its residual runs the dense split
  kernel) for k4v2 and k3v2, dense and paged at the default block size, each head dim x query-group tile
  x with and without a mask x with and without the mass, and every other bit width once (head dim 128,
  dense, mask); quantize-and-pack (its kernel reads the float32 rotated vectors, whatever x's dtype)
  for each bit width x head dim at the largest token tile, every tile at head dim 128, and one token
  per row into slots;
- on one representative (fp16, head dim 128, mask): every other paged block size and query groups
  past one tile (values that only enter index arithmetic).

The gate compiles in fresh worker processes with ``TRITON_INTERPRET`` removed from their
environment (the kernels must be decorated as real ``JITFunction``s) and a private cache directory
(so ptxas always runs: its log gives registers and spills, which a ``CompiledKernel`` reports only
once loaded on a GPU). Needs tqdm (the ``tests`` extra).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib
import inspect
import io
import itertools
import json
import math
import multiprocessing
import os
import re
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass

import torch
import triton
from tqdm import tqdm
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import KernelInterface

from hf_kvplus.kernels import (
    decode_attention,
    paged_attention,
    quant_attention,
    quant_pack,
    rotated_attention,
    rotated_pack,
)
from hf_kvplus.kernels.errors import ConfigError
from hf_kvplus.kernels.paged_attention import DEFAULT_BLOCK_SIZE
from hf_kvplus.kernels.quant_format import BIT_WIDTHS, DEFAULT_GROUP, PackedKV, QuantFormat
from hf_kvplus.kernels.rotated_format import ROTATED_BITS, KeyCenter, RotatedFormat
from hf_kvplus.kernels.turning_center import RotaryBasis

__all__ = [
    "ARCHS", "MAX_SHARED", "Row", "Spec", "covering", "format_table", "main", "parse_arch", "run", "specializations",
    "summary",
]

#: Targets the gate knows (Ampere and newer: what Triton's NVIDIA backend supports): compute capability.
ARCHS = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90, "sm_100": 100, "sm_120": 120}
#: Shared memory one block may use (opt-in maximum, CUDA programming guide): 163, 99 or 227 KiB.
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
#: float8 e4m3 (``tl.float8e4nv``) exists from sm_89 on.
FP8_ARCH = 89
HEAD_DIMS = (64, 128, 256)
KERNEL_MODULES = (decode_attention, paged_attention, quant_attention, quant_pack, rotated_attention, rotated_pack)
#: The rotated formats the gate sweeps over every head dim and option (other bit widths: once each).
ROTATED_FORMATS = (RotatedFormat(4, 2), RotatedFormat(3, 2))
# The representative launch shapes (see the module doc).
BATCH, KV_HEADS, KEYS, RESIDUAL = 2, 2, 4099, 17
# One-at-a-time sweeps run on this representative (with a mask).
REP_DTYPE, REP_HEAD_DIM = torch.float16, 128
#: Block sizes of the paged pools: the powers of two in MIN_BLOCK_SIZE..MAX_BLOCK_SIZE.
PAGED_BLOCK_SIZES = tuple(
    2**i for i in range(paged_attention.MIN_BLOCK_SIZE.bit_length() - 1, paged_attention.MAX_BLOCK_SIZE.bit_length())
)
_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Spec:
    """One compile: a kernel (by module and name) with the ASTSource pieces and options of one launch."""

    module: str
    kernel: str
    label: str
    signature: tuple[tuple[str, str], ...]  # (argument, triton type or "constexpr"), every argument
    constexprs: tuple[tuple[str, object], ...]  # the tl.constexpr parameters and the ints specialized to 1
    attrs: tuple[tuple[int, str], ...]  # (argument index, JIT specialization key such as "D")
    options: tuple[tuple[str, object], ...]  # num_warps, enable_fp_fusion...: what the launch passed
    choices: tuple[tuple[str, object], ...]  # the tl.constexpr parameters alone
    min_arch: int = 0

    def key(self) -> tuple:
        """What the launch code chose: kernel, constexpr parameters, pointer types, options.

        Launches that differ only in the JIT's value specialization of ints (1, multiples of 16) count
        as one: the first recorded stands for them.
        """
        pointers = tuple(kind for _, kind in self.signature if kind.startswith("*"))
        return self.module, self.kernel, self.choices, pointers, self.options

    def features(self) -> set[tuple]:
        """What a covering subset must compile at least once: each constexpr value, pointer types, options."""
        _, kernel, choices, pointers, options = self.key()
        return {(kernel, "pointers", pointers), (kernel, "options", options), *((kernel, *c) for c in choices)}


@dataclass
class Row:
    """The outcome of one spec on one target (``status``: "ok", "needs sm_NN+" or "error")."""

    kernel: str
    spec: str
    target: str
    status: str
    registers: int | None = None
    spill_stores: int | None = None  # bytes
    spill_loads: int | None = None  # bytes
    shared: int | None = None  # bytes
    seconds: float | None = None
    error: str | None = None


def parse_arch(name: str) -> tuple[str, int]:
    """``"sm_90"`` -> ``("sm_90", 90)``; ConfigError for an arch the gate does not know."""
    if name not in ARCHS:
        raise ConfigError(f"unknown arch {name!r}; expected one of {', '.join(ARCHS)}")
    return name, ARCHS[name]


# ---------------------------------------------------------------------------------------------------
# Recording launches
# ---------------------------------------------------------------------------------------------------


class _Recorder:
    """Stands in for one kernel: ``kernel[grid](*args, **kwargs)`` records the launch, runs nothing."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


@contextlib.contextmanager
def _recording(launches: list):
    """Every kernel of KERNEL_MODULES replaced by a recorder, and their runnable checks passed.

    The Triton entry points accept non-CUDA tensors only when their kernels are interpreted
    (``_is_interpreted``); here nothing runs, so meta tensors are let through.
    """
    saved = []
    for module in KERNEL_MODULES:
        for name, obj in list(vars(module).items()):
            if isinstance(obj, KernelInterface):
                saved.append((module, name, obj))
                setattr(module, name, _Recorder(obj, launches))
        saved.append((module, "_is_interpreted", module._is_interpreted))
        module._is_interpreted = lambda fn: True
    try:
        yield
    finally:
        for module, name, obj in saved:
            setattr(module, name, obj)


def _specialize(fn, args, kwargs) -> tuple:
    """(signature, constexprs, attrs, options, choices) of one launch, specialized as the JIT does it."""
    params = inspect.signature(fn.fn).parameters
    bound = inspect.Signature(list(params.values())).bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    signature, constexprs, attrs, choices = [], [], [], []
    for i, (name, value) in enumerate(bound.arguments.items()):
        if "constexpr" in str(params[name].annotation):
            kind, key = "constexpr", value
            choices.append((name, value))
        else:
            kind, key = native_specialize_impl(CUDABackend, value, False, True, True)
        signature.append((name, kind))
        if kind == "constexpr":
            constexprs.append((name, key))
        elif key:
            attrs.append((i, key))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
    return tuple(signature), tuple(constexprs), tuple(attrs), options, tuple(choices)


def _tiles(constexprs: dict, options: dict) -> str:
    """The planner's choices of a launch: BLOCK_* tiles (not the storage's BLOCK_SIZE), chunks, warps."""
    parts = [
        f"{name.removeprefix('BLOCK_').lower()}{value}"
        for name, value in constexprs.items()
        if name.startswith("BLOCK_") and name != "BLOCK_SIZE"
    ]
    if constexprs.get("G_CHUNKS", 1) > 1:
        parts.append(f"chunks{constexprs['G_CHUNKS']}")
    return " ".join([*parts, f"w{options.get('num_warps', 4)}"])


def _record(launch, labels: dict[str, str], min_arch: dict[str, int] | None = None) -> list[Spec]:
    """The specs of the kernels ``launch()`` launches; ``labels`` names each kernel's specialization."""
    launches: list = []
    with _recording(launches):
        launch()
    specs = []
    for fn, args, kwargs in launches:
        name = fn.fn.__name__
        signature, constexprs, attrs, options, choices = _specialize(fn, args, kwargs)
        label = f"{labels[name]} {_tiles(dict(choices), dict(options))}"
        arch = (min_arch or {}).get(name, 0)
        specs.append(Spec(fn.fn.__module__, name, label, signature, constexprs, attrs, options, choices, arch))
    return specs


# ---------------------------------------------------------------------------------------------------
# The launches
# ---------------------------------------------------------------------------------------------------


def _meta(*shape, dtype=torch.float16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _query_groups() -> tuple[list[int], list[int]]:
    """Query heads per KV head, one per (BLOCK_G, G_CHUNKS) the split planner picks (the largest G
    that gets it), G up to two chunks: (groups in one chunk, groups in more)."""
    tiles: dict[tuple[int, int], int] = {}
    for group in range(1, 2 * decode_attention.MAX_BLOCK_G + 1):
        q = _meta(1, group, REP_HEAD_DIM, dtype=REP_DTYPE)
        plan = decode_attention._plan_splits(q, 1, REP_HEAD_DIM, KEYS, None)
        tiles[plan.block_g, plan.g_chunks] = group
    return [g for (_, c), g in tiles.items() if c == 1], [g for (_, c), g in tiles.items() if c > 1]


def _mask(mask: bool, keys: int):
    return _meta(BATCH, keys, dtype=torch.bool) if mask else None


def _dense(dtype, head_dim, group, mask, mass) -> list[Spec]:
    q = _meta(BATCH, KV_HEADS * group, head_dim, dtype=dtype)
    k = v = _meta(BATCH, KV_HEADS, KEYS, head_dim, dtype=dtype)
    name = f"{_SHORT[dtype]} d{head_dim} dense{' mask' if mask else ''}{' scores' if mass else ''}"
    fn = decode_attention.decode_attention_with_mass_triton if mass else decode_attention.decode_attention_triton
    return _record(
        lambda: fn(q, k, v, scale=0.125, mask=_mask(mask, KEYS)),
        {"_decode_split_kernel": name, "_decode_merge_kernel": f"{_SHORT[dtype]} dv{head_dim}{' lse' if mass else ''}"},
    )


def _table(block_size: int):
    columns = -(-KEYS // block_size)
    return _meta(BATCH, columns, dtype=torch.int32), BATCH * columns


def _paged(dtype, head_dim, group, mask, block_size) -> list[Spec]:
    table, blocks = _table(block_size)
    q = _meta(BATCH, KV_HEADS * group, head_dim, dtype=dtype)
    pool = _meta(blocks, KV_HEADS, block_size, head_dim, dtype=dtype)
    return _record(
        lambda: paged_attention.paged_decode_attention_triton(
            q, pool, pool, table, start=0, length=KEYS, scale=0.125, mask=_mask(mask, KEYS)
        ),
        {
            "_decode_split_kernel": f"{_SHORT[dtype]} d{head_dim} paged bs{block_size}{' mask' if mask else ''}",
            "_decode_merge_kernel": f"{_SHORT[dtype]} dv{head_dim}",
        },
    )


def _store(dtype, head_dim, block_size) -> list[Spec]:
    """A decode step's store: one new token per row."""
    pool = _meta(_table(block_size)[1], KV_HEADS, block_size, head_dim, dtype=dtype)
    new = _meta(BATCH, KV_HEADS, 1, head_dim, dtype=dtype)
    slots = _meta(BATCH, 1, dtype=torch.int64)
    bits = dtype.itemsize * 8
    return _record(
        lambda: paged_attention.paged_store_triton(pool, pool, new, new, slots),
        {"_paged_store_kernel": f"{bits}-bit d{head_dim} bs{block_size}"},
    )


def _default_format(bits, head_dim) -> QuantFormat:
    """The quantized caches' default group for ``bits`` at one head dim (the gcd rule of quantized_cache)."""
    return QuantFormat(bits, math.gcd(DEFAULT_GROUP[bits], head_dim))


def _quant_block_sizes(fmt) -> list[int]:
    """Block sizes a quantized pool takes (multiples of the group), the paged pool's default first."""
    default = max(DEFAULT_BLOCK_SIZE, fmt.group_size)
    return [default, *(bs for bs in PAGED_BLOCK_SIZES if bs % fmt.group_size == 0 and bs != default)]


def _packed(fmt, head_dim, rows, tokens, keys_per_token=False) -> PackedKV:
    """Quantized K/V buffers [rows, Hkv, tokens, ...] in ``fmt`` (zeros None for fp8); keys per channel over
    groups of tokens, or laid out as the values with ``keys_per_token``."""
    width = head_dim // fmt.per_byte
    key_params = (tokens, head_dim // fmt.group_size) if keys_per_token else (tokens // fmt.group_size, head_dim)
    zero = None if fmt.is_float else _meta(rows, KV_HEADS, *key_params)
    v_zero = None if fmt.is_float else _meta(rows, KV_HEADS, tokens, head_dim // fmt.group_size)
    return PackedKV(
        _meta(rows, KV_HEADS, tokens, width, dtype=torch.uint8), _meta(rows, KV_HEADS, *key_params), zero,
        _meta(rows, KV_HEADS, tokens, width, dtype=torch.uint8),
        _meta(rows, KV_HEADS, tokens, head_dim // fmt.group_size), v_zero,
    )


def _quantized(dtype, fmt, head_dim, group, mask, block_size, keys_per_token=False, mass=False) -> list[Spec]:
    """Quantized decode attention over KEYS codes (dense, or paged when ``block_size``) plus a residual; with
    ``keys_per_token``, an evicting cache's slots: dense, keys laid out as values, no residual; ``mass``: the
    with-mass entry (logit stores and the merge's log-sum-exp)."""
    q = _meta(BATCH, KV_HEADS * group, head_dim, dtype=dtype)
    residual = None if keys_per_token else _meta(BATCH, KV_HEADS, RESIDUAL, head_dim, dtype=dtype)
    if block_size is None:
        packed, table = _packed(fmt, head_dim, BATCH, -(-KEYS // 128) * 128, keys_per_token), None
    else:
        table, blocks = _table(block_size)
        packed = _packed(fmt, head_dim, blocks, block_size)
    storage = "slots" if keys_per_token else "dense" if block_size is None else f"paged bs{block_size}"
    name = f"{_SHORT[dtype]} d{head_dim} {fmt} {storage}{' mask' if mask else ''}{' scores' if mass else ''}"
    fn = (
        quant_attention.quantized_decode_attention_with_mass_triton
        if mass
        else quant_attention.quantized_decode_attention_triton
    )
    return _record(
        lambda: fn(
            q, packed, fmt, start=0, length=KEYS, scale=0.125, residual_k=residual, residual_v=residual,
            mask=_mask(mask, KEYS + (0 if keys_per_token else RESIDUAL)), block_table=table,
            keys_per_token=keys_per_token,
        ),
        {
            "_quant_split_kernel": name,
            "_decode_split_kernel": f"{_SHORT[dtype]} d{head_dim} dense{' mask' if mask else ''}",
            "_decode_merge_kernel": f"{_SHORT[dtype]} dv{head_dim}{' lse' if mass else ''}",
        },
        # e4m3 codes are converted with tl.float8e4nv (the pack kernels encode them with integers).
        {"_quant_split_kernel": FP8_ARCH} if fmt.is_float else None,
    )


def _pack(dtype, fmt, head_dim) -> list[Spec]:
    """Quantize keys (one group of tokens), and values at the token tiles the launch picks (it shrinks
    them for short inputs; the token count doubles until the tile stops growing): every tile for the
    representative dtype, the largest for the others."""
    name = f"{_SHORT[dtype]} {fmt} d{head_dim}"
    x = _meta(BATCH, KV_HEADS, fmt.group_size, head_dim, dtype=dtype)
    keys = _record(lambda: quant_pack.quantize_keys_triton(x, fmt), {"_quant_keys_kernel": name})
    values: list[Spec] = []
    tokens = 1
    while True:
        x = _meta(BATCH, KV_HEADS, tokens, head_dim, dtype=dtype)
        (spec,) = _record(functools.partial(quant_pack.quantize_values_triton, x, fmt), {"_quant_values_kernel": name})
        if values and spec.key() == values[-1].key():
            return keys + (values if dtype == REP_DTYPE else values[-1:])
        values.append(spec)
        tokens *= 2


def _pack_at(dtype, fmt, head_dim) -> list[Spec]:
    """Quantize one token per row and head into its slot of slot buffers (an evicting cache's refill)."""
    x = _meta(BATCH, KV_HEADS, 1, head_dim, dtype=dtype)
    slots = _meta(BATCH, KV_HEADS, 1, dtype=torch.int64)
    codes = _meta(BATCH, KV_HEADS, KEYS, head_dim // fmt.per_byte, dtype=torch.uint8)
    params = _meta(BATCH, KV_HEADS, KEYS, head_dim // fmt.group_size)
    out = (codes, params, None if fmt.is_float else params)
    return _record(
        lambda: quant_pack.quantize_values_at_triton(x, fmt, out, slots),
        {"_quant_values_kernel": f"{_SHORT[dtype]} {fmt} d{head_dim} slots"},
    )


def _centered(fmt: RotatedFormat, head_dim: int) -> KeyCenter:
    """A set key centre of ``fmt``, as a cache's layer holds it (``RotatedFormat.make_state``)."""
    return KeyCenter.given(_meta(KV_HEADS, head_dim, dtype=torch.float32), fmt.seed)


def _turning(fmt: RotatedFormat, head_dim: int) -> KeyCenter:
    """A set key centre turning with RoPE, as a growing storage's full-attention layer holds it."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    center = KeyCenter(RotaryBasis(inv_freq, head_dim))
    center.mu = _meta(KV_HEADS, head_dim, dtype=torch.float32)
    center.weights = center.rotated_weights = _meta(KV_HEADS, head_dim, head_dim, dtype=torch.float32)
    return center


def _rotated(fmt, head_dim, group, mask, block_size, mass, turning=False) -> list[Spec]:
    """Rotated-format decode attention over KEYS coded tokens (dense, or paged when ``block_size``) plus a
    residual, as ``quant_attention``'s dispatcher launches it for a cache's layer (keys centred; `turning`: relative to
    a turning centre, dense): q and the residual rotated, float32."""
    center = _turning(fmt, head_dim) if turning else _centered(fmt, head_dim)
    q = _meta(BATCH, KV_HEADS * group, head_dim, dtype=torch.float32)
    residual = _meta(BATCH, KV_HEADS, RESIDUAL, head_dim, dtype=torch.float32)
    if block_size is None:
        table, rows, tokens = None, BATCH, KEYS
    else:
        (table, rows), tokens = _table(block_size), block_size
    packed = PackedKV.allocate(fmt, rows, KV_HEADS, tokens, head_dim, head_dim, "meta")
    storage = "dense" if block_size is None else f"paged bs{block_size}"
    flags = f"{' mask' if mask else ''}{' scores' if mass else ''}"
    return _record(
        lambda: rotated_attention.rotated_decode_attention_triton(
            q, packed, fmt, start=0, length=KEYS, scale=0.125, residual_k=residual,
            residual_v=residual, mask=_mask(mask, KEYS + RESIDUAL), block_table=table, with_mass=mass,
            key_center=center,
        ),
        {
            "_rotated_split_kernel": f"fp32 d{head_dim} {fmt} {storage}{flags}{' turning' if turning else ''}",
            "_decode_split_kernel": f"fp32 d{head_dim} dense{flags}",
            "_decode_merge_kernel": f"fp32 dv{head_dim}{' lse' if mass else ''}",
        },
    )


def _rotated_pack(bits, head_dim, centered) -> list[Spec]:
    """Rotated quantize-and-pack at the token tiles the launch picks (the token count doubles until the tile stops
    growing): every tile at the representative head dim, the largest at the others; and one token per row and head
    into its slot of slot buffers (an evicting cache's refill). `centered`: keys with a centre (signed norms)."""
    fmt = RotatedFormat(bits, bits)
    center = _centered(fmt, head_dim) if centered else None
    name = f"{bits}-bit d{head_dim}{' centred' if centered else ''}"
    tiles: list[Spec] = []
    tokens = 1
    while True:
        x = _meta(BATCH, KV_HEADS, tokens, head_dim)
        (spec,) = _record(functools.partial(rotated_pack.quantize_rotated_triton, x, fmt, "keys", center=center),
                          {"_rotated_pack_kernel": name})  # fmt: skip
        if tiles and spec.key() == tiles[-1].key():
            break
        tiles.append(spec)
        tokens *= 2
    x, slots = _meta(BATCH, KV_HEADS, 1, head_dim), _meta(BATCH, KV_HEADS, 1, dtype=torch.int64)
    codes = PackedKV.allocate(fmt, BATCH, KV_HEADS, KEYS, head_dim, head_dim, "meta")
    out = (codes.k, codes.k_scale, None)
    at = _record(
        lambda: rotated_pack.quantize_rotated_triton(x, fmt, "keys", out, slots, center=center),
        {"_rotated_pack_kernel": f"{name} slots"},
    )
    return (tiles if head_dim == REP_HEAD_DIM else tiles[-1:]) + at


def specializations() -> list[Spec]:
    """Every specialization of the gate, in table order, without duplicates (see the module doc)."""
    dtypes = decode_attention.SUPPORTED_DTYPES
    groups, more_groups = _query_groups()
    flags = (False, True)
    specs: list[Spec] = []
    for dt, d, g, mask, mass in itertools.product(dtypes, HEAD_DIMS, groups, flags, flags):
        specs += _dense(dt, d, g, mask, mass)
    for dt, d, g, mask in itertools.product(dtypes, HEAD_DIMS, groups, flags):
        specs += _paged(dt, d, g, mask, DEFAULT_BLOCK_SIZE)
    for dt, d in itertools.product(dtypes, HEAD_DIMS):
        specs += _store(dt, d, DEFAULT_BLOCK_SIZE)
    for dt, bits, d, g, mask in itertools.product(dtypes, BIT_WIDTHS, HEAD_DIMS, groups, flags):
        fmt = _default_format(bits, d)
        specs += _quantized(dt, fmt, d, g, mask, None)
        specs += _quantized(dt, fmt, d, g, mask, _quant_block_sizes(fmt)[0])
        specs += _quantized(dt, fmt, d, g, mask, None, keys_per_token=True)
        specs += _quantized(dt, fmt, d, g, mask, None, keys_per_token=True, mass=True)
    for dt, bits, d in itertools.product(dtypes, BIT_WIDTHS, HEAD_DIMS):
        specs += _pack(dt, _default_format(bits, d), d)
        specs += _pack_at(dt, _default_format(bits, d), d)
    for fmt, d, g, mask, mass in itertools.product(ROTATED_FORMATS, HEAD_DIMS, groups, flags, flags):
        specs += _rotated(fmt, d, g, mask, None, mass) + _rotated(fmt, d, g, mask, DEFAULT_BLOCK_SIZE, mass)
        specs += _rotated(fmt, d, g, mask, None, mass, turning=True)
    for bits in ROTATED_BITS:
        fmt = RotatedFormat(bits, bits)
        if fmt not in ROTATED_FORMATS:
            specs += _rotated(fmt, REP_HEAD_DIM, groups[0], True, None, False)
    for bits, d, centered in itertools.product(ROTATED_BITS, HEAD_DIMS, flags):
        specs += _rotated_pack(bits, d, centered)

    rep = (REP_DTYPE, REP_HEAD_DIM)
    for bs in PAGED_BLOCK_SIZES:
        specs += _paged(*rep, groups[0], True, bs) + _store(*rep, bs)
    for g in more_groups:
        specs += _dense(*rep, g, True, True) + _paged(*rep, g, True, DEFAULT_BLOCK_SIZE)
    for bits in BIT_WIDTHS:
        fmt = _default_format(bits, REP_HEAD_DIM)
        for bs in _quant_block_sizes(fmt)[1:]:
            specs += _quantized(REP_DTYPE, fmt, REP_HEAD_DIM, groups[0], True, bs)
        for g in more_groups:
            specs += _quantized(REP_DTYPE, fmt, REP_HEAD_DIM, g, True, None)
    unique: dict[tuple, Spec] = {}
    for spec in specs:
        unique.setdefault(spec.key(), spec)
    kernels = list(dict.fromkeys(spec.kernel for spec in unique.values()))
    return sorted(unique.values(), key=lambda spec: kernels.index(spec.kernel))


def covering(specs: list[Spec]) -> list[Spec]:
    """A small subset that compiles every feature of ``specs`` at least once (greedy set cover): per
    kernel, each value of each constexpr parameter, each combination of pointer types and each
    option set. What CI compiles; the whole list takes minutes per core."""
    missing = set().union(*(spec.features() for spec in specs))
    chosen = []
    while missing:
        best = max(specs, key=lambda spec: len(spec.features() & missing))
        chosen.append(best)
        missing -= best.features()
    return [spec for spec in specs if spec in chosen]


# ---------------------------------------------------------------------------------------------------
# Compilation (in worker processes)
# ---------------------------------------------------------------------------------------------------


def _ast_source(fn, spec: Spec):
    """The ``ASTSource`` of ``spec`` as triton 3.6 through 3.9 take it: signature and constexprs keyed
    by argument name, attrs keyed by ``(index,)`` paths and parsed by the backend."""
    attrs = {(i,): CUDABackend.parse_attr(key) for i, key in spec.attrs}
    return triton.compiler.ASTSource(
        fn=fn, signature=dict(spec.signature), constexprs=dict(spec.constexprs), attrs=attrs
    )


def _ptxas_usage(log: str) -> tuple[int | None, int | None, int | None]:
    """(registers, spill store bytes, spill load bytes) from ptxas' -v log of one entry function."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (
        int(regs.group(1)) if regs else None,
        int(spills.group(1)) if spills else None,
        int(spills.group(2)) if spills else None,
    )


def _init_worker(cache_dir: str) -> None:
    """A private cache (every compile runs ptxas) and ptxas' log printed, to read registers and spills."""
    triton.knobs.cache.dir = cache_dir
    triton.knobs.nvidia.dump_ptxas_log = True
    # Triton 3.9 warns once per process that its fp-fusion default will change: a concern of the launch
    # code (which passes enable_fp_fusion where it matters), noise in every worker here.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")


def _describe(error: BaseException) -> str:
    """The error and its root cause (triton wraps the cause in errors that quote the kernel source)."""
    root = error
    while root.__cause__ or root.__context__:
        root = root.__cause__ or root.__context__
    text = f"{type(error).__name__}: {error}".strip()
    return text if root is error else f"{text}\n  caused by {type(root).__name__}: {root}"


def _compile(spec: Spec, target: str, arch: int) -> Row:
    row = Row(spec.kernel, spec.label, target, "ok")
    log = io.StringIO()
    start = time.perf_counter()
    try:
        fn = getattr(importlib.import_module(spec.module), spec.kernel)
        with contextlib.redirect_stdout(log):  # ptxas' log, and the PTX that triton prints on a failure
            compiled = triton.compile(
                _ast_source(fn, spec), target=GPUTarget("cuda", arch, 32), options=dict(spec.options)
            )
    except Exception as e:  # noqa: BLE001 - every failure is a row of the report
        row.status, row.error = "error", _describe(e)
    else:
        row.registers, row.spill_stores, row.spill_loads = _ptxas_usage(log.getvalue())
        row.shared = compiled.metadata.shared
        if row.shared > MAX_SHARED[arch]:
            row.status, row.error = "error", f"needs {row.shared} bytes of shared memory, {target} has {MAX_SHARED[arch]}"
    row.seconds = round(time.perf_counter() - start, 2)
    return row


@contextlib.contextmanager
def _worker_environment():
    """Workers start without TRITON_INTERPRET: it is read when @triton.jit decorates, at import."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def run(specs: list[Spec], targets: list[tuple[str, int]], jobs: int | None = None) -> list[Row]:
    """Compile every spec for every target in ``jobs`` fresh processes; rows in spec-then-target order.

    A worker that dies (a crash inside the compiler) fails its rows, and those still queued, as errors.
    """
    rows = [Row(spec.kernel, spec.label, target, "queued") for spec, (target, _) in itertools.product(specs, targets)]
    work = {}
    for i, (spec, (_, arch)) in enumerate(itertools.product(specs, targets)):
        if arch < spec.min_arch:
            rows[i].status = f"needs sm_{spec.min_arch}+"
        else:
            work[i] = (spec, rows[i].target, arch)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    context = multiprocessing.get_context("spawn")
    with (
        tempfile.TemporaryDirectory(prefix="kvplus-aot-") as cache_dir,
        _worker_environment(),
        ProcessPoolExecutor(jobs, context, initializer=_init_worker, initargs=(cache_dir,)) as pool,
        tqdm(total=len(work), desc="compiling", unit="kernel", file=sys.stderr) as bar,
    ):
        futures = {pool.submit(_compile, *job): i for i, job in work.items()}
        for future in as_completed(futures):
            i = futures[future]
            try:
                rows[i] = future.result()
            except BrokenProcessPool as e:
                rows[i].status, rows[i].error = "error", f"worker process died: {e}"
            bar.update()
    return rows


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------


def _cell(value) -> str:
    return "-" if value is None else str(value)


def format_table(rows: list[Row]) -> str:
    """One line per row: kernel, specialization, target, status, registers, spills, shared memory, seconds."""
    header = ("kernel", "specialization", "target", "status", "regs", "spill st/ld B", "smem B", "s")
    lines = [
        (
            r.kernel, r.spec, r.target, r.status, _cell(r.registers),
            "-" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}", _cell(r.shared),
            _cell(r.seconds),
        )
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i < 4 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*x).rstrip() for x in [header, *lines])


def summary(rows: list[Row], wall: float) -> str:
    """The closing line: rows per outcome, rows that spill, wall time, triton version."""
    failed = sum(r.status == "error" for r in rows)
    newer = sum(r.status.startswith("needs") for r in rows)
    spilling = sum(bool(r.spill_stores or r.spill_loads) for r in rows)
    return (
        f"{len(rows)} specializations: {len(rows) - failed - newer} compiled, {newer} need a newer arch, "
        f"{failed} failed, {spilling} spill; {wall:.0f} s wall, triton {triton.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_kvplus.kernels.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", nargs="+", default=["sm_90"], help=f"targets (default sm_90): {', '.join(ARCHS)}")
    parser.add_argument("--json", metavar="FILE", help="also write every row, the triton version, targets, date")
    parser.add_argument("--kernel", nargs="+", metavar="NAME", help="only these kernels (function names)")
    parser.add_argument("--quick", action="store_true", help="only a covering subset (see covering(); what CI runs)")
    parser.add_argument("--jobs", type=int, help="worker processes (default: one per CPU)")
    args = parser.parse_args(argv)
    try:
        targets = [parse_arch(a) for a in args.arch]
    except ConfigError as e:
        parser.error(str(e))
    specs = [s for s in specializations() if not args.kernel or s.kernel in args.kernel]
    if args.quick:
        specs = covering(specs)
    start = time.perf_counter()
    rows = run(specs, targets, args.jobs)
    wall = time.perf_counter() - start
    print(format_table(rows))
    for r in rows:
        if r.status == "error":
            print(f"\nFAILED {r.kernel} [{r.spec}] {r.target}:\n{r.error}")
    print(summary(rows, wall), flush=True)
    if args.json:
        report = {
            "triton": triton.__version__,
            "targets": [t for t, _ in targets],
            "quick": args.quick,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "wall_seconds": round(wall, 1),
            "rows": [asdict(r) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if any(r.status == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
