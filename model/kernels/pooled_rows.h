// pooled_state.cpp's row arithmetic: one key row's read (q ⊙ (S·α + k ⊗ v)), the reads that fold the tree of
// halves' first one or three levels into making the rows (read_rows_halved, read_rows_eighthed), the same with a
// slot's pending update applied as it is read (read_rows_pending) or with the new state stored (stored_rows_eighthed:
// the scans), and the commit's update of one column block (update_block). The ops, their checks and the
// passes over rows and blocks stay in pooled_state.cpp (the scan's in delta_rule.cpp).
#pragma once

#include "recurrence_blocks.h"

#include <algorithm>
#include <cstdint>

namespace {

// the factor of key dimension i, or none (alpha: per key dimension, or one per head with `per_head`)
inline const float* factor(const float* alpha, bool per_head, int64_t i) {
  return alpha ? (per_head ? alpha : alpha + i) : nullptr;
}

// q_i ⊙ (S_i·α_i + k_i ⊗ v) of key row i, element c (linear_block's arithmetic, the state not stored)
struct ReadRow {
  const float* s;
  float qi, ki, ai;
  bool scaled;
  float at(const float* v, int64_t c) const {
    const float s1 = scaled ? s[c] * ai : s[c], outer = ki * v[c];
    return qi * (s1 + outer);
  }
};

inline ReadRow read_row(const float* q, const float* k, const float* alpha, bool per_head, const float* S,
                        int64_t dv, int64_t i) {
  const float* a = factor(alpha, per_head, i);
  return {S + i * dv, q[i], k[i], a ? *a : 1.0f, a != nullptr};
}

// q ⊙ (S·α + k ⊗ v) for one column block, with the tree of halves' first level done as the rows are made: buf's
// row i = row i + row i + ⌊d_k/2⌋ (an odd d_k's last row moves to row ⌊d_k/2⌋, as `tree` moves it) — the same
// additions in the same order, so the same bits, with half the scratch written and read back (1.4-1.7x faster
// on 340M's shapes, one row). Returns the rows left for `tree`.
inline int64_t read_rows_halved(const float* q, const float* k, const float* v, const float* alpha, bool per_head,
                                const float* S, int64_t dk, int64_t dv, int64_t w, float* buf) {
  const int64_t h = dk / 2;
  for (int64_t i = 0; i < h; ++i) {
    const ReadRow a = read_row(q, k, alpha, per_head, S, dv, i), b = read_row(q, k, alpha, per_head, S, dv, i + h);
    float* __restrict row = buf + i * w;
    if (alpha) {  // (both cases written out: the compiler vectorizes each)
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) {
        const float x = a.qi * (a.s[c] * a.ai + a.ki * v[c]), y = b.qi * (b.s[c] * b.ai + b.ki * v[c]);
        row[c] = x + y;
      }
    } else {
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) {
        const float x = a.qi * (a.s[c] + a.ki * v[c]), y = b.qi * (b.s[c] + b.ki * v[c]);
        row[c] = x + y;
      }
    }
  }
  if (dk % 2) {
    const ReadRow a = read_row(q, k, alpha, per_head, S, dv, dk - 1);
    float* __restrict row = buf + h * w;
    for (int64_t c = 0; c < w; ++c) row[c] = a.at(v, c);
  }
  return h + dk % 2;
}

// s0 … s7: the state rows j[0] … j[7] of one column block, each its own restrict pointer (so the loops over the
// block's columns vectorize)
#define EIGHT_STATE_ROWS(T, S, j, dv)                                                                  \
  T* __restrict s0 = (S) + (j)[0] * (dv);                                                              \
  T* __restrict s1 = (S) + (j)[1] * (dv);                                                              \
  T* __restrict s2 = (S) + (j)[2] * (dv);                                                              \
  T* __restrict s3 = (S) + (j)[3] * (dv);                                                              \
  T* __restrict s4 = (S) + (j)[4] * (dv);                                                              \
  T* __restrict s5 = (S) + (j)[5] * (dv);                                                              \
  T* __restrict s6 = (S) + (j)[6] * (dv);                                                              \
  T* __restrict s7 = (S) + (j)[7] * (dv)

// the key rows one output row of three folded levels reads, in the tree's order: i, i + d_k/2, i + d_k/4,
// i + 3d_k/4, then the same four from i + d_k/8 — level 1 sums each pair, level 2 each two pairs, level 3 the two
inline void eight_rows(int64_t i, int64_t dk, int64_t (&j)[8]) {
  const int64_t h = dk / 2, f = dk / 4, e = dk / 8;
  const int64_t first[8] = {i, i + h, i + f, i + f + h, i + e, i + e + h, i + e + f, i + e + f + h};
  std::copy(first, first + 8, j);
}

