// y = x @ W.T + b for bf16 weights at decode sizes (1 to ~64 rows), streaming W once.
//
// W (N, K) is packed once at load into panels of 32 output columns: (ceil(N/32), K/2, 32, 2)
// bf16, the two values of a k pair side by side (the layout AVX-512 BF16's dot product
// reads), zero-padded to whole panels. A call walks the panels in chunks (parallel_chunks:
// helper threads may take chunks beside the caller); within a panel every row chunk reuses
// the panel from cache, so W leaves memory once per call whatever the row count: the GEMM
// runs at memory speed until the rows make it compute-bound.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx.h"
#include "isa.h"
#include "pool.h"

namespace warmboot {
namespace {

constexpr int64_t kCols = 32;
// From this many rows on the GEMM runs on AMX tiles where the CPU has them (amx_ready).
constexpr int64_t kAmxRows = 4;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
// MR rows x 32 columns in 2 * MR registers; x as bf16 pairs broadcast per k pair.
// NOTE: named accumulators, not an array: GCC keeps an array of vectors in memory too and
// stores it back every iteration (2.5x slower)
#define WB_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)
// pf: the next panel, whose k pairs [pf_lo, pf_hi) this call fetches into cache while it
// computes (rows past the first 8 reread the panel from cache: compute-bound, so the memory
// stream would stall if nothing were in flight).
template <int MR>
void panel_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k2, float* acc,
                const uint16_t* pf, int64_t pf_lo, int64_t pf_hi) {
#define WB_DECL(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0;
  WB_ROWS(WB_DECL)
  for (int64_t kp = 0; kp < k2; ++kp) {
    const uint16_t* wp = w + kp * 64;
    if (kp >= pf_lo && kp < pf_hi) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + kp * 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pf + kp * 64 + 32), _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
#define WB_STEP(r)                                                                   \
  if constexpr (MR > r) {                                                            \
    int32_t pair;                                                                    \
    std::memcpy(&pair, x + r * ldx + 2 * kp, 4);                                     \
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                           \
    a##r##0 = _mm512_dpbf16_ps(a##r##0, xb, w0);                                     \
    a##r##1 = _mm512_dpbf16_ps(a##r##1, xb, w1);                                     \
  }
    WB_ROWS(WB_STEP)
  }
#define WB_STORE(r)                                 \
  if constexpr (MR > r) {                           \
    _mm512_storeu_ps(acc + r * 32, a##r##0);        \
    _mm512_storeu_ps(acc + r * 32 + 16, a##r##1);   \
  }
  WB_ROWS(WB_STORE)
#undef WB_DECL
#undef WB_STEP
#undef WB_STORE
}

// Every 8-row chunk of x against one panel; where there is more than one chunk, the chunks
// share out fetching the next panel (pf, or none).
void panels_bf16(const uint16_t* x, int64_t m, int64_t ldx, const uint16_t* w, int64_t k2,
                 float* acc, const uint16_t* pf) {
  const int64_t chunks = (m + 7) / 8;
  if (chunks < 2) pf = nullptr;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t r = 8 * c, lo = pf ? k2 * c / chunks : 0, hi = pf ? k2 * (c + 1) / chunks : 0;
    const uint16_t* xr = x + r * ldx;
    float* ar = acc + r * 32;
    switch (std::min<int64_t>(8, m - r)) {
      case 8: panel_bf16<8>(xr, ldx, w, k2, ar, pf, lo, hi); break;
      case 7: panel_bf16<7>(xr, ldx, w, k2, ar, pf, lo, hi); break;
      case 6: panel_bf16<6>(xr, ldx, w, k2, ar, pf, lo, hi); break;
      case 5: panel_bf16<5>(xr, ldx, w, k2, ar, pf, lo, hi); break;
      case 4: panel_bf16<4>(xr, ldx, w, k2, ar, pf, lo, hi); break;
      case 3: panel_bf16<3>(xr, ldx, w, k2, ar, pf, lo, hi); break;
      case 2: panel_bf16<2>(xr, ldx, w, k2, ar, pf, lo, hi); break;
      default: panel_bf16<1>(xr, ldx, w, k2, ar, pf, lo, hi); break;
    }
  }
}

// One panel's (m, 32) fp32 sums plus bias into rows of y (bf16 or fp32), 16 columns a
// vector; the bits of store_panel's scalar loop (round to nearest even), NaN payloads aside.
void store_panel_bf16(const float* acc, int64_t m, void* y, bool y_bf16, int64_t ldy,
                      const float* bias, int64_t width) {
  const __mmask16 m0 = width >= 16 ? 0xFFFF : (1u << width) - 1;
  const __mmask16 m1 = width >= 32 ? 0xFFFF : width <= 16 ? 0 : (1u << (width - 16)) - 1;
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < m; ++r) {
    const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(acc + r * kCols), b0);
    const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(acc + r * kCols + 16), b1);
    if (y_bf16) {
      uint16_t* dst = static_cast<uint16_t*>(y) + r * ldy;
      _mm256_mask_storeu_epi16(dst, m0, (__m256i)_mm512_cvtneps_pbh(v0));
      _mm256_mask_storeu_epi16(dst + 16, m1, (__m256i)_mm512_cvtneps_pbh(v1));
    } else {
      float* dst = static_cast<float*>(y) + r * ldy;
      _mm512_mask_storeu_ps(dst, m0, v0);
      _mm512_mask_storeu_ps(dst + 16, m1, v1);
    }
  }
}
#pragma GCC pop_options

