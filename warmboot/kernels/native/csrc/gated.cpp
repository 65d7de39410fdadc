// The gated MLP's activation, silu(gate) * up, as one pass shared with the helper threads
// (parallel_chunks), and a prefill's gate/up GEMM with it fused (dense_gated): each row block's
// GEMM output (oneDNN's, as dense_linear) is activated while it is in cache, so the step's
// (rows, 2 * inter) projection never goes to memory. On the device thread's one torch thread
// inductor's fused kernel for it ran alone: 3.3 ms a layer for a 2048-token step.
//
// Both compute in float32 and round once to the output's dtype, as inductor's kernel does.
// bf16 rows where the set in use has AVX-512 BF16: 16 lanes a step, exp by Cephes'
// single-precision polynomial after range reduction (about 1 ulp in float32); other dtypes
// and sets: a scalar loop on the C library's exp.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "dense.h"
#include "isa.h"
#include "pool.h"
#include "simd.h"

namespace warmboot {
namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
__m512 load_bf16(const at::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One row: out[c] = silu(g[c]) * u[c], c < n.
void row_avx512(const at::BFloat16* g, const at::BFloat16* u, at::BFloat16* out, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = n - c >= 16 ? 0xFFFF : (1u << (n - c)) - 1;
    const __m512 gv = load_bf16(g + c, m), uv = load_bf16(u + c, m);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    _mm256_mask_storeu_epi16(out + c, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, uv)));
  }
}
#pragma GCC pop_options

template <typename T>
void row_scalar(const T* g, const T* u, T* out, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const float gf = static_cast<float>(g[c]);
    out[c] = static_cast<T>(gf / (1.f + std::exp(-gf)) * static_cast<float>(u[c]));
  }
}

template <typename T>
void activate_typed(const at::Tensor& gu, const at::Tensor& out, int64_t r0, int64_t r1) {
  const int64_t n = out.size(1), ld = gu.stride(0), ldo = out.stride(0);
  const T* src = gu.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = src + r * ld;
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (detect_isa() == Isa::Avx512Bf16) {
        row_avx512(g, g + n, dst + r * ldo, n);
        continue;
      }
    }
    row_scalar(g, g + n, dst + r * ldo, n);
  }
}

// Rows [r0, r1) of gu (rows of 2n: gate then up) into the same rows of out (rows of n).
void activate_rows(const at::Tensor& gu, const at::Tensor& out, int64_t r0, int64_t r1) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu_mul", [&] {
    activate_typed<scalar_t>(gu, out, r0, r1);
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "silu_mul wants gate and up side by side in the last dimension, got ",
              gate_up.sizes());
  const int64_t n = gate_up.size(-1) / 2;
  const auto gu = gate_up.reshape({-1, 2 * n}).contiguous();
  auto out = at::empty({gu.size(0), n}, gu.options());
  // NOTE: about 32 KB of input a chunk
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / (4 * n * gu.element_size()));
  parallel_chunks(gu.size(0), grain, [&](int64_t r0, int64_t r1) {
    activate_rows(gu, out, r0, r1);
  });
  auto shape = gate_up.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

// silu_mul(x @ weight.T + bias) in row blocks (dense_linear's), each block's projection
// activated as soon as it is computed.
at::Tensor dense_gated(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1) && weight.size(0) % 2 == 0,
              "dense_gated: x has ", x.size(-1), " features, the weight is ", weight.sizes());
  const int64_t k = weight.size(1), n = weight.size(0) / 2;
  const auto x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  auto shape = x.sizes().vec();
  shape.back() = n;
  if (m < 2 * kMinBlockRows) return silu_mul(at::linear(x2, weight, bias)).view(shape);
  auto y = at::empty({m, n}, x.options());
  const auto wt = weight.t();
  const bool inference = c10::InferenceMode::is_enabled();
  parallel_chunks(m, dense_block_rows(m), [&](int64_t r0, int64_t r1) {
    c10::InferenceMode mode(inference);  // NOTE: thread-local: a helper takes the caller's
    const auto rows = x2.narrow(0, r0, r1 - r0);
    const auto gu = bias.has_value() ? at::addmm(*bias, rows, wt) : at::mm(rows, wt);
    activate_rows(gu, y.narrow(0, r0, r1 - r0), 0, r1 - r0);
  });
  return y.view(shape);
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor", &warmboot::silu_mul);
  m.def("dense_gated(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &warmboot::dense_gated);
}
