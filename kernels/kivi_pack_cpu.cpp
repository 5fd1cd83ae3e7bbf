// Quantize-and-pack of the KIVI formats on the CPU: quant_format.quantize_keys / quantize_values in one pass per
// group, bit for bit (the same float32 operations in the same order, none fused: see kFloatOrder). The twin runs
// about fifteen tensor operations per call, each a dispatch and a pass over memory, where an evicting cache codes
// one token per step and layer (kivi_cpu.py says where this runs).
//
// kivi_encode: x [B, H, T, D] float32 (any strides); `bits` 8, 4, 2 or 0 (fp8); `per_channel`: keys, a scale and
// zero per channel over each group of `group` tokens (T a multiple of it), else values, per token over groups of
// `group` channels. Returns (codes uint8 [B, H, T, D * bits / 8] (fp8: D), scales float16 [B, H, T / group, D] or
// [B, H, T, D / group], zeros likewise (fp8: an empty tensor)).
//
// kivi_encode_into: values' coding (per token) of x [B, H, T, D] float32 written straight into `codes`
// [B, H, N, D * bits / 8], `scale` and `zero` [B, H, N, D / group] (any strides: a storage's fields; fp8: `zero`
// unused) at rows `slots` [B, H, T] int64 (undefined: rows start .. start + T - 1), the codes the
// same bits as kivi_encode's. With `limit` >= 0 a value whose magnitude exceeds it (NaN included) is coded as 0 and
// counted into `bad` (a 0-d int64 tensor): storage/value_range.RangeGuard's rule, folded in. What an evicting
// cache's decode step runs per layer in one call, where guarding, coding and copying into the slots took a dozen.
// kivi_encode_kv_into: the same for a token's key and value (one format; fields of each side, one `slots` or
// `start` and one `bad` for both) in one call: an operator call costs more than its compute at a decode step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

// kFloatOrder: every product and sum rounds on its own, as the twin's tensor operations do (no multiply-add fused).
#if defined(__clang__)
#define KVPLUS_FLOAT_ORDER _Pragma("clang fp contract(off)")
#define KVPLUS_NO_CONTRACT
#elif defined(__GNUC__)
#define KVPLUS_FLOAT_ORDER
#define KVPLUS_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define KVPLUS_FLOAT_ORDER
#define KVPLUS_NO_CONTRACT
#endif

namespace kvplus_kivi_pack {

constexpr float kMargin = 1.0f / 1024.0f;  // quant_format._MARGIN
constexpr float kTiny = 5.9604644775390625e-08f;  // 2**-24
constexpr float kHalfTiny = 2.98023223876953125e-08f;  // 2**-25
constexpr float kFp8Max = 448.0f;

inline float round_half(float x) { return float(at::Half(x)); }

// One group's parameters from its range (quant_format._params_int / _scale_fp8) and a value's code.
struct Coder {
  int bits;
  float qmax;

  KVPLUS_NO_CONTRACT inline void params(float lo, float hi, float amax, at::Half& scale, at::Half& zero) const {
    KVPLUS_FLOAT_ORDER
    if (bits == 0) {
      float s = amax / kFp8Max;
      s = s * (1.0f + kMargin);
      s = s + kHalfTiny;
      scale = at::Half(std::max(s, kTiny));
      return;
    }
    float z = std::fabs(lo) * kMargin;
    z = lo - z;
    z = z - kTiny;
    zero = at::Half(z);
    float s = hi - float(zero);
    s = s / qmax;
    s = s * (1.0f + kMargin);
    s = s + kHalfTiny;
    scale = at::Half(std::max(s, kTiny));
  }

