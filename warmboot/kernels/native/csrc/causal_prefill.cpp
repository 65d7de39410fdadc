// A step's prefills, shared with the helper threads (parallel_chunks): the device thread runs
// one torch thread, so one attention call per sequence left the host's other core idle.
//
// causal_prefill: fresh prefills (no cached context, causal; a sliding window, chunks, sinks
// and soft-capped scores only on the flash kernel), their K/V the step's own rows. bf16 where
// flash_fits: flash attention on AMX tiles (flash_prefill.cpp); otherwise (fp32, no AMX,
// other head sizes) torch's SDPA, one (sequence, KV head) a call, each giving the bits of one
// call over all heads.
//
// paged_prefill: chunks over cached context (chunked prefill, prefix-cache hits), their K/V
// in the paged cache (the chunk's own written first), through the same flash kernel, which
// repacks them from the blocks where they lie (no gather); returns false, doing nothing,
// where the kernel does not fit.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "flash_prefill.h"
#include "pool.h"

namespace warmboot {
namespace {

struct Seqs {
  at::IntArrayRef starts, lens;
  int64_t hkv, group;
};

void sdpa_calls(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& out, const Seqs& s, double scale) {
  const bool inference = c10::InferenceMode::is_enabled();
  const int64_t calls = static_cast<int64_t>(s.starts.size()) * s.hkv;
  parallel_chunks(calls, 1, [&](int64_t c0, int64_t c1) {
    c10::InferenceMode mode(inference);  // NOTE: thread-local: a helper takes the caller's
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t st = s.starts[c / s.hkv], n = s.lens[c / s.hkv], h = c % s.hkv;
      auto heads = [&](const at::Tensor& t, int64_t first, int64_t count) {
        return t.narrow(0, st, n).narrow(1, first, count).transpose(0, 1).unsqueeze(0);
      };
      const auto o = at::scaled_dot_product_attention(
          heads(q, h * s.group, s.group), heads(k, h, 1), heads(v, h, 1), std::nullopt, 0.0,
          /*is_causal=*/true, scale, /*enable_gqa=*/true);
      out.narrow(0, st, n).narrow(1, h * s.group, s.group).copy_(o[0].transpose(0, 1));
    }
  });
}

bool rows_fit(const at::Tensor& t) {  // bf16, each token's heads contiguous
  return t.scalar_type() == at::kBFloat16 && t.stride(-1) == 1 && t.stride(-2) == t.size(-1);
}

// The call's window, sinks, soft-cap and chunk for the flash kernel (sinks as float32 in
// `keep`).
FlashOpts options(const at::Tensor& q, double scale, int64_t window,
                  const std::optional<at::Tensor>& sinks, double softcap, int64_t chunk,
                  at::Tensor& keep, const char* op) {
  TORCH_CHECK(window >= 0, op, ": window must be 0 (none) or positive, got ", window);
  TORCH_CHECK(chunk >= 0, op, ": chunk must be 0 (none) or positive, got ", chunk);
  TORCH_CHECK(softcap >= 0, op, ": softcap must be 0 (none) or positive, got ", softcap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->numel() == q.size(1), op, ": sinks must hold ", q.size(1),
                " logits, got ", sinks->sizes());
    keep = sinks->to(at::kFloat).contiguous();
  }
  return FlashOpts{scale, window, keep.defined() ? keep.data_ptr<float>() : nullptr,
                   static_cast<float>(softcap), chunk};
}

void causal_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, at::IntArrayRef starts, at::IntArrayRef lens,
                    double scale, int64_t window, const std::optional<at::Tensor>& sinks,
                    double softcap, int64_t chunk) {
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
  at::Tensor keep;
  const FlashOpts opts =
      options(q, scale, window, sinks, softcap, chunk, keep, "causal_prefill");
  if (flash_fits(q, out) && rows_fit(k) && rows_fit(v)) {
    std::vector<FlashSeq> seqs;
    for (size_t i = 0; i < starts.size(); ++i) seqs.push_back({starts[i], lens[i], lens[i]});
    flash_amx(q, out, seqs, hkv, opts, [&](int64_t i, int64_t h, bool is_v) {
      const at::Tensor& t = is_v ? v : k;
      return Rows{bits(t) + (starts[i] * t.stride(0) + h * t.size(2)), t.stride(0)};
    });
    return;
  }
  TORCH_CHECK(window == 0 && chunk == 0 && !sinks.has_value() && softcap == 0,
              "causal_prefill: a window, sinks or a softcap need the flash kernel (bf16 on AMX "
              "tiles), and so do chunks");
  sdpa_calls(q, k, v, out, Seqs{starts, lens, hkv, q.size(1) / hkv}, scale);
}

