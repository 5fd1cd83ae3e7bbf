// Decode attention on the CPU over KIVI codes (int8, int4, int2, fp8; kernels/quant_format.py) and over the float
// blocks of a paged pool, read in place: no chunk of the cache is dequantized or gathered into memory. The plain-torch
// twins dequantize (or gather) every key and value into float32 tensors at each step, then multiply; here a token's
// codes become one row of floats in a small buffer, read at once by every query of its KV head (kivi_cpu.py says
// where this runs).
//
// kivi_decode: q [B, Hq, D] float32 contiguous; codes [X, Hkv, T, P] uint8 (X: batch rows, or a pool's blocks of T
// tokens), key scales/zeros float16 [X, Hkv, T / group, D] (per channel, a row per group of tokens) or, with
// `keys_per_token`, [X, Hkv, T, D / group] (as values), value scales/zeros [X, Hkv, T, Dv / group]; zeros none for fp8
// (`bits` 0). Codes of byte j of a token are channels i * P + j, bits i * bits .., for i < 8 / bits. Tokens `start ..
// start + length - 1` are attended: dense (no block table) at buffer index start + t of row b; paged at block
// table[b, (start + t) / T], offset (start + t) % T. Then a float32 ring [B, Hkv, R, D] / [B, Hkv, R, Dv] of exact
// keys and values (or none), a bool mask [B, length + R] (true: attended; or none). paged_decode: the same over float
// pools [blocks, Hkv, T, D] (float32, float16 or bfloat16) through a block table, no ring.
// Returns the output [B, Hq, Dv] float32 and, with `with_mass`, each key's attention mass [B, Hkv, length + R]
// summed over its query group (else an empty tensor); a query whose keys are all masked outputs zeros.
//
// Work is split over (row, KV head, span of keys), spans long enough to amortize the merge, so that two threads
// are busy even with three KV heads; each span keeps its own max, sum and weighted sum, merged at the end.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace kvplus_kivi {

using kvplus_cpu::accumulate;
using kvplus_cpu::dot;
using kvplus_cpu::exp_shifted;
using kvplus_cpu::half_to_float;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Fewest keys per span of the work split (below it the merge costs more than a second thread saves).
constexpr int64_t kMinSpan = 256;

inline void halves(const at::Half* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#endif
  for (; i < n; ++i) out[i] = half_to_float(x[i]);
}

inline void axpy(float w, const float* x, float* acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += w * x[i];
}

// Tokens whose value rows are summed at once.
constexpr int64_t kBlock = 16;

// float8 e4m3fn of each byte value (NaN for the two NaN codes).
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 15, m = c & 7;
      float x = e == 0 ? std::ldexp(float(m) / 8.f, -6) : std::ldexp(1.f + float(m) / 8.f, e - 7);
      if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();
      v[c] = (c & 128) ? -x : x;
    }
  }
};
const Fp8Table kFp8;

// Eight lanes of floats and of bytes (GCC/Clang vectors: one AVX register, or two SSE ones).
typedef float F8 __attribute__((vector_size(32)));
typedef uint8_t B8 __attribute__((vector_size(8)));
typedef int32_t I8 __attribute__((vector_size(32)));

