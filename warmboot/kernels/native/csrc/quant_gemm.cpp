// Weight-only quantized GEMM at decode sizes (1 to ~64 rows): y = x @ dequant(W).T + b, W kept
// as 4- or 8-bit codes, dequantized in registers and streamed once per call (panels in chunks,
// as gemm.cpp: parallel_chunks, the next panel fetched while one computes).
//
// Layout "panel32" (fixed, the same on every ISA: snapshots store it): codes (N, K) uint8 in
// P = ceil(N/32) panels of 32 output rows, rows past N zero;
// - bits 8: (P, K, 32), [p, k, c] = codes[32p + c, k];
// - bits 4: (P, K/2, 32), [p, j, c] = codes[32p + c, 2j] | codes[32p + c, 2j + 1] << 4.
// scales (P, G, 32) fp16/bf16/fp32 (G = K / group_size), zeros (P, G, 32) uint8 or none
// (symmetric: 2^(bits-1)). y[m, n] = sum_g s[n,g] * sum_{k in g} x[m,k] * (u[n,k] - z[n,g]).
// A group sums part = x . u in fp32 (u small exact integers), then acc += s * part - (z * s) * xs
// with xs the group's sum of x (once per call). With bf16 x on AVX-512 BF16, dot products take
// a k pair an instruction: 8-bit codes become bf16 u (fp32 u's high half: 8 significant bits),
// 4-bit ones bf16 16 + u by bits alone (exponent 2^4, u in mantissa bits 3-6; 16 + z comes off).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "isa.h"
#include "pool.h"

namespace warmboot {
namespace {

constexpr int64_t kCols = 32;
enum ScaleType : int { kF32, kF16, kBF16 };

// One call's operands.
struct Call {
  int64_t m, k, gs, groups;  // rows, in_features, group size, groups
  const float* x;            // (m, k) fp32 rows (the fp32 kernels)
  const uint16_t* xb;        // (m, k) bf16 rows (the BF16 dot products)
  const float* xs;           // (m, groups): each group's sum of x
  int sdt;                   // the scales' ScaleType
  float zsym;                // the zero point where there are no zeros
};

// One panel's weights, scales and zeros (or null); pf: the panel the kernel fetches into cache
// as it goes (the next one; where there is none, this one: no branch in the loop).
struct Panel {
  const uint8_t *w;
  const char* s;
  const uint8_t *z, *pf;
};

inline void fetch(const Panel& q, int64_t off) {
  _mm_prefetch(reinterpret_cast<const char*>(q.pf + off), _MM_HINT_T0);
}

inline float scale_at(const char* s, int sdt, int64_t i) {
  if (sdt == kF32) return reinterpret_cast<const float*>(s)[i];
  if (sdt == kF16) return static_cast<float>(reinterpret_cast<const at::Half*>(s)[i]);
  return static_cast<float>(reinterpret_cast<const at::BFloat16*>(s)[i]);
}

inline const __m128i* at16(const void* p) { return static_cast<const __m128i*>(p); }

// nibbles_bf16's vpshufb control: bytes 1 and 2 of 32-bit lane i take byte i, 0 and 3 zero
struct NibbleCtl {
  alignas(64) int8_t b[64] = {};
  constexpr NibbleCtl() {
    for (int i = 0; i < 64; ++i) b[i] = i % 4 == 0 || i % 4 == 3 ? -128 : i / 4 % 4 + i / 16 * 4;
  }
};
constexpr NibbleCtl kNibbleCtl;

// Rows [r0, r0 + mr) as one block of MR rows, from the largest kernel down.
#define QG_BLOCK_OF(NAME, KERNEL)                                                \
  template <int MR, int BITS, bool DP>                                           \
  void NAME(int64_t mr, const Call& c, const Panel& q, int64_t r0, float* acc) { \
    if constexpr (MR > 1) {                                                      \
      if (mr < MR) return NAME<MR - 1, BITS, DP>(mr, c, q, r0, acc);             \
    }                                                                            \
    KERNEL<MR, BITS, DP>(c, q, r0, acc);                                         \
  }
#define QG_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma")
inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(at16(p))));
}