  KVPLUS_NO_CONTRACT inline uint8_t code(float x, float scale, float zero) const {
    KVPLUS_FLOAT_ORDER
    if (bits == 0) {
      float y = x / scale;
      y = std::min(std::max(y, -kFp8Max), kFp8Max);
      return c10::Float8_e4m3fn(y).x;
    }
    float y = x - zero;
    y = y / scale;
    y = y + 0.5f;
    y = std::floor(y);
    y = std::min(std::max(y, 0.0f), qmax);
    return uint8_t(y);
  }
};

// The smallest, the largest and the largest magnitude of a group's `n` values (what a group's scale and zero are
// made from).
inline void group_range(const float* x, int64_t n, float& lo, float& hi, float& mag) {
  lo = hi = x[0];
  mag = std::fabs(x[0]);
  for (int64_t c = 1; c < n; ++c) {
    lo = std::min(lo, x[c]);
    hi = std::max(hi, x[c]);
    mag = std::max(mag, std::fabs(x[c]));
  }
}

// Codes of one token [D] (channel order) packed: byte j holds channels i * P + j in bits i * bits ...
inline void pack(const uint8_t* codes, int64_t D, int bits, uint8_t* out) {
  if (bits == 0 || bits == 8) {
    std::copy(codes, codes + D, out);
    return;
  }
  const int per = 8 / bits;
  const int64_t P = D / per;
  for (int64_t j = 0; j < P; ++j) {
    unsigned byte = 0;
    for (int i = 0; i < per; ++i) byte |= unsigned(codes[i * P + j]) << (i * bits);
    out[j] = uint8_t(byte);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> kivi_encode_cpu(const at::Tensor& x, int64_t bits, int64_t group,
                                                               bool per_channel) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat, "kivi_encode_cpu: x must be float32 [B, H, T, D]");
  TORCH_CHECK(bits == 0 || bits == 2 || bits == 4 || bits == 8, "kivi_encode_cpu: bits must be 8, 4, 2 or 0 (fp8)");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  const int per = bits == 0 ? 1 : 8 / int(bits);
  TORCH_CHECK(group > 0 && D % per == 0 && (per_channel ? T % group == 0 : D % group == 0), "kivi_encode_cpu: group ",
              group, " must divide ", per_channel ? "the tokens " : "the channels ", per_channel ? T : D);
  const at::Tensor xs = x.contiguous();
  auto half = x.options().dtype(at::kHalf);
  at::Tensor codes = at::empty({B, H, T, D / per}, x.options().dtype(at::kByte));
  const std::vector<int64_t> pshape =
      per_channel ? std::vector<int64_t>{B, H, T / group, D} : std::vector<int64_t>{B, H, T, D / group};
  at::Tensor scale = at::empty(pshape, half);
  at::Tensor zero = bits == 0 ? at::empty({0}, half) : at::empty(pshape, half);
  const float* xp = xs.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  at::Half* sp = scale.data_ptr<at::Half>();
  at::Half* zp = bits == 0 ? nullptr : zero.data_ptr<at::Half>();
  const Coder coder{int(bits), float((1 << (bits == 0 ? 8 : bits)) - 1)};
  const int64_t P = D / per;
  // Work unit: a key group of `group` tokens (per channel), or one token (per token) of one (row, head).
  const int64_t span = per_channel ? group : 1, units = B * H * (T / span);
  at::parallel_for(0, units, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> q(span * D);
    std::vector<float> lo(D), hi(D), amax(D);
    for (int64_t u = begin; u < end; ++u) {
      const float* xu = xp + u * span * D;  // (rows, heads and tokens contiguous: units in order)
      if (per_channel) {
        for (int64_t c = 0; c < D; ++c) {
          float l = xu[c], h = xu[c], a = std::fabs(xu[c]);
          for (int64_t t = 1; t < span; ++t) {
            const float v = xu[t * D + c];
            l = std::min(l, v);
            h = std::max(h, v);
            a = std::max(a, std::fabs(v));
          }
          at::Half s, z;
          coder.params(l, h, a, s, z);
          sp[u * D + c] = s;
          if (zp != nullptr) zp[u * D + c] = z;
          const float sf = float(s), zf = zp != nullptr ? float(z) : 0.f;
          for (int64_t t = 0; t < span; ++t) q[t * D + c] = coder.code(xu[t * D + c], sf, zf);
        }
      } else {
        const int64_t groups = D / group;
        for (int64_t k = 0; k < groups; ++k) {
          const float* xg = xu + k * group;
          float l, h, a;
          group_range(xg, group, l, h, a);
          at::Half s, z;
          coder.params(l, h, a, s, z);
          sp[u * groups + k] = s;
          if (zp != nullptr) zp[u * groups + k] = z;
          const float sf = float(s), zf = zp != nullptr ? float(z) : 0.f;
          for (int64_t c = 0; c < group; ++c) q[k * group + c] = coder.code(xg[c], sf, zf);
        }
      }
      for (int64_t t = 0; t < span; ++t) pack(q.data() + t * D, D, int(bits), cp + (u * span + t) * P);
    }
  });
  return {codes, scale, zero};
}


