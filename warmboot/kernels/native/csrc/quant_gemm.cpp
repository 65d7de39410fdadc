// Weight-only quantized GEMM at decode sizes (1 to ~64 rows): y = x @ dequant(W).T + b, W kept
// as 4- or 8-bit integer codes or FP8 e4m3 / FP4 e2m1 ones, dequantized in registers and
// streamed once per call (panels in chunks, as gemm.cpp: parallel_chunks, the next panel fetched
// while one computes).
//
// Layout "panel32" (fixed, the same on every ISA: snapshots store it): codes (N, K) uint8 in
// P = ceil(N/32) panels of 32 output rows, rows past N zero;
// - bits 8 (and FP8, bits -8): (P, K, 32), [p, k, c] = codes[32p + c, k];
// - bits 4 (and FP4, bits -4): (P, K/2, 32), [p, j, c] = codes[32p + c, 2j] |
//   codes[32p + c, 2j + 1] << 4.
// scales (P, G, 32) fp16/bf16/fp32 (G = K / group_size), zeros (P, G, 32) uint8 or none
// (symmetric: 2^(bits-1)). y[m, n] = sum_g s[n,g] * sum_{k in g} x[m,k] * (u[n,k] - z[n,g]).
// A group sums part = x . u in fp32 (u small exact integers), then acc += s * part - (z * s) * xs
// with xs the group's sum of x (once per call). With bf16 x on AVX-512 BF16, dot products take
// a k pair an instruction: 8-bit codes become bf16 u (fp32 u's high half: 8 significant bits),
// 4-bit ones bf16 16 + u by bits alone (exponent 2^4, u in mantissa bits 3-6; 16 + z comes off).
// FP8 (bits -8): the 8-bit layout, bytes e4m3, no zeros: y = sum_g s * (x . fp8(u)). Three
// routes to exact values (normals and subnormals alike), the scales taking the power of 2 they
// leave (time at 1 row from L2 on an AMD EPYC with AVX-512, int8's = 1):
// - table (bf16 x, AVX-512 BF16 with VBMI; every row count): bf16 pairs of fp8(u) * 2^-8, their
//   low and high bytes looked up by the 7 magnitude bits (vpermt2b), the sign OR'd in (0.85);
// - subnormal (fp32 FMAs on AMD): (b & 0x80) << 24 | (b & 0x7F) << 20 is fp32 fp8(b) * 2^-120,
//   subnormal where fp8(b) is, against x * 2^64 (|x| < 2^64): 3 integer ops a vector (1.07).
//   Intel runs FMAs on subnormal inputs through microcode assists, hence AMD only; MXCSR.DAZ
//   (which would zero them) is lifted for the call;
// - fp16 (the others): (b & 0x80) << 8 | (b & 0x7F) << 7 is fp16 fp8(b) * 2^-8 (exponent biases
//   15 and 7), vcvtph2ps'd (F16C; 1.4); the BF16 dot products take its fp32's high half.
// The NaN codes 0x7F / 0xFF read as +-480 on every route: checkpoints hold none.
// FP4 (bits -4, MXFP4): the 4-bit layout, nibbles e2m1 (bit 3 the sign; 0, .5, 1, 1.5, 2, 3, 4,
// 6), no zeros: y = sum_g s * (x . fp4(u)). Exact values by 16-entry tables, no power of 2 left
// to the scales (bits alone would make 0.5 a subnormal, which the dot products read as 0):
// - fp32 FMAs: vpermps (4 index bits: the nibble as it stands);
// - BF16 dot products (every row count): bf16 pairs by vpermw (5 index bits: the table twice,
//   bit 4 the next nibble's), the nibbles placed by vpshufb and vpsrlvw, or at one row with
//   VBMI (the table route: 5-11% faster there, no faster from 2 rows) by vpmultishiftqb;
// - AVX2: an 8-entry vpermd, the sign XOR'd in.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <vector>

#include "isa.h"
#include "pool.h"

namespace warmboot {
namespace {

constexpr int64_t kCols = 32;
constexpr int kFp8 = -8;     // bits of FP8 e4m3 codes (the fp16 route)
constexpr int kFp8Sub = -9;  // FP8 codes by the subnormal route (the kernels' own)
constexpr int kFp4 = -4;     // bits of FP4 e2m1 codes
template <int BITS>
constexpr int kWidth = BITS == 4 || BITS == kFp4 ? 4 : 8;  // bits a code takes
constexpr float kSubX = 0x1p64f;  // the subnormal route's x multiplier
// The scales' multiplier: the power of 2 the codes as read (and x) leave out (the table
// route's: kFp8's)
template <int BITS>
constexpr float kSMul = BITS == kFp8 ? 0x1p8f : BITS == kFp8Sub ? 0x1p56f : 1.f;
// those on (the fp16 route: always); kTable: FP4's table route too
enum Fp8Routes : int { kSubnormal = 1, kTable = 2 };
enum ScaleType : int { kF32, kF16, kBF16 };

// One call's operands.
struct Call {
  int64_t m, k, gs, groups;  // rows, in_features, group size, groups
  const float* x;            // (m, k) fp32 rows (the fp32 kernels)
  const uint16_t* xb;        // (m, k) bf16 rows (the BF16 dot products)
  const float* xs;           // (m, groups): each group's sum of x (null for FP8)
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

// The SIMD kernels shift b sign-extended left (by 7 into 16 bits, 20 into 32) and mask the
// sign's copies but the top one off.
constexpr int16_t kFp8Mask = int16_t(0xBF80);
constexpr int32_t kSubMask = int32_t(0x87F00000u);
constexpr unsigned kDaz = 0x40;  // MXCSR's denormals-are-zero

bool vbmi() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi");
}

int fp8_routes() {
  __builtin_cpu_init();
  return (__builtin_cpu_is("amd") ? kSubnormal : 0) | (vbmi() ? kTable : 0);
}
std::atomic<int> g_fp8_routes{fp8_routes()};  // FP8's routes on (tests turn them either way)

// Lifts MXCSR.DAZ on this thread while it lives (the subnormal route's codes are subnormals).
struct NoDaz {
  unsigned csr;
  explicit NoDaz(bool on) : csr(on ? _mm_getcsr() : 0) {
    if (csr & kDaz) _mm_setcsr(csr & ~kDaz);
  }
  ~NoDaz() {
    if (csr & kDaz) _mm_setcsr(csr);
  }
};

// fp8(b) * 2^-8 for each byte b, as the portable kernel reads it (the fp16 route's)
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const auto h = static_cast<uint16_t>((b & 0x80) << 8 | (b & 0x7F) << 7);
      v[b] = static_cast<float>(c10::Half(h, c10::Half::from_bits()));
    }
  }
};

