// Paged attention over the KV cache in place, no gather and no copy of K/V: decode (one query
// token per sequence) and extend (a prefill chunk of one sequence, causal).
//
// A work item is one KV head with its group of query heads (times the chunk's tokens: one
// query row each). It walks the context in tiles of up to kTile positions, reading each
// position's K and V row straight from its cache block (the next tile's rows prefetched).
// Per tile: the scores of every row, an online softmax step (running max m and denominator l;
// the accumulator rescaled by exp(m_old - m_new)), then the probabilities times the V rows;
// fp32 throughout. Sinks start a row at m = sink, l = 1. Fewer items than threads with a long
// context (batch 1) also split the context and merge the partial softmaxes (flash-decoding).
//
// Kernels: AVX-512 intrinsics (query rows in register blocks of up to 8, so a K/V row is read
// once per block; bf16 scores by dpbf16 where the CPU has AVX512_BF16), else the same steps in
// plain C++: this file's #else half, included into itself once for AVX2+FMA, once portable.
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

namespace warmboot {
namespace {

constexpr int kTile = 32;        // context positions per softmax step
constexpr int64_t kChunk = 16;   // extend: query tokens per work item
constexpr int64_t kSplit = 512;  // fewest positions per context split
constexpr float kInf = std::numeric_limits<float>::infinity();

// One instruction set's tile kernels. Query rows are `dp` floats apart (head_dim rounded up
// to 16, zero-padded); s and p: kTile floats per row; k, v: a tile's n row pointers.
template <typename T>
struct Kernels {
  // s[r][t] = scale * q[r] . k[t]
  void (*scores)(const float* q, int rows, int dp, const T* const* k, int n, int d, float scale,
                 float* s);
  // scores -> probabilities for the row's positions [lo, hi) of the tile (0 elsewhere),
  // updating m and l; alpha: the factor the row's accumulator takes first
  void (*softmax)(float* s, int rows, int n, const int* lo, const int* hi, float cap, float* m,
                  float* l, float* alpha);
  // acc[r] = alpha[r] * acc[r] + sum_t p[r][t] * v[t]
  void (*accum)(float* acc, int rows, int dp, const float* alpha, const float* p,
                const T* const* v, int n, int d);
};

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
inline __mmask16 lanes(int n) { return n >= 16 ? 0xffff : n > 0 ? (1u << n) - 1 : 0; }

inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const c10::BFloat16* p, __mmask16 m) {  // bf16 -> fp32: a 16-bit shift
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
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

inline __m512 hsum16(const __m512* v) {  // lane t: the sum of v[t]'s lanes (a transpose)
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                                  _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                                  _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xdd));
}

// NG rows' scores: per position one vector of partial sums per row (`dot` adds `step` values),
// reduced 16 positions at a time.
template <typename T, int NG, typename Q, typename Dot>
void scores_tile(const Q* q, int ldq, const T* const* k, int n, int d, float scale, float* s,
                 int step, Dot dot) {
  __m512 part[NG][16];
  for (int t0 = 0; t0 < n; t0 += 16) {
    const int m = std::min(16, n - t0);
    for (int t = 0; t < m; ++t) {
      __m512 a[NG];
      for (int j = 0; j < NG; ++j) a[j] = _mm512_setzero_ps();
      for (int c = 0; c < d; c += step)
        for (int j = 0; j < NG; ++j) a[j] = dot(a[j], q + j * ldq + c, k[t0 + t] + c, d - c);
      for (int j = 0; j < NG; ++j) part[j][t] = a[j];
    }
    for (int j = 0; j < NG; ++j) {
      for (int t = m; t < 16; ++t) part[j][t] = _mm512_setzero_ps();
      _mm512_storeu_ps(s + j * kTile + t0, _mm512_mul_ps(hsum16(part[j]), _mm512_set1_ps(scale)));
    }
  }
}

template <typename T>
struct Fma {  // 16 fp32 query values times 16 widened k values
  __m512 operator()(__m512 a, const float* q, const T* k, int left) const {
    return _mm512_fmadd_ps(_mm512_loadu_ps(q), load(k, lanes(left)), a);
  }
};

