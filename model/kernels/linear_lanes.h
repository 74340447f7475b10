// invariant_linear.cpp's AVX512 lanes forms (AVX512-BF16's VDPBF16PS, or its arithmetic in plain AVX512
// instructions): register blocks of rows × outputs over (N, K) or packed weights, the scalar form's bits.
#pragma once

#include "linear_scalar.h"

#include <algorithm>
#include <chrono>

#ifdef LINSERVE_LANES
#include <immintrin.h>
#endif

namespace {

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

inline __m512 odd_of(__m512i pairs) {  // each 32-bit lane's high bf16 as fp32 (exact)
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline __m512 even_of(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }  // the low one

#ifdef LINSERVE_AVX512BF16
using WeightChunk = __m512i;  // 32 bf16, as VDPBF16PS takes them

inline __m256i to_bf16(__m512 s) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(s)); }

inline WeightChunk load_w(const uint16_t* p, int64_t left) { return load_x(p, left); }

// 32 int8 widened exactly to bf16 (every int8 is one). A one-row pass over cached int8 weights is bound by this
// widening: 7-11 G weights a second a core from L2 through fp32 (an Intel Xeon, model 207). With AVX512-FP16
// (`fp16_widening`): int16 → fp16 in one instruction (exact), then each fp16's bits rebiased to bf16's — an int8's
// fp16 has its mantissa's low 3 bits zero, so bf16 = sign | (magnitude >> 3) + (127 - 15) << 7, zero kept zero by
// the mask: 14-15 G weights a second in a stand-alone loop (1.26-1.35x), one row over cached weights 1.2-1.8x in the
// kernel (docs/benchmarks.md), the same bf16 values
inline WeightChunk load_w(const int8_t* p, int64_t left) {
#ifdef __AVX512FP16__
  const __m512i words = _mm512_cvtepi8_epi16(load_bytes(p, left));  // (32,) int16
  const __m512i halves = _mm512_castph_si512(_mm512_cvtepi16_ph(words));  // (32,) fp16 bits
  const __m512i sign_magnitude =  // sign at bit 15, the magnitude's bits >> 3 below (bits 12-14 cleared)
      _mm512_and_si512(_mm512_srai_epi16(halves, 3), _mm512_set1_epi16(static_cast<int16_t>(0x8fff)));
  return _mm512_maskz_add_epi16(_mm512_test_epi16_mask(words, words), sign_magnitude, _mm512_set1_epi16(0x3800));
#else
  const __m256i bytes = load_bytes(p, left);
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));  // k 0..15
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));  // k 16..31
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
#endif
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
  static int64_t at(int o, int64_t c, int64_t) { return packed_at(o, c); }
  static int64_t group(int64_t g, int64_t K) { return packed_group(g, K); }
  template <int R>
  static constexpr int quads() { return R == 1 ? 4 : (R == 2 ? 2 : 1); }  // as many outputs as registers allow
};

// A later pass's share of the packed group read next, fetched chunk by chunk as the pass goes (fetch_share; group:
// null where there is none to read)
template <typename W>
struct NextGroup {
  const W* group = nullptr;
  int share = 0, shares = 1;
};

template <typename W>
inline NextGroup<W> no_group() { return {}; }

// one 32-wide chunk at k = c (`left` of K from there: the tail reads zeros past it) into R rows × O outputs
template <int R, int O, typename W, typename L, bool F>
__attribute__((always_inline)) inline void dot_chunks(__m512 (&acc)[R][O], const uint16_t* x, const W* w, int64_t K,
                                                      int64_t c, int64_t left, bool fetch, const NextGroup<W>& next) {
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
  if (next.group != nullptr) fetch_share(next.group, c, next.share, next.shares);
  for (int o = 0; o < O; ++o) {
    const WeightChunk b = load_w(w + L::at(o, c, K), left);
    for (int r = 0; r < R; ++r) acc[r][o] = dot_chunk<F>(acc[r][o], a[r], b);
  }
}