// FP4's tables by nibble u: fp32 fp4(u), bf16 fp4(u) twice over (vpermw reads 5 index bits, the
// fifth the other nibble's), and for AVX2 fp4(u)'s fp32 bits ^ u << 28 (u < 8; see fp4x8).
struct Fp4Tables {
  alignas(64) float f32[16];
  alignas(64) uint16_t bf16[32];
  alignas(32) int32_t avx2[8];
  constexpr Fp4Tables() : f32(), bf16(), avx2() {
    constexpr float kMag[8] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    for (int u = 0; u < 32; ++u) {
      const float v = u & 8 ? -kMag[u & 7] : kMag[u & 7];
      const auto bits = std::bit_cast<uint32_t>(v);
      if (u < 16) f32[u] = v;
      bf16[u] = static_cast<uint16_t>(bits >> 16);
      if (u < 8) avx2[u] = static_cast<int32_t>(bits ^ uint32_t(u) << 28);
    }
  }
};
constexpr Fp4Tables kFp4s;

// The table route's tables: bf16 fp8(u) * 2^-8's low and high bytes by u & 0x7F, and each half
// of the columns' vpermb control: 32-bit lane c takes byte c twice, then byte 32 + c twice.
struct Fp8Bf16Table {
  alignas(64) uint8_t lo[128], hi[128], ctl[2][64];
  Fp8Bf16Table() {
    const Fp8Table fp8;
    for (int b = 0; b < 128; ++b) {
      uint32_t u = 0;
      std::memcpy(&u, &fp8.v[b], 4);
      lo[b] = u >> 16 & 0xFF, hi[b] = u >> 24;
    }
    for (int j = 0; j < 128; ++j) ctl[j / 64][j % 64] = j % 64 / 4 + 16 * (j / 64) + j % 4 / 2 * 32;
  }
};
const Fp8Bf16Table kFp8Bf16;

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

// 32 columns of FP8 codes as fp32 fp8(u) * 2^-8 (the fp16 route)
inline void fp8x32(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i s = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(s, 7), _mm512_set1_epi16(kFp8Mask));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// 16 columns of FP8 codes as fp32 fp8(u) * 2^-120 (the subnormal route)
inline __m512 sub16(const uint8_t* p) {
  const __m512i s = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(at16(p))), 20);
  return _mm512_castsi512_ps(_mm512_and_si512(s, _mm512_set1_epi32(kSubMask)));
}

// 32 columns of 8-bit codes as fp32: u, or FP8 by either route
template <int BITS>
inline void w8x32(const uint8_t* p, __m512& lo, __m512& hi) {
  if constexpr (BITS == kFp8) {
    fp8x32(p, lo, hi);
  } else if constexpr (BITS == kFp8Sub) {
    lo = sub16(p), hi = sub16(p + 16);
  } else {
    lo = u8x16(p), hi = u8x16(p + 16);
  }
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

// bf16 pairs (row k, row k + 1) of 16 columns from their fp32 e and o (8-bit codes: u or
// fp8(u) * 2^-8, exact in bf16, the fp32's high half)
inline __m512bh pairs_bf16(__m512 e, __m512 o) {
  const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(e), 16);
  const __m512i hi = _mm512_set1_epi32(0xFFFF0000);
  return (__m512bh)_mm512_ternarylogic_epi32(lo, _mm512_castps_si512(o), hi, 0xF8);  // a | b & c
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

// bf16 pairs fp4(u) of 16 columns of nibble pairs: nibbles_bf16's bytes, the even k's from
// byte 1 by 8 (bit 4 the odd nibble's: the table is there twice), the odd k's from byte 2 by 4,
// looked up (vpermw). tab: kFp4s.bf16.
inline __m512bh fp4_bf16(const uint8_t* p, __m512i ctl, __m512i tab) {
  const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(at16(p)));
  const __m512i t = _mm512_srlv_epi16(_mm512_shuffle_epi8(b, ctl), _mm512_set1_epi32(0x40008));
  return (__m512bh)_mm512_permutexvar_epi16(t, tab);
}

// 16 columns of 4-bit codes as fp32 from their bytes in b's 32-bit lanes, the low nibbles (LO)
// or the high ones: FP4 by table (vpermps reads 4 index bits), else u
template <int BITS, bool LO>
inline __m512 nib16(__m512i b, __m512 tab) {
  if constexpr (!LO) b = _mm512_srli_epi32(b, 4);
  if constexpr (BITS == kFp4) return _mm512_permutexvar_ps(b, tab);
  return _mm512_cvtepi32_ps(LO ? _mm512_and_si512(b, _mm512_set1_epi32(15)) : b);
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
    const uint8_t* b = q.w + kk * kCols * WB / 8;                                      \
    fetch(q, kk * kCols * WB / 8);                                                     \
    if constexpr (DP && BITS == kFp4) {                                                \
      const __m512bh v0 = fp4_bf16(b, ctl, f4b), v1 = fp4_bf16(b + 16, ctl, f4b);      \
      QG_ROWS(QG_DP)                                                                   \
    } else if constexpr (DP && WB == 4) {                                              \
      const __m512bh v0 = nibbles_bf16(b, ctl), v1 = nibbles_bf16(b + 16, ctl);        \
      QG_ROWS(QG_DP)                                                                   \
    } else {                                                                           \
      __m512 e0, e1, o0 = _mm512_setzero_ps(), o1 = o0;                                \
      if constexpr (WB == 8) {                                                         \
        w8x32<BITS>(b, e0, e1);                                                        \
        if constexpr (!tail) w8x32<BITS>(b + kCols, o0, o1);                           \
      } else {                                                                         \
        const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(at16(b)));             \
        const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(at16(b + 16)));        \
        e0 = nib16<BITS, true>(b0, f4), e1 = nib16<BITS, true>(b1, f4);                \
        o0 = nib16<BITS, false>(b0, f4), o1 = nib16<BITS, false>(b1, f4);              \
      }                                                                                \
      if constexpr (DP) {                                                              \
        const __m512bh v0 = pairs_bf16(e0, o0), v1 = pairs_bf16(e1, o1);               \
        QG_ROWS(QG_DP)                                                                 \
      } else {                                                                         \
        QG_ROWS(QG_FMA)                                                                \
      }                                                                                \
    }                                                                                  \
  }