// The coding of kivi_encode_into into one side's fields; returns how many values the guard zeroed.
int64_t encode_rows(const at::Tensor& x, int64_t bits, int64_t group, double limit, const at::Tensor& codes,
                    const at::Tensor& scale, const at::Tensor& zero, int64_t start,
                    const c10::optional<at::Tensor>& slots) {
  TORCH_CHECK(x.dim() == 4 && at::isFloatingType(x.scalar_type()), "kivi_encode_into: x must be floats [B, H, T, D]");
  TORCH_CHECK(bits == 0 || bits == 2 || bits == 4 || bits == 8, "kivi_encode_into: bits must be 8, 4, 2 or 0 (fp8)");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  const int per = bits == 0 ? 1 : 8 / int(bits);
  TORCH_CHECK(group > 0 && D % group == 0 && D % per == 0, "kivi_encode_into: group ", group,
              " must divide the channels ", D);
  const int64_t P = D / per, groups = D / group;
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.size(0) == B && codes.size(1) == H &&
                  codes.size(3) == P && codes.stride(3) == 1,
              "kivi_encode_into: codes must be uint8 [B, H, N, ", P, "] with unit last stride");
  TORCH_CHECK(scale.dim() == 4 && scale.scalar_type() == at::kHalf && scale.size(0) == B && scale.size(1) == H &&
                  scale.size(2) == codes.size(2) && scale.size(3) == groups,
              "kivi_encode_into: scale must be float16 [B, H, N, ", groups, "]");
  const bool has_zero = bits != 0;
  if (has_zero) {
    TORCH_CHECK(zero.scalar_type() == at::kHalf && zero.sizes() == scale.sizes(),
                "kivi_encode_into: zero must be float16 like scale");
  }
  const int64_t N = codes.size(2);
  const bool by_slot = slots.has_value() && slots->defined();
  if (by_slot) {
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->dim() == 3 && slots->size(0) == B &&
                    slots->size(1) == H && slots->size(2) == T,
                "kivi_encode_into: slots must be int64 [B, H, T]");
  } else {
    TORCH_CHECK(start >= 0 && start + T <= N, "kivi_encode_into: rows ", start, "..", start + T - 1, " of ", N);
  }
  const at::Tensor xs = x.to(at::kFloat).contiguous();  // (float32 as coded; no copy for a float32 decode token)
  const at::Tensor sl = by_slot ? slots->contiguous() : at::Tensor();
  const float* xp = xs.data_ptr<float>();
  const int64_t* slp = by_slot ? sl.data_ptr<int64_t>() : nullptr;
  uint8_t* cp = codes.data_ptr<uint8_t>();
  at::Half* sp = scale.data_ptr<at::Half>();
  at::Half* zp = has_zero ? zero.data_ptr<at::Half>() : nullptr;
  const int64_t c0 = codes.stride(0), c1 = codes.stride(1), c2 = codes.stride(2);
  const int64_t s0 = scale.stride(0), s1 = scale.stride(1), s2 = scale.stride(2), s3 = scale.stride(3);
  const int64_t z0 = has_zero ? zero.stride(0) : 0, z1 = has_zero ? zero.stride(1) : 0,
                z2 = has_zero ? zero.stride(2) : 0, z3 = has_zero ? zero.stride(3) : 0;
  const bool guard = limit >= 0;
  const float lim = float(limit);
  const Coder coder{int(bits), float((1 << (bits == 0 ? 8 : bits)) - 1)};
  int64_t count = 0;
  std::vector<float> v(D);
  std::vector<uint8_t> q(D);
  for (int64_t u = 0; u < B * H * T; ++u) {  // (one token per row and head at a decode step: no threads)
    const int64_t b = u / (H * T), h = (u / T) % H, t = u % T;
    const int64_t row = by_slot ? slp[u] : start + t;
    TORCH_CHECK(row >= 0 && row < N, "kivi_encode_into: slot ", row, " outside 0..", N - 1);
    const float* xu = xp + u * D;
    for (int64_t c = 0; c < D; ++c) {
      const float val = xu[c];
      const bool ok = !guard || std::fabs(val) <= lim;  // (NaN fails)
      count += !ok;
      v[c] = ok ? val : 0.f;
    }
    for (int64_t k = 0; k < groups; ++k) {
      const float* xg = v.data() + k * group;
      float l, hi, a;
      group_range(xg, group, l, hi, a);
      at::Half s, z;
      coder.params(l, hi, a, s, z);
      sp[b * s0 + h * s1 + row * s2 + k * s3] = s;
      if (zp != nullptr) zp[b * z0 + h * z1 + row * z2 + k * z3] = z;
      const float sf = float(s), zf = zp != nullptr ? float(z) : 0.f;
      for (int64_t c = 0; c < group; ++c) q[k * group + c] = coder.code(xg[c], sf, zf);
    }
    pack(q.data(), D, int(bits), cp + b * c0 + h * c1 + row * c2);
  }
  // Written through raw pointers: the fields' version counters move as an in-place op's (an offloaded layer's
  // placement writes back a slot field whose counter moved; without this, a decode step's codes never reached disk).
  kvplus_cpu::mark_written(codes);
  kvplus_cpu::mark_written(scale);
  if (has_zero) kvplus_cpu::mark_written(zero);
  return count;
}