// A token's codes (P bytes) to its levels in channel order: the integer codes as floats (eight bytes at a time,
// every plane of them), or fp8's values.
template <int Bits>
inline void levels(const uint8_t* c, int64_t P, float* out) {
  if constexpr (Bits == 0) {
    // e4m3fn, eight at a time: a normal code's float has the code's exponent and mantissa bits shifted into place
    // and the exponent rebiased (+120); a subnormal's value is its mantissa times 2**-9; then the sign.
    int64_t j = 0;
    for (; j + 8 <= P; j += 8) {
      B8 b;
      std::memcpy(&b, c + j, sizeof b);
      const I8 x = __builtin_convertvector(b, I8), em = x & 0x7F;
      const I8 normal = (em << 20) + (120 << 23);
      F8 v;
      std::memcpy(&v, &normal, sizeof v);
      const F8 sub = __builtin_convertvector(em, F8) * (1.f / 512.f);
      v = em < 8 ? sub : v;
      I8 bits;
      std::memcpy(&bits, &v, sizeof bits);
      bits |= (x & 0x80) << 24;
      std::memcpy(out + j, &bits, sizeof bits);
    }
    for (; j < P; ++j) out[j] = kFp8.v[c[j]];
  } else {
    constexpr int per = 8 / Bits;
    constexpr unsigned mask = (1u << Bits) - 1u;
    int64_t j = 0;
    for (; j + 8 <= P; j += 8) {
      B8 b;
      std::memcpy(&b, c + j, sizeof b);
      for (int i = 0; i < per; ++i) {
        const B8 x = (b >> uint8_t(i * Bits)) & uint8_t(mask);
        const F8 f = __builtin_convertvector(__builtin_convertvector(x, I8), F8);
        std::memcpy(out + i * P + j, &f, sizeof f);
      }
    }
    for (; j < P; ++j)
      for (int i = 0; i < per; ++i) out[i * P + j] = float((unsigned(c[j]) >> (i * Bits)) & mask);
  }
}

// Tokens whose key scores are made together: eight, the lanes of one vector of scores.
constexpr int64_t kKeys = 8;

// out[g * L + k] = q_g . rows[k] (+ add[g]) for k < n <= kKeys rows `rstride` floats apart, D a multiple of 8: each
// query's eight running sums per row stay in registers, and the eight rows' sums are reduced together (one
// transposing reduction instead of one horizontal sum per key).
inline void score_rows(const float* q, int64_t G, int64_t D, const float* rows, int64_t rstride, int64_t n,
                       const float* add, float* out, int64_t L) {
  if (D % 8 != 0) {  // (no head dim of a model hf_kvplus knows)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t k = 0; k < n; ++k)
        out[g * L + k] = dot(q + g * D, rows + k * rstride, D) + (add != nullptr ? add[g] : 0.f);
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    F8 acc[kKeys] = {};
    for (int64_t c = 0; c < D; c += 8) {
      F8 qv;
      std::memcpy(&qv, qg + c, sizeof qv);
      for (int64_t k = 0; k < kKeys; ++k) {
        if (k < n) {
          F8 r;
          std::memcpy(&r, rows + k * rstride + c, sizeof r);
          acc[k] += qv * r;
        }
      }
    }
    const float a = add != nullptr ? add[g] : 0.f;
#if defined(__AVX__)
    if (n == kKeys) {
      __m256 t0 = _mm256_hadd_ps((__m256)acc[0], (__m256)acc[1]), t1 = _mm256_hadd_ps((__m256)acc[2], (__m256)acc[3]);
      __m256 t2 = _mm256_hadd_ps((__m256)acc[4], (__m256)acc[5]), t3 = _mm256_hadd_ps((__m256)acc[6], (__m256)acc[7]);
      t0 = _mm256_hadd_ps(t0, t1);
      t2 = _mm256_hadd_ps(t2, t3);
      const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20), _mm256_permute2f128_ps(t0, t2, 0x31));
      _mm256_storeu_ps(out + g * L, _mm256_add_ps(sum, _mm256_set1_ps(a)));
      continue;
    }
#endif
    for (int64_t k = 0; k < n; ++k) {
      float sum = 0.f;
      for (int j = 0; j < 8; ++j) sum += acc[k][j];
      out[g * L + k] = sum + a;
    }
  }
}

// row = levels * scale + zero, a scale and zero per `group` channels (zero none: fp8).
inline void dequantize(const float* lv, const float* s, const float* z, int64_t group, int64_t D, float* out) {
  for (int64_t c0 = 0, gi = 0; c0 < D; c0 += group, ++gi) {
    const float sc = s[gi], zc = z != nullptr ? z[gi] : 0.f;
    for (int64_t c = c0; c < c0 + group; ++c) out[c] = lv[c] * sc + zc;
  }
}