// the same with the tree's first three levels done as the rows are made, for a d_k that 8 divides: an eighth of the
// scratch written, those levels never read back (each row's eight products spelled out: a recursive template over
// a lambda was not vectorized)
inline int64_t read_rows_eighthed(const float* q, const float* k, const float* v, const float* alpha, bool per_head,
                                  const float* S, int64_t dk, int64_t dv, int64_t w, float* buf) {
  for (int64_t i = 0; i < dk / 8; ++i) {
    int64_t j[8];
    eight_rows(i, dk, j);
    const ReadRow r0 = read_row(q, k, alpha, per_head, S, dv, j[0]), r1 = read_row(q, k, alpha, per_head, S, dv, j[1]);
    const ReadRow r2 = read_row(q, k, alpha, per_head, S, dv, j[2]), r3 = read_row(q, k, alpha, per_head, S, dv, j[3]);
    const ReadRow r4 = read_row(q, k, alpha, per_head, S, dv, j[4]), r5 = read_row(q, k, alpha, per_head, S, dv, j[5]);
    const ReadRow r6 = read_row(q, k, alpha, per_head, S, dv, j[6]), r7 = read_row(q, k, alpha, per_head, S, dv, j[7]);
    float* __restrict row = buf + i * w;
    if (alpha) {
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) {
        const float x0 = r0.qi * (r0.s[c] * r0.ai + r0.ki * v[c]), x1 = r1.qi * (r1.s[c] * r1.ai + r1.ki * v[c]);
        const float x2 = r2.qi * (r2.s[c] * r2.ai + r2.ki * v[c]), x3 = r3.qi * (r3.s[c] * r3.ai + r3.ki * v[c]);
        const float x4 = r4.qi * (r4.s[c] * r4.ai + r4.ki * v[c]), x5 = r5.qi * (r5.s[c] * r5.ai + r5.ki * v[c]);
        const float x6 = r6.qi * (r6.s[c] * r6.ai + r6.ki * v[c]), x7 = r7.qi * (r7.s[c] * r7.ai + r7.ki * v[c]);
        row[c] = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7));
      }
    } else {
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) {
        const float x0 = r0.qi * (r0.s[c] + r0.ki * v[c]), x1 = r1.qi * (r1.s[c] + r1.ki * v[c]);
        const float x2 = r2.qi * (r2.s[c] + r2.ki * v[c]), x3 = r3.qi * (r3.s[c] + r3.ki * v[c]);
        const float x4 = r4.qi * (r4.s[c] + r4.ki * v[c]), x5 = r5.qi * (r5.s[c] + r5.ki * v[c]);
        const float x6 = r6.qi * (r6.s[c] + r6.ki * v[c]), x7 = r7.qi * (r7.s[c] + r7.ki * v[c]);
        row[c] = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7));
      }
    }
  }
  return dk / 8;
}

