// Paged attention over the KV cache in place, no gather and no copy of K/V: decode (one query
// token per sequence) and extend (a prefill chunk of one sequence, causal).
//
// A work item is a task (a sequence's decode token, or up to kChunk tokens of a chunk) with all
// its KV heads, or a share of them where tasks are fewer than threads. It walks the context in
// tiles of up to kTile positions; per tile and KV head: the scores of the head's query rows (its
// query heads times the tokens), an online softmax step (running max m and denominator l; the
// accumulator rescaled by exp(m_old - m_new)), then the probabilities times the V rows; fp32
// throughout. Sinks start a row at m = sink, l = 1. Fewer items than threads with a long context
// (batch 1) also split the context and merge the partial softmaxes (flash-decoding).
//
// Memory: a position's K rows of all KV heads lie side by side in its cache block (its V rows
// too), so an item reads its blocks whole. While a tile is computed, the next one's rows (in
// the last tile, the next item's first) are prefetched into L2, a row per position computed.
//
// Kernels: AVX-512 intrinsics, else the same steps in plain C++: this file's #else half,
// included into itself once for AVX2+FMA, once portable. AVX-512 scores: up to 4 query rows per
// K row read (bf16 pairs by dpbf16 where the CPU has AVX512_BF16), each row's partial sums of 16
// positions reduced to one vector by a transposing tree of shuffles, in registers (head_dim 64
// and 128 unrolled). Accumulation: up to 8 rows per V row read, bf16 widened as its even and odd
// elements (a shift and a mask), so an accumulator holds each 32 values in that order until
// it is written out.
#ifndef WB_PA_GENERIC
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "pool.h"

namespace warmboot {
namespace {

constexpr int kTile = 32;        // context positions per softmax step
constexpr int64_t kChunk = 16;   // extend: query tokens per work item
constexpr int64_t kSplit = 512;  // fewest positions per context split
constexpr float kInf = std::numeric_limits<float>::infinity();
static_assert(kTile % 16 == 0 && kTile <= 64, "a tile's scores: whole vectors, a 64-bit mask");

// One instruction set's tile kernels. A tile: n <= kTile positions, position t's K (V) row at
// k[t] + off (v[t] + off). Query rows and accumulators are `dp` floats apart (head_dim rounded
// up to 32); s and p: kTile floats per row.
template <typename T>
struct Kernels {
  // a query row of d values into the form `scores` reads (zero-padded, dp floats of room)
  void (*prepare)(const T* src, int d, int dp, float* q);
  // s[r][t] = scale * q[r] . k[t]; meanwhile the rows ahead[t] + off, t < na, into L2
  void (*scores)(const float* q, int rows, int dp, const T* const* k, int64_t off, int n, int d,
                 float scale, float* s, const T* const* ahead, int na);
  // scores -> probabilities for the row's positions [lo, hi) of the tile (0 elsewhere),
  // updating m and l; alpha: the factor the row's accumulator takes first
  void (*softmax)(float* s, int rows, int n, const int* lo, const int* hi, float cap, float* m,
                  float* l, float* alpha);
  // acc[r] = alpha[r] * acc[r] + sum_t p[r][t] * v[t]; ahead, na: as for scores
  void (*accum)(float* acc, int rows, int dp, const float* alpha, const float* p,
                const T* const* v, int64_t off, int n, int d, const T* const* ahead, int na);
  // dst[c] = inv * acc[c], c < d, in T (acc: an accumulator row)
  void (*write)(const float* acc, int d, float inv, T* dst);
};

// A row of d values into L2. NOTE: not into L1: measured on Zen 4, L1 prefetches of the next
// tile were slower than none (they hold up the loads behind them); L2 ones spread over the
// compute keep DRAM busy.
template <typename T>
inline void fetch(const T* row, int d) {
  const auto last = reinterpret_cast<uintptr_t>(row + d) - 1;
  for (auto a = reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63); a <= last; a += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 2);
}

template <typename T>
void prepare(const T* src, int d, int dp, float* q) {  // fp32
  for (int c = 0; c < d; ++c) q[c] = static_cast<float>(src[c]);
  std::fill(q + d, q + dp, 0.f);
}

template <typename T>
void write(const float* acc, int d, float inv, T* dst) {  // acc in head_dim order
  for (int c = 0; c < d; ++c) dst[c] = static_cast<T>(acc[c] * inv);
}

#define WB_PA_GENERIC
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "paged_attention.cpp"  // NOTE: this file again: its #else half
#pragma GCC pop_options
}  // namespace avx2
namespace portable {
#include "paged_attention.cpp"
}  // namespace portable
#undef WB_PA_GENERIC

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")
#define WB_INLINE inline __attribute__((always_inline))

inline __mmask16 lanes(int n) { return n >= 16 ? 0xffff : n > 0 ? (1u << n) - 1 : 0; }
inline __mmask32 lanes32(int n) { return n >= 32 ? ~0u : n > 0 ? (1u << n) - 1 : 0; }

// 16 values (16-bit), the first `left` of them (the rest 0)
WB_INLINE __m256i load16(const void* p, int left) {
  return left >= 16 ? _mm256_loadu_si256(static_cast<const __m256i*>(p))
                    : _mm256_maskz_loadu_epi16(lanes(left), p);
}
// 16 values widened to fp32, the first `left` of them (the rest 0)
WB_INLINE __m512 load(const float* p, int left) {
  return left >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(lanes(left), p);
}
WB_INLINE __m512 load(const c10::BFloat16* p, int left) {  // bf16 -> fp32: a 16-bit shift
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load16(p, left)), 16));
}
WB_INLINE __m512 load(const c10::Half* p, int left) { return _mm512_cvtph_ps(load16(p, left)); }

