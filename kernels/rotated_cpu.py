"""The rotated formats' C++ operators on the CPU: decode attention (``torch.ops.hf_kvplus_cpu.rotated_decode``) and
quantize-and-pack (``torch.ops.hf_kvplus_cpu.rotated_encode``).

Why: the plain-torch twin decodes every code position to float32 in memory at each step, then multiplies; on a
CPU that decode costs about half of the attention, and inductor cannot fuse a decode into the matrix product it
feeds. The attention operator (``rotated_attention_cpu.cpp``) never writes the decoded codes out: a key's score is
one read per code byte (3-bit codes: per 6 bits) of a table, made once per call and query, of that byte's dot
product with q's channels there; the values are decoded 16 tokens at a time into a small buffer (a table row per
byte, as :func:`rotated_format.decoded_units` reads them) and summed at once; the ring of exact keys comes after
the codes, and q and the output are rotated inside. One call per layer and step, which a compiled graph calls as
one external kernel (a Python custom operator would cost about 18 us a call there). The encode operator
(``rotated_pack_cpu.cpp``) codes each vector in one pass (centre, rotation, length, codebook search,
re-normalization, packing), where inductor generates a chain of scalar loops for the twin's few vectors of a decode
step: an evicting cache codes its new token and re-codes its moved sinks at every step.

Both are built on first use, as one library, with ``torch.utils.cpp_extension.load_inline`` (a C++ compiler and
ninja; tens of seconds once, then cached by torch under ``TORCH_EXTENSIONS_DIR``), for the CPU it runs on
(``-march=native``: the build's name carries a digest of the sources, the flags and the CPU's), when a rotated
layer first sees its shapes on the CPU (``dispatch.prepare``). Where they cannot be built, or with
``HF_KVPLUS_CPU_KERNELS=0``, the twins run, as everywhere off CUDA before; a failed build warns once.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path

import torch

from hf_kvplus.kernels import rotated_format
from hf_kvplus.kernels.constants import Constants
from hf_kvplus.kernels.rotated_format import (
    RotatedFormat,
    byte_table,
    codebook,
    coding_center,
    rotation,
)

__all__ = ["available", "encodes", "encodes_into", "float32", "rotated_decode_cpu", "rotated_encode_cpu",
           "rotated_encode_into_cpu", "rotated_encode_kv_into_cpu", "rows", "supports"]

#: One library: the rotated formats' operators and the KIVI and paged decode of `kivi_cpu` (built, or not, together).
_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("cpu_common.cpp", "rotated_attention_cpu.cpp", "rotated_pack_cpu.cpp", "kivi_attention_cpu.cpp",
                 "kivi_pack_cpu.cpp", "token_write_cpu.cpp")  # fmt: skip
]
#: OpenMP on Linux: `at::parallel_for` is inline OpenMP code in torch's headers (sequential without it), and the
#: library then shares the libgomp that torch has loaded (as inductor's kernels do).
_OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
_FLAGS = ["-O3", "-march=native", "-std=c++17", *_OPENMP]
#: None: not tried yet; then whether the operators are registered.
_LOADED: bool | None = None
#: What registers the fakes of the other operators built into the library (`kivi_cpu`'s): called once it loads.
_ON_LOAD: list = []


def when_loaded(register) -> None:
    """Calls `register` (the fakes of operators another module wraps) once the library is loaded: now, if it is."""
    if _LOADED:
        register()
    else:
        _ON_LOAD.append(register)


def available() -> bool:
    """Whether the operators are there, building them on the first call outside a compiled region (a graph being
    traced only reads what an earlier call found)."""
    global _LOADED
    if _LOADED is None and not torch.compiler.is_compiling():
        _LOADED = _load()
    return bool(_LOADED)


def supports(q: torch.Tensor, block_table) -> bool:
    """Whether this call can take the attention operator: CPU tensors, codes in one buffer (not a pool of blocks),
    and the operators built."""
    return q.is_cpu and block_table is None and available()


def encodes(x: torch.Tensor) -> bool:
    """Whether `x` can be coded by the encode operator: floats [B, H, T, D] on the CPU, and the operator built (other
    input goes to the twin, which says what is wrong with it)."""
    return x.is_cpu and x.dim() == 4 and x.is_floating_point() and available()


def rotated_encode_cpu(
    x: torch.Tensor, fmt: RotatedFormat, side: str, positions: torch.Tensor | None = None, center=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [B, H, T, D * bits // 8], norms float16 [B, H, T, 1]) of x [B, H, T, D], as
    `rotated_format.quantize_rotated` makes them (relative to the layer's key `center`, given with the keys, whose
    first call sets it, as there; a turning centre is taken at the tokens' indices `positions`)."""
    D = x.shape[-1]
    fmt.check_head_dim(D)
    bits = fmt.bits_of(side)
    centroids, boundaries = codebook(D, bits, x.device)
    turn = None if fmt.inputs_rotated else rotation(D, fmt.seed, x.device)
    mu = coding_center(x, fmt, positions, center)
    return torch.ops.hf_kvplus_cpu.rotated_encode(x.float(), turn, boundaries, centroids, mu, bits,
                                                  rotated_format.RENORMALIZE)  # (an ablation may turn it off)


