// Run-time choice of instruction set: kernels compile one function per set with target
// attributes and dispatch on detect_isa(), so one build serves every x86-64 CPU.
#pragma once

namespace warmboot {

enum class Isa { Portable, Avx2, Avx512, Avx512Bf16 };

// The best set this CPU has, or a lower one chosen by the use_isa op (tests).
Isa detect_isa();

// Whether the bf16 GEMM may use AMX tiles: the CPU has AMX-BF16, Linux granted this process
// the tile state (arch_prctl; gVisor does not), AVX-512 BF16 is the set in use, and use_amx
// has not turned it off (tests).
bool amx_ready();

}  // namespace warmboot
