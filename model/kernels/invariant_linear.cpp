// linserve::invariant_linear — y = x Wᵀ + b whose every output is one fixed sequence of roundings, whatever the
// number of rows, the blocking or the threads: a request's projections never depend on what shares its batch.
// Threads and register blocks split rows and outputs only, never K. Two families of forms, one per kind of CPU:
//
// AMX (AMX-BF16 CPUs): W packed once into B tiles (pack_weight: (N/16, K/32, 16, 32)); each output accumulates in
// a C tile over the K blocks in order (TDPBF16PS). A tile row is computed from its own A row alone — checked: a
// row's bits are the same with 1 or 16 rows configured — so one row, a decode batch and a prefill chunk agree.
// AMX's internal rounding is its own (it matched no sequential or fused emulation), hence no scalar twin.
//
// Lanes (AVX512-BF16; on an AVX512 CPU without it, its arithmetic in plain AVX512 instructions; else scalar code —
// the same bits, all three), over W packed once into groups of 16 outputs whose 32-wide
// chunks lie side by side (pack_weight: (N/16, K/32, 16, 32), so a one-row pass over a group reads one stream; W as
// it is (N, K) is read too, and by the scalar code), one output y[m, n]:
//   lanes[j] = 0 (j < 16); for each 32-wide chunk c of K (the tail read as zeros), in order:
//       lanes[j] = fma(x[32c + 2j + 1], w[32c + 2j + 1], lanes[j]);  lanes[j] = fma(x[32c + 2j], w[32c + 2j], lanes[j])
//     (VDPBF16PS: bf16 products are exact in fp32, inputs' subnormals read as zero, results' flushed, RNE);
//   s = Σ lanes as the fixed tree of halves (j + j+8, then j + j+4, j + j+2, j + j+1).
// Both: y = bf16_rne(s + bias[n]) (int8 weights: bf16_rne(s · scale[n] + bias[n]); every int8 is a bf16, so the
// weights are widened exactly). The threads set FTZ/DAZ for the kernel's length so their fp32 adds round alike.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>
#include <xmmintrin.h>

#include "flush_subnormals.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>

#ifdef LINSERVE_LANES
#include <immintrin.h>
#endif
#include <sys/mman.h>
#ifdef LINSERVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

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
constexpr int64_t SINGLE_ROWS = 8;  // streamed packed bf16: at most this many rows one at a time (see below)
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

#ifdef LINSERVE_LANES
// ------------------------------------------------------------------------------------------ the AVX512 lanes forms
inline __m512i load_x(const uint16_t* p, int64_t left) {  // 32 bf16, zeros past the end
  if (left >= CHUNK) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << left) - 1), p);
}

inline __m256i load_bytes(const int8_t* p, int64_t left) {  // 32 int8, zeros past the end
  return left >= CHUNK ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                       : _mm256_maskz_loadu_epi8(static_cast<__mmask32>((1ull << left) - 1), p);
}

#ifdef LINSERVE_AVX512BF16
using WeightChunk = __m512i;  // 32 bf16, as VDPBF16PS takes them

inline __m256i to_bf16(__m512 s) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(s)); }

inline WeightChunk load_w(const uint16_t* p, int64_t left) { return load_x(p, left); }

inline WeightChunk load_w(const int8_t* p, int64_t left) {  // 32 int8 widened exactly to bf16
  const __m256i bytes = load_bytes(p, left);
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));  // k 0..15
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));  // k 16..31
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));  // exact: every int8 is a bf16
}

template <bool F>  // (VDPBF16PS: no unfused form to choose)
inline __m512 dot_chunk(__m512 acc, __m512i a, WeightChunk b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}
#else
// AVX512F/BW without AVX512-BF16 (Skylake-SP to Ice Lake; virtual machines that hide it): VDPBF16PS's and
// VCVTNEPS2BF16's arithmetic as the scalar form states it, in plain AVX512 instructions — the same bits
inline __m256i to_bf16(__m512 s) {  // float_to_bf16 on 16 lanes: RNE, an input subnormal read as zero, NaN kept
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  __m512i bits = _mm512_castps_si512(s);
  bits = _mm512_mask_and_epi32(bits, _mm512_testn_epi32_mask(bits, exponent), bits, _mm512_set1_epi32(INT32_MIN));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), exponent);
  const __m512i kept_lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));  // ties to even
  const __m512i up = _mm512_add_epi32(kept_lsb, _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, up), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// a weight chunk as fp32 values, split once for every row that reads it: lane j's element 2j + 1 and element 2j
struct WeightChunk {
  __m512 odd, even;
};

inline __m512 odd_of(__m512i pairs) {  // each 32-bit lane's high bf16 as fp32 (exact)
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline __m512 even_of(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }  // the low one

inline WeightChunk load_w(const uint16_t* p, int64_t left) {
  const __m512i pairs = load_x(p, left);
  return {odd_of(pairs), even_of(pairs)};
}

inline WeightChunk load_w(const int8_t* p, int64_t left) {  // 32 int8 as fp32 (exact, as their bf16 would be)
  const __m512i words = _mm512_cvtepi8_epi16(load_bytes(p, left));  // lane j: element 2j low, 2j + 1 high
  return {_mm512_cvtepi32_ps(_mm512_srai_epi32(words, 16)),
          _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(words, 16), 16))};
}

// each 32-bit lane: its odd pair's product added, then its even pair's — bf16 products are exact in fp32, and the
// kernel's threads run under FTZ/DAZ (FlushSubnormals), so a product then an add is VDPBF16PS's step as lanes_scalar
// states it (a multiply and an add, not fused: -ffp-contract=off). F: the same step as one fused multiply-add, for a
// call whose every product is exact and normal (`in_fused_range`): the fused form then rounds the same exact sum
// once, as the add does — the same bits in half the instructions (a multi-row call is arithmetic-bound here)
template <bool F>
inline __m512 dot_chunk(__m512 acc, __m512i a, const WeightChunk& b) {
  if (F) return _mm512_fmadd_ps(even_of(a), b.even, _mm512_fmadd_ps(odd_of(a), b.odd, acc));
  acc = _mm512_add_ps(acc, _mm512_mul_ps(odd_of(a), b.odd));
  return _mm512_add_ps(acc, _mm512_mul_ps(even_of(a), b.even));
}
#endif