// A 4-d tensor's data with its first three strides (its last is 1).
template <class T>
struct View {
  const T* p = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  View() = default;
  explicit View(const std::optional<at::Tensor>& t) {
    if (t.has_value()) *this = View(*t);
  }
  explicit View(const at::Tensor& t) : p(t.data_ptr<T>()), s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)) {}
  inline const T* at(int64_t x, int64_t h, int64_t r) const { return p + x * s0 + h * s1 + r * s2; }
};

// Where token t of the attended span lives: (buffer row or block, index in it).
struct Locator {
  const int32_t* table = nullptr;
  int64_t ts0 = 0, ts1 = 0, block = 0, start = 0;
  inline void at(int64_t b, int64_t t, int64_t& x, int64_t& i) const {
    const int64_t n = start + t;
    if (table == nullptr) {
      x = b;
      i = n;
    } else {
      x = table[b * ts0 + (n / block) * ts1];
      i = n % block;
    }
  }
};

// KIVI codes: the keys' scores and the values' rows of one KV head, with their scratch.
template <int Bits>
struct KiviSource {
  View<uint8_t> kc, vc;
  View<at::Half> ks, kz, vs, vz;
  int64_t group, D, Dv, Pk, Pv;
  bool per_token_keys;
  std::vector<float> lv, row, sf, zf, qs, qz;
  const at::Half* cached = nullptr;  // the key-scale row qs and qz were made for

  void prepare(int64_t G) {
    lv.resize(kKeys * std::max(D, Dv));
    row.resize(std::max(D, Dv));
    sf.resize(D);
    zf.resize(D);
    qs.resize(G * D);
    qz.resize(G);
    cached = nullptr;
  }
  void begin() { cached = nullptr; }  // a new query

  // Scores (scaled q) of the n <= kKeys keys at (x, i .. i + n - 1) of head h, in one key group, into
  // out[g * L + k]. Per channel: q . (zero + level * scale) = q . zero + (q * scale) . level, the first two made once
  // per group.
  inline void scores(int64_t x, int64_t h, int64_t i, int64_t n, const float* q, int64_t G, float* out, int64_t L) {
    for (int64_t k = 0; k < n; ++k) levels<Bits>(kc.at(x, h, i + k), Pk, lv.data() + k * D);
    if (per_token_keys) {
      const int64_t m = D / group;
      for (int64_t k = 0; k < n; ++k) {
        halves(ks.at(x, h, i + k), sf.data(), m);
        if (kz.p != nullptr) halves(kz.at(x, h, i + k), zf.data(), m);
        dequantize(lv.data() + k * D, sf.data(), kz.p != nullptr ? zf.data() : nullptr, group, D, lv.data() + k * D);
      }
      score_rows(q, G, D, lv.data(), D, n, nullptr, out, L);
      return;
    }
    const at::Half* srow = ks.at(x, h, i / group);
    if (srow != cached) {
      cached = srow;
      halves(srow, sf.data(), D);
      if (kz.p != nullptr) halves(kz.at(x, h, i / group), zf.data(), D);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        for (int64_t c = 0; c < D; ++c) qs[g * D + c] = qg[c] * sf[c];
        qz[g] = kz.p != nullptr ? dot(qg, zf.data(), D) : 0.f;
      }
    }
    score_rows(qs.data(), G, D, lv.data(), D, n, qz.data(), out, L);
  }

  // Keys of one call to `scores` that share a key group from buffer index i: up to the group's end.
  inline int64_t run(int64_t i) const { return per_token_keys ? kKeys : group - i % group; }

  // The value at (x, i) of head h into out [Dv].
  inline void value(int64_t x, int64_t h, int64_t i, float* out) {
    levels<Bits>(vc.at(x, h, i), Pv, lv.data());
    const int64_t n = Dv / group;
    halves(vs.at(x, h, i), sf.data(), n);
    if (vz.p != nullptr) halves(vz.at(x, h, i), zf.data(), n);
    dequantize(lv.data(), sf.data(), vz.p != nullptr ? zf.data() : nullptr, group, Dv, out);
  }
};

// Float blocks of a paged pool.
template <class T>
struct PoolSource {
  View<T> kp, vp;
  int64_t D, Dv;
  std::vector<float> row, keys;

