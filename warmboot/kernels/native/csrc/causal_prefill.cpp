// A step's fresh prefills (no cached context, causal, no window, soft-cap or sinks) through
// torch's SDPA, one (sequence, KV head) at a time, those calls shared with the helper threads
// (parallel_chunks): the device thread runs one torch thread, so SDPA's flash kernel left the
// host's core idle through a prefill's attention. A call's rows are its KV head's query heads
// (GQA) against that head's K/V; each call gives the bits of one call over all heads (flash
// attention computes every head apart, blocked by the length alone) whichever thread runs it.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include "pool.h"

namespace warmboot {
namespace {

void causal_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, at::IntArrayRef starts, at::IntArrayRef lens,
                    double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && out.sizes() == q.sizes(),
              "causal_prefill wants q, out (N, Hq, D) and k, v (N, Hkv, D), got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes(), ", ", out.sizes());
  const int64_t tokens = q.size(0), hkv = k.size(1);
  TORCH_CHECK(k.size(0) == tokens && hkv > 0 && q.size(1) % hkv == 0 && k.size(2) == q.size(2),
              "causal_prefill: ", q.size(1), " query heads over ", hkv, " KV heads of ",
              k.sizes());
  TORCH_CHECK(starts.size() == lens.size(), "causal_prefill: ", starts.size(), " starts, ",
              lens.size(), " lengths");
  for (size_t i = 0; i < starts.size(); ++i) {
    TORCH_CHECK(starts[i] >= 0 && lens[i] > 0 && starts[i] + lens[i] <= tokens,
                "causal_prefill: sequence ", i, " (start ", starts[i], ", length ", lens[i],
                ") is outside the ", tokens, " tokens");
  }
  const int64_t group = q.size(1) / hkv;
  const bool inference = c10::InferenceMode::is_enabled();
  const int64_t calls = static_cast<int64_t>(starts.size()) * hkv;
  parallel_chunks(calls, 1, [&](int64_t c0, int64_t c1) {
    c10::InferenceMode mode(inference);  // NOTE: thread-local: a helper takes the caller's
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t s = starts[c / hkv], n = lens[c / hkv], h = c % hkv;
      auto heads = [&](const at::Tensor& t, int64_t first, int64_t count) {
        return t.narrow(0, s, n).narrow(1, first, count).transpose(0, 1).unsqueeze(0);
      };
      const auto o = at::scaled_dot_product_attention(
          heads(q, h * group, group), heads(k, h, 1), heads(v, h, 1), std::nullopt, 0.0,
          /*is_causal=*/true, scale, /*enable_gqa=*/true);
      out.narrow(0, s, n).narrow(1, h * group, group).copy_(o[0].transpose(0, 1));
    }
  });
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def("causal_prefill(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int[] starts, int[] lens, "
        "float scale) -> ()",
        &warmboot::causal_prefill);
}