inline __m512 scales16(const char* s, int sdt, int64_t i) {
  if (sdt == kF32) return _mm512_loadu_ps(reinterpret_cast<const float*>(s) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * i));
  if (sdt == kF16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// (z + off) * s of 16 columns from index i
inline __m512 zs16(const Panel& q, const Call& c, int64_t i, float off, __m512 s) {
  const __m512 z = q.z ? u8x16(q.z + i) : _mm512_set1_ps(c.zsym);
  return _mm512_mul_ps(_mm512_add_ps(z, _mm512_set1_ps(off)), s);
}

// bf16 pairs (row k, row k + 1) of 16 columns of 8-bit codes (TAIL: row k alone): the high
// half of fp32 u is bf16 u exactly.
template <bool TAIL>
inline __m512bh bytes_bf16(const uint8_t* b) {
  const __m512i e = _mm512_srli_epi32(_mm512_castps_si512(u8x16(b)), 16);
  if constexpr (TAIL) return (__m512bh)e;
  const __m512i o = _mm512_castps_si512(u8x16(b + kCols)), hi = _mm512_set1_epi32(0xFFFF0000);
  return (__m512bh)_mm512_ternarylogic_epi32(e, o, hi, 0xF8);  // a | b & c
}

// bf16 pairs 16 + u of 16 columns of nibble pairs: each column's byte twice in its 32-bit lane
// (vpshufb within 128-bit lanes of 4 columns), shifted into mantissa bits 3-6 (the even k's
// from byte 1 by 5, the odd k's from byte 2 by 1), masked, exponent 2^4 OR'd in.
inline __m512bh nibbles_bf16(const uint8_t* p, __m512i ctl) {
  const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(at16(p)));
  const __m512i t = _mm512_srlv_epi16(_mm512_shuffle_epi8(b, ctl), _mm512_set1_epi32(0x10005));
  return (__m512bh)_mm512_ternarylogic_epi32(t, _mm512_set1_epi32(0x00780078),
                                             _mm512_set1_epi32(0x41804180), 0xEA);  // a & b | c
}

// NOTE: named accumulators, not arrays (gemm.cpp's NOTE). p takes the even k (fp32) or even k
// pairs (dot products), q the others where SPLIT: few rows still have independent chains.
#define QG_DECL(r) __m512 p##r##0 = _mm512_setzero_ps(), p##r##1 = p##r##0, q##r##0 = p##r##0, \
                          q##r##1 = p##r##0;
#define QG_FMA(r)                                                              \
  if constexpr (MR > r) {                                                      \
    const __m512 xe = _mm512_set1_ps(x[r * c.k + kk]);                         \
    p##r##0 = _mm512_fmadd_ps(xe, e0, p##r##0);                                \
    p##r##1 = _mm512_fmadd_ps(xe, e1, p##r##1);                                \
    if constexpr (!tail) {                                                     \
      const __m512 xo = _mm512_set1_ps(x[r * c.k + kk + 1]);                   \
      __m512 &a0 = SPLIT ? q##r##0 : p##r##0, &a1 = SPLIT ? q##r##1 : p##r##1; \
      a0 = _mm512_fmadd_ps(xo, o0, a0);                                        \
      a1 = _mm512_fmadd_ps(xo, o1, a1);                                        \
    }                                                                          \
  }
#define QG_DP(r)                                                                         \
  if constexpr (MR > r) {                                                                \
    int32_t pair = 0;                                                                    \
    std::memcpy(&pair, xb + r * c.k + kk, tail ? 2 : 4);                                 \
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                               \
    __m512 &a0 = SPLIT && odd ? q##r##0 : p##r##0, &a1 = SPLIT && odd ? q##r##1 : p##r##1; \
    a0 = _mm512_dpbf16_ps(a0, xv, v0);                                                   \
    a1 = _mm512_dpbf16_ps(a1, xv, v1);                                                   \
  }