struct Dpbf16 {  // 32 bf16 query values times 32 bf16 k values, in pairs
  __m512 operator()(__m512 a, const uint16_t* q, const c10::BFloat16* k, int left) const {
    const __m512i kv = _mm512_maskz_loadu_epi16(left >= 32 ? ~0u : (1u << left) - 1, k);
    return _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q), (__m512bh)kv);
  }
};

template <typename T, int NG>
void scores_block(const float* q, int dp, const T* const* k, int n, int d, float scale,
                  float* s) {
  scores_tile<T, NG>(q, dp, k, n, d, scale, s, 16, Fma<T>());
}

constexpr int kMaxDot = 1024;  // longest head_dim for dpbf16 (a larger one takes Fma)

// bf16 caches where the CPU has AVX512_BF16 (only then called): the query rows back to bf16
// (exact: they were bf16), zero-padded to 32 values.
template <typename T, int NG>
void scores_dot_block(const float* q, int dp, const T* const* k, int n, int d, float scale,
                      float* s) {
  alignas(64) uint16_t qb[NG][kMaxDot];
  for (int j = 0; j < NG; ++j) {
    for (int c = 0; c < (d + 31) / 32 * 32; c += 16) {
      const __m512 x = _mm512_maskz_loadu_ps(lanes(d - c), q + j * dp + c);
      _mm256_store_si256(reinterpret_cast<__m256i*>(&qb[j][c]), (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
  scores_tile<T, NG>(&qb[0][0], kMaxDot, k, n, d, scale, s, 32, Dpbf16());
}

template <typename T, int NG>
void accum_block(float* acc, int dp, const float* alpha, const float* p, const T* const* v, int n,
                 int d) {
  constexpr int U = NG <= 2 ? 4 : NG <= 4 ? 2 : 1;  // positions in flight (FMA latency)
  for (int c = 0; c < d; c += 16) {
    const __mmask16 m = lanes(d - c);
    __m512 a[U][NG];
    for (int j = 0; j < NG; ++j) {
      a[0][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * dp + c), _mm512_set1_ps(alpha[j]));
      for (int u = 1; u < U; ++u) a[u][j] = _mm512_setzero_ps();
    }
    int t = 0;
    for (; t + U <= n; t += U) {
      for (int u = 0; u < U; ++u) {
        const __m512 vv = load(v[t + u] + c, m);
        for (int j = 0; j < NG; ++j)
          a[u][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * kTile + t + u]), vv, a[u][j]);
      }
    }
    for (; t < n; ++t) {
      const __m512 vv = load(v[t] + c, m);
      for (int j = 0; j < NG; ++j)
        a[0][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * kTile + t]), vv, a[0][j]);
    }
    for (int j = 0; j < NG; ++j) {
      for (int u = 1; u < U; ++u) a[0][j] = _mm512_add_ps(a[0][j], a[u][j]);
      _mm512_storeu_ps(acc + j * dp + c, a[0][j]);
    }
  }
}

// The rows in register blocks of 8, then 4, then the rest.
#define WB_PA_BLOCKS(F, ...)                          \
  int r = 0;                                          \
  for (; r + 8 <= rows; r += 8) F<T, 8>(__VA_ARGS__); \
  if (r + 4 <= rows) F<T, 4>(__VA_ARGS__), r += 4;    \
  if (rows - r == 3) F<T, 3>(__VA_ARGS__);            \
  if (rows - r == 2) F<T, 2>(__VA_ARGS__);            \
  if (rows - r == 1) F<T, 1>(__VA_ARGS__);

template <typename T>
void scores(const float* q, int rows, int dp, const T* const* k, int n, int d, float scale,
            float* s) {
  WB_PA_BLOCKS(scores_block, q + r * dp, dp, k, n, d, scale, s + r * kTile)
}

template <typename T>
void scores_dot(const float* q, int rows, int dp, const T* const* k, int n, int d, float scale,
                float* s) {
  if (d > kMaxDot) return scores<T>(q, rows, dp, k, n, d, scale, s);
  WB_PA_BLOCKS(scores_dot_block, q + r * dp, dp, k, n, d, scale, s + r * kTile)
}

