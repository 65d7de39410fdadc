// Greedy sampling's row-wise argmax of (rows, vocab) logits, bf16 or fp32: the answer of
// torch.argmax(dim=-1) (the first maximum; in a row with a NaN, its first NaN), in two passes
// over each row, 16 values a vector: the maximum (and whether any NaN), then its first index.
// torch's CPU argmax walks a vocabulary of 49152 at ~9 ns a value (13 ms a step at 32 rows).
#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "isa.h"
#include "pool.h"

namespace warmboot {
namespace {

template <typename T>
float value(const T* row, int64_t i) {
  return static_cast<float>(row[i]);
}

template <typename T>
int64_t argmax_scalar(const T* row, int64_t v) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  for (int64_t i = 0; i < v; ++i) {
    const float x = value(row, i);
    if (std::isnan(x)) return i;
    if (x > best) best = x, at = i;
  }
  return at;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
// 16 values from i (fewer at the row's end: the rest -inf), as fp32.
template <typename T>
__m512 load16(const T* row, int64_t i, int64_t v) {
  const int64_t n = std::min<int64_t>(16, v - i);
  const __mmask16 m = n == 16 ? 0xFFFF : (1u << n) - 1;
  __m512 x;
  if constexpr (sizeof(T) == 2) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, row + i);
    x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    x = _mm512_maskz_loadu_ps(m, row + i);
  }
  return _mm512_mask_blend_ps(m, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), x);
}

template <typename T>
int64_t argmax_avx512(const T* row, int64_t v) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < v; i += 16) {
    const __m512 x = load16(row, i, v);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    best = _mm512_max_ps(x, best);  // NOTE: a NaN in x gives best (NaNs are found apart)
  }
  const float top = _mm512_reduce_max_ps(best);
  for (int64_t i = 0; i < v; i += 16) {
    const __m512 x = load16(row, i, v);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)
                              : _mm512_cmp_ps_mask(x, _mm512_set1_ps(top), _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // NOTE: unreachable: some value equals the maximum
}
#pragma GCC pop_options

template <typename T>
int64_t argmax_row(const T* row, int64_t v, bool avx512) {
  return avx512 ? argmax_avx512(row, v) : argmax_scalar(row, v);
}

at::Tensor argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.device().is_cpu(),
              "argmax wants (rows, vocab) CPU logits, got ", logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "argmax wants float32 or bfloat16 logits, got ", logits.scalar_type());
  const auto x = logits.contiguous();
  const int64_t rows = x.size(0), v = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const Isa isa = detect_isa();
  const bool avx512 = isa == Isa::Avx512 || isa == Isa::Avx512Bf16;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  parallel_chunks(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      o[r] = bf16 ? argmax_row(x.data_ptr<at::BFloat16>() + r * v, v, avx512)
                  : argmax_row(x.data_ptr<float>() + r * v, v, avx512);
    }
  });
  return out;
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def("argmax(Tensor logits) -> Tensor", &warmboot::argmax);
}
