// invariant_linear.cpp's AVX2 lanes form (AVX2 + FMA without AVX512: AMD Zen 2/3, Intel Haswell to Alder Lake):
// VDPBF16PS's arithmetic as the scalar form states it, each output's 16 lanes as two 8-float halves — the same bits.
// It reads pack_weight's groups (N/16, K/32, 16, 32) only (weights given as (N, K) take the scalar code).
#pragma once

#include "linear_scalar.h"

#ifdef LINSERVE_AVX2
#include <immintrin.h>
#endif

namespace {

#ifdef LINSERVE_AVX2
// register blocks (AVX2 has 16 vector registers): up to AVX2_ROWS rows a pass
constexpr int64_t AVX2_ROWS = 4;  // (4 rows × 2 outputs, a half at a time: 8 accumulators, 4 weight, 2 x)
// k's a block of several rows takes at a time (a multiple of CHUNK): 4 rows' x of it, split, are 8 KB of L1
constexpr int64_t AVX2_K_BLOCK = 512;
// chunks ahead a single pass of int8 rows over streamed weights prefetches (avx2_rows_streamed; 16 measured alike)
constexpr int64_t INT8_STREAM_AHEAD = 8;
// a streamed call of 2 to AVX2_STREAM_ROWS bf16 rows (int8: to AVX2_PASS_ROWS; at most streamed_rows_limit) reads
// each group in single passes of at most AVX2_PASS_ROWS rows (avx2_rows_streamed)
constexpr int64_t AVX2_STREAM_ROWS = 8;
constexpr int64_t AVX2_PASS_ROWS = 6;

// 32 bf16 of a row at k = c: lanes 0-7's pairs (elements 0-15) and lanes 8-15's (16-31), zeros past the end
struct PairChunk {
  __m256i lo, hi;
};

inline PairChunk load_pairs(const uint16_t* p, int64_t left) {
  if (left >= CHUNK)
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
  alignas(32) uint16_t tail[CHUNK] = {};
  std::memcpy(tail, p, static_cast<size_t>(left) * sizeof(uint16_t));
  return {_mm256_load_si256(reinterpret_cast<const __m256i*>(tail)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(tail + 16))};
}

inline __m256 odd_of(__m256i pairs) {  // each 32-bit lane's high bf16 as fp32 (exact)
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline __m256 even_of(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }  // the low one

// a chunk as fp32 values, split once for every row or output that reads it: lanes 0-7 and 8-15, element 2j + 1
// (odd) and 2j (even) of lane j
struct SplitChunk {
  __m256 odd_lo, even_lo, odd_hi, even_hi;
};

inline SplitChunk split(const PairChunk& p) { return {odd_of(p.lo), even_of(p.lo), odd_of(p.hi), even_of(p.hi)}; }

// half a weight chunk (16 of its k's: 8 lanes) as fp32, element 2j + 1 (odd) and 2j (even) of lane j
struct HalfChunk {
  __m256 odd, even;
};

inline HalfChunk load_weight_half(const uint16_t* p) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {odd_of(pairs), even_of(pairs)};
}

// 16 int8 as fp32 (exact, as their bf16 would be), packed odd elements first on this form (pack_weight: each half's
// 8 odd bytes, then its 8 even ones): each 8 widened straight to 32-bit lanes — 4 operations a half, where widening
// the pairs to 16 bits and splitting them took 6 (which is what made 4 int8 rows a pass cost more than 6)
inline HalfChunk load_weight_half(const int8_t* p) {
  const __m256i odd = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i even = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  return {_mm256_cvtepi32_ps(odd), _mm256_cvtepi32_ps(even)};
}

// one half's step: its odd pair's product added, then its even pair's (unfused under the kernel's FTZ/DAZ: the
// scalar form's step); F: as fused multiply-adds, for a call whose every product is exact and normal
// (`in_fused_range`) — the same exact sum rounded once, the same bits
template <bool F>
inline __m256 dot_half(__m256 acc, __m256 xo, __m256 xe, __m256 wo, __m256 we) {
  if (F) return _mm256_fmadd_ps(xe, we, _mm256_fmadd_ps(xo, wo, acc));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(xo, wo));
  return _mm256_add_ps(acc, _mm256_mul_ps(xe, we));
}

