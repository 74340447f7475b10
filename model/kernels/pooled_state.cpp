// The decode step's recurrences on the state pool itself, in two passes (server/engine/decode_program.py):
//
//   linserve::linear_read  — one token of the gated linear recurrence read from each row's pool slot:
//                            o = tree_sum_k(q ⊙ (S·α + k ⊗ v)), the new state made element by element in registers
//                            and never stored;
//   linserve::delta_read   — one token of the (gated) delta rule the same way: p = tree_sum_k(k ⊙ S·α),
//                            u = β·(v − p), o = tree_sum_k(q ⊙ (S·α + k ⊗ u)); it returns o and u;
//   linserve::state_commit — once the step knows which rows' logits are finite: S ← S·α + k ⊗ v (v: the delta
//                            rule's u) in place, in each kept row's slot.
//   linserve::linear_read_folded / delta_read_folded / pending_record — either recurrence with its commit folded
//                            into the next step's read: the read applies the slot's pending update (S ← S·α + k ⊗ u,
//                            recorded by the last step's pending_record: the commit's roundings) to each element as
//                            its first pass reads it and stores the result in the slot; pending_record then only
//                            notes the kept rows' k, u (v) and α. A row's state moves twice a step (read, written)
//                            instead of three times.
//   linserve::pending_settle — the pending updates of listed slots written into their state (the commit's
//                            roundings) and cleared, every folded state in one call: before a slot is read otherwise.
//
// Each element gets the roundings of linear_scan / delta_step (delta_rule.cpp) in their order — product, then sum;
// the read-outs' tree of halves over d_k — so the bits are theirs, and the outputs are the same whatever the batch.
// What it saves is traffic: linear_scan over gathered rows moved a row's state ~7 times a step (the gather into
// the program's input, a copy to write into, the new state, the keep-or-revert select, the write back), each
// through freshly allocated (page-faulting) memory; here the state is read once by the read and read and written
// once by the commit, where it lives. 340M linear_attn holds 24 MiB a row: at 8 rows that was most of the step.
// Each read's tree over d_k starts as its rows are made: its first three levels where 8 divides d_k (else its first)
// are summed in registers from the 8 (2) key rows they pair, in the tree's order, so the scratch the rest of the
// tree reads back is an eighth (a half) of d_k rows (340M Gated DeltaNet's delta_read 1.27x faster with three
// levels than with one, 8 rows, docs/benchmarks.md).
//
// state_commit writes through a tensor torch was told is only read (the op is declared functional and returns
// `keep`): the decode program chains the commits through that output, so a compiler neither drops nor reorders
// them, and nothing reads a pool buffer after its commit within a step. A slot that appears in more than one row
// (a bucket's padding repeats the first row) is updated once, by its first row.
//
// The row arithmetic (the reads with their folded tree levels, the pending reads, update_block) is in pooled_rows.h;
// the ops, their checks and the passes over rows and column blocks are here.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include "pooled_rows.h"
#include "recurrence_blocks.h"

#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

// a step's fp32 output rows, allocated without a trip through the dispatcher (these ops run on the CPU only, a
// dozen times a decode step)
at::Tensor rows_out(int64_t B, int64_t H, int64_t dv) {
  return at::detail::empty_cpu({B, H, dv}, at::kFloat, false, c10::nullopt);
}

using linserve::for_each_block;
using linserve::MAX_COLUMNS;
using linserve::tree;

void check_pool(const at::Tensor& pool, const at::Tensor& slots, int64_t B, const char* op) {
  TORCH_CHECK(pool.dim() == 4 && pool.scalar_type() == at::kFloat && pool.is_contiguous(), op,
              ": the pool buffer must be contiguous fp32 (N, H, dk, dv)");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.scalar_type() == at::kLong, op, ": slots must be int64 (B,)");
}

// each row's slot, checked against the pool
std::vector<int64_t> slot_list(const at::Tensor& slots, int64_t N, const char* op) {
  const at::Tensor sc = slots.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  std::vector<int64_t> out(sp, sp + sc.numel());
  for (int64_t s : out) TORCH_CHECK(s >= 0 && s < N, op, ": slot ", s, " is outside the pool of ", N);
  return out;
}