// 32 values widened to fp32 as two vectors, the accumulator's order: bf16 as its even and odd
// elements (no shuffle), the others in order. Full: all 32.
template <bool Full, typename T>
WB_INLINE void load2(const T* p, int left, __m512& a, __m512& b) {
  a = load(p, Full ? 16 : left), b = load(p + 16, Full ? 16 : left - 16);
}
template <bool Full>
WB_INLINE void load2(const c10::BFloat16* p, int left, __m512& a, __m512& b) {
  const __m512i x = Full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(lanes32(left), p);
  a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int(0xffff0000u))));
}

// 16 values into T (the first `left` of them), rounded to nearest even as c10's conversions
inline void put(float* p, __m512 x, int left) { _mm512_mask_storeu_ps(p, lanes(left), x); }
inline void put(c10::Half* p, __m512 x, int left) {
  _mm256_mask_storeu_epi16(p, lanes(left), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
inline void put(c10::BFloat16* p, __m512 x, int left) {  // NaN: 0x7fc0
  const __m512i u = _mm512_castps_si512(x), one = _mm512_set1_epi32(1);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(p, lanes(left), _mm512_cvtepi32_epi16(r));
}

template <typename T>
void write(const float* acc, int d, float inv, T* dst) {  // acc in head_dim order
  const __m512 f = _mm512_set1_ps(inv);
  for (int c = 0; c < d; c += 16) put(dst + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c), f), d - c);
}

// bf16: each 32 values as their even and odd halves (load2), interleaved back
void write_pairs(const float* acc, int d, float inv, c10::BFloat16* dst) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  const __m512 f = _mm512_set1_ps(inv);
  for (int c = 0; c < d; c += 32) {
    const __m512 e = _mm512_loadu_ps(acc + c), o = _mm512_loadu_ps(acc + c + 16);
    put(dst + c, _mm512_mul_ps(_mm512_permutex2var_ps(e, lo, o), f), d - c);
    put(dst + c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(e, hi, o), f), d - c - 16);
  }
}

inline __m512 exp(__m512 x) {  // Cephes expf: x = n ln2 + r, |r| <= ln2 / 2; NaN stays NaN
  x = _mm512_min_ps(_mm512_set1_ps(88.5f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), 0);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 tanh(__m512 x) {  // Cephes tanhf: odd polynomial below 0.625, else via exp
  const __m512 a = _mm512_abs_ps(x), z = _mm512_mul_ps(x, x), one = _mm512_set1_ps(1.f);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  for (float c : {2.06390887954e-2f, -5.37397155531e-2f, 1.33314422036e-1f, -3.33332819422e-1f})
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(c));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
  const __m512 e = exp(_mm512_add_ps(a, a));  // 1 - 2 / (e^2|x| + 1), with x's sign
  __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  const __m512 zero = _mm512_setzero_ps();
  big = _mm512_mask_sub_ps(big, _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), zero, big);
  const __mmask16 near0 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(near0, big, small);
}

// A K row against NG query rows (ldq apart): per row a vector of partial sums, S values a
// step. C > 0: d is 32 C (unrolled); C = 0: any d (a loop, the last step masked).
template <int S, int C, typename Dot, int NG, typename Q, typename T>
WB_INLINE void dot(__m512 (&a)[NG], const Q* q, int ldq, const T* k, int d) {
  for (int j = 0; j < NG; ++j) a[j] = _mm512_setzero_ps();
  if constexpr (C > 0) {
    for (int c = 0; c < 32 * C; c += S) Dot::step(a, q, ldq, k, c, S);
  } else {
    int c = 0;
#pragma GCC unroll 1
    for (; c + S <= d; c += S) Dot::step(a, q, ldq, k, c, S);
    if (c < d) Dot::step(a, q, ldq, k, c, d - c);
  }
}

template <typename T>
struct Fma {  // fp32 query rows times the widened K row
  template <int NG>
  WB_INLINE static void step(__m512 (&a)[NG], const float* q, int ldq, const T* k, int c,
                             int left) {
    const __m512 kv = load(k + c, left);
    for (int j = 0; j < NG; ++j) a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * ldq + c), kv, a[j]);
  }
  template <int NG, int C>
  WB_INLINE void run(__m512 (&a)[NG], const float* q, int ldq, const T* k, int d) const {
    dot<16, C, Fma>(a, q, ldq, k, d);
  }
};

struct Dpbf16 {  // bf16 query rows times the bf16 K row, in pairs
  template <int NG>
  WB_INLINE static void step(__m512 (&a)[NG], const uint16_t* q, int ldq,
                             const c10::BFloat16* k, int c, int left) {
    const __m512i kv = left >= 32 ? _mm512_loadu_si512(k + c)
                                  : _mm512_maskz_loadu_epi16(lanes32(left), k + c);
    for (int j = 0; j < NG; ++j) {
      const __m512i qv = _mm512_loadu_si512(q + j * ldq + c);
      a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)qv, (__m512bh)kv);
    }
  }
  template <int NG, int C>
  WB_INLINE void run(__m512 (&a)[NG], const uint16_t* q, int ldq, const c10::BFloat16* k,
                     int d) const {
    dot<32, C, Dpbf16>(a, q, ldq, k, d);
  }
};

