// Decode attention over a rotated format's codes on the CPU, never writing the decoded codes out: key scores come
// from tables of each code byte's dot products with the query group (`scores_by_table`), values are decoded a block of tokens
// at a time into a small buffer and summed at once. The plain-torch twin decodes every code position to float32 in
// memory first, which costs about half of its attention (rotated_attention_cpu.py says where this runs).
//
// One call: q [B, Hq, D] float32 as the model gives it, key and value codes [B, Hkv, N, P] uint8 with their
// float16 norms [B, Hkv, N, 1], the chunk tables [2**width, per] float32 of each side
// (rotated_format.byte_table), the rotations R_k [D, D] and R_v [Dv, Dv], the keys' centre [Hkv, D] in the
// rotated space (or none), a float32 ring [B, Hkv, R, D] of exact keys and values after the codes (or none;
// `ring_rotated`: held as x @ R, as a static storage holds it, else as the model gave them), and a bool mask
// [B, N + R] (true: attended; or none). The codes are read in the rotated space: q is rotated once (q R_k), a
// ring not rotated is read with q itself ((q R) . (k R) = q . k), and the codes' weighted sum of values is
// rotated back once (R_v^T). Returns the output [B, Hq, Dv] float32 and, with `with_mass`, each key's attention
// mass [B, Hkv, N + R] summed over its query group (else an empty tensor).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using kvplus_cpu::accumulate;
using kvplus_cpu::dot;
using kvplus_cpu::exp_shifted;
using kvplus_cpu::half_to_float;

// One token's codes (nbytes bytes) to floats: each byte (wide: each 12-bit half of 3 bytes) is a table row of
// `Per` floats.
template <int Per, bool Wide>
inline void decode_token(const uint8_t* codes, int64_t nbytes, const float* table, float* out) {
  if constexpr (!Wide) {
    for (int64_t i = 0; i < nbytes; ++i) std::memcpy(out + i * Per, table + codes[i] * Per, Per * sizeof(float));
  } else {
    for (int64_t i = 0; i < nbytes; i += 3) {
      uint32_t w = uint32_t(codes[i]) | (uint32_t(codes[i + 1]) << 8) | (uint32_t(codes[i + 2]) << 16);
      float* o = out + (i / 3) * 2 * Per;
      std::memcpy(o, table + (w & 4095u) * Per, Per * sizeof(float));
      std::memcpy(o + Per, table + (w >> 12) * Per, Per * sizeof(float));
    }
  }
}

// Tokens decoded at a time before they are read: floats just stored in pieces and read back as a vector stall
// the load (store forwarding fails), unless other stores have come between.
constexpr int64_t kBlock = 16;
// Positions per block of a turning centre's term (kernels/rotated_format.py's TURN_BLOCK). Only the first block's
// basis columns are read: RoPE's angles add, so a later block's term is the first block's sums with each query's
// weights turned by the block's offset (`turned_weights`), and the [D, kTurnBlock] columns stay in cache (16 KB at
// head dim 64: L1).
constexpr int64_t kTurnBlock = 64;
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));  // GCC/Clang vectors: one register
constexpr int64_t kTurnTile = 2 * kLanes;  // columns of `turn_rows`' tile
static_assert(kTurnBlock % kTurnTile == 0, "a block's columns are whole tiles");

// out[r, j] = dot(u[r], local[:, j]) for r < Rows and j < kTurnBlock (out and local: kTurnBlock floats a row), two
// vectors of columns at a time: 6 x 2 sums, the two basis vectors and a weight fit AVX2's 16 registers. Measured on
// AVX2 at head dims 64 and 256: 4 rows ran at half the speed (GCC then read the basis from memory at every
// multiply-add), and 64-byte vectors went through memory (2.2x the whole call's time at 4K tokens).
constexpr int64_t kTurnRows = 6;
template <int Rows>
void turn_rows(const float* u, int64_t D, const float* local, float* out) {
  for (int64_t c = 0; c < kTurnBlock; c += kTurnTile) {
    Lanes acc[Rows][2] = {};
    for (int64_t d = 0; d < D; ++d) {
      Lanes e0, e1;
      std::memcpy(&e0, local + d * kTurnBlock + c, sizeof e0);
      std::memcpy(&e1, local + d * kTurnBlock + c + kLanes, sizeof e1);
      for (int r = 0; r < Rows; ++r) {
        const float w = u[r * D + d];
        acc[r][0] += w * e0;
        acc[r][1] += w * e1;
      }
    }
    for (int r = 0; r < Rows; ++r) {
      std::memcpy(out + r * kTurnBlock + c, &acc[r][0], sizeof(Lanes));
      std::memcpy(out + r * kTurnBlock + c + kLanes, &acc[r][1], sizeof(Lanes));
    }
  }
}