inline __m512 pair_sum(__m512 a, __m512 b, __m512i low, __m512i high) {
  return _mm512_add_ps(_mm512_permutex2var_ps(a, low, b), _mm512_permutex2var_ps(a, high, b));
}

// The tree of halves over 16 outputs' lanes (v[o], 16 floats each) → their 16 sums in order, each output's exactly
// tree16's: level 1 pairs outputs (2i, 2i+1) into one vector of their half sums, level 2 those pairs, and so on.
// Levels 1-2 of outputs 4q..4q+3 need only those four (quad: one vector u[q]); levels 3-4 take the four u's (last).
// So a block reduces its accumulators in registers as it finishes, and nothing of the lanes touches memory.
struct Tree {
  __m512i l1, h1, l2, h2, l3, h3, l4, h4;
  Tree() {
    l1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    h1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    l2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    h2 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    l3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    h3 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    l4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    h4 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  }
  inline __m512 quad(__m512 a, __m512 b, __m512 c, __m512 d) const {
    return pair_sum(pair_sum(a, b, l1, h1), pair_sum(c, d, l1, h1), l2, h2);
  }
  inline __m512 last(const __m512* u) const {
    return pair_sum(pair_sum(u[0], u[1], l3, h3), pair_sum(u[2], u[3], l3, h3), l4, h4);
  }
};

// Where output o's 32-wide chunk at k = c lies, counted from its group's first output (elements of W):
// - RowMajor: W as it is, (N, K) — a pass over several outputs reads one stream per output;
// - Packed (pack_weight, where the CPU has AVX512-BF16 but no AMX): (⌈N/16⌉, ⌈K/32⌉, 16, 32), a group's 16
//   outputs' chunks side by side and the tails zeros — a pass reads one stream. Same arithmetic, same bits.
struct RowMajor {
  static int64_t at(int o, int64_t c, int64_t K) { return o * K + c; }
  static int64_t group(int64_t g, int64_t K) { return g * K; }  // g: the group's first output
  template <int R>
  static constexpr int quads() { return R <= 2 ? 2 : 1; }  // 8 streams at one row (16 measured 6-18% slower)
};
struct Packed {
  static int64_t at(int o, int64_t c, int64_t) { return o * CHUNK + c * GROUP; }
  static int64_t group(int64_t g, int64_t K) { return g * ((K + CHUNK - 1) / CHUNK) * CHUNK; }
  template <int R>
  static constexpr int quads() { return R == 1 ? 4 : (R == 2 ? 2 : 1); }  // as many outputs as registers allow
};

// one 32-wide chunk at k = c (`left` of K from there: the tail reads zeros past it) into R rows × O outputs
template <int R, int O, typename W, typename L, bool F>
__attribute__((always_inline)) inline void dot_chunks(__m512 (&acc)[R][O], const uint16_t* x, const W* w, int64_t K,
                                                      int64_t c, int64_t left, bool fetch) {
  __m512i a[R];
  for (int r = 0; r < R; ++r) a[r] = load_x(x + r * K + c, left);
  if (STREAM_PREFETCH && std::is_same<L, Packed>::value && O == GROUP && R == 1 && fetch) {
    // a one-row pass over whole groups (decode; a streamed batch's first row) reads one stream, 1 KB a chunk: its
    // lines 4 KB ahead asked for now, as the hardware's prefetchers alone do not (one row on the 2-vCPU AVX512
    // Xeon: 1.3-1.45x over weights in L3, 1.12-1.3x from DRAM; 8 rows 1.01-1.07x)
    const char* ahead = reinterpret_cast<const char*>(w + L::at(0, c + STREAM_AHEAD * CHUNK, K));
    for (int64_t line = 0; line < GROUP * CHUNK * static_cast<int64_t>(sizeof(W)); line += 64)
      _mm_prefetch(ahead + line, _MM_HINT_T0);
  }
  if (std::is_same<L, Packed>::value && O < GROUP && fetch) {
    // the first pass over part of a group (several rows) brings the whole block in: the other passes then read
    // cached lines (int8 at 8 rows: 0.7x -> 1.1x the (N, K) form's speed, Zen 5)
    const char* ahead = reinterpret_cast<const char*>(w + L::at(0, c + FETCH_AHEAD * CHUNK, K));
    for (int64_t line = 0; line < GROUP * CHUNK * static_cast<int64_t>(sizeof(W)); line += 64)
      _mm_prefetch(ahead + line, _MM_HINT_T0);
  }
  for (int o = 0; o < O; ++o) {
    const WeightChunk b = load_w(w + L::at(o, c, K), left);
    for (int r = 0; r < R; ++r) acc[r][o] = dot_chunk<F>(acc[r][o], a[r], b);
  }
}

// R rows × O outputs over all of K: the full chunks unmasked (CHUNK, a constant), the tail masked once (inlined:
// the accumulators stay in registers)
template <int R, int O, typename W, typename L, bool F = false>
__attribute__((always_inline)) inline void dot_rows(__m512 (&acc)[R][O], const uint16_t* x, const W* w, int64_t K,
                                                    bool fetch = false) {
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm512_setzero_ps();
  const int64_t full = K - K % CHUNK;
  for (int64_t c = 0; c < full; c += CHUNK) dot_chunks<R, O, W, L, F>(acc, x, w, K, c, CHUNK, fetch);
  if (full < K) dot_chunks<R, O, W, L, F>(acc, x, w, K, full, K - full, false);
}