// k pair (K0, K0 + 1), TAIL: K0 alone (an odd 8-bit group's last)
#define QG_STEP(K0, ODD, TAIL)                                                         \
  {                                                                                    \
    const int64_t kk = K0;                                                             \
    constexpr bool odd = ODD, tail = TAIL;                                             \
    const uint8_t* b = q.w + kk * kCols * BITS / 8;                                    \
    fetch(q, kk * kCols * BITS / 8);                                                   \
    if constexpr (DP) {                                                                \
      const __m512bh v0 = BITS == 4 ? nibbles_bf16(b, ctl) : bytes_bf16<tail>(b);      \
      const __m512bh v1 = BITS == 4 ? nibbles_bf16(b + 16, ctl) : bytes_bf16<tail>(b + 16); \
      QG_ROWS(QG_DP)                                                                   \
    } else {                                                                           \
      __m512 e0, e1, o0, o1;                                                           \
      if constexpr (BITS == 8) {                                                       \
        e0 = u8x16(b), e1 = u8x16(b + 16);                                             \
        if constexpr (!tail) o0 = u8x16(b + 32), o1 = u8x16(b + 48);                   \
      } else {                                                                         \
        const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(at16(b)));             \
        const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(at16(b + 16)));        \
        const __m512i lo = _mm512_set1_epi32(15);                                      \
        e0 = _mm512_cvtepi32_ps(_mm512_and_si512(b0, lo));                             \
        e1 = _mm512_cvtepi32_ps(_mm512_and_si512(b1, lo));                             \
        o0 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4));                             \
        o1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4));                             \
      }                                                                                \
      QG_ROWS(QG_FMA)                                                                  \
    }                                                                                  \
  }