// A query's basis weights u [D] turned by an offset's angles (cs [2, pairs]: cos, then sin): dot(u', e(p)) equals
// dot(u, e(p + offset)) for e's cos rows [0, pairs), sin rows [pairs, 2 pairs) and constant rows past them.
inline void turned_weights(const float* u, const float* cs, int64_t pairs, int64_t D, float* out) {
  const float *c = cs, *s = cs + pairs, *a = u, *b = u + pairs;
  for (int64_t i = 0; i < pairs; ++i) out[i] = a[i] * c[i] + b[i] * s[i];
  for (int64_t i = 0; i < pairs; ++i) out[pairs + i] = b[i] * c[i] - a[i] * s[i];
  for (int64_t d = 2 * pairs; d < D; ++d) out[d] = u[d];
}

// The turning centre's term of every code: turn[g K + k, j] = dot(W q_g, e(kTurnBlock k + j)) for each query g of
// the group (qw [G, D]: W q_g) and block k < K (cs [K, 2, pairs]: its angles), rows [G K, kTurnBlock] (columns past
// the last code unused). The rows are taken kTurnRows at a time whatever G is, each with its weights turned to its
// block; `u` is scratch [kTurnRows, D].
void turning_term(const float* qw, int64_t G, int64_t D, const float* local, const float* cs, int64_t pairs,
                  int64_t K, float* u, float* turn) {
  for (int64_t r0 = 0; r0 < G * K; r0 += kTurnRows) {
    const int64_t rows = std::min(kTurnRows, G * K - r0);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t g = (r0 + i) / K, k = (r0 + i) % K;
      turned_weights(qw + g * D, cs + k * 2 * pairs, pairs, D, u + i * D);
    }
    float* out = turn + r0 * kTurnBlock;
    switch (rows) {
      case 1: turn_rows<1>(u, D, local, out); break;
      case 2: turn_rows<2>(u, D, local, out); break;
      case 3: turn_rows<3>(u, D, local, out); break;
      case 4: turn_rows<4>(u, D, local, out); break;
      case 5: turn_rows<5>(u, D, local, out); break;
      default: turn_rows<6>(u, D, local, out);
    }
  }
}

// `n` tokens' codes, `stride` bytes apart, to floats `[n, channels]`.
template <int Per, bool Wide>
void decode_block(const uint8_t* codes, int64_t stride, int64_t n, int64_t nbytes, const float* table, float* out,
                  int64_t channels) {
  for (int64_t t = 0; t < n; ++t) decode_token<Per, Wide>(codes + t * stride, nbytes, table, out + t * channels);
}

using DecodeFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const float*, float*, int64_t);

DecodeFn decoder(const at::Tensor& table, const char* side) {
  const int64_t rows = table.size(0), per = table.size(1);
  if (rows == 4096 && per == 4) return decode_block<4, true>;
  TORCH_CHECK(rows == 256, "rotated_decode_cpu: the ", side, " table must have 256 or 4096 rows, got ", rows);
  switch (per) {
    case 1: return decode_block<1, false>;
    case 2: return decode_block<2, false>;
    case 4: return decode_block<4, false>;
    case 8: return decode_block<8, false>;
  }
  TORCH_CHECK(false, "rotated_decode_cpu: a ", side, " table row of ", per, " floats fits no bit width");
  return nullptr;
}

