// The pieces linserve's recurrence kernels share (delta_rule.cpp, pooled_state.cpp): the fixed tree of halves over
// d_k, a row scaled by its decay, and the parallel loop over (row, head)s and column blocks of d_v.
#pragma once
#include <ATen/Parallel.h>

#include "flush_subnormals.h"
#include "work_pool.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace linserve {

// d_v columns per block: a head's rows are read whole (up to this width), one contiguous stream the prefetchers
// follow; the block's partials (d_k rows of it) stay in L2. (16-column blocks walked the state down its rows at a
// 2 KiB stride, a demand miss per line: 340M Gated DeltaNet's update ran at ~1 GB/s.)
constexpr int64_t MAX_COLUMNS = 512;

// the tree of halves over rows 0..n-1 of buf (each row w wide, rows `stride` floats apart) into row 0
inline void tree(float* buf, int64_t n, int64_t w, int64_t stride) {
  while (n > 1) {
    const int64_t h = n / 2;
    for (int64_t i = 0; i < h; ++i) {
      float* __restrict a = buf + i * stride;
      const float* __restrict b = buf + (i + h) * stride;
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) a[c] = a[c] + b[c];
    }
    if (n % 2) std::copy(buf + 2 * h * stride, buf + 2 * h * stride + w, buf + h * stride);
    n = h + n % 2;
  }
}

inline void tree(float* buf, int64_t n, int64_t w) { tree(buf, n, w, w); }

// rows of `w` floats `stride` apart, where `stride` is w rounded up to 16 floats (64 bytes): a row's vectors never
// straddle two cache lines — the shipped model's d_v + 1 = 33 columns a row at a 33-float stride made every row's
// loads and stores split ones (its scan 2-2.7x slower than at 32 columns)
inline int64_t aligned_stride(int64_t w) { return (w + 15) / 16 * 16; }

// a thread's scratch of `floats`, its start 64-byte aligned, kept for the thread's life (as `scratch`)
inline float* aligned_scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats + 16) buf.resize(floats + 16);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((at + 63) & ~static_cast<uintptr_t>(63));
}

// s1 = s · (*factor), or a copy without a factor (w columns)
inline void scaled_copy(const float* __restrict s, float* __restrict s1, const float* factor, int64_t w) {
  if (factor) {
    const float a = *factor;
#pragma GCC ivdep
    for (int64_t c = 0; c < w; ++c) s1[c] = s[c] * a;
  } else {
    std::copy(s, s + w, s1);
  }
}

// a thread's d_k × block scratch, kept for the thread's life: every call writes the rows it then reads, so it is
// neither allocated nor zeroed per call (a fresh vector a call was a 256-512 KiB memset per thread per layer, twice
// a step, and cold lines) — the same addresses call after call, warm in L2
inline float* scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

// fn(bh, c0, w, buf) for every (row, head) bh of n and column block [c0, c0 + w) of d_v: (row, head)s are the
// parallel tasks, each thread with its own d_k × block scratch and subnormals flushed
template <class Fn>
void for_each_block(int64_t n, int64_t dk, int64_t dv, const Fn& fn) {
  linserve::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    linserve::FlushSubnormals flushed;
    float* buf = scratch(static_cast<size_t>(std::max<int64_t>(dk, 1) * std::min(MAX_COLUMNS, std::max<int64_t>(dv, 1))));
    for (int64_t bh = begin; bh < end; ++bh)
      for (int64_t c0 = 0; c0 < dv; c0 += MAX_COLUMNS) fn(bh, c0, std::min(MAX_COLUMNS, dv - c0), buf);
  });
}

}  // namespace linserve