#if WB_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")
// AMX: where the rows make the GEMM compute-bound (a few rows on a Xeon: the dot products
// above then take longer than the panel's stream), the tiles multiply 16 rows x 32 k by 32 k
// x 16 columns an instruction. B tiles read the panels in place: a panel's k pair rows are
// 32 columns x 2 = 128 bytes, so a tile of 16 pairs x 16 columns is a 64-byte-wide window
// with a 128-byte stride. C tiles 0-3, A tiles 4-5, B tiles 6-7.
// acc (m16, 32) fp32 = x (m16 rows of k bf16, ldx apart) @ one panel; m16 a multiple of 16
// and k of 32. Two 16-row blocks share each pair of B tiles where there are two.
// pf: the next panel, fetched into cache during the first block (tile loads stall on memory).
void panel_amx(const uint16_t* x, int64_t m16, int64_t ldx, const uint16_t* w, int64_t k,
               float* acc, const uint16_t* pf) {
  auto fetch = [&](int64_t kk) {
    if (!pf) return;
    const char* p = reinterpret_cast<const char*>(pf + kk * 32);
    for (int i = 0; i < 2048; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
  };
  int64_t r = 0;
  for (; r + 32 <= m16; r += 32) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kk = 0; kk < k; kk += 32) {
      if (r == 0) fetch(kk);
      _tile_loadd(6, w + kk * 32, 128);
      _tile_loadd(7, w + kk * 32 + 32, 128);
      _tile_loadd(4, x + r * ldx + kk, ldx * 2);
      _tile_loadd(5, x + (r + 16) * ldx + kk, ldx * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, acc + r * 32, 128);
    _tile_stored(1, acc + r * 32 + 16, 128);
    _tile_stored(2, acc + (r + 16) * 32, 128);
    _tile_stored(3, acc + (r + 16) * 32 + 16, 128);
  }
  if (r < m16) {
    _tile_zero(0); _tile_zero(1);
    for (int64_t kk = 0; kk < k; kk += 32) {
      if (r == 0) fetch(kk);
      _tile_loadd(6, w + kk * 32, 128);
      _tile_loadd(7, w + kk * 32 + 32, 128);
      _tile_loadd(4, x + r * ldx + kk, ldx * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, acc + r * 32, 128);
    _tile_stored(1, acc + r * 32 + 16, 128);
  }
}

#pragma GCC pop_options
#else
void panel_amx(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, float*,
               const uint16_t*) {}
#endif

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma")
#include "gemm_generic.h"
#pragma GCC pop_options
}  // namespace avx512

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "gemm_generic.h"
#pragma GCC pop_options
}  // namespace avx2

namespace portable {
#include "gemm_generic.h"
}  // namespace portable

using GenericPanels = void (*)(const float*, int64_t, int64_t, const uint32_t*, int64_t, float*);

GenericPanels generic_kernel() {
  switch (detect_isa()) {
    case Isa::Avx512Bf16:
    case Isa::Avx512: return avx512::panels_generic;
    case Isa::Avx2: return avx2::panels_generic;
    default: return portable::panels_generic;
  }
}

// One panel's (m, 32) fp32 sums plus bias, stored into y's columns [n0, n0 + width).
void store_panel(const float* acc, int64_t m, const at::Tensor& y, const float* bias,
                 int64_t n0, int64_t width) {
  const int64_t n = y.size(1);
  for (int64_t r = 0; r < m; ++r) {
    const float* src = acc + r * kCols;
    if (y.scalar_type() == at::kFloat) {
      float* dst = y.data_ptr<float>() + r * n + n0;
      for (int64_t c = 0; c < width; ++c) dst[c] = src[c] + (bias ? bias[n0 + c] : 0.f);
    } else {
      at::BFloat16* dst = y.data_ptr<at::BFloat16>() + r * n + n0;
      for (int64_t c = 0; c < width; ++c) dst[c] = src[c] + (bias ? bias[n0 + c] : 0.f);
    }
  }
}

