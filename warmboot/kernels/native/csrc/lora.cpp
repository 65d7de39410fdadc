// LoRA's decode rows (kernels/lora.py): one call a linear for all its one-token rows and all
// its shards. Row t of slot s (not the base) gets, per shard i,
//   out[t, shard i's columns] = y[t, ...] + (x[t] @ A[s, block i].T) @ B_i[s]
// with the stack's layout: a (S + 1, R, in), shard i's A rows in block i of max_rank rows;
// bs[i] (S + 1, max_rank, out_i), shard i's B transposed; ranks (S + 1, shards) int32, the rows
// of each block an adapter fills (the rest are zero and never read: an untargeted shard or a
// rank below max_rank costs nothing). Rows of the base slot, and rows past the slots', are y's.
//
// The decode rows are sorted by slot into runs of up to 4 rows of one slot, which go through
// together: each A and B vector loaded once for the run's rows (a batch on one adapter reads
// it once, not once a row). Per run and shard: the shrink into a scratch of R floats a row
// (dot products, 4 A rows a pass over x), then the expand in column blocks (128 columns, or
// 64 for 3-4 rows, in registers; B's rows streamed), y added in the accumulators and the sum
// rounded once to the output's dtype. Float32 arithmetic throughout, each row's sums in the
// same order whatever its run (the same bits); bf16 inputs widened to it (AVX-512 BF16: the
// shrink by vdpbf16ps, whose bf16 products are exact in float32). The AVX2 and portable
// routes run a row at a time. torch's form costs ~20-25 us a small bf16 GEMM call and 4-6
// calls a linear; this is one. Runs go to the helper threads (parallel_chunks).
#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "isa.h"
#include "pool.h"

namespace warmboot {
namespace {

// For g rows of one slot (x[i], h[i], y[i], o[i] row i's): shrink: h[i][j] = a[j] . x[i],
// j < r (a: r rows of `in`); expand: o[i] = y[i] + h[i][:r] @ b (b: r rows of n)
template <typename T>
using ShrinkFn = void (*)(const T* a, int64_t r, int64_t in, int g, const T* const* x,
                          float* const* h);
template <typename T>
using ExpandFn = void (*)(int g, const float* const* h, int64_t r, const T* b, int64_t n,
                          const T* const* y, T* const* o);

constexpr int64_t kBlock = 128;    // the expand's column block
constexpr int kGroup = 4;          // rows of one slot at once
constexpr int64_t kCopyRows = 64;  // rows of the base (copied) a run

// ---- portable C++ (the compiler vectorizes what it can) ----

template <typename T>
void shrink_portable(const T* a, int64_t r, int64_t in, const T* x, float* h) {
  for (int64_t j = 0; j < r; ++j) {
    float acc = 0.f;
    for (int64_t k = 0; k < in; ++k) {
      acc += static_cast<float>(a[j * in + k]) * static_cast<float>(x[k]);
    }
    h[j] = acc;
  }
}

template <typename T>
void expand_portable(const float* h, int64_t r, const T* b, int64_t n, const T* y, T* o) {
  float acc[kBlock];
  for (int64_t c = 0; c < n; c += kBlock) {
    const int64_t w = std::min(kBlock, n - c);
    for (int64_t j = 0; j < w; ++j) acc[j] = static_cast<float>(y[c + j]);
    for (int64_t k = 0; k < r; ++k) {
      const T* bk = b + k * n + c;
      for (int64_t j = 0; j < w; ++j) acc[j] += h[k] * static_cast<float>(bk[j]);
    }
    for (int64_t j = 0; j < w; ++j) o[c + j] = static_cast<T>(acc[j]);
  }
}

// ---- AVX2 + FMA: 8 lanes, scalar tails ----

#pragma GCC push_options
#pragma GCC target("avx2,fma")
template <typename T>
__m256 load8(const T* p) {
  if constexpr (sizeof(T) == 2) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  } else {
    return _mm256_loadu_ps(p);
  }
}

// bf16: round to nearest even, a NaN to 0x7FC0 (c10::BFloat16's conversion)
template <typename T>
void store8(T* p, __m256 v) {
  if constexpr (sizeof(T) == 2) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  } else {
    _mm256_storeu_ps(p, v);
  }
}

