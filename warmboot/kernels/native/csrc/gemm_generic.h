// The GEMM's panel kernel in plain C++, included once per instruction set under a
// `#pragma GCC target` (gemm.cpp): the compiler vectorises the 32-column loops with that
// set's registers. Weights are bf16 pairs (k even in the low half of each 32-bit lane),
// widened to fp32 by a shift or a mask.
#include <cstdint>
#include <cstring>

template <int MR>
static void panel_generic(const float* x, int64_t ldx, const uint32_t* w, int64_t k2,
                          float* acc) {
  float a[MR][32] = {};
  for (int64_t kp = 0; kp < k2; ++kp) {
    const uint32_t* lanes = w + kp * 32;
    float lo[32], hi[32];
    for (int c = 0; c < 32; ++c) {
      uint32_t l = lanes[c] << 16, h = lanes[c] & 0xffff0000u;
      std::memcpy(&lo[c], &l, 4);
      std::memcpy(&hi[c], &h, 4);
    }
    for (int r = 0; r < MR; ++r) {
      const float x0 = x[r * ldx + 2 * kp], x1 = x[r * ldx + 2 * kp + 1];
      for (int c = 0; c < 32; ++c) a[r][c] += x0 * lo[c] + x1 * hi[c];
    }
  }
  std::memcpy(acc, a, sizeof(a));
}

static void panels_generic(const float* x, int64_t m, int64_t ldx, const uint32_t* w,
                           int64_t k2, float* acc) {
  // acc: (m, 32) for this panel; rows in chunks of 4
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) panel_generic<4>(x + r * ldx, ldx, w, k2, acc + r * 32);
  for (; r < m; ++r) panel_generic<1>(x + r * ldx, ldx, w, k2, acc + r * 32);
}