// acc (row r's 32 fp32) += s * (p + q) - zs * xs (FP8 / FP4: no zs)
#define QG_FLUSH(r)                                                                    \
  if constexpr (MR > r) {                                                              \
    if constexpr (SPLIT) p##r##0 = _mm512_add_ps(p##r##0, q##r##0);                    \
    if constexpr (SPLIT) p##r##1 = _mm512_add_ps(p##r##1, q##r##1);                    \
    float* ar = acc + r * kCols;                                                       \
    __m512 a0 = _mm512_fmadd_ps(s0, p##r##0, _mm512_loadu_ps(ar));                     \
    __m512 a1 = _mm512_fmadd_ps(s1, p##r##1, _mm512_loadu_ps(ar + 16));                \
    if constexpr (BITS >= 0) {                                                         \
      const __m512 xr = _mm512_set1_ps(xs[r * c.groups + g]);                          \
      a0 = _mm512_fnmadd_ps(zs0, xr, a0), a1 = _mm512_fnmadd_ps(zs1, xr, a1);          \
    }                                                                                  \
    _mm512_storeu_ps(ar, a0);                                                          \
    _mm512_storeu_ps(ar + 16, a1);                                                     \
  }

// Rows r0 .. r0 + MR - 1 against one panel: acc (MR, 32) += their sums. DP: BF16 dot products.
template <int MR, int BITS, bool DP>
void panel512(const Call& c, const Panel& q, int64_t r0, float* acc) {
  constexpr bool SPLIT = MR <= 4;
  constexpr int WB = kWidth<BITS>;
  const float* x = DP ? nullptr : c.x + r0 * c.k;
  const uint16_t* xb = DP ? c.xb + r0 * c.k : nullptr;
  const float* xs = c.xs ? c.xs + r0 * c.groups : nullptr;
  const __m512i ctl = _mm512_load_si512(kNibbleCtl.b), f4b = _mm512_load_si512(kFp4s.bf16);
  [[maybe_unused]] const __m512 f4 = _mm512_load_ps(kFp4s.f32);
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
    __m512 s0 = scales16(q.s, c.sdt, g * kCols), s1 = scales16(q.s, c.sdt, g * kCols + 16);
    if constexpr (BITS < 0) {
      s0 = _mm512_mul_ps(s0, _mm512_set1_ps(kSMul<BITS>));
      s1 = _mm512_mul_ps(s1, _mm512_set1_ps(kSMul<BITS>));
    }
    const __m512 zs0 = BITS < 0 ? s0 : zs16(q, c, g * kCols, off, s0);
    const __m512 zs1 = BITS < 0 ? s1 : zs16(q, c, g * kCols + 16, off, s1);
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

// The table route (its own target: VBMI only here, never in code that runs without it)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,fma")
struct Fp8Regs {
  __m512i lo0, lo1, hi0, hi1, ctl0, ctl1;
};

// bf16 pairs (row k, row k + 1) of 16 columns from the k pair's 64 bytes: each lane's bytes
// (b_k, b_k, b_k+1, b_k+1) as indices, the even ones into the low-byte table, the others into
// the high-byte one (vpermt2b reads 7 index bits), the signs OR'd into the high bytes.
inline __m512bh fp8_pairs(__m512i raw, __m512i ctl, const Fp8Regs& t) {
  const __m512i i = _mm512_permutexvar_epi8(ctl, raw);
  const __m512i lo = _mm512_mask2_permutex2var_epi8(t.lo0, i, 0x5555555555555555ull, t.lo1);
  const __m512i w = _mm512_mask2_permutex2var_epi8(t.hi0, lo, 0xAAAAAAAAAAAAAAAAull, t.hi1);
  return (__m512bh)_mm512_ternarylogic_epi32(w, i, _mm512_set1_epi16(-32768), 0xF8);  // a | b & c
}

// bf16 pairs fp4(u) of 16 columns of nibble pairs (FP4's table route: 3 instructions as
// fp4_bf16, faster at one row): the bytes of columns 2i and 2i + 1 in 64-bit lane i, each 16-bit
// word's low byte taken from bit 0, 4, 8 or 12 (vpmultishiftqb: the even and the odd k of both
// columns, bit 4 the next nibble's), looked up (vpermw).
inline __m512bh fp4_pairs(const uint8_t* p, __m512i tab) {
  const __m512i b = _mm512_cvtepu16_epi64(_mm_loadu_si128(at16(p)));
  const __m512i t = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x000C000800040000ll), b);
  return (__m512bh)_mm512_permutexvar_epi16(t, tab);
}

// k pair (K0, K0 + 1), TAIL: K0 alone (FP8: its 32 bytes, the rest zero)
#define QG_TABLE_STEP(K0, ODD, TAIL)                                                        \
  {                                                                                         \
    const int64_t kk = K0;                                                                  \
    constexpr bool odd = ODD, tail = TAIL;                                                  \
    const uint8_t* b = q.w + kk * kCols * kWidth<BITS> / 8;                                 \
    fetch(q, kk * kCols * kWidth<BITS> / 8);                                                \
    __m512bh v0, v1;                                                                        \
    if constexpr (BITS == kFp4) {                                                           \
      v0 = fp4_pairs(b, f4b), v1 = fp4_pairs(b + 16, f4b);                                  \
    } else {                                                                                \
      const __m512i raw =                                                                   \
          tail ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, b) : _mm512_loadu_si512(b);         \
      v0 = fp8_pairs(raw, t.ctl0, t), v1 = fp8_pairs(raw, t.ctl1, t);                       \
    }                                                                                       \
    QG_ROWS(QG_DP)                                                                          \
  }

// panel512's dot products on FP8 or FP4 codes by table
template <int MR, int BITS, bool>
void panel_table(const Call& c, const Panel& q, int64_t r0, float* acc) {
  constexpr bool SPLIT = MR <= 4;
  const uint16_t* xb = c.xb + r0 * c.k;
  const float* xs = nullptr;  // FP8 / FP4: no zero points
  const auto* f = &kFp8Bf16;
  const Fp8Regs t{_mm512_load_si512(f->lo),     _mm512_load_si512(f->lo + 64),
                  _mm512_load_si512(f->hi),     _mm512_load_si512(f->hi + 64),
                  _mm512_load_si512(f->ctl[0]), _mm512_load_si512(f->ctl[1])};
  const __m512i f4b = _mm512_load_si512(kFp4s.bf16);
  const __m512 mul = _mm512_set1_ps(kSMul<BITS>);
  for (int64_t g = 0; g < c.groups; ++g) {
    QG_ROWS(QG_DECL)
    const int64_t kend = (g + 1) * c.gs;
    int64_t k0 = g * c.gs;
    for (; k0 + 3 < kend; k0 += 4) {
      QG_TABLE_STEP(k0, false, false)
      QG_TABLE_STEP(k0 + 2, true, false)
    }
    if (k0 + 1 < kend) QG_TABLE_STEP(k0, false, false)
    if ((kend - k0) % 2) QG_TABLE_STEP(kend - 1, false, true)
    const __m512 s0 = _mm512_mul_ps(scales16(q.s, c.sdt, g * kCols), mul);
    const __m512 s1 = _mm512_mul_ps(scales16(q.s, c.sdt, g * kCols + 16), mul);
    [[maybe_unused]] const __m512 zs0 = s0, zs1 = s1;
    QG_ROWS(QG_FLUSH)
  }
}
QG_BLOCK_OF(block_table, panel_table)

