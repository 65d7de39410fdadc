// Flash attention for prefills on AMX tiles (bf16), shared by the ops of causal_prefill.cpp:
// a step's fresh prefills (K/V rows of the step) and chunks over cached context (K/V in the
// paged cache).
//
// Each (sequence, KV head) has its K and V repacked once into the tiles' pair layout; then a
// work item is 16 query rows of one query head: per block of 32 positions up to its last row's,
// scores = Q K^T on the tiles (fp32 sums), an online softmax step in fp32 (AVX-512, exp16),
// the probabilities rounded to bf16 and P V added on the tiles to the fp32 accumulator; the
// output divided by the denominator and rounded once: the arithmetic of torch's CPU flash
// kernel (fp32 scores and softmax, bf16 probabilities into the P V product), within its error
// of a float64 reference. An item is one thread's from start to end, so a call gives the same
// bits whoever runs it (helpers share the repacks and the items: parallel_chunks). One fresh
// sequence of 128 tokens, 9 query heads over 3 KV heads, head_dim 64, on one thread of a Xeon:
// 85 us, where SDPA took 190 (2048 tokens: 13 ms against 20).
#include "flash_prefill.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "amx.h"
#include "isa.h"
#include "pool.h"
#include "simd.h"

namespace warmboot {
namespace {

constexpr int64_t kMaxDim = 256;
constexpr int64_t kRows = 16;  // tokens an item
constexpr int64_t kSpan = 32;  // positions a block
constexpr float kRescale = 8.f;
constexpr int64_t kShareElements = 1 << 17;  // K values repacked from which helpers share it
constexpr int64_t kItemGrain = 8;            // items a claim

// K (n, d) -> blocks of 16 positions, each d/2 pair rows of 16 positions x 2 values (a QK^T
// B tile per 32 values of d); V (n, d) -> blocks of 32 positions, each 16 position-pair rows
// of d x 2 values (a P V B tile per 16 values of d), two rows interleaved 32 values a step.
// Positions past n are zeros. (d a multiple of 32.) A sequence's cached positions are read
// once here per layer and step.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
void repack(const Rows& k, const Rows& v, int64_t n, int64_t d, uint16_t* kp, uint16_t* vp) {
  const int64_t padded = (n + kSpan - 1) / kSpan * kSpan;
  std::memset(kp, 0, padded * d * 2);
  std::memset(vp, 0, padded * d * 2);
  for (int64_t p = 0; p < n; ++p) {
    uint16_t* kb = kp + (p / 16) * d * 16 + (p % 16) * 2;
    for (int64_t j = 0; j < d / 2; ++j) std::memcpy(kb + j * 32, k(p) + 2 * j, 4);
  }
  alignas(64) static const uint16_t order[64] = {
      0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
      11, 43, 12, 44, 13, 45, 14, 46, 15, 47, 16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
      22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(order), hi = _mm512_load_si512(order + 32);
  for (int64_t p = 0; p < n; p += 2) {
    uint16_t* vb = vp + (p / kSpan) * kSpan * d + (p % kSpan) / 2 * d * 2;
    const uint16_t *even = v(p), *odd = p + 1 < n ? v(p + 1) : nullptr;
    for (int64_t c = 0; c < d; c += 32) {
      const __m512i a = _mm512_loadu_si512(even + c);
      const __m512i b = odd ? _mm512_loadu_si512(odd + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(vb + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(vb + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}
#pragma GCC pop_options

#if WB_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")
struct Flash {  // one item's running state: rows r < rows are tokens t0 + r
  alignas(64) uint16_t q[kRows * kMaxDim];
  alignas(64) float s[kRows * kSpan];
  alignas(64) uint16_t p[kRows * kSpan];
  alignas(64) float o[kRows * kMaxDim];
  float m[kRows], l[kRows], alpha[kRows];
};

struct Part {  // an item: query rows [t0, t0 + rows), row r at position pos0 + r
  int64_t t0, rows, pos0;
  int64_t window;  // positions a row sees, its own included (0: every one before it)
  int64_t chunk;   // a row at p sees p - p % chunk .. p only (0: no chunks)
  float scale;
  float sink;  // a logit joining each row's softmax without a value (-inf: none)
  float cap;   // scores capped to cap tanh(score / cap) (0: none)
};

// Tiles: C 0-3 the accumulator where head_dim <= 64 (a tile per 16 values, resident through
// an item), else C 0 a column block of it at a time; C 4-5 the scores; A 6 Q or P; B 7 K or V.
// s = Q K^T for positions [32 b, 32 b + 32).
void scores(Flash& f, const uint16_t* kp, int64_t b, int64_t d) {
  _tile_zero(4);
  _tile_zero(5);
  const uint16_t* k0 = kp + 2 * b * d * 16;
  for (int64_t s = 0; s < d / 32; ++s) {
    _tile_loadd(6, f.q + 32 * s, d * 2);
    _tile_loadd(7, k0 + s * 16 * 32, 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, k0 + d * 16 + s * 16 * 32, 64);
    _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(4, f.s, kSpan * 4);
  _tile_stored(5, f.s + 16, kSpan * 4);
}

// Lane r of the result: op over the 16 lanes of v[r] (a transposing tree: 15 shuffle pairs
// for the 16 rows, where a reduction per row takes 4 each).
template <class Op>
__m512 across(const __m512 (&v)[kRows], Op op) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i) {  // per 128 bits: rows 2i, 2i + 1 over lanes {0, 2}, {1, 3}
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    u[i] = op(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // per 128 bits: rows 4i .. 4i + 3 over its 4 lanes
    const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
    w[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
              _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // NOTE: the shuffles' immediates must be constants: spelled out
  const __m512 x =
      op(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
  const __m512 y =
      op(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
  return op(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

__m512 max_of(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
__m512 sum_of(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }

// 16 scores scaled, soft-capped where `cap` (Gemma 2: cap tanh(x / cap)).
__m512 scaled(const float* x, __m512 sc, float cap) {
  const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x), sc);
  if (cap == 0.f) return y;
  return _mm512_mul_ps(_mm512_set1_ps(cap), tanh16(_mm512_mul_ps(y, _mm512_set1_ps(1.f / cap))));
}

// The first position a row at `pos` sees: its window's and its chunk's (0: every one before).
int64_t first_seen(const Part& it, int64_t pos) {
  const int64_t from = it.window ? pos + 1 - it.window : 0;
  return it.chunk ? std::max(from, pos - pos % it.chunk) : from;
}

// The block's scores scaled (and capped), positions a row does not see (past its own, before
// its window or its chunk; all, for padding rows) at -inf, in place; each row's max.
__m512 masked(Flash& f, const Part& it, int64_t p0) {
  const __m512 sc = _mm512_set1_ps(it.scale), ninf = _mm512_set1_ps(-INFINITY);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i lane16 = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
  __m512 top[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t own = it.pos0 + r - p0;
    const __m512i last = _mm512_set1_epi32(r < it.rows ? static_cast<int>(own) : -1);
    __mmask16 m0 = _mm512_cmple_epi32_mask(lane, last), m1 = _mm512_cmple_epi32_mask(lane16, last);
    if (it.window || it.chunk) {  // NOTE: and none before the window's or chunk's first
      const int64_t from = std::max<int64_t>(first_seen(it, it.pos0 + r) - p0, -kSpan);
      const __m512i first = _mm512_set1_epi32(static_cast<int>(from));
      m0 &= _mm512_cmpge_epi32_mask(lane, first);
      m1 &= _mm512_cmpge_epi32_mask(lane16, first);
    }
    float* x = f.s + r * kSpan;
    const __m512 x0 = _mm512_mask_mov_ps(ninf, m0, scaled(x, sc, it.cap));
    const __m512 x1 = _mm512_mask_mov_ps(ninf, m1, scaled(x + 16, sc, it.cap));
    _mm512_storeu_ps(x, x0);
    _mm512_storeu_ps(x + 16, x1);
    top[r] = _mm512_max_ps(x0, x1);
  }
  return across(top, max_of);
}

// 16 masked scores -> exp(x - m) (0 where masked) into 16 bf16 probabilities at p
__m512 probabilities(const float* x, __m512 m, uint16_t* p) {
  const __m512 s = _mm512_loadu_ps(x);
  const __mmask16 seen = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
  const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(s, m)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(e));
  return e;
}

// The online softmax step of each row over the block's positions p0 .. p0 + 31 (those past
// the row's token masked): m, l and the accumulator's factor alpha; p in bf16. As
// FlashAttention 4 does, a row's running max m moves only when the block's max exceeds it by
// more than kRescale (e^8: the probabilities stay far from float32's range): most blocks then
// leave every alpha at 1 and the accumulator as it is. Returns whether any row's m moved.
bool softmax(Flash& f, const Part& it, int64_t p0) {
  const __m512 old = _mm512_loadu_ps(f.m), top = masked(f, it, p0);
  const __m512 bar = _mm512_add_ps(old, _mm512_set1_ps(kRescale));
  const __mmask16 moved = _mm512_cmp_ps_mask(top, bar, _CMP_GT_OQ);
  const __m512 now = _mm512_mask_blend_ps(moved, old, top);
  alignas(64) float m[kRows];
  _mm512_store_ps(m, now);
  __m512 part[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const __m512 mv = _mm512_set1_ps(r < it.rows ? m[r] : 0.f);  // NOTE: masked: 0 anyway
    const float* x = f.s + r * kSpan;
    part[r] = _mm512_add_ps(probabilities(x, mv, f.p + r * kSpan),
                            probabilities(x + 16, mv, f.p + r * kSpan + 16));
  }
  const __m512 l = _mm512_loadu_ps(f.l), sum = across(part, sum_of);
  if (!moved) {
    _mm512_storeu_ps(f.l, _mm512_add_ps(l, sum));
    return false;
  }
  // alpha = exp(m_old - m_new) where m moved (0 from -inf: the first block), else 1
  const __m512 alpha =
      _mm512_mask_blend_ps(moved, _mm512_set1_ps(1.f), exp16(_mm512_sub_ps(old, now)));
  _mm512_storeu_ps(f.alpha, alpha);
  _mm512_storeu_ps(f.m, now);
  _mm512_storeu_ps(f.l, _mm512_fmadd_ps(l, alpha, sum));
  return true;
}

void rescale(Flash& f, int64_t d) {  // o *= alpha, row by row
  for (int64_t r = 0; r < kRows; ++r) {
    const __m512 a = _mm512_set1_ps(f.alpha[r]);
    for (int64_t c = 0; c < d; c += 16) {
      float* o = f.o + r * d + c;
      _mm512_storeu_ps(o, _mm512_mul_ps(a, _mm512_loadu_ps(o)));
    }
  }
}

// The resident accumulator's tiles to or from f.o (head_dim d <= 64).
void park(Flash& f, int64_t d, bool store) {
  const int64_t ld = d * 4;
#define WB_TILE(t)                                                   \
  if (16 * (t) < d) {                                                \
    if (store) {                                                     \
      _tile_stored(t, f.o + 16 * (t), ld);                           \
    } else {                                                         \
      _tile_loadd(t, f.o + 16 * (t), ld);                            \
    }                                                                \
  }
  WB_TILE(0) WB_TILE(1) WB_TILE(2) WB_TILE(3)
#undef WB_TILE
}

// o = alpha o (where `moved`) + P V for the block b.
void accumulate(Flash& f, const uint16_t* vp, int64_t b, int64_t d, bool moved) {
  const uint16_t* v0 = vp + b * kSpan * d;
  const bool resident = d <= 64;
  if (moved) {
    if (resident) park(f, d, true);
    rescale(f, d);
    if (resident) park(f, d, false);
  }
  _tile_loadd(6, f.p, kSpan * 2);
  if (resident) {
#define WB_TILE(t)                             \
  if (16 * (t) < d) {                          \
    _tile_loadd(7, v0 + 32 * (t), d * 4);      \
    _tile_dpbf16ps(t, 6, 7);                   \
  }
    WB_TILE(0) WB_TILE(1) WB_TILE(2) WB_TILE(3)
#undef WB_TILE
    return;
  }
  for (int64_t c = 0; c < d; c += 16) {
    _tile_loadd(0, f.o + c, d * 4);
    _tile_loadd(7, v0 + 2 * c, d * 4);
    _tile_dpbf16ps(0, 6, 7);
    _tile_stored(0, f.o + c, d * 4);
  }
}

// An item's query rows of one head (q rows ldq apart) into out (ldo apart).
void item(Flash& f, const uint16_t* q, int64_t ldq, const uint16_t* kp, const uint16_t* vp,
          uint16_t* out, int64_t ldo, int64_t d, const Part& it) {
  std::memset(f.q, 0, kRows * d * 2);
  for (int64_t r = 0; r < it.rows; ++r) std::memcpy(f.q + r * d, q + (it.t0 + r) * ldq, d * 2);
  std::fill_n(f.o, kRows * d, 0.f);
  for (int64_t r = 0; r < kRows; ++r) {  // NOTE: a sink starts a row at m = sink, l = 1
    const bool sink = r < it.rows && it.sink > -INFINITY;
    f.m[r] = sink ? it.sink : -INFINITY, f.l[r] = sink ? 1.f : 0.f;
  }
  if (d <= 64) park(f, d, false);
  const int64_t lo = std::max<int64_t>(0, first_seen(it, it.pos0)) / kSpan;
  for (int64_t b = lo; b * kSpan < it.pos0 + it.rows; ++b) {
    scores(f, kp, b, d);
    // NOTE: the first block's accumulator is zeros, whatever alpha
    accumulate(f, vp, b, d, softmax(f, it, b * kSpan) && b > lo);
  }
  if (d <= 64) park(f, d, true);
  for (int64_t r = 0; r < it.rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / f.l[r]);
    for (int64_t c = 0; c < d; c += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(f.o + r * d + c), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (it.t0 + r) * ldo + c),
                          (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}
#pragma GCC pop_options
#else
struct Flash {};
struct Part {
  int64_t t0, rows, pos0, window, chunk;
  float scale, sink, cap;
};
void item(Flash&, const uint16_t*, int64_t, const uint16_t*, const uint16_t*, uint16_t*, int64_t,
          int64_t, const Part&) {}
#endif

}  // namespace

void flash_amx(const at::Tensor& q, const at::Tensor& out, const std::vector<FlashSeq>& seqs,
               int64_t hkv, const FlashOpts& opts, const RowsOf& rows_of) {
  const int64_t nseq = static_cast<int64_t>(seqs.size()), d = q.size(2);
  const int64_t group = q.size(1) / hkv;
  // per sequence, prefix sums: its packed K (and V) elements, its items
  std::vector<int64_t> packed(nseq + 1, 0), items(nseq + 1, 0);
  auto padded = [&](int64_t i) { return (seqs[i].ctx + kSpan - 1) / kSpan * kSpan; };
  for (int64_t i = 0; i < nseq; ++i) {
    packed[i + 1] = packed[i] + padded(i) * d * hkv;
    items[i + 1] = items[i] + (seqs[i].n + kRows - 1) / kRows * hkv * group;
  }
  auto kv = at::empty({2, packed[nseq]}, q.options());
  auto* kp = reinterpret_cast<uint16_t*>(kv.data_ptr<at::BFloat16>());
  uint16_t* vp = kp + packed[nseq];
  // NOTE: a small repack (a short prompt's) runs on the caller: a helper's wake-up costs more
  const int64_t grain = packed[nseq] < kShareElements ? nseq * hkv : 1;
  parallel_chunks(nseq * hkv, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i = c / hkv, h = c % hkv, at = packed[i] + h * padded(i) * d;
      repack(rows_of(i, h, false), rows_of(i, h, true), seqs[i].ctx, d, kp + at, vp + at);
    }
  });
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  parallel_chunks(items[nseq], kItemGrain, [&](int64_t c0, int64_t c1) {
    thread_local Flash f;
    amx_configure();
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i = std::upper_bound(items.begin(), items.end(), c) - items.begin() - 1;
      const FlashSeq& s = seqs[i];
      const int64_t local = c - items[i], tiles = (s.n + kRows - 1) / kRows;
      const int64_t head = local / tiles, t0 = local % tiles * kRows;
      const int64_t at = packed[i] + head / group * padded(i) * d;
      const float sink = opts.sinks ? opts.sinks[head] : -INFINITY;
      const Part it{t0, std::min(kRows, s.n - t0), s.ctx - s.n + t0, opts.window,
                    opts.chunk, static_cast<float>(opts.scale), sink, opts.softcap};
      item(f, bits(q) + s.start * q.stride(0) + head * d, q.stride(0), kp + at, vp + at,
           o + s.start * out.stride(0) + head * d, out.stride(0), d, it);
    }
    amx_release();
  });
}

bool flash_fits(const at::Tensor& q, const at::Tensor& out) {
  const int64_t d = q.size(2);
  auto rows = [](const at::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2); };
  return WB_AMX && q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
         d % 32 == 0 && d <= kMaxDim && rows(q) && rows(out) && amx_ready();
}

}  // namespace warmboot