// Vectors of partial sums over the positions [t, t + N/2) and [t + N/2, t + N), in one: the
// step of a horizontal sum taken across two vectors; at N = 16 lane i holds position t + i's sum.
template <int N>
WB_INLINE __m512 merge(__m512 a, __m512 b) {
  if constexpr (N == 2) return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  if constexpr (N == 4) {
    const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
}

// NG rows' dot products with the K rows of positions [t, t + N) (0 past n), reduced depth
// first: at most one pending vector per level and row stays in registers.
template <int N, int C, int NG, typename Q, typename T, typename Dot>
WB_INLINE void tree(__m512 (&out)[NG], const Q* q, int ldq, const T* const* k, int64_t off, int t,
                    int n, int d, Dot dot) {
  if (t >= n) {
    for (int j = 0; j < NG; ++j) out[j] = _mm512_setzero_ps();
  } else if constexpr (N == 1) {
    dot.template run<NG, C>(out, q, ldq, k[t] + off, d);
  } else {
    __m512 a[NG], b[NG];
    tree<N / 2, C>(a, q, ldq, k, off, t, n, d, dot);
    tree<N / 2, C>(b, q, ldq, k, off, t + N / 2, n, d, dot);
    for (int j = 0; j < NG; ++j) out[j] = merge<N>(a[j], b[j]);
  }
}

template <int N, int NG>
WB_INLINE void reduce(__m512 (&out)[NG], const __m512 (*part)[NG]) {  // the same from memory
  if constexpr (N == 1) {
    for (int j = 0; j < NG; ++j) out[j] = part[0][j];
  } else {
    __m512 a[NG], b[NG];
    reduce<N / 2>(a, part), reduce<N / 2>(b, part + N / 2);
    for (int j = 0; j < NG; ++j) out[j] = merge<N>(a[j], b[j]);
  }
}

// 16 positions at a time: C > 0 in registers (tree), C = 0 (any head_dim) through a buffer,
// its dot products in a loop (so not unrolled 16 times).
template <int NG, int C, typename Q, typename T, typename Dot>
void scores_block(const Q* q, int ldq, const T* const* k, int64_t off, int n, int d, float scale,
                  float* s, Dot dot, const T* const* ahead, int na) {
  for (int t = 0; t < n; t += 16) {
    __m512 x[NG];
    for (int i = t; i < std::min(na, t + 16); ++i) fetch(ahead[i] + off, d);
    if constexpr (C > 0) {
      tree<16, C>(x, q, ldq, k, off, t, n, d, dot);
    } else {
      __m512 part[16][NG];
      for (int i = 0; i < 16; ++i) {
        if (t + i < n) dot.template run<NG, 0>(part[i], q, ldq, k[t + i] + off, d);
        else
          for (int j = 0; j < NG; ++j) part[i][j] = _mm512_setzero_ps();
      }
      reduce<16>(x, part);
    }
    for (int j = 0; j < NG; ++j) {
      _mm512_storeu_ps(s + j * kTile + t, _mm512_mul_ps(x[j], _mm512_set1_ps(scale)));
    }
  }
}

// Register blocks of 4 rows, then the rest (the first block fetches ahead).
template <int C, typename Q, typename T, typename Dot>
void scores_rows(const Q* q, int ldq, int rows, const T* const* k, int64_t off, int n, int d,
                 float scale, float* s, Dot dot, const T* const* ahead, int na) {
  int r = 0;
  for (; r + 4 <= rows; r += 4, na = 0) {
    scores_block<4, C>(q + r * ldq, ldq, k, off, n, d, scale, s + r * kTile, dot, ahead, na);
  }
  q += r * ldq, s += r * kTile;
  if (rows - r == 3) scores_block<3, C>(q, ldq, k, off, n, d, scale, s, dot, ahead, na);
  if (rows - r == 2) scores_block<2, C>(q, ldq, k, off, n, d, scale, s, dot, ahead, na);
  if (rows - r == 1) scores_block<1, C>(q, ldq, k, off, n, d, scale, s, dot, ahead, na);
}

template <typename T>
void scores(const float* q, int rows, int dp, const T* const* k, int64_t off, int n, int d,
            float scale, float* s, const T* const* ahead, int na) {
  if (d == 64) return scores_rows<2>(q, dp, rows, k, off, n, d, scale, s, Fma<T>(), ahead, na);
  if (d == 128) return scores_rows<4>(q, dp, rows, k, off, n, d, scale, s, Fma<T>(), ahead, na);
  scores_rows<0>(q, dp, rows, k, off, n, d, scale, s, Fma<T>(), ahead, na);
}

// bf16 caches where the CPU has AVX512_BF16 (only then called): the query rows kept in bf16
// (exact: they were bf16), zero-padded to a multiple of 32 values.
void prepare_dot(const c10::BFloat16* src, int d, int dp, float* q) {
  auto* b = reinterpret_cast<uint16_t*>(q);
  std::memcpy(b, src, sizeof(uint16_t) * d);
  std::fill(b + d, b + 2 * dp, uint16_t(0));
}

void scores_dot(const float* q, int rows, int dp, const c10::BFloat16* const* k, int64_t off,
                int n, int d, float scale, float* s, const c10::BFloat16* const* ahead, int na) {
  const auto* qb = reinterpret_cast<const uint16_t*>(q);
  const int ld = 2 * dp;
  if (d == 64) return scores_rows<2>(qb, ld, rows, k, off, n, d, scale, s, Dpbf16(), ahead, na);
  if (d == 128) return scores_rows<4>(qb, ld, rows, k, off, n, d, scale, s, Dpbf16(), ahead, na);
  scores_rows<0>(qb, ld, rows, k, off, n, d, scale, s, Dpbf16(), ahead, na);
}

// Position t's V row (32 C values from v[t] + off) times its NG probabilities into b.
template <int NG, int C, bool Full, typename T>
WB_INLINE void accum_step(__m512 (&b)[NG][2 * C], const float* p, const T* const* v, int64_t off,
                          int t, int left) {
  __m512 x[2 * C];
  for (int c = 0; c < C; ++c) {
    load2<Full>(v[t] + off + 32 * c, left - 32 * c, x[2 * c], x[2 * c + 1]);
  }
  for (int j = 0; j < NG; ++j) {
    const __m512 w = _mm512_set1_ps(p[j * kTile + t]);
    for (int i = 0; i < 2 * C; ++i) b[j][i] = _mm512_fmadd_ps(w, x[i], b[j][i]);
  }
}

// NG accumulator rows times 32 C values (`left` of them valid unless Full): the tile's
// positions in one pass, each V row widened once; U positions in flight (the FMA latency).
template <int NG, int C, bool Full, typename T>
WB_INLINE void accum_pass(float* acc, int dp, const float* alpha, const float* p,
                          const T* const* v, int64_t off, int n, int left,
                          const T* const* ahead, int64_t aoff, int na, int d) {
  constexpr int U = NG * C == 1 ? 2 : 1, W = 2 * C;
  __m512 a[U][NG][W];
  for (int j = 0; j < NG; ++j) {
    for (int i = 0; i < W; ++i) {
      a[0][j][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * dp + 16 * i), _mm512_set1_ps(alpha[j]));
      for (int u = 1; u < U; ++u) a[u][j][i] = _mm512_setzero_ps();
    }
  }
  int t = 0;
  for (; t + U <= n; t += U) {
    for (int u = 0; u < U; ++u) {
      if (t + u < na) fetch(ahead[t + u] + aoff, d);
      accum_step<NG, C, Full>(a[u], p, v, off, t + u, left);
    }
  }
  for (; t < n; ++t) {
    if (t < na) fetch(ahead[t] + aoff, d);
    accum_step<NG, C, Full>(a[0], p, v, off, t, left);
  }
  for (int j = 0; j < NG; ++j) {
    for (int i = 0; i < W; ++i) {
      for (int u = 1; u < U; ++u) a[0][j][i] = _mm512_add_ps(a[0][j][i], a[u][j][i]);
      _mm512_storeu_ps(acc + j * dp + 16 * i, a[0][j][i]);
    }
  }
}

