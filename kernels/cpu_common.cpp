// What the CPU decode operators share (kivi_attention_cpu.cpp, rotated_attention_cpu.cpp): float16 to float, a dot
// product, exp of shifted logits and the weighted sum of value rows. Built first, in the same library
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

// exp(x[i] - m) in place: 2**y as 2**round(y) times a degree-6 polynomial of 2**f on [-0.5, 0.5] (relative error
// under 2e-7), which the compiler vectorizes (libm's expf is a call per element); 0 below 2**-126 (a masked key's
// -inf among them).
inline void exp_shifted(float* x, int64_t n, float m) {
  constexpr float kLog2e = 1.4426950408889634f;
  for (int64_t i = 0; i < n; ++i) {
    const float y = std::max((x[i] - m) * kLog2e, -127.f);
    const float e = std::nearbyint(y), f = y - e;
    const float p = 1.f + f * (0.6931471806f + f * (0.2402265070f + f * (0.0555041087f + f * (0.0096181291f +
                    f * (0.0013333558f + f * 0.0001540353f)))));
    const int32_t bits = (int32_t(e) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    x[i] = y > -126.f ? p * scale : 0.f;
  }
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

inline void accumulate(const float* w, const float* x, int64_t n, float* acc, int64_t channels) {
  int64_t c = 0;
  for (; c + 32 <= channels; c += 32) accumulate_span<32>(w, x + c, n, acc + c, channels);
  for (; c + 8 <= channels; c += 8) accumulate_span<8>(w, x + c, n, acc + c, channels);
  for (; c < channels; ++c) accumulate_span<1>(w, x + c, n, acc + c, channels);
}

}  // namespace kvplus_cpu
