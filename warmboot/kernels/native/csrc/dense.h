// Row blocks of the prefill-sized GEMMs on torch's kernel (dense.cpp, gated.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

namespace warmboot {

// Blocks of at least kMinBlockRows, about kBlockRows where there are rows for 2-4 blocks:
// oneDNN's AMX GEMM on a 2-core Xeon (the model's shapes, one thread) ran 750 GFLOP/s on
// 128-row blocks, 1100 on 256 and 1350 on 512, so 128-row blocks lent the helper were no
// faster than one call alone. Set by the row count alone: a step lent the helper or not
// gives the same bits.
constexpr int64_t kMinBlockRows = 256, kBlockRows = 512, kMaxBlocks = 4;

inline int64_t dense_block_rows(int64_t m) {
  const int64_t blocks = std::clamp<int64_t>(m / kBlockRows, 2, kMaxBlocks);
  return ((m + blocks - 1) / blocks + 15) / 16 * 16;
}

}  // namespace warmboot