// Passes of up to 16 accumulator registers (the first fetches ahead).
template <int NG, typename T>
void accum_block(float* acc, int dp, const float* alpha, const float* p, const T* const* v,
                 int64_t off, int n, int d, const T* const* ahead, int na) {
  constexpr int CM = NG <= 2 ? 4 : NG <= 4 ? 2 : 1;
#define WB_PA_PASS(C, F, left) \
  accum_pass<NG, C, F>(acc + c, dp, alpha, p, v, off + c, n, left, ahead, off, na, d), na = 0
  int c = 0;
  if constexpr (CM >= 4)
    for (; c + 128 <= d; c += 128) WB_PA_PASS(4, true, 0);
  if constexpr (CM >= 2)
    for (; c + 64 <= d; c += 64) WB_PA_PASS(2, true, 0);
  for (; c + 32 <= d; c += 32) WB_PA_PASS(1, true, 0);
  if (c < d) WB_PA_PASS(1, false, d - c);
#undef WB_PA_PASS
}

// Register blocks of 8 rows, then 4, then the rest (the first block fetches ahead).
template <typename T>
void accum(float* acc, int rows, int dp, const float* alpha, const float* p, const T* const* v,
           int64_t off, int n, int d, const T* const* ahead, int na) {
  int r = 0;
  for (; r + 8 <= rows; r += 8, na = 0) {
    accum_block<8>(acc + r * dp, dp, alpha + r, p + r * kTile, v, off, n, d, ahead, na);
  }
  if (r + 4 <= rows) {
    accum_block<4>(acc + r * dp, dp, alpha + r, p + r * kTile, v, off, n, d, ahead, na);
    r += 4, na = 0;
  }
  acc += r * dp, alpha += r, p += r * kTile;
  if (rows - r == 3) accum_block<3>(acc, dp, alpha, p, v, off, n, d, ahead, na);
  if (rows - r == 2) accum_block<2>(acc, dp, alpha, p, v, off, n, d, ahead, na);
  if (rows - r == 1) accum_block<1>(acc, dp, alpha, p, v, off, n, d, ahead, na);
}

// R rows at once (their dependency chains interleaved): each row's tile of kTile scores.
template <int R>
WB_INLINE void softmax_rows(float* s, const int* lo, const int* hi, float cap, float* m,
                            float* l, float* alpha) {
  constexpr int V = kTile / 16;
  __m512 x[R][V], top[R];
  __mmask16 v[R][V];
  for (int r = 0; r < R; ++r) {
    const uint64_t below = hi[r] >= 64 ? ~0ull : (1ull << hi[r]) - 1;
    const uint64_t valid = lo[r] < hi[r] ? below & ~((1ull << lo[r]) - 1) : 0;
    for (int h = 0; h < V; ++h) {
      v[r][h] = __mmask16(valid >> 16 * h);
      x[r][h] = _mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), v[r][h], s + r * kTile + 16 * h);
    }
  }
  if (cap > 0) {
    const __m512 c = _mm512_set1_ps(cap), inv = _mm512_set1_ps(1.f / cap);
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < V; ++h)
        x[r][h] = _mm512_mask_mul_ps(x[r][h], v[r][h], c, tanh(_mm512_mul_ps(x[r][h], inv)));
  }
  for (int r = 0; r < R; ++r) {  // no valid position: top = m, alpha = 1
    __m512 t = x[r][0];
    for (int h = 1; h < V; ++h) t = _mm512_max_ps(t, x[r][h]);
    top[r] = _mm512_set1_ps(std::max(m[r], _mm512_reduce_max_ps(t)));
  }
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < V; ++h) {
      x[r][h] = _mm512_maskz_mov_ps(v[r][h], exp(_mm512_sub_ps(x[r][h], top[r])));
      _mm512_storeu_ps(s + r * kTile + 16 * h, x[r][h]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float t = _mm512_cvtss_f32(top[r]);
    alpha[r] = t == m[r] ? 1.f : _mm512_cvtss_f32(exp(_mm512_sub_ps(_mm512_set1_ps(m[r]), top[r])));
    __m512 sum = x[r][0];
    for (int h = 1; h < V; ++h) sum = _mm512_add_ps(sum, x[r][h]);
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    m[r] = t;
  }
}