// R rows × 4Q outputs: each row's quads of lanes reduced by the tree's first two levels into u[r][q0 + q]
template <int R, int Q, typename W, typename L, bool F>
void block_quads(const Tree& tree, const uint16_t* x, const W* w, int64_t K, __m512 (*u)[4], int q0, bool fetch) {
  __m512 acc[R][4 * Q];
  dot_rows<R, 4 * Q, W, L, F>(acc, x, w, K, fetch);
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < Q; ++q)
      u[r][q0 + q] = tree.quad(acc[r][4 * q], acc[r][4 * q + 1], acc[r][4 * q + 2], acc[r][4 * q + 3]);
}

// the last quad of a group with 1-3 outputs (W as it is): each alone, the missing ones' lanes zero
template <int R, typename W>
void block_partial(const Tree& tree, const uint16_t* x, const W* w, int64_t K, int count, __m512 (*u)[4], int q) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < 4; ++o) acc[r][o] = _mm512_setzero_ps();
  for (int o = 0; o < count; ++o) {
    __m512 one[R][1];
    dot_rows<R, 1, W, RowMajor>(one, x, w + o * K, K);
    for (int r = 0; r < R; ++r) acc[r][o] = one[r][0];
  }
  for (int r = 0; r < R; ++r) u[r][q] = tree.quad(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

template <int R, typename W, typename L, bool F>
inline void group_quads(const Tree& tree, const uint16_t* x, const W* wg, int64_t K, int64_t outputs, __m512 (*u)[4],
                        bool fetch) {
  constexpr int Q = L::template quads<R>();
  const int quads = static_cast<int>(outputs / 4);
  int q = 0;
  for (; q + Q <= quads; q += Q)
    block_quads<R, Q, W, L, F>(tree, x, wg + L::at(4 * q, 0, K), K, u, q, fetch && q == 0);
  for (; q < quads; ++q) block_quads<R, 1, W, L, F>(tree, x, wg + L::at(4 * q, 0, K), K, u, q, fetch && q == 0);
  if (outputs % 4) {
    block_partial<R, W>(tree, x, wg + 4 * q * K, K, static_cast<int>(outputs % 4), u, q);
    ++q;
  }
  for (; q < 4; ++q)
    for (int r = 0; r < R; ++r) u[r][q] = _mm512_setzero_ps();
}

template <typename W, typename L, bool F = false>
void rows_avx512(const uint16_t* x, const W* w, const float* scale, const float* bias, uint16_t* y, int64_t m0,
                 int64_t m1, int64_t n0, int64_t n1, int64_t K, int64_t ys) {  // ys: y's row stride
  constexpr bool packed = std::is_same<L, Packed>::value;
  // packed bf16: rows two at a time over 8 outputs a pass while those outputs' chunks stay in L1 (faster than 6
  // rows × 4 outputs at 8-512 rows for K ≤ 1024 on Zen 5; at K = 2816 much slower, and int8's widening wants
  // the 6 rows); otherwise 6 rows × 4 outputs a pass
  const bool pairs = packed && sizeof(W) == 2 && 8 * K * static_cast<int64_t>(sizeof(W)) <= PAIR_BYTES;
  // packed bf16 streamed from DRAM, a decode batch (≤ SINGLE_ROWS rows): a row at a time over each group's 16 outputs
  // — the weights one contiguous stream, as at one row, the other rows reading the group from L1/L2 (2-8 rows of
  // 340M's projections on Zen 4: 0.62-0.92x the blocked forms' time; slower from 12 rows, for cached weights, int8)
  const bool singles = packed && sizeof(W) == 2 && m1 - m0 <= SINGLE_ROWS && weights_streamed();
  const Tree tree;
  __m512 u[6][4];
  for (int64_t g = n0; g < n1; g += GROUP) {
    const int64_t outputs = std::min(GROUP, n1 - g);
    const int64_t computed = packed ? GROUP : outputs;  // packed: a short group's missing rows are zeros
    const W* wg = w + L::group(g, K);
    const __mmask16 keep = static_cast<__mmask16>((1u << outputs) - 1);
    const __m512 sc = scale ? _mm512_maskz_loadu_ps(keep, scale + g) : _mm512_setzero_ps();
    const __m512 bi = bias ? _mm512_maskz_loadu_ps(keep, bias + g) : _mm512_setzero_ps();
    for (int64_t m = m0; m < m1;) {
      const int64_t left = m1 - m;
      const int64_t rows = singles ? 1
                           : pairs ? (left >= 2 ? 2 : 1)
                                   : (left >= 6 ? 6 : (left >= 4 ? 4 : (left >= 2 ? 2 : 1)));
      const uint16_t* xm = x + m * K;
      switch (rows) {
        case 6: group_quads<6, W, L, F>(tree, xm, wg, K, computed, u, m == m0); break;
        case 4: group_quads<4, W, L, F>(tree, xm, wg, K, computed, u, m == m0); break;
        case 2: group_quads<2, W, L, F>(tree, xm, wg, K, computed, u, m == m0); break;
        default: group_quads<1, W, L, F>(tree, xm, wg, K, computed, u, m == m0);
      }
      for (int64_t r = 0; r < rows; ++r) {
        __m512 s = tree.last(u[r]);
        if (scale) s = _mm512_mul_ps(s, sc);
        if (bias) s = _mm512_add_ps(s, bi);
        _mm256_mask_storeu_epi16(y + (m + r) * ys + g, keep, to_bf16(s));
      }
      m += rows;
    }
  }
}
#endif


#ifdef LINSERVE_AMX
// ------------------------------------------------------------------------------------------ the AMX form
// Weights packed once into AMX's B-tile layout: (ceil(N/16), ceil(K/32), 16, 32) bf16, tile (nb, kb) row kp holding
// w[16nb + n][32kb + 2kp + e] at column 2n + e (zeros past N and K). Each output is accumulated in a C tile over the
// K blocks in order; AMX computes each tile row from its own A row alone (checked: a row's result is the same bits
// with 1 or 16 rows configured), so a row's output never depends on the other rows.
struct __attribute__((packed)) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_path = false;

void configure_tiles(int rows0, int rows1) {  // C 0..3 (rows × 16 fp32), A 4, 5 (rows × 32 bf16), B 6, 7 (16 × 32 bf16)
  TileConfig cfg;
  const int rows[2] = {rows0, rows1};
  for (int i = 0; i < 2; ++i) {
    const int r = rows[i] > 0 ? rows[i] : 1;
    cfg.rows[2 * i] = cfg.rows[2 * i + 1] = static_cast<uint8_t>(r);  // C tiles of row block i
    cfg.colsb[2 * i] = cfg.colsb[2 * i + 1] = 64;
    cfg.rows[4 + i] = static_cast<uint8_t>(r);
    cfg.colsb[4 + i] = 64;
    cfg.rows[6 + i] = 16;
    cfg.colsb[6 + i] = 64;
  }
  _tile_loadconfig(&cfg);
}

template <typename W>
inline const void* tile(const W* b, uint16_t* wide);
template <>
inline const void* tile<uint16_t>(const uint16_t* b, uint16_t*) { return b; }
template <>
inline const void* tile<int8_t>(const int8_t* b, uint16_t* wide) {
  for (int i = 0; i < 16; ++i) _mm512_store_si512(wide + 32 * i, load_w(b + 32 * i, CHUNK));
  asm volatile("" ::: "memory");  // (GCC's tile intrinsics are asm that names no memory: keep the stores before it)
  return wide;
}

// rows [m0, m0 + rows) (≤ 32) × n blocks nb, nb + 1 (the second only if two): all of K
template <typename W>
inline void amx_block(const uint16_t* x, int64_t x_stride, const W* packed, int64_t Kb, int rows, int64_t nb,
                      bool two, const float* scale, const float* bias, uint16_t* y, int64_t N, int64_t ys,
                      int64_t m0) {
  const int r0 = rows > 16 ? 16 : rows, r1 = rows - r0;
  _tile_zero(0);
  _tile_zero(1);
  if (r1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const W* b0 = packed + nb * Kb * 512;
  const W* b1 = two ? b0 + Kb * 512 : b0;
  alignas(64) uint16_t wide[2][512];  // int8 weights: this block's tiles widened to bf16 (exact)
  const uint16_t* a0 = x + m0 * x_stride;
  const uint16_t* a1 = a0 + 16 * x_stride;
  const int64_t stride = x_stride * 2;
  for (int64_t kb = 0; kb < Kb; ++kb) {
    _tile_loadd(4, a0 + 32 * kb, stride);
    _tile_loadd(6, tile<W>(b0 + 512 * kb, wide[0]), 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) {
      _tile_loadd(7, tile<W>(b1 + 512 * kb, wide[1]), 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (r1) {
      _tile_loadd(5, a1 + 32 * kb, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (two) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][16 * 16];
  _tile_stored(0, c[0], 64);
  if (two) _tile_stored(1, c[1], 64);
  if (r1) {
    _tile_stored(2, c[2], 64);
    if (two) _tile_stored(3, c[3], 64);
  }
  asm volatile("" ::: "memory");  // (and read c only after the tile stores)
  for (int j = 0; j < (two ? 2 : 1); ++j) {
    const int64_t n0 = (nb + j) * 16;
    const int64_t outputs = std::min<int64_t>(16, N - n0);
    const __mmask16 keep = static_cast<__mmask16>((1u << outputs) - 1);
    const __m512 sc = scale ? _mm512_maskz_loadu_ps(keep, scale + n0) : _mm512_setzero_ps();
    const __m512 bi = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
      const float* row = r < 16 ? c[j] + r * 16 : c[2 + j] + (r - 16) * 16;
      __m512 s = _mm512_load_ps(row);
      if (scale) s = _mm512_mul_ps(s, sc);
      if (bias) s = _mm512_add_ps(s, bi);
      _mm256_mask_storeu_epi16(y + (m0 + r) * ys + n0, keep, to_bf16(s));
    }
  }
}

template <typename W>
void run_amx(const uint16_t* x, int64_t x_stride, const Parts<W>& parts, uint16_t* y, int64_t ys, int64_t M,
             int64_t Kb) {
  // tasks: each part's groups of output pairs × groups of 32-row blocks, so a prefill chunk reads each weight tile
  // once per 128 rows (a group's tiles stay in L2) rather than once per 32; a decode batch (≤ 32 rows): one pair a
  // task. The parts' tasks in one range: one parallel region a call however many weights it reads
  const int64_t row_blocks = (M + 31) / 32;
  const int64_t pair_group = row_blocks > 1 ? 8 : 1, row_group = row_blocks > 1 ? 4 : 1;
  const int64_t row_groups = (row_blocks + row_group - 1) / row_group;
  int64_t first[MAX_PARTS + 1] = {0};  // part j's tasks: [first[j], first[j + 1])
  for (int j = 0; j < parts.count; ++j) {
    const int64_t pairs = ((parts.part[j].N + 15) / 16 + 1) / 2;
    first[j + 1] = first[j] + (pairs + pair_group - 1) / pair_group * row_groups;
  }
  at::parallel_for(0, first[parts.count], 1, [&](int64_t begin, int64_t end) {
    linserve::FlushSubnormals flushed;
    int configured = -1, j = 0;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= first[j + 1]) ++j;
      const Part<W>& part = parts.part[j];
      const int64_t Nb = (part.N + 15) / 16, pairs = (Nb + 1) / 2;
      const int64_t pair_groups = (pairs + pair_group - 1) / pair_group;
      const int64_t pg = (t - first[j]) % pair_groups, rg = (t - first[j]) / pair_groups;
      for (int64_t b = rg * row_group; b < std::min(row_blocks, (rg + 1) * row_group); ++b) {
        const int64_t m0 = b * 32;
        const int rows = static_cast<int>(std::min<int64_t>(32, M - m0));
        if (rows != configured) {
          configure_tiles(rows > 16 ? 16 : rows, rows > 16 ? rows - 16 : 0);
          configured = rows;
        }
        for (int64_t p = pg * pair_group; p < std::min(pairs, (pg + 1) * pair_group); ++p)
          amx_block<W>(x, x_stride, part.w, Kb, rows, 2 * p, 2 * p + 1 < Nb, part.scale, part.bias,
                       y + part.column, part.N, ys, m0);
      }
    }
    _tile_release();
  });
}
#endif

bool avx512_path = false;  // set at load when the CPU has the lanes form's instructions (the library was built for it)

// The plain-AVX512 lanes form's fused step (dot_chunk<true>) gives the unfused step's bits when every product is
// exact and normal: bf16 × bf16 (or int8 × bf16) significands always fit fp32's, so what remains is the exponents —
// every nonzero input in [2^-63, 2^64) keeps each product in [2^-126, FLT_MAX), neither flushed nor overflowed,
// and the multiply-add then rounds the same exact sum once, as the add does. A zero or subnormal input (read as
// zero either way) is in range; an infinity or NaN is not. Checked for x on every multi-row call (M·K bf16
// exponents, ~0.1 µs for 5 × 1,024) and for each bf16 weight once, as pack_weight packs it: the packed weights
// in range are known by their data while they live (`fused_weights`; a packed weight is read-only; any other tensor
// — a copy, a view past its start — is not known, so unfused). int8 weights are integers of magnitude 1-128: in range.
constexpr int FUSED_EXPONENT_LOW = 127 - 63, FUSED_EXPONENT_HIGH = 127 + 63;  // biased: 2^-63 .. 2^64 exclusive
std::mutex fused_mutex;
std::unordered_set<const void*> fused_weights;  // the data of live packed bf16 weights whose values are all in range

bool packed_in_fused_range(const void* data) {
  std::lock_guard<std::mutex> lock(fused_mutex);
  return fused_weights.count(data) != 0;
}

bool in_fused_range(const uint16_t* v, int64_t n) {
  int64_t i = 0;
#ifdef LINSERVE_LANES
  if (avx512_path) {
    const __m512i low = _mm512_set1_epi16(FUSED_EXPONENT_LOW), high = _mm512_set1_epi16(FUSED_EXPONENT_HIGH);
    const __m512i field = _mm512_set1_epi16(0xff);
    __mmask32 all = ~__mmask32(0);
    for (; i + 32 <= n; i += 32) {
      const __m512i e = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(v + i), 7), field);
      const __mmask32 zero = _mm512_cmpeq_epi16_mask(e, _mm512_setzero_si512());
      all &= zero | (_mm512_cmpge_epu16_mask(e, low) & _mm512_cmple_epu16_mask(e, high));
    }
    if (all != ~__mmask32(0)) return false;
  }
#endif
  for (; i < n; ++i) {
    const int e = (v[i] >> 7) & 0xff;
    if (e != 0 && (e < FUSED_EXPONENT_LOW || e > FUSED_EXPONENT_HIGH)) return false;
  }
  return true;
}

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
      at::in_parallel_region()) {  // (a share's front and back are 32-bit halves of one word)
    at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
      linserve::FlushSubnormals flushed;
      for (int64_t t = begin; t < end; ++t) task(t);
    });
    return;
  }
  Share shares[MAX_SHARES];
  for (int i = 0; i < threads; ++i) shares[i].range.store(Share::pack(total * i / threads, total * (i + 1) / threads));
  const int64_t step = std::max<int64_t>(1, grain / 4);
  at::parallel_for(0, threads, 1, [&](int64_t first_share, int64_t last_share) {
    linserve::FlushSubnormals flushed;
    int64_t begin, end;
    for (int64_t i = first_share; i < last_share; ++i)
      while (shares[i].take(true, step, begin, end))
        for (int64_t t = begin; t < end; ++t) task(t);
    for (int k = 1; k < threads; ++k) {  // then the others' shares, from their ends
      Share& other = shares[(first_share + k) % threads];
      while (other.take(false, step, begin, end))
        for (int64_t t = begin; t < end; ++t) task(t);
    }
  });
}