void check_rows(std::initializer_list<const at::Tensor*> tensors, at::IntArrayRef shape, const char* what) {
  for (const at::Tensor* t : tensors)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->sizes() == shape, what);
}

struct Dims {
  int64_t B, H, dk, dv;
};

// a token's k (B, H, dk) and v (B, H, dv), fp32, against the pool (N, H, dk, dv) and the rows' slots (B,)
Dims check_token(const at::Tensor& k, const at::Tensor& v, const at::Tensor& pool, const at::Tensor& slots,
                 const char* op) {
  TORCH_CHECK(k.dim() == 3, op, ": k must be (B, H, dk)");
  const Dims d{k.size(0), k.size(1), k.size(2), pool.dim() == 4 ? pool.size(3) : 0};
  check_pool(pool, slots, d.B, op);
  TORCH_CHECK(pool.size(1) == d.H && pool.size(2) == d.dk, op, ": the pool's heads and d_k must be k's");
  TORCH_CHECK(k.scalar_type() == at::kFloat, op, ": k must be fp32 (B, H, dk)");
  TORCH_CHECK(v.scalar_type() == at::kFloat && v.sizes() == at::IntArrayRef({d.B, d.H, d.dv}), op,
              ": v must be fp32 (B, H, dv)");
  return d;
}

// the reads' q beside k
void check_query(const at::Tensor& q, const at::Tensor& k, const char* op) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.sizes() == k.sizes(), op, ": q, k must be fp32 (B, H, dk)");
}

// a commit's `keep` (contiguous bool), copied: its output — the next commit's input, so a compiler keeps the order
at::Tensor copy_of(const at::Tensor& keep) {
  at::Tensor out = at::detail::empty_cpu(keep.sizes(), at::kBool, false, c10::nullopt);
  std::memcpy(out.data_ptr(), keep.data_ptr(), static_cast<size_t>(keep.numel()));
  return out;
}

// each row's first appearance among the rows (a bucket's padding repeats the first row)
std::vector<char> first_of_slot(const std::vector<int64_t>& rows) {
  std::vector<char> first(rows.size(), 1);
  for (size_t b = 0; b < rows.size(); ++b)
    for (size_t e = 0; e < b && first[b]; ++e) first[b] = rows[e] != rows[b];
  return first;
}

// a commit's gate, checked and made contiguous: (B, H, dk) per key dimension or (B, H) per head (`per_head`); an
// undefined tensor without one
at::Tensor commit_gate(const c10::optional<at::Tensor>& alpha, const Dims& d, bool& per_head, const char* what) {
  per_head = false;
  if (!alpha.has_value() || !alpha->defined()) return at::Tensor();
  per_head = alpha->dim() == 2;
  check_rows({&*alpha}, per_head ? at::IntArrayRef({d.B, d.H}) : at::IntArrayRef({d.B, d.H, d.dk}), what);
  return alpha->contiguous();
}

// after a folded read: each slot it read has its flag cleared (after every head's block: the slot now holds its
// state), and a repeated slot's row (a bucket's padding) gets its first row's outputs (each (B, H, dv): row_floats)
void finish_folded(const std::vector<int64_t>& rows, const std::vector<char>& first, uint8_t* flags,
                   std::initializer_list<float*> outputs, int64_t row_floats) {
  for (size_t b = 0; b < rows.size(); ++b) {
    if (first[b]) {
      flags[rows[b]] = 0;
      continue;
    }
    const int64_t f = std::find(rows.begin(), rows.end(), rows[b]) - rows.begin();
    for (float* out : outputs) std::copy(out + f * row_floats, out + (f + 1) * row_floats, out + b * row_floats);
  }
}

