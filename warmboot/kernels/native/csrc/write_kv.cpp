// A step's new K and V rows into the paged caches at their slots, in one call: what two
// index_copy_ calls did, without their per-call set-up (~10 us each, twice a layer a step).
// A token's row (all its KV heads) must be contiguous; tokens may lie any stride apart (the
// compiled step hands K and V as views into its fused QKV projection).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace warmboot {
namespace {

void check_rows(const at::Tensor& x, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(x.dim() == 3 && cache.dim() == 4 && x.size(1) == cache.size(2) &&
                  x.size(2) == cache.size(3),
              "write_kv: ", name, " rows ", x.sizes(), " do not fit the cache ", cache.sizes());
  TORCH_CHECK(x.scalar_type() == cache.scalar_type() && cache.is_contiguous() &&
                  x.stride(2) == 1 && x.stride(1) == x.size(2),
              "write_kv: ", name, " must be rows of the cache's dtype, each contiguous");
}

void copy_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots) {
  const int64_t n = x.size(0), bytes = x.size(1) * x.size(2) * x.element_size();
  const auto* src = static_cast<const char*>(x.data_ptr());
  auto* dst = static_cast<char*>(cache.data_ptr());
  const int64_t stride = x.stride(0) * x.element_size();
  for (int64_t i = 0; i < n; ++i) std::memcpy(dst + slots[i] * bytes, src + i * stride, bytes);
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots) {
  check_rows(k, k_cache, "k");
  check_rows(v, v_cache, "v");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "write_kv: the caches differ in shape");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && v.size(0) == k.size(0) &&
                  slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "write_kv: one int64 slot per token, got ", slots.sizes());
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.size(0); ++i) {
    TORCH_CHECK(s[i] >= 0 && s[i] < capacity, "write_kv: slot ", s[i], " is outside the cache (",
                capacity, " slots)");
  }
  copy_rows(k, k_cache, s);
  copy_rows(v, v_cache, s);
}

}  // namespace
}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()",
        &warmboot::write_kv);
}