void softmax(float* s, int rows, int n, const int* lo, const int* hi, float cap, float* m,
             float* l, float* alpha) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    softmax_rows<4>(s + r * kTile, lo + r, hi + r, cap, m + r, l + r, alpha + r);
  }
  s += r * kTile, lo += r, hi += r, m += r, l += r, alpha += r;
  if (rows - r == 3) softmax_rows<3>(s, lo, hi, cap, m, l, alpha);
  if (rows - r == 2) softmax_rows<2>(s, lo, hi, cap, m, l, alpha);
  if (rows - r == 1) softmax_rows<1>(s, lo, hi, cap, m, l, alpha);
}
#undef WB_INLINE
#pragma GCC pop_options
}  // namespace avx512

template <typename T>
Kernels<T> kernels() {
  constexpr bool bf16 = std::is_same_v<T, c10::BFloat16>;
  switch (detect_isa()) {  // the CPU's best set, or a lower one use_isa chose (tests)
    case Isa::Avx512Bf16:
      if constexpr (bf16) {
        return {avx512::prepare_dot, avx512::scores_dot, avx512::softmax, avx512::accum<T>,
                avx512::write_pairs};
      }
      [[fallthrough]];
    case Isa::Avx512:
      if constexpr (bf16) {
        return {prepare<T>, avx512::scores<T>, avx512::softmax, avx512::accum<T>,
                avx512::write_pairs};
      }
      return {prepare<T>, avx512::scores<T>, avx512::softmax, avx512::accum<T>, avx512::write<T>};
    case Isa::Avx2:
      return {prepare<T>, avx2::scores<T>, avx2::softmax, avx2::accum<T>, write<T>};
    default:
      return {prepare<T>, portable::scores<T>, portable::softmax, portable::accum<T>, write<T>};
  }
}

struct Geometry {  // one call's shapes and strides (in elements)
  int64_t hq, group, d, dp, q_tok, q_head, kb, kt, kh, vb, vt, vh, nblocks, bs, window, chunk;
  float scale, cap;
  const float* sinks;
};

struct Task {  // nq query tokens (q's rows tok0..) at positions pos0.. of one sequence
  const int64_t* table;
  int64_t tok0, nq, pos0;
};

struct Item {  // a task's KV heads [h0, h1)
  int64_t task, h0, h1;
};

struct Work {  // a work item's rows: ((h - h0) * nq + token) * group + (query head - h * group)
  int rows = 0;
  std::vector<float> q, acc, s, m, l, alpha;
  std::vector<int> lo, hi;
  std::vector<int64_t> row_lo, row_hi;  // per token and query head (the same for every KV head)
  std::vector<const void*> krow, vrow;  // two tiles' K/V row pointers
  void size(int n, int per, int64_t dp) {
    rows = n, q.resize(n * dp), acc.assign(n * dp, 0.f), s.resize(n * kTile);
    m.resize(n), l.resize(n), alpha.resize(n), lo.resize(per), hi.resize(per);
    row_lo.resize(per), row_hi.resize(per), krow.resize(2 * kTile), vrow.resize(2 * kTile);
  }
};

// The first position a query at end - 1 sees: its window's, and where later its chunk's
// (chunked local attention: the positions from end - 1 - (end - 1) % chunk).
int64_t window_start(const Geometry& g, int64_t end) {
  const int64_t from = g.window > 0 ? std::max<int64_t>(0, end - g.window) : 0;
  return g.chunk > 0 && end > 0 ? std::max(from, end - 1 - (end - 1) % g.chunk) : from;
}

// Positions [lo, hi) of a task, its KV heads from h0 on.
template <typename T>
struct Span {
  const Task* t = nullptr;
  int64_t h0 = 0, lo = 0, hi = 0;

  // the K/V rows of the first (up to) kTile positions; returns their count
  int rows(const Geometry& g, const T* kc, const T* vc, const T** krow, const T** vrow) const {
    const int n = int(std::clamp<int64_t>(hi - lo, 0, kTile));
    for (int i = 0; i < n;) {  // one cache block's run of positions at a time
      const int64_t bi = (lo + i) / g.bs, off = lo + i - bi * g.bs, blk = t->table[bi];
      TORCH_CHECK(blk >= 0 && blk < g.nblocks, "paged attention: block id ", blk,
                  " out of range [0, ", g.nblocks, ")");
      const T* kb = kc + blk * g.kb + off * g.kt + h0 * g.kh;
      const T* vb = vc + blk * g.vb + off * g.vt + h0 * g.vh;
      for (int64_t j = 0, m = std::min<int64_t>(n - i, g.bs - off); j < m; ++j, ++i) {
        krow[i] = kb + j * g.kt, vrow[i] = vb + j * g.vt;
      }
    }
    return n;
  }
};

