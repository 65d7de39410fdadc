// The library's namespace and the instruction set its kernels run with on this CPU.
#include "isa.h"

#include <torch/library.h>

#include <atomic>
#include <string>

namespace warmboot {
namespace {

Isa best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")) {
    return Isa::Avx512Bf16;
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
    return Isa::Avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
  return Isa::Portable;
}

const char* kNames[] = {"portable", "avx2", "avx512", "avx512_bf16"};

std::atomic<int> g_isa{static_cast<int>(best_isa())};

std::string isa_name() { return kNames[g_isa.load()]; }

// Tests run every kernel variant the CPU can: a lower set than the best, never a higher one.
std::string use_isa(const std::string& name) {
  for (int i = 0; i < 4; ++i) {
    if (name == kNames[i]) {
      TORCH_CHECK(i <= static_cast<int>(best_isa()), "this CPU cannot run ", name);
      g_isa = i;
      return name;
    }
  }
  TORCH_CHECK(false, "unknown instruction set ", name);
}

}  // namespace

Isa detect_isa() { return static_cast<Isa>(g_isa.load()); }

}  // namespace warmboot

TORCH_LIBRARY(warmboot_cpu, m) {
  m.def("isa() -> str", &warmboot::isa_name);
  m.def("use_isa(str name) -> str", &warmboot::use_isa);
}
