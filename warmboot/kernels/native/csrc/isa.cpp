// The library's namespace and the instruction set its kernels run with on this CPU.
#include "isa.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

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

// CPUID leaf 7: AMX-BF16 (EDX bit 22) and AMX-TILE (bit 24); then ask Linux for the tile
// data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), which a process must hold to use it.
bool amx_permitted() {
#if !(defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11)
  return false;  // NOTE: gemm.cpp builds its tiles with GCC 11 or later only
#endif
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

const bool g_amx_permitted = amx_permitted();
std::atomic<bool> g_amx{g_amx_permitted};

bool amx_available() { return g_amx_permitted; }

// Tests run the GEMM with and without the tiles; on where the CPU and OS allow only.
bool use_amx(bool on) {
  TORCH_CHECK(!on || g_amx_permitted, "this CPU or OS cannot run AMX");
  g_amx = on;
  return on;
}

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

// gVisor's CPUID hides sets the host has (AVX-512 BF16 among them); the launcher hands its
// worker the host's flags, and this raises the set to what they list (never lowers it).
std::string adopt_host_isa(const std::string& name) {
  for (int i = 0; i < 4; ++i) {
    if (name == kNames[i]) {
      if (i > g_isa.load()) g_isa = i;
      return kNames[g_isa.load()];
    }
  }
  TORCH_CHECK(false, "unknown instruction set ", name);
}

}  // namespace

Isa detect_isa() { return static_cast<Isa>(g_isa.load()); }

bool amx_ready() { return g_amx.load() && detect_isa() == Isa::Avx512Bf16; }

}  // namespace warmboot

TORCH_LIBRARY(warmboot_cpu, m) {
  m.def("isa() -> str", &warmboot::isa_name);
  m.def("use_isa(str name) -> str", &warmboot::use_isa);
  m.def("adopt_host_isa(str name) -> str", &warmboot::adopt_host_isa);
  m.def("amx() -> bool", &warmboot::amx_available);
  m.def("use_amx(bool on) -> bool", &warmboot::use_amx);
}