  void prepare(int64_t) {
    row.resize(std::max(D, Dv));
    keys.resize(kKeys * D);
  }
  void begin() {}

  inline const float* as_floats(const T* p, int64_t n) {
    if constexpr (std::is_same_v<T, float>) {
      return p;
    } else if constexpr (std::is_same_v<T, at::Half>) {
      halves(p, row.data(), n);
      return row.data();
    } else {
      for (int64_t c = 0; c < n; ++c) row[c] = float(p[c]);
      return row.data();
    }
  }

  inline void scores(int64_t x, int64_t h, int64_t i, int64_t n, const float* q, int64_t G, float* out, int64_t L) {
    if constexpr (std::is_same_v<T, float>) {
      score_rows(q, G, D, kp.at(x, h, i), kp.s2, n, nullptr, out, L);
    } else {
      for (int64_t k = 0; k < n; ++k) {
        const float* r = as_floats(kp.at(x, h, i + k), D);
        std::memcpy(keys.data() + k * D, r, D * sizeof(float));
      }
      score_rows(q, G, D, keys.data(), D, n, nullptr, out, L);
    }
  }

  inline int64_t run(int64_t) const { return kKeys; }

  inline void value(int64_t x, int64_t h, int64_t i, float* out) {
    const float* v = as_floats(vp.at(x, h, i), Dv);
    std::memcpy(out, v, Dv * sizeof(float));
  }
};

struct Call {
  const float* q;
  int64_t B, Hq, Hkv, G, D, Dv, N, R, L;
  float scale;
  Locator where;
  View<float> rk, rv;
  const bool* mask = nullptr;
  int64_t ms0 = 0, ms1 = 0;
};

// Spans per (row, KV head): enough tasks for the threads, each at least kMinSpan keys.
int64_t spans_of(const Call& c) {
  const int64_t threads = at::get_num_threads(), rows = c.B * c.Hkv;
  const int64_t wanted = (2 * threads + rows - 1) / rows;
  return std::max<int64_t>(1, std::min(wanted, c.L / kMinSpan));
}