// The tree of halves, levels 2-4, over 8 outputs whose level 1 is done (v[o]: lane j + lane j + 8, j < 8) → their
// 8 sums in order, each exactly tree16's: j + j+4 for outputs o and o + 4 side by side, then j + j+2, then j + j+1
inline __m256 tree8(const __m256* v) {
  __m256 w[4];
  for (int o = 0; o < 4; ++o)  // [o: t0..t3 | o + 4: t0..t3]
    w[o] = _mm256_add_ps(_mm256_permute2f128_ps(v[o], v[o + 4], 0x20), _mm256_permute2f128_ps(v[o], v[o + 4], 0x31));
  __m256 x[2];
  for (int p = 0; p < 2; ++p)  // [2p: u0 u1, 2p + 1: u0 u1 | 2p + 4: u0 u1, 2p + 5: u0 u1]
    x[p] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * p], w[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(w[2 * p], w[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),  // outputs 0-3 | 4-7
                       _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m128i to_bf16(__m256 s) {  // float_to_bf16 on 8 lanes: RNE, an input subnormal read as zero, NaN kept
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  __m256i bits = _mm256_castps_si256(s);
  const __m256i subnormal = _mm256_cmpeq_epi32(_mm256_and_si256(bits, exponent), _mm256_setzero_si256());
  bits = _mm256_blendv_epi8(bits, _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN)), subnormal);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), exponent);
  const __m256i kept_lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));  // ties to even
  const __m256i up = _mm256_add_epi32(kept_lsb, _mm256_set1_epi32(0x7fff));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, up), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i out = _mm256_blendv_epi8(rounded, quiet, nan);  // each ≤ 0xffff: packed without saturating
  return _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
}

// x split once a call: each row's 32-wide chunks as fp32 [odd_lo, even_lo, odd_hi, even_hi] (8 floats each, the
// tail's zeros too), so the passes over every group of outputs read x as it goes into the arithmetic
inline int64_t split_stride(int64_t K) { return (K + CHUNK - 1) / CHUNK * CHUNK; }

inline void split_rows(const uint16_t* x, int64_t M, int64_t K, float* xs) {
  const int64_t stride = split_stride(K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < K; c += CHUNK) {
      const SplitChunk a = split(load_pairs(x + m * K + c, K - c));
      float* out = xs + m * stride + c;
      _mm256_storeu_ps(out, a.odd_lo), _mm256_storeu_ps(out + 8, a.even_lo);
      _mm256_storeu_ps(out + 16, a.odd_hi), _mm256_storeu_ps(out + 24, a.even_hi);
    }
}

// a packed group's whole block of the chunk `chunks` after k = c brought into L1 (a block's first pass; one int8 row's
// single pass, INT8_STREAM_AHEAD ahead — past the group's end, the next group's first chunks)
template <typename W>
inline void fetch_ahead(const W* wg, int64_t c, int64_t chunks = FETCH_AHEAD) {
  const char* ahead = reinterpret_cast<const char*>(wg + packed_at(0, c + chunks * CHUNK));
  for (int64_t line = 0; line < GROUP * CHUNK * static_cast<int64_t>(sizeof(W)); line += 64)
    _mm_prefetch(ahead + line, _MM_HINT_T0);
}

