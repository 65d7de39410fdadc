// y = x @ W.T + b for prefill-sized rows on torch's own GEMM (oneDNN on a CPU with bf16),
// its row blocks shared with the helper threads (parallel_chunks, as the native GEMM's panels
// are): the device thread runs one torch thread, so without them a prefill's GEMMs left the
// host's core idle. Each block is one single-threaded addmm into its rows of y; a block's
// rows give the same bits whichever thread computes them, and the blocks depend on the row
// count alone, so a step lent the helper or not gives the same bits.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include "dense.h"
#include "pool.h"

namespace warmboot {
namespace {

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1),
              "dense_linear: x has ", x.size(-1), " features, the weight is ", weight.sizes());
  const int64_t k = weight.size(1), n = weight.size(0);
  const auto x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  if (m < 2 * kMinBlockRows) return at::linear(x, weight, bias);
  auto y = at::empty({m, n}, x.options());
  const auto wt = weight.t();
  const bool inference = c10::InferenceMode::is_enabled();
  parallel_chunks(m, dense_block_rows(m), [&](int64_t r0, int64_t r1) {
    c10::InferenceMode mode(inference);  // NOTE: thread-local: a helper takes the caller's
    auto out = y.narrow(0, r0, r1 - r0);
    const auto rows = x2.narrow(0, r0, r1 - r0);
    if (bias.has_value()) {
      at::addmm_out(out, *bias, rows, wt);
    } else {
      at::mm_out(out, rows, wt);
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = n;
  return y.view(shape);
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &warmboot::dense_linear);
}