// pending: pk (N, H, dk), pu (N, H, dv), pa (N, H, dk) fp32 and flag (N,) uint8 — 0 none, 1 pending without α, 2 with
// α (per key dimension; a per-head gate recorded as d_k equal factors)
void check_pending(const at::Tensor& pk, const at::Tensor& pu, const at::Tensor& pa, const at::Tensor& flag,
                   const Dims& d, int64_t N, const char* op) {
  TORCH_CHECK(pk.scalar_type() == at::kFloat && pk.is_contiguous() && pk.sizes() == at::IntArrayRef({N, d.H, d.dk}),
              op, ": pending k must be contiguous fp32 (N, H, dk)");
  TORCH_CHECK(pu.scalar_type() == at::kFloat && pu.is_contiguous() && pu.sizes() == at::IntArrayRef({N, d.H, d.dv}),
              op, ": pending u must be contiguous fp32 (N, H, dv)");
  TORCH_CHECK(pa.scalar_type() == at::kFloat && pa.is_contiguous() && pa.sizes() == at::IntArrayRef({N, d.H, d.dk}),
              op, ": pending alpha must be contiguous fp32 (N, H, dk)");
  TORCH_CHECK(flag.scalar_type() == at::kByte && flag.is_contiguous() && flag.sizes() == at::IntArrayRef({N}), op,
              ": pending flags must be contiguous uint8 (N,)");
}

std::tuple<at::Tensor, at::Tensor> delta_read_folded(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& beta, const c10::optional<at::Tensor>& alpha,
                                                     const at::Tensor& pool, const at::Tensor& slots,
                                                     const at::Tensor& pk, const at::Tensor& pu, const at::Tensor& pa,
                                                     const at::Tensor& flag) {
  const Dims d = check_token(k, v, pool, slots, "delta_read_folded");
  check_query(q, k, "delta_read_folded");
  const int64_t B = d.B, H = d.H, dk = d.dk, dv = d.dv;
  check_rows({&beta}, {B, H}, "delta_read_folded: beta must be fp32 (B, H)");
  check_pending(pk, pu, pa, flag, d, pool.size(0), "delta_read_folded");
  const bool gated = alpha.has_value() && alpha->defined();
  at::Tensor a;
  if (gated) {
    check_rows({&*alpha}, {B, H}, "delta_read_folded: alpha must be fp32 (B, H)");
    a = alpha->contiguous();
  }
  const std::vector<int64_t> rows = slot_list(slots, pool.size(0), "delta_read_folded");
  const std::vector<char> first = first_of_slot(rows);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), bc = beta.contiguous();
  at::Tensor o = rows_out(B, H, dv), u = rows_out(B, H, dv);  // (B, H, dv) each
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const float *bp = bc.data_ptr<float>(), *ap = gated ? a.data_ptr<float>() : nullptr;
  float* sp = pool.data_ptr<float>();
  const float *pkp = pk.data_ptr<float>(), *pup = pu.data_ptr<float>(), *pap = pa.data_ptr<float>();
  uint8_t* flags = flag.data_ptr<uint8_t>();
  float *op = o.data_ptr<float>(), *up = u.data_ptr<float>();
  for_each_block(B * H, dk, dv, [&](int64_t bh, int64_t c0, int64_t w, float* buf) {
    const int64_t b = bh / H, h = bh % H, slot = rows[b], sh = slot * H + h;
    if (!first[b]) return;  // (a repeated slot: its first row's outputs, copied below)
    float* S = sp + sh * dk * dv + c0;
    const float *kr = kp + bh * dk, *alpha_bh = ap ? ap + bh : nullptr;
    const uint8_t pending = flags[slot];
    const float* pending_alpha = pending == 2 ? pap + sh * dk : nullptr;  // (d_k equal factors: a head's gate)
    if (pending && dk % 8 == 0 && dk >= 8 && (pending_alpha != nullptr) == (alpha_bh != nullptr)) {
      tree(buf, predicted_rows_pending(kr, alpha_bh, S, dk, dv, w, buf, pkp + sh * dk, pup + sh * dv + c0,
                                       pending_alpha), w);
    } else {
      if (pending) update_block(S, dk, dv, w, pkp + sh * dk, pup + sh * dv + c0, pending_alpha, false);
      tree(buf, predicted_rows(kr, alpha_bh, S, dk, dv, w, buf), w);  // k ⊙ S·α
    }
    float* ur = up + bh * dv + c0;
    const float* vr = vp + bh * dv + c0;
    for (int64_t c = 0; c < w; ++c) ur[c] = bp[bh] * (vr[c] - buf[c]);
    tree(buf, read_rows(qp + bh * dk, kr, ur, alpha_bh, true, S, dk, dv, w, buf), w);  // q ⊙ (S·α + k ⊗ u)
    std::copy(buf, buf + w, op + bh * dv + c0);
  });
  finish_folded(rows, first, flags, {op, up}, H * dv);
  return {o, u};
}

