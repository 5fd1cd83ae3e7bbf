"""Decode attention over a rotated format's codes (``kernels/rotated_format.py``), in the rotated space.

:func:`rotated_decode_attention_triton` is what the quantized dispatcher (``kernels/dispatch.py``) runs on CUDA for a
:class:`RotatedFormat`: it has already rotated q and the residual (``x @ R``, float32), and rotates the output
back. Since ``q . k = (q @ R) . (k @ R)``, the softmax needs no rotation of the keys: the codes are read as they
are. Split-KV flash-decoding as ``quant_attention``'s KIVI path: kernel 1 (``_rotated_split_kernel``) walks one
slice of the coded tokens per (batch row, KV head, split) for the whole query group, unpacking each token's bit
stream in registers (each run of 8 codes is ``BITS`` bytes, read as one word: 3-bit codes straddle bytes) and
decoding ``centroid[code] * norm`` (a gathered load from the codebook, 2**bits floats; keys with a centre:
``centroid[code] * |norm| + (norm >= 0) * mu_rot[head]``, the centre's row loaded once); the residual runs
``decode_attention``'s split kernel on its own splits; ``decode_attention``'s merge kernel combines them (and,
for the mass, stores the log-sum-exp). Tiles come from ``quant_attention``'s planner (float32 q: FMA dots), so
this kernel spills about where the KIVI kernel's float32 path does at sm_90: 32-row query tiles and head dim 256
(compile gate, kernels/aot.py).

Arguments as ``quantized_decode_attention_triton`` (its module docstring) with q = q @ R float32 [B, Hq, D] and
residual_k/residual_v float32 [B, Hkv, R, D/Dv] already rotated; ``packed`` holds key codes [L, Hkv, T, D *
key_bits / 8], key norms [L, Hkv, T, 1] float16, value codes and norms alike, zeros None (L = B dense, or the
pool's blocks with ``block_table``). ``keys_per_token`` is accepted and ignored: a rotated format's keys are per
token anyway. ``key_center`` (the layer's state, set): the keys' centre, its ``rotated`` [Hkv, D] float32 read by the kernel; a
turning centre (``kernels/turning_center.py``): the query's weights ``W R q`` [B, Hq, D] and the basis of the
tokens' indices [D, START + N], whose dot product is the centre's share of a key's score (where its norm is not
negative); ``turn`` (the custom operator's): those two tensors given, for a format without a centre.
Returns (out float32 [B, Hq, Dv] in the rotated space, mass float32 [B, Hkv, length + R] with ``with_mass``,
else None).
"""

from __future__ import annotations

import torch

from hf_kvplus.kernels.decode_attention import _is_interpreted
from hf_kvplus.kernels.errors import ConfigError, KernelUnavailableError
from hf_kvplus.kernels.quant_attention import LOG2E, _check_inputs, _dims, optional_args, split_decode
from hf_kvplus.kernels.rotated_format import RotatedFormat, codebook, turning_key_center

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

__all__ = ["rotated_decode_attention_triton"]


def rotated_decode_attention_triton(
    q,
    packed,
    fmt,
    *,
    start,
    length,
    scale,
    residual_k=None,
    residual_v=None,
    mask=None,
    block_table=None,
    num_splits=None,
    keys_per_token: bool = False,
    check: bool = True,
    with_mass: bool = False,
    turn=None,
    key_center=None,
):
    """Split-KV decode attention in the rotated space (see the module doc): (out, mass or None)."""
    if check:
        if triton is None:
            raise KernelUnavailableError("rotated_decode_attention_triton needs triton, which is not installed")
        if not isinstance(fmt, RotatedFormat):
            raise ConfigError(f"fmt must be a RotatedFormat, got {type(fmt).__name__}")
        info = _check_inputs(
            q, packed, fmt, start, length, scale, residual_k, residual_v, mask, block_table, num_splits
        )
        if not q.is_cuda and not _is_interpreted(_rotated_split_kernel):
            raise KernelUnavailableError(
                f"rotated_decode_attention_triton needs CUDA tensors (got {q.device}) or TRITON_INTERPRET=1 "
                "set before import"
            )
    else:
        info = _dims(q, packed, fmt, residual_k, block_table)

    def launch(q, partials, plan, scores):
        _launch_rotated_split(q, packed, fmt, info, mask, partials, plan, scale, start, length, block_table, scores,
                              turn, key_center)  # fmt: skip

    return split_decode(
        q, info, launch, length, scale, residual_k, residual_v, mask, num_splits, with_mass, torch.float32
    )  # fmt: skip