// acc (row r's 32 fp32) += s * (p + q) - zs * xs
#define QG_FLUSH(r)                                                                    \
  if constexpr (MR > r) {                                                              \
    if constexpr (SPLIT) p##r##0 = _mm512_add_ps(p##r##0, q##r##0);                    \
    if constexpr (SPLIT) p##r##1 = _mm512_add_ps(p##r##1, q##r##1);                    \
    const __m512 xr = _mm512_set1_ps(xs[r * c.groups + g]);                            \
    float* ar = acc + r * kCols;                                                       \
    const __m512 a0 = _mm512_fmadd_ps(s0, p##r##0, _mm512_loadu_ps(ar));               \
    const __m512 a1 = _mm512_fmadd_ps(s1, p##r##1, _mm512_loadu_ps(ar + 16));          \
    _mm512_storeu_ps(ar, _mm512_fnmadd_ps(zs0, xr, a0));                               \
    _mm512_storeu_ps(ar + 16, _mm512_fnmadd_ps(zs1, xr, a1));                          \
  }

// Rows r0 .. r0 + MR - 1 against one panel: acc (MR, 32) += their sums. DP: BF16 dot products.
template <int MR, int BITS, bool DP>
void panel512(const Call& c, const Panel& q, int64_t r0, float* acc) {
  constexpr bool SPLIT = MR <= 4;
  const float* x = DP ? nullptr : c.x + r0 * c.k;
  const uint16_t* xb = DP ? c.xb + r0 * c.k : nullptr;
  const float* xs = c.xs + r0 * c.groups;
  const __m512i ctl = _mm512_load_si512(kNibbleCtl.b);
  for (int64_t g = 0; g < c.groups; ++g) {
    QG_ROWS(QG_DECL)
    const int64_t kend = (g + 1) * c.gs;
    int64_t k0 = g * c.gs;
    for (; k0 + 3 < kend; k0 += 4) {
      QG_STEP(k0, false, false)
      QG_STEP(k0 + 2, true, false)
    }
    if (k0 + 1 < kend) QG_STEP(k0, false, false)
    if ((kend - k0) % 2) QG_STEP(kend - 1, false, true)
    const float off = DP && BITS == 4 ? 16.f : 0.f;
    const __m512 s0 = scales16(q.s, c.sdt, g * kCols), s1 = scales16(q.s, c.sdt, g * kCols + 16);
    const __m512 zs0 = zs16(q, c, g * kCols, off, s0), zs1 = zs16(q, c, g * kCols + 16, off, s1);
    QG_ROWS(QG_FLUSH)
  }
}
QG_BLOCK_OF(block512, panel512)

// One panel, blocks of up to 8 rows; the first fetches the next panel, the others re-read
// this one from cache.
template <int BITS, bool DP>
void panels512(const Call& c, Panel q, float* acc) {
  for (int64_t r = 0; r < c.m; r += 8) {
    block512<8, BITS, DP>(std::min<int64_t>(8, c.m - r), c, q, r, acc + r * kCols);
    q.pf = q.w;
  }
}
#pragma GCC pop_options

// p, q: even and odd k; t, u: the same for every other k pair where MR <= 2 (more chains)
#define Q2_DECL(r) __m256 p##r = _mm256_setzero_ps(), q##r = p##r, t##r = p##r, u##r = p##r;
#define Q2_FMA(r, A, B, K, W)                                                \
  if constexpr (MR > r) {                                                   \
    __m256& a = alt ? A##r : B##r;                                          \
    a = _mm256_fmadd_ps(_mm256_set1_ps(x[r * c.k + K]), W, a);              \
  }
#define Q2_EVEN(r) Q2_FMA(r, t, p, kk, e)
#define Q2_ODD(r) Q2_FMA(r, u, q, kk + 1, o)
// k pair (K0, K0 + 1) of slice h
#define Q2_PAIR(K0, ALT)                                                     \
  {                                                                         \
    const int64_t kk = K0;                                                  \
    constexpr bool alt = ALT && MR <= 2;                                    \
    const uint8_t* b = q.w + kk * kCols * BITS / 8 + 8 * h;                 \
    if (h == 0) fetch(q, kk * kCols * BITS / 8);                            \
    __m256 e, o;                                                            \
    if constexpr (BITS == 8) {                                              \
      e = u8x8(b), o = u8x8(b + kCols);                                     \
    } else {                                                                \
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(at16(b)));     \
      e = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));   \
      o = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));                      \
    }                                                                       \
    Q2_ROWS(Q2_EVEN)                                                        \
    Q2_ROWS(Q2_ODD)                                                         \
  }
#define Q2_FLUSH(r)                                                                \
  if constexpr (MR > r) {                                                          \
    float* ar = acc + r * kCols + 8 * h;                                           \
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(p##r, q##r), _mm256_add_ps(t##r, u##r)); \
    __m256 a = _mm256_fmadd_ps(s, sum, _mm256_loadu_ps(ar));                       \
    if (last) a = _mm256_fnmadd_ps(zs, _mm256_set1_ps(xs[r * c.groups + g]), a);   \
    _mm256_storeu_ps(ar, a);                                                       \
  }
#define Q2_ROWS(F) F(0) F(1) F(2) F(3)

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(at16(p))));
}