// linear_read with each slot's pending update applied as the read passes over it (stored back; the flag cleared):
// the gated linear recurrence's commit folded into the next step's read
at::Tensor linear_read_folded(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const c10::optional<at::Tensor>& alpha, const at::Tensor& pool, const at::Tensor& slots,
                              const at::Tensor& pk, const at::Tensor& pu, const at::Tensor& pa, const at::Tensor& flag) {
  const Dims d = check_token(k, v, pool, slots, "linear_read_folded");
  check_query(q, k, "linear_read_folded");
  const int64_t B = d.B, H = d.H, dk = d.dk, dv = d.dv;
  check_pending(pk, pu, pa, flag, d, pool.size(0), "linear_read_folded");
  const bool gated = alpha.has_value() && alpha->defined();
  at::Tensor a;
  if (gated) {
    check_rows({&*alpha}, {B, H, dk}, "linear_read_folded: alpha must be fp32 (B, H, dk)");
    a = alpha->contiguous();
  }
  const std::vector<int64_t> rows = slot_list(slots, pool.size(0), "linear_read_folded");
  const std::vector<char> first = first_of_slot(rows);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor o = rows_out(B, H, dv);  // (B, H, dv)
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const float* ap = gated ? a.data_ptr<float>() : nullptr;
  float* sp = pool.data_ptr<float>();
  const float *pkp = pk.data_ptr<float>(), *pup = pu.data_ptr<float>(), *pap = pa.data_ptr<float>();
  uint8_t* flags = flag.data_ptr<uint8_t>();
  float* op = o.data_ptr<float>();
  for_each_block(B * H, dk, dv, [&](int64_t bh, int64_t c0, int64_t w, float* buf) {
    const int64_t b = bh / H, h = bh % H, slot = rows[b], sh = slot * H + h;
    if (!first[b]) return;  // (a repeated slot: its first row's outputs, copied below)
    float* S = sp + sh * dk * dv + c0;
    const float *qr = qp + bh * dk, *kr = kp + bh * dk, *vr = vp + bh * dv + c0;
    const float* alpha_bh = ap ? ap + bh * dk : nullptr;
    const uint8_t pending = flags[slot];
    const float *ppk = pkp + sh * dk, *ppu = pup + sh * dv + c0, *ppa = pending == 2 ? pap + sh * dk : nullptr;
    int64_t n;
    if (pending && dk % 8 == 0 && dk >= 8) {
      if (ppa)
        n = alpha_bh ? read_rows_pending<true, true>(qr, kr, vr, alpha_bh, S, dk, dv, w, buf, ppk, ppu, ppa)
                     : read_rows_pending<true, false>(qr, kr, vr, alpha_bh, S, dk, dv, w, buf, ppk, ppu, ppa);
      else
        n = alpha_bh ? read_rows_pending<false, true>(qr, kr, vr, alpha_bh, S, dk, dv, w, buf, ppk, ppu, ppa)
                     : read_rows_pending<false, false>(qr, kr, vr, alpha_bh, S, dk, dv, w, buf, ppk, ppu, ppa);
    } else {
      if (pending) update_block(S, dk, dv, w, ppk, ppu, ppa, false);
      n = read_rows(qr, kr, vr, alpha_bh, false, S, dk, dv, w, buf);
    }
    tree(buf, n, w);
    std::copy(buf, buf + w, op + bh * dv + c0);
  });
  finish_folded(rows, first, flags, {op}, H * dv);
  return o;
}