// The max and the sum of n floats, in eight running lanes (any n).
inline float max_of(const float* x, int64_t n) {
  const float lowest = -std::numeric_limits<float>::infinity();
  float part[8] = {lowest, lowest, lowest, lowest, lowest, lowest, lowest, lowest};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) part[j] = std::max(part[j], x[i + j]);
  for (; i < n; ++i) part[0] = std::max(part[0], x[i]);
  return std::max(std::max(std::max(part[0], part[1]), std::max(part[2], part[3])),
                  std::max(std::max(part[4], part[5]), std::max(part[6], part[7])));
}

inline float sum_of(const float* x, int64_t n) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += x[i + j];
  for (; i < n; ++i) part[0] += x[i];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Channels of P bytes of codes read through a chunk table (4096 rows: 3 bytes hold two 12-bit chunks).
int64_t channels(int64_t P, const at::Tensor& table) {
  return table.size(0) == 4096 ? P / 3 * 2 * table.size(1) : P * table.size(1);
}

// Key scores go through per-query tables (`scores_by_table`) where a call holds the work to pay for building them:
// code positions times (the group's queries + 1) at least kTableWork for tables of byte pieces (1-, 2- and 4-bit keys),
// kWideTableWork for 3-bit keys' 64-entry ones; below, each key is decoded and dotted with the queries. Measured one
// call against the other (AMD EPYC, AVX2 and FMA, warm; head dims 32-256, 1-8 queries, 64-2,048 positions): byte
// tables break even at about 1,024 positions for one query, 512 for two to four and 256 for eight, 3-bit ones at
// about half those; the fixed 64 positions before made a 256-slot sink cache's call (2 queries, 32 channels) 17%
// slower than decoding, 13% in a model's decode step, where the 64 KB of tables a call writes also evicts more.
constexpr int64_t kTableWork = 2048, kWideTableWork = 1024;

// Queries of a group as the lanes of one vector in `scores_by_table`'s tables (more than 8: 8 at a time).
typedef float Group4 __attribute__((vector_size(4 * sizeof(float))));
typedef float Group8 __attribute__((vector_size(8 * sizeof(float))));

template <typename V>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// `scores_by_table` for up to W = lanes of V queries q [G, D]: the table T [pieces, E, W] holds each piece's and
// value's dot products of all of them, so that a token's scores are one vector read per piece, not G reads.
template <typename V>
void table_scores(const float* q, int64_t G, int64_t D, const float* ut, int64_t E, int64_t kc, bool wide,
                  const uint8_t* codes, int64_t stride, int64_t Pk, int64_t N, float* rows, int64_t L,
                  std::vector<float>& lut) {
  constexpr int W = sizeof(V) / sizeof(float);
  const int64_t pieces = D / kc;
  lut.resize((pieces * E + D) * W);
  float *T = lut.data(), *qt = T + pieces * E * W;  // qt [D, W]: q's channels, a query a lane (0 past G)
  for (int64_t d = 0; d < D; ++d)
    for (int j = 0; j < W; ++j) qt[d * W + j] = j < G ? q[j * D + d] : 0.f;
  for (int64_t p = 0; p < pieces; ++p)
    for (int64_t e = 0; e < E; ++e) {
      V sum = {};
      for (int64_t i = 0; i < kc; ++i) sum += load<V>(qt + (p * kc + i) * W) * ut[i * E + e];
      std::memcpy(T + (p * E + e) * W, &sum, sizeof sum);
    }
  for (int64_t t = 0; t < N; ++t) {
    const uint8_t* c = codes + t * stride;
    V a0 = {}, a1 = {}, a2 = {}, a3 = {};
    if (wide) {
      for (int64_t w = 0; w < Pk / 3; ++w) {
        const uint32_t word = uint32_t(c[3 * w]) | (uint32_t(c[3 * w + 1]) << 8) | (uint32_t(c[3 * w + 2]) << 16);
        const float* Tw = T + 4 * w * E * W;
        a0 += load<V>(Tw + (word & 63u) * W);
        a1 += load<V>(Tw + (E + ((word >> 6) & 63u)) * W);
        a2 += load<V>(Tw + (2 * E + ((word >> 12) & 63u)) * W);
        a3 += load<V>(Tw + (3 * E + (word >> 18)) * W);
      }
    } else {
      int64_t p = 0;
      for (; p + 4 <= pieces; p += 4) {
        a0 += load<V>(T + (p * E + c[p]) * W);
        a1 += load<V>(T + ((p + 1) * E + c[p + 1]) * W);
        a2 += load<V>(T + ((p + 2) * E + c[p + 2]) * W);
        a3 += load<V>(T + ((p + 3) * E + c[p + 3]) * W);
      }
      for (; p < pieces; ++p) a0 += load<V>(T + (p * E + c[p]) * W);
    }
    const V sum = (a0 + a1) + (a2 + a3);
    for (int64_t g = 0; g < G; ++g) rows[g * L + t] = sum[g];
  }
}

