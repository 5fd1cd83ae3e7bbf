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
//
// rotated_encode_into: the same coding of x [B, H, T, D] float32 written straight into `codes` [B, H, N, D * bits / 8]
// (unit last stride) and `norms` [B, H, N, 1] float16 (any strides: a storage's fields) at rows `slots` [B, H, T]
// int64 (undefined: rows start .. start + T - 1), bit for bit rotated_encode's. With `limit` >= 0 a vector whose length
// exceeds it (NaN and inf included) is coded as the zero vector and counted into `bad` (a 0-d int64 tensor):
// storage/value_range.RangeGuard's rule for norm-coded formats, folded in. What an evicting cache's decode step runs
// per layer and side in one call, where guarding, coding and copying into the slots took a dozen tensor operations.
// rotated_encode_kv_into: a token's key (relative to the centre) and value (none), each side its codebook and bits,
// at the same rows and one `bad` for both, in one call (an operator call costs more than its compute).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <vector>

namespace kvplus_rotated_pack {

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

// What both operators check and read: the rotation, codebook and centre of one call, and the coding of one vector.
struct Coder {
  int64_t H, T, D, bits, levels, P;
  bool per_token, renormalize;
  at::Tensor bc, cc, rc, mc;  // contiguous copies (kept alive while the pointers are read)
  const float *bp, *cp, *rp, *mp;

  Coder(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& rotation, const at::Tensor& boundaries,
        const at::Tensor& centroids, const std::optional<at::Tensor>& center, int64_t bits_, bool renormalize_)
      : bits(bits_), renormalize(renormalize_) {
    TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat && x.device().is_cpu(), op,
                ": x must be float32 [B, H, T, D] on the CPU, got ", x.scalar_type(), " ", x.sizes());
    H = x.size(1), T = x.size(2), D = x.size(3);
    TORCH_CHECK(D % 8 == 0, op, ": the head dim must be a multiple of 8, got ", D);
    TORCH_CHECK(bits == 1 || bits == 2 || bits == 3 || bits == 4 || bits == 8, op,
                ": bits must be 1, 2, 3, 4 or 8, got ", bits);
    levels = int64_t(1) << bits;
    P = D * bits / 8;
    TORCH_CHECK(boundaries.numel() == levels - 1 && centroids.numel() == levels &&
                    boundaries.scalar_type() == at::kFloat && centroids.scalar_type() == at::kFloat,
                op, ": ", bits, "-bit codes need ", levels - 1, " boundaries and ", levels,
                " centroids (float32), got ", boundaries.numel(), " and ", centroids.numel());
    if (rotation)
      TORCH_CHECK(rotation->dim() == 2 && rotation->size(0) == D && rotation->size(1) == D &&
                      rotation->scalar_type() == at::kFloat,
                  op, ": the rotation must be float32 [", D, ", ", D, "], got ", rotation->sizes());
    // One centre per head [H, D], or one per head and token [H, T, D] (a turning centre at each token's position).
    if (center)
      TORCH_CHECK(((center->dim() == 2 && center->size(0) == H) ||
                   (center->dim() == 3 && center->size(0) == H && center->size(1) == T)) &&
                      center->size(-1) == D && center->scalar_type() == at::kFloat,
                  op, ": the centre must be float32 [", H, ", ", D, "] or [", H, ", ", T, ", ", D, "], got ",
                  center->sizes());
    per_token = center && center->dim() == 3;
    bc = boundaries.contiguous(), cc = centroids.contiguous();
    rc = rotation ? rotation->contiguous() : at::Tensor();
    mc = center ? center->contiguous() : at::Tensor();
    bp = bc.data_ptr<float>(), cp = cc.data_ptr<float>();
    rp = rotation ? rc.data_ptr<float>() : nullptr;
    mp = center ? mc.data_ptr<float>() : nullptr;
  }