def encodes_into(x: torch.Tensor, center) -> bool:
    """Whether `rotated_encode_into_cpu` codes `x` relative to `center` (a layer's key centre, or None): `encodes`,
    and a centre that is set and does not turn (an unset one is set from the keys as they are coded, which a range
    guard must have cleaned first; a turning one is taken at positions, which slots do not code by)."""
    return encodes(x) and (center is None or (center.mu is not None and center.turns is None))


#: The `bad` counter of an unguarded `rotated_encode_into_cpu` call (the operator leaves it untouched).
_UNCOUNTED = torch.zeros((), dtype=torch.long)


def rotated_encode_into_cpu(
    x: torch.Tensor, fmt: RotatedFormat, side: str, out, start: int = 0, slots: torch.Tensor | None = None,
    limit: float | None = None, bad: torch.Tensor | None = None, center=None,
) -> None:  # fmt: skip
    """`rotated_encode_cpu`'s codes of x [B, H, T, D] written into `out` = (codes, norms, None) [B, H, N, ...] at
    rows `slots` [B, H, T] int64 (None: rows `start` .. `start` + T - 1), bit for bit. With `limit`, a vector
    whose length exceeds it (or is not finite) is coded as the zero vector and counted into `bad` (0-d int64), as
    `RangeGuard` zeroes it before coding: the guard, the coding and the copies of an evicting cache's decode step in
    one call. `center`: as `encodes_into` says (a set centre that does not turn)."""
    bits = fmt.key_bits if side == "keys" else fmt.value_bits
    coder = _coder_of(x, fmt, bits)
    torch.ops.hf_kvplus_cpu.rotated_encode_into(
        x.float(), *coder, _center_of(x, fmt, center), bits, rotated_format.RENORMALIZE,
        -1.0 if limit is None else float(limit), out[0], out[1], start, slots, _UNCOUNTED if bad is None else bad,
    )  # fmt: skip


def rotated_encode_kv_into_cpu(
    k: torch.Tensor, v: torch.Tensor, fmts, out_k, out_v, start: int = 0, slots: torch.Tensor | None = None,
    limit: float | None = None, bad: torch.Tensor | None = None, center=None,
) -> None:  # fmt: skip
    """`rotated_encode_into_cpu` of a token's keys `k` (values side of ``fmts[0]``, relative to `center`) into `out_k`
    and values `v` (values side of ``fmts[1]``) into `out_v`, at the same rows, in one operator call: at a decode step
    an operator call costs more than its compute."""
    k_fmt, v_fmt = fmts
    k_bits, v_bits = k_fmt.value_bits, v_fmt.value_bits
    torch.ops.hf_kvplus_cpu.rotated_encode_kv_into(
        k.float(), v.float(), *_coder_of(k, k_fmt, k_bits), _center_of(k, k_fmt, center), k_bits,
        *_coder_of(v, v_fmt, v_bits), v_bits, rotated_format.RENORMALIZE, -1.0 if limit is None else float(limit),
        out_k[0], out_k[1], out_v[0], out_v[1], start, slots, _UNCOUNTED if bad is None else bad,
    )  # fmt: skip