// Key scores before norms, q_g . (centroids of token t's codes), into rows[g * L + t] for t < N, by tables: for
// each piece of a token's codes (a byte of 1-, 2- or 4-bit codes; 6 bits, two codes, of 3-bit ones) and each value
// it can take, the dot products of those codes' centroids with the group's queries' channels there, made once per
// call (a few vector operations per entry); a token's scores are then one vector read per piece (the queries as
// lanes: SmolLM2's 3 at 4K tokens, 1.3 ms a call before, one read per piece and query), where decoding reads and
// writes every channel. With AVX-512 and byte pieces, a multiple of 16 of them, one gather reads 16 pieces' entries
// of one query instead (a call at 1K tokens and 32-channel heads went from 95 to 78 us against one read per piece
// and query; not measured against the lanes). `lut` and `ut` are scratch.
void scores_by_table(const float* q, int64_t G, int64_t D, const at::Tensor& table, const uint8_t* codes,
                     int64_t stride, int64_t Pk, int64_t N, float* rows, int64_t L, std::vector<float>& lut,
                     std::vector<float>& ut) {
  const bool wide = table.size(0) == 4096;
  const int64_t per = table.size(1), E = wide ? 64 : 256, kc = wide ? 2 : per, pieces = D / kc;
  const float* U = table.data_ptr<float>();  // row e: the centroids of the codes a chunk of value e holds, in order
  ut.resize(kc * E);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < kc; ++i) ut[i * E + e] = U[e * per + i];
#if defined(__AVX512F__)
  if (!wide && pieces % 16 == 0) {
    // Pieces of one byte, 16 at a time: a gather of their entries (the entry of piece p and value e is p * E + e).
    const __m512i offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(int32_t(E)));
    lut.assign(G * pieces * E, 0.f);  // [g, piece, value]
    for (int64_t g = 0; g < G; ++g)
      for (int64_t p = 0; p < pieces; ++p) {
        float* row = lut.data() + (g * pieces + p) * E;
        for (int64_t i = 0; i < kc; ++i) {
          const float qv = q[g * D + p * kc + i];
          const float* u = ut.data() + i * E;
          for (int64_t e = 0; e < E; ++e) row[e] += qv * u[e];
        }
      }
    for (int64_t t = 0; t < N; ++t) {
      const uint8_t* c = codes + t * stride;
      for (int64_t g = 0; g < G; ++g) {
        const float* T = lut.data() + g * pieces * E;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t p = 0; p < pieces; p += 16) {
          const __m512i index = _mm512_add_epi32(
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + p))), offsets);
          sum = _mm512_add_ps(sum, _mm512_i32gather_ps(index, T + p * E, 4));
        }
        rows[g * L + t] = _mm512_reduce_add_ps(sum);
      }
    }
    return;
  }
#endif
  if (G <= 4) {
    table_scores<Group4>(q, G, D, ut.data(), E, kc, wide, codes, stride, Pk, N, rows, L, lut);
    return;
  }
  for (int64_t g0 = 0; g0 < G; g0 += 8)
    table_scores<Group8>(q + g0 * D, std::min<int64_t>(8, G - g0), D, ut.data(), E, kc, wide, codes, stride, Pk, N,
                         rows + g0 * L, L, lut);
}