template <typename W>
void run(const uint16_t* x, const Parts<W>& parts, uint16_t* y, int64_t ys, int64_t M, int64_t K, bool force_scalar,
         bool lanes_packed, bool fused) {
  // tasks: each part's groups of outputs × blocks of rows, the parts' tasks in one range (one parallel region a
  // call); every output's arithmetic is the same whichever task holds it
  const int64_t row_block = M <= 64 ? M : 64;
  const int64_t row_blocks = (M + row_block - 1) / row_block;
  const int64_t per_task = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K * std::min<int64_t>(M, 64)));
  int64_t first[MAX_PARTS + 1] = {0};  // part j's tasks: [first[j], first[j + 1])
  for (int j = 0; j < parts.count; ++j) first[j + 1] = first[j] + (parts.part[j].N + GROUP - 1) / GROUP * row_blocks;
  run_tasks(first[parts.count], per_task, [&](int64_t t) {
    int j = 0;
    while (t >= first[j + 1]) ++j;
    const Part<W>& part = parts.part[j];
    const int64_t groups = (part.N + GROUP - 1) / GROUP;
    const int64_t g = (t - first[j]) % groups, b = (t - first[j]) / groups;
    const int64_t n0 = g * GROUP, n1 = std::min(part.N, n0 + GROUP);
    const int64_t m0 = b * row_block, m1 = std::min(M, m0 + row_block);
    uint16_t* yp = y + part.column;
#ifdef LINSERVE_LANES
    if (lanes_packed) {
      if (fused)
        rows_avx512<W, Packed, true>(x, part.w, part.scale, part.bias, yp, m0, m1, n0, n1, K, ys);
      else
        rows_avx512<W, Packed>(x, part.w, part.scale, part.bias, yp, m0, m1, n0, n1, K, ys);
      return;
    }
    if (avx512_path && !force_scalar) {
      rows_avx512<W, RowMajor>(x, part.w, part.scale, part.bias, yp, m0, m1, n0, n1, K, ys);
      return;
    }
#endif
    rows_scalar<W>(x, part.w, part.scale, part.bias, yp, m0, m1, n0, n1, K, ys);
  });
}

