// The decode step of the hybrid models' state layers, in place on the state rows named by
// slot (no gather into a batch and scatter back): the gated delta rule (Qwen3-Next,
// Qwen3.5), KDA (its decay per key channel) and Mamba 2's state space step; the causal
// conv1d's window step is conv_step.cpp's. They compute what kernels/recurrent.py's steps
// do, in the same order of operations, in float32: each head's state (16 KB at 64 x 64) is
// read from memory once and written once, where torch's step made six passes over a
// gathered copy (at batch 1, 16 heads of 64 x 64, 2-core EPYC: ~0.3 ms a layer, this ~0.05).
//
// The delta rules' and SSD's rows run 8 columns a vector where the CPU has AVX2/FMA, else a
// scalar loop; (row, head) items are shared with the helper threads (parallel_chunks).
#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "isa.h"
#include "pool.h"
#include "state_step.h"

namespace warmboot {
namespace {

constexpr float kL2Eps = 1e-6f;  // recurrent.L2NORM_EPS

at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

// ------------------------------------------------------------------ delta rules

// One (row, head): S (dk, dv) in place; q, k normalised (q scaled); decay dk values or one.
struct Head {
  float* S;
  const float *q, *k, *v, *decay;
  bool per_channel;
  float beta;
  float* out;  // dv
  int64_t dk, dv;
};

// Columns [j0, dv): S = d S; delta = (v - S^T k) beta; S += k delta^T; out = S^T q.
void head_scalar(const Head& h, int64_t j0) {
  std::vector<float> delta(h.dv);
  for (int64_t j = j0; j < h.dv; ++j) delta[j] = 0.f;
  for (int64_t i = 0; i < h.dk; ++i) {
    float* row = h.S + i * h.dv;
    const float d = h.decay[h.per_channel ? i : 0];
    for (int64_t j = j0; j < h.dv; ++j) {
      row[j] *= d;
      delta[j] += h.k[i] * row[j];
    }
  }
  for (int64_t j = j0; j < h.dv; ++j) {
    delta[j] = (h.v[j] - delta[j]) * h.beta;
    h.out[j] = 0.f;
  }
  for (int64_t i = 0; i < h.dk; ++i) {
    float* row = h.S + i * h.dv;
    for (int64_t j = j0; j < h.dv; ++j) {
      row[j] += h.k[i] * delta[j];
      h.out[j] += h.q[i] * row[j];
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
// Columns [j, j + 8 NV) of a head, NV vectors at a time down the rows (twice).
template <int NV>
void head_block_avx2(const Head& h, int64_t j) {
  __m256 acc[NV], delta[NV];
  for (int u = 0; u < NV; ++u) acc[u] = _mm256_setzero_ps();
  for (int64_t i = 0; i < h.dk; ++i) {
    float* row = h.S + i * h.dv + j;
    const __m256 d = _mm256_set1_ps(h.decay[h.per_channel ? i : 0]);
    const __m256 ki = _mm256_set1_ps(h.k[i]);
    for (int u = 0; u < NV; ++u) {
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * u), d);
      _mm256_storeu_ps(row + 8 * u, s);
      acc[u] = _mm256_fmadd_ps(ki, s, acc[u]);
    }
  }
  const __m256 beta = _mm256_set1_ps(h.beta);
  for (int u = 0; u < NV; ++u) {
    delta[u] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(h.v + j + 8 * u), acc[u]), beta);
    acc[u] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < h.dk; ++i) {
    float* row = h.S + i * h.dv + j;
    const __m256 ki = _mm256_set1_ps(h.k[i]), qi = _mm256_set1_ps(h.q[i]);
    for (int u = 0; u < NV; ++u) {
      const __m256 s = _mm256_fmadd_ps(ki, delta[u], _mm256_loadu_ps(row + 8 * u));
      _mm256_storeu_ps(row + 8 * u, s);
      acc[u] = _mm256_fmadd_ps(qi, s, acc[u]);
    }
  }
  for (int u = 0; u < NV; ++u) _mm256_storeu_ps(h.out + j + 8 * u, acc[u]);
}

void head_avx2(const Head& h) {
  int64_t j = 0;
  for (; j + 32 <= h.dv; j += 32) head_block_avx2<4>(h, j);
  for (; j + 8 <= h.dv; j += 8) head_block_avx2<1>(h, j);
  if (j < h.dv) head_scalar(h, j);
}
#pragma GCC pop_options

// x (rows, heads, d) float32 -> x / |x| (rsqrt form, or a division: KDA's) times `scale`.
at::Tensor l2norm(const at::Tensor& x, float scale, bool divide) {
  auto y = at::empty_like(x);
  const int64_t d = x.size(-1), n = x.numel() / std::max<int64_t>(d, 1);
  const float* src = x.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const float* a = src + r * d;
    float s = 0.f;
    for (int64_t i = 0; i < d; ++i) s += a[i] * a[i];
    const float norm = std::sqrt(s + kL2Eps), inv = 1.f / norm;
    for (int64_t i = 0; i < d; ++i) dst[r * d + i] = (divide ? a[i] / norm : a[i] * inv) * scale;
  }
  return y;
}