// the kept rows' update noted for their slots' next read (each slot once, by its first row); returns keep's copy —
// the next commit's input, as state_commit's
at::Tensor pending_record(const at::Tensor& pk, const at::Tensor& pu, const at::Tensor& pa, const at::Tensor& flag,
                          const at::Tensor& slots, const at::Tensor& k, const at::Tensor& u,
                          const c10::optional<at::Tensor>& alpha, const at::Tensor& keep) {
  TORCH_CHECK(k.dim() == 3 && k.scalar_type() == at::kFloat, "pending_record: k must be fp32 (B, H, dk)");
  const Dims d{k.size(0), k.size(1), k.size(2), pu.dim() == 3 ? pu.size(2) : 0};
  check_pending(pk, pu, pa, flag, d, pk.size(0), "pending_record");
  TORCH_CHECK(u.scalar_type() == at::kFloat && u.sizes() == at::IntArrayRef({d.B, d.H, d.dv}),
              "pending_record: u must be fp32 (B, H, dv)");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == d.B && slots.scalar_type() == at::kLong,
              "pending_record: slots must be int64 (B,)");
  TORCH_CHECK(keep.dim() == 1 && keep.size(0) == d.B && keep.scalar_type() == at::kBool,
              "pending_record: keep must be bool (B,)");
  bool per_head;
  const at::Tensor a = commit_gate(alpha, d, per_head, "pending_record: alpha must be fp32 (B, H, dk) or (B, H)");
  const bool gated = a.defined();
  const std::vector<int64_t> rows = slot_list(slots, pk.size(0), "pending_record");
  const std::vector<char> first = first_of_slot(rows);
  const at::Tensor keep_c = keep.contiguous(), kc = k.contiguous(), uc = u.contiguous();
  const bool* kept = keep_c.data_ptr<bool>();
  float *pkp = pk.data_ptr<float>(), *pup = pu.data_ptr<float>(), *pap = pa.data_ptr<float>();
  uint8_t* flags = flag.data_ptr<uint8_t>();
  for (int64_t b = 0; b < d.B; ++b) {
    if (!kept[b] || !first[b]) continue;
    const int64_t slot = rows[b];
    std::copy(kc.data_ptr<float>() + b * d.H * d.dk, kc.data_ptr<float>() + (b + 1) * d.H * d.dk, pkp + slot * d.H * d.dk);
    std::copy(uc.data_ptr<float>() + b * d.H * d.dv, uc.data_ptr<float>() + (b + 1) * d.H * d.dv, pup + slot * d.H * d.dv);
    if (gated && per_head) {  // a head's factor for each of its key dimensions
      for (int64_t h = 0; h < d.H; ++h)
        std::fill(pap + (slot * d.H + h) * d.dk, pap + (slot * d.H + h + 1) * d.dk, a.data_ptr<float>()[b * d.H + h]);
    } else if (gated) {
      std::copy(a.data_ptr<float>() + b * d.H * d.dk, a.data_ptr<float>() + (b + 1) * d.H * d.dk, pap + slot * d.H * d.dk);
    }
    flags[slot] = gated ? 2 : 1;
  }
  return copy_of(keep_c);
}

at::Tensor linear_read(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& alpha, const at::Tensor& pool, const at::Tensor& slots) {
  const Dims d = check_token(k, v, pool, slots, "linear_read");
  check_query(q, k, "linear_read");
  const int64_t B = d.B, H = d.H, dk = d.dk, dv = d.dv;
  const bool gated = alpha.has_value() && alpha->defined();
  at::Tensor a;
  if (gated) {
    check_rows({&*alpha}, {B, H, dk}, "linear_read: alpha must be fp32 (B, H, dk)");
    a = alpha->contiguous();
  }
  const std::vector<int64_t> rows = slot_list(slots, pool.size(0), "linear_read");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor o = rows_out(B, H, dv);  // (B, H, dv)
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const float *ap = gated ? a.data_ptr<float>() : nullptr, *sp = pool.data_ptr<float>();
  float* op = o.data_ptr<float>();
  for_each_block(B * H, dk, dv, [&](int64_t bh, int64_t c0, int64_t w, float* buf) {
    const int64_t b = bh / H, h = bh % H;
    const float* S = sp + (rows[b] * H + h) * dk * dv + c0;
    tree(buf, read_rows(qp + bh * dk, kp + bh * dk, vp + bh * dv + c0, ap ? ap + bh * dk : nullptr, false, S, dk,
                        dv, w, buf), w);
    std::copy(buf, buf + w, op + bh * dv + c0);
  });
  return o;
}