template <typename T>
void accum(float* acc, int rows, int dp, const float* alpha, const float* p, const T* const* v,
           int n, int d) {
  WB_PA_BLOCKS(accum_block, acc + r * dp, dp, alpha + r, p + r * kTile, v, n, d)
}
#undef WB_PA_BLOCKS

void softmax(float* s, int rows, int n, const int* lo, const int* hi, float cap, float* m,
             float* l, float* alpha) {
  for (int r = 0; r < rows; ++r) {
    float* x = s + r * kTile;
    const uint32_t valid = lo[r] < hi[r] ? uint32_t((1ull << hi[r]) - (1ull << lo[r])) : 0;
    const __mmask16 v0 = valid & 0xffff, v1 = valid >> 16;
    __m512 x0 = _mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), v0, x);
    __m512 x1 = _mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), v1, x + 16);
    if (cap > 0) {
      const __m512 c = _mm512_set1_ps(cap), inv = _mm512_set1_ps(1.f / cap);
      x0 = _mm512_mask_mul_ps(x0, v0, c, tanh(_mm512_mul_ps(x0, inv)));
      x1 = _mm512_mask_mul_ps(x1, v1, c, tanh(_mm512_mul_ps(x1, inv)));
    }
    const float top = valid ? std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(x0, x1))) : m[r];
    const __m512 mt = _mm512_set1_ps(top);
    x0 = _mm512_maskz_mov_ps(v0, exp(_mm512_sub_ps(x0, mt)));
    x1 = _mm512_maskz_mov_ps(v1, exp(_mm512_sub_ps(x1, mt)));
    _mm512_storeu_ps(x, x0);
    _mm512_storeu_ps(x + 16, x1);
    alpha[r] = valid ? std::exp(m[r] - top) : 1.f;
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
    m[r] = top;
  }
}
#pragma GCC pop_options
}  // namespace avx512

template <typename T>
Kernels<T> kernels() {
  switch (detect_isa()) {  // the CPU's best set, or a lower one use_isa chose (tests)
    case Isa::Avx512Bf16:
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        return {avx512::scores_dot<T>, avx512::softmax, avx512::accum<T>};
      [[fallthrough]];
    case Isa::Avx512: return {avx512::scores<T>, avx512::softmax, avx512::accum<T>};
    case Isa::Avx2: return {avx2::scores<T>, avx2::softmax, avx2::accum<T>};
    default: return {portable::scores<T>, portable::softmax, portable::accum<T>};
  }
}

struct Geometry {  // one call's shapes and strides (in elements)
  int64_t hq, group, d, dp, q_tok, q_head, kb, kt, kh, vb, vt, vh, nblocks, bs, window;
  float scale, cap;
  const float* sinks;
};

struct Task {  // nq query tokens (q's rows tok0..) at positions pos0.. of one sequence
  const int64_t* table;
  int64_t tok0, nq, pos0;
};

struct Work {  // one work item's rows (row = query token * group + head in the group)
  std::vector<float> q, acc, s, m, l, alpha;
  std::vector<int> lo, hi;
  std::vector<int64_t> row_lo, row_hi;
  std::vector<const void*> krow, vrow;  // two tiles' K/V row pointers
  void size(int rows, int64_t dp) {
    q.assign(rows * dp, 0.f), acc.assign(rows * dp, 0.f), s.resize(rows * kTile);
    m.resize(rows), l.resize(rows), alpha.resize(rows), lo.resize(rows), hi.resize(rows);
    row_lo.resize(rows), row_hi.resize(rows), krow.resize(2 * kTile), vrow.resize(2 * kTile);
  }
};

template <typename T>
inline void prefetch(const T* row, int64_t d) {  // the cache lines of d values
  const auto last = reinterpret_cast<uintptr_t>(row + d) - 1;
  for (auto a = reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63); a <= last; a += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(a));
}

int64_t window_start(const Geometry& g, int64_t end) {  // first position a query sees
  return g.window > 0 ? std::max<int64_t>(0, end - g.window) : 0;
}