// R rows × O outputs over all of K: the full chunks unmasked (CHUNK, a constant), the tail masked once (inlined:
// the accumulators stay in registers)
template <int R, int O, typename W, typename L, bool F = false>
__attribute__((always_inline)) inline void dot_rows(__m512 (&acc)[R][O], const uint16_t* x, const W* w, int64_t K,
                                                    bool fetch = false, const NextGroup<W>& next = NextGroup<W>{}) {
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm512_setzero_ps();
  const int64_t full = K - K % CHUNK;
  for (int64_t c = 0; c < full; c += CHUNK) dot_chunks<R, O, W, L, F>(acc, x, w, K, c, CHUNK, fetch, next);
  if (full < K) dot_chunks<R, O, W, L, F>(acc, x, w, K, full, K - full, false, next);
}

// R rows × 4Q outputs: each row's quads of lanes reduced by the tree's first two levels into u[r][q0 + q]
template <int R, int Q, typename W, typename L, bool F>
void block_quads(const Tree& tree, const uint16_t* x, const W* w, int64_t K, __m512 (*u)[4], int q0, bool fetch,
                 const NextGroup<W>& next) {
  __m512 acc[R][4 * Q];
  dot_rows<R, 4 * Q, W, L, F>(acc, x, w, K, fetch, next);
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
                        bool fetch, const NextGroup<W>& next = NextGroup<W>{}) {  // next: the first block reads it
  constexpr int Q = L::template quads<R>();
  const int quads = static_cast<int>(outputs / 4);
  int q = 0;
  for (; q + Q <= quads; q += Q)
    block_quads<R, Q, W, L, F>(tree, x, wg + L::at(4 * q, 0, K), K, u, q, fetch && q == 0,
                               q == 0 ? next : no_group<W>());
  for (; q < quads; ++q)
    block_quads<R, 1, W, L, F>(tree, x, wg + L::at(4 * q, 0, K), K, u, q, fetch && q == 0,
                               q == 0 ? next : no_group<W>());
  if (outputs % 4) {
    block_partial<R, W>(tree, x, wg + 4 * q * K, K, static_cast<int>(outputs % 4), u, q);
    ++q;
  }
  for (; q < 4; ++q)
    for (int r = 0; r < R; ++r) u[r][q] = _mm512_setzero_ps();
}

#ifdef LINSERVE_AVX512BF16
// ------------------------------------------------------------------------------------------ fused rows (AVX512-BF16)
// Where VDPBF16PS issues at a fraction of the FMA's rate (the Intel Xeons without AMX measured here: 0.5 a cycle
// against 2), several rows over packed bf16 weights go faster as the plain form's fused steps: each chunk's bf16
// pairs split into fp32 once (x once a call, `split_rows`; a weight chunk once for the block's four rows), then a
// fused multiply-add for the odd and the even pair — VDPBF16PS's bits wherever every product is exact and normal
// (`in_fused_range`, checked per call; packed_weights.h), the same lanes and the same tree. Four rows × four outputs
// a pass: 16 sums, 8 of x and 2 of the weight chunk in registers (60 against 43 G multiply-adds a second on one core
// of the 2-vCPU Xeon, weights cached; 6 × 4 and 8 × 2, with x read from memory, were slower; a long K in blocks). `fused_rows_pay`
// times both at load.
constexpr int64_t FUSED_ROWS = 4;

inline int64_t split_stride(int64_t K) { return (K + CHUNK - 1) / CHUNK * CHUNK; }  // floats a row

// x split once a call: each row's 32-wide chunks as fp32 [odd 16 | even 16] (lane j: element 2j + 1, element 2j;
// zeros past K, as the packed weights' tail)
inline void split_rows(const uint16_t* x, int64_t M, int64_t K, float* xs) {
  const int64_t stride = split_stride(K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < K; c += CHUNK) {
      const __m512i pairs = load_x(x + m * K + c, K - c);
      _mm512_store_ps(xs + m * stride + c, odd_of(pairs));
      _mm512_store_ps(xs + m * stride + c + 16, even_of(pairs));
    }
}