std::tuple<at::Tensor, at::Tensor> delta_read(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& beta, const c10::optional<at::Tensor>& alpha,
                                              const at::Tensor& pool, const at::Tensor& slots) {
  const Dims d = check_token(k, v, pool, slots, "delta_read");
  check_query(q, k, "delta_read");
  const int64_t B = d.B, H = d.H, dk = d.dk, dv = d.dv;
  check_rows({&beta}, {B, H}, "delta_read: beta must be fp32 (B, H)");
  const bool gated = alpha.has_value() && alpha->defined();
  at::Tensor a;
  if (gated) {
    check_rows({&*alpha}, {B, H}, "delta_read: alpha must be fp32 (B, H)");
    a = alpha->contiguous();
  }
  const std::vector<int64_t> rows = slot_list(slots, pool.size(0), "delta_read");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), bc = beta.contiguous();
  at::Tensor o = rows_out(B, H, dv), u = rows_out(B, H, dv);  // (B, H, dv) each
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const float *bp = bc.data_ptr<float>(), *ap = gated ? a.data_ptr<float>() : nullptr, *sp = pool.data_ptr<float>();
  float *op = o.data_ptr<float>(), *up = u.data_ptr<float>();
  for_each_block(B * H, dk, dv, [&](int64_t bh, int64_t c0, int64_t w, float* buf) {
    const int64_t b = bh / H, h = bh % H;
    const float* S = sp + (rows[b] * H + h) * dk * dv + c0;
    const float *kr = kp + bh * dk, *alpha_bh = ap ? ap + bh : nullptr;
    tree(buf, predicted_rows(kr, alpha_bh, S, dk, dv, w, buf), w);  // k ⊙ S·α (delta_step's S1, not stored)
    float* ur = up + bh * dv + c0;
    const float* vr = vp + bh * dv + c0;
    for (int64_t c = 0; c < w; ++c) ur[c] = bp[bh] * (vr[c] - buf[c]);
    tree(buf, read_rows(qp + bh * dk, kr, ur, alpha_bh, true, S, dk, dv, w, buf), w);  // q ⊙ (S·α + k ⊗ u)
    std::copy(buf, buf + w, op + bh * dv + c0);
  });
  return {o, u};
}

// alpha: (B, H, dk) per key dimension, (B, H) per head, or none
at::Tensor state_commit(const at::Tensor& pool, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& alpha, const at::Tensor& keep) {
  const Dims d = check_token(k, v, pool, slots, "state_commit");
  const int64_t B = d.B, H = d.H, dk = d.dk, dv = d.dv;
  TORCH_CHECK(keep.dim() == 1 && keep.size(0) == B && keep.scalar_type() == at::kBool, "state_commit: keep must be bool (B,)");
  bool per_head;
  const at::Tensor a = commit_gate(alpha, d, per_head, "state_commit: alpha must be fp32 (B, H, dk) or (B, H)");
  const bool gated = a.defined();
  const std::vector<int64_t> rows = slot_list(slots, pool.size(0), "state_commit");
  const at::Tensor keep_c = keep.contiguous();
  const bool* kept = keep_c.data_ptr<bool>();
  std::vector<char> writes = first_of_slot(rows);  // kept, and the first row of its slot
  for (int64_t b = 0; b < B; ++b) writes[b] = writes[b] && kept[b];
  const at::Tensor kc = k.contiguous(), vc = v.contiguous();
  const float *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>(), *ap = gated ? a.data_ptr<float>() : nullptr;
  float* sp = pool.data_ptr<float>();
  for_each_block(B * H, dk, dv, [&](int64_t bh, int64_t c0, int64_t w, float*) {
    const int64_t b = bh / H, h = bh % H;
    if (!writes[b]) return;
    float* S = sp + (rows[b] * H + h) * dk * dv + c0;
    const float* alpha_bh = ap ? ap + bh * (per_head ? 1 : dk) : nullptr;
    update_block(S, dk, dv, w, kp + bh * dk, vp + bh * dv + c0, alpha_bh, per_head);
  });
  return copy_of(keep_c);
}