def _coder_of(x: torch.Tensor, fmt: RotatedFormat, bits: int) -> tuple:
    """(rotation or None, boundaries, centroids) the encode operators read for `x`'s head dim in `fmt` at `bits`."""
    device = x.device
    return _CODERS.get((x.shape[-1], bits, fmt.seed, fmt.inputs_rotated, device),
                       lambda: _coder(fmt, x.shape[-1], bits, device))  # fmt: skip


def _center_of(x: torch.Tensor, fmt: RotatedFormat, center) -> torch.Tensor | None:
    """The centre the encode operators code `x` relative to: a set centre that does not turn as it is; else as
    `coding_center` says (None: no centre)."""
    if center is None:
        return None
    mu = center.mu if center.mu is not None and center.turns is None and not fmt.inputs_rotated else None
    return coding_center(x, fmt, None, center) if mu is None else mu


#: What the operators read of a format's side, a vector size and a device, in one lookup (a decode step's calls are
#: its host cost): derived from the rotations, codebooks and byte tables, so forgotten with them.
_CODERS: Constants[tuple] = Constants(derived=True)
_DECODERS: Constants[tuple] = Constants(derived=True)


def _coder(fmt: RotatedFormat, D: int, bits: int, device) -> tuple:
    """The encode operators' rotation (None: inputs come rotated), decision boundaries and centroids."""
    centroids, boundaries = codebook(D, bits, device)
    return None if fmt.inputs_rotated else rotation(D, fmt.seed, device), boundaries, centroids


def _decoder(fmt: RotatedFormat, D: int, Dv: int, device) -> tuple:
    """The decode operator's byte tables and rotations of keys and values."""
    return (byte_table(D, fmt.key_bits, device), byte_table(Dv, fmt.value_bits, device), rotation(D, fmt.seed, device),
            rotation(Dv, fmt.seed, device))  # fmt: skip