// S ← S·α + k ⊗ v, stored, and q ⊙ S for one column block (α per key dimension, one per head with `per_head`, or
// none), the tree's first three levels done as the rows are made (d_k that 8 divides): a scan's token —
// read_rows_eighthed's arithmetic with the new state written back, so the bits are the scans' (delta_rule.cpp:
// block_step's second half with v = u, linear_block)
inline int64_t stored_rows_eighthed(const float* q, const float* k, const float* v, const float* alpha, bool per_head,
                                    float* S, int64_t dk, int64_t dv, int64_t w, float* buf) {
  for (int64_t i = 0; i < dk / 8; ++i) {
    int64_t j[8];
    eight_rows(i, dk, j);
    EIGHT_STATE_ROWS(float, S, j, dv);
    float qr[8], kr[8], ar[8];
    for (int r = 0; r < 8; ++r) {
      const float* f = factor(alpha, per_head, j[r]);
      qr[r] = q[j[r]], kr[r] = k[j[r]], ar[r] = f ? *f : 1.0f;
    }
    const float q0 = qr[0], q1 = qr[1], q2 = qr[2], q3 = qr[3], q4 = qr[4], q5 = qr[5], q6 = qr[6], q7 = qr[7];
    const float k0 = kr[0], k1 = kr[1], k2 = kr[2], k3 = kr[3], k4 = kr[4], k5 = kr[5], k6 = kr[6], k7 = kr[7];
    const float a0 = ar[0], a1 = ar[1], a2 = ar[2], a3 = ar[3], a4 = ar[4], a5 = ar[5], a6 = ar[6], a7 = ar[7];
    float* __restrict row = buf + i * w;
    if (alpha) {
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) {
        const float vc = v[c];
        const float t0 = s0[c] * a0 + k0 * vc, t1 = s1[c] * a1 + k1 * vc, t2 = s2[c] * a2 + k2 * vc;
        const float t3 = s3[c] * a3 + k3 * vc, t4 = s4[c] * a4 + k4 * vc, t5 = s5[c] * a5 + k5 * vc;
        const float t6 = s6[c] * a6 + k6 * vc, t7 = s7[c] * a7 + k7 * vc;
        s0[c] = t0, s1[c] = t1, s2[c] = t2, s3[c] = t3, s4[c] = t4, s5[c] = t5, s6[c] = t6, s7[c] = t7;
        row[c] = ((q0 * t0 + q1 * t1) + (q2 * t2 + q3 * t3)) + ((q4 * t4 + q5 * t5) + (q6 * t6 + q7 * t7));
      }
    } else {
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) {
        const float vc = v[c];
        const float t0 = s0[c] + k0 * vc, t1 = s1[c] + k1 * vc, t2 = s2[c] + k2 * vc, t3 = s3[c] + k3 * vc;
        const float t4 = s4[c] + k4 * vc, t5 = s5[c] + k5 * vc, t6 = s6[c] + k6 * vc, t7 = s7[c] + k7 * vc;
        s0[c] = t0, s1[c] = t1, s2[c] = t2, s3[c] = t3, s4[c] = t4, s5[c] = t5, s6[c] = t6, s7[c] = t7;
        row[c] = ((q0 * t0 + q1 * t1) + (q2 * t2 + q3 * t3)) + ((q4 * t4 + q5 * t5) + (q6 * t6 + q7 * t7));
      }
    }
  }
  return dk / 8;
}

// q ⊙ (S·α + k ⊗ v) for one column block into buf: the tree's first three levels done as the rows are made where
// 8 divides d_k (64, 128 and 256 in the checkpoints served so far), else its first
inline int64_t read_rows(const float* q, const float* k, const float* v, const float* alpha, bool per_head,
                         const float* S, int64_t dk, int64_t dv, int64_t w, float* buf) {
  return dk % 8 == 0 && dk >= 8 ? read_rows_eighthed(q, k, v, alpha, per_head, S, dk, dv, w, buf)
                                : read_rows_halved(q, k, v, alpha, per_head, S, dk, dv, w, buf);
}

// k ⊙ S·α for one column block into buf (the delta rule's prediction S_{t-1}ᵀk, before its tree), the tree's first
// level — or, for a d_k that 8 divides, its first three — done as the rows are made (as read_rows does). Returns the
// rows left for `tree`.
inline int64_t predicted_rows(const float* kr, const float* alpha_bh, const float* S, int64_t dk, int64_t dv,
                              int64_t w, float* buf) {
  const float ai = alpha_bh ? *alpha_bh : 1.0f;
  if (dk % 8 == 0 && dk >= 8) {
    for (int64_t i = 0; i < dk / 8; ++i) {
      int64_t j[8];
      eight_rows(i, dk, j);
      EIGHT_STATE_ROWS(const float, S, j, dv);
      const float k0 = kr[j[0]], k1 = kr[j[1]], k2 = kr[j[2]], k3 = kr[j[3]];
      const float k4 = kr[j[4]], k5 = kr[j[5]], k6 = kr[j[6]], k7 = kr[j[7]];
      float* __restrict row = buf + i * w;
      if (alpha_bh) {
#pragma GCC ivdep
        for (int64_t c = 0; c < w; ++c)
          row[c] = ((k0 * (s0[c] * ai) + k1 * (s1[c] * ai)) + (k2 * (s2[c] * ai) + k3 * (s3[c] * ai))) +
                   ((k4 * (s4[c] * ai) + k5 * (s5[c] * ai)) + (k6 * (s6[c] * ai) + k7 * (s7[c] * ai)));
      } else {
#pragma GCC ivdep
        for (int64_t c = 0; c < w; ++c)
          row[c] = ((k0 * s0[c] + k1 * s1[c]) + (k2 * s2[c] + k3 * s3[c])) +
                   ((k4 * s4[c] + k5 * s5[c]) + (k6 * s6[c] + k7 * s7[c]));
      }
    }
    return dk / 8;
  }
  const int64_t half = dk / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float* __restrict s = S + i * dv;
    const float* __restrict t = S + (i + half) * dv;
    float* __restrict row = buf + i * w;
    const float ki = kr[i], kj = kr[i + half];
    if (alpha_bh) {
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) row[c] = ki * (s[c] * ai) + kj * (t[c] * ai);
    } else {
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) row[c] = ki * s[c] + kj * t[c];
    }
  }
  if (dk % 2) {
    const float* __restrict s = S + (dk - 1) * dv;
    float* __restrict row = buf + half * w;
    const float ki = kr[dk - 1];
    for (int64_t c = 0; c < w; ++c) row[c] = alpha_bh ? ki * (s[c] * ai) : ki * s[c];
  }
  return half + dk % 2;
}