void check_tables(const std::vector<at::Tensor>& tables, at::IntArrayRef ctxs, int64_t blocks,
                  int64_t bs) {
  for (size_t i = 0; i < tables.size(); ++i) {
    const at::Tensor& t = tables[i];
    const int64_t need = (ctxs[i] + bs - 1) / bs;
    TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && t.is_contiguous() &&
                    t.size(0) >= need,
                "paged_prefill: sequence ", i, "'s block table must be int64 with ", need,
                " blocks or more, got ", t.sizes(), " ", t.scalar_type());
    const int64_t* ids = t.data_ptr<int64_t>();
    for (int64_t b = 0; b < need; ++b) {
      TORCH_CHECK(ids[b] >= 0 && ids[b] < blocks, "paged_prefill: block ", ids[b],
                  " is outside the cache (", blocks, " blocks)");
    }
  }
}

bool paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& out, at::IntArrayRef starts, at::IntArrayRef lens,
                   at::IntArrayRef ctxs, const std::vector<at::Tensor>& tables, double scale,
                   int64_t window, const std::optional<at::Tensor>& sinks, double softcap,
                   int64_t chunk) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(3) == q.size(2),
              "paged_prefill wants q, out (N, Hq, D) and caches (blocks, block size, Hkv, D), "
              "got ", q.sizes(), ", ", out.sizes(), ", ", k_cache.sizes(), ", ", v_cache.sizes());
  const int64_t hkv = k_cache.size(2), bs = k_cache.size(1), tokens = q.size(0);
  TORCH_CHECK(hkv > 0 && q.size(1) % hkv == 0, "paged_prefill: ", q.size(1),
              " query heads over ", hkv, " KV heads");
  TORCH_CHECK(starts.size() == lens.size() && ctxs.size() == lens.size() &&
                  tables.size() == lens.size(),
              "paged_prefill: one start, length, context and table per sequence");
  for (size_t i = 0; i < starts.size(); ++i) {
    TORCH_CHECK(starts[i] >= 0 && lens[i] > 0 && starts[i] + lens[i] <= tokens &&
                    ctxs[i] >= lens[i],
                "paged_prefill: sequence ", i, " (start ", starts[i], ", length ", lens[i],
                ", context ", ctxs[i], ") is outside the ", tokens, " tokens or its context");
  }
  check_tables(tables, ctxs, k_cache.size(0), bs);
  if (!(flash_fits(q, out) && k_cache.is_contiguous() && v_cache.is_contiguous() &&
        rows_fit(k_cache) && rows_fit(v_cache))) {
    return false;
  }
  at::Tensor keep;
  const FlashOpts opts = options(q, scale, window, sinks, softcap, chunk, keep, "paged_prefill");
  std::vector<FlashSeq> seqs;
  for (size_t i = 0; i < starts.size(); ++i) seqs.push_back({starts[i], lens[i], ctxs[i]});
  const int64_t d = q.size(2);
  flash_amx(q, out, seqs, hkv, opts, [&](int64_t i, int64_t h, bool is_v) {
    return Rows{bits(is_v ? v_cache : k_cache) + h * d, hkv * d, tables[i].data_ptr<int64_t>(),
                bs};
  });
  return true;
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def("causal_prefill(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int[] starts, int[] lens, "
        "float scale, int window=0, Tensor? sinks=None, float softcap=0, int chunk=0) -> ()",
        &warmboot::causal_prefill);
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor(a!) out, int[] starts, "
        "int[] lens, int[] contexts, Tensor[] tables, float scale, int window=0, "
        "Tensor? sinks=None, float softcap=0, int chunk=0) -> bool",
        &warmboot::paged_prefill);
}