inline void in_registers(__m512& a, __m512& b) { asm volatile("" : "+v"(a), "+v"(b)); }  // (not folded into loads)

// FUSED_ROWS rows (split: xs, `stride` floats a row) × the quad q of a packed bf16 group over k in [k0, k1) (whole
// chunks), its 16 sums carried in `acc`. fetch: the group's first pass brings each chunk's whole block into L1 ahead
__attribute__((always_inline)) inline void fused_quad(__m512 (&acc)[FUSED_ROWS][4], const float* xs, int64_t stride,
                                                      const uint16_t* wg, int64_t k0, int64_t k1, int q, bool fetch,
                                                      const NextGroup<uint16_t>& next) {
  for (int64_t c = k0; c < k1; c += CHUNK) {  // (the last chunk's tail: zeros in both)
    if (fetch) {
      const char* ahead = reinterpret_cast<const char*>(wg + packed_at(0, c + FETCH_AHEAD * CHUNK));
      for (int64_t line = 0; line < GROUP * CHUNK * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    if (next.group != nullptr) fetch_share(next.group, c, next.share, next.shares);
    __m512 odd[FUSED_ROWS], even[FUSED_ROWS];
    for (int r = 0; r < FUSED_ROWS; ++r) {
      odd[r] = _mm512_load_ps(xs + r * stride + c);
      even[r] = _mm512_load_ps(xs + r * stride + c + 16);
      in_registers(odd[r], even[r]);
    }
    for (int o = 0; o < 4; ++o) {
      const __m512i pairs = _mm512_loadu_si512(wg + packed_at(4 * q + o, c));
      const __m512 w_odd = odd_of(pairs), w_even = even_of(pairs);
      for (int r = 0; r < FUSED_ROWS; ++r)  // VDPBF16PS's order: the odd pair's product, then the even one's
        acc[r][o] = _mm512_fmadd_ps(even[r], w_even, _mm512_fmadd_ps(odd[r], w_odd, acc[r][o]));
    }
  }
}

// FUSED_ROWS rows × a packed bf16 group's 16 outputs over all of K → u[r][q] (the tree's first two levels): K in
// blocks (all of it up to 2 × FUSED_K_BLOCK, else FUSED_K_BLOCK at a time), a quad at a time within a block, every
// quad's sums kept between blocks — so the rows' split x of a block (4 × 512 × 4 B = 8 KB) stays in L1 for the four
// quads (K = 2,816 in one pass, when the split took 8 B an element: 90 KB from L2, 49 against 57 G multiply-adds a
// second on one core of the Xeon; 45 KB now, still most of its 48 KB L1). Each lane's chunks in order: the same bits
constexpr int64_t FUSED_K_BLOCK = 512;

inline void fused_group(const Tree& tree, const float* xs, int64_t stride, const uint16_t* wg, int64_t K,
                        __m512 (*u)[4], bool fetch, const NextGroup<uint16_t>& next) {  // next: a block's 1st quad
  const int64_t block = K <= 2 * FUSED_K_BLOCK ? K : FUSED_K_BLOCK;
  __m512 sums[4][FUSED_ROWS][4];  // (each quad's, between blocks: 4 KB)
  for (int q = 0; q < 4; ++q)
    for (int r = 0; r < FUSED_ROWS; ++r)
      for (int o = 0; o < 4; ++o) sums[q][r][o] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += block)
    for (int q = 0; q < 4; ++q) {
      __m512 acc[FUSED_ROWS][4];
      for (int r = 0; r < FUSED_ROWS; ++r)
        for (int o = 0; o < 4; ++o) acc[r][o] = sums[q][r][o];
      fused_quad(acc, xs, stride, wg, k0, std::min(K, k0 + block), q, fetch && q == 0,
                 q == 0 ? next : no_group<uint16_t>());
      for (int r = 0; r < FUSED_ROWS; ++r)
        for (int o = 0; o < 4; ++o) sums[q][r][o] = acc[r][o];
    }
  for (int q = 0; q < 4; ++q)
    for (int r = 0; r < FUSED_ROWS; ++r) u[r][q] = tree.quad(sums[q][r][0], sums[q][r][1], sums[q][r][2], sums[q][r][3]);
}
#endif

// A streamed call of at most STREAM_BLOCK_ROWS rows goes over each packed group STREAM_K_BLOCK of K at a time: the
// first row streams the block's 16 outputs (one contiguous read, as at one row), the other rows' passes compute the
// same block from L1 while each brings its share of the next group into L2, then the next block — so the read and the
// arithmetic overlap block by block instead of group by group. 340M's projections on Zen 4, a step's, 2 threads: 8
// rows 28.1 -> 21.4 ms (one row's 19.7: 1.08x), 12 rows 35.3 -> 27.7, 16 rows 42.0 -> 36.7 (512 a block: 8 rows
// 21-24 ms, 128: 23-25; without the next group's shares 37-39). Each lane's chunks in order: the same bits
constexpr int64_t STREAM_K_BLOCK = 256;
constexpr int64_t STREAM_BLOCK_ROWS = 16;  // their sums (16 KB), a block of weights (8 KB) and of x (8 KB) in L1

// R rows × O outputs from o0 of a packed group over K's block [k0, k1), the sums carried in `sums` (a row's GROUP)
template <int R, int O, typename W, typename L, bool F>
__attribute__((always_inline)) inline void streamed_span(__m512 (*sums)[GROUP], int o0, const uint16_t* x,
                                                         const W* wg, int64_t K, int64_t k0, int64_t k1,
                                                         const NextGroup<W>& next) {
  __m512 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = sums[r][o0 + o];
  const W* wo = wg + L::at(o0, 0, K);
  for (int64_t c = k0; c < k1; c += CHUNK) dot_chunks<R, O, W, L, F>(acc, x, wo, K, c, K - c, false, next);
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) sums[r][o0 + o] = acc[r][o];
}