float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <typename T>
void shrink_avx2(const T* a, int64_t r, int64_t in, const T* x, float* h) {
  const int64_t main = in / 8 * 8;
  int64_t j = 0;
  for (; j + 4 <= r; j += 4) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t k = 0; k < main; k += 8) {
      const __m256 xv = load8(x + k);
      for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(load8(a + (j + i) * in + k), xv, acc[i]);
    }
    for (int i = 0; i < 4; ++i) {
      float s = hsum8(acc[i]);
      for (int64_t k = main; k < in; ++k) {
        s += static_cast<float>(a[(j + i) * in + k]) * static_cast<float>(x[k]);
      }
      h[j + i] = s;
    }
  }
  for (; j < r; ++j) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < main; k += 8) {
      acc = _mm256_fmadd_ps(load8(a + j * in + k), load8(x + k), acc);
    }
    float s = hsum8(acc);
    for (int64_t k = main; k < in; ++k) {
      s += static_cast<float>(a[j * in + k]) * static_cast<float>(x[k]);
    }
    h[j] = s;
  }
}

template <typename T>
void expand_avx2(const float* h, int64_t r, const T* b, int64_t n, const T* y, T* o) {
  constexpr int kAcc = 8;  // 64 columns
  int64_t c = 0;
  for (; c + 8 * kAcc <= n; c += 8 * kAcc) {
    __m256 acc[kAcc];
    for (int i = 0; i < kAcc; ++i) acc[i] = load8(y + c + 8 * i);
    for (int64_t k = 0; k < r; ++k) {
      const __m256 hk = _mm256_set1_ps(h[k]);
      const T* bk = b + k * n + c;
      for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_fmadd_ps(hk, load8(bk + 8 * i), acc[i]);
    }
    for (int i = 0; i < kAcc; ++i) store8(o + c + 8 * i, acc[i]);
  }
  for (; c + 8 <= n; c += 8) {
    __m256 acc = load8(y + c);
    for (int64_t k = 0; k < r; ++k) {
      acc = _mm256_fmadd_ps(_mm256_set1_ps(h[k]), load8(b + k * n + c), acc);
    }
    store8(o + c, acc);
  }
  for (; c < n; ++c) {
    float acc = static_cast<float>(y[c]);
    for (int64_t k = 0; k < r; ++k) acc += h[k] * static_cast<float>(b[k * n + c]);
    o[c] = static_cast<T>(acc);
  }
}
#pragma GCC pop_options

// ---- AVX-512: 16 lanes, masked tails ----

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
inline __mmask16 tail16(int64_t left) { return left >= 16 ? 0xFFFF : (1u << left) - 1; }

template <typename T>
__m512 load16(const T* p, __mmask16 m) {
  if constexpr (sizeof(T) == 2) {
    const __m256i v = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  } else {
    return _mm512_maskz_loadu_ps(m, p);
  }
}

// bf16: round to nearest even, a NaN to 0x7FC0 (c10::BFloat16's conversion)
template <typename T>
void store16(T* p, __m512 v, __mmask16 m) {
  if constexpr (sizeof(T) == 2) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm512_mask_cvtepi32_storeu_epi16(p, m, r);
  } else {
    _mm512_mask_storeu_ps(p, m, v);
  }
}

// Rows of one slot go through together, up to kGroup, each A and B vector loaded once for
// all of them; each row's own sums run in the order they would alone (the same bits).
template <typename T, int G>
void shrink_group(const T* a, int64_t r, int64_t in, const T* const* x, float* const* h) {
  int64_t j = 0;
  for (; j + 4 <= r; j += 4) {
    __m512 acc[4][G];
    for (auto& row : acc) for (auto& v : row) v = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 16) {
      const __mmask16 m = tail16(in - k);
      __m512 xv[G];
      for (int g = 0; g < G; ++g) xv[g] = load16(x[g] + k, m);
      for (int i = 0; i < 4; ++i) {
        const __m512 av = load16(a + (j + i) * in + k, m);
        for (int g = 0; g < G; ++g) acc[i][g] = _mm512_fmadd_ps(av, xv[g], acc[i][g]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      for (int g = 0; g < G; ++g) h[g][j + i] = _mm512_reduce_add_ps(acc[i][g]);
    }
  }
  for (; j < r; ++j) {
    __m512 acc[G];
    for (auto& v : acc) v = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 16) {
      const __mmask16 m = tail16(in - k);
      const __m512 av = load16(a + j * in + k, m);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(av, load16(x[g] + k, m), acc[g]);
    }
    for (int g = 0; g < G; ++g) h[g][j] = _mm512_reduce_add_ps(acc[g]);
  }
}

