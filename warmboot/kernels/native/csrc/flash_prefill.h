// Flash attention for prefills on AMX tiles (flash_prefill.cpp), behind the ops of
// causal_prefill.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace warmboot {

// Where a sequence's K (or V) rows of one KV head lie: position p's at base + p * ld, or in a
// paged cache at base + (table[p / bs] * bs + p % bs) * ld.
struct Rows {
  const uint16_t* base;
  int64_t ld;
  const int64_t* table = nullptr;
  int64_t bs = 1;
  const uint16_t* operator()(int64_t p) const {
    return base + (table ? table[p / bs] * bs + p % bs : p) * ld;
  }
};

// A sequence of a call: n query rows from q's row `start`, its last n positions of ctx.
struct FlashSeq {
  int64_t start, n, ctx;
};

struct FlashOpts {
  double scale;
  int64_t window = 0;            // positions a row sees, its own included (0: all before it)
  const float* sinks = nullptr;  // per query head: a logit in each row's softmax, no value
  float softcap = 0;             // scores become softcap tanh(score / softcap) (0: as they are)
  int64_t chunk = 0;             // a row at p sees only p - p % chunk .. p too (0: no chunks)
};

// A bf16 tensor's data as raw 16-bit values.
inline const uint16_t* bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

// (sequence, KV head, V rather than K) -> its rows
using RowsOf = std::function<Rows(int64_t, int64_t, bool)>;

// Whether the kernel takes q and out (N, Hq, D): bf16, each token's heads contiguous, head_dim
// a multiple of 32 up to 256, AMX tiles usable (amx_ready).
bool flash_fits(const at::Tensor& q, const at::Tensor& out);

// Causal attention of every sequence's query rows into the same rows of out (Hq / hkv query
// heads a KV head). Only where flash_fits.
void flash_amx(const at::Tensor& q, const at::Tensor& out, const std::vector<FlashSeq>& seqs,
               int64_t hkv, const FlashOpts& opts, const RowsOf& rows_of);

}  // namespace warmboot