// R rows from o0 = 0 over a whole group's outputs, O at a time (the first span asks for the pass's share of `next`)
template <int R, int O, typename W, typename L, bool F>
inline void streamed_pass(__m512 (*sums)[GROUP], const uint16_t* x, const W* wg, int64_t K, int64_t k0, int64_t k1,
                          const NextGroup<W>& next) {
  for (int o = 0; o < GROUP; o += O)
    streamed_span<R, O, W, L, F>(sums, o, x, wg, K, k0, k1, o == 0 ? next : no_group<W>());
}

template <typename W, typename L, bool F = false>
void rows_avx512(const uint16_t* x, const W* w, const float* scale, const float* bias, uint16_t* y, int64_t m0,
                 int64_t m1, int64_t n0, int64_t n1, int64_t K, int64_t ys,  // ys: y's row stride
                 const W* after = nullptr,  // after: the group this thread likely reads next (null: none known)
                 const float* xs = nullptr) {  // x split (AVX512-BF16, F: rows FUSED_ROWS at a time fused), else null
  constexpr bool packed = std::is_same<L, Packed>::value;
  // packed bf16: rows two at a time over 8 outputs a pass while those outputs' chunks stay in L1 (faster than 6
  // rows × 4 outputs at 8-512 rows for K ≤ 1024 on Zen 5; at K = 2816 much slower, and int8's widening wants
  // the 6 rows); otherwise 6 rows × 4 outputs a pass
  const bool pairs = packed && sizeof(W) == 2 && 8 * K * static_cast<int64_t>(sizeof(W)) <= PAIR_BYTES;
  // packed bf16 streamed from DRAM, at most streamed_rows_limit rows (a decode batch, a verification, a short
  // chunk): the first row alone over each group's 16 outputs — the weights one contiguous stream, as at one row — and the other
  // rows in the blocked passes, reading the group from L1/L2 while each pass brings its share of the group read next
  // (this call's, else the next task's) into L2 (340M's projections on Zen 4, a step's: 8 rows 0.87x the time of
  // every row alone, 12-32 rows 0.77-0.86x the blocked forms'; cached weights and int8 keep the blocked forms)
  const bool stream_first = packed && sizeof(W) == 2 &&
                            m1 - m0 <= streamed_rows_limit.load(std::memory_order_relaxed) && weights_streamed();
#ifdef LINSERVE_AVX512BF16
  const bool fused_rows = F && packed && sizeof(W) == 2 && xs != nullptr;
#else
  constexpr bool fused_rows = false;
#endif
  auto pass_rows = [&](int64_t m) -> int64_t {  // the rows of the pass that starts at row m
    const int64_t left = m1 - m;
    if (stream_first && m == m0) return 1;
    if (fused_rows && left >= 4) return 4;  // (FUSED_ROWS)
    if (pairs) return left >= 2 ? 2 : 1;
    return left >= 6 ? 6 : (left >= 4 ? 4 : (left >= 2 ? 2 : 1));
  };
  const bool in_k_blocks = stream_first && !fused_rows && m1 - m0 >= 2 && m1 - m0 <= STREAM_BLOCK_ROWS;
  int later_passes = 0;  // the passes after the streaming row's: each fetches 1/later_passes of the next group
  if (stream_first)
    for (int64_t m = m0 + 1; m < m1; m += pass_rows(m)) ++later_passes;
  const Tree tree;
  __m512 u[6][4];
  for (int64_t g = n0; g < n1; g += GROUP) {
    const int64_t outputs = std::min(GROUP, n1 - g);
    const int64_t computed = packed ? GROUP : outputs;  // packed: a short group's missing rows are zeros
    const W* wg = w + L::group(g, K);
    const W* following = g + GROUP < n1 ? w + L::group(g + GROUP, K) : after;
    const __mmask16 keep = static_cast<__mmask16>((1u << outputs) - 1);
    const __m512 sc = scale ? _mm512_maskz_loadu_ps(keep, scale + g) : _mm512_setzero_ps();
    const __m512 bi = bias ? _mm512_maskz_loadu_ps(keep, bias + g) : _mm512_setzero_ps();
    auto write_row = [&](int64_t m, __m512 s) {  // row m's 16 sums → scaled, biased, its bf16 outputs
      if (scale) s = _mm512_mul_ps(s, sc);
      if (bias) s = _mm512_add_ps(s, bi);
      _mm256_mask_storeu_epi16(y + m * ys + g, keep, to_bf16(s));
    };
    if (in_k_blocks) {
      alignas(64) __m512 sums[STREAM_BLOCK_ROWS][GROUP];
      for (int64_t r = 0; r < m1 - m0; ++r)
        for (int o = 0; o < GROUP; ++o) sums[r][o] = _mm512_setzero_ps();
      for (int64_t k0 = 0; k0 < K; k0 += STREAM_K_BLOCK) {
        const int64_t k1 = std::min(K, k0 + STREAM_K_BLOCK);
        streamed_pass<1, GROUP, W, L, F>(sums, x + m0 * K, wg, K, k0, k1, no_group<W>());  // (the stream)
        int later = 0;
        for (int64_t m = m0 + 1; m < m1;) {
          const int64_t rows = pass_rows(m);
          const uint16_t* xm = x + m * K;
          __m512(*rows_sums)[GROUP] = sums + (m - m0);
          const NextGroup<W> next = following != nullptr ? NextGroup<W>{following, later++, later_passes}
                                                         : no_group<W>();
          switch (rows) {
            case 6: streamed_pass<6, 4, W, L, F>(rows_sums, xm, wg, K, k0, k1, next); break;
            case 4: streamed_pass<4, 4, W, L, F>(rows_sums, xm, wg, K, k0, k1, next); break;
            case 2:
              if (pairs) streamed_pass<2, 8, W, L, F>(rows_sums, xm, wg, K, k0, k1, next);
              else streamed_pass<2, 4, W, L, F>(rows_sums, xm, wg, K, k0, k1, next);
              break;
            default: streamed_pass<1, GROUP, W, L, F>(rows_sums, xm, wg, K, k0, k1, next);
          }
          m += rows;
        }
      }
      for (int64_t r = 0; r < m1 - m0; ++r) {
        __m512 quads[4];
        for (int q = 0; q < 4; ++q)
          quads[q] = tree.quad(sums[r][4 * q], sums[r][4 * q + 1], sums[r][4 * q + 2], sums[r][4 * q + 3]);
        write_row(m0 + r, tree.last(quads));
      }
      continue;
    }
    int later = 0;
    for (int64_t m = m0; m < m1;) {
      const int64_t rows = pass_rows(m);
      const uint16_t* xm = x + m * K;
      const NextGroup<W> next = stream_first && m > m0 && following != nullptr
                                    ? NextGroup<W>{following, later++, later_passes} : no_group<W>();
      bool blocked = false;  // (the fused rows' block computed u)
#ifdef LINSERVE_AVX512BF16
      if constexpr (std::is_same<W, uint16_t>::value) {
        if (fused_rows && rows == FUSED_ROWS) {
          const int64_t stride = split_stride(K);
          fused_group(tree, xs + m * stride, stride, wg, K, u, m == m0, next);
          blocked = true;
        }
      }
#endif
      if (!blocked) switch (rows) {
        case 6: group_quads<6, W, L, F>(tree, xm, wg, K, computed, u, m == m0, next); break;
        case 4: group_quads<4, W, L, F>(tree, xm, wg, K, computed, u, m == m0, next); break;
        case 2: group_quads<2, W, L, F>(tree, xm, wg, K, computed, u, m == m0, next); break;
        default: group_quads<1, W, L, F>(tree, xm, wg, K, computed, u, m == m0, next);
      }
      for (int64_t r = 0; r < rows; ++r) write_row(m + r, tree.last(u[r]));
      m += rows;
    }
  }
}
#endif