// FP4's blocks of 2 rows or more: panel512's (fp4_bf16), as fast or faster there
template <int BITS>
void panels_table(const Call& c, Panel q, float* acc) {
  for (int64_t r = 0; r < c.m; r += 8) {
    const int64_t mr = std::min<int64_t>(8, c.m - r);
    if (BITS == kFp4 && mr > 1) {
      block512<8, BITS, true>(mr, c, q, r, acc + r * kCols);
    } else {
      block_table<BITS == kFp4 ? 1 : 8, BITS, true>(mr, c, q, r, acc + r * kCols);
    }
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
    const uint8_t* b = q.w + kk * kCols * WB / 8 + 8 * h;                   \
    if (h == 0) fetch(q, kk * kCols * WB / 8);                              \
    __m256 e, o;                                                            \
    if constexpr (WB == 8) {                                                \
      e = w8x8<BITS>(b), o = w8x8<BITS>(b + kCols);                         \
    } else {                                                                \
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(at16(b)));     \
      e = nib8<BITS, true>(v), o = nib8<BITS, false>(v);                    \
    }                                                                       \
    Q2_ROWS(Q2_EVEN)                                                        \
    Q2_ROWS(Q2_ODD)                                                         \
  }
#define Q2_FLUSH(r)                                                                \
  if constexpr (MR > r) {                                                          \
    float* ar = acc + r * kCols + 8 * h;                                           \
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(p##r, q##r), _mm256_add_ps(t##r, u##r)); \
    __m256 a = _mm256_fmadd_ps(s, sum, _mm256_loadu_ps(ar));                       \
    if (BITS >= 0 && last) a = _mm256_fnmadd_ps(zs, _mm256_set1_ps(xs[r * c.groups + g]), a); \
    _mm256_storeu_ps(ar, a);                                                       \
  }
#define Q2_ROWS(F) F(0) F(1) F(2) F(3)

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(at16(p))));
}

// 8 columns of FP8 codes as fp32 fp8(u) * 2^-8 (the fp16 route: F16C)
inline __m256 fp8x8(const uint8_t* p) {
  const __m128i s = _mm_cvtepi8_epi16(_mm_loadl_epi64(at16(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16(kFp8Mask)));
}

// 8 columns of FP8 codes as fp32 fp8(u) * 2^-120 (the subnormal route)
inline __m256 sub8(const uint8_t* p) {
  const __m256i s = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64(at16(p))), 20);
  return _mm256_castsi256_ps(_mm256_and_si256(s, _mm256_set1_epi32(kSubMask)));
}

// 8 columns of FP4 codes as fp32 from nibbles u (bits 0-3 of the lanes, zero above): the table
// by u's 3 low bits (vpermd), XOR u << 28 takes its u << 28 back and leaves the sign at bit 31.
inline __m256 fp4x8(__m256i u) {
  const __m256i t = _mm256_load_si256(reinterpret_cast<const __m256i*>(kFp4s.avx2));
  return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_permutevar8x32_epi32(t, u),
                                              _mm256_slli_epi32(u, 28)));
}

// 8 columns of 4-bit codes as fp32 from their bytes in v's lanes, the low nibbles (LO) or high
template <int BITS, bool LO>
inline __m256 nib8(__m256i v) {
  if constexpr (LO) v = _mm256_and_si256(v, _mm256_set1_epi32(15));
  if constexpr (!LO) v = _mm256_srli_epi32(v, 4);
  if constexpr (BITS == kFp4) return fp4x8(v);
  return _mm256_cvtepi32_ps(v);
}

template <int BITS>
inline __m256 w8x8(const uint8_t* p) {
  if constexpr (BITS == kFp8) return fp8x8(p);
  if constexpr (BITS == kFp8Sub) return sub8(p);
  return u8x8(p);
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
  constexpr int WB = kWidth<BITS>;
  const float *x = c.x + r0 * c.k, *xs = c.xs ? c.xs + r0 * c.groups : nullptr;
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
          const __m256 e = w8x8<BITS>(q.w + kk * kCols + 8 * h);
          Q2_ROWS(Q2_EVEN)
        }
        __m256 s = scales8(q.s, c.sdt, g * kCols + 8 * h);
        if constexpr (BITS < 0) s = _mm256_mul_ps(s, _mm256_set1_ps(kSMul<BITS>));
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

