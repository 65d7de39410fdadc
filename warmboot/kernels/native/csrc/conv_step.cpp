// The causal conv1d's decode step (Mamba 2's, gated DeltaNet's and KDA's conv, LFM2's short
// conv) in place on the window rows named by slot: recurrent.causal_conv1d_step without the
// gather and scatter and torch's depthwise conv1d set-up (~200 us a layer at batch 1 for
// 2048 channels, where this takes ~10). The channels go in a scalar loop (K - 1 values each),
// the SiLU 8 a vector where the CPU has AVX2/FMA.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "isa.h"
#include "state_step.h"

namespace warmboot {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma")
// exp of 8 lanes: Cephes' single-precision polynomial after range reduction (simd.h's exp16
// in AVX2: about 1 ulp), clamped where 2^n stays a normal float.
__m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256i e = _mm256_slli_epi32(biased, 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// y[c] = y[c] / (1 + exp(-y[c])), c < n, 8 a vector.
int64_t silu_avx2(float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 v = _mm256_loadu_ps(y + c);
    const __m256 e = exp8(_mm256_sub_ps(zero, v));
    _mm256_storeu_ps(y + c, _mm256_div_ps(v, _mm256_add_ps(one, e)));
  }
  return c;
}
#pragma GCC pop_options

// Each row's window (slots, C, K - 1) shifted by its new input x (B, C) in place; y = the
// window's dot with the taps (+ bias) in float32, rounded to T as torch's conv1d does, then
// SiLU (rounded again). kW: the window's length where fixed at compile time (the loops
// unroll), else 0 (w's).
template <typename T, int kW>
void conv_rows(const at::Tensor& x, const at::Tensor& w, const T* __restrict bias,
               at::Tensor& states, const int64_t* slots, at::Tensor& y, bool silu) {
  const int64_t B = x.size(0), C = x.size(1), K = w.size(1), ld = x.stride(0);
  const int64_t W = kW > 0 ? kW : K - 1;
  const T* __restrict xs = x.data_ptr<T>();
  const T* __restrict ws = w.data_ptr<T>();
  T* st = states.data_ptr<T>();
  T* __restrict ys = y.data_ptr<T>();
  const bool avx2 = detect_isa() != Isa::Portable;
  std::vector<float> pre(C);
  for (int64_t b = 0; b < B; ++b) {
    T* __restrict win = st + slots[b] * C * W;
    for (int64_t c = 0; c < C; ++c) {
      T* __restrict s = win + c * W;
      const T* __restrict wc = ws + c * (W + 1);
      const T xin = xs[b * ld + c];
      float acc = 0.f;
      for (int64_t t = 0; t < W; ++t) acc += static_cast<float>(wc[t]) * static_cast<float>(s[t]);
      acc += static_cast<float>(wc[W]) * static_cast<float>(xin);
      for (int64_t t = 0; t + 1 < W; ++t) s[t] = s[t + 1];
      if (W > 0) s[W - 1] = xin;
      if (bias != nullptr) acc += static_cast<float>(bias[c]);
      pre[c] = static_cast<float>(static_cast<T>(acc));
    }
    int64_t c = silu && avx2 ? silu_avx2(pre.data(), C) : (silu ? 0 : C);
    for (; c < C; ++c) pre[c] = pre[c] / (1.f + std::exp(-pre[c]));
    for (c = 0; c < C; ++c) ys[b * C + c] = static_cast<T>(pre[c]);
  }
}

template <typename T>
void conv_typed(const at::Tensor& x, const at::Tensor& w, const T* bias, at::Tensor& states,
                const int64_t* slots, at::Tensor& y, bool silu) {
  switch (w.size(1)) {  // NOTE: the models' kernels: 4 (most), 3 (LFM2), 2
    case 4: return conv_rows<T, 3>(x, w, bias, states, slots, y, silu);
    case 3: return conv_rows<T, 2>(x, w, bias, states, slots, y, silu);
    case 2: return conv_rows<T, 1>(x, w, bias, states, slots, y, silu);
    default: return conv_rows<T, 0>(x, w, bias, states, slots, y, silu);
  }
}

at::Tensor conv_step(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, at::Tensor states,
                     const at::Tensor& slots, bool silu) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == x.size(1) &&
                  x.stride(1) == 1 && weight.is_contiguous(),
              "conv_step: x (B, C) rows contiguous and weight (C, K), got ", x.sizes(),
              weight.sizes());
  const int64_t C = x.size(1), K = weight.size(1);
  TORCH_CHECK(states.dim() == 3 && states.size(1) == C && states.size(2) == K - 1 &&
                  states.is_contiguous() && states.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(),
              "conv_step: states (slots, C, K - 1) contiguous and weight in x's dtype, got ",
              states.sizes());
  TORCH_CHECK(!bias.has_value() || (bias->numel() == C && bias->is_contiguous() &&
                                    bias->scalar_type() == x.scalar_type()),
              "conv_step: bias (C,) in x's dtype");
  check_slots(slots, x.size(0), states.size(0), "conv_step");
  auto y = at::empty({x.size(0), C}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "conv_step", [&] {
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    conv_typed<scalar_t>(x, weight, b, states, slots.data_ptr<int64_t>(), y, silu);
  });
  return y;
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def(
      "conv_step(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) states, Tensor slots,"
      " bool silu) -> Tensor",
      &warmboot::conv_step);
}