// q, k (B, Hk, Dk) (Hk divides H); v (B, H, Dv); g (B, H) or, per_channel, (B, H, Dk);
// beta (B, H); states (slots, H, Dk, Dv) float32, rows `slots` updated in place.
at::Tensor delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta, at::Tensor& states,
                      const at::Tensor& slots, double scale, bool per_channel) {
  const char* op = per_channel ? "kda_step" : "gated_delta_step";
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              op, ": q, k (B, Hk, Dk) and v (B, H, Dv), got ", q.sizes(), k.sizes(), v.sizes());
  const int64_t B = v.size(0), H = v.size(1), Dv = v.size(2), Hk = q.size(1), Dk = q.size(2);
  TORCH_CHECK(Hk > 0 && H % Hk == 0 && (!per_channel || Hk == H), op, ": ", Hk,
              " key heads do not group ", H, " value heads");
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() &&
                  states.dim() == 4 && states.size(1) == H && states.size(2) == Dk &&
                  states.size(3) == Dv,
              op, ": states must be contiguous float32 (slots, ", H, ", ", Dk, ", ", Dv,
              "), got ", states.sizes());
  TORCH_CHECK(g.numel() == B * H * (per_channel ? Dk : 1) && beta.numel() == B * H, op,
              ": g or beta of the wrong size");
  check_slots(slots, B, states.size(0), op);
  const bool divide = per_channel;  // NOTE: KDA normalises by a division (recurrent.py)
  const auto qn = l2norm(f32(q), static_cast<float>(scale), divide);
  const auto kn = l2norm(f32(k), 1.f, divide);
  const auto vf = f32(v), bf = f32(beta), decay = f32(g).exp();
  auto out = at::empty({B, H, Dv}, vf.options());
  const int64_t* s = slots.data_ptr<int64_t>();
  float* S = states.data_ptr<float>();
  const int64_t per_decay = per_channel ? Dk : 1, group = H / Hk;
  const bool avx2 = detect_isa() != Isa::Portable;
  parallel_chunks(B * H, 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H, kh = b * Hk + h / group;
      const Head head{S + (s[b] * H + h) * Dk * Dv,
                      qn.data_ptr<float>() + kh * Dk,
                      kn.data_ptr<float>() + kh * Dk,
                      vf.data_ptr<float>() + i * Dv,
                      decay.data_ptr<float>() + i * per_decay,
                      per_channel,
                      bf.data_ptr<float>()[i],
                      out.data_ptr<float>() + i * Dv,
                      Dk,
                      Dv};
      if (avx2) {
        head_avx2(head);
      } else {
        head_scalar(head, 0);
      }
    }
  });
  return out.to(v.scalar_type());
}

at::Tensor gated_delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& g, const at::Tensor& beta, at::Tensor states,
                            const at::Tensor& slots, double scale) {
  return delta_step(q, k, v, g, beta, states, slots, scale, false);
}

at::Tensor kda_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& g, const at::Tensor& beta, at::Tensor states,
                    const at::Tensor& slots, double scale) {
  return delta_step(q, k, v, g, beta, states, slots, scale, true);
}

// ------------------------------------------------------------------ Mamba 2 (SSD)

