// AMX tile set-up shared by the kernels that multiply on the tiles (gemm.cpp,
// flash_prefill.cpp). WB_AMX: whether this build has the tiles at all.
#pragma once

#include <immintrin.h>

#include <cstdint>

// NOTE: the AMX intrinsics need GCC 11 (the build's compiler is the system's); an older one
// builds the library without the tiles
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define WB_AMX 1
#else
#define WB_AMX 0
#endif

namespace warmboot {

#if WB_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All 8 tiles 16 rows of 64 bytes. Every thread loads it before a call's tiles (another
// library's kernels, oneDNN's, may have loaded their own on this thread since).
inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  // NOTE: not GCC 12's _tile_loadconfig: its asm names 8 bytes of the config as read, so
  // the stores of the rest were dropped as dead (the tiles then raised #UD)
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

// Back to the tiles' initial state after a call: a context switch then saves no tile data.
inline void amx_release() { _tile_release(); }
#pragma GCC pop_options
#else
inline void amx_configure() {}
inline void amx_release() {}
#endif

}  // namespace warmboot