// One row (split: xs) × O outputs of a packed group from output o0, over all of K → v[0][o0 + o] (level 1 of the tree
// done: lanes 0-7 + lanes 8-15). Each accumulator takes two dependent steps a chunk, so the block keeps 2 · O of them
// going (8: a fused multiply-add's latency times the two a cycle). fetch: the group's first pass brings the whole
// block of each chunk in, FETCH_AHEAD chunks ahead, so the passes over its other outputs read cached lines. next (the
// passes after the first; else null): the group read next, a third of its lines each (fetch_share)
template <int O, typename W, bool F>
__attribute__((always_inline)) inline void avx2_block(const float* xs, const W* wg, int64_t K, __m256 (*v)[GROUP],
                                                      int o0, bool fetch, const W* next = nullptr, int share = 0) {
  __m256 lo[O], hi[O];
  for (int o = 0; o < O; ++o) lo[o] = hi[o] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K; c += CHUNK) {
    if (fetch) fetch_ahead(wg, c);
    if (next != nullptr) fetch_share(next, c, share, 3);
    for (int o = 0; o < O; ++o) {  // a half of the weight chunk at a time: two registers of it live, not four
      const float* a = xs + c;
      const HalfChunk b_lo = load_weight_half(wg + packed_at(o0 + o, c));
      lo[o] = dot_half<F>(lo[o], _mm256_load_ps(a), _mm256_load_ps(a + 8), b_lo.odd, b_lo.even);
      const HalfChunk b_hi = load_weight_half(wg + packed_at(o0 + o, c) + 16);
      hi[o] = dot_half<F>(hi[o], _mm256_load_ps(a + 16), _mm256_load_ps(a + 24), b_hi.odd, b_hi.even);
    }
  }
  for (int o = 0; o < O; ++o) v[0][o0 + o] = _mm256_add_ps(lo[o], hi[o]);
}

// Two registers kept as registers: without this GCC folds each load of a row's x into every multiply-add that reads
// it — a load per multiply-add, and the block then waits on L1's two loads a cycle (4 rows × 2 outputs 1.19x slower
// at 8 rows, the shipped model's shapes on one Zen 3 core)
inline void in_registers(__m256& a, __m256& b) { asm volatile("" : "+x"(a), "+x"(b)); }