  // Vector i (of B * H * T, in x's order) coded into `out` (P bytes); returns its float16 norm. `shifted`, `turned`
  // and `code`: D entries of scratch each.
  at::Half code(int64_t i, const float* v, uint8_t* out, float* shifted, float* turned, uint8_t* code) const {
    float length = length_of(v, D);
    bool plain = false;
    if (mp) {
      const float* mu = mp + (per_token ? ((i / T) % H) * T + i % T : (i / T) % H) * D;
      for (int64_t d = 0; d < D; ++d) shifted[d] = v[d] - mu[d];
      const float shifted_length = length_of(shifted, D);
      if (shifted_length <= length) {
        v = shifted;
        length = shifted_length;
      } else {
        plain = true;
      }
    }
    if (rp) {  // turned = v R, a row of R at a time (multiply-adds over contiguous channels)
      float* __restrict t = turned;
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
    if (bits == 8) {
      std::copy(code, code + D, out);
    } else {
      for (int64_t g = 0; g < D / 8; ++g) pack8(code + 8 * g, bits, out + g * bits);
    }
    return half;
  }
};

std::tuple<at::Tensor, at::Tensor> rotated_encode_cpu(const at::Tensor& x, const std::optional<at::Tensor>& rotation,
                                                      const at::Tensor& boundaries, const at::Tensor& centroids,
                                                      const std::optional<at::Tensor>& center, int64_t bits,
                                                      bool renormalize) {
  const Coder coder("rotated_encode_cpu", x, rotation, boundaries, centroids, center, bits, renormalize);
  const int64_t B = x.size(0), H = coder.H, T = coder.T, D = coder.D, P = coder.P;
  const at::Tensor xc = x.contiguous();
  at::Tensor codes = at::empty({B, H, T, P}, x.options().dtype(at::kByte));
  at::Tensor norms = at::empty({B, H, T, 1}, x.options().dtype(at::kHalf));
  const float* xp = xc.data_ptr<float>();
  uint8_t* op = codes.data_ptr<uint8_t>();
  at::Half* np = norms.data_ptr<at::Half>();
  at::parallel_for(0, B * H * T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> shifted(D), turned(D);
    std::vector<uint8_t> code(D);
    for (int64_t i = begin; i < end; ++i)
      np[i] = coder.code(i, xp + i * D, op + i * P, shifted.data(), turned.data(), code.data());
  });
  return {codes, norms};
}

// The coding of rotated_encode_into into one side's fields; returns how many vectors the guard zeroed.
int64_t encode_rows(const at::Tensor& x, const std::optional<at::Tensor>& rotation, const at::Tensor& boundaries,
                    const at::Tensor& centroids, const std::optional<at::Tensor>& center, int64_t bits,
                    bool renormalize, double limit, const at::Tensor& codes, const at::Tensor& norms, int64_t start,
                    const std::optional<at::Tensor>& slots) {
  const Coder coder("rotated_encode_into", x, rotation, boundaries, centroids, center, bits, renormalize);
  const int64_t B = x.size(0), H = coder.H, T = coder.T, D = coder.D, P = coder.P;
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.size(0) == B && codes.size(1) == H &&
                  codes.size(3) == P && codes.stride(3) == 1,
              "rotated_encode_into: codes must be uint8 [", B, ", ", H, ", N, ", P, "] with unit last stride, got ",
              codes.scalar_type(), " ", codes.sizes());
  const int64_t N = codes.size(2);
  TORCH_CHECK(norms.dim() == 4 && norms.scalar_type() == at::kHalf && norms.size(0) == B && norms.size(1) == H &&
                  norms.size(2) == N && norms.size(3) == 1,
              "rotated_encode_into: norms must be float16 [", B, ", ", H, ", ", N, ", 1], got ", norms.scalar_type(),
              " ", norms.sizes());
  const bool by_slot = slots.has_value() && slots->defined();
  at::Tensor sl;
  if (by_slot) {
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->dim() == 3 && slots->size(0) == B &&
                    slots->size(1) == H && slots->size(2) == T,
                "rotated_encode_into: slots must be int64 [", B, ", ", H, ", ", T, "], got ", slots->sizes());
    sl = slots->contiguous();
    const int64_t* s = sl.data_ptr<int64_t>();
    for (int64_t u = 0; u < B * H * T; ++u)
      TORCH_CHECK(s[u] >= 0 && s[u] < N, "rotated_encode_into: slot ", s[u], " outside 0..", N - 1);
  } else {
    TORCH_CHECK(start >= 0 && start + T <= N, "rotated_encode_into: rows ", start, "..", start + T - 1, " of ", N);
  }
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t* slp = by_slot ? sl.data_ptr<int64_t>() : nullptr;
  uint8_t* cp = codes.data_ptr<uint8_t>();
  at::Half* np = norms.data_ptr<at::Half>();
  const int64_t c0 = codes.stride(0), c1 = codes.stride(1), c2 = codes.stride(2);
  const int64_t n0 = norms.stride(0), n1 = norms.stride(1), n2 = norms.stride(2);
  const bool guard = limit >= 0;
  const float lim = float(limit);
  std::atomic<int64_t> count{0};
  at::parallel_for(0, B * H * T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> zeros(D, 0.f), shifted(D), turned(D);
    std::vector<uint8_t> code(D);
    int64_t refused = 0;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (H * T), h = (i / T) % H, t = i % T;
      const int64_t row = by_slot ? slp[i] : start + t;
      const float* v = xp + i * D;
      if (guard && !(length_of(v, D) <= lim)) {  // (NaN and inf fail): coded as the zero vector
        v = zeros.data();
        ++refused;
      }
      np[b * n0 + h * n1 + row * n2] =
          coder.code(i, v, cp + b * c0 + h * c1 + row * c2, shifted.data(), turned.data(), code.data());
    }
    count += refused;
  });
  // Written through raw pointers: the version counters move as an in-place op's (`kivi_pack_cpu.cpp`'s encode_rows).
  kvplus_cpu::mark_written(codes);
  kvplus_cpu::mark_written(norms);
  return guard ? count.load() : 0;
}