// every folded state's pending updates in the listed slots (undefined: every slot) written into the state — each
// element S·α + k ⊗ u, the commit's roundings (α per key dimension where the flag is 2) — and their flags cleared: what
// the pool's `settle` asks before anything but a folded read looks at a slot. One call and one parallel region for
// all of a model's folded states (a slot listed twice, or with nothing pending, is passed over).
void pending_settle(at::TensorList pools, at::TensorList pk, at::TensorList pu, at::TensorList pa, at::TensorList flags,
                    const c10::optional<at::Tensor>& slots) {
  const size_t n = pools.size();
  TORCH_CHECK(pk.size() == n && pu.size() == n && pa.size() == n && flags.size() == n,
              "pending_settle: one pending k, u, alpha and flags a pool buffer");
  struct Item {
    float* S;
    const float *k, *u, *alpha;
    int64_t dk, dv;
  };
  const int64_t N = n ? pools[0].size(0) : 0;  // (every buffer's slots: one pool's)
  for (size_t s = 0; s < n; ++s) {  // every argument checked before a flag changes
    const at::Tensor& pool = pools[s];
    TORCH_CHECK(pool.dim() == 4 && pool.scalar_type() == at::kFloat && pool.is_contiguous() && pool.size(0) == N,
                "pending_settle: a pool buffer must be contiguous fp32 (N, H, dk, dv), N the same for all");
    check_pending(pk[s], pu[s], pa[s], flags[s], Dims{N, pool.size(1), pool.size(2), pool.size(3)}, N,
                  "pending_settle");
  }
  std::vector<int64_t> listed;
  if (slots.has_value() && slots->defined()) {
    TORCH_CHECK(slots->dim() == 1 && slots->scalar_type() == at::kLong, "pending_settle: slots must be int64 (B,)");
    listed = slot_list(*slots, N, "pending_settle");
  } else {
    for (int64_t slot = 0; slot < N; ++slot) listed.push_back(slot);
  }
  std::vector<Item> items;  // one a (state, slot, head) with an update pending
  for (size_t s = 0; s < n; ++s) {
    const at::Tensor& pool = pools[s];
    const int64_t H = pool.size(1), dk = pool.size(2), dv = pool.size(3);
    uint8_t* flag = flags[s].data_ptr<uint8_t>();
    float* sp = pool.data_ptr<float>();
    const float *pkp = pk[s].data_ptr<float>(), *pup = pu[s].data_ptr<float>(), *pap = pa[s].data_ptr<float>();
    for (int64_t slot : listed) {
      if (!flag[slot]) continue;  // (nothing pending, or listed before)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t sh = slot * H + h;
        items.push_back({sp + sh * dk * dv, pkp + sh * dk, pup + sh * dv, flag[slot] == 2 ? pap + sh * dk : nullptr,
                         dk, dv});
      }
      flag[slot] = 0;  // (the items keep what it said)
    }
  }
  if (items.empty()) return;
  linserve::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    linserve::FlushSubnormals flushed;  // (as every commit)
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      update_block(it.S, it.dk, it.dv, it.dv, it.k, it.u, it.alpha, false);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def("linear_read(Tensor q, Tensor k, Tensor v, Tensor? alpha, Tensor pool, Tensor slots) -> Tensor");
  m.def("delta_read(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor? alpha, Tensor pool, Tensor slots) -> (Tensor, Tensor)");
  m.def("delta_read_folded(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor? alpha, Tensor pool, Tensor slots, "
        "Tensor pk, Tensor pu, Tensor pa, Tensor flag) -> (Tensor, Tensor)");
  m.def("linear_read_folded(Tensor q, Tensor k, Tensor v, Tensor? alpha, Tensor pool, Tensor slots, Tensor pk, "
        "Tensor pu, Tensor pa, Tensor flag) -> Tensor");
  m.def("pending_record(Tensor pk, Tensor pu, Tensor pa, Tensor flag, Tensor slots, Tensor k, Tensor u, Tensor? alpha, "
        "Tensor keep) -> Tensor");
  m.def("state_commit(Tensor pool, Tensor slots, Tensor k, Tensor v, Tensor? alpha, Tensor keep) -> Tensor");
  m.def("pending_settle(Tensor(a!)[] pools, Tensor[] pk, Tensor[] pu, Tensor[] pa, Tensor(b!)[] flags, Tensor? slots) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("linear_read", &linear_read);
  m.impl("delta_read", &delta_read);
  m.impl("delta_read_folded", &delta_read_folded);
  m.impl("linear_read_folded", &linear_read_folded);
  m.impl("pending_record", &pending_record);
  m.impl("state_commit", &state_commit);
  m.impl("pending_settle", &pending_settle);
}

using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::pointer_to_optional;
using torch::aot_inductor::tensor_handle_to_tensor_pointer;