template <class Src>
std::tuple<at::Tensor, at::Tensor> attend(const Call& c, const Src& proto, bool with_mass) {
  const int64_t S = spans_of(c), span = (c.L + S - 1) / S, G = c.G, L = c.L;
  auto opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor scores = at::empty({c.B * c.Hkv, G, L}, opts);
  at::Tensor part = at::empty({c.B * c.Hkv, S, G, 2 + c.Dv}, opts);  // per span and query: max, sum, weighted sum
  float* sp = scores.data_ptr<float>();
  float* pp = part.data_ptr<float>();

  at::parallel_for(0, c.B * c.Hkv * S, 1, [&](int64_t begin, int64_t end) {
    Src src = proto;
    src.prepare(G);
    std::vector<float> vbuf(kBlock * c.Dv), qscaled(G * c.D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / S, s = task % S, b = bh / c.Hkv, h = bh % c.Hkv;
      const int64_t t0 = s * span, t1 = std::min(L, t0 + span);
      const float* q_in = c.q + (b * c.Hq + h * G) * c.D;
      for (int64_t e = 0; e < G * c.D; ++e) qscaled[e] = q_in[e] * c.scale;  // scores come scaled
      const float* q = qscaled.data();
      float* sc = sp + bh * G * L;
      float* out = pp + (bh * S + s) * G * (2 + c.Dv);
      for (int64_t g = 0; g < G; ++g) {
        out[g * (2 + c.Dv)] = kNegInf;
        out[g * (2 + c.Dv) + 1] = 0.f;
        std::fill(out + g * (2 + c.Dv) + 2, out + (g + 1) * (2 + c.Dv), 0.f);
      }
      if (t0 >= t1) continue;
      src.begin();
      // Scores: the codes (or blocks) in runs of keys that share a key group and a block, then the ring; then the
      // mask.
      const int64_t codes_end = std::min(t1, c.N);
      for (int64_t t = t0; t < codes_end;) {
        int64_t x, i;
        c.where.at(b, t, x, i);
        int64_t n = std::min({kKeys, codes_end - t, src.run(i)});
        if (c.where.table != nullptr) n = std::min(n, c.where.block - i);
        src.scores(x, h, i, n, q, G, sc + t, L);
        t += n;
      }
      for (int64_t t = std::max(t0, c.N); t < t1; ++t) {
        const float* k = c.rk.at(b, h, t - c.N);
        for (int64_t g = 0; g < G; ++g) sc[g * L + t] = dot(q + g * c.D, k, c.D);
      }
      if (c.mask != nullptr)
        for (int64_t t = t0; t < t1; ++t)
          if (!c.mask[b * c.ms0 + t * c.ms1])
            for (int64_t g = 0; g < G; ++g) sc[g * L + t] = kNegInf;
      bool any = false;
      for (int64_t g = 0; g < G; ++g) {
        float* row = sc + g * L;
        float m = kNegInf;
        for (int64_t t = t0; t < t1; ++t) m = std::max(m, row[t]);
        out[g * (2 + c.Dv)] = m;
        if (m == kNegInf) {
          std::fill(row + t0, row + t1, 0.f);
          continue;
        }
        any = true;
        exp_shifted(row + t0, t1 - t0, m);
        float l = 0.f;
        for (int64_t t = t0; t < t1; ++t) l += row[t];
        out[g * (2 + c.Dv) + 1] = l;
      }
      if (!any) continue;
      // The values, kBlock tokens at a time: their rows into a buffer, then each query's weighted sum with its
      // running sums held in registers over the block (tokens no query attends are skipped: their codes may hold
      // anything).
      for (int64_t a = t0; a < t1; a += kBlock) {
        const int64_t n = std::min(kBlock, t1 - a);
        int64_t kept = 0;
        int64_t at_[kBlock];
        for (int64_t t = a; t < a + n; ++t) {
          bool live = false;
          for (int64_t g = 0; g < G; ++g) live |= sc[g * L + t] != 0.f;
          if (!live) continue;
          float* v = vbuf.data() + kept * c.Dv;
          if (t < c.N) {
            int64_t x, i;
            c.where.at(b, t, x, i);
            src.value(x, h, i, v);
          } else {
            std::memcpy(v, c.rv.at(b, h, t - c.N), c.Dv * sizeof(float));
          }
          at_[kept++] = t;
        }
        if (kept == 0) continue;
        for (int64_t g = 0; g < G; ++g) {
          float w[kBlock];
          for (int64_t k = 0; k < kept; ++k) w[k] = sc[g * L + at_[k]];
          accumulate(w, vbuf.data(), kept, out + g * (2 + c.Dv) + 2, c.Dv);
        }
      }
    }
  });

  at::Tensor result = at::empty({c.B, c.Hq, c.Dv}, opts);
  at::Tensor mass = at::empty({with_mass ? c.B : 0, c.Hkv, L}, opts);
  float* op = result.data_ptr<float>();
  float* mp = with_mass ? mass.data_ptr<float>() : nullptr;
  at::parallel_for(0, c.B * c.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(S);
    for (int64_t bh = begin; bh < end; ++bh) {
      if (mp != nullptr) std::fill(mp + bh * L, mp + (bh + 1) * L, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        const float* part_g = pp + bh * S * G * (2 + c.Dv) + g * (2 + c.Dv);
        const int64_t stride = G * (2 + c.Dv);
        float M = kNegInf;
        for (int64_t s = 0; s < S; ++s) M = std::max(M, part_g[s * stride]);
        float* o = op + (bh * G + g) * c.Dv;  // (bh = b * Hkv + h: query head h * G + g of row b)
        std::fill(o, o + c.Dv, 0.f);
        if (M == kNegInf) continue;  // every key masked: zeros
        float l = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          const float m = part_g[s * stride];
          w[s] = m == kNegInf ? 0.f : std::exp(m - M);
          l += w[s] * part_g[s * stride + 1];
        }
        const float inv = 1.f / l;
        for (int64_t s = 0; s < S; ++s)
          if (w[s] != 0.f) axpy(w[s] * inv, part_g + s * stride + 2, o, c.Dv);
        if (mp != nullptr) {
          const float* row = sp + (bh * G + g) * L;
          for (int64_t s = 0; s < S; ++s) {
            const float f = w[s] * inv;
            const int64_t t0 = s * span, t1 = std::min(L, t0 + span);
            if (f != 0.f) axpy(f, row + t0, mp + bh * L + t0, t1 - t0);
          }
        }
      }
    }
  });
  return {result, mass};
}