void check_codes(const at::Tensor& codes, const at::Tensor& norms, const char* side) {
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.stride(3) == 1,
              "rotated_decode_cpu: ", side, " codes must be uint8 [B, H, N, P] with unit stride in P");
  TORCH_CHECK(norms.dim() == 4 && norms.scalar_type() == at::kHalf && norms.size(2) == codes.size(2),
              "rotated_decode_cpu: ", side, " norms must be float16 [B, H, N, 1]");
}

std::tuple<at::Tensor, at::Tensor> rotated_decode_cpu(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_norms, const at::Tensor& v_codes,
    const at::Tensor& v_norms, const at::Tensor& k_table, const at::Tensor& v_table,
    const at::Tensor& k_rotation, const at::Tensor& v_rotation, const std::optional<at::Tensor>& k_center,
    const std::optional<at::Tensor>& k_turn_weights, const std::optional<at::Tensor>& k_turn_basis,
    const std::optional<at::Tensor>& k_turn_steps,
    const std::optional<at::Tensor>& ring_k, const std::optional<at::Tensor>& ring_v, bool ring_rotated,
    const std::optional<at::Tensor>& mask, double scale, bool with_mass, int64_t start, int64_t length) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "rotated_decode_cpu: q must be contiguous float32 [B, Hq, D]");
  check_codes(k_codes, k_norms, "key");
  check_codes(v_codes, v_norms, "value");
  TORCH_CHECK(k_table.scalar_type() == at::kFloat && k_table.is_contiguous() &&
                  v_table.scalar_type() == at::kFloat && v_table.is_contiguous(),
              "rotated_decode_cpu: the tables must be contiguous float32");
  // Codes start .. start + length - 1 are read (length -1: every code from start), in place: a growing segment's
  // buffer holds more than its tokens, which four `narrow` calls a step cut before.
  const int64_t held = k_codes.size(2), N = length < 0 ? held - start : length;
  TORCH_CHECK(start >= 0 && N >= 0 && start + N <= held, "rotated_decode_cpu: codes ", start, " .. ", start + N,
              " of ", held);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_codes.size(1);
  const int64_t Pk = k_codes.size(3), Pv = v_codes.size(3);
  const int64_t Dk = channels(Pk, k_table), Dv = channels(Pv, v_table);
  TORCH_CHECK(Dk == D && D % 8 == 0 && Dv % 8 == 0 && (k_table.size(0) != 4096 || Pk % 3 == 0) &&
                  (v_table.size(0) != 4096 || Pv % 3 == 0),
              "rotated_decode_cpu: the keys' codes hold ", Dk, " channels and q ", D, " (values: ", Dv,
              "); each must be a multiple of 8");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "rotated_decode_cpu: ", Hq, " query heads on ", Hkv, " KV heads");
  TORCH_CHECK(k_codes.size(0) == B && v_codes.size(0) == B && v_codes.size(1) == Hkv && v_codes.size(2) == held,
              "rotated_decode_cpu: key and value codes must share [B, Hkv, N]");
  const int64_t R = ring_k.has_value() ? ring_k->size(2) : 0;
  if (R) {
    TORCH_CHECK(ring_v.has_value() && ring_k->scalar_type() == at::kFloat && ring_v->scalar_type() == at::kFloat &&
                    ring_k->stride(3) == 1 && ring_v->stride(3) == 1 && ring_k->size(3) == D &&
                    ring_v->size(3) == Dv && ring_v->size(2) == R,
                "rotated_decode_cpu: the ring must be float32 [B, Hkv, R, D] keys and [B, Hkv, R, Dv] values");
  }
  const int64_t L = N + R, G = Hq / Hkv;
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 2 && mask->scalar_type() == at::kBool && mask->size(0) == B && mask->size(1) == L,
                "rotated_decode_cpu: the mask must be bool [B, ", L, "]");
  }
  // A turning centre (k_turn_weights, k_turn_basis, k_turn_steps): the centre term of the key at code t is
  // dot(W q, e(t)), W [Hkv, D, D] of each KV head (c(p) = e(p) W); e of the first kTurnBlock codes as columns [D,
  // kTurnBlock], its rows cos [0, h), sin [h, 2 h) of RoPE's h angles, then constant; and the cos and sin of the
  // angles at kTurnBlock k [K, 2, h], which turn the first block's basis to block k's (kernels/turning_center.py).
  const bool turning = k_turn_weights.has_value();
  const bool centred = k_center.has_value() || turning;
  TORCH_CHECK(!(k_center.has_value() && turning), "rotated_decode_cpu: a fixed and a turning centre both given");
  if (k_center.has_value()) {
    TORCH_CHECK(k_center->scalar_type() == at::kFloat && k_center->is_contiguous() && k_center->size(0) == Hkv &&
                    k_center->size(1) == D,
                "rotated_decode_cpu: the keys' centre must be contiguous float32 [Hkv, D]");
  }
  if (turning) {
    TORCH_CHECK(k_turn_basis.has_value() && k_turn_steps.has_value() && k_turn_weights->scalar_type() == at::kFloat &&
                    k_turn_weights->is_contiguous() && k_turn_weights->dim() == 3 && k_turn_weights->size(0) == Hkv &&
                    k_turn_weights->size(1) == D && k_turn_weights->size(2) == D &&
                    k_turn_basis->scalar_type() == at::kFloat && k_turn_basis->is_contiguous() &&
                    k_turn_basis->dim() == 2 && k_turn_basis->size(0) == D && k_turn_basis->size(1) == kTurnBlock &&
                    k_turn_steps->scalar_type() == at::kFloat && k_turn_steps->is_contiguous() &&
                    k_turn_steps->dim() == 3 && k_turn_steps->size(0) * kTurnBlock >= N &&
                    k_turn_steps->size(1) == 2 && 2 * k_turn_steps->size(2) <= D,
                "rotated_decode_cpu: a turning centre takes contiguous float32 weights [", Hkv, ", ", D, ", ", D,
                "], a basis [", D, ", ", kTurnBlock, "] and the angles of at least ", (N + kTurnBlock - 1) / kTurnBlock,
                " blocks [K, 2, h <= ", D / 2, "]");
  }
  TORCH_CHECK(k_rotation.scalar_type() == at::kFloat && k_rotation.is_contiguous() && k_rotation.dim() == 2 &&
                  k_rotation.size(0) == D && k_rotation.size(1) == D && v_rotation.scalar_type() == at::kFloat &&
                  v_rotation.is_contiguous() && v_rotation.dim() == 2 && v_rotation.size(0) == Dv &&
                  v_rotation.size(1) == Dv,
              "rotated_decode_cpu: the rotations must be contiguous float32 [", D, ", ", D, "] and [", Dv, ", ", Dv,
              "]");
  const DecodeFn decode_k = decoder(k_table, "key"), decode_v = decoder(v_table, "value");
  const bool by_table = N * (G + 1) >= (k_table.size(0) == 4096 ? kWideTableWork : kTableWork) &&
                        !(k_table.size(0) == 256 && k_table.size(1) == 1);  // not 8-bit keys

  at::Tensor out = at::empty({B, Hq, Dv}, q.options());
  at::Tensor mass = at::empty({with_mass ? B : 0, Hkv, L}, q.options());
  const float* qp = q.data_ptr<float>();
  const uint8_t* kc = k_codes.data_ptr<uint8_t>() + start * k_codes.stride(2);
  const uint8_t* vc = v_codes.data_ptr<uint8_t>() + start * v_codes.stride(2);
  const at::Half* kn = k_norms.data_ptr<at::Half>() + start * k_norms.stride(2);
  const at::Half* vn = v_norms.data_ptr<at::Half>() + start * v_norms.stride(2);
  const float *kt = k_table.data_ptr<float>(), *vt = v_table.data_ptr<float>();
  const float *rot_k = k_rotation.data_ptr<float>(), *rot_v = v_rotation.data_ptr<float>();
  const float* mu = k_center.has_value() ? k_center->data_ptr<float>() : nullptr;
  const float* turn_w = turning ? k_turn_weights->data_ptr<float>() : nullptr;
  const int64_t turn_blocks = turning ? (N + kTurnBlock - 1) / kTurnBlock : 0, P2 = turning ? k_turn_steps->size(2) : 0;
  const int64_t turn_row = turn_blocks * kTurnBlock;  // floats per query in `turn`
  const float* turn_local = turning ? k_turn_basis->data_ptr<float>() : nullptr;
  const float* turn_cs = turning ? k_turn_steps->data_ptr<float>() : nullptr;
  const float* rk = R ? ring_k->data_ptr<float>() : nullptr;
  const float* rv = R ? ring_v->data_ptr<float>() : nullptr;
  const bool* mk = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  const int64_t mk_s0 = mask.has_value() ? mask->stride(0) : 0, mk_s1 = mask.has_value() ? mask->stride(1) : 0;
  float* op = out.data_ptr<float>();
  float* mp = with_mass ? mass.data_ptr<float>() : nullptr;
  const float s = float(scale), neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * L), kf(kBlock * D), vf(kBlock * Dv), acc(G * Dv), plain(G * Dv), qr(G * D);
    std::vector<float> qmu(G, 0.f), lut, ut, turn(G * turn_row), uq(turning ? kTurnRows * D : 0),
        qw(turning ? G * D : 0);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      const float* q_in = qp + (b * Hq + h * G) * D;
      std::fill(qr.begin(), qr.end(), 0.f);  // qr = q R_k, row by row of R_k
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) accumulate(q_in + g * D + d, rot_k + d * D, 1, qr.data() + g * D, D);
      const float* qg = qr.data();
      const float* q_ring = ring_rotated ? qg : q_in;
      if (mu != nullptr)
        for (int64_t g = 0; g < G; ++g) qmu[g] = dot(qg + g * D, mu + h * D, D);
      if (turning) {  // turn[g, t] = dot(W q_g, e(t)), W q_g with q as the model gives it
        for (int64_t g = 0; g < G; ++g)
          for (int64_t e = 0; e < D; ++e) qw[g * D + e] = dot(turn_w + (h * D + e) * D, q_in + g * D, D);
        turning_term(qw.data(), G, D, turn_local, turn_cs, P2, turn_blocks, uq.data(), turn.data());
      }
      auto attended = [&](int64_t t) { return mk == nullptr || mk[b * mk_s0 + t * mk_s1]; };
      // Scores: the codes, a block at a time, then the ring.
      const uint8_t* kc_bh = kc + b * k_codes.stride(0) + h * k_codes.stride(1);
      const at::Half* kn_bh = kn + b * k_norms.stride(0) + h * k_norms.stride(1);
      if (by_table) {
        scores_by_table(qg, G, D, k_table, kc_bh, k_codes.stride(2), Pk, N, scores.data(), L, lut, ut);
      } else {
        for (int64_t t0 = 0; t0 < N; t0 += kBlock) {
          const int64_t n = std::min(kBlock, N - t0);
          decode_k(kc_bh + t0 * k_codes.stride(2), k_codes.stride(2), n, Pk, kt, kf.data(), D);
          for (int64_t i = 0; i < n; ++i)
            for (int64_t g = 0; g < G; ++g) scores[g * L + t0 + i] = dot(qg + g * D, kf.data() + i * D, D);
        }
      }
      const int64_t kn_s = k_norms.stride(2);  // (an out-of-line call: not made per code)
      for (int64_t t = 0; t < N; ++t) {  // the norms, the centre, the scale and the mask
        if (!attended(t)) {
          for (int64_t g = 0; g < G; ++g) scores[g * L + t] = neg_inf;
          continue;
        }
        const float norm = half_to_float(kn_bh[t * kn_s]);
        const float coef = centred ? std::fabs(norm) : norm;
        const bool add_mu = centred && norm >= 0.f;
        if (turning && add_mu) {
          for (int64_t g = 0; g < G; ++g) scores[g * L + t] = s * (coef * scores[g * L + t] + turn[g * turn_row + t]);
        } else {
          for (int64_t g = 0; g < G; ++g)
            scores[g * L + t] = s * (coef * scores[g * L + t] + (add_mu ? qmu[g] : 0.f));
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const bool live = attended(N + r);
        const float* key = rk + b * ring_k->stride(0) + h * ring_k->stride(1) + r * ring_k->stride(2);
        for (int64_t g = 0; g < G; ++g) scores[g * L + N + r] = live ? s * dot(q_ring + g * D, key, D) : neg_inf;
      }
      // Softmax per query, in place; a query with every key masked gets zeros.
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        const float m = max_of(sg, L);
        if (m == neg_inf) {
          std::fill(sg, sg + L, 0.f);
          continue;
        }
        exp_shifted(sg, L, m);
        const float inv = 1.f / sum_of(sg, L);
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      if (mp != nullptr) {
        float* mrow = mp + (b * Hkv + h) * L;
        for (int64_t t = 0; t < L; ++t) {
          float sum = 0.f;
          for (int64_t g = 0; g < G; ++g) sum += scores[g * L + t];
          mrow[t] = sum;
        }
      }
      // The weighted sum of the values: the codes (skipping keys no query attends), then the ring.
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(plain.begin(), plain.end(), 0.f);
      const uint8_t* vc_bh = vc + b * v_codes.stride(0) + h * v_codes.stride(1);
      const at::Half* vn_bh = vn + b * v_norms.stride(0) + h * v_norms.stride(1);
      const int64_t vn_s = v_norms.stride(2);
      for (int64_t t0 = 0; t0 < N; t0 += kBlock) {
        const int64_t n = std::min(kBlock, N - t0);
        bool any = false;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < n; ++i) any |= scores[g * L + t0 + i] != 0.f;
        if (!any) continue;
        decode_v(vc_bh + t0 * v_codes.stride(2), v_codes.stride(2), n, Pv, vt, vf.data(), Dv);
        float norm[kBlock];
        for (int64_t i = 0; i < n; ++i) norm[i] = half_to_float(vn_bh[(t0 + i) * vn_s]);
        for (int64_t g = 0; g < G; ++g) {
          float w[kBlock];
          for (int64_t i = 0; i < n; ++i) {  // an unattended token's norm is never read into the sum (it may be NaN)
            const float p = scores[g * L + t0 + i];
            w[i] = p != 0.f ? p * norm[i] : 0.f;
          }
          accumulate(w, vf.data(), n, acc.data() + g * Dv, Dv);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const float* value = rv + b * ring_v->stride(0) + h * ring_v->stride(1) + r * ring_v->stride(2);
        float* sum = ring_rotated ? acc.data() : plain.data();
        for (int64_t g = 0; g < G; ++g)
          if (scores[g * L + N + r] != 0.f) accumulate(scores.data() + g * L + N + r, value, 1, sum + g * Dv, Dv);
      }
      float* o = op + (b * Hq + h * G) * Dv;  // acc R_v^T + plain
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < Dv; ++d) o[g * Dv + d] = dot(acc.data() + g * Dv, rot_v + d * Dv, Dv) + plain[g * Dv + d];
    }
  });
  return {out, mass};
}

}  // namespace

TORCH_LIBRARY(hf_kvplus_cpu, m) {
  m.def(
      "rotated_decode(Tensor q, Tensor k_codes, Tensor k_norms, Tensor v_codes, Tensor v_norms, Tensor k_table, "
      "Tensor v_table, Tensor k_rotation, Tensor v_rotation, Tensor? k_center, Tensor? k_turn_weights, Tensor? k_turn_basis, "
      "Tensor? k_turn_steps, Tensor? ring_k, Tensor? ring_v, "
      "bool ring_rotated, Tensor? mask, float scale, bool with_mass, int start=0, int length=-1) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_kvplus_cpu, CPU, m) { m.impl("rotated_decode", &rotated_decode_cpu); }
