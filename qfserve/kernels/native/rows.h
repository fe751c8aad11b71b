// Where the rows of an MLX array of any strides start, for the kernels that walk rows.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

namespace qfserve {

// Element offset of each row (all but the last dimension), in row-major order.
inline std::vector<int64_t> row_starts(const mlx::core::array& a) {
  const int nd = a.ndim();
  const int64_t rows = a.size() / a.shape(nd - 1);
  std::vector<int64_t> out(rows);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t rem = r, off = 0;
    for (int d = nd - 2; d >= 0; --d) {
      off += (rem % a.shape(d)) * a.strides()[d];
      rem /= a.shape(d);
    }
    out[r] = off;
  }
  return out;
}

}  // namespace qfserve
