// A decode step's token written into a paged pool on the CPU: each row's key and value at one offset of the block its
// table names in one column, both pools in one call. Indexing a pool with the table's column in Python writes them in
// two index_put calls, each converting the index and building an iterator: several times this copy of a few hundred
// bytes, at every layer and step.
//
// paged_write: k_pool [blocks, Hkv, T, D], v_pool [blocks, Hkv, T, Dv] (unit last stride), keys [B, Hkv, 1, D] and
// values [B, Hkv, 1, Dv] of the pools' dtype (unit last stride), block_table int32 [B, columns]; writes row b's token
// at (block_table[b, column], :, offset).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace kvplus_paged {

void paged_write_cpu(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& keys,
                     const at::Tensor& values, const at::Tensor& block_table, int64_t column, int64_t offset) {
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && keys.size(2) == 1 &&
                  values.size(2) == 1,
              "paged_write_cpu: pools [blocks, Hkv, T, D] and one token's keys and values [B, Hkv, 1, D]");
  TORCH_CHECK(keys.scalar_type() == k_pool.scalar_type() && values.scalar_type() == v_pool.scalar_type(),
              "paged_write_cpu: keys and values must have their pools' dtype");
  TORCH_CHECK(k_pool.stride(3) == 1 && v_pool.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1,
              "paged_write_cpu: unit stride in the last dim");
  const int64_t B = keys.size(0), H = keys.size(1), blocks = k_pool.size(0);
  TORCH_CHECK(k_pool.size(1) == H && v_pool.size(1) == H && values.size(0) == B && values.size(1) == H &&
                  k_pool.size(3) == keys.size(3) && v_pool.size(3) == values.size(3) && v_pool.size(0) == blocks,
              "paged_write_cpu: keys ", keys.sizes(), " and values ", values.sizes(), " do not fit pools ",
              k_pool.sizes(), " and ", v_pool.sizes());
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt && block_table.size(0) == B &&
                  column >= 0 && column < block_table.size(1) && offset >= 0 && offset < k_pool.size(2) &&
                  offset < v_pool.size(2),
              "paged_write_cpu: column ", column, " and offset ", offset, " outside a table of ", block_table.sizes(),
              " over blocks of ", k_pool.size(2), " tokens");
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t ts0 = block_table.stride(0), ts1 = block_table.stride(1);
  const auto write = [&](const at::Tensor& pool, const at::Tensor& x) {
    const int64_t size = pool.element_size(), row = x.size(3) * size;
    char* p = static_cast<char*>(pool.data_ptr());
    const char* s = static_cast<const char*>(x.data_ptr());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t block = table[b * ts0 + column * ts1];
      TORCH_CHECK(block >= 0 && block < blocks, "paged_write_cpu: row ", b, " names block ", block, " of ", blocks);
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(p + (block * pool.stride(0) + h * pool.stride(1) + offset * pool.stride(2)) * size,
                    s + (b * x.stride(0) + h * x.stride(1)) * size, row);
    }
  };
  write(k_pool, keys);
  write(v_pool, values);
}

}  // namespace kvplus_paged

TORCH_LIBRARY_FRAGMENT(hf_kvplus_cpu, m) {
  m.def(
      "paged_write(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor keys, Tensor values, Tensor block_table, int column, "
      "int offset) -> ()");
}

TORCH_LIBRARY_IMPL(hf_kvplus_cpu, CPU, m) { m.impl("paged_write", &kvplus_paged::paged_write_cpu); }
