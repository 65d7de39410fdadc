// AVX-512 helpers shared by the kernels that compute in float32 (gated.cpp,
// flash_prefill.cpp); callers compile them under the same target. (paged_attention.cpp keeps
// its own exp and tanh, older: its exp clamps at 88.5.)
#pragma once

#include <immintrin.h>

namespace warmboot {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
// exp of 16 lanes: Cephes' single-precision polynomial after range reduction (about 1 ulp)
inline __m512 exp16(__m512 x) {
  // NOTE: clamped where scalef still makes inf above and 0 below, as expf does
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// tanh of 16 lanes: Cephes' odd polynomial below 0.625, else 1 - 2 / (e^2|x| + 1) with x's
// sign (about 2 ulp)
inline __m512 tanh16(__m512 x) {
  const __m512 a = _mm512_abs_ps(x), z = _mm512_mul_ps(x, x), one = _mm512_set1_ps(1.f);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
  const __m512 e = exp16(_mm512_add_ps(a, a));
  __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  const __m512 zero = _mm512_setzero_ps();
  big = _mm512_mask_sub_ps(big, _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), zero, big);
  const __mmask16 near0 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(near0, big, small);
}
#pragma GCC pop_options

}  // namespace warmboot