def _launch_rotated_split(
    q, packed, fmt, info, mask, partials, plan, scale, start, length, block_table, scores, turn=None, center=None
):  # fmt: skip
    """Kernel 1 over the coded tokens: splits 0 .. plan.num_splits - 1 of ``partials``; ``scores``: None, or
    float32 [B, Hq, length] (any strides) that receives the log2-domain logits (-inf where masked)."""
    B, Hq, D = q.shape
    mid_o, mid_m, mid_l = partials
    (mask_arg, smb, smn), (bt_arg, sbb, sbc), (scores_arg, ssb, ssh, ssn) = optional_args(
        q, mask, block_table if info.paged else None, scores, mid_m
    )  # fmt: skip
    k_book = codebook(D, fmt.key_bits, q.device)[0]
    v_book = codebook(info.Dv, fmt.value_bits, q.device)[0]
    turning = turning_key_center(center)
    if turn is None and turning is not None and turning.mu is not None:
        # the query's weights (q is rotated) and the basis of indices 0 .. START + N - 1, [D, START + N]
        turn = turning.query_weights(q, rotated=True), turning.basis(start + length, q.device)
    k_mu = None if center is None or turning is not None else center.rotated
    q_turn, turn_basis = (q, q) if turn is None else turn  # (never read without KEY_TURN)
    # fmt: off
    _rotated_split_kernel[(B, info.Hkv * plan.g_chunks, plan.num_splits)](
        q, packed.k, packed.k_scale, packed.v, packed.v_scale, k_book, v_book,
        k_book if k_mu is None else k_mu,  # never read without a centre (KEY_CENTER=False)
        q_turn, turn_basis,  # read only with a turning centre (KEY_TURN)
        mask_arg, mid_o, mid_m, mid_l, bt_arg, scores_arg,
        length, info.G, D, info.Dv, Hq, mid_m.shape[-1], plan.tiles_per_split, start, info.num_blocks,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1), q_turn.stride(0), q_turn.stride(1), turn_basis.stride(0), turn_basis.stride(1),
        *packed.k.stride(), *packed.k_scale.stride()[:3],
        *packed.v.stride(), *packed.v_scale.stride()[:3],
        smb, smn,
        sbb, sbc,
        ssb, ssh, ssn,
        HAS_MASK=mask is not None,
        PAGED=info.paged, BLOCK_SIZE=info.T if info.paged else 1,
        STORE_SCORES=scores is not None, KEY_CENTER=k_mu is not None, KEY_TURN=turn is not None,
        KBITS=fmt.key_bits, VBITS=fmt.value_bits,
        G_CHUNKS=plan.g_chunks, BLOCK_G=plan.block_g, D_PAD=plan.d_pad, DV_PAD=plan.dv_pad,
        BLOCK_N=plan.block_n,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        enable_fp_fusion=True,
    )
    # fmt: on