// Column blocks of kBlock for one or two rows, half that for more (8 or 16 accumulators).
template <typename T, int G>
void expand_group(const float* const* h, int64_t r, const T* b, int64_t n, const T* const* y,
                  T* const* o) {
  constexpr int kAcc = (G <= 2 ? kBlock : kBlock / 2) / 16;
  int64_t c = 0;
  for (; c + 16 * kAcc <= n; c += 16 * kAcc) {
    __m512 acc[G][kAcc];
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < kAcc; ++i) acc[g][i] = load16(y[g] + c + 16 * i, 0xFFFF);
    }
    for (int64_t k = 0; k < r; ++k) {
      __m512 bv[kAcc];
      for (int i = 0; i < kAcc; ++i) bv[i] = load16(b + k * n + c + 16 * i, 0xFFFF);
      for (int g = 0; g < G; ++g) {
        const __m512 hk = _mm512_set1_ps(h[g][k]);
        for (int i = 0; i < kAcc; ++i) acc[g][i] = _mm512_fmadd_ps(hk, bv[i], acc[g][i]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < kAcc; ++i) store16(o[g] + c + 16 * i, acc[g][i], 0xFFFF);
    }
  }
  for (; c < n; c += 16) {
    const __mmask16 m = tail16(n - c);
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = load16(y[g] + c, m);
    for (int64_t k = 0; k < r; ++k) {
      const __m512 bv = load16(b + k * n + c, m);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(h[g][k]), bv, acc[g]);
    }
    for (int g = 0; g < G; ++g) store16(o[g] + c, acc[g], m);
  }
}

template <typename T>
void shrink_avx512(const T* a, int64_t r, int64_t in, int g, const T* const* x,
                   float* const* h) {
  switch (g) {
    case 1: return shrink_group<T, 1>(a, r, in, x, h);
    case 2: return shrink_group<T, 2>(a, r, in, x, h);
    case 3: return shrink_group<T, 3>(a, r, in, x, h);
    default: return shrink_group<T, 4>(a, r, in, x, h);
  }
}

template <typename T>
void expand_avx512(int g, const float* const* h, int64_t r, const T* b, int64_t n,
                   const T* const* y, T* const* o) {
  switch (g) {
    case 1: return expand_group<T, 1>(h, r, b, n, y, o);
    case 2: return expand_group<T, 2>(h, r, b, n, y, o);
    case 3: return expand_group<T, 3>(h, r, b, n, y, o);
    default: return expand_group<T, 4>(h, r, b, n, y, o);
  }
}
#pragma GCC pop_options

// ---- AVX-512 BF16: the bf16 shrink as pairs of products (vdpbf16ps), 32 values a step ----

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
inline __m512bh load32(const at::BFloat16* p, __mmask32 m) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

inline __mmask32 tail32(int64_t left) { return left >= 32 ? 0xFFFFFFFFu : (1u << left) - 1; }

template <int G>
void dpbf16_group(const at::BFloat16* a, int64_t r, int64_t in, const at::BFloat16* const* x,
                  float* const* h) {
  int64_t j = 0;
  for (; j + 4 <= r; j += 4) {
    __m512 acc[4][G];
    for (auto& row : acc) for (auto& v : row) v = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 32) {
      const __mmask32 m = tail32(in - k);
      __m512bh xv[G];
      for (int g = 0; g < G; ++g) xv[g] = load32(x[g] + k, m);
      for (int i = 0; i < 4; ++i) {
        const __m512bh av = load32(a + (j + i) * in + k, m);
        for (int g = 0; g < G; ++g) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], av, xv[g]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      for (int g = 0; g < G; ++g) h[g][j + i] = _mm512_reduce_add_ps(acc[i][g]);
    }
  }
  for (; j < r; ++j) {
    __m512 acc[G];
    for (auto& v : acc) v = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 32) {
      const __mmask32 m = tail32(in - k);
      const __m512bh av = load32(a + j * in + k, m);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_dpbf16_ps(acc[g], av, load32(x[g] + k, m));
    }
    for (int g = 0; g < G; ++g) h[g][j] = _mm512_reduce_add_ps(acc[g]);
  }
}