// (n, k) -> (P, k/2, 32, 2): k pair kp of panel p holds that pair of rows 32p .. 32p + 31 side
// by side, rows past n zero. One pass over W in strips of 32 rows x kStrip pairs (8 KB, in
// L1): memory speed, where a padded copy and a permuted one ran at ~0.6 GB/s (5 s for a 1.5B
// model, on a tier-P restore's path).
at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack_linear wants a 2-D bfloat16 weight, got ", weight.sizes(), " ",
              weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1), k2 = k / 2;
  TORCH_CHECK(k % 2 == 0, "pack_linear wants an even in_features, got ", k);
  const at::Tensor w = weight.contiguous();
  const int64_t panels = (n + kCols - 1) / kCols;
  auto out = at::empty({panels, k2, kCols, 2}, w.options());
  const char* src = reinterpret_cast<const char*>(w.data_ptr<at::BFloat16>());
  char* dst = reinterpret_cast<char*>(out.data_ptr<at::BFloat16>());
  constexpr int64_t kStrip = 64;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      char* panel = dst + p * k2 * kCols * 4;
      const int64_t rows = std::min(kCols, n - p * kCols);
      for (int64_t b = 0; b < k2; b += kStrip) {
        const int64_t e = std::min(k2, b + kStrip);
        for (int64_t c = 0; c < kCols; ++c) {
          const char* row = c < rows ? src + (p * kCols + c) * k * 2 : nullptr;
          for (int64_t kp = b; kp < e; ++kp) {
            char* to = panel + (kp * kCols + c) * 4;
            if (row) {
              std::memcpy(to, row + kp * 4, 4);
            } else {
              std::memset(to, 0, 4);
            }
          }
        }
      }
    }
  });
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  int64_t n) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "linear wants a weight from pack_linear");
  const int64_t k2 = packed.size(1), k = 2 * k2, panels = packed.size(0);
  TORCH_CHECK(x.size(-1) == k, "linear: x has ", x.size(-1), " features, the weight ", k);
  TORCH_CHECK(n > (panels - 1) * kCols && n <= panels * kCols, "linear: out_features ", n,
              " does not match the packed weight");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear wants bfloat16 or float32 rows, got ", x.scalar_type());
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  const auto x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y.view(out_shape);
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const bool bf16 = detect_isa() == Isa::Avx512Bf16;
  const bool amx = WB_AMX && bf16 && m >= kAmxRows && k % 32 == 0 && amx_ready();
  // NOTE: AMX reads x in whole 16-row tiles: rows past m are zeros (their sums unstored)
  const int64_t m_acc = amx ? (m + 15) / 16 * 16 : m;
  at::Tensor xin = bf16 ? x2.to(at::kBFloat16) : x2.to(at::kFloat);
  if (m_acc > m) xin = at::cat({xin, at::zeros({m_acc - m, k}, xin.options())});
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const GenericPanels generic = generic_kernel();
  // NOTE: chunks of about 256 KB (at least 2 panels; 4 chunks where there are panels enough):
  // a chunk's first panel goes unfetched, so 64 KB chunks (one 576-wide panel) fetched none
  const int64_t grain = std::clamp<int64_t>((int64_t(1) << 18) / (k * 2 * kCols), 2,
                                            std::max<int64_t>(2, (panels + 3) / 4));
  parallel_chunks(panels, grain, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> acc;
    acc.resize(m_acc * kCols);
    if (amx) amx_configure();
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* wp = w + p * k2 * 2 * kCols;
      const uint16_t* next = p + 1 < p1 ? wp + k2 * 2 * kCols : nullptr;
      if (amx) {
        panel_amx(reinterpret_cast<const uint16_t*>(xin.data_ptr<at::BFloat16>()), m_acc, k, wp,
                  k, acc.data(), next);
      } else if (bf16) {
        panels_bf16(reinterpret_cast<const uint16_t*>(xin.data_ptr<at::BFloat16>()), m, k, wp,
                    k2, acc.data(), next);
      } else {
        generic(xin.data_ptr<float>(), m, k, reinterpret_cast<const uint32_t*>(wp), k2,
                acc.data());
      }
      const int64_t n0 = p * kCols, width = std::min(kCols, n - n0);
      if (bf16) {
        const bool y_bf16 = y.scalar_type() == at::kBFloat16;
        char* y0 = static_cast<char*>(y.data_ptr()) + n0 * y.element_size();
        store_panel_bf16(acc.data(), m, y0, y_bf16, n, bp ? bp + n0 : nullptr, width);
      } else {
        store_panel(acc.data(), m, y, bp, n0, width);
      }
    }
    if (amx) amx_release();
  });
  return y.view(out_shape);
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def("pack_linear(Tensor weight) -> Tensor", &warmboot::pack_linear);
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor",
        &warmboot::linear);
}