// `t` with unit stride in its last dim (a copy only where it has not), and of an optional one.
at::Tensor unit_rows(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }
std::optional<at::Tensor> unit_rows(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(unit_rows(*t)) : std::nullopt;
}
// An optional ring as float32.
std::optional<at::Tensor> floats(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->scalar_type() != at::kFloat ? std::optional<at::Tensor>(t->to(at::kFloat)) : t;
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, "kivi_decode_cpu: ", name, " must be 4-d with unit stride in its last dim");
}

Call make_call(const at::Tensor& q, int64_t Hkv, int64_t Dv, int64_t N, int64_t start, int64_t block,
               const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& ring_k,
               const std::optional<at::Tensor>& ring_v, const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "kivi_decode_cpu: q must be contiguous float32 [B, Hq, D]");
  Call c;
  c.q = q.data_ptr<float>();
  c.B = q.size(0);
  c.Hq = q.size(1);
  c.D = q.size(2);
  c.Hkv = Hkv;
  TORCH_CHECK(Hkv > 0 && c.Hq % Hkv == 0, "kivi_decode_cpu: ", c.Hq, " query heads on ", Hkv, " KV heads");
  c.G = c.Hq / Hkv;
  c.Dv = Dv;
  c.N = N;
  c.R = ring_k.has_value() ? ring_k->size(2) : 0;
  c.L = c.N + c.R;
  c.scale = float(scale);
  TORCH_CHECK(c.L > 0, "kivi_decode_cpu: no key to attend");
  if (ring_k.has_value()) {
    TORCH_CHECK(ring_v.has_value() && ring_k->scalar_type() == at::kFloat && ring_v->scalar_type() == at::kFloat &&
                    ring_k->dim() == 4 && ring_v->dim() == 4 && ring_k->stride(3) == 1 && ring_v->stride(3) == 1 &&
                    ring_k->size(0) == c.B && ring_v->size(0) == c.B && ring_k->size(1) == Hkv &&
                    ring_v->size(1) == Hkv && ring_k->size(3) == c.D && ring_v->size(3) == Dv &&
                    ring_v->size(2) == c.R,
                "kivi_decode_cpu: the ring must be float32 [", c.B, ", ", Hkv, ", R, ", c.D, "] keys and [", c.B,
                ", ", Hkv, ", R, ", Dv, "] values");
    c.rk = View<float>(*ring_k);
    c.rv = View<float>(*ring_v);
  }
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 2 && mask->scalar_type() == at::kBool && mask->size(0) == c.B && mask->size(1) == c.L,
                "kivi_decode_cpu: the mask must be bool [", c.B, ", ", c.L, "]");
    c.mask = mask->data_ptr<bool>();
    c.ms0 = mask->stride(0);
    c.ms1 = mask->stride(1);
  }
  c.where.start = start;
  c.where.block = block;
  if (block_table.has_value()) {
    TORCH_CHECK(block_table->dim() == 2 && block_table->scalar_type() == at::kInt && block_table->size(0) == c.B,
                "kivi_decode_cpu: the block table must be int32 [", c.B, ", columns]");
    TORCH_CHECK(N == 0 || (start + N - 1) / block < block_table->size(1), "kivi_decode_cpu: tokens up to ", start + N,
                " need ", (start + N - 1) / block + 1, " table columns, the table has ", block_table->size(1));
    c.where.table = block_table->data_ptr<int32_t>();
    c.where.ts0 = block_table->stride(0);
    c.where.ts1 = block_table->stride(1);
  }
  return c;
}

