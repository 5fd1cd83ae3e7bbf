// What the CPU decode operators share (kivi_attention_cpu.cpp, rotated_attention_cpu.cpp): float16 to float, a dot
// product, exp of shifted logits and the weighted sum of value rows; and what every operator that writes in place
// does after (`mark_written`). Built first, in the same library
// (rotated_cpu._SOURCES), so that each operator's source reads one copy of each.

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvplus_cpu {

// A float16 as a float: one instruction with F16C (c10::Half converts in software).
inline float half_to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return float(h);
#endif
}

// Eight running sums (the compiler makes them one vector), then the tail.
inline float dot(const float* a, const float* b, int64_t n) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) part[0] += a[i] * b[i];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

typedef float Floats8 __attribute__((vector_size(8 * sizeof(float))));  // GCC/Clang vectors: one AVX register
typedef int32_t Ints8 __attribute__((vector_size(8 * sizeof(int32_t))));

inline int32_t bits_of(float x) {
  int32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
inline Ints8 bits_of(Floats8 x) { return (Ints8)x; }
inline float float_of(int32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}
inline Floats8 float_of(Ints8 b) { return (Floats8)b; }

// 2**y for y <= 0, of a float or of 8 (F: float or Floats8, the same arithmetic): 2**round(y) times a degree-6
// polynomial of 2**f on [-0.5, 0.5] (relative error under 2e-7); 0 at and below 2**-126 (a masked key's -inf among
// them). round(y) is read off y + 1.5 * 2**23 (round to nearest even, as nearbyint), and what is below 2**-126
// selected away as an integer: the float select and conversion that GCC 12 left scalar (the FP operations may trap,
// so it does not speculate them) cost 3x this.
template <typename F>
inline F exp2_nonpositive(F y) {
  constexpr float kRound = 12582912.f;
  y = y < -127.f ? F{} - 127.f : y;
  const F r = y + kRound, e = r - kRound, f = y - e;
  const F p = 1.f + f * (0.6931471806f + f * (0.2402265070f + f * (0.0555041087f + f * (0.0096181291f +
              f * (0.0013333558f + f * 0.0001540353f)))));
  const auto bits = bits_of(r);
  return p * float_of(y > -126.f ? (bits - (bits_of(kRound) - 127)) << 23 : decltype(bits){});
}

// exp(x[i] - m) in place (x[i] <= m), 8 at a time.
inline void exp_shifted(float* x, int64_t n, float m) {
  constexpr float kLog2e = 1.4426950408889634f;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    Floats8 v;
    std::memcpy(&v, x + i, sizeof v);
    v = exp2_nonpositive((v - m) * kLog2e);
    std::memcpy(x + i, &v, sizeof v);
  }
  for (; i < n; ++i) x[i] = exp2_nonpositive((x[i] - m) * kLog2e);
}

// acc [channels] += sum_i w[i] * x[i, :] over n rows, `Width` channels at a time held in registers over the rows
// (several vectors: independent chains of multiply-adds).
template <int Width>
inline void accumulate_span(const float* w, const float* x, int64_t n, float* acc, int64_t channels) {
  float a[Width];
  for (int j = 0; j < Width; ++j) a[j] = acc[j];
  for (int64_t i = 0; i < n; ++i)
    for (int j = 0; j < Width; ++j) a[j] += w[i] * x[i * channels + j];
  for (int j = 0; j < Width; ++j) acc[j] = a[j];
}

// A tensor an operator wrote through its data pointer: its version counter moves, as an in-place op's does (what tells
// an offloaded layer's placement that a tensor at rest changed, and autograd that a saved tensor did). Inference
// tensors keep no counter.
inline void mark_written(const at::Tensor& t) {
  if (t.defined() && !t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

inline void accumulate(const float* w, const float* x, int64_t n, float* acc, int64_t channels) {
  int64_t c = 0;
  for (; c + 32 <= channels; c += 32) accumulate_span<32>(w, x + c, n, acc + c, channels);
  for (; c + 8 <= channels; c += 8) accumulate_span<8>(w, x + c, n, acc + c, channels);
  for (; c < channels; ++c) accumulate_span<1>(w, x + c, n, acc + c, channels);
}

}  // namespace kvplus_cpu