void check_bad(const at::Tensor& bad) {
  TORCH_CHECK(bad.scalar_type() == at::kLong && bad.numel() == 1 && bad.device().is_cpu(),
              "rotated_encode_into: bad must be one int64 on the CPU");
}

void rotated_encode_into_cpu(const at::Tensor& x, const std::optional<at::Tensor>& rotation,
                             const at::Tensor& boundaries, const at::Tensor& centroids,
                             const std::optional<at::Tensor>& center, int64_t bits, bool renormalize, double limit,
                             at::Tensor codes, at::Tensor norms, int64_t start, const std::optional<at::Tensor>& slots,
                             at::Tensor bad) {
  check_bad(bad);
  const int64_t count =
      encode_rows(x, rotation, boundaries, centroids, center, bits, renormalize, limit, codes, norms, start, slots);
  if (count) *bad.data_ptr<int64_t>() += count;  // (in place, no operator call)
}

// A token's key (with the centre) and value, each side with its own codebook and bits, at the same rows in one call.
void rotated_encode_kv_into_cpu(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& k_rotation,
                                const at::Tensor& k_boundaries, const at::Tensor& k_centroids,
                                const std::optional<at::Tensor>& center, int64_t k_bits,
                                const std::optional<at::Tensor>& v_rotation, const at::Tensor& v_boundaries,
                                const at::Tensor& v_centroids, int64_t v_bits,
                                bool renormalize, double limit, at::Tensor k_codes, at::Tensor k_norms,
                                at::Tensor v_codes, at::Tensor v_norms, int64_t start,
                                const std::optional<at::Tensor>& slots, at::Tensor bad) {
  check_bad(bad);
  const int64_t count = encode_rows(k, k_rotation, k_boundaries, k_centroids, center, k_bits, renormalize, limit,
                                    k_codes, k_norms, start, slots) +
                        encode_rows(v, v_rotation, v_boundaries, v_centroids, std::nullopt, v_bits, renormalize, limit,
                                    v_codes, v_norms, start, slots);
  if (count) *bad.data_ptr<int64_t>() += count;
}

}  // namespace kvplus_rotated_pack

TORCH_LIBRARY_FRAGMENT(hf_kvplus_cpu, m) {
  m.def(
      "rotated_encode(Tensor x, Tensor? rotation, Tensor boundaries, Tensor centroids, Tensor? center, int bits, "
      "bool renormalize) -> (Tensor, Tensor)");
  m.def(
      "rotated_encode_into(Tensor x, Tensor? rotation, Tensor boundaries, Tensor centroids, Tensor? center, int bits, "
      "bool renormalize, float limit, Tensor(a!) codes, Tensor(b!) norms, int start, Tensor? slots, Tensor(c!) bad) "
      "-> ()");
  m.def(
      "rotated_encode_kv_into(Tensor k, Tensor v, Tensor? k_rotation, Tensor k_boundaries, Tensor k_centroids, "
      "Tensor? center, int k_bits, Tensor? v_rotation, Tensor v_boundaries, Tensor v_centroids, int v_bits, "
      "bool renormalize, float limit, "
      "Tensor(a!) k_codes, Tensor(b!) k_norms, Tensor(c!) v_codes, Tensor(d!) v_norms, int start, Tensor? slots, "
      "Tensor(e!) bad) -> ()");
}

TORCH_LIBRARY_IMPL(hf_kvplus_cpu, CPU, m) {
  m.impl("rotated_encode", &kvplus_rotated_pack::rotated_encode_cpu);
  m.impl("rotated_encode_into", &kvplus_rotated_pack::rotated_encode_into_cpu);
  m.impl("rotated_encode_kv_into", &kvplus_rotated_pack::rotated_encode_kv_into_cpu);
}
