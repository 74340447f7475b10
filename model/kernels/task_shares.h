// invariant_linear.cpp's threads: a call's tasks in contiguous shares, the thread done first taking the rest
// of the others' from their ends (which thread runs a task changes nothing in its arithmetic), over the kernels'
// own pool (work_pool.h: a region waits only for the threads that joined it).
#pragma once

#include <ATen/Parallel.h>

#include "flush_subnormals.h"
#include "work_pool.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

// A thread's contiguous share of a call's tasks, [front, back) in one word: its owner takes tasks from the front,
// a thread done with its own share takes them from the back — each task once, whichever thread runs it
struct alignas(64) Share {
  std::atomic<uint64_t> range;
  static uint64_t pack(int64_t front, int64_t back) { return static_cast<uint64_t>(back) << 32 | front; }
  // [begin, end) of up to `step` tasks from the front (owner) or the back; false once the share is empty
  bool take(bool owner, int64_t step, int64_t& begin, int64_t& end) {
    uint64_t now = range.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(now & 0xffffffffu), back = static_cast<int64_t>(now >> 32);
      if (front >= back) return false;
      if (owner) begin = front, end = std::min(back, front + step);
      else begin = std::max(front, back - step), end = back;
      if (range.compare_exchange_weak(now, owner ? pack(end, back) : pack(front, begin), std::memory_order_relaxed))
        return true;
    }
  }
};
constexpr int MAX_SHARES = 16;

// tasks [0, total) over the threads: each thread's contiguous share (one stream of weights for the hardware
// prefetchers, as a static split gives), taken a quarter of `grain` at a time, and a thread that finishes first takes
// what is left of the others' from their ends — a region ends when the work does, not when its slowest thread's
// fixed half does (fla's 340M batch-1 steps on 2 Zen 4 cores: 0.96x `linear_attn`, 0.98x Gated DeltaNet; a
// quarter beat a whole grain or a sixteenth). Which thread runs a task changes nothing in its arithmetic.
template <typename Task>
void run_tasks(int64_t total, int64_t grain, const Task& task) {
  // as many shares as at::parallel_for would make threads busy (none: a call of at most `grain` tasks runs here)
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (total + grain - 1) / grain));
  if (threads < 2 || threads > MAX_SHARES || total < 4 * threads || total >= (int64_t{1} << 31) ||
      linserve::WorkPool::inside() || at::in_parallel_region()) {  // (a share's front and back: 32-bit halves)
    linserve::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
      linserve::FlushSubnormals flushed;
      for (int64_t t = begin; t < end; ++t) task(t);
    });
    return;
  }
  Share shares[MAX_SHARES];
  for (int i = 0; i < threads; ++i) shares[i].range.store(Share::pack(total * i / threads, total * (i + 1) / threads));
  const int64_t step = std::max<int64_t>(1, grain / 4);
  const auto participate = [&](int64_t own) {  // share `own` from its front, then the others' from their ends
    linserve::FlushSubnormals flushed;
    int64_t begin, end;
    while (shares[own].take(true, step, begin, end))
      for (int64_t t = begin; t < end; ++t) task(t);
    for (int k = 1; k < threads; ++k) {
      Share& other = shares[(own + k) % threads];
      while (other.take(false, step, begin, end))
        for (int64_t t = begin; t < end; ++t) task(t);
    }
  };
  // over the pool (work_pool.h), where this thread asked for it: a share whose thread never joins is taken from its
  // end by those that did; else an OpenMP region, one share a thread
  if (linserve::pool_wanted() && linserve::run_region(threads, participate))
    return;
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t own = first; own < last; ++own) participate(own);
  });
}

}  // namespace