void shrink_dpbf16(const at::BFloat16* a, int64_t r, int64_t in, int g,
                   const at::BFloat16* const* x, float* const* h) {
  switch (g) {
    case 1: return dpbf16_group<1>(a, r, in, x, h);
    case 2: return dpbf16_group<2>(a, r, in, x, h);
    case 3: return dpbf16_group<3>(a, r, in, x, h);
    default: return dpbf16_group<4>(a, r, in, x, h);
  }
}
#pragma GCC pop_options

// The one-row kernels (portable, AVX2) over a group, a row at a time.
template <typename T, void (*F)(const T*, int64_t, int64_t, const T*, float*)>
void shrink_rows(const T* a, int64_t r, int64_t in, int g, const T* const* x, float* const* h) {
  for (int i = 0; i < g; ++i) F(a, r, in, x[i], h[i]);
}

template <typename T, void (*F)(const float*, int64_t, const T*, int64_t, const T*, T*)>
void expand_rows(int g, const float* const* h, int64_t r, const T* b, int64_t n,
                 const T* const* y, T* const* o) {
  for (int i = 0; i < g; ++i) F(h[i], r, b, n, y[i], o[i]);
}

template <typename T>
std::pair<ShrinkFn<T>, ExpandFn<T>> kernels(Isa isa) {
  switch (isa) {
    case Isa::Avx512Bf16:
      if constexpr (sizeof(T) == 2) return {&shrink_dpbf16, &expand_avx512<T>};
      [[fallthrough]];
    case Isa::Avx512:
      return {&shrink_avx512<T>, &expand_avx512<T>};
    case Isa::Avx2:
      return {&shrink_rows<T, shrink_avx2<T>>, &expand_rows<T, expand_avx2<T>>};
    default:
      return {&shrink_rows<T, shrink_portable<T>>, &expand_rows<T, expand_portable<T>>};
  }
}

// Runs of rows: [begin, end) of `order` (the rows by slot); a run of the base is copied.
struct Run {
  int64_t begin, end, slot;
};

// The rows by slot (stable), cut into runs of one slot: kGroup rows at most, or kCopyRows of
// the base's and of those past the slots'.
std::vector<Run> runs_of(const int64_t* slots, int64_t d, int64_t rows, int64_t base,
                         std::vector<int64_t>& order) {
  order.resize(rows);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.begin() + d,
                   [&](int64_t p, int64_t q) { return slots[p] < slots[q]; });
  std::vector<Run> runs;
  for (int64_t i = 0; i < rows;) {
    const int64_t s = order[i] < d ? slots[order[i]] : base;
    const int64_t most = s == base ? kCopyRows : kGroup;
    int64_t j = i + 1;
    while (j < rows && j - i < most && (order[j] < d ? slots[order[j]] : base) == s) ++j;
    runs.push_back({i, j, s});
    i = j;
  }
  return runs;
}

template <typename T>
void decode_rows(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                 at::TensorList bs, const at::Tensor& ranks, const int64_t* slots, int64_t d,
                 const at::Tensor& out) {
  const int64_t rows = y.size(0), width = y.size(1), in = x.size(1), base = a.size(0) - 1;
  const int64_t nshards = static_cast<int64_t>(bs.size()), mr = bs[0].size(1);
  const int64_t big_r = a.size(1), ldx = x.stride(0), ldy = y.stride(0);
  std::vector<int64_t> order;
  const std::vector<Run> runs = runs_of(slots, d, rows, base, order);
  std::vector<int64_t> cols(nshards), ns(nshards);
  std::vector<const T*> bp(nshards);
  for (int64_t i = 0; i < nshards; ++i) {
    ns[i] = bs[i].size(2);
    bp[i] = bs[i].data_ptr<T>();
    if (i) cols[i] = cols[i - 1] + ns[i - 1];
  }
  const T *xp = x.data_ptr<T>(), *yp = y.data_ptr<T>(), *ap = a.data_ptr<T>();
  const int32_t* rk = ranks.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const auto fns = kernels<T>(detect_isa());
  const ShrinkFn<T> shrink = fns.first;
  const ExpandFn<T> expand = fns.second;
  parallel_chunks(static_cast<int64_t>(runs.size()), 1, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> scratch;  // NOTE: each row's R floats
    scratch.resize(kGroup * big_r);
    float* h = scratch.data();
    for (int64_t u = r0; u < r1; ++u) {
      const Run& run = runs[u];
      if (run.slot == base) {
        for (int64_t i = run.begin; i < run.end; ++i) {
          std::memcpy(op + order[i] * width, yp + order[i] * ldy, width * sizeof(T));
        }
        continue;
      }
      const int g = static_cast<int>(run.end - run.begin);
      const T *xs[kGroup], *ys[kGroup];
      T* os[kGroup];
      float* hs[kGroup];
      for (int64_t i = 0; i < nshards; ++i) {
        const int64_t r = rk[run.slot * nshards + i], n = ns[i];
        for (int k = 0; k < g; ++k) {
          const int64_t t = order[run.begin + k];
          xs[k] = xp + t * ldx;
          hs[k] = h + k * big_r + i * mr;
        }
        shrink(ap + (run.slot * big_r + i * mr) * in, r, in, g, xs, hs);
        for (int k = 0; k < g; ++k) {
          const int64_t t = order[run.begin + k];
          ys[k] = yp + t * ldy + cols[i];
          os[k] = op + t * width + cols[i];
        }
        expand(g, hs, r, bp[i] + run.slot * mr * n, n, ys, os);
      }
    }
  });
}