std::tuple<at::Tensor, at::Tensor> kivi_decode_cpu(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale, const std::optional<at::Tensor>& k_zero,
    const at::Tensor& v_codes, const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero, int64_t bits,
    int64_t group, bool keys_per_token, int64_t start, int64_t length, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& ring_k, const std::optional<at::Tensor>& ring_v,
    const std::optional<at::Tensor>& mask, double scale, bool with_mass) {
  // What the wrapper took as it is (a decode step's inputs already are: a call saved per input) made so here: q
  // float32 and contiguous, the ring float32, every input unit-stride in its last dim, the table int32.
  const at::Tensor qf = q.scalar_type() == at::kFloat && q.is_contiguous() ? q : q.to(at::kFloat).contiguous();
  const at::Tensor kc = unit_rows(k_codes), ks = unit_rows(k_scale), vc = unit_rows(v_codes), vs = unit_rows(v_scale);
  const std::optional<at::Tensor> kz = unit_rows(k_zero), vz = unit_rows(v_zero);
  const std::optional<at::Tensor> rk = unit_rows(floats(ring_k)), rv = unit_rows(floats(ring_v));
  std::optional<at::Tensor> table = block_table;
  if (table.has_value() && table->scalar_type() != at::kInt) table = table->to(at::kInt);
  for (auto [t, name] : {std::pair{&kc, "k_codes"}, {&vc, "v_codes"}, {&ks, "k_scale"}, {&vs, "v_scale"}})
    check_rows(*t, name);
  TORCH_CHECK(k_codes.scalar_type() == at::kByte && v_codes.scalar_type() == at::kByte &&
                  k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf,
              "kivi_decode_cpu: codes must be uint8 and scales float16");
  TORCH_CHECK(bits == 0 || bits == 2 || bits == 4 || bits == 8, "kivi_decode_cpu: bits must be 8, 4, 2 or 0 (fp8), got ",
              bits);
  TORCH_CHECK((bits == 0) == !kz.has_value() && (bits == 0) == !vz.has_value(),
              "kivi_decode_cpu: zeros go with integer codes, and only with them");
  for (const auto* z : {&kz, &vz})
    if (z->has_value()) {
      check_rows(**z, "a zero");
      TORCH_CHECK((*z)->scalar_type() == at::kHalf, "kivi_decode_cpu: zeros must be float16");
    }
  const int64_t per = bits == 0 ? 1 : 8 / bits, Hkv = kc.size(1), T = kc.size(2);
  const int64_t D = kc.size(3) * per, Dv = vc.size(3) * per;
  TORCH_CHECK(group > 0 && D % group == 0 && Dv % group == 0 && (keys_per_token || T % group == 0),
              "kivi_decode_cpu: group ", group, " must divide the head dims ", D, ", ", Dv, " and the block ", T);
  TORCH_CHECK(qf.size(-1) == D, "kivi_decode_cpu: q has ", qf.size(-1), " channels, the keys' codes ", D);
  TORCH_CHECK(length >= 0 && start >= 0 && (table.has_value() || start + length <= T),
              "kivi_decode_cpu: tokens ", start, " .. ", start + length, " outside the buffers' ", T);
  Call c = make_call(qf, Hkv, Dv, length, start, T, table, rk, rv, mask, scale);
  auto run = [&](auto src) {
    src.kc = View<uint8_t>(kc);
    src.vc = View<uint8_t>(vc);
    src.ks = View<at::Half>(ks);
    src.kz = View<at::Half>(kz);
    src.vs = View<at::Half>(vs);
    src.vz = View<at::Half>(vz);
    src.group = group;
    src.D = D;
    src.Dv = Dv;
    src.Pk = kc.size(3);
    src.Pv = vc.size(3);
    src.per_token_keys = keys_per_token;
    return attend(c, src, with_mass);
  };
  switch (bits) {
    case 8: return run(KiviSource<8>{});
    case 4: return run(KiviSource<4>{});
    case 2: return run(KiviSource<2>{});
    default: return run(KiviSource<0>{});
  }
}