// Task t's rows for KV heads [h0, h1) over positions [p0, p1), with the sinks or not: leaves
// w.acc (in the kernels' order, not yet divided by l), w.m and w.l. `then`: the span read next
// (its first tile fetched during the last one).
template <typename T>
void attend(const Geometry& g, const Kernels<T>& kern, const T* q, const T* kc, const T* vc,
            const Task& t, int64_t h0, int64_t h1, int64_t p0, int64_t p1, bool sinks, Work& w,
            Span<T> then = {}) {
  const int per = int(t.nq * g.group), dp = int(g.dp), d = int(g.d);
  w.size(int(h1 - h0) * per, per, g.dp);
  for (int r = 0; r < per; ++r) {
    const int64_t end = t.pos0 + r / g.group + 1;
    w.row_lo[r] = std::max(window_start(g, end), p0), w.row_hi[r] = std::min(end, p1);
  }
  for (int r = 0; r < w.rows; ++r) {
    const int64_t i = r % per / g.group, head = (h0 + r / per) * g.group + r % g.group;
    kern.prepare(q + (t.tok0 + i) * g.q_tok + head * g.q_head, d, dp, &w.q[r * dp]);
    const bool sink = sinks && g.sinks;
    w.m[r] = sink ? g.sinks[head] : -kInf, w.l[r] = sink ? 1.f : 0.f;
  }
  const int64_t start = w.row_lo[0], stop = w.row_hi[per - 1];
  const T** krow = reinterpret_cast<const T**>(w.krow.data());
  const T** vrow = reinterpret_cast<const T**>(w.vrow.data());
  Span<T>{&t, h0, start, stop}.rows(g, kc, vc, krow, vrow);
  for (int64_t pos = start, cur = 0; pos < stop; pos += kTile, cur ^= kTile) {
    const int n = int(std::min<int64_t>(kTile, stop - pos));
    const Span<T> ahead = pos + kTile < stop ? Span<T>{&t, h0, pos + kTile, stop} : then;
    const int next = ahead.rows(g, kc, vc, krow + (cur ^ kTile), vrow + (cur ^ kTile));
    for (int r = 0; r < per; ++r) {
      w.lo[r] = int(std::clamp<int64_t>(w.row_lo[r] - pos, 0, n));
      w.hi[r] = int(std::clamp<int64_t>(w.row_hi[r] - pos, 0, n));
    }
    for (int64_t h = 0, r = 0; h < h1 - h0; ++h, r += per) {
      float* s = &w.s[r * kTile];  // the next tile's rows of this head fetched meanwhile
      kern.scores(&w.q[r * dp], per, dp, krow + cur, h * g.kh, n, d, g.scale, s,
                  krow + (cur ^ kTile), next);
      kern.softmax(s, per, n, w.lo.data(), w.hi.data(), g.cap, &w.m[r], &w.l[r], &w.alpha[r]);
      kern.accum(&w.acc[r * dp], per, dp, &w.alpha[r], s, vrow + cur, h * g.vh, n, d,
                 vrow + (cur ^ kTile), next);
    }
  }
}

template <typename T>
void store(const Geometry& g, const Kernels<T>& kern, const Task& t, int64_t h0, const Work& w,
           T* out) {
  const int64_t per = t.nq * g.group;
  for (int64_t r = 0; r < w.rows; ++r) {
    const int64_t i = r % per / g.group, head = (h0 + r / per) * g.group + r % g.group;
    const float inv = w.l[r] > 0 ? 1.f / w.l[r] : 0.f;  // no position and no sink: zeros
    kern.write(&w.acc[r * g.dp], int(g.d), inv, out + ((t.tok0 + i) * g.hq + head) * g.d);
  }
}

void merge(const Geometry& g, Work* parts, int64_t n) {  // into parts[0]
  for (int64_t r = 0; r < parts[0].rows; ++r) {
    float top = -kInf;
    for (int64_t s = 0; s < n; ++s) top = std::max(top, parts[s].m[r]);
    for (int64_t s = 0; s < n; ++s) {
      const float f = top > -kInf ? std::exp(parts[s].m[r] - top) : 0.f;
      float* acc = parts[0].acc.data() + r * g.dp;
      const float* src = parts[s].acc.data() + r * g.dp;
      for (int64_t c = 0; c < g.dp; ++c) acc[c] = (s ? acc[c] : 0.f) + f * src[c];
      parts[0].l[r] = (s ? parts[0].l[r] : 0.f) + f * parts[s].l[r];
    }
  }
}

template <typename T>
void run(const Geometry& g, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
         const std::vector<Task>& tasks, at::Tensor& out) {
  const Kernels<T> kern = kernels<T>();
  const T *qp = q.data_ptr<T>(), *kp = kc.data_ptr<T>(), *vp = vc.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t hkv = g.hq / g.group, threads = parallel_width();
  const int64_t ntasks = int64_t(tasks.size());
  // every KV head of a task in one item, or shares of them where tasks are fewer than threads
  const int64_t shares = ntasks >= threads ? 1 : std::min(hkv, (threads + ntasks - 1) / ntasks);
  std::vector<Item> items;
  for (int64_t i = 0; i < ntasks; ++i) {
    for (int64_t s = 0; s < shares; ++s) {
      items.push_back({i, hkv * s / shares, hkv * (s + 1) / shares});
    }
  }
  const int64_t n = int64_t(items.size());
  int64_t longest = 0;  // positions of the widest task
  for (const Task& t : tasks) {
    longest = std::max(longest, t.pos0 + t.nq - window_start(g, t.pos0 + 1));
  }
  const int64_t splits =
      n >= threads ? 1 : std::max(int64_t(1), std::min((threads + n - 1) / n, longest / kSplit));
  if (splits == 1) {
    // NOTE: a few items a chunk, so the next item's first blocks can be fetched ahead
    parallel_chunks(n, std::max<int64_t>(1, n / (4 * threads)), [&](int64_t b, int64_t e) {
      thread_local Work w;  // NOTE: its buffers outlive the call (no allocation per call)
      for (int64_t i = b; i < e; ++i) {
        const Item& it = items[i];
        const Task& t = tasks[it.task];
        Span<T> then;  // the next item's first positions, fetched during this one's last
        if (i + 1 < e && items[i + 1].h0 == it.h0) {
          const Task& u = tasks[items[i + 1].task];
          then = {&u, it.h0, window_start(g, u.pos0 + 1), u.pos0 + u.nq};
        }
        attend(g, kern, qp, kp, vp, t, it.h0, it.h1, 0, t.pos0 + t.nq, true, w, then);
        store(g, kern, t, it.h0, w, op);
      }
    });
    return;
  }
  std::vector<Work> parts(n * splits);  // flash-decoding: each split's (acc, m, l)
  parallel_chunks(n * splits, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Item& it = items[i / splits];
      const Task& t = tasks[it.task];
      const int64_t s = i % splits, lo = window_start(g, t.pos0 + 1), len = t.pos0 + t.nq - lo;
      attend(g, kern, qp, kp, vp, t, it.h0, it.h1, lo + len * s / splits,
             lo + len * (s + 1) / splits, s == 0, parts[i]);
    }
  });
  parallel_chunks(n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      merge(g, &parts[i * splits], splits);
      store(g, kern, tasks[items[i].task], items[i].h0, parts[i * splits], op);
    }
  });
}