// Packed weights of a megabyte or more live back to back in large mappings advised as transparent huge pages
// (madvise before the first touch; honoured where THP is `madvise` or `always`, harmless where `never`): a decode
// step streams every packed weight once, and on 4 KB pages each 4 KB is a TLB miss and a restart of the hardware
// prefetchers (one row over 340M's gate and up: 21 -> 28 GB/s on one Zen 4 thread). Back to back, not a mapping
// each: a weight's last huge page would hold up to 2 MB of nothing (75 MB over 340M Gated DeltaNet's 211 weights),
// and leaving that tail on 4 KB pages cost the step 5-8%. A chunk is unmapped with the last tensor on it.
struct Chunk {
  void* base = nullptr;
  size_t length = 0, used = 0;
  ~Chunk() {
    if (base) munmap(base, length);
  }
};
constexpr size_t HUGE_PAGE = 2u << 20, CHUNK_BYTES = 128u << 20, WEIGHT_ALIGN = 4096;
std::mutex chunk_mutex;
std::weak_ptr<Chunk> current_chunk;  // where the next weight goes while a tensor still holds it

std::shared_ptr<Chunk> new_chunk(size_t bytes) {
  const size_t length = std::max(CHUNK_BYTES, (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
  const size_t mapped = length + HUGE_PAGE;  // room to start on a 2 MB boundary
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(base), aligned = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
  if (aligned > start) munmap(base, aligned - start);  // the slack before the boundary and after the chunk given back
  munmap(reinterpret_cast<void*>(aligned + length), start + mapped - (aligned + length));
  auto chunk = std::make_shared<Chunk>();
  chunk->base = reinterpret_cast<void*>(aligned), chunk->length = length;
  madvise(chunk->base, length, MADV_HUGEPAGE);  // (pages never touched cost nothing)
  return chunk;
}

at::Tensor huge_page_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  size_t bytes = options.dtype().itemsize();
  for (int64_t size : sizes) bytes *= static_cast<size_t>(size);
  if (bytes < HUGE_PAGE / 2) return at::empty(sizes, options);
  std::shared_ptr<Chunk> chunk;
  void* memory = nullptr;
  {
    std::lock_guard<std::mutex> lock(chunk_mutex);
    chunk = current_chunk.lock();
    if (!chunk || chunk->used + bytes > chunk->length) {
      chunk = new_chunk(bytes);
      if (!chunk) return at::empty(sizes, options);
      current_chunk = chunk;
    }
    memory = static_cast<char*>(chunk->base) + chunk->used;
    chunk->used = (chunk->used + bytes + WEIGHT_ALIGN - 1) / WEIGHT_ALIGN * WEIGHT_ALIGN;
  }
  large_weight_bytes += static_cast<int64_t>(bytes);
  return at::from_blob(memory, sizes, [chunk, bytes](void*) { large_weight_bytes -= static_cast<int64_t>(bytes); },
                       options);  // (the chunk lives while a tensor on it does)
}

at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_weight: weight must be (N, K)");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kChar,
              "pack_weight: weight must be bfloat16 or int8");
  const int64_t N = weight.size(0), K = weight.size(1), Nb = (N + 15) / 16, Kb = (K + 31) / 32;
  if (!avx512_path) return weight.contiguous();  // the scalar form reads (N, K)
  at::Tensor padded = weight.contiguous();  // (Nb·16, Kb·32): zeros past N and K, a copy only where there are any
  if (N % 16 || K % 32) {
    padded = at::zeros({Nb * 16, Kb * 32}, weight.options());
    padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  }
  at::Tensor packed = huge_page_empty({Nb, Kb, 16, 32}, weight.options());
