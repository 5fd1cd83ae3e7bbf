"""Decode attention: one query token per batch row against a dense K/V cache, GQA-aware.

Entry points sharing one contract (the dispatcher, ``decode_attention``, which runs the Triton kernel on CUDA
tensors and the twin elsewhere, is in ``kernels/dispatch.py``):

- :func:`decode_attention_torch` is the twin: scaled_dot_product_attention with each KV head's query
  group packed as the query length, so K/V are read as they are (no repeat, no copy).
- :func:`decode_attention_triton` is split-KV flash-decoding: kernel 1 walks one slice of keys per
  (batch row, KV head, split) for the whole query group at once (each K/V tile is read once for up to
  32 query heads per KV head), kernel 2 merges the splits. Kernel 1 has a compile-time storage
  switch (``PAGED``): the same code reads paged pools through a block table for
  ``kernels/paged_attention.py``, which also reuses the merge kernel.
- :func:`decode_attention_with_mass_torch` and :func:`decode_attention_with_mass_triton` (dispatcher
  ``decode_attention_with_mass``) also return each key's attention mass per KV head, for heavy-hitter
  (H2O) eviction: the Triton path turns on two
  more compile-time switches, ``STORE_SCORES`` (kernel 1 stores its logits) and ``STORE_LSE`` (the merge
  kernel stores each query head's log-sum-exp), so the probabilities are rebuilt from N floats per
  query head without a second pass over K.

Shapes: q [B, Hq, D], k [B, Hkv, N, D], v [B, Hkv, N, Dv], Hq % Hkv == 0 (query head h reads KV head
h // (Hq // Hkv)), mask None or bool [B, N] with True = attend. Output [B, Hq, Dv] in q.dtype. A row
whose keys are all masked outputs zeros. Attention mass [B, Hkv, N] float32: mass[b, j, n] is the sum,
over the query heads of KV head j's group, of their softmax probability of key n (so each row with an
unmasked key sums to G = Hq // Hkv); masked keys and fully masked rows get 0.

``check`` (keyword, every entry point; the dispatchers pass it on): True (the default) validates the whole
contract above and raises typed errors. False skips all of it (types, shapes, dtypes, devices, mask,
scale, ``num_splits``, whether Triton can run) and only reads sizes off the shapes: for callers whose
inputs are valid by construction, e.g. the caches' storages on the decode hot path. Invalid input is
then undefined behaviour. No path of these functions reads a tensor value on the host.
While ``torch.compile`` (or ``torch.export``) traces CUDA tensors, a dispatcher called with
``check=False`` runs one custom operator, ``torch.ops.kvplus.decode_attention`` /
``decode_attention_with_mass`` (``kernels/custom_ops.py``), which runs the same Triton kernel. Other
devices trace the twin inline: it is straight-line torch, which the compiler fuses with its neighbours.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hf_kvplus.kernels.errors import ConfigError, DeviceError, DTypeError, KernelUnavailableError, ShapeError

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch twin still works without triton
    triton = None
    tl = None

__all__ = [
    "decode_attention_torch",
    "decode_attention_triton",
    "decode_attention_with_mass_torch",
    "decode_attention_with_mass_triton",
    "pick_num_splits",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
# Auto split rule (see pick_num_splits).
DEFAULT_SM_COUNT = 132
WAVES = 4
MIN_TILES_PER_SPLIT = 4
MERGE_BLOCK_S = 16
# Query rows per program. Larger groups (G > 32 is rare: MQA with many heads) are cut into chunks of
# 32 rows, each reading the KV head again, to keep the float32 tiles in registers.
MAX_BLOCK_G = 32


def _check_inputs(q, k, v, scale, mask, num_splits) -> tuple[int, int, int, int, int, int, int]:
    """Validate the shared contract; return (B, Hq, Hkv, G, N, D, Dv)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t, want in (("q", q, 3), ("k", k, 4), ("v", v, 4)):
        if t.dim() != want:
            raise ShapeError(
                f"{name} must have {want} dims ({'[B, Hq, D]' if want == 3 else '[B, Hkv, N, D]'}), "
                f"got {t.dim()} dims with shape {tuple(t.shape)}"
            )
    if q.dtype not in SUPPORTED_DTYPES:
        raise DTypeError(f"q dtype {q.dtype} is not supported; expected one of {SUPPORTED_DTYPES}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise DTypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise DeviceError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")

    B, Hq, D = q.shape
    Bk, Hkv, N, Dk = k.shape
    Bv, Hkv_v, Nv, Dv = v.shape
    if B == 0 or Hq == 0 or Hkv == 0:
        raise ShapeError(f"batch and head counts must be positive, got B={B}, Hq={Hq}, Hkv={Hkv}")
    if Bk != B or Bv != B:
        raise ShapeError(f"batch size mismatch: q has B={B}, k has B={Bk}, v has B={Bv}")
    if Hkv_v != Hkv:
        raise ShapeError(f"KV head count mismatch: k has Hkv={Hkv}, v has Hkv={Hkv_v}")
    if Hq % Hkv != 0:
        raise ShapeError(
            f"query heads Hq={Hq} must be a multiple of KV heads Hkv={Hkv} (remainder {Hq % Hkv})"
        )
    if Nv != N:
        raise ShapeError(f"key/value length mismatch: k has N={N}, v has N={Nv}")
    if N == 0:
        raise ShapeError(f"no keys to attend to: N=0 (k shape {tuple(k.shape)})")
    if Dk != D:
        raise ShapeError(f"head_dim mismatch: q has D={D}, k has D={Dk}")
    for name, d in (("head_dim D", D), ("value head_dim Dv", Dv)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ShapeError(f"{name}={d} is not supported; expected {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")

    _check_mask_and_scale(mask, scale, (B, N), "[B, N]", q.device, "q/k/v")
    _check_num_splits(num_splits)
    return _dims(q, k, v)


def _dims(q, k, v) -> tuple[int, int, int, int, int, int, int]:
    """(B, Hq, Hkv, G, N, D, Dv) read off the shapes, no checks (``_check_inputs`` validates first)."""
    B, Hq, D = q.shape
    _, Hkv, N, _ = k.shape
    return B, Hq, Hkv, Hq // Hkv, N, D, v.shape[-1]


def _check_mask_and_scale(mask, scale, shape: tuple[int, int], layout: str, device, holders: str) -> None:
    """Shared by the dense and paged kernels: a bool `shape` mask on `device` (or None), a finite scale."""
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise DTypeError(f"mask must be a torch.bool tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise DTypeError(f"mask dtype must be torch.bool (True = attend), got {mask.dtype}")
        if tuple(mask.shape) != shape:
            raise ShapeError(f"mask shape must be {layout} = {list(shape)}, got {list(mask.shape)}")
        if mask.device != device:
            raise DeviceError(f"mask is on {mask.device}, {holders} on {device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ConfigError(f"scale must be a finite float, got {scale!r}")


def _check_num_splits(num_splits) -> None:
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1
    ):
        raise ConfigError(f"num_splits must be None or an int >= 1, got {num_splits!r}")


def decode_attention_torch(q, k, v, *, scale, mask=None, check: bool = True) -> torch.Tensor:
    """Plain-torch twin: SDPA with the query group of each KV head packed as the query length."""
    if check:
        _check_inputs(q, k, v, scale, mask, None)
    return grouped_sdpa(q, k, v, mask, scale).contiguous()


def grouped_sdpa(q, k, v, mask, scale) -> torch.Tensor:
    """SDPA of q [B, Hq, D] over k/v [B, Hkv, N, D|Dv] with each KV head's query group packed as the
    query length (K/V read once per group), in the dtype of q/k/v; fully masked rows give zeros.
    The twins' one-shot path: on a short context the op count is the cost."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    attn_mask = None if mask is None else mask.view(B, 1, 1, -1)
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv, D), k, v, attn_mask=attn_mask, scale=float(scale))
    if mask is not None:
        # Some SDPA backends/versions give NaN for rows with no key to attend to; the contract is zeros.
        out = out.masked_fill(~mask.any(dim=-1).view(B, 1, 1, 1), 0.0)
    return out.reshape(B, Hq, v.shape[-1])


def decode_attention_with_mass_torch(
    q, k, v, *, scale, mask=None, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch twin of ``decode_attention_with_mass`` (``kernels/dispatch.py``): explicit float32 softmax.

    SDPA does not hand back its probabilities, so the logits are formed here, with each KV head's
    query group packed as rows ([B, Hkv, G, N]: K is read once per group, never repeated).
    """
    B, Hq, Hkv, G, N, D, Dv = _check_inputs(q, k, v, scale, mask, None) if check else _dims(q, k, v)
    # (row, KV head) pairs as one batch of bmm; K/V of any strides whose first two dims merge (a slot
    # store's prefix) are viewed, not copied.
    qg = q.float().reshape(B * Hkv, G, D)
    s = torch.bmm(qg, k.float().reshape(B * Hkv, N, D).transpose(1, 2)).mul_(float(scale))  # [B*Hkv, G, N]
    if mask is not None:
        s = s.view(B, Hkv * G, N).masked_fill_(~mask.view(B, 1, N), float("-inf"))
    p = torch.softmax(s, dim=-1)
    if mask is not None:
        # Softmax over a row of -inf is NaN; the contract is zeros (output and mass).
        p = p.masked_fill(~mask.any(dim=-1).view(B, 1, 1), 0.0)
    out = torch.bmm(p.view(B * Hkv, G, N), v.float().reshape(B * Hkv, N, Dv))
    return out.view(B, Hq, Dv).to(q.dtype), p.view(B, Hkv, G, N).sum(dim=2)


def _block_n(d_pad: int, dv_pad: int, element_size: int) -> int:
    # Keys per tile: a K (or V) tile of at most 16 KiB keeps the shared-memory buffers and the float32
    # copies in registers within budget (64 keys for fp16/bf16 at head_dim 128).
    return max(16, min(64, 16384 // (max(d_pad, dv_pad) * element_size)))


def _num_warps(block_g: int, d_pad: int, dv_pad: int, block_n: int, element_size: int) -> int:
    # Chosen from register counts of sm_90 builds (ptxas): float32 tiles of q, acc, scores, K and V per
    # program; past ~200 floats per thread at 4 warps, 8 warps avoid spills. float32 inputs use FMA
    # dots (input_precision="ieee"), which need more registers: always 8 warps.
    if element_size == 4:
        return 8
    floats = block_g * (d_pad + dv_pad + block_n) + block_n * (d_pad + dv_pad)
    return 4 if floats <= 200 * 128 else 8


def _block_g(G: int) -> int:
    """Query rows per program: the group padded to a power of two, at least 16 (tl.dot), at most 32."""
    return min(MAX_BLOCK_G, max(16, triton.next_power_of_2(G)))


def _num_stages(d_pad: int, dv_pad: int) -> int:
    # Software-pipelined K/V tiles in shared memory: 3 stages (triton's default) fit every GPU up to
    # head dim 128; at 256 a 32-row query group with 3 stages needs ~101 KiB, over the 99 KiB per block
    # of sm_86/sm_89/sm_120 (compile gate, kernels/aot.py), so 2 stages there.
    return 2 if max(d_pad, dv_pad) >= 256 else 3


def pick_num_splits(batch: int, kv_heads: int, n_keys: int, block_n: int, sm_count: int | None = None) -> int:
    """Automatic split count for kernel 1 (grid B x Hkv x num_splits).

    Rule: enough splits that B * Hkv * num_splits reaches WAVES (4) programs per SM
    (``sm_count``, 132 when unknown), but each split covers at least MIN_TILES_PER_SPLIT (4) tiles
    of ``block_n`` keys, and never more splits than tiles; at least 1. (``kv_heads`` counts programs
    per batch row and split: Hkv, times the group chunks when G > 32.)
    """
    sms = sm_count or DEFAULT_SM_COUNT
    tiles = -(-n_keys // block_n)
    want = -(-WAVES * sms // (batch * kv_heads))
    return max(1, min(want, tiles // MIN_TILES_PER_SPLIT, tiles))


if triton is not None:

    @triton.jit
    def _decode_split_kernel(
        Q, K, V, Mask, MidO, MidM, MidL, BT, Scores,
        N, G, D, DV, HQ, NUM_SPLITS, TILES_PER_SPLIT, START, NUM_BLOCKS, SPLIT_OFFSET,
        qk_scale,
        stride_qb, stride_qh,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_mb, stride_mn,
        stride_btb, stride_btc,
        stride_sb, stride_sh, stride_sn,
        HAS_MASK: tl.constexpr,
        PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        STORE_SCORES: tl.constexpr,
        G_CHUNKS: tl.constexpr,
        BLOCK_G: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # Storage switch (compile time). Dense (PAGED=False): K [B, Hkv, N, D], key n of row b at
        # K + b*stride_kb + h*stride_kh + n*stride_kn. Paged: K is a pool [blocks, Hkv, BLOCK_SIZE, D];
        # key n of row b is logical token t = START + n, in block BT[b, t // BLOCK_SIZE] at offset
        # t % BLOCK_SIZE (stride_kb is then the pool's block stride). Table entries outside the keys'
        # columns are never read; block ids outside 0..NUM_BLOCKS-1 are treated as masked keys
        # (never dereferenced). Partials: NUM_SPLITS slots per query head in MidO/MidM/MidL, this
        # launch's split pid_s writes slot SPLIT_OFFSET + pid_s (other launches may fill the rest).
        # STORE_SCORES (compile time): also write the log2-domain logits of every key n < N into
        # Scores [B, HQ, N] float32 (-inf where masked), for the attention mass (see
        # decode_attention_with_mass_triton); Scores is never touched otherwise.
        pid_b = tl.program_id(0).to(tl.int64)
        pid_hg = tl.program_id(1)
        pid_s = tl.program_id(2)
        pid_h = (pid_hg // G_CHUNKS).to(tl.int64)  # KV head
        chunk = pid_hg % G_CHUNKS  # which BLOCK_G rows of its query group

        offs_g = chunk * BLOCK_G + tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        g_ok = offs_g < G
        d_ok = offs_d < D
        dv_ok = offs_dv < DV

        # The query group of this KV head (all of it unless G > BLOCK_G): rows pid_h * G + g of q.
        q_rows = pid_h * G + offs_g
        q_ptrs = Q + pid_b * stride_qb + q_rows[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

        if PAGED:
            k_base = K + pid_h * stride_kh
            v_base = V + pid_h * stride_vh
            bt_row = BT + pid_b * stride_btb
        else:
            k_base = K + pid_b * stride_kb + pid_h * stride_kh
            v_base = V + pid_b * stride_vb + pid_h * stride_vh

        # Finite initial max: a row that sees only masked keys keeps m = -1e30, p = 0, l = 0 (no NaN).
        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, DV_PAD], dtype=tl.float32)

        start = pid_s * TILES_PER_SPLIT * BLOCK_N
        end = tl.minimum(start + TILES_PER_SPLIT * BLOCK_N, N)
        for start_n in range(start, end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_in = offs_n < N
            n_ok = n_in
            offs_n64 = offs_n.to(tl.int64)
            if PAGED:
                tok = START + offs_n64
                blk = tl.load(bt_row + (tok // BLOCK_SIZE) * stride_btc, mask=n_ok, other=0).to(tl.int64)
                n_ok = n_ok & (blk >= 0) & (blk < NUM_BLOCKS)
                off = tok % BLOCK_SIZE
                k_rows = blk * stride_kb + off * stride_kn
                v_rows = blk * stride_vb + off * stride_vn
            else:
                k_rows = offs_n64 * stride_kn
                v_rows = offs_n64 * stride_vn
            k = tl.load(
                k_base + k_rows[:, None] + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0,
            ).to(tl.float32)
            v = tl.load(
                v_base + v_rows[:, None] + offs_dv[None, :],
                mask=n_ok[:, None] & dv_ok[None, :], other=0.0,
            ).to(tl.float32)
            if HAS_MASK:
                keep = tl.load(Mask + pid_b * stride_mb + offs_n64 * stride_mn, mask=n_ok, other=0)
                n_ok = n_ok & (keep != 0)

            # Scores in the log2 domain; masked keys are -inf, so exp2(-inf - finite max) = 0.
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(n_ok[None, :], s, float("-inf"))
            if STORE_SCORES:
                s_ptrs = (
                    Scores + pid_b * stride_sb + q_rows[:, None] * stride_sh
                    + offs_n64[None, :] * stride_sn
                )
                tl.store(s_ptrs, s, mask=g_ok[:, None] & n_in[None, :])
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            m_i = m_new

        # Partials of query head (pid_h * G + g) for this split.
        row = (pid_b * HQ + q_rows) * NUM_SPLITS + SPLIT_OFFSET + pid_s
        tl.store(MidM + row, m_i, mask=g_ok)
        tl.store(MidL + row, l_i, mask=g_ok)
        tl.store(MidO + row[:, None] * DV + offs_dv[None, :], acc, mask=g_ok[:, None] & dv_ok[None, :])

    @triton.jit
    def _decode_merge_kernel(
        MidO, MidM, MidL, Out, Lse,
        DV, HQ, NUM_SPLITS,
        stride_ob, stride_oh,
        stride_lb, stride_lh,
        DV_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
        STORE_LSE: tl.constexpr,
    ):
        # STORE_LSE (compile time): also write the log2-domain log-sum-exp of the row's logits into
        # Lse [B, HQ], so that exp2(logit - lse) is the softmax probability; Lse is never touched otherwise.
        pid_b = tl.program_id(0).to(tl.int64)
        pid_h = tl.program_id(1).to(tl.int64)
        offs_dv = tl.arange(0, DV_PAD)
        dv_ok = offs_dv < DV
        base = (pid_b * HQ + pid_h) * NUM_SPLITS

        # Pass 1: the largest running max over all splits.
        m_max = tl.full([BLOCK_S], -1.0e30, dtype=tl.float32)
        for s0 in range(0, NUM_SPLITS, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            m = tl.load(MidM + base + offs_s, mask=offs_s < NUM_SPLITS, other=-1.0e30)
            m_max = tl.maximum(m_max, m)
        m_all = tl.max(m_max, axis=0)

        # Pass 2: rescale every split to that max and sum.
        l_tot = tl.zeros([BLOCK_S], dtype=tl.float32)
        acc = tl.zeros([DV_PAD], dtype=tl.float32)
        for s0 in range(0, NUM_SPLITS, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            s_ok = offs_s < NUM_SPLITS
            m = tl.load(MidM + base + offs_s, mask=s_ok, other=-1.0e30)
            lsum = tl.load(MidL + base + offs_s, mask=s_ok, other=0.0)
            o = tl.load(
                MidO + (base + offs_s)[:, None] * DV + offs_dv[None, :],
                mask=s_ok[:, None] & dv_ok[None, :], other=0.0,
            )
            w = tl.where(s_ok, tl.exp2(m - m_all), 0.0)
            l_tot += w * lsum
            acc += tl.sum(w[:, None] * o, axis=0)
        denom = tl.sum(l_tot, axis=0)
        # Every key masked: acc and denom are both 0; output zeros instead of 0/0.
        out = acc / tl.where(denom > 0.0, denom, 1.0)
        out_ptrs = Out + pid_b * stride_ob + pid_h * stride_oh + offs_dv
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=dv_ok)
        if STORE_LSE:
            # Every key masked: +inf, so exp2(logit - lse) is 0 for the (-inf) logits, never NaN.
            lse = tl.where(denom > 0.0, m_all + tl.log2(tl.where(denom > 0.0, denom, 1.0)), float("inf"))
            tl.store(Lse + pid_b * stride_lb + pid_h * stride_lh, lse)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _is_interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


def decode_attention_triton(q, k, v, *, scale, mask=None, num_splits=None, check: bool = True) -> torch.Tensor:
    """Split-KV flash-decoding in Triton (CUDA tensors, or any tensors under TRITON_INTERPRET=1).

    ``num_splits``: keys are cut into that many slices, each handled by its own program per
    (batch row, KV head); None picks it with :func:`pick_num_splits`. It is clamped so that no split
    is empty (at most one split per BLOCK_N tile).
    """
    (B, Hq, Hkv, G, N, D, Dv), q, k, v = _triton_inputs(
        q, k, v, scale, mask, num_splits, "decode_attention", check
    )
    return _split_kv_attention(q, k, v, mask, scale=scale, num_splits=num_splits, n_keys=N)


def _triton_inputs(q, k, v, scale, mask, num_splits, name, check=True):
    """Checks the shared contract and that Triton can run (``check``); returns the dims and unit-stride q, k, v."""
    if not check:
        dims = _dims(q, k, v)
    else:
        if triton is None:
            raise KernelUnavailableError(f"{name}_triton needs triton, which is not installed")
        dims = _check_inputs(q, k, v, scale, mask, num_splits)
        if not q.is_cuda and not _is_interpreted(_decode_split_kernel):
            raise KernelUnavailableError(
                f"{name}_triton needs CUDA tensors (got {q.device}) or TRITON_INTERPRET=1 set before import; "
                f"use {name}_torch"
            )
    # The kernel assumes unit stride along the head dim; other strides are passed through.
    return dims, *(t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))


class _SplitPlan(NamedTuple):
    """Tile sizes and split count of one launch of the split kernel (see :func:`_plan_splits`)."""

    block_g: int
    g_chunks: int
    d_pad: int
    dv_pad: int
    block_n: int
    num_warps: int
    num_stages: int
    tiles_per_split: int
    num_splits: int


def _plan_splits(q, Hkv, Dv, n_keys, num_splits, block_n=None) -> _SplitPlan:
    """Tiles and splits for ``n_keys`` keys (``block_n`` None: the dense kernel's tile rule)."""
    B, Hq, D = q.shape
    G = Hq // Hkv
    block_g = _block_g(G)
    g_chunks = triton.cdiv(G, block_g)
    d_pad = max(16, triton.next_power_of_2(D))
    dv_pad = max(16, triton.next_power_of_2(Dv))
    if block_n is None:
        block_n = _block_n(d_pad, dv_pad, q.element_size())
    num_warps = _num_warps(block_g, d_pad, dv_pad, block_n, q.element_size())
    tiles = triton.cdiv(n_keys, block_n)
    if num_splits is None:
        sms = _sm_count(q.device.index) if q.is_cuda else None
        num_splits = pick_num_splits(B, Hkv * g_chunks, n_keys, block_n, sms)
    tiles_per_split = triton.cdiv(tiles, min(num_splits, tiles))
    num_splits = triton.cdiv(tiles, tiles_per_split)
    num_stages = _num_stages(d_pad, dv_pad)
    return _SplitPlan(block_g, g_chunks, d_pad, dv_pad, block_n, num_warps, num_stages, tiles_per_split, num_splits)


def _alloc_partials(q, Dv, total_splits):
    """float32 partial results (acc [B, Hq, S, Dv], running max and sum [B, Hq, S]) for the merge kernel."""
    B, Hq, _ = q.shape
    dev = q.device
    mid_o = torch.empty((B, Hq, total_splits, Dv), dtype=torch.float32, device=dev)
    mid_m = torch.empty((B, Hq, total_splits), dtype=torch.float32, device=dev)
    mid_l = torch.empty((B, Hq, total_splits), dtype=torch.float32, device=dev)
    return mid_o, mid_m, mid_l


def _split_kv_attention(
    q, k, v, mask, *, scale, num_splits, n_keys, block_table=None, start=0, block_size=1
) -> torch.Tensor:
    """Launches the split kernel and the merge kernel on validated inputs (head dim unit-stride).

    Dense storage when ``block_table`` is None: k [B, Hkv, N, D], v [B, Hkv, N, Dv]. Paged storage
    otherwise: k/v are pools [blocks, Hkv, block_size, D/Dv] and key n of row b is logical token
    ``start + n`` of that row's ``block_table`` (int32 [B, columns]). ``n_keys`` = N keys, ``mask``
    None or bool [B, N].
    """
    Hkv, Dv = k.shape[1], v.shape[-1]
    plan = _plan_splits(q, Hkv, Dv, n_keys, num_splits)
    partials = _alloc_partials(q, Dv, plan.num_splits)
    _launch_split(
        q, k, v, mask, partials, plan, scale=scale, n_keys=n_keys, block_table=block_table, start=start,
        block_size=block_size,
    )
    return _merge_partials(partials, q.dtype, plan.dv_pad)


def _launch_split(
    q, k, v, mask, partials, plan, *, scale, n_keys, split_offset=0, block_table=None, start=0, block_size=1,
    scores=None,
) -> None:
    """Launch the split kernel: its ``plan.num_splits`` splits write slots ``split_offset ..`` of ``partials``.

    Storage and arguments as in :func:`_split_kv_attention`; ``partials`` from :func:`_alloc_partials`
    (other launches may fill its other slots before :func:`_merge_partials`). ``scores``: None, or
    float32 [B, Hq, n_keys] that receives the log2-domain logits (-inf where masked).
    """
    B, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    G, N = Hq // Hkv, n_keys
    paged = block_table is not None
    mid_o, mid_m, mid_l = partials
    total_splits = mid_m.shape[-1]

    if mask is None:
        mask_arg, smb, smn = q, 0, 0  # never read (HAS_MASK=False)
    else:
        mask_arg = mask.view(torch.uint8)  # same bytes; triton loads bytes more reliably than int1
        smb, smn = mask_arg.stride()

    if paged:
        bt_arg, sbb, sbc, num_blocks = block_table, block_table.stride(0), block_table.stride(1), k.shape[0]
    else:
        bt_arg, sbb, sbc, num_blocks = q, 0, 0, 0  # never read (PAGED=False)

    if scores is None:
        scores_arg, ssb, ssh, ssn = mid_m, 0, 0, 0  # never written (STORE_SCORES=False)
    else:
        if scores.dtype != torch.float32 or tuple(scores.shape) != (B, Hq, N):
            raise ShapeError(
                f"scores must be float32 [B, Hq, N] = {[B, Hq, N]}, got {scores.dtype} {list(scores.shape)}"
            )
        scores_arg, (ssb, ssh, ssn) = scores, scores.stride()

    log2e = 1.4426950408889634
    _decode_split_kernel[(B, Hkv * plan.g_chunks, plan.num_splits)](
        q, k, v, mask_arg, mid_o, mid_m, mid_l, bt_arg, scores_arg,
        N, G, D, Dv, Hq, total_splits, plan.tiles_per_split, start, num_blocks, split_offset,
        float(scale) * log2e,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        smb, smn,
        sbb, sbc,
        ssb, ssh, ssn,
        HAS_MASK=mask is not None,
        PAGED=paged, BLOCK_SIZE=block_size if paged else 1,
        STORE_SCORES=scores is not None,
        G_CHUNKS=plan.g_chunks, BLOCK_G=plan.block_g, D_PAD=plan.d_pad, DV_PAD=plan.dv_pad,
        BLOCK_N=plan.block_n,
        # fp16/bf16 values are exact in tf32, so QK^T loses nothing on tensor cores and P keeps 11
        # significant bits in P @ V; float32 inputs need "ieee" to stay float32-accurate.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        enable_fp_fusion=True,  # multiply-adds contracted to FMAs (triton's default before 3.10)
    )


def _merge_partials(partials, dtype, dv_pad, lse=None) -> torch.Tensor:
    """Merge kernel: combine every split slot of ``partials`` into the output [B, Hq, Dv] in ``dtype``.

    ``lse``: None, or float32 [B, Hq] that receives each row's log2-domain log-sum-exp (+inf for a row
    with every key masked).
    """
    mid_o, mid_m, mid_l = partials
    B, Hq, total_splits, Dv = mid_o.shape
    out = torch.empty((B, Hq, Dv), dtype=dtype, device=mid_o.device)
    if lse is None:
        lse_arg, slb, slh = mid_m, 0, 0  # never written (STORE_LSE=False)
    else:
        if lse.dtype != torch.float32 or tuple(lse.shape) != (B, Hq):
            raise ShapeError(f"lse must be float32 [B, Hq] = {[B, Hq]}, got {lse.dtype} {list(lse.shape)}")
        lse_arg, (slb, slh) = lse, lse.stride()
    _decode_merge_kernel[(B, Hq)](
        mid_o, mid_m, mid_l, out, lse_arg,
        Dv, Hq, total_splits,
        out.stride(0), out.stride(1),
        slb, slh,
        DV_PAD=dv_pad, BLOCK_S=MERGE_BLOCK_S,
        STORE_LSE=lse is not None,
        num_warps=4,
        enable_fp_fusion=True,
    )
    return out


def decode_attention_with_mass_triton(
    q, k, v, *, scale, mask=None, num_splits=None, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_attention_triton` plus per-key attention mass [B, Hkv, N] float32.

    Kernel 1 stores its logits and the merge kernel each row's log-sum-exp (both log2 domain), so the
    probabilities come back as exp2(logit - lse) at the cost of N floats per query head, without a
    second pass over K; the group sum is done in torch.
    """
    (B, Hq, Hkv, G, N, D, Dv), q, k, v = _triton_inputs(
        q, k, v, scale, mask, num_splits, "decode_attention_with_mass", check
    )

    plan = _plan_splits(q, Hkv, Dv, N, num_splits)
    partials = _alloc_partials(q, Dv, plan.num_splits)
    scores = torch.empty((B, Hq, N), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, Hq), dtype=torch.float32, device=q.device)
    _launch_split(q, k, v, mask, partials, plan, scale=scale, n_keys=N, scores=scores)
    out = _merge_partials(partials, q.dtype, plan.dv_pad, lse=lse)
    mass = torch.exp2(scores - lse[..., None]).view(B, Hkv, G, N).sum(dim=2)
    return out, mass
