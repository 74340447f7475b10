// invariant_linear.cpp's shared parts — its constants, the last-level cache's size, a call's weights
// (Part, Parts), bf16's conversions — and the scalar lanes form, the definition the other forms keep to the bit.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

namespace {

constexpr int64_t CHUNK = 32;  // k's per chunk: 16 lanes × 2
constexpr int64_t GROUP = 16;  // outputs reduced together (one vector of sums)
constexpr int64_t STREAM_AHEAD = 4;  // chunks ahead a one-row pass over packed weights prefetches (see below)
#ifdef LINSERVE_AVX512BF16
// where the CPU computes bf16 (AMD Zen 4 here) its hardware prefetchers alone stream faster: one row over packed
// weights with the prefetch 0.85x (from DRAM) and 0.90x (from L3) the speed without it, geometric means of 8 shapes
constexpr bool STREAM_PREFETCH = false;
#else
constexpr bool STREAM_PREFETCH = true;  // the plain-AVX512 form's (measured on the Intel Xeon that runs it)
#endif
constexpr int64_t FETCH_AHEAD = 4;  // chunks ahead a partial pass over packed weights prefetches its whole block
constexpr int64_t PAIR_BYTES = 16 * 1024;  // packed bf16: rows two at a time while 8 outputs' chunks fit (see below)
// streamed packed bf16: calls of at most this many rows stream each group with their first row (see rows_avx512); a
// variable for the tests' and benchmarks' switch (linserve_set_streamed_rows)
std::atomic<int64_t> streamed_rows_limit{64};
constexpr int MAX_PARTS = 4;  // weights one call reads (invariant_linear_cat)

// Packed weights of a megabyte or more that tensors still hold (pack_weight's, on huge pages): more than the last-level
// cache means a decode step streams them from DRAM (fla's 340M shapes: 0.6-0.9 GB), less that they stay cached
// between steps (the shipped model: 11.6 MB)
std::atomic<int64_t> large_weight_bytes{0};

// one L3 instance's size, as Linux describes the caches of CPU 0 (sysconf's figure can be the whole package's: 320 MB
// on a 2-vCPU slice of an EPYC whose vCPUs share one 32 MB L3); 32 MB where nothing says
int64_t last_level_cache_bytes() {
  static const int64_t bytes = [] {
    for (int index = 0; index < 8; ++index) {
      const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
      std::ifstream level(dir + "level"), size(dir + "size");
      int lv = 0;
      int64_t amount = 0;
      std::string unit;
      if (level >> lv && lv == 3 && size >> amount) {
        size >> unit;
        return amount << (unit == "K" ? 10 : unit == "M" ? 20 : 0);
      }
    }
    return int64_t{32} << 20;
  }();
  return bytes;
}

bool weights_streamed() { return large_weight_bytes.load(std::memory_order_relaxed) > last_level_cache_bytes(); }

// one weight of a call over x: its N outputs are y's columns [column, column + N)
template <typename W>
struct Part {
  const W* w;
  const float* scale;  // int8: (N,), else null
  const float* bias;   // (N,) or null
  int64_t N, column;
};
template <typename W>
struct Parts {
  Part<W> part[MAX_PARTS];
  int count;
};

// pack_weight's lanes layout (N/16, K/32, 16, 32), in elements: where output o's 32-wide chunk at k = c lies from its
// group's start, and where the group of output g (a multiple of 16) starts
inline int64_t packed_at(int o, int64_t c) { return o * CHUNK + c * GROUP; }
inline int64_t packed_group(int64_t g, int64_t K) { return g * ((K + CHUNK - 1) / CHUNK) * CHUNK; }

// a later pass's share of the packed group read next: every `shares`-th line of its block of the chunk at k = c, from
// line `share`, brought into L2 (locality 2: PREFETCHT1 on x86) — so the next group's memory is read while the passes
// over this one compute from the cache (the AVX2 and AVX512 lanes forms' several rows)
template <typename W>
inline void fetch_share(const W* next, int64_t c, int share, int shares) {
  const char* lines = reinterpret_cast<const char*>(next + packed_at(0, c));
  for (int64_t line = 64 * share; line < GROUP * CHUNK * static_cast<int64_t>(sizeof(W)); line += 64 * shares)
    __builtin_prefetch(lines + line, 0, 2);
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; an input subnormal reads as zero (as VCVTNEPS2BF16)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0) bits &= 0x80000000u;
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float daz(float v) {  // a subnormal input read as (signed) zero
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7f800000u) == 0) bits &= 0x80000000u;
  std::memcpy(&v, &bits, 4);
  return v;
}

// ------------------------------------------------------------------------------------------ the scalar form
template <typename W>
inline float weight_value(W w);
template <>
inline float weight_value<uint16_t>(uint16_t w) { return bf16_to_float(w); }
template <>
inline float weight_value<int8_t>(int8_t w) { return static_cast<float>(w); }

// lanes (16) of one output over all of K, as VDPBF16PS computes them (products of bf16 values are exact in fp32,
// so a product then an add under FTZ/DAZ is the fused operation, but for products below fp32's normal range)
template <typename W>
void lanes_scalar(const uint16_t* x, const W* w, int64_t K, float* lanes) {
  for (int j = 0; j < 16; ++j) lanes[j] = 0.0f;
  for (int64_t c = 0; c < K; c += CHUNK) {
    for (int j = 0; j < 16; ++j) {
      for (int half = 1; half >= 0; --half) {
        int64_t k = c + 2 * j + half;
        float a = k < K ? daz(bf16_to_float(x[k])) : 0.0f;
        float b = k < K ? daz(weight_value<W>(w[k])) : 0.0f;
        volatile float product = a * b;  // (volatile: no contraction into an fma by the compiler)
        lanes[j] = lanes[j] + product;
      }
    }
  }
}

inline float tree16(float* v) {  // the fixed tree of halves
  for (int h = 8; h >= 1; h /= 2)
    for (int j = 0; j < h; ++j) v[j] = v[j] + v[j + h];
  return v[0];
}

template <typename W>
void rows_scalar(const uint16_t* x, const W* w, const float* scale, const float* bias, uint16_t* y, int64_t m0,
                 int64_t m1, int64_t n0, int64_t n1, int64_t K, int64_t ys) {  // ys: y's row stride
  float lanes[16];
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      lanes_scalar<W>(x + m * K, w + n * K, K, lanes);
      float s = tree16(lanes);
      if (scale) s = s * scale[n];
      if (bias) s = s + bias[n];
      y[m * ys + n] = float_to_bf16(s);
    }
}

}  // namespace