// Task t's rows for KV head h over positions [p0, p1), with the sinks or not: leaves w.acc
// (not yet divided by l), w.m and w.l.
template <typename T>
void attend(const Geometry& g, const Kernels<T>& kern, const T* q, const T* kc, const T* vc,
            const Task& t, int64_t h, int64_t p0, int64_t p1, bool sinks, Work& w) {
  const int rows = int(t.nq * g.group), dp = int(g.dp), d = int(g.d);
  w.size(rows, g.dp);
  for (int r = 0; r < rows; ++r) {
    const int64_t i = r / g.group, head = h * g.group + r % g.group, end = t.pos0 + i + 1;
    const T* src = q + (t.tok0 + i) * g.q_tok + head * g.q_head;
    for (int c = 0; c < d; ++c) w.q[r * dp + c] = static_cast<float>(src[c]);
    w.row_lo[r] = std::max(window_start(g, end), p0), w.row_hi[r] = std::min(end, p1);
    const bool sink = sinks && g.sinks;
    w.m[r] = sink ? g.sinks[head] : -kInf, w.l[r] = sink ? 1.f : 0.f;
  }
  const int64_t start = w.row_lo[0], stop = w.row_hi[rows - 1];
  auto rows_at = [&](int64_t pos, const T** krow, const T** vrow) {  // a tile's rows, fetched
    const int n = int(std::min<int64_t>(kTile, stop - pos));
    for (int i = 0; i < n;) {  // one cache block's run of positions at a time
      const int64_t bi = (pos + i) / g.bs, off = pos + i - bi * g.bs, blk = t.table[bi];
      TORCH_CHECK(blk >= 0 && blk < g.nblocks, "paged attention: block id ", blk,
                  " out of range [0, ", g.nblocks, ")");
      const T* kb = kc + blk * g.kb + off * g.kt + h * g.kh;
      const T* vb = vc + blk * g.vb + off * g.vt + h * g.vh;
      for (int64_t j = 0, m = std::min<int64_t>(n - i, g.bs - off); j < m; ++j, ++i) {
        krow[i] = kb + j * g.kt, vrow[i] = vb + j * g.vt;
        prefetch(krow[i], d), prefetch(vrow[i], d);
      }
    }
  };
  const T** krow = reinterpret_cast<const T**>(w.krow.data());
  const T** vrow = reinterpret_cast<const T**>(w.vrow.data());
  if (start < stop) rows_at(start, krow, vrow);
  for (int64_t pos = start, cur = 0; pos < stop; pos += kTile, cur ^= kTile) {
    const int n = int(std::min<int64_t>(kTile, stop - pos));
    if (pos + kTile < stop) rows_at(pos + kTile, krow + (cur ^ kTile), vrow + (cur ^ kTile));
    for (int r = 0; r < rows; ++r) {
      w.lo[r] = int(std::clamp<int64_t>(w.row_lo[r] - pos, 0, n));
      w.hi[r] = int(std::clamp<int64_t>(w.row_hi[r] - pos, 0, n));
    }
    kern.scores(w.q.data(), rows, dp, krow + cur, n, d, g.scale, w.s.data());
    kern.softmax(w.s.data(), rows, n, w.lo.data(), w.hi.data(), g.cap, w.m.data(), w.l.data(),
                 w.alpha.data());
    kern.accum(w.acc.data(), rows, dp, w.alpha.data(), w.s.data(), vrow + cur, n, d);
  }
}

template <typename T>
void store(const Geometry& g, const Task& t, int64_t h, const Work& w, T* out) {
  for (int64_t r = 0; r < t.nq * g.group; ++r) {
    T* dst = out + ((t.tok0 + r / g.group) * g.hq + h * g.group + r % g.group) * g.d;
    const float inv = w.l[r] > 0 ? 1.f / w.l[r] : 0.f;  // no position and no sink: zeros
    for (int64_t c = 0; c < g.d; ++c) dst[c] = static_cast<T>(w.acc[r * g.dp + c] * inv);
  }
}