// y (N, out) with the decode rows' deltas added: rows t < D by slots[t]; a new tensor.
at::Tensor lora_decode(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                       at::TensorList bs, const at::Tensor& ranks, const at::Tensor& slots) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 3 && x.size(0) == y.size(0) &&
                  x.size(1) == a.size(2) && !bs.empty(),
              "lora_decode: y ", y.sizes(), ", x ", x.sizes(), ", a ", a.sizes(), " do not fit");
  const auto dtype = y.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "lora_decode wants float32 or bfloat16, got ", dtype);
  const int64_t nshards = static_cast<int64_t>(bs.size()), mr = bs[0].size(1);
  const int64_t s1 = a.size(0);
  TORCH_CHECK(a.size(1) == nshards * mr, "lora_decode: a has ", a.size(1), " rank rows for ",
              nshards, " shards of ", mr);
  int64_t width = 0;
  for (const auto& b : bs) {
    TORCH_CHECK(b.dim() == 3 && b.size(0) == s1 && b.size(1) == mr && b.is_contiguous() &&
                    b.scalar_type() == dtype && b.device().is_cpu(),
                "lora_decode: a shard's B is ", b.sizes(), " for ", s1, " slots of rank ", mr);
    width += b.size(2);
  }
  TORCH_CHECK(width == y.size(1), "lora_decode: the shards are ", width, " wide, y ", y.size(1));
  for (const auto* t : {&x, &a}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->device().is_cpu(),
                "lora_decode: x, y, a and B must share y's dtype, on the CPU");
  }
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.device().is_cpu() &&
                  ranks.sizes() == at::IntArrayRef({s1, nshards}),
              "lora_decode: ranks must be (", s1, ", ", nshards, ") int32, got ", ranks.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.device().is_cpu() &&
                  slots.size(0) <= y.size(0),
              "lora_decode: slots must be (D <= ", y.size(0), ") int64 on the CPU");
  const auto rk = ranks.contiguous();
  const auto sl = slots.contiguous();
  const int64_t d = sl.size(0);
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int32_t* rp = rk.data_ptr<int32_t>();
  for (int64_t t = 0; t < d; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < s1, "lora_decode: slot ", sp[t], " of row ", t,
                " is not one of ", s1);
    for (int64_t i = 0; i < nshards; ++i) {
      const int32_t r = rp[sp[t] * nshards + i];
      TORCH_CHECK(r >= 0 && r <= mr, "lora_decode: rank ", r, " of slot ", sp[t], " past ", mr);
    }
  }
  const auto inner = [](const at::Tensor& t) { return t.stride(1) == 1 ? t : t.contiguous(); };
  const auto x2 = inner(x), y2 = inner(y), a2 = a.contiguous();
  auto out = at::empty(y.sizes(), y.options().memory_format(at::MemoryFormat::Contiguous));
  if (dtype == at::kFloat) {
    decode_rows<float>(y2, x2, a2, bs, rk, sp, d, out);
  } else {
    decode_rows<at::BFloat16>(y2, x2, a2, bs, rk, sp, d, out);
  }
  return out;
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def(
      "lora_decode(Tensor y, Tensor x, Tensor a, Tensor[] bs, Tensor ranks, Tensor slots) "
      "-> Tensor",
        &warmboot::lora_decode);
}