inline __m256 scales8(const char* s, int sdt, int64_t i) {
  static const bool f16c = __builtin_cpu_supports("f16c");
  if (sdt == kF32) return _mm256_loadu_ps(reinterpret_cast<const float*>(s) + i);
  const __m128i h = _mm_loadu_si128(at16(s + 2 * i));
  if (sdt == kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  if (f16c) return _mm256_cvtph_ps(h);
  float f[8];
  for (int j = 0; j < 8; ++j) f[j] = scale_at(s, sdt, i + j);
  return _mm256_loadu_ps(f);
}

// AVX2 (16 registers): a slice of 8 columns at a time, over blocks of up to 64 k whose weights
// stay in L1 while the four slices read them; s * part per block, (z * s) * xs per group.
template <int MR, int BITS, bool>
void panel_avx2(const Call& c, const Panel& q, int64_t r0, float* acc) {
  const float *x = c.x + r0 * c.k, *xs = c.xs + r0 * c.groups;
  for (int64_t g = 0; g < c.groups; ++g) {
    const int64_t kend = (g + 1) * c.gs;
    for (int64_t kb = g * c.gs; kb < kend; kb += 64) {
      const int64_t bend = std::min(kend, kb + 64);
      const bool last = bend == kend;
      for (int h = 0; h < 4; ++h) {
        Q2_ROWS(Q2_DECL)
        int64_t k0 = kb;
        for (; k0 + 3 < bend; k0 += 4) {
          Q2_PAIR(k0, false)
          Q2_PAIR(k0 + 2, true)
        }
        if (k0 + 1 < bend) Q2_PAIR(k0, false)
        if ((bend - k0) % 2) {  // an odd group (8 bits): its last k
          const int64_t kk = bend - 1;
          constexpr bool alt = false;
          const __m256 e = u8x8(q.w + kk * kCols + 8 * h);
          Q2_ROWS(Q2_EVEN)
        }
        const __m256 s = scales8(q.s, c.sdt, g * kCols + 8 * h);
        const __m256 z = q.z ? u8x8(q.z + g * kCols + 8 * h) : _mm256_set1_ps(c.zsym);
        const __m256 zs = _mm256_mul_ps(z, s);
        Q2_ROWS(Q2_FLUSH)
      }
    }
  }
}
QG_BLOCK_OF(block_avx2, panel_avx2)

template <int BITS, bool DP>
void panels_avx2(const Call& c, Panel q, float* acc) {
  for (int64_t r = 0; r < c.m; r += 4) {
    block_avx2<4, BITS, DP>(std::min<int64_t>(4, c.m - r), c, q, r, acc + r * kCols);
    q.pf = q.w;
  }
}
#pragma GCC pop_options

// Plain C++: k by k, each k's 32 weights converted once for every row.
template <int BITS, bool>
void panels_portable(const Call& c, Panel q, float* acc) {
  thread_local std::vector<float> part;
  for (int64_t g = 0; g < c.groups; ++g) {
    part.assign(c.m * kCols, 0.f);
    for (int64_t k = g * c.gs; k < (g + 1) * c.gs; ++k) {
      const uint8_t* b = q.w + (BITS == 8 ? k : k / 2) * kCols;
      float w[kCols];
      for (int i = 0; i < kCols; ++i) w[i] = BITS == 8 ? b[i] : k % 2 ? b[i] >> 4 : b[i] & 15;
      for (int64_t r = 0; r < c.m; ++r) {
        float* __restrict pr = part.data() + r * kCols;
        const float xv = c.x[r * c.k + k];
        for (int i = 0; i < kCols; ++i) pr[i] += xv * w[i];
      }
    }
    for (int i = 0; i < kCols; ++i) {
      const float s = scale_at(q.s, c.sdt, g * kCols + i);
      const float zs = (q.z ? q.z[g * kCols + i] : c.zsym) * s;
      for (int64_t r = 0; r < c.m; ++r) {
        acc[r * kCols + i] += s * part[r * kCols + i] - zs * c.xs[r * c.groups + g];
      }
    }
  }
}

// One panel's (m, 32) sums plus bias into y's columns [n0, n0 + 32) (bf16: nearest even).
void store(const float* acc, int64_t m, const at::Tensor& y, const at::Tensor& bias, int64_t n0) {
  const int64_t n = y.size(1), width = std::min(kCols, n - n0);
  const bool wide = bias.defined() && bias.scalar_type() == at::kFloat;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "quant_linear", [&] {
    scalar_t* dst = y.data_ptr<scalar_t>() + n0;
    const float* bf = wide ? bias.data_ptr<float>() + n0 : nullptr;
    const scalar_t* bx = bias.defined() && !wide ? bias.data_ptr<scalar_t>() + n0 : nullptr;
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t i = 0; i < width; ++i) {
        const float b = bf ? bf[i] : bx ? static_cast<float>(bx[i]) : 0.f;
        dst[r * n + i] = acc[r * kCols + i] + b;
      }
    }
  });
}