// R rows (split: xs, row stride `stride`) × a group's 16 outputs in one pass over K, for weights streamed from DRAM
// (`weights_streamed`): each weight half split once for all R rows, their R × 32 sums (too many for registers) in an
// array (L1) from chunk to chunk, the group read as one sequential stream at an even pace. One row: where 4 passes of
// 4 outputs took turns, one waiting on memory while three computed from the cache; the sums' loads and stores cost
// more than that turn-taking where the weights stay cached, so cached weights keep avx2_row_passes. int8 reads a
// chunk in half bf16's time, faster than the hardware prefetchers bring it: without a prefetch of its own one int8
// row's single pass was no faster than the passes (~11 GB/s on one Zen 3 thread, where the core computes ~24 G
// weights a second from L1); INT8_STREAM_AHEAD chunks ahead, 1.24-1.54x on one thread, 1.06-1.39x on two (bf16's
// within the noise with it: left without). Several rows: where the blocks of rows (avx2_rows_group) took turns —
// the first pass waiting on DRAM, the others computing from the cache with DRAM idle — the read and the arithmetic
// overlap: a step
// of 340M's projections on Zen 3, 2 threads, the two ways alternating in one process, 2 rows 36.3-41.4 -> 30.4-36.7
// ms (one row's 27-30), 3 rows 36.9-38.6 -> 31.7-36.0, 6 rows 50.7-52.5 -> 41.5-46.3, 8 rows (6 + 2) 54.7-62.9 ->
// 52.1-58.3, 4 rows alike; int8, its chunks fetched INT8_STREAM_AHEAD ahead as one int8 row's are, 2 rows 1.31-1.63x,
// 3 rows 1.12-1.44x, 6 rows 1.04-1.14x, 4 rows alike (docs/benchmarks.md). Two rows take a whole chunk at a time,
// their x in 8 registers; more take a half at a time (x in 2R: 3-6 rows measured faster that way, 2 slower). Each
// lane's sum over its chunks in order either way: the same bits
template <int R, typename W, bool F>
void avx2_rows_streamed(const float* xs, int64_t stride, const W* wg, int64_t K, __m256 (*v)[GROUP]) {
  __m256 sums[2][GROUP][R];  // (half, output, row)
  for (int h = 0; h < 2; ++h)
    for (int o = 0; o < GROUP; ++o)
      for (int r = 0; r < R; ++r) sums[h][o][r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K; c += CHUNK) {
    if constexpr (sizeof(W) == 1) fetch_ahead(wg, c, INT8_STREAM_AHEAD);
    if constexpr (R <= 2) {
      __m256 x[R][4];  // (each row's chunk, split: [odd_lo, even_lo, odd_hi, even_hi])
      for (int r = 0; r < R; ++r) {
        const float* a = xs + r * stride + c;
        x[r][0] = _mm256_load_ps(a), x[r][1] = _mm256_load_ps(a + 8);
        x[r][2] = _mm256_load_ps(a + 16), x[r][3] = _mm256_load_ps(a + 24);
        in_registers(x[r][0], x[r][1]);
        in_registers(x[r][2], x[r][3]);
      }
      for (int o = 0; o < GROUP; ++o) {
        const W* p = wg + packed_at(o, c);
        const HalfChunk b_lo = load_weight_half(p);
        for (int r = 0; r < R; ++r) sums[0][o][r] = dot_half<F>(sums[0][o][r], x[r][0], x[r][1], b_lo.odd, b_lo.even);
        const HalfChunk b_hi = load_weight_half(p + 16);
        for (int r = 0; r < R; ++r) sums[1][o][r] = dot_half<F>(sums[1][o][r], x[r][2], x[r][3], b_hi.odd, b_hi.even);
      }
    } else {
      for (int h = 0; h < 2; ++h) {  // (a half of the chunk: its lanes 0-7 or 8-15, 16 k's)
        __m256 odd[R], even[R];  // (the rows' half chunk, split)
        for (int r = 0; r < R; ++r) {
          const float* a = xs + r * stride + c + 16 * h;
          odd[r] = _mm256_load_ps(a), even[r] = _mm256_load_ps(a + 8);
          in_registers(odd[r], even[r]);
        }
        for (int o = 0; o < GROUP; ++o) {
          const HalfChunk b = load_weight_half(wg + packed_at(o, c) + 16 * h);
          for (int r = 0; r < R; ++r) sums[h][o][r] = dot_half<F>(sums[h][o][r], odd[r], even[r], b.odd, b.even);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < GROUP; ++o) v[r][o] = _mm256_add_ps(sums[0][o][r], sums[1][o][r]);  // (level 1 of the tree)
}

// One row × a group's 16 outputs in four passes of 4 → v[0][o] (level 1 of the tree done: lanes 0-7 + lanes 8-15),
// all of K at once (a decode step's row: its read of the weights is the cost, its x small) — where the weights stay
// cached, and int8's row
template <typename W, bool F>
void avx2_row_passes(const float* xs, const W* wg, int64_t K, __m256 (*v)[GROUP], bool fetch,
                     const W* next = nullptr) {  // next: the group read next (avx2_block), else null
  for (int o0 = 0; o0 < GROUP; o0 += 4)
    avx2_block<4, W, F>(xs, wg, K, v, o0, fetch && o0 == 0, o0 > 0 ? next : nullptr, o0 / 4 - 1);
}

// R rows (split: xs, row stride `stride`) × O outputs of a packed group from output o0, over k in [c0, c1), one half
// of each chunk (half 0: lanes 0-7, its first 16 k's; 1: lanes 8-15): the accumulators start from zero where `first`,
// else from acc_s[r][o0 + o] (carried on from the last block of k), and end there. A lane's sum over its chunks
// never meets the other half's until level 1 of the tree, so the halves may run one after the other — the same bits
// as both at once — and a block holds R · O accumulators, not twice that: 4 × 2 keeps 8 going (a fused
// multiply-add's latency times the two a cycle), its 2 outputs' weight halves in 4 registers and a row's x in 2, each
// x read from L1 once for both outputs (with 6 rows × 1 output over both halves each multiply-add read its x:
// 28 loads for 24 of them a chunk). fetch: this pass brings the whole block of each chunk in, FETCH_AHEAD ahead
template <int R, int O, typename W, bool F>
__attribute__((always_inline)) inline void avx2_half_block(const float* xs, int64_t stride, const W* wg, int64_t c0,
                                                           int64_t c1, __m256 (*acc_s)[GROUP], int o0, int half,
                                                           bool first, bool fetch, const W* next = nullptr,
                                                           int share = 0, int shares = 1) {
  __m256 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = first ? _mm256_setzero_ps() : acc_s[r][o0 + o];
  for (int64_t c = c0; c < c1; c += CHUNK) {
    if (fetch) fetch_ahead(wg, c);
    if (next != nullptr) fetch_share(next, c, share, shares);  // (a later pass: its share of the next group)
    HalfChunk b[O];
    for (int o = 0; o < O; ++o) b[o] = load_weight_half(wg + packed_at(o0 + o, c) + 16 * half);
    for (int r = 0; r < R; ++r) {
      const float* a = xs + r * stride + c + 16 * half;
      __m256 odd = _mm256_load_ps(a), even = _mm256_load_ps(a + 8);
      in_registers(odd, even);
      for (int o = 0; o < O; ++o) acc[r][o] = dot_half<F>(acc[r][o], odd, even, b[o].odd, b[o].even);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc_s[r][o0 + o] = acc[r][o];
}

// R rows × a group's 16 outputs → v[r][o] (level 1 of the tree done: lanes 0-7 + lanes 8-15), k in blocks of
// AVX2_K_BLOCK: each half of every output over one block before the next block, so the rows' x of a block stays in
// L1 for all 16 (4 rows of K = 2,816 are 44 KB, more than L1), the sums carried from block to block
template <int R, int O, typename W, bool F>
void avx2_rows_group(const float* xs, int64_t stride, const W* wg, int64_t K, __m256 (*v)[GROUP], bool fetch,
                     const W* next = nullptr) {  // next: the group read next, over streamed weights (else null)
  __m256 lo[R][GROUP], hi[R][GROUP];
  constexpr int whole = GROUP / O * O;  // (outputs in blocks of O; what is left of 16 in one block after them)
  constexpr int passes = 2 * ((GROUP + O - 1) / O);  // a block of k's passes: the first fetches, the rest share next
  for (int64_t c0 = 0; c0 < K; c0 += AVX2_K_BLOCK) {
    const int64_t c1 = std::min(K, c0 + AVX2_K_BLOCK);
    int pass = 0;
    for (int half = 0; half < 2; ++half) {
      for (int o0 = 0; o0 < whole; o0 += O, ++pass)
        avx2_half_block<R, O, W, F>(xs, stride, wg, c0, c1, half ? hi : lo, o0, half, c0 == 0,
                                    fetch && pass == 0, pass > 0 ? next : nullptr, pass - 1, passes - 1);
      if constexpr (whole < GROUP) {
        avx2_half_block<R, GROUP - whole, W, F>(xs, stride, wg, c0, c1, half ? hi : lo, whole, half, c0 == 0, false,
                                                next, pass - 1, passes - 1);
        ++pass;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < GROUP; ++o) v[r][o] = _mm256_add_ps(lo[r][o], hi[r][o]);
}

// rows [m0, m1) (split: xs, split_rows) × outputs [n0, n1) over packed weights (a packed group's missing outputs
// are zeros: computed, not stored)
template <typename W, bool F = false>
void rows_avx2(const float* xs, const W* w, const float* scale, const float* bias, uint16_t* y, int64_t m0,
               int64_t m1, int64_t n0, int64_t n1, int64_t K, int64_t ys,  // ys: y's row stride
               const W* after = nullptr) {  // after: the group this thread likely reads next (null: none known)
  const int64_t stride = split_stride(K);
  const bool streamed = weights_streamed();  // one row over weights streamed from DRAM: a single pass a group
  // 2 to AVX2_STREAM_ROWS bf16 rows over streamed weights, or 2 to AVX2_PASS_ROWS int8 rows (one pass: 8 int8 rows as
  // 6 + 2 measured 0.90-1.01x the blocks), in single passes of up to AVX2_PASS_ROWS rows
  const int64_t most = sizeof(W) == 2 ? AVX2_STREAM_ROWS : AVX2_PASS_ROWS;
  const bool passes_streamed = streamed && m1 - m0 >= 2 &&
                               m1 - m0 <= std::min(most, streamed_rows_limit.load(std::memory_order_relaxed));
  __m256 v[AVX2_PASS_ROWS][GROUP];
  for (int64_t g = n0; g < n1; g += GROUP) {
    const int64_t outputs = std::min(GROUP, n1 - g);
    const W* wg = w + packed_group(g, K);
    // the group read next (this call's, else the next task's): one int8 row's later passes over cached weights read it
    // meanwhile — bf16's are too short to hide a read behind (measured 0.95-1.06x with it, int8 1.02-1.37x;
    // docs/engine.md) —, and so do several rows' over streamed weights
    const W* following = g + GROUP < n1 ? w + packed_group(g + GROUP, K) : after;
    // the group's scales and biases, each filled only where given (a bf16 projection has neither; zero-filling both
    // was a `rep stos` each a group — 10% of a one-row call's perf samples, mostly skid: measured, ≤ 5% of a call)
    alignas(32) float sc[GROUP], bi[GROUP];
    if (scale)
      for (int64_t o = 0; o < GROUP; ++o) sc[o] = o < outputs ? scale[g + o] : 0.0f;
    if (bias)
      for (int64_t o = 0; o < GROUP; ++o) bi[o] = o < outputs ? bias[g + o] : 0.0f;
    for (int64_t m = m0; m < m1;) {
      const int64_t rows = std::min<int64_t>(m1 - m, passes_streamed ? AVX2_PASS_ROWS : AVX2_ROWS);
      const float* xm = xs + m * stride;
      const bool fetch = m == m0;
      if (passes_streamed || (streamed && rows == 1)) {  // (a first pass streams the group, a second reads it from L2)
        switch (rows) {
          case 1: avx2_rows_streamed<1, W, F>(xm, stride, wg, K, v); break;
          case 2: avx2_rows_streamed<2, W, F>(xm, stride, wg, K, v); break;
          case 3: avx2_rows_streamed<3, W, F>(xm, stride, wg, K, v); break;
          case 4: avx2_rows_streamed<4, W, F>(xm, stride, wg, K, v); break;
          case 5: avx2_rows_streamed<5, W, F>(xm, stride, wg, K, v); break;
          default: avx2_rows_streamed<6, W, F>(xm, stride, wg, K, v);
        }
      } else if (rows == 1) {
        avx2_row_passes<W, F>(xm, wg, K, v, fetch, sizeof(W) == 1 ? following : nullptr);
      } else {  // several rows: a half at a time (2 rows × 3 outputs and 3 × 2 measured best for 2 and 3; int8 since
        // its half widens in 4 operations: 1.16-1.40x at 4 int8 rows, 1.00-1.14x at 8). Over streamed weights the
        // first block of rows reads the next group meanwhile: its later passes compute from the cache, DRAM
        // otherwise idle
        const W* ahead = streamed && fetch ? following : nullptr;
        switch (rows) {
          case 4: avx2_rows_group<4, 2, W, F>(xm, stride, wg, K, v, fetch, ahead); break;
          case 3: avx2_rows_group<3, 2, W, F>(xm, stride, wg, K, v, fetch, ahead); break;
          default: avx2_rows_group<2, 3, W, F>(xm, stride, wg, K, v, fetch, ahead);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int h = 0; h < 2 && 8 * h < outputs; ++h) {
          __m256 s = tree8(v[r] + 8 * h);
          if (scale) s = _mm256_mul_ps(s, _mm256_load_ps(sc + 8 * h));
          if (bias) s = _mm256_add_ps(s, _mm256_load_ps(bi + 8 * h));
          const __m128i out = to_bf16(s);
          uint16_t* yp = y + (m + r) * ys + g + 8 * h;
          if (outputs - 8 * h >= 8) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(yp), out);
          } else {
            alignas(16) uint16_t tail[8];
            _mm_store_si128(reinterpret_cast<__m128i*>(tail), out);
            std::memcpy(yp, tail, static_cast<size_t>(outputs - 8 * h) * sizeof(uint16_t));
          }
        }
      m += rows;
    }
  }
}
#endif

}  // namespace