// Plain C++: k by k, each k's 32 weights converted once for every row (FP8: the fp16 route).
template <int BITS, bool>
void panels_portable(const Call& c, Panel q, float* acc) {
  static_assert(BITS != kFp8Sub);
  static const Fp8Table fp8;
  thread_local std::vector<float> part;
  for (int64_t g = 0; g < c.groups; ++g) {
    part.assign(c.m * kCols, 0.f);
    for (int64_t k = g * c.gs; k < (g + 1) * c.gs; ++k) {
      const uint8_t* b = q.w + (kWidth<BITS> == 4 ? k / 2 : k) * kCols;
      float w[kCols];
      for (int i = 0; i < kCols; ++i) {
        const int u = kWidth<BITS> == 8 ? b[i] : k % 2 ? b[i] >> 4 : b[i] & 15;
        w[i] = BITS == kFp8 ? fp8.v[u] : BITS == kFp4 ? kFp4s.f32[u] : u;
      }
      for (int64_t r = 0; r < c.m; ++r) {
        float* __restrict pr = part.data() + r * kCols;
        const float xv = c.x[r * c.k + k];
        for (int i = 0; i < kCols; ++i) pr[i] += xv * w[i];
      }
    }
    for (int i = 0; i < kCols; ++i) {
      const float s = scale_at(q.s, c.sdt, g * kCols + i) * kSMul<BITS>;
      const float zs = (q.z ? q.z[g * kCols + i] : c.zsym) * s;
      for (int64_t r = 0; r < c.m; ++r) {
        const float sum = s * part[r * kCols + i];
        acc[r * kCols + i] += BITS < 0 ? sum : sum - zs * c.xs[r * c.groups + g];
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

// The panel kernels for this CPU's set: the BF16 dot products (dp) for bf16 x (8 bits and FP8's
// fp16 route: from 2 rows, one row runs faster on fp32 FMAs; 4 bits and FP4: every row count).
// FP8 on AVX2 wants F16C.
template <int BITS>
Panels pick(Isa isa, bool bf16_x, int64_t m, bool* dp) {
  static const bool f16c = __builtin_cpu_supports("f16c");
  *dp = isa == Isa::Avx512Bf16 && bf16_x && (kWidth<BITS> == 4 || m > 1);
  if (*dp) return panels512<BITS, true>;
  if (isa == Isa::Avx512Bf16 || isa == Isa::Avx512) return panels512<BITS, false>;
  const bool avx2 = isa == Isa::Avx2 && (BITS != kFp8 || f16c);
  return avx2 ? panels_avx2<BITS, false> : panels_portable<BITS, false>;
}

// The kernels for bits. FP8: bf16 x by table where it is on (dp), fp32 FMAs by the subnormal
// route (sub) where that is, else the fp16 route.
Panels pick_bits(int64_t bits, bool bf16_x, int64_t m, bool* dp, bool* sub) {
  const Isa isa = detect_isa();
  const int routes = g_fp8_routes.load();
  *sub = false;
  if (bits == 4) return pick<4>(isa, bf16_x, m, dp);
  if (bits == 8) return pick<8>(isa, bf16_x, m, dp);
  *dp = isa == Isa::Avx512Bf16 && bf16_x && (routes & kTable);
  if (bits == kFp4) return *dp ? panels_table<kFp4> : pick<kFp4>(isa, bf16_x, m, dp);
  if (*dp) return panels_table<kFp8>;
  const Panels fp16 = pick<kFp8>(isa, bf16_x, m, dp);
  *sub = !*dp && isa != Isa::Portable && (routes & kSubnormal);
  if (!*sub) return fp16;
  return isa == Isa::Avx2 ? panels_avx2<kFp8Sub, false> : panels512<kFp8Sub, false>;
}

// FP8's routes on (Fp8Routes bits, kTable FP4's too: tests run each where the CPU can); the
// previous ones back.
int64_t quant_fp8_routes(int64_t routes) {
  TORCH_CHECK(routes >= 0 && routes <= (kSubnormal | kTable), "unknown FP8 routes ", routes);
  TORCH_CHECK(!(routes & kTable) || vbmi(), "the FP8 table route wants AVX-512 VBMI");
  return g_fp8_routes.exchange(static_cast<int>(routes));
}

at::Tensor quant_pack(const at::Tensor& codes, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8 || bits == kFp8 || bits == kFp4,
              "quant_pack: bits must be 4, 8 or -8 / -4 (FP8 / FP4 codes), got ", bits);
  bits = std::abs(bits);  // FP8 and FP4: the same layouts
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
  TORCH_CHECK(bits == 4 || bits == 8 || bits == kFp8 || bits == kFp4,
              "quant_linear: bits must be 4, 8 or -8 / -4 (FP8 / FP4 codes), got ", bits);
  TORCH_CHECK(bits > 0 || !zeros, "quant_linear: ", bits == kFp8 ? "FP8" : "FP4", " codes (bits ",
              bits, ") take no zero points, got a zeros tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(),
              "quant_linear wants a weight from quant_pack");
  const bool nibbles = bits == 4 || bits == kFp4;
  const int64_t panels = packed.size(0), k = packed.size(1) * (nibbles ? 2 : 1);
  const auto xt = x.scalar_type(), st = scales.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16,
              "quant_linear wants float32 or bfloat16 rows, got ", xt);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "quant_linear: x has ", x.size(-1),
              " features, the weight ", k);
  TORCH_CHECK(n > (panels - 1) * kCols && n <= panels * kCols, "quant_linear: out_features ", n,
              " does not match the packed weight");
  TORCH_CHECK(gs > 0 && k % gs == 0, "quant_linear: group_size ", gs, " does not divide ", k);
  TORCH_CHECK(!nibbles || gs % 2 == 0, "quant_linear: 4-bit codes need an even group_size, got ",
              gs);
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
// x (in double, rounded once) into xs where zero points take them (not FP8 / FP4). xmul: the
// rows' multiplier (FP8's subnormal route; then into buf).
void rows_and_sums(const at::Tensor& x, Call& c, bool dp, bool sums, float xmul,
                   std::vector<float>& buf, std::vector<float>& xs) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  const auto* xb = bf16 ? x.data_ptr<at::BFloat16>() : nullptr;
  if ((bf16 && !dp) || xmul != 1.f) {
    buf.resize(c.m * c.k);
    for (int64_t i = 0; i < c.m * c.k; ++i) buf[i] = (xf ? xf[i] : float(xb[i])) * xmul;
    xf = buf.data();
  }
  xs.resize(sums ? c.m * c.groups : 0);
  for (int64_t r = 0; r < (sums ? c.m : 0); ++r) {
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
  c.xs = sums ? xs.data() : nullptr;
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
  bool dp = false, sub = false;
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
  const Panels kernel = pick_bits(bits, bf16_x, m, &dp, &sub);
  const auto st = scales.scalar_type();
  const int sdt = st == at::kFloat ? kF32 : st == at::kHalf ? kF16 : kBF16;
  const float zsym = bits < 0 ? 0.f : float(1 << (bits - 1));
  Call c{m, k, gs, groups, nullptr, nullptr, nullptr, sdt, zsym};
  thread_local std::vector<float> buf, xs;
  rows_and_sums(x2, c, dp, bits > 0, sub ? kSubX : 1.f, buf, xs);
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
    const NoDaz subnormals(sub);
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

// Meta kernel: the output's shape for torch.compile's fake tensors (the op is called directly
// in a compiled step, without a Python wrapper).
at::Tensor quant_linear_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                             int64_t n, int64_t, int64_t) {
  auto sizes = x.sym_sizes().vec();
  sizes.back() = n;
  return at::empty_symint(sizes, x.options());
}


// W8A8 int8 (quant_linear_i8): int8 rows xq against symmetric 8-bit codes, a scale per row of
// x and per output channel: y[m, n] = xs[m] * s[n] * sum_k xq[m, k] * (u[n, k] - 128) + b[n].
// The sum is exact in int32: sum_k xq * u (|.| <= K * 255 * 128, hence K <= 65536) less 128 *
// sum_k xq (per row, once per call); then fp32 float(sum) * (xs * s) + b. Routes: AVX-512 VNNI
// (vpdpbusd: u unsigned against xq signed, 4 k a lane), AVX2 (vpmaddwd: u and xq widened to
// int16, 2 k a lane), portable C++.
enum class I8Route { kPortable, kAvx2, kVnni512 };

I8Route i8_route() {
  static const bool vnni = (__builtin_cpu_init(), __builtin_cpu_supports("avx512vnni"));
  const Isa isa = detect_isa();
  if ((isa == Isa::Avx512 || isa == Isa::Avx512Bf16) && vnni) return I8Route::kVnni512;
  return isa == Isa::Portable ? I8Route::kPortable : I8Route::kAvx2;
}

// One call's operands: rows padded with zeros to kp inputs (a multiple of 4).
struct I8Call {
  int64_t m, k, kp;
  const int8_t* x;     // (m, kp)
  const int16_t* x16;  // (m, kp) widened (AVX2)
};

// acc (m, 32) int32 += the rows' sums x . u against one panel's codes w (K, 32)
void i8_portable(const I8Call& c, const uint8_t* w, int32_t* acc) {
  for (int64_t k = 0; k < c.k; ++k) {
    const uint8_t* wk = w + k * kCols;
    for (int64_t r = 0; r < c.m; ++r) {
      const int32_t xv = c.x[r * c.kp + k];
      int32_t* ar = acc + r * kCols;
      for (int i = 0; i < kCols; ++i) ar[i] += xv * wk[i];
    }
  }
}

#define I8_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)

// Where one call's outputs go: y (m, n) fp32 or bf16, x's scales (one per row or one_xs) and
// 128 * each row's sum of x.
struct I8Out {
  int64_t m, n;
  void* y;
  bool bf16, one_xs;
  const float* xs;
  const int32_t* zs;
};

// One panel's outputs (portable): float(acc - zs[r]) * (xs[r] * s[i]) into facc, then store's
void i8_store(const int32_t* acc, const I8Out& o, const float* s, float* facc, const at::Tensor& y,
              const at::Tensor& b, int64_t n0) {
  for (int64_t r = 0; r < o.m; ++r) {
    const float xr = o.xs[o.one_xs ? 0 : r];
    for (int i = 0; i < kCols; ++i) {
      facc[r * kCols + i] = static_cast<float>(acc[r * kCols + i] - o.zs[r]) * (xr * s[i]);
    }
  }
  store(facc, o.m, y, b, n0);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
// The panel's 4 k from kk (rows past K zero) as 2 vectors of 16 columns, a column's 4 codes in
// its 32-bit lane: vector 0 holds columns 0-3, 16-19, 8-11, 24-27, vector 1 the next 4 of each.
inline void i8_quads(const uint8_t* b, int64_t left, __m512i& w0, __m512i& w1) {
  __m512i a, c;
  if (left >= 4) {
    a = _mm512_loadu_si512(b), c = _mm512_loadu_si512(b + 64);
  } else {
    const uint64_t ones = ~0ull;
    a = _mm512_maskz_loadu_epi8(left >= 2 ? ones : ones >> 32, b);
    c = _mm512_maskz_loadu_epi8(left == 3 ? ones >> 32 : 0, b + 64);
  }
  const __m512i e = _mm512_shuffle_i64x2(a, c, 0x44), o = _mm512_shuffle_i64x2(a, c, 0xEE);
  const __m512i lo = _mm512_unpacklo_epi8(e, o), hi = _mm512_unpackhi_epi8(e, o);
  const __m512i f = _mm512_shuffle_i64x2(lo, hi, 0x44), g = _mm512_shuffle_i64x2(lo, hi, 0xEE);
  w0 = _mm512_unpacklo_epi16(f, g), w1 = _mm512_unpackhi_epi16(f, g);
}

// i8_quads' columns back in order: lanes of [w0 | w1] for columns 0-15 and 16-31
struct I8Order {
  alignas(64) int32_t idx[2][16] = {};
  constexpr I8Order() {
    for (int j = 0; j < 32; ++j) {  // lane j of [w0 | w1] -> its column
      const int lane = j % 16, col = lane % 4 + 4 * (j / 16) + 8 * (lane / 8) + 16 * (lane / 4 % 2);
      idx[col / 16][col % 16] = j;
    }
  }
};
constexpr I8Order kI8Order;

#define I8_DECL(r) __m512i a##r##0 = _mm512_setzero_si512(), a##r##1 = a##r##0, \
                           b##r##0 = a##r##0, b##r##1 = a##r##0;
#define I8_DP(r)                                                       \
  if constexpr (MR > r) {                                              \
    int32_t quad;                                                      \
    std::memcpy(&quad, x + r * c.kp + kk, 4);                          \
    const __m512i xv = _mm512_set1_epi32(quad);                        \
    __m512i& s0 = SPLIT && odd ? b##r##0 : a##r##0;                    \
    __m512i& s1 = SPLIT && odd ? b##r##1 : a##r##1;                    \
    s0 = _mm512_dpbusd_epi32(s0, w0, xv);                              \
    s1 = _mm512_dpbusd_epi32(s1, w1, xv);                              \
  }
#define I8_STEP(K0, ODD)                                        \
  {                                                             \
    const int64_t kk = K0;                                      \
    constexpr bool odd = ODD;                                   \
    __m512i w0, w1;                                             \
    i8_quads(q.w + kk * kCols, c.k - kk, w0, w1);               \
    fetch(q, kk * kCols);                                       \
    fetch(q, kk * kCols + 64);                                  \
    I8_ROWS(I8_DP)                                              \
  }
#define I8_FLUSH(r)                                                                     \
  if constexpr (MR > r) {                                                               \
    if constexpr (SPLIT) a##r##0 = _mm512_add_epi32(a##r##0, b##r##0);                  \
    if constexpr (SPLIT) a##r##1 = _mm512_add_epi32(a##r##1, b##r##1);                  \
    int32_t* ar = acc + r * kCols;                                                      \
    _mm512_storeu_si512(ar, _mm512_permutex2var_epi32(a##r##0, lo, a##r##1));           \
    _mm512_storeu_si512(ar + 16, _mm512_permutex2var_epi32(a##r##0, hi, a##r##1));      \
  }

// Rows r0 .. r0 + MR - 1 against one panel: acc (MR, 32) = their sums x . u
template <int MR>
void i8_panel512(const I8Call& c, const Panel& q, int64_t r0, int32_t* acc) {
  constexpr bool SPLIT = MR <= 4;
  const int8_t* x = c.x + r0 * c.kp;
  I8_ROWS(I8_DECL)
  int64_t k0 = 0;
  for (; k0 + 7 < c.k; k0 += 8) {
    I8_STEP(k0, false)
    I8_STEP(k0 + 4, true)
  }
  for (; k0 < c.k; k0 += 4) I8_STEP(k0, false)
  const __m512i lo = _mm512_load_si512(kI8Order.idx[0]), hi = _mm512_load_si512(kI8Order.idx[1]);
  I8_ROWS(I8_FLUSH)
}

template <int MR>
void i8_block512(int64_t mr, const I8Call& c, const Panel& q, int64_t r0, int32_t* acc) {
  if constexpr (MR > 1) {
    if (mr < MR) return i8_block512<MR - 1>(mr, c, q, r0, acc);
  }
  i8_panel512<MR>(c, q, r0, acc);
}

void i8_panels512(const I8Call& c, Panel q, int32_t* acc) {
  for (int64_t r = 0; r < c.m; r += 8) {
    i8_block512<8>(std::min<int64_t>(8, c.m - r), c, q, r, acc + r * kCols);
    q.pf = q.w;
  }
}

// One panel's outputs (store's, vectorized): y[r, n0 + i] = float(acc - zs[r]) * (xs[r] * s[i])
// + b[i] for the panel's width columns, bf16 rounded to nearest even.
void i8_store512(const int32_t* acc, const I8Out& o, const float* s, const float* b, int64_t n0) {
  const int64_t width = std::min(kCols, o.n - n0);
  const auto mask = [&](int64_t from) {  // the columns from `from` on, up to 16
    const int64_t cols = std::clamp<int64_t>(width - from, 0, 16);
    return static_cast<__mmask16>((1u << cols) - 1);
  };
  const __mmask16 k0 = mask(0), k1 = mask(16);
  const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
  const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF);
  for (int64_t r = 0; r < o.m; ++r) {
    const __m512 xr = _mm512_set1_ps(o.xs[o.one_xs ? 0 : r]);
    const __m512i z = _mm512_set1_epi32(o.zs[r]);
    for (int h = 0; h < 2; ++h) {
      const __m512i sum = _mm512_sub_epi32(_mm512_loadu_si512(acc + r * kCols + 16 * h), z);
      const __m512 v = _mm512_add_ps(
          _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(xr, h ? s1 : s0)), h ? b1 : b0);
      const int64_t at = r * o.n + n0 + 16 * h;
      if (!o.bf16) {
        _mm512_mask_storeu_ps(static_cast<float*>(o.y) + at, h ? k1 : k0, v);
        continue;
      }
      const __m512i bits = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
      const __m512i up = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(half, lsb)), 16);
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(o.y) + at, h ? k1 : k0,
                               _mm512_cvtepi32_epi16(up));
    }
  }
}
#pragma GCC pop_options

#define I2_DECL(r) __m256i a##r##0 = _mm256_setzero_si256(), a##r##1 = a##r##0;
#define I2_MADD(r)                                                                    \
  if constexpr (MR > r) {                                                             \
    int32_t pair;                                                                     \
    std::memcpy(&pair, x + r * c.kp + kk, 4);                                         \
    const __m256i xv = _mm256_set1_epi32(pair);                                       \
    a##r##0 = _mm256_add_epi32(a##r##0, _mm256_madd_epi16(w0, xv));                   \
    a##r##1 = _mm256_add_epi32(a##r##1, _mm256_madd_epi16(w1, xv));                   \
  }
#define I2_FLUSH(r)                                                                   \
  if constexpr (MR > r) {                                                             \
    auto* ar = reinterpret_cast<__m256i*>(acc + r * kCols + 16 * h);                  \
    _mm256_storeu_si256(ar, _mm256_add_epi32(_mm256_loadu_si256(ar), a##r##0));       \
    _mm256_storeu_si256(ar + 1, _mm256_add_epi32(_mm256_loadu_si256(ar + 1), a##r##1)); \
  }

#pragma GCC push_options
#pragma GCC target("avx2")
// AVX2: 16 columns (half h) at a time over blocks of 64 k (in L1 while both halves read them),
// k pairs as int16 pairs: u of the pair's two rows interleaved and widened, vpmaddwd'd against
// the rows' widened x pairs.
template <int MR>
void i8_panel_avx2(const I8Call& c, const Panel& q, int64_t r0, int32_t* acc) {
  const int16_t* x = c.x16 + r0 * c.kp;
  for (int64_t kb = 0; kb < c.k; kb += 64) {
    const int64_t bend = std::min(c.k, kb + 64);
    for (int h = 0; h < 2; ++h) {
      I8_ROWS(I2_DECL)
      for (int64_t kk = kb; kk < bend; kk += 2) {
        const uint8_t* b = q.w + kk * kCols + 16 * h;
        if (h == 0) fetch(q, kk * kCols);
        const __m128i e = _mm_loadu_si128(at16(b));
        const __m128i o = kk + 1 < bend ? _mm_loadu_si128(at16(b + kCols)) : _mm_setzero_si128();
        const __m256i w0 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(e, o));
        const __m256i w1 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(e, o));
        I8_ROWS(I2_MADD)
      }
      I8_ROWS(I2_FLUSH)
    }
  }
}

template <int MR>
void i8_block_avx2(int64_t mr, const I8Call& c, const Panel& q, int64_t r0, int32_t* acc) {
  if constexpr (MR > 1) {
    if (mr < MR) return i8_block_avx2<MR - 1>(mr, c, q, r0, acc);
  }
  i8_panel_avx2<MR>(c, q, r0, acc);
}

void i8_panels_avx2(const I8Call& c, Panel q, int32_t* acc) {
  for (int64_t r = 0; r < c.m; r += 4) {
    i8_block_avx2<4>(std::min<int64_t>(4, c.m - r), c, q, r, acc + r * kCols);
    q.pf = q.w;
  }
}
#pragma GCC pop_options

void check_i8(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& packed,
              const at::Tensor& scales, const std::optional<at::Tensor>& bias, int64_t n,
              at::ScalarType dt) {
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.dim() >= 1,
              "quant_linear_i8 wants int8 rows, got ", xq.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(),
              "quant_linear_i8 wants an 8-bit weight from quant_pack");
  const int64_t panels = packed.size(0), k = packed.size(1);
  const int64_t m = xq.numel() / std::max<int64_t>(k, 1);
  TORCH_CHECK(xq.size(-1) == k, "quant_linear_i8: x has ", xq.size(-1), " features, the weight ",
              k);
  TORCH_CHECK(k <= 65536, "quant_linear_i8: in_features ", k, " past 65536 (int32 sums)");
  TORCH_CHECK(n > (panels - 1) * kCols && n <= panels * kCols, "quant_linear_i8: out_features ",
              n, " does not match the packed weight");
  const auto st = scales.scalar_type();
  TORCH_CHECK((st == at::kFloat || st == at::kHalf || st == at::kBFloat16) &&
                  scales.sizes() == at::IntArrayRef({panels, 1, kCols}),
              "quant_linear_i8: scales must be one per output channel (", panels, ", 1, ", kCols,
              "), float16, bfloat16 or float32; got ", scales.sizes(), " ", st);
  TORCH_CHECK(xs.scalar_type() == at::kFloat && (xs.numel() == m || xs.numel() == 1),
              "quant_linear_i8: x_scale must be float32, one per row or one in all");
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "quant_linear_i8: dtype must be float32 "
              "or bfloat16, got ", dt);
  TORCH_CHECK(!bias || (bias->numel() == n && (bias->scalar_type() == at::kFloat ||
                                               bias->scalar_type() == dt)),
              "quant_linear_i8: bias must hold out_features values, float32 or dtype");
}

// The rows padded to kp (a multiple of 4: copied where k is not), widened to int16 for AVX2,
// and 128 * each row's sum (the zero point's share of x . u).
void i8_rows(const at::Tensor& xq, I8Call& c, bool wide, std::vector<int8_t>& pad,
             std::vector<int16_t>& x16, std::vector<int32_t>& zsum) {
  const int8_t* x = xq.data_ptr<int8_t>();
  c.kp = (c.k + 3) / 4 * 4;
  if (c.kp != c.k) {
    pad.assign(c.m * c.kp, 0);
    for (int64_t r = 0; r < c.m; ++r) std::memcpy(pad.data() + r * c.kp, x + r * c.k, c.k);
    x = pad.data();
  }
  x16.resize(wide ? c.m * c.kp : 0);
  zsum.assign(c.m, 0);
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t i = r * c.kp; i < (r + 1) * c.kp; ++i) {
      zsum[r] += 128 * x[i];
      if (wide) x16[i] = x[i];
    }
  }
  c.x = x, c.x16 = wide ? x16.data() : nullptr;
}