void check_bad(const at::Tensor& bad) {
  TORCH_CHECK(bad.scalar_type() == at::kLong && bad.numel() == 1 && bad.device().is_cpu(),
              "kivi_encode_into: bad must be one int64 on the CPU");
}

void kivi_encode_into_cpu(const at::Tensor& x, int64_t bits, int64_t group, double limit, at::Tensor codes,
                          at::Tensor scale, at::Tensor zero, int64_t start, const c10::optional<at::Tensor>& slots,
                          at::Tensor bad) {
  check_bad(bad);
  const int64_t count = encode_rows(x, bits, group, limit, codes, scale, zero, start, slots);
  if (count) *bad.data_ptr<int64_t>() += count;  // (in place, no operator call: one every layer and step)
}

// Keys and values (one format, per token) into their fields in one call: a decode step's token of an evicting cache.
void kivi_encode_kv_into_cpu(const at::Tensor& k, const at::Tensor& v, int64_t bits, int64_t group, double limit,
                             at::Tensor k_codes, at::Tensor k_scale, at::Tensor k_zero, at::Tensor v_codes,
                             at::Tensor v_scale, at::Tensor v_zero, int64_t start,
                             const c10::optional<at::Tensor>& slots, at::Tensor bad) {
  check_bad(bad);
  const int64_t count = encode_rows(k, bits, group, limit, k_codes, k_scale, k_zero, start, slots) +
                        encode_rows(v, bits, group, limit, v_codes, v_scale, v_zero, start, slots);
  if (count) *bad.data_ptr<int64_t>() += count;
}

}  // namespace kvplus_kivi_pack

TORCH_LIBRARY_FRAGMENT(hf_kvplus_cpu, m) {
  m.def("kivi_encode(Tensor x, int bits, int group, bool per_channel) -> (Tensor, Tensor, Tensor)");
  m.def(
      "kivi_encode_into(Tensor x, int bits, int group, float limit, Tensor(a!) codes, Tensor(b!) scale, "
      "Tensor(c!) zero, int start, Tensor? slots, Tensor(d!) bad) -> ()");
  m.def(
      "kivi_encode_kv_into(Tensor k, Tensor v, int bits, int group, float limit, Tensor(a!) k_codes, "
      "Tensor(b!) k_scale, Tensor(c!) k_zero, Tensor(d!) v_codes, Tensor(e!) v_scale, Tensor(f!) v_zero, int start, "
      "Tensor? slots, Tensor(g!) bad) -> ()");
}

TORCH_LIBRARY_IMPL(hf_kvplus_cpu, CPU, m) {
  m.impl("kivi_encode", &kvplus_kivi_pack::kivi_encode_cpu);
  m.impl("kivi_encode_into", &kvplus_kivi_pack::kivi_encode_into_cpu);
  m.impl("kivi_encode_kv_into", &kvplus_kivi_pack::kivi_encode_kv_into_cpu);
}
