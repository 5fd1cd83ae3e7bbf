// A decode step's token written into a paged pool on the CPU, keys and values in one call: at `offset` of the block
// each row's table names in one column. Indexing the pools with the table's column in Python took two index_put calls,
// each converting the index and building an iterator: several times this copy of a few hundred bytes, at every layer
// and step.
//
// write_token: k_buf [blocks, Hkv, T, D], v_buf [blocks, Hkv, T, Dv] (unit last stride), keys [B, Hkv, 1, D] and
// values [B, Hkv, 1, Dv] of the pools' dtypes (unit last stride), block_table int32 [B, columns]; writes row b's token
// at (block_table[b, column], :, offset).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace kvplus_token {

void write_token_cpu(const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& keys, const at::Tensor& values,
                     const at::Tensor& block_table, int64_t column, int64_t offset) {
  TORCH_CHECK(k_buf.dim() == 4 && v_buf.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && keys.size(2) == 1 &&
                  values.size(2) == 1,
              "write_token_cpu: buffers [X, Hkv, T, D] and one token's keys and values [B, Hkv, 1, D]");
  TORCH_CHECK(keys.scalar_type() == k_buf.scalar_type() && values.scalar_type() == v_buf.scalar_type(),
              "write_token_cpu: keys and values must have their buffers' dtypes");
  TORCH_CHECK(k_buf.stride(3) == 1 && v_buf.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1,
              "write_token_cpu: unit stride in the last dim");
  const int64_t B = keys.size(0), H = keys.size(1), rows = k_buf.size(0);
  TORCH_CHECK(k_buf.size(1) == H && v_buf.size(1) == H && values.size(0) == B && values.size(1) == H &&
                  k_buf.size(3) == keys.size(3) && v_buf.size(3) == values.size(3) && v_buf.size(0) == rows &&
                  offset >= 0 && offset < k_buf.size(2) && offset < v_buf.size(2),
              "write_token_cpu: keys ", keys.sizes(), " and values ", values.sizes(), " at offset ", offset,
              " do not fit buffers ", k_buf.sizes(), " and ", v_buf.sizes());
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt && block_table.size(0) == B &&
                  column >= 0 && column < block_table.size(1),
              "write_token_cpu: column ", column, " outside a table of ", block_table.sizes());
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t ts0 = block_table.stride(0), ts1 = block_table.stride(1);
  const auto write = [&](const at::Tensor& buf, const at::Tensor& x) {
    const int64_t size = buf.element_size(), row = x.size(3) * size;
    char* p = static_cast<char*>(buf.data_ptr());
    const char* s = static_cast<const char*>(x.data_ptr());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t r = table[b * ts0 + column * ts1];
      TORCH_CHECK(r >= 0 && r < rows, "write_token_cpu: row ", b, " names block ", r, " of ", rows);
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(p + (r * buf.stride(0) + h * buf.stride(1) + offset * buf.stride(2)) * size,
                    s + (b * x.stride(0) + h * x.stride(1)) * size, row);
    }
  };
  write(k_buf, keys);
  write(v_buf, values);
  kvplus_cpu::mark_written(k_buf);  // (as an in-place op's: `mark_written` says why)
  kvplus_cpu::mark_written(v_buf);
}

}  // namespace kvplus_token

TORCH_LIBRARY_FRAGMENT(hf_kvplus_cpu, m) {
  m.def(
      "write_token(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor keys, Tensor values, Tensor block_table, int column, "
      "int offset) -> ()");
}

TORCH_LIBRARY_IMPL(hf_kvplus_cpu, CPU, m) { m.impl("write_token", &kvplus_token::write_token_cpu); }