void merge(const Geometry& g, Work* parts, int64_t n, int64_t rows) {  // into parts[0]
  for (int64_t r = 0; r < rows; ++r) {
    float top = -kInf;
    for (int64_t s = 0; s < n; ++s) top = std::max(top, parts[s].m[r]);
    for (int64_t s = 0; s < n; ++s) {
      const float f = top > -kInf ? std::exp(parts[s].m[r] - top) : 0.f;
      float* acc = parts[0].acc.data() + r * g.dp;
      const float* src = parts[s].acc.data() + r * g.dp;
      for (int64_t c = 0; c < g.d; ++c) acc[c] = (s ? acc[c] : 0.f) + f * src[c];
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
  const int64_t hkv = g.hq / g.group, items = int64_t(tasks.size()) * hkv;
  const int64_t threads = at::get_num_threads();
  int64_t longest = 0;  // positions of the widest task
  for (const Task& t : tasks) {
    longest = std::max(longest, t.pos0 + t.nq - window_start(g, t.pos0 + 1));
  }
  const int64_t splits = items >= threads ? 1
                         : std::max(int64_t(1), std::min((threads + items - 1) / items,
                                                         longest / kSplit));
  if (splits == 1) {
    at::parallel_for(0, items, 1, [&](int64_t b, int64_t e) {
      Work w;
      for (int64_t i = b; i < e; ++i) {
        const Task& t = tasks[i / hkv];
        attend(g, kern, qp, kp, vp, t, i % hkv, 0, t.pos0 + t.nq, true, w);
        store(g, t, i % hkv, w, op);
      }
    });
    return;
  }
  std::vector<Work> parts(items * splits);  // flash-decoding: each split's (acc, m, l)
  at::parallel_for(0, items * splits, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t item = i / splits, s = i % splits;
      const Task& t = tasks[item / hkv];
      const int64_t lo = window_start(g, t.pos0 + 1), len = t.pos0 + t.nq - lo;
      attend(g, kern, qp, kp, vp, t, item % hkv, lo + len * s / splits,
             lo + len * (s + 1) / splits, s == 0, parts[i]);
    }
  });
  at::parallel_for(0, items, 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const Task& t = tasks[item / hkv];
      merge(g, &parts[item * splits], splits, t.nq * g.group);
      store(g, t, item % hkv, parts[item * splits], op);
    }
  });
}

Geometry check(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, double scale,
               int64_t window, double softcap, const std::optional<at::Tensor>& sinks,
               at::Tensor& sinks_f32) {
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
  TORCH_CHECK(softcap >= 0, "paged attention: softcap must be >= 0 (0: none), got ", softcap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->numel() == hq, "paged attention: sinks must hold ", hq, " logits, got ",
                sinks->sizes());
    sinks_f32 = sinks->to(at::kFloat).contiguous();
  }
  const float* sink_ptr = sinks_f32.defined() ? sinks_f32.data_ptr<float>() : nullptr;
  return {hq,           hq / hkv,     d,            (d + 15) / 16 * 16,
          q.stride(0),  q.stride(1),  kc.stride(0), kc.stride(1),
          kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
          kc.size(0),   kc.size(1),   window,       float(scale),
          float(softcap), sink_ptr};
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
                        int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  at::Tensor sinks_f32;
  const Geometry g = check(q, k_cache, v_cache, scale, window, softcap, sinks, sinks_f32);
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
                        int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  at::Tensor sinks_f32;
  const Geometry g = check(q, k_cache, v_cache, scale, window, softcap, sinks, sinks_f32);
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
                       const std::optional<at::Tensor>&) {
  return at::empty_symint(q.sym_sizes(), q.options());
}

at::Tensor extend_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, int64_t, double, int64_t, double,
                       const std::optional<at::Tensor>&) {
  return at::empty_symint(q.sym_sizes(), q.options());
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window, float softcap, Tensor? sinks) -> Tensor");
  m.def(
      "paged_extend(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "int context_len, float scale, int window, float softcap, Tensor? sinks) -> Tensor");
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
const float* widen(const T* const* rows, int n, int d, int dp) {  // fp32, zero-padded to dp
  thread_local std::vector<float> tile;
  tile.resize(size_t(kTile) * dp);
  for (int t = 0; t < n; ++t) {
    float* dst = tile.data() + t * dp;
    for (int c = 0; c < d; ++c) dst[c] = static_cast<float>(rows[t][c]);
    for (int c = d; c < dp; ++c) dst[c] = 0.f;
  }
  return tile.data();
}

template <typename T>
void scores(const float* q, int rows, int dp, const T* const* k, int n, int d, float scale,
            float* s) {
  const float* kf = widen(k, n, d, dp);
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
           int n, int d) {
  const float* vf = widen(v, n, d, dp);
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