// One (row, head): S (P, N) = d S + (x dt) B^T per row p (torch's addcmul), y_p = S_p . C.
void ssd_head_scalar(float* S, const float* x, const float* dtB, const float* C, float d,
                     float* y, int64_t P, int64_t N, int64_t n0) {
  for (int64_t p = 0; p < P; ++p) {
    float* row = S + p * N;
    float acc = 0.f;
    for (int64_t n = n0; n < N; ++n) {
      row[n] = row[n] * d + x[p] * dtB[n];
      acc += row[n] * C[n];
    }
    y[p] += acc;
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

void ssd_head_avx2(float* S, const float* x, const float* dtB, const float* C, float d,
                   float* y, int64_t P, int64_t N) {
  const int64_t n8 = N / 8 * 8;
  const __m256 dv = _mm256_set1_ps(d);
  for (int64_t p = 0; p < P; ++p) {
    float* row = S + p * N;
    const __m256 xp = _mm256_set1_ps(x[p]);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t n = 0; n < n8; n += 8) {
      const __m256 u = _mm256_mul_ps(xp, _mm256_loadu_ps(dtB + n));
      const __m256 s = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(row + n), dv), u);
      _mm256_storeu_ps(row + n, s);
      acc = _mm256_fmadd_ps(s, _mm256_loadu_ps(C + n), acc);
    }
    y[p] = hsum(acc);
  }
  if (n8 < N) ssd_head_scalar(S, x, dtB, C, d, y, P, N, n8);
}
#pragma GCC pop_options

// x (B, H, P); dt (B, H) softplus'd; A, D (H,); Bm, Cm (B, G, N) (G divides H); states
// (slots, H, P, N) float32, rows `slots` updated in place.
at::Tensor ssd_step(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                    const at::Tensor& Bm, const at::Tensor& Cm, const at::Tensor& D,
                    at::Tensor states, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 3 && Bm.dim() == 3 && Cm.sizes() == Bm.sizes() &&
                  Bm.size(0) == x.size(0),
              "ssd_step: x (B, H, P), B and C (B, G, N), got ", x.sizes(), Bm.sizes());
  const int64_t B = x.size(0), H = x.size(1), P = x.size(2), G = Bm.size(1), N = Bm.size(2);
  TORCH_CHECK(G > 0 && H % G == 0, "ssd_step: ", G, " groups do not divide ", H, " heads");
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() &&
                  states.dim() == 4 && states.size(1) == H && states.size(2) == P &&
                  states.size(3) == N,
              "ssd_step: states must be contiguous float32 (slots, ", H, ", ", P, ", ", N,
              "), got ", states.sizes());
  TORCH_CHECK(dt.numel() == B * H && A.numel() == H && D.numel() == H,
              "ssd_step: dt (B, H), A and D (H,)");
  check_slots(slots, B, states.size(0), "ssd_step");
  const auto xf = f32(x), dtf = f32(dt), Bf = f32(Bm), Cf = f32(Cm), Df = f32(D);
  const auto decay = (dtf.view({B, H}) * f32(A).view({1, H})).exp();  // (B, H)
  auto y = at::empty({B, H, P}, xf.options());
  const int64_t* s = slots.data_ptr<int64_t>();
  float* S = states.data_ptr<float>();
  const int64_t group = H / G;
  const bool avx2 = detect_isa() != Isa::Portable;
  parallel_chunks(B * H, 4, [&](int64_t i0, int64_t i1) {
    std::vector<float> dtB(N);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H, grp = b * G + h / group;
      const float dti = dtf.data_ptr<float>()[i];
      const float* Bi = Bf.data_ptr<float>() + grp * N;
      for (int64_t n = 0; n < N; ++n) dtB[n] = dti * Bi[n];
      const float* xi = xf.data_ptr<float>() + i * P;
      float* yi = y.data_ptr<float>() + i * P;
      float* Si = S + (s[b] * H + h) * P * N;
      const float* Ci = Cf.data_ptr<float>() + grp * N;
      const float d = decay.data_ptr<float>()[i];
      if (avx2) {
        ssd_head_avx2(Si, xi, dtB.data(), Ci, d, yi, P, N);
      } else {
        std::fill(yi, yi + P, 0.f);
        ssd_head_scalar(Si, xi, dtB.data(), Ci, d, yi, P, N, 0);
      }
      const float Dh = Df.data_ptr<float>()[h];
      for (int64_t p = 0; p < P; ++p) yi[p] += xi[p] * Dh;
    }
  });
  return y.to(x.scalar_type());
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def(
      "gated_delta_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states,"
      " Tensor slots, float scale) -> Tensor",
      &warmboot::gated_delta_step);
  m.def(
      "kda_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states,"
      " Tensor slots, float scale) -> Tensor",
      &warmboot::kda_step);
  m.def(
      "ssd_step(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor(a!) states,"
      " Tensor slots) -> Tensor",
      &warmboot::ssd_step);
}