#ifdef LINSERVE_AMX
  if (amx_path) {  // (N, K) → (Nb, Kb, 16, 32): tile (nb, kb), row kp, column 2n + e = w[16nb + n][32kb + 2kp + e]
    packed.view({Nb, Kb, 16, 16, 2}).copy_(padded.view({Nb, 16, Kb, 16, 2}).permute({0, 2, 3, 1, 4}));
    return packed;
  }
#endif
  // lanes: (N, K) → (Nb, Kb, 16, 32): [nb][kb][n][j] = w[16nb + n][32kb + j] — a group's chunks side by side
  packed.copy_(padded.view({Nb, 16, Kb, 32}).permute({0, 2, 1, 3}));
#ifdef LINSERVE_AVX512BF16
  return packed;  // (VDPBF16PS is the step: nothing fused to choose, no weight to know)
#else
  if (weight.scalar_type() != at::kBFloat16 ||
      !in_fused_range(reinterpret_cast<const uint16_t*>(padded.data_ptr()), padded.numel()))
    return packed;
  // known in range while it lives: the same memory, held by a tensor whose end forgets it
  void* data = packed.data_ptr();
  {
    std::lock_guard<std::mutex> lock(fused_mutex);
    fused_weights.insert(data);
  }
  return at::from_blob(data, packed.sizes(), [packed, data](void*) {
    std::lock_guard<std::mutex> lock(fused_mutex);
    fused_weights.erase(data);
  }, packed.options());
#endif
}