#ifdef LINSERVE_AVX512BF16
// Whether the fused rows beat VDPBF16PS on this CPU: four rows × one group over K = 512 (weights and x in L1),
// each way 40 times, the fastest of each compared (~0.1 ms once, at load). Which way a call goes changes no bit.
inline bool fused_rows_pay() {
  constexpr int64_t K = 512;
  alignas(64) static uint16_t x[FUSED_ROWS * K], w[GROUP * K], y[FUSED_ROWS * GROUP];
  alignas(64) static float xs[FUSED_ROWS * K];
  for (int64_t i = 0; i < FUSED_ROWS * K; ++i) x[i] = static_cast<uint16_t>(0x3f80 + (i * 37) % 127);
  for (int64_t i = 0; i < GROUP * K; ++i) w[i] = static_cast<uint16_t>(0x3c00 + (i * 53) % 255);
  split_rows(x, FUSED_ROWS, K, xs);
  auto fastest = [&](bool fused) {
    double best = 1e30;
    for (int rep = 0; rep < 40; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      if (fused)
        rows_avx512<uint16_t, Packed, true>(x, w, nullptr, nullptr, y, 0, FUSED_ROWS, 0, GROUP, K, GROUP, nullptr, xs);
      else
        rows_avx512<uint16_t, Packed>(x, w, nullptr, nullptr, y, 0, FUSED_ROWS, 0, GROUP, K, GROUP);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return best;
  };
  fastest(true), fastest(false);  // (warm)
  return fastest(true) * 1.1 < fastest(false);
}
#endif

}  // namespace
