// Quantize-and-pack of a rotated format on the CPU: rotated_format.quantize_rotated in one pass per vector. In a
// compiled decode step the twin's rotation, norms, codebook search, re-normalization and packing are a chain of
// scalar loops that inductor generates for a handful of vectors (an evicting cache codes the new token and
// re-codes its moved sinks at every step); here they are one external call per tensor (rotated_cpu.py says where
// this runs).
//
// One call: x [B, H, T, D] float32 (any strides), the rotation R [D, D] (or none: x comes rotated), the codebook's
// decision boundaries [2**bits - 1] and centroids [2**bits] float32, and the centre [H, D] float32 in x's space (or
// none). A vector v of head h is coded as v - centre[h] where that is no longer than v (its norm kept positive), else
// as v (its norm made negative, at least 2**-24 in magnitude: rotated_format.signed_norms); the coded vector is
// rotated, divided by its length, and each coordinate's code is the count of boundaries below it; with
// `renormalize` the norm is the length over the length of the codes' centroids (the decoded vector keeps the
// length). Codes of 8 coordinates make one word of 8 * bits bits, stored as `bits` little-endian bytes
// (rotated_format.pack_bits). Returns (codes uint8 [B, H, T, D * bits / 8], norms float16 [B, H, T, 1]).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {

// n a multiple of 8: eight running sums of squares, which the compiler turns into one vector.
inline float length_of(const float* x, int64_t n) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t i = 0; i < n; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += x[i + j] * x[i + j];
  return std::sqrt(((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7])));
}

// 8 codes to `bits` bytes of one little-endian word.
inline void pack8(const uint8_t* codes, int64_t bits, uint8_t* out) {
  uint64_t word = 0;
  for (int j = 0; j < 8; ++j) word |= uint64_t(codes[j]) << (j * bits);
  for (int64_t b = 0; b < bits; ++b) out[b] = uint8_t(word >> (8 * b));
}

// The smallest float16 magnitude of a plain code's norm (rotated_format.PLAIN_NORM).
constexpr float kPlainNorm = 5.9604644775390625e-08f;  // 2**-24

std::tuple<at::Tensor, at::Tensor> rotated_encode_cpu(const at::Tensor& x, const std::optional<at::Tensor>& rotation,
                                                      const at::Tensor& boundaries, const at::Tensor& centroids,
                                                      const std::optional<at::Tensor>& center, int64_t bits,
                                                      bool renormalize) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "rotated_encode_cpu: x must be float32 [B, H, T, D] on the CPU, got ", x.scalar_type(), " ", x.sizes());
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK(D % 8 == 0, "rotated_encode_cpu: the head dim must be a multiple of 8, got ", D);
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 3 || bits == 4 || bits == 8,
              "rotated_encode_cpu: bits must be 1, 2, 3, 4 or 8, got ", bits);
  const int64_t levels = int64_t(1) << bits;
  TORCH_CHECK(boundaries.numel() == levels - 1 && centroids.numel() == levels &&
                  boundaries.scalar_type() == at::kFloat && centroids.scalar_type() == at::kFloat,
              "rotated_encode_cpu: ", bits, "-bit codes need ", levels - 1, " boundaries and ", levels,
              " centroids (float32), got ", boundaries.numel(), " and ", centroids.numel());
  if (rotation)
    TORCH_CHECK(rotation->dim() == 2 && rotation->size(0) == D && rotation->size(1) == D &&
                    rotation->scalar_type() == at::kFloat,
                "rotated_encode_cpu: the rotation must be float32 [", D, ", ", D, "], got ", rotation->sizes());
  // One centre per head [H, D], or one per head and token [H, T, D] (a turning centre at each token's position).
  if (center)
    TORCH_CHECK(((center->dim() == 2 && center->size(0) == H) ||
                 (center->dim() == 3 && center->size(0) == H && center->size(1) == T)) &&
                    center->size(-1) == D && center->scalar_type() == at::kFloat,
                "rotated_encode_cpu: the centre must be float32 [", H, ", ", D, "] or [", H, ", ", T, ", ", D,
                "], got ", center->sizes());
  const bool per_token = center && center->dim() == 3;
  const at::Tensor xc = x.contiguous(), bc = boundaries.contiguous(), cc = centroids.contiguous();
  const at::Tensor rc = rotation ? rotation->contiguous() : at::Tensor();
  const at::Tensor mc = center ? center->contiguous() : at::Tensor();
  const int64_t P = D * bits / 8;
  at::Tensor codes = at::empty({B, H, T, P}, x.options().dtype(at::kByte));
  at::Tensor norms = at::empty({B, H, T, 1}, x.options().dtype(at::kHalf));
  const float* xp = xc.data_ptr<float>();
  const float* bp = bc.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* rp = rotation ? rc.data_ptr<float>() : nullptr;
  const float* mp = center ? mc.data_ptr<float>() : nullptr;
  uint8_t* op = codes.data_ptr<uint8_t>();
  at::Half* np = norms.data_ptr<at::Half>();
  at::parallel_for(0, B * H * T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> shifted(D), turned(D);
    std::vector<uint8_t> code(D);
    for (int64_t i = begin; i < end; ++i) {
      const float* v = xp + i * D;
      float length = length_of(v, D);
      bool plain = false;
      if (mp) {
        const float* mu = mp + (per_token ? ((i / T) % H) * T + i % T : (i / T) % H) * D;
        for (int64_t d = 0; d < D; ++d) shifted[d] = v[d] - mu[d];
        const float shifted_length = length_of(shifted.data(), D);
        if (shifted_length <= length) {
          v = shifted.data();
          length = shifted_length;
        } else {
          plain = true;
        }
      }
      if (rp) {  // turned = v R, a row of R at a time (multiply-adds over contiguous channels)
        float* __restrict t = turned.data();
        std::fill(t, t + D, 0.f);
        for (int64_t k = 0; k < D; ++k) {
          const float a = v[k];
          const float* __restrict row = rp + k * D;
          for (int64_t j = 0; j < D; ++j) t[j] += a * row[j];
        }
        v = t;
      }
      const float divisor = std::max(length, 1e-30f);
      float decoded = 0.f;  // squared length of the codes' centroids
      for (int64_t d = 0; d < D; ++d) {
        const float unit = v[d] / divisor;
        int64_t c = 0;  // boundaries below `unit`: counted (up to 15), else searched (255)
        if (levels <= 16) {
          for (int64_t j = 0; j < levels - 1; ++j) c += bp[j] < unit;
        } else {
          c = std::lower_bound(bp, bp + levels - 1, unit) - bp;
        }
        code[d] = uint8_t(c);
        decoded += cp[c] * cp[c];
      }
      float norm = renormalize ? length / std::max(std::sqrt(decoded), 1e-30f) : length;
      at::Half half(norm);
      if (plain) half = at::Half(-std::max(float(half), kPlainNorm));
      np[i] = half;
      uint8_t* out = op + i * P;
      if (bits == 8) {
        std::copy(code.begin(), code.end(), out);
      } else {
        for (int64_t g = 0; g < D / 8; ++g) pack8(code.data() + 8 * g, bits, out + g * bits);
      }
    }
  });
  return {codes, norms};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_kvplus_cpu, m) {
  m.def(
      "rotated_encode(Tensor x, Tensor? rotation, Tensor boundaries, Tensor centroids, Tensor? center, int bits, "
      "bool renormalize) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_kvplus_cpu, CPU, m) { m.impl("rotated_encode", &rotated_encode_cpu); }