using Panels = void (*)(const Call&, Panel, float*);

// The panel kernels for this CPU's set: the BF16 dot products (dp) for bf16 x (8 bits: from 2
// rows; one row runs faster on fp32 FMAs).
template <int BITS>
Panels pick(bool bf16_x, int64_t m, bool* dp) {
  const Isa isa = detect_isa();
  *dp = isa == Isa::Avx512Bf16 && bf16_x && (BITS == 4 || m > 1);
  if (*dp) return panels512<BITS, true>;
  if (isa == Isa::Avx512Bf16 || isa == Isa::Avx512) return panels512<BITS, false>;
  return isa == Isa::Avx2 ? panels_avx2<BITS, false> : panels_portable<BITS, false>;
}

at::Tensor quant_pack(const at::Tensor& codes, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_pack: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte,
              "quant_pack wants 2-D uint8 codes (out_features, in_features), got ", codes.sizes(),
              " ", codes.scalar_type());
  const int64_t n = codes.size(0), k = codes.size(1), rows = bits == 8 ? k : k / 2;
  TORCH_CHECK(bits == 8 || k % 2 == 0, "quant_pack: 4-bit codes need an even in_features, got ", k);
  TORCH_CHECK(bits == 8 || n * k == 0 || codes.max().item<uint8_t>() < 16,
              "quant_pack: 4-bit codes must be below 16");
  auto out = at::zeros({(n + kCols - 1) / kCols, rows, kCols}, codes.options());
  const at::Tensor src = codes.contiguous();
  const uint8_t* from = src.data_ptr<uint8_t>();
  uint8_t* to = out.data_ptr<uint8_t>();
  at::parallel_for(0, out.size(0), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t t0 = 0; t0 < rows; t0 += 64) {  // 2 KB written a pass, from 32 rows' strips
        for (int64_t c = 0; c < std::min(kCols, n - p * kCols); ++c) {
          const uint8_t* row = from + (p * kCols + c) * k;
          for (int64_t t = t0; t < std::min(rows, t0 + 64); ++t) {
            to[(p * rows + t) * kCols + c] = bits == 8 ? row[t] : row[2 * t] | row[2 * t + 1] << 4;
          }
        }
      }
    }
  });
  return out;
}

void check_inputs(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                  const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias,
                  int64_t n, int64_t bits, int64_t gs) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(),
              "quant_linear wants a weight from quant_pack");
  const int64_t panels = packed.size(0), k = packed.size(1) * (bits == 8 ? 1 : 2);
  const auto xt = x.scalar_type(), st = scales.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16,
              "quant_linear wants float32 or bfloat16 rows, got ", xt);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "quant_linear: x has ", x.size(-1),
              " features, the weight ", k);
  TORCH_CHECK(n > (panels - 1) * kCols && n <= panels * kCols, "quant_linear: out_features ", n,
              " does not match the packed weight");
  TORCH_CHECK(gs > 0 && k % gs == 0, "quant_linear: group_size ", gs, " does not divide ", k);
  TORCH_CHECK(bits == 8 || gs % 2 == 0, "quant_linear: 4 bits need an even group_size, got ", gs);
  const std::vector<int64_t> want{panels, k / gs, kCols};
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16,
              "quant_linear: scales must be float16, bfloat16 or float32, got ", st);
  TORCH_CHECK(scales.sizes() == want, "quant_linear: scales must be ", at::IntArrayRef(want),
              ", got ", scales.sizes());
  TORCH_CHECK(!zeros || (zeros->scalar_type() == at::kByte && zeros->sizes() == want),
              "quant_linear: zeros must be uint8 ", at::IntArrayRef(want));
  TORCH_CHECK(!bias || (bias->numel() == n && (bias->scalar_type() == at::kFloat ||
                                               bias->scalar_type() == xt)),
              "quant_linear: bias must hold out_features values, float32 or x's dtype");
}