// the prediction pass (predicted_rows, d_k that 8 divides) over a slot with a pending update recorded with the same
// gate as this read's (both with α or both without): each element made S·pa + pk ⊗ pu (state_commit's roundings;
// without: S + pk ⊗ pu), stored back, then read as predicted_rows does
inline int64_t predicted_rows_pending(const float* kr, const float* alpha_bh, float* S, int64_t dk, int64_t dv,
                                      int64_t w, float* buf, const float* pk, const float* pu, const float* pa) {
  const float ai = alpha_bh ? *alpha_bh : 1.0f, a_p = pa ? *pa : 1.0f;
  for (int64_t i = 0; i < dk / 8; ++i) {
    int64_t j[8];
    eight_rows(i, dk, j);
    EIGHT_STATE_ROWS(float, S, j, dv);
    const float k0 = kr[j[0]], k1 = kr[j[1]], k2 = kr[j[2]], k3 = kr[j[3]];
    const float k4 = kr[j[4]], k5 = kr[j[5]], k6 = kr[j[6]], k7 = kr[j[7]];
    const float p0 = pk[j[0]], p1 = pk[j[1]], p2 = pk[j[2]], p3 = pk[j[3]];
    const float p4 = pk[j[4]], p5 = pk[j[5]], p6 = pk[j[6]], p7 = pk[j[7]];
    float* __restrict row = buf + i * w;
    if (alpha_bh) {
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) {
        const float u = pu[c];
        const float t0 = s0[c] * a_p + p0 * u, t1 = s1[c] * a_p + p1 * u, t2 = s2[c] * a_p + p2 * u;
        const float t3 = s3[c] * a_p + p3 * u, t4 = s4[c] * a_p + p4 * u, t5 = s5[c] * a_p + p5 * u;
        const float t6 = s6[c] * a_p + p6 * u, t7 = s7[c] * a_p + p7 * u;
        s0[c] = t0, s1[c] = t1, s2[c] = t2, s3[c] = t3, s4[c] = t4, s5[c] = t5, s6[c] = t6, s7[c] = t7;
        row[c] = ((k0 * (t0 * ai) + k1 * (t1 * ai)) + (k2 * (t2 * ai) + k3 * (t3 * ai))) +
                 ((k4 * (t4 * ai) + k5 * (t5 * ai)) + (k6 * (t6 * ai) + k7 * (t7 * ai)));
      }
    } else {
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) {
        const float u = pu[c];
        const float t0 = s0[c] + p0 * u, t1 = s1[c] + p1 * u, t2 = s2[c] + p2 * u, t3 = s3[c] + p3 * u;
        const float t4 = s4[c] + p4 * u, t5 = s5[c] + p5 * u, t6 = s6[c] + p6 * u, t7 = s7[c] + p7 * u;
        s0[c] = t0, s1[c] = t1, s2[c] = t2, s3[c] = t3, s4[c] = t4, s5[c] = t5, s6[c] = t6, s7[c] = t7;
        row[c] = ((k0 * t0 + k1 * t1) + (k2 * t2 + k3 * t3)) + ((k4 * t4 + k5 * t5) + (k6 * t6 + k7 * t7));
      }
    }
  }
  return dk / 8;
}