extern "C" AOTITorchError aoti_torch_cpu_linear_read(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                      AtenTensorHandle* alpha, AtenTensorHandle pool,
                                                      AtenTensorHandle slots, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(linear_read(*tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k),
                                          *tensor_handle_to_tensor_pointer(v), pointer_to_optional<at::Tensor>(alpha),
                                          *tensor_handle_to_tensor_pointer(pool), *tensor_handle_to_tensor_pointer(slots)));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_delta_read(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                     AtenTensorHandle beta, AtenTensorHandle* alpha,
                                                     AtenTensorHandle pool, AtenTensorHandle slots,
                                                     AtenTensorHandle* ret0, AtenTensorHandle* ret1) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    auto [o, u] = delta_read(*tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k),
                             *tensor_handle_to_tensor_pointer(v), *tensor_handle_to_tensor_pointer(beta),
                             pointer_to_optional<at::Tensor>(alpha), *tensor_handle_to_tensor_pointer(pool),
                             *tensor_handle_to_tensor_pointer(slots));
    *ret0 = new_tensor_handle(std::move(o));
    *ret1 = new_tensor_handle(std::move(u));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_state_commit(AtenTensorHandle pool, AtenTensorHandle slots,
                                                       AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle* alpha,
                                                       AtenTensorHandle keep, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(state_commit(*tensor_handle_to_tensor_pointer(pool), *tensor_handle_to_tensor_pointer(slots),
                                           *tensor_handle_to_tensor_pointer(k), *tensor_handle_to_tensor_pointer(v),
                                           pointer_to_optional<at::Tensor>(alpha), *tensor_handle_to_tensor_pointer(keep)));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_delta_read_folded(
    AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle beta, AtenTensorHandle* alpha,
    AtenTensorHandle pool, AtenTensorHandle slots, AtenTensorHandle pk, AtenTensorHandle pu, AtenTensorHandle pa,
    AtenTensorHandle flag, AtenTensorHandle* ret0, AtenTensorHandle* ret1) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    auto [o, u] = delta_read_folded(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k), *tensor_handle_to_tensor_pointer(v),
        *tensor_handle_to_tensor_pointer(beta), pointer_to_optional<at::Tensor>(alpha),
        *tensor_handle_to_tensor_pointer(pool), *tensor_handle_to_tensor_pointer(slots),
        *tensor_handle_to_tensor_pointer(pk), *tensor_handle_to_tensor_pointer(pu), *tensor_handle_to_tensor_pointer(pa),
        *tensor_handle_to_tensor_pointer(flag));
    *ret0 = new_tensor_handle(std::move(o));
    *ret1 = new_tensor_handle(std::move(u));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_pending_record(AtenTensorHandle pk, AtenTensorHandle pu, AtenTensorHandle pa,
                                                         AtenTensorHandle flag, AtenTensorHandle slots,
                                                         AtenTensorHandle k, AtenTensorHandle u,
                                                         AtenTensorHandle* alpha, AtenTensorHandle keep,
                                                         AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(pending_record(
        *tensor_handle_to_tensor_pointer(pk), *tensor_handle_to_tensor_pointer(pu), *tensor_handle_to_tensor_pointer(pa),
        *tensor_handle_to_tensor_pointer(flag), *tensor_handle_to_tensor_pointer(slots),
        *tensor_handle_to_tensor_pointer(k), *tensor_handle_to_tensor_pointer(u), pointer_to_optional<at::Tensor>(alpha),
        *tensor_handle_to_tensor_pointer(keep)));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_linear_read_folded(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                             AtenTensorHandle* alpha, AtenTensorHandle pool,
                                                             AtenTensorHandle slots, AtenTensorHandle pk,
                                                             AtenTensorHandle pu, AtenTensorHandle pa,
                                                             AtenTensorHandle flag, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(linear_read_folded(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k), *tensor_handle_to_tensor_pointer(v),
        pointer_to_optional<at::Tensor>(alpha), *tensor_handle_to_tensor_pointer(pool),
        *tensor_handle_to_tensor_pointer(slots), *tensor_handle_to_tensor_pointer(pk),
        *tensor_handle_to_tensor_pointer(pu), *tensor_handle_to_tensor_pointer(pa), *tensor_handle_to_tensor_pointer(flag)));
  });
}