Geometry check(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, double scale,
               int64_t window, double softcap, const std::optional<at::Tensor>& sinks,
               at::Tensor& sinks_f32, int64_t chunk) {
  TORCH_CHECK(q.dim() == 3, "paged attention: q must be (tokens, heads, head_dim), got ",
              q.sizes());
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "paged attention: q must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(kc.dim() == 4 && vc.dim() == 4,
              "paged attention: the caches must be (num_blocks, block_size, kv_heads, "
              "head_dim), got ", kc.sizes(), " and ", vc.sizes());
  TORCH_CHECK(kc.sizes() == vc.sizes(), "paged attention: k_cache ", kc.sizes(),
              " and v_cache ", vc.sizes(), " differ in shape");
  TORCH_CHECK(kc.scalar_type() == dt && vc.scalar_type() == dt, "paged attention: q is ", dt,
              ", the caches ", kc.scalar_type(), " and ", vc.scalar_type());
  const int64_t hq = q.size(1), d = q.size(2), hkv = kc.size(2);
  TORCH_CHECK(kc.size(3) == d, "paged attention: q's head_dim is ", d, ", the caches' ",
              kc.size(3));
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "paged attention: ", hq,
              " query heads are not a multiple of ", hkv, " kv heads");
  TORCH_CHECK(q.stride(2) == 1, "paged attention: q's head_dim must be contiguous");
  for (const at::Tensor* c : {&kc, &vc}) {
    TORCH_CHECK(c->stride(3) == 1 && c->stride(2) == d,
                "paged attention: a cache's (kv_heads, head_dim) must be contiguous, strides ",
                c->strides());
  }
  TORCH_CHECK(window >= 0, "paged attention: window must be >= 0 (0: full), got ", window);
  TORCH_CHECK(chunk >= 0, "paged attention: chunk must be >= 0 (0: none), got ", chunk);
  TORCH_CHECK(softcap >= 0, "paged attention: softcap must be >= 0 (0: none), got ", softcap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->numel() == hq, "paged attention: sinks must hold ", hq, " logits, got ",
                sinks->sizes());
    sinks_f32 = sinks->to(at::kFloat).contiguous();
  }
  const float* sink_ptr = sinks_f32.defined() ? sinks_f32.data_ptr<float>() : nullptr;
  return {hq,           hq / hkv,     d,            (d + 31) / 32 * 32,
          q.stride(0),  q.stride(1),  kc.stride(0), kc.stride(1),
          kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
          kc.size(0),   kc.size(1),   window,       chunk,
          float(scale), float(softcap), sink_ptr};
}

at::Tensor dispatch(const Geometry& g, const at::Tensor& q, const at::Tensor& kc,
                    const at::Tensor& vc, const std::vector<Task>& tasks) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.numel() == 0) return out;
  switch (q.scalar_type()) {
    case at::kBFloat16: run<c10::BFloat16>(g, q, kc, vc, tasks, out); break;
    case at::kHalf: run<c10::Half>(g, q, kc, vc, tasks, out); break;
    default: run<float>(g, q, kc, vc, tasks, out);
  }
  return out;
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t window, double softcap, const std::optional<at::Tensor>& sinks,
                        int64_t chunk) {
  at::Tensor sinks_f32;
  const Geometry g = check(q, k_cache, v_cache, scale, window, softcap, sinks, sinks_f32, chunk);
  const int64_t batch = q.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch &&
                  block_tables.scalar_type() == at::kLong,
              "paged_decode: block_tables must be (", batch, ", max_blocks) int64, got ",
              block_tables.sizes(), " ", block_tables.scalar_type());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == batch &&
                  seq_lens.scalar_type() == at::kLong,
              "paged_decode: seq_lens must be (", batch, ",) int64, got ", seq_lens.sizes(), " ",
              seq_lens.scalar_type());
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int64_t width = tables.size(1);
  std::vector<Task> tasks(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens.data_ptr<int64_t>()[b];
    TORCH_CHECK(len >= 0 && len <= width * g.bs, "paged_decode: seq_lens[", b, "] = ", len,
                " is not in [0, ", width * g.bs, "] (max_blocks * block_size)");
    tasks[b] = {tables.data_ptr<int64_t>() + b * width, b, 1, len - 1};
  }
  return dispatch(g, q, k_cache, v_cache, tasks);
}

at::Tensor paged_extend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, int64_t context_len, double scale,
                        int64_t window, double softcap, const std::optional<at::Tensor>& sinks,
                        int64_t chunk) {
  at::Tensor sinks_f32;
  const Geometry g = check(q, k_cache, v_cache, scale, window, softcap, sinks, sinks_f32, chunk);
  const int64_t n = q.size(0);
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong,
              "paged_extend: block_table must be (num_blocks,) int64, got ", block_table.sizes(),
              " ", block_table.scalar_type());
  TORCH_CHECK(context_len >= n && context_len <= block_table.size(0) * g.bs,
              "paged_extend: context_len ", context_len, " must cover the ", n,
              " query tokens and fit the block table's ", block_table.size(0) * g.bs, " slots");
  const at::Tensor table = block_table.contiguous();
  std::vector<Task> tasks;
  for (int64_t i = 0; i < n; i += kChunk) {
    tasks.push_back({table.data_ptr<int64_t>(), i, std::min(kChunk, n - i), context_len - n + i});
  }
  return dispatch(g, q, k_cache, v_cache, tasks);
}