// read_rows_eighthed over a slot with a pending update (pk, pu and, with PendingGate, pa per key dimension): each
// element made S·pa + pk ⊗ pu (state_commit's roundings; without a gate S + pk ⊗ pu), stored back, then read as
// read_rows_eighthed reads it — q ⊙ (S·α + k ⊗ v), α per key dimension with Gate — the tree's first three levels
// in registers
template <bool PendingGate, bool Gate>
inline int64_t read_rows_pending(const float* q, const float* k, const float* v, const float* alpha, float* S,
                                 int64_t dk, int64_t dv, int64_t w, float* buf, const float* pk, const float* pu,
                                 const float* pa) {
  for (int64_t i = 0; i < dk / 8; ++i) {
    int64_t j[8];
    eight_rows(i, dk, j);
    EIGHT_STATE_ROWS(float, S, j, dv);
    float qr[8], kr[8], ar[8], pkr[8], par[8];
    for (int r = 0; r < 8; ++r) {
      qr[r] = q[j[r]], kr[r] = k[j[r]], pkr[r] = pk[j[r]];
      ar[r] = Gate ? alpha[j[r]] : 1.0f, par[r] = PendingGate ? pa[j[r]] : 1.0f;
    }
    const float q0 = qr[0], q1 = qr[1], q2 = qr[2], q3 = qr[3], q4 = qr[4], q5 = qr[5], q6 = qr[6], q7 = qr[7];
    const float k0 = kr[0], k1 = kr[1], k2 = kr[2], k3 = kr[3], k4 = kr[4], k5 = kr[5], k6 = kr[6], k7 = kr[7];
    const float a0 = ar[0], a1 = ar[1], a2 = ar[2], a3 = ar[3], a4 = ar[4], a5 = ar[5], a6 = ar[6], a7 = ar[7];
    const float p0 = pkr[0], p1 = pkr[1], p2 = pkr[2], p3 = pkr[3], p4 = pkr[4], p5 = pkr[5], p6 = pkr[6], p7 = pkr[7];
    const float g0 = par[0], g1 = par[1], g2 = par[2], g3 = par[3], g4 = par[4], g5 = par[5], g6 = par[6], g7 = par[7];
    float* __restrict row = buf + i * w;
#pragma GCC ivdep
    for (int64_t c = 0; c < w; ++c) {
      const float u = pu[c], vc = v[c];
      float t0, t1, t2, t3, t4, t5, t6, t7;
      if constexpr (PendingGate) {
        t0 = s0[c] * g0 + p0 * u, t1 = s1[c] * g1 + p1 * u, t2 = s2[c] * g2 + p2 * u, t3 = s3[c] * g3 + p3 * u;
        t4 = s4[c] * g4 + p4 * u, t5 = s5[c] * g5 + p5 * u, t6 = s6[c] * g6 + p6 * u, t7 = s7[c] * g7 + p7 * u;
      } else {
        t0 = s0[c] + p0 * u, t1 = s1[c] + p1 * u, t2 = s2[c] + p2 * u, t3 = s3[c] + p3 * u;
        t4 = s4[c] + p4 * u, t5 = s5[c] + p5 * u, t6 = s6[c] + p6 * u, t7 = s7[c] + p7 * u;
      }
      s0[c] = t0, s1[c] = t1, s2[c] = t2, s3[c] = t3, s4[c] = t4, s5[c] = t5, s6[c] = t6, s7[c] = t7;
      float x0, x1, x2, x3, x4, x5, x6, x7;
      if constexpr (Gate) {
        x0 = q0 * (t0 * a0 + k0 * vc), x1 = q1 * (t1 * a1 + k1 * vc), x2 = q2 * (t2 * a2 + k2 * vc);
        x3 = q3 * (t3 * a3 + k3 * vc), x4 = q4 * (t4 * a4 + k4 * vc), x5 = q5 * (t5 * a5 + k5 * vc);
        x6 = q6 * (t6 * a6 + k6 * vc), x7 = q7 * (t7 * a7 + k7 * vc);
      } else {
        x0 = q0 * (t0 + k0 * vc), x1 = q1 * (t1 + k1 * vc), x2 = q2 * (t2 + k2 * vc), x3 = q3 * (t3 + k3 * vc);
        x4 = q4 * (t4 + k4 * vc), x5 = q5 * (t5 + k5 * vc), x6 = q6 * (t6 + k6 * vc), x7 = q7 * (t7 + k7 * vc);
      }
      row[c] = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7));
    }
  }
  return dk / 8;
}

// S ← S·α + k ⊗ v over one block in place (α per key dimension, one per head with `per_head`, or none): the commit's
// arithmetic — state_commit's, and a pending update's where the read cannot fold it (a d_k that 8 does not divide,
// or a gate the update was recorded without)
inline void update_block(float* S, int64_t dk, int64_t dv, int64_t w, const float* kr, const float* vr,
                         const float* alpha, bool per_head) {
  for (int64_t i = 0; i < dk; ++i) {
    float* __restrict s = S + i * dv;
    const float ki = kr[i];
    const float* f = factor(alpha, per_head, i);
    if (f) {
      const float ai = *f;
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) {
        const float s1 = s[c] * ai, outer = ki * vr[c];
        s[c] = s1 + outer;
      }
    } else {
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) {
        const float outer = ki * vr[c];
        s[c] = s[c] + outer;
      }
    }
  }
}

}  // namespace
