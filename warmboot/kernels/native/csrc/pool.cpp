// The helper threads behind parallel_chunks (pool.h).
//
// Each thread has a pool of its own: a device thread lends its helpers to its own calls only,
// so engines in one process never share them, and the thread's exit stops them. A call's
// chunks are handed out by one 64-bit ticket: the call's generation in the high half, the
// next chunk in the low half. A claim is a CAS that fails once the chunks run out or a newer
// call began, so a late helper never touches a call that has returned; a new call closes the
// ticket (its generation, no chunk left) before it sets itself up, then opens it. The caller
// counts the chunks it ran itself and waits only until the helpers have finished the rest.
// Idle helpers spin (yielding the core to any other runnable thread) for kSpinUs, about the
// gaps between a step's kernels, then sleep on a futex.
#include "pool.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <thread>
#include <vector>

namespace warmboot {
namespace {

using Fn = std::function<void(int64_t, int64_t)>;
using Clock = std::chrono::steady_clock;
constexpr auto kSpinUs = std::chrono::microseconds(300);
constexpr uint64_t kLow = 0xffffffffull;

struct Pool {
  std::atomic<uint64_t> ticket{0};  // generation << 32 | next chunk
  std::atomic<int64_t> chunks{0}, n{0}, grain{1};
  std::atomic<const Fn*> fn{nullptr};
  std::atomic<int64_t> done{0};  // chunks the helpers finished in this call
  std::atomic<int64_t> lent{0};  // chunks the helpers finished, all calls
  std::atomic<int> wake{0};      // bumped per call: sleeping helpers wait on it
  std::atomic<bool> stop{false};
  std::exception_ptr error;  // a helper's, rethrown by the caller
  bool busy = false;         // a call in flight (a nested call runs without helpers)
  std::vector<std::thread> threads;
  std::vector<int64_t> cpus;
  ~Pool();
};

Pool& pool() {
  thread_local Pool p;
  return p;
}

int64_t claim(Pool& p, uint64_t gen) {
  uint64_t t = p.ticket.load(std::memory_order_acquire);
  while ((t >> 32) == gen && static_cast<int64_t>(t & kLow) < p.chunks.load()) {
    if (p.ticket.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
      return static_cast<int64_t>(t & kLow);
    }
  }
  return -1;
}

void run_chunk(const Fn& fn, int64_t c, int64_t grain, int64_t n) {
  fn(c * grain, std::min(n, (c + 1) * grain));
}

// Until the next call's wake-up (or stop): spin, then sleep.
void await_call(Pool& p, int seen) {
  const auto until = Clock::now() + kSpinUs;
  while (p.wake.load(std::memory_order_acquire) == seen && !p.stop.load()) {
    if (Clock::now() < until) {
      _mm_pause();
      sched_yield();  // NOTE: returns at once unless another thread wants this core
    } else {
      p.wake.wait(seen);
    }
  }
}

void helper_main(Pool& p, std::vector<int64_t> cpus) {
  if (!cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (auto c : cpus) CPU_SET(static_cast<int>(c), &set);
    sched_setaffinity(0, sizeof(set), &set);
  }
  omp_set_num_threads(1);  // NOTE: a chunk that calls torch's GEMM (dense.cpp) runs it here alone
  int seen = p.wake.load();
  while (!p.stop.load()) {
    await_call(p, seen);
    seen = p.wake.load(std::memory_order_acquire);
    const uint64_t gen = p.ticket.load(std::memory_order_acquire) >> 32;
    for (int64_t c; (c = claim(p, gen)) >= 0;) {
      try {
        run_chunk(*p.fn.load(), c, p.grain.load(), p.n.load());
      } catch (...) {
        p.error = std::current_exception();
      }
      p.lent.fetch_add(1, std::memory_order_relaxed);
      p.done.fetch_add(1, std::memory_order_release);
    }
  }
}

void stop_helpers(Pool& p) {
  if (p.threads.empty()) return;
  p.stop = true;
  p.wake.fetch_add(1);
  p.wake.notify_all();
  for (auto& t : p.threads) t.join();
  p.threads.clear();
  p.stop = false;
}

Pool::~Pool() { stop_helpers(*this); }

// The calling thread's helpers: `count` threads pinned to `cpus` (empty: unpinned); 0 stops
// them. Returns the count.
int64_t use_helpers(int64_t count, std::vector<int64_t> cpus) {
  TORCH_CHECK(count >= 0 && count <= 64, "use_helpers: count must be 0..64, got ", count);
  Pool& p = pool();
  TORCH_CHECK(!p.busy, "use_helpers inside a parallel call");
  if (static_cast<int64_t>(p.threads.size()) == count && p.cpus == cpus) return count;
  stop_helpers(p);
  p.cpus = cpus;
  for (int64_t i = 0; i < count; ++i) p.threads.emplace_back(helper_main, std::ref(p), cpus);
  return count;
}

int64_t helpers() { return static_cast<int64_t>(pool().threads.size()); }

int64_t helper_chunks() { return pool().lent.load(); }

}  // namespace

namespace {
bool helpers_idle(const Pool& p) {
  return !p.busy && !p.threads.empty() && at::get_num_threads() == 1 &&
         !at::in_parallel_region();
}
}  // namespace

int64_t parallel_width() {
  const Pool& p = pool();
  return helpers_idle(p) ? 1 + static_cast<int64_t>(p.threads.size()) : at::get_num_threads();
}

void parallel_chunks(int64_t n, int64_t grain, const Fn& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  Pool& p = pool();
  const int64_t chunks = (n + grain - 1) / grain;
  if (chunks < 2 || !helpers_idle(p)) {
    at::parallel_for(0, n, grain, fn);
    return;
  }
  p.busy = true;
  const uint64_t gen = (p.ticket.load() >> 32) + 1;
  // NOTE: closed first: a helper still in the last call's claim loop that read the new chunk
  // count would otherwise win a CAS on the old ticket and count a chunk into this call
  p.ticket.store(gen << 32 | kLow);
  p.fn = &fn;
  p.n = n;
  p.grain = grain;
  p.chunks = chunks;
  p.done.store(0);
  p.error = nullptr;
  p.ticket.store(gen << 32, std::memory_order_release);
  p.wake.fetch_add(1, std::memory_order_release);
  p.wake.notify_all();
  int64_t mine = 0;
  std::exception_ptr error;
  try {
    for (int64_t c; (c = claim(p, gen)) >= 0; ++mine) run_chunk(fn, c, grain, n);
  } catch (...) {  // NOTE: still wait: the helpers' chunks use fn
    error = std::current_exception();
    ++mine;
    while (claim(p, gen) >= 0) ++mine;
  }
  while (p.done.load(std::memory_order_acquire) < chunks - mine) _mm_pause();
  p.busy = false;
  if (!error) error = p.error;
  if (error) std::rethrow_exception(error);
}

}  // namespace warmboot

TORCH_LIBRARY_FRAGMENT(warmboot_cpu, m) {
  m.def("use_helpers(int count, int[] cpus) -> int", &warmboot::use_helpers);
  m.def("helpers() -> int", &warmboot::helpers);
  m.def("helper_chunks() -> int", &warmboot::helper_chunks);
}
