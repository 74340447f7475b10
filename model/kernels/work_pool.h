// The kernels' own threads: a parallel region that never waits for a thread that has not started on it.
//
// at::parallel_for (OpenMP) ends a region at a barrier every thread of the team must reach — also a thread that
// took no work because it was not running when the region began. On a small host the server's other processes (the
// HTTP frontend, a load generator) take a CPU for a few hundred µs at a time; while they hold the CPU of the engine's
// second OpenMP thread, every region of the step waits at its barrier for that thread to be scheduled again, though
// the calling thread has long since done the work itself (its share and, by stealing, the other's). Measured on 2
// vCPUs (AMD Zen 3): the shipped model's 8-row step on two threads 1.97-2.56 ms alone, 2.81-3.54 ms beside a
// process that runs 0.4 ms every 2 ms (17% of a CPU) — more than the CPU it took (docs/benchmarks.md, "A region
// that waits only for the threads in it").
//
// Here a region is published to the pool's workers; each worker that sees it while it is open joins it (takes a
// participant number) and works; the caller works from the start, and when its own work is done it closes the
// region and waits only for the workers that joined — a worker that was not running misses the region and costs
// nothing. Which thread runs a task changes nothing in its arithmetic (every task's result is a fixed sequence of
// roundings), so the bits are those of any split. Between regions a worker spins for SPIN_NS (a step's regions
// follow each other within tens of µs), then sleeps on a condition variable until the next region is published:
// between steps, and on a host with other work, its CPU is free.
//
// Used where the calling thread asked for it (`pool_wanted`: the engine thread, while a compiled program built for
// one thread runs); elsewhere the kernels' regions are at::parallel_for's. One caller at a time: a region asked for
// while another thread's is running runs as at::parallel_for did. A forked child starts a new pool (its parent's
// workers do not exist in it). An exception a worker's part throws is rethrown by the caller once the region is
// over (as at::parallel_for does), never left to end the process.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>

#include "flush_subnormals.h"

namespace linserve {

// whether this thread's kernel calls run their regions on the pool (set by `torch.ops.linserve.use_work_pool`; off:
// at::parallel_for). The engine thread turns it on while a compiled program built for one thread runs on more: there
// no OpenMP region of the program's own competes with the pool's workers (both kinds of worker spinning between
// regions on a 2-vCPU host made an 8-row step 2-3x slower)
inline bool& pool_wanted() {
  static thread_local bool wanted = false;
  return wanted;
}

class WorkPool {
 public:
  using Body = void (*)(const void* context, int participant);
  static constexpr int MAX_HELPERS = 63;
  static constexpr int64_t SPIN_NS = 50'000;  // a worker's wait for the next region before it sleeps