// one weight's checks: (N, K) as it is or packed (N/16, K/32, 16, 32); int8 with a scale, bf16 without
bool check_weight(const at::Tensor& weight, const c10::optional<at::Tensor>& scale, int64_t N, int64_t K,
                  bool force_scalar) {
  TORCH_CHECK(weight.is_contiguous() && (weight.dim() == 2 || weight.dim() == 4),
              "invariant_linear: weight must be pack_weight's (contiguous (N, K), or packed (N/16, K/32, 16, 32))");
  const bool int8 = weight.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || weight.scalar_type() == at::kBFloat16, "invariant_linear: weight must be bfloat16 or int8");
  TORCH_CHECK(int8 == (scale.has_value() && scale->defined()), "invariant_linear: int8 weights take a scale, bf16 none");
  TORCH_CHECK(!int8 || (scale->numel() == N), "invariant_linear: an int8 weight's scale must be (N,) = (", N, ",)");
  const bool tiles = weight.dim() == 4;
  if (tiles) {
    TORCH_CHECK(weight.size(0) == (N + 15) / 16 && weight.size(1) == (K + 31) / 32 && weight.size(2) == 16 &&
                    weight.size(3) == 32,
                "invariant_linear: packed tiles ", weight.sizes(), " are not (N, K) = (", N, ", ", K, ")");
  } else {
    TORCH_CHECK(weight.size(0) == N && weight.size(1) == K, "invariant_linear: weight ", weight.sizes(),
                " is not (N, K) = (", N, ", ", K, ")");
  }
  TORCH_CHECK(!(tiles && force_scalar), "invariant_linear_scalar: takes (N, K) weights");
  return tiles;
}

template <typename W>
void run_parts(const at::Tensor& x, int64_t M, int64_t K, const std::vector<at::Tensor>& weights,
               const std::vector<at::Tensor>& scales, const at::Tensor& bias, const std::vector<int64_t>& Ns,
               at::Tensor& y, bool tiles, bool force_scalar) {
  const int64_t ys = y.size(-1);
  Parts<W> parts{};
  parts.count = static_cast<int>(weights.size());
  for (int j = 0, column = 0; j < parts.count; column += Ns[j], ++j)
    parts.part[j] = {reinterpret_cast<const W*>(weights[j].data_ptr()),
                     scales[j].defined() ? scales[j].data_ptr<float>() : nullptr,
                     bias.defined() ? bias.data_ptr<float>() : nullptr, Ns[j], column};
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
#ifdef LINSERVE_AMX
  if (tiles && amx_path) {
    const int64_t Kb = (K + 31) / 32;
    const at::Tensor xp = K % 32 ? at::constant_pad_nd(x.view({M, K}), {0, Kb * 32 - K}) : x;  // whole 32-wide blocks
    run_amx<W>(reinterpret_cast<const uint16_t*>(xp.data_ptr()), Kb * 32, parts, yp, ys, M, Kb);
    return;
  }
#endif
  TORCH_CHECK(!tiles || avx512_path, "invariant_linear: packed weights on a CPU without AVX512");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
#ifdef LINSERVE_AVX512BF16
  const bool fused = false;  // (VDPBF16PS is the step already)
#else
  // packed weights, every product in range: fused at one row too (bound by arithmetic where the weights stay cached:
  // the shipped model's head 110 -> 64 µs a call on the 2-vCPU AVX512 Xeon, its x checked in ~0.03 µs)
  bool fused = tiles;
  for (int j = 0; fused && j < parts.count; ++j)  // the weights known first (a lookup), then x's scan
    fused = std::is_same<W, int8_t>::value || packed_in_fused_range(weights[j].data_ptr());
  fused = fused && in_fused_range(xp, M * K);
#endif
  run<W>(xp, parts, yp, ys, M, K, force_scalar, tiles, fused);
}

at::Tensor as_float(const at::Tensor& t) {  // (a scale or a bias: fp32 and contiguous already, without a dispatch)
  return t.scalar_type() == at::kFloat && t.is_contiguous() ? t : t.to(at::kFloat).contiguous();
}

// y = [x W_0ᵀ, x W_1ᵀ, …] (+ b where one weight has a bias): each weight's outputs exactly as a call over it alone
// (the same groups, the same arithmetic; only the tasks are shared out together)
at::Tensor invariant_linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                  const std::vector<c10::optional<at::Tensor>>& scales,
                                  const c10::optional<at::Tensor>& bias, const std::vector<int64_t>& Ns,
                                  bool force_scalar) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "invariant_linear: x must be bfloat16");
  TORCH_CHECK(!weights.empty() && weights.size() <= MAX_PARTS, "invariant_linear: 1 to ", MAX_PARTS, " weights");
  const int64_t K = x.size(-1);
  const bool int8 = weights[0].scalar_type() == at::kChar, tiles = weights[0].dim() == 4;  // (checked below)
  std::vector<at::Tensor> s(weights.size());
  int64_t total = 0;
  for (size_t j = 0; j < weights.size(); ++j) {
    TORCH_CHECK(check_weight(weights[j], scales[j], Ns[j], K, force_scalar) == tiles &&
                    (weights[j].scalar_type() == at::kChar) == int8,
                "invariant_linear_cat: the weights must share one form (packed or not, bf16 or int8)");
    if (int8) s[j] = as_float(*scales[j]);
    total += Ns[j];
  }
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(weights.size() == 1, "invariant_linear_cat: no bias");
    b = as_float(*bias);
  }
  // No operator goes through the dispatcher on a decode step's path (x contiguous, as every caller passes it): a
  // reshape, a view and an `empty` through it cost 1.1-1.5 µs a call, and a shipped-model step makes 27 calls
  const at::Tensor x2 = x.contiguous();  // (…, K): itself where it is contiguous
  const int64_t M = K ? x2.numel() / K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = total;
  at::Tensor y = at::detail::empty_cpu(shape, at::kBFloat16, false, c10::nullopt);  // (…, total)
  if (M == 0 || total == 0) return y;
  if (int8)
    run_parts<int8_t>(x2, M, K, weights, s, b, Ns, y, tiles, force_scalar);
  else
    run_parts<uint16_t>(x2, M, K, weights, s, b, Ns, y, tiles, force_scalar);
  return y;
}