def rotated_decode_cpu(
    q: torch.Tensor, packed, fmt: RotatedFormat, start: int, length: int, scale: float,
    residual_k: torch.Tensor | None, residual_v: torch.Tensor | None, mask: torch.Tensor | None, with_mass: bool,
    center=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(output [B, Hq, Dv] float32, mass [B, Hkv, length + R] or None) of q [B, Hq, D] over codes ``start .. start
    + length`` of `packed` and the ring `residual_k`/`residual_v` (rotated when `fmt.inputs_rotated`), as
    `quant_attention`'s twin computes it (`center`: the layer's key centre); the rotations of q and of the output
    happen inside."""
    k_codes, k_norms, v_codes, v_norms = packed.k, packed.k_scale, packed.v, packed.v_scale
    D, device = q.shape[-1], q.device
    Dv = v_codes.shape[-1] * 8 // fmt.value_bits  # (`fmt.channels`)
    key = (D, Dv, fmt.key_bits, fmt.value_bits, fmt.seed, device)
    tables = _DECODERS.get(key, lambda: _decoder(fmt, D, Dv, device))
    set_center = center is not None and center.mu is not None
    turning = set_center and center.turns is not None
    if residual_k is not None:
        residual_k, residual_v = rows(float32(residual_k)), rows(float32(residual_v))
    turn = center.block_basis(start, length, device) if turning else (None, None)
    out, mass = torch.ops.hf_kvplus_cpu.rotated_decode(
        float32(q).contiguous(), k_codes, k_norms, v_codes, v_norms, *tables,
        center.rotated if set_center and not turning else None, center.weights if turning else None, *turn,
        residual_k, residual_v, fmt.inputs_rotated, mask, float(scale), with_mass, start, length,
    )  # fmt: skip  (codes start .. start + length - 1 read in place: no `narrow` of four tensors every step)
    return out, (mass if with_mass else None)


def rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with unit stride along its last dim (what the operators read), a copy only where it is not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def float32(t: torch.Tensor) -> torch.Tensor:
    """`t` as float32 (what the operators read): itself when it is one, where `.float()` is a call into torch even
    then (several per layer and decode step)."""
    return t if t.dtype == torch.float32 else t.float()


def _load() -> bool:
    if os.environ.get("HF_KVPLUS_CPU_KERNELS", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import _get_build_directory, load_inline

        _ninja_on_path()
        sources = [path.read_text() for path in _SOURCES]
        digest = hashlib.sha256("\n".join([*sources, *_FLAGS, _cpu_flags(), torch.__version__]).encode()).hexdigest()
        name = f"hf_kvplus_cpu_{digest[:16]}"
        if not os.path.exists(os.path.join(_get_build_directory(name, verbose=False), f"{name}.so")):
            print("hf_kvplus: building the C++ CPU operators, once for this torch (about 20 s)", file=sys.stderr)
        load_inline(name, cpp_sources=sources, extra_cflags=_FLAGS, extra_ldflags=_OPENMP, is_python_module=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: the twin runs
        warnings.warn(
            f"hf_kvplus: the CPU kernels could not be built ({type(exc).__name__}: {exc}); the decode attention of "
            "quantized and paged caches and the rotated formats' coding on the CPU run the plain-torch twins",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    torch.library.register_fake("hf_kvplus_cpu::rotated_decode")(_fake)
    torch.library.register_fake("hf_kvplus_cpu::rotated_encode")(_fake_encode)
    torch.library.register_fake("hf_kvplus_cpu::rotated_encode_into")(_fake_encode_into)
    torch.library.register_fake("hf_kvplus_cpu::rotated_encode_kv_into")(_fake_encode_kv_into)
    for register in _ON_LOAD:
        register()
    return True


def _ninja_on_path() -> None:
    """Puts the `ninja` package's binary on PATH when no ninja is there (an environment used without activating
    it): torch's build runs ``ninja`` by name."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _fake(
    q, k_codes, k_norms, v_codes, v_norms, k_table, v_table, k_rotation, v_rotation, k_center, k_turn_weights,
    k_turn_basis, k_turn_steps, ring_k, ring_v, ring_rotated, mask, scale, with_mass, start=0, length=-1,
):  # fmt: skip
    B, Hq, _ = q.shape
    N = k_codes.shape[2] - start if length < 0 else length
    Hkv, L = k_codes.shape[1], N + (0 if ring_k is None else ring_k.shape[2])
    Dv = v_rotation.shape[0]
    return q.new_empty(B, Hq, Dv), q.new_empty(B if with_mass else 0, Hkv, L)


def _fake_encode(x, rotation, boundaries, centroids, center, bits, renormalize):
    B, H, T, D = x.shape
    return x.new_empty(B, H, T, D * bits // 8, dtype=torch.uint8), x.new_empty(B, H, T, 1, dtype=torch.float16)


def _fake_encode_into(x, rotation, boundaries, centroids, center, bits, renormalize, limit, codes, norms, start, slots,
                      bad):  # fmt: skip
    return None


def _fake_encode_kv_into(k, v, k_rotation, k_boundaries, k_centroids, center, k_bits, v_rotation, v_boundaries,
                         v_centroids, v_bits, renormalize, limit, k_codes, k_norms, v_codes, v_norms, start, slots,
                         bad):  # fmt: skip
    return None


def _cpu_flags() -> str:
    """The CPU's feature flags (a build made with -march=native runs only where they hold)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()
