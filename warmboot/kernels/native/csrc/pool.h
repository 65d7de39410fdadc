// Helper threads that lend the native kernels the host's idle cycles.
#pragma once

#include <cstdint>
#include <functional>

namespace warmboot {

// fn(begin, end) over [0, n) in chunks of `grain`. With helpers (the use_helpers op) and one
// torch thread, the caller works through the chunks while the helpers claim chunks beside
// it; a helper that has not claimed a chunk when they run out does none, so a call waits only
// for chunks already started, never for a core that is busy elsewhere. Otherwise (no
// helpers, more torch threads, another call in flight): at::parallel_for.
void parallel_chunks(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// How many threads a parallel_chunks call from here would work on: the caller and its helpers,
// or torch's threads where parallel_chunks falls back to at::parallel_for.
int64_t parallel_width();

}  // namespace warmboot