at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                            const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return invariant_linear_parts(x, {weight}, {scale}, bias, {out_features}, false);
}

at::Tensor invariant_linear_scalar(const at::Tensor& x, const at::Tensor& weight,
                                   const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias,
                                   int64_t out_features) {
  return invariant_linear_parts(x, {weight}, {scale}, bias, {out_features}, true);
}

// up to four weights over one x in one call: (…, K) → (…, n0 + n1 + n2 + n3), each weight's outputs its own columns
at::Tensor invariant_linear_cat(const at::Tensor& x, const at::Tensor& w0, const at::Tensor& w1,
                                const c10::optional<at::Tensor>& w2, const c10::optional<at::Tensor>& w3,
                                const c10::optional<at::Tensor>& s0, const c10::optional<at::Tensor>& s1,
                                const c10::optional<at::Tensor>& s2, const c10::optional<at::Tensor>& s3, int64_t n0,
                                int64_t n1, int64_t n2, int64_t n3) {
  std::vector<at::Tensor> weights{w0, w1};
  std::vector<c10::optional<at::Tensor>> scales{s0, s1};
  std::vector<int64_t> Ns{n0, n1};
  if (w2.has_value() && w2->defined()) weights.push_back(*w2), scales.push_back(s2), Ns.push_back(n2);
  if (w3.has_value() && w3->defined()) {
    TORCH_CHECK(weights.size() == 3, "invariant_linear_cat: w3 without w2");
    weights.push_back(*w3), scales.push_back(s3), Ns.push_back(n3);
  }
  return invariant_linear_parts(x, weights, scales, c10::nullopt, Ns, false);
}

bool has_lanes() {  // the instructions the lanes form was built with
#ifdef LINSERVE_LANES
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
#ifdef LINSERVE_AVX512BF16
  return avx512 && __builtin_cpu_supports("avx512bf16");
#else
  return avx512;
#endif
#else
  return false;
#endif
}

bool has_amx() {
#ifdef LINSERVE_AMX
  if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("amx-tile")) return false;
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
  return false;
#endif
}

struct Init {
  Init() {
    avx512_path = has_lanes();
#ifdef LINSERVE_AMX
    amx_path = avx512_path && has_amx();
#endif
  }
} init;

}  // namespace

TORCH_LIBRARY(linserve, m) {
  m.def("invariant_linear(Tensor x, Tensor weight, Tensor? scale, Tensor? bias, int out_features) -> Tensor");
  m.def("invariant_linear_scalar(Tensor x, Tensor weight, Tensor? scale, Tensor? bias, int out_features) -> Tensor");
  m.def("invariant_linear_cat(Tensor x, Tensor w0, Tensor w1, Tensor? w2, Tensor? w3, Tensor? s0, Tensor? s1, "
        "Tensor? s2, Tensor? s3, int n0, int n1, int n2, int n3) -> Tensor");
  m.def("pack_weight(Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("invariant_linear", &invariant_linear);
  m.impl("invariant_linear_scalar", &invariant_linear_scalar);
  m.impl("invariant_linear_cat", &invariant_linear_cat);
  m.impl("pack_weight", &pack_weight);
}

// AOTInductor's C shim for the op: a compiled program calls this directly (no dispatcher, no Python)
extern "C" AOTITorchError aoti_torch_cpu_invariant_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                           AtenTensorHandle* scale, AtenTensorHandle* bias,
                                                           int64_t out_features, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    auto result = invariant_linear(*torch::aot_inductor::tensor_handle_to_tensor_pointer(x),
                                   *torch::aot_inductor::tensor_handle_to_tensor_pointer(weight),
                                   torch::aot_inductor::pointer_to_optional<at::Tensor>(scale),
                                   torch::aot_inductor::pointer_to_optional<at::Tensor>(bias), out_features);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(result));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_invariant_linear_cat(
    AtenTensorHandle x, AtenTensorHandle w0, AtenTensorHandle w1, AtenTensorHandle* w2, AtenTensorHandle* w3,
    AtenTensorHandle* s0, AtenTensorHandle* s1, AtenTensorHandle* s2, AtenTensorHandle* s3, int64_t n0, int64_t n1,
    int64_t n2, int64_t n3, AtenTensorHandle* ret0) {
  using torch::aot_inductor::pointer_to_optional;
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    auto result = invariant_linear_cat(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(w0),
                                       *tensor_handle_to_tensor_pointer(w1), pointer_to_optional<at::Tensor>(w2),
                                       pointer_to_optional<at::Tensor>(w3), pointer_to_optional<at::Tensor>(s0),
                                       pointer_to_optional<at::Tensor>(s1), pointer_to_optional<at::Tensor>(s2),
                                       pointer_to_optional<at::Tensor>(s3), n0, n1, n2, n3);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(result));
  });
}

extern "C" int linserve_streamed_rows() {  // rows a call takes one at a time now (0: none; the weights fit the cache)
#ifdef LINSERVE_AMX
  if (amx_path) return 0;  // (tiles: run_amx)
#endif
  return avx512_path && weights_streamed() ? static_cast<int>(SINGLE_ROWS) : 0;
}

extern "C" int64_t linserve_last_level_cache_bytes() { return last_level_cache_bytes(); }

extern "C" int linserve_kernel_form() {  // 2: AMX tiles, 1: AVX512-BF16 lanes, 3: AVX512 lanes, 0: scalar lanes
#ifdef LINSERVE_AMX
  if (amx_path) return 2;
#endif
#ifdef LINSERVE_AVX512BF16
  return avx512_path ? 1 : 0;
#else
  return avx512_path ? 3 : 0;
#endif
}