// A panel's 32 biases as fp32 (fp32 bf or bf16 bb, or none; zero past n)
void i8_bias(const float* bf, const at::BFloat16* bb, int64_t n, int64_t n0, float* out) {
  for (int64_t i = 0; i < std::min(kCols, n - n0); ++i) {
    out[i] = bf ? bf[n0 + i] : bb ? static_cast<float>(bb[n0 + i]) : 0.f;
  }
}

at::Tensor quant_linear_i8(const at::Tensor& xq, const at::Tensor& x_scale,
                           const at::Tensor& packed, const at::Tensor& scales,
                           const std::optional<at::Tensor>& bias, int64_t n, at::ScalarType dt) {
  check_i8(xq, x_scale, packed, scales, bias, n, dt);
  const int64_t panels = packed.size(0), k = packed.size(1);
  auto out_shape = xq.sizes().vec();
  out_shape.back() = n;
  const at::Tensor x2 = xq.contiguous(), xs = x_scale.contiguous();
  const int64_t m = x2.numel() / std::max<int64_t>(k, 1);
  auto y = at::empty({m, n}, xq.options().dtype(dt));
  if (m == 0) return y.view(out_shape);
  const I8Route route = i8_route();
  I8Call c{m, k, k, nullptr, nullptr};
  thread_local std::vector<int8_t> pad;
  thread_local std::vector<int16_t> x16;
  thread_local std::vector<int32_t> zsum;
  i8_rows(x2, c, route == I8Route::kAvx2, pad, x16, zsum);
  const at::Tensor s = scales.contiguous();
  const at::Tensor b = bias ? bias->contiguous().view(-1) : at::Tensor();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const char* sp = static_cast<const char*>(s.data_ptr());
  const I8Out o{m, n, y.data_ptr(), dt == at::kBFloat16, xs.numel() == 1, xs.data_ptr<float>(),
               zsum.data()};  // NOTE: the caller's zsum (a helper thread has its own)
  const bool wide = b.defined() && b.scalar_type() == at::kFloat;
  const float* bf = wide ? b.data_ptr<float>() : nullptr;
  const at::BFloat16* bb = b.defined() && !wide ? b.data_ptr<at::BFloat16>() : nullptr;
  const auto st = s.scalar_type();
  const int sdt = st == at::kFloat ? kF32 : st == at::kHalf ? kF16 : kBF16;
  const int64_t pbytes = k * kCols;
  const int64_t grain = std::clamp<int64_t>((int64_t(1) << 18) / std::max<int64_t>(pbytes, 1), 2,
                                            std::max<int64_t>(2, (panels + 3) / 4));
  parallel_chunks(panels, grain, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<int32_t> iacc;
    thread_local std::vector<float> facc;
    facc.resize(route == I8Route::kVnni512 ? 0 : m * kCols);
    for (int64_t p = p0; p < p1; ++p) {
      iacc.assign(m * kCols, 0);
      const Panel q{w + p * pbytes, nullptr, nullptr, w + (p + 1 < p1 ? p + 1 : p) * pbytes};
      float sc[kCols], bias32[kCols] = {};
      for (int i = 0; i < kCols; ++i) sc[i] = scale_at(sp, sdt, p * kCols + i);
      if (route == I8Route::kVnni512) {
        i8_panels512(c, q, iacc.data());
        i8_bias(bf, bb, n, p * kCols, bias32);
        i8_store512(iacc.data(), o, sc, bias32, p * kCols);
        continue;
      }
      if (route == I8Route::kAvx2) {
        i8_panels_avx2(c, q, iacc.data());
      } else {
        i8_portable(c, q.w, iacc.data());
      }
      i8_store(iacc.data(), o, sc, facc.data(), y, b, p * kCols);
    }
  });
  return y.view(out_shape);
}

at::Tensor quant_linear_i8_meta(const at::Tensor& xq, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const std::optional<at::Tensor>&, int64_t n,
                                at::ScalarType dt) {
  auto sizes = xq.sym_sizes().vec();
  sizes.back() = n;
  return at::empty_symint(sizes, xq.options().dtype(dt));
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def("quant_pack(Tensor codes, int bits) -> Tensor", &warmboot::quant_pack);
  m.def("quant_linear(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, Tensor? bias, "
        "int out_features, int bits, int group_size) -> Tensor");
  m.def("quant_fp8_routes(int routes) -> int", &warmboot::quant_fp8_routes);
  m.def("quant_linear_i8(Tensor xq, Tensor x_scale, Tensor packed, Tensor scales, Tensor? bias, "
        "int out_features, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(warmboot_cpu, CPU, m) {
  m.impl("quant_linear", &warmboot::quant_linear);
  m.impl("quant_linear_i8", &warmboot::quant_linear_i8);
}

TORCH_LIBRARY_IMPL(warmboot_cpu, Meta, m) {
  m.impl("quant_linear", &warmboot::quant_linear_meta);
  m.impl("quant_linear_i8", &warmboot::quant_linear_i8_meta);
}