  static WorkPool& get() {
    static std::once_flag registered;
    std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, [] { current() = nullptr; }); });
    WorkPool*& pool = current();
    if (pool == nullptr) pool = new WorkPool();  // (never destroyed: its workers outlive any static destructor)
    return *pool;
  }

  // body(context, 0) on this thread and body(context, i) on each worker i (1 … helpers) that joins while this
  // thread's own part runs; returns once every participant's has. False (nothing run): another thread's region is
  // running — the caller runs the work otherwise.
  bool run(int helpers, Body body, const void* context) {
    if (busy_.exchange(true, std::memory_order_acquire)) return false;
    helpers = std::min(helpers, MAX_HELPERS);
    while (static_cast<int>(started_) < helpers) start_worker();
    body_.store(body, std::memory_order_relaxed);
    context_.store(context, std::memory_order_relaxed);
    helpers_.store(helpers, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t generation = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(generation << 32 | OPEN, std::memory_order_seq_cst);  // (the fields above travel with it)
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lock(mutex_); }
      wake_.notify_all();
    }
    inside() = true;
    try {
      body(context, 0);
    } catch (...) {
      finish();
      throw;
    }
    if (std::exception_ptr error = finish()) std::rethrow_exception(error);  // (a worker's)
    return true;
  }

  // whether this thread runs a region's work now (a worker: always) — a region asked for there runs inline
  static bool& inside() {
    static thread_local bool flag = false;
    return flag;
  }

 private:
  static constexpr uint64_t OPEN = uint64_t{1} << 31;   // state: generation << 32 | OPEN | workers joined
  static constexpr uint64_t JOINED = OPEN - 1;

  // close the region, wait for the workers in it; the first exception one of them threw (taken: the pool is free)
  std::exception_ptr finish() {
    inside() = false;
    const uint64_t closed = state_.fetch_and(~OPEN, std::memory_order_acq_rel);  // no one joins from here
    const uint32_t joined = static_cast<uint32_t>(closed & JOINED);
    while (done_.load(std::memory_order_acquire) < joined) _mm_pause();
    std::exception_ptr error = std::move(error_);
    error_ = nullptr;
    busy_.store(false, std::memory_order_release);
    return error;
  }

  static WorkPool*& current() {
    static WorkPool* pool = nullptr;
    return pool;
  }

  void start_worker() {
    std::thread(&WorkPool::work, this, state_.load(std::memory_order_acquire) >> 32).detach();
    ++started_;
  }

  void work(uint64_t seen) {  // seen: the last generation this worker looked at
    inside() = true;
    auto spin_until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(SPIN_NS);
    for (unsigned polls = 0;; ++polls) {
      uint64_t state = state_.load(std::memory_order_acquire);
      if (state >> 32 == seen) {
        if ((polls & 63) != 63 || std::chrono::steady_clock::now() < spin_until) {
          _mm_pause();
          continue;
        }
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return state_.load(std::memory_order_seq_cst) >> 32 != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        continue;
      }
      // a newer region: join it while it is open and has room (the CAS fails if it closed or another joined)
      while (state >> 32 != seen && (state & OPEN) &&
             (state & JOINED) < static_cast<uint64_t>(helpers_.load(std::memory_order_relaxed))) {
        if (state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
          const int participant = static_cast<int>(state & JOINED) + 1;
          try {
            body_.load(std::memory_order_relaxed)(context_.load(std::memory_order_relaxed), participant);
          } catch (...) {
            std::lock_guard<std::mutex> lock(mutex_);
            if (!error_) error_ = std::current_exception();
          }
          done_.fetch_add(1, std::memory_order_release);
          break;
        }
      }
      seen = state >> 32;
      spin_until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(SPIN_NS);
    }
  }

  alignas(64) std::atomic<uint64_t> state_{0};
  alignas(64) std::atomic<uint32_t> done_{0};
  std::atomic<Body> body_{nullptr};
  std::atomic<const void*> context_{nullptr};
  std::atomic<int> helpers_{0};
  alignas(64) std::atomic<bool> busy_{false};
  std::atomic<int> sleepers_{0};
  unsigned started_ = 0;  // (written by the one running caller)
  std::mutex mutex_;  // the sleepers' wait, and error_
  std::condition_variable wake_;
  std::exception_ptr error_;  // the first exception a worker's part of this region threw (read after it is over)
};

// body(participant) on up to `threads` participants — the calling thread (0) and the pool's workers that join; a
// participant that never joins never runs, so the work must not belong to one (take it from shared counters).
// Returns false where the pool is busy (another thread's region): nothing ran.
template <class Body>
bool run_region(int threads, const Body& body) {
  return WorkPool::get().run(threads - 1, [](const void* b, int participant) {
    (*static_cast<const Body*>(b))(participant);
  }, &body);
}

// at::parallel_for's contract — fn(begin, end) over [begin, end) in pieces of at least `grain` — over the pool:
// pieces taken from one counter by whichever participants are running (about four a thread, so one that joins late
// still takes a share). A range of at most one grain, one thread, a thread that did not ask for the
// pool (`pool_wanted`) or a busy pool: at::parallel_for itself; a call inside a region's work: inline.
template <class Fn>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain));
  const auto fallback = [&] { at::parallel_for(begin, end, grain, fn); };
  if (WorkPool::inside()) return fn(begin, end);  // (a region inside a region's work: here, in order)
  if (!pool_wanted() || threads < 2 || at::in_parallel_region()) return fallback();
  const int64_t piece = std::max(grain, (n + 4 * threads - 1) / (4 * threads));
  std::atomic<int64_t> next{begin};
  const bool ran = run_region(threads, [&](int) {
    for (int64_t b = next.fetch_add(piece, std::memory_order_relaxed); b < end;
         b = next.fetch_add(piece, std::memory_order_relaxed))
      fn(b, std::min(end, b + piece));
  });
  if (!ran) fallback();
}

}  // namespace linserve
