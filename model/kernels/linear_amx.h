// invariant_linear.cpp's AMX form: packed B tiles, each output accumulated in a C tile over K in order.
#pragma once

#include <ATen/Parallel.h>

#include "flush_subnormals.h"
#include "work_pool.h"
#include "linear_lanes.h"  // (its loads and its rounding to bf16)

#ifdef LINSERVE_AMX
#include <immintrin.h>
#endif

namespace {

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
  linserve::parallel_for(0, first[parts.count], 1, [&](int64_t begin, int64_t end) {
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

}  // namespace