// Meta kernels: the output's shape for torch.compile's fake tensors.
at::Tensor decode_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, double, int64_t, double,
                       const std::optional<at::Tensor>&, int64_t) {
  return at::empty_symint(q.sym_sizes(), q.options());
}

at::Tensor extend_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, int64_t, double, int64_t, double,
                       const std::optional<at::Tensor>&, int64_t) {
  return at::empty_symint(q.sym_sizes(), q.options());
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window, float softcap, Tensor? sinks, int chunk=0) "
      "-> Tensor");
  m.def(
      "paged_extend(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "int context_len, float scale, int window, float softcap, Tensor? sinks, int chunk=0) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(warmboot_cpu, CPU, m) {
  m.impl("paged_decode", &warmboot::paged_decode);
  m.impl("paged_extend", &warmboot::paged_extend);
}

TORCH_LIBRARY_IMPL(warmboot_cpu, Meta, m) {
  m.impl("paged_decode", &warmboot::decode_meta);
  m.impl("paged_extend", &warmboot::extend_meta);
}

#else  // WB_PA_GENERIC: the tile kernels in plain C++, compiled once per instruction set

// 8 floats in GCC's vector extensions: exp, tanh and the softmax's selects without branches
// (the auto-vectoriser would leave them scalar: trapping math forbids if-converting them).
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
inline v8f splat(float f) { return v8f{} + f; }
inline float hsum8(v8f a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

inline v8f exp8(v8f x) {  // Cephes expf; NaN stays NaN
  x = x < -87.f ? splat(-87.f) : x;
  x = x > 88.f ? splat(88.f) : x;
  const v8f n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest
  const v8f r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  v8f p = splat(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    p = p * r + c;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  return (p * r * r + r + 1.f) * (v8f)bits;
}

inline v8f tanh8(v8f x) {  // Cephes tanhf
  const v8f a = x < 0.f ? -x : x, z = x * x;
  v8f p = splat(-5.70498872745e-3f);
  for (float c : {2.06390887954e-2f, -5.37397155531e-2f, 1.33314422036e-1f, -3.33332819422e-1f})
    p = p * z + c;
  const v8f big = 1.f - 2.f / (exp8(a + a) + 1.f);
  return a < 0.625f ? p * z * x + x : x < 0.f ? -big : big;
}

template <typename T>
const float* widen(const T* const* rows, int64_t off, int n, int d, int dp) {  // fp32, padded
  thread_local std::vector<float> tile;
  tile.resize(size_t(kTile) * dp);
  for (int t = 0; t < n; ++t) {
    float* dst = tile.data() + t * dp;
    for (int c = 0; c < d; ++c) dst[c] = static_cast<float>(rows[t][off + c]);
    for (int c = d; c < dp; ++c) dst[c] = 0.f;
  }
  return tile.data();
}

template <typename T>
void scores(const float* q, int rows, int dp, const T* const* k, int64_t off, int n, int d,
            float scale, float* s, const T* const* ahead, int na) {
  for (int t = 0; t < na; ++t) fetch(ahead[t] + off, d);
  const float* kf = widen(k, off, n, d, dp);
  for (int t = 0; t < n; ++t) {
    for (int r = 0; r < rows; ++r) {
      v8f a{}, b{}, x, y;
      for (int c = 0; c < dp; c += 16) {
        std::memcpy(&x, q + r * dp + c, 32), std::memcpy(&y, kf + t * dp + c, 32);
        a += x * y;
        std::memcpy(&x, q + r * dp + c + 8, 32), std::memcpy(&y, kf + t * dp + c + 8, 32);
        b += x * y;
      }
      s[r * kTile + t] = hsum8(a + b) * scale;
    }
  }
}

void softmax(float* s, int rows, int n, const int* lo, const int* hi, float cap, float* m,
             float* l, float* alpha) {
  for (int r = 0; r < rows; ++r) {  // whole tiles: lanes outside [lo, hi) computed, dropped
    float* x = s + r * kTile;
    v8f v[kTile / 8];
    std::memcpy(v, x, sizeof(v));
    if (cap > 0)
      for (v8f& e : v) e = cap * tanh8(e * (1.f / cap));
    std::memcpy(x, v, sizeof(v));
    float top = m[r];
    for (int t = lo[r]; t < hi[r]; ++t) top = std::max(top, x[t]);
    v8f sum{};
    for (int i = 0; i < kTile / 8; ++i) {
      const v8i t = v8i{0, 1, 2, 3, 4, 5, 6, 7} + 8 * i;
      v[i] = t >= lo[r] && t < hi[r] ? exp8(v[i] - top) : splat(0.f);
      sum += v[i];
    }
    std::memcpy(x, v, sizeof(v));
    alpha[r] = lo[r] < hi[r] ? std::exp(m[r] - top) : 1.f;
    l[r] = l[r] * alpha[r] + hsum8(sum);
    m[r] = top;
  }
}

template <typename T>
void accum(float* acc, int rows, int dp, const float* alpha, const float* p, const T* const* v,
           int64_t off, int n, int d, const T* const* ahead, int na) {
  for (int t = 0; t < na; ++t) fetch(ahead[t] + off, d);
  const float* vf = widen(v, off, n, d, dp);
  for (int r = 0; r < rows; ++r) {
    float* a = acc + r * dp;
    if (alpha[r] != 1.f)
      for (int c = 0; c < dp; ++c) a[c] *= alpha[r];
    for (int t = 0; t < n; ++t) {
      const float w = p[r * kTile + t];
      if (w != 0.f)
        for (int c = 0; c < dp; ++c) a[c] += w * vf[t * dp + c];
    }
  }
}

#endif  // WB_PA_GENERIC