at::Tensor paged_decode_cpu(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& block_table, int64_t start, int64_t length,
                            const std::optional<at::Tensor>& mask, double scale) {
  check_rows(k_pool, "k_pool");
  check_rows(v_pool, "v_pool");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type() && k_pool.size(2) == v_pool.size(2),
              "paged_decode_cpu: the pools must share a dtype and a block size");
  TORCH_CHECK(q.size(-1) == k_pool.size(3), "paged_decode_cpu: q has ", q.size(-1), " channels, the keys ",
              k_pool.size(3));
  Call c = make_call(q, k_pool.size(1), v_pool.size(3), length, start, k_pool.size(2), block_table, std::nullopt,
                     std::nullopt, mask, scale);
  auto run = [&](auto src) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(src.kp.p)>>;
    src.kp = View<T>(k_pool);
    src.vp = View<T>(v_pool);
    src.D = c.D;
    src.Dv = c.Dv;
    return std::get<0>(attend(c, src, false));
  };
  switch (k_pool.scalar_type()) {
    case at::kFloat: return run(PoolSource<float>{});
    case at::kHalf: return run(PoolSource<at::Half>{});
    case at::kBFloat16: return run(PoolSource<at::BFloat16>{});
    default: TORCH_CHECK(false, "paged_decode_cpu: pools must be float32, float16 or bfloat16, got ", k_pool.scalar_type());
  }
  return at::Tensor();
}

// Decode attention over float K/V [B, Hkv, N, D] read in place (any strides but the last), with the mass each key
// received when asked: the dense slots of a scored eviction (H2O), whose twin copies K and V to float32 and
// reshapes them (a copy of every held token per layer and step) to get the weights out.
std::tuple<at::Tensor, at::Tensor> dense_decode_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const std::optional<at::Tensor>& mask, double scale,
                                                    bool with_mass) {
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k.size(0) == v.size(0) && k.size(1) == v.size(1) &&
                  k.size(2) == v.size(2) && k.size(0) == q.size(0),
              "dense_decode_cpu: k and v must share a dtype and [B, Hkv, N] with q's batch");
  TORCH_CHECK(q.size(-1) == k.size(3), "dense_decode_cpu: q has ", q.size(-1), " channels, the keys ", k.size(3));
  Call c = make_call(q, k.size(1), v.size(3), k.size(2), 0, k.size(2), std::nullopt, std::nullopt, std::nullopt, mask,
                     scale);
  auto run = [&](auto src) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(src.kp.p)>>;
    src.kp = View<T>(k);
    src.vp = View<T>(v);
    src.D = c.D;
    src.Dv = c.Dv;
    return attend(c, src, with_mass);
  };
  switch (k.scalar_type()) {
    case at::kFloat: return run(PoolSource<float>{});
    case at::kHalf: return run(PoolSource<at::Half>{});
    case at::kBFloat16: return run(PoolSource<at::BFloat16>{});
    default: TORCH_CHECK(false, "dense_decode_cpu: k and v must be float32, float16 or bfloat16, got ", k.scalar_type());
  }
  return {};
}

}  // namespace kvplus_kivi

TORCH_LIBRARY_FRAGMENT(hf_kvplus_cpu, m) {
  m.def(
      "kivi_decode(Tensor q, Tensor k_codes, Tensor k_scale, Tensor? k_zero, Tensor v_codes, Tensor v_scale, "
      "Tensor? v_zero, int bits, int group, bool keys_per_token, SymInt start, SymInt length, Tensor? block_table, "
      "Tensor? ring_k, Tensor? ring_v, Tensor? mask, float scale, bool with_mass) -> (Tensor, Tensor)");
  m.def(
      "paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, SymInt start, SymInt length, Tensor? mask, "
      "float scale) -> Tensor");
  m.def("dense_decode(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool with_mass) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_kvplus_cpu, CPU, m) {
  m.impl("kivi_decode", &kvplus_kivi::kivi_decode_cpu);
  m.impl("paged_decode", &kvplus_kivi::paged_decode_cpu);
  m.impl("dense_decode", &kvplus_kivi::dense_decode_cpu);
}