// The rows as the kernels read them (fp32: a bf16 x converted into buf) and each group's sum of
// x (in double, rounded once) into xs.
void rows_and_sums(const at::Tensor& x, Call& c, bool dp, std::vector<float>& buf,
                   std::vector<float>& xs) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  const auto* xb = bf16 ? x.data_ptr<at::BFloat16>() : nullptr;
  if (bf16 && !dp) {
    buf.resize(c.m * c.k);
    for (int64_t i = 0; i < c.m * c.k; ++i) buf[i] = float(xb[i]);
    xf = buf.data();
  }
  xs.resize(c.m * c.groups);
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t g = 0; g < c.groups; ++g) {
      double t = 0;
      for (int64_t i = r * c.k + g * c.gs; i < r * c.k + (g + 1) * c.gs; ++i) {
        t += xf ? xf[i] : float(xb[i]);
      }
      xs[r * c.groups + g] = static_cast<float>(t);
    }
  }
  c.x = dp ? nullptr : xf;
  c.xb = dp ? reinterpret_cast<const uint16_t*>(xb) : nullptr;
  c.xs = xs.data();
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const std::optional<at::Tensor>& zeros,
                        const std::optional<at::Tensor>& bias, int64_t n, int64_t bits,
                        int64_t gs) {
  check_inputs(x, packed, scales, zeros, bias, n, bits, gs);
  const int64_t panels = packed.size(0), k = x.size(-1), groups = k / gs;
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  const at::Tensor x2 = x.contiguous();
  const int64_t m = x2.numel() / k;
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y.view(out_shape);
  bool dp = false;
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
  const Panels kernel = bits == 8 ? pick<8>(bf16_x, m, &dp) : pick<4>(bf16_x, m, &dp);
  const auto st = scales.scalar_type();
  const int sdt = st == at::kFloat ? kF32 : st == at::kHalf ? kF16 : kBF16;
  Call c{m, k, gs, groups, nullptr, nullptr, nullptr, sdt, float(1 << (bits - 1))};
  thread_local std::vector<float> buf, xs;
  rows_and_sums(x2, c, dp, buf, xs);
  const at::Tensor s = scales.contiguous(), z = zeros ? zeros->contiguous() : at::Tensor();
  const at::Tensor b = bias ? bias->contiguous().view(-1) : at::Tensor();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t pbytes = packed.size(1) * kCols, sbytes = groups * kCols * s.element_size();
  // NOTE: chunks of about 256 KB (at least 2 panels; 4 chunks where there are panels enough):
  // a chunk's first panel goes unfetched, and 64 KB chunks lost a third of 2 threads' speed
  const int64_t grain = std::clamp<int64_t>((int64_t(1) << 18) / pbytes, 2,
                                            std::max<int64_t>(2, (panels + 3) / 4));
  parallel_chunks(panels, grain, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> acc;
    for (int64_t p = p0; p < p1; ++p) {
      acc.assign(m * kCols, 0.f);
      const Panel q{w + p * pbytes, static_cast<const char*>(s.data_ptr()) + p * sbytes,
                    z.defined() ? z.data_ptr<uint8_t>() + p * groups * kCols : nullptr,
                    w + (p + 1 < p1 ? p + 1 : p) * pbytes};
      kernel(c, q, acc.data());
      store(acc.data(), m, y, b, p * kCols);
    }
  });
  return y.view(out_shape);
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def("quant_pack(Tensor codes, int bits) -> Tensor", &warmboot::quant_pack);
  m.def("quant_linear(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, Tensor? bias, "
        "int out_features, int bits, int group_size) -> Tensor",
        &warmboot::quant_linear);
}