if triton is not None:

    @triton.jit
    def _decode_rows(
        C, rows, N_OK, BOOK, norm, MU, WIDTH, stride_p, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
        WIDTH_PAD: tl.constexpr, CENTERED: tl.constexpr,
    ):  # fmt: skip
        # Tokens at byte offsets `rows` [BLOCK_N] of C (bit streams of WIDTH codes, byte stride stride_p) ->
        # float32 centroid[code] * norm [BLOCK_N, WIDTH_PAD] (coordinates in order; masked entries 0); CENTERED:
        # centroid[code] * |norm| plus the centre MU [WIDTH] where the norm is not negative. Below 8
        # bits, each run of 8 codes is read as BITS bytes, put together as one int32 word (at most 32 bits) and
        # cut into its 8 codes: a load per byte, not per code (a load per code needed ~2x the spills at sm_90).
        offs_c = tl.arange(0, WIDTH_PAD)
        ok = N_OK[:, None] & (offs_c < WIDTH)[None, :]
        if BITS == 8:
            code = tl.load(C + rows[:, None] + offs_c[None, :] * stride_p, mask=ok, other=0).to(tl.int32)
        else:
            offs_r = tl.arange(0, WIDTH_PAD // 8)
            offs_j = tl.arange(0, BITS + (BITS == 3))  # BITS bytes, padded to a power of two
            byte_ok = N_OK[:, None, None] & (offs_r < WIDTH // 8)[None, :, None] & (offs_j < BITS)[None, None, :]
            byte_of = (offs_r[:, None] * BITS + offs_j[None, :]) * stride_p  # [WIDTH_PAD // 8, bytes]
            byte = tl.load(C + rows[:, None, None] + byte_of[None, :, :], mask=byte_ok, other=0).to(tl.int32)
            word = tl.sum(byte << (offs_j * 8)[None, None, :], axis=2)  # disjoint bits: the sum is an or
            parts = (word[:, :, None] >> (tl.arange(0, 8) * BITS)[None, None, :]) & ((1 << BITS) - 1)
            code = tl.reshape(parts, [BLOCK_N, WIDTH_PAD])  # [N, runs, 8] row-major: coordinate r * 8 + i
        if CENTERED:
            mu = tl.load(MU + offs_c, mask=offs_c < WIDTH, other=0.0)
            x = tl.load(BOOK + code) * tl.abs(norm)[:, None] + tl.where(norm >= 0, 1.0, 0.0)[:, None] * mu[None, :]
            return tl.where(ok, x, 0.0)
        return tl.where(ok, tl.load(BOOK + code) * norm[:, None], 0.0)

    @triton.jit
    def _rotated_split_kernel(
        Q, KC, KN, VC, VN, KBook, VBook, KMu, QT, TurnBasis, Mask, MidO, MidM, MidL, BT, Scores,
        N, G, D, DV, HQ, NUM_SPLITS, TILES_PER_SPLIT, START, NUM_BLOCKS,
        qk_scale,
        stride_qb, stride_qh, stride_qtb, stride_qth, stride_ebd, stride_ebn,
        stride_kcb, stride_kch, stride_kcn, stride_kcp,
        stride_knb, stride_knh, stride_knn,
        stride_vcb, stride_vch, stride_vcn, stride_vcp,
        stride_vnb, stride_vnh, stride_vnn,
        stride_mb, stride_mn,
        stride_btb, stride_btc,
        stride_sb, stride_sh, stride_sn,
        HAS_MASK: tl.constexpr,
        PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        STORE_SCORES: tl.constexpr, KEY_CENTER: tl.constexpr, KEY_TURN: tl.constexpr,
        KBITS: tl.constexpr, VBITS: tl.constexpr,
        G_CHUNKS: tl.constexpr,
        BLOCK_G: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Key n (0 .. N-1) of row b is token t = START + n: dense, token t of the buffers of (b, head); paged,
        # block BT[b, t // BLOCK_SIZE] at offset t % BLOCK_SIZE (block ids outside 0..NUM_BLOCKS-1 count as
        # masked keys, never dereferenced). Its key is KBook[code] * KN[token] per coordinate, its value
        # VBook[code] * VN[token]; KEY_CENTER: keys relative to the centre KMu [Hkv, D] where KN >= 0 (see
        # _decode_rows). KEY_TURN: keys relative to a turning centre where KN >= 0, whose score term is the dot
        # product of the query's weights QT [B, HQ, D] with the basis column TurnBasis[:, t] [D] of the key's token t
        # (kernels/turning_center.py). STORE_SCORES: also write the log2-domain logits into Scores [B, HQ, N].
        pid_b = tl.program_id(0).to(tl.int64)
        pid_hg = tl.program_id(1)
        pid_s = tl.program_id(2)
        pid_h = (pid_hg // G_CHUNKS).to(tl.int64)  # KV head
        chunk = pid_hg % G_CHUNKS  # which BLOCK_G rows of its query group

        offs_g = chunk * BLOCK_G + tl.arange(0, BLOCK_G)
        g_ok = offs_g < G
        offs_c = tl.arange(0, D_PAD)
        offs_cv = tl.arange(0, DV_PAD)
        q_rows = pid_h * G + offs_g
        q_ptrs = Q + pid_b * stride_qb + q_rows[:, None] * stride_qh + offs_c[None, :]
        q = tl.load(q_ptrs, mask=g_ok[:, None] & (offs_c < D)[None, :], other=0.0).to(tl.float32)
        if KEY_TURN:
            qt_ptrs = QT + pid_b * stride_qtb + q_rows[:, None] * stride_qth + offs_c[None, :]
            qt = tl.load(qt_ptrs, mask=g_ok[:, None] & (offs_c < D)[None, :], other=0.0)

        if PAGED:
            kc_base = KC + pid_h * stride_kch
            kn_base = KN + pid_h * stride_knh
            vc_base = VC + pid_h * stride_vch
            vn_base = VN + pid_h * stride_vnh
            bt_row = BT + pid_b * stride_btb
        else:
            kc_base = KC + pid_b * stride_kcb + pid_h * stride_kch
            kn_base = KN + pid_b * stride_knb + pid_h * stride_knh
            vc_base = VC + pid_b * stride_vcb + pid_h * stride_vch
            vn_base = VN + pid_b * stride_vnb + pid_h * stride_vnh

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
            if HAS_MASK:
                keep = tl.load(Mask + pid_b * stride_mb + offs_n64 * stride_mn, mask=n_ok, other=0)
                n_ok = n_ok & (keep != 0)  # masked keys are not even loaded
            tok = START + offs_n64
            if PAGED:
                blk = tl.load(bt_row + (tok // BLOCK_SIZE) * stride_btc, mask=n_ok, other=0).to(tl.int64)
                n_ok = n_ok & (blk >= 0) & (blk < NUM_BLOCKS)
                off = tok % BLOCK_SIZE
                kc_rows, kn_rows = blk * stride_kcb + off * stride_kcn, blk * stride_knb + off * stride_knn
                vc_rows, vn_rows = blk * stride_vcb + off * stride_vcn, blk * stride_vnb + off * stride_vnn
            else:
                kc_rows, kn_rows = tok * stride_kcn, tok * stride_knn
                vc_rows, vn_rows = tok * stride_vcn, tok * stride_vnn

            k_norm = tl.load(kn_base + kn_rows, mask=n_ok, other=0.0).to(tl.float32)
            k = _decode_rows(kc_base, kc_rows, n_ok, KBook, tl.abs(k_norm) if KEY_TURN else k_norm, KMu + pid_h * D,
                             D, stride_kcp, KBITS, BLOCK_N, D_PAD, KEY_CENTER)  # fmt: skip
            v_norm = tl.load(vn_base + vn_rows, mask=n_ok, other=0.0).to(tl.float32)
            v = _decode_rows(vc_base, vc_rows, n_ok, VBook, v_norm, VBook, DV, stride_vcp, VBITS, BLOCK_N, DV_PAD,
                             False)  # fmt: skip

            # Scores in the log2 domain; masked keys are -inf, so exp2(-inf - finite max) = 0. q is float32:
            # "ieee" keeps float32 accuracy ("tf32" would round q, K and P to 11 bits).
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            if KEY_TURN:
                row_ok = n_ok[:, None] & (offs_c < D)[None, :]
                rows = tl.load(TurnBasis + tok[:, None] * stride_ebn + offs_c[None, :] * stride_ebd, mask=row_ok, other=0.0)
                turn = tl.dot(qt, tl.trans(rows), input_precision="ieee")
                s += tl.where((k_norm >= 0)[None, :], turn, 0.0)
            s = s * qk_scale
            s = tl.where(n_ok[None, :], s, float("-inf"))
            if STORE_SCORES:
                s_ptrs = (
                    Scores + pid_b * stride_sb + q_rows[:, None] * stride_sh + offs_n64[None, :] * stride_sn
                )  # fmt: skip
                tl.store(s_ptrs, s, mask=g_ok[:, None] & n_in[None, :])
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new

        # Partials of query head (pid_h * G + g), split slot pid_s (the coded splits come first).
        row = (pid_b * HQ + q_rows) * NUM_SPLITS + pid_s
        tl.store(MidM + row, m_i, mask=g_ok)
        tl.store(MidL + row, l_i, mask=g_ok)
        tl.store(MidO + row[:, None] * DV + offs_cv[None, :], acc, mask=g_ok[:, None] & (offs_cv < DV)[None, :])
