// linserve::linear_scan — T tokens of the gated linear recurrence (model/recurrence.py's `scan`: linear_attn, GLA,
// RetNet, Mamba2; model/linear_attention.py's `scan`: the shipped model, z its last value column) for every row and
// head, one pass over the state a token, scan's operations in scan's order:
//
//   S' = S · α + k ⊗ v                  (α per key dimension, or none; the product k_i·v_c rounded on its own)
//   o  = tree_sum_k(q ⊙ S')
//
// linserve::dplr_step — one token of RWKV-7's generalised delta rule (model/generalized_delta.py's `scan`):
//
//   p  = tree_sum_k(a ⊙ S)              (the read-back along a, from the state before the token)
//   S' = d ⊙ S + b ⊗ p + k ⊗ v          (d = e^w per key dimension; (d·s + b·p), then + k·v)
//   o  = tree_sum_k(r ⊙ S')
//
// linserve::delta_scan — T tokens of the (gated) delta rule for every row and head, one pass over the state a token
// (two over a block the cache holds), each operation the one model/delta_rule.py's `scan` writes, in its order (so
// the bits are scan's):
//
//   S1 = S · α                          (gated; α = 1: S1 = S)
//   p  = tree_sum_k(k ⊙ S1)             (the fixed tree of halves over d_k: x[i] + x[i + h], an odd last carried)
//   u  = β · (v − p)
//   S' = S1 + k ⊗ u
//   o  = tree_sum_k(q ⊙ S')
//
// All fp32, elementwise IEEE operations (built without contraction), subnormals flushed as on the engine's
// thread. The state is read and written once per token — torch's form makes ~10 passes over a
// 64 MiB state (fla's 340M Gated DeltaNet), which made a step's cost grow with every row. Rows and heads are
// independent tasks: the result never depends on how many rows share the call, nor on the threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>
#include <immintrin.h>

#include "pooled_rows.h"
#include "recurrence_blocks.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using linserve::for_each_block;
using linserve::MAX_COLUMNS;
using linserve::aligned_scratch;
using linserve::aligned_stride;
using linserve::scaled_copy;
using linserve::tree;

// one column block [c0, c0 + w) of one (row, head); S, S_new, v, o point at the block's first column
inline void block_step(const float* q, const float* k, const float* v, float beta, const float* alpha,
                       const float* S, float* S_new, float* o, int64_t dk, int64_t dv, int64_t w, float* buf) {
  for (int64_t i = 0; i < dk; ++i) {  // S1 = S · α; k ⊙ S1
    float* __restrict s1 = S_new + i * dv;
    float* __restrict row = buf + i * w;
    const float ki = k[i];
    scaled_copy(S + i * dv, s1, alpha, w);
#pragma GCC ivdep
    for (int64_t c = 0; c < w; ++c) row[c] = ki * s1[c];
  }
  tree(buf, dk, w);
  float u[MAX_COLUMNS];
  for (int64_t c = 0; c < w; ++c) u[c] = beta * (v[c] - buf[c]);
  for (int64_t i = 0; i < dk; ++i) {  // S' = S1 + k ⊗ u; q ⊙ S'
    float* __restrict s1 = S_new + i * dv;
    float* __restrict row = buf + i * w;
    const float ki = k[i], qi = q[i];
#pragma GCC ivdep
    for (int64_t c = 0; c < w; ++c) s1[c] = s1[c] + ki * u[c];
#pragma GCC ivdep
    for (int64_t c = 0; c < w; ++c) row[c] = qi * s1[c];
  }
  tree(buf, dk, w);
  std::copy(buf, buf + w, o);
}

// one token of the gated linear recurrence over one column block of w columns of one (row, head), its state S
// updated in place (a row's old values are read before they are written): S's rows and buf's `stride` floats apart
inline void linear_block(const float* q, const float* k, const float* v, const float* alpha, float* S, float* o,
                         int64_t dk, int64_t w, float* buf, int64_t stride) {
  for (int64_t i = 0; i < dk; ++i) {
    float* __restrict s1 = S + i * stride;
    float* __restrict row = buf + i * stride;
    const float ki = k[i], qi = q[i];
    if (alpha) {
      const float ai = alpha[i];
#pragma GCC ivdep
      for (int64_t c = 0; c < w; ++c) s1[c] = s1[c] * ai;
    }
#pragma GCC ivdep
    for (int64_t c = 0; c < w; ++c) {
      const float outer = ki * v[c];
      s1[c] = s1[c] + outer;
    }
#pragma GCC ivdep
    for (int64_t c = 0; c < w; ++c) row[c] = qi * s1[c];
  }
  tree(buf, dk, w, stride);
  std::copy(buf, buf + w, o);
}

// n floats, inline: a scan keeps the state after every prefix with dk short copies a token and head (32 floats
// each for the shipped model), and std::copy called memmove for each (~13,800 calls in a verification of 8 drafts,
// 5-7% of its program's time)
inline void copy_floats(const float* from, float* to, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(to + j, _mm512_loadu_ps(from + j));
  if (j < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(to + j, tail, _mm512_maskz_loadu_ps(tail, from + j));
    j = n;
  }
#elif defined(__AVX2__)
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(to + j, _mm256_loadu_ps(from + j));
#endif
  for (; j < n; ++j) to[j] = from[j];
}

// w columns of dk rows from `from` (rows `fs` apart) to `to` (rows `ts` apart)
inline void copy_rows(const float* from, int64_t fs, float* to, int64_t ts, int64_t dk, int64_t w) {
  for (int64_t i = 0; i < dk; ++i) copy_floats(from + i * fs, to + i * ts, w);
}

// fn(token, c0, w, stride, state, spare, rows) for every token of every (row, head) and column block [c0, c0 + w) of
// d_v, in token order — the scans' common frame: the block carried across the tokens in the thread's aligned scratch (`state`, rows `stride` =
// aligned_stride(w) floats apart; `spare` a second such block one cache line past it — right after it, a 32 × 32
// block put each state row 4 KiB from its tree row, and the loads of one waited on the stores to the other (4K
// aliasing); `rows` for_each_block's scratch), copied out to `out` after every token with `prefixes` (B, T, H, dk,
// dv), else once at the end (B, H, dk, dv). fn may swap state and spare (a step that writes the other copy).
template <class Fn>
void carried_blocks(int64_t B, int64_t H, int64_t T, int64_t dk, int64_t dv, const float* S, float* out, bool prefixes,
                    const Fn& fn) {
  const int64_t square = dk * dv;
  for_each_block(B * H, dk, dv, [&](int64_t bh, int64_t c0, int64_t w, float* rows) {
    const int64_t b = bh / H, h = bh % H, stride = aligned_stride(w);
    float* state = aligned_scratch(static_cast<size_t>(2 * dk * stride + 16));
    float* spare = state + dk * stride + 16;
    copy_rows(S + bh * square + c0, dv, state, stride, dk, w);
    for (int64_t t = 0; t < T; ++t) {
      fn(bh * T + t, c0, w, stride, state, spare, rows);
      if (prefixes) copy_rows(state, stride, out + ((b * T + t) * H + h) * square + c0, dv, dk, w);
    }
    if (!prefixes) copy_rows(state, stride, out + bh * square + c0, dv, dk, w);
  });
}

// linear_scan: q, k (B, H, T, dk), v (B, H, T, dv), alpha (B, H, T, dk) or none, S
// (B, H, dk, dv) → o (B, H, T, dv) and the state after the T tokens — or, with `prefixes`, after every prefix
// (B, T, H, dk, dv). Token by token each element gets the roundings above, so the bits are those of T single-token
// scans whatever T is. A (row, head)'s column block is carried across the tokens in the thread's aligned scratch
// (`aligned_stride`), copied out after every token with `prefixes`, else once at the end.
std::tuple<at::Tensor, at::Tensor> linear_scan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const c10::optional<at::Tensor>& alpha, const at::Tensor& S,
                                               bool prefixes) {
  TORCH_CHECK(S.dim() == 4 && S.scalar_type() == at::kFloat, "linear_scan: S must be fp32 (B, H, dk, dv)");
  const int64_t B = S.size(0), H = S.size(1), dk = S.size(2), dv = S.size(3);
  TORCH_CHECK(q.dim() == 4, "linear_scan: q must be (B, H, T, dk)");
  const int64_t T = q.size(2);
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "linear_scan: q, k, v must be fp32");
  TORCH_CHECK(q.sizes() == at::IntArrayRef({B, H, T, dk}) && k.sizes() == q.sizes(), "linear_scan: q, k must be (B, H, T, dk)");
  TORCH_CHECK(v.sizes() == at::IntArrayRef({B, H, T, dv}), "linear_scan: v must be (B, H, T, dv)");
  const bool gated = alpha.has_value() && alpha->defined();
  at::Tensor a;
  if (gated) {
    TORCH_CHECK(alpha->scalar_type() == at::kFloat && alpha->sizes() == q.sizes(), "linear_scan: alpha must be fp32 (B, H, T, dk)");
    a = alpha->contiguous();
  }
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), Sc = S.contiguous();
  at::Tensor o = at::empty({B, H, T, dv}, S.options());
  at::Tensor out = prefixes ? at::empty({B, T, H, dk, dv}, S.options()) : at::empty_like(Sc);
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const float *ap = gated ? a.data_ptr<float>() : nullptr, *sp = Sc.data_ptr<float>();
  float *outp = out.data_ptr<float>(), *op = o.data_ptr<float>();
  const bool eighthed = dk % 8 == 0 && dk >= 8;
  carried_blocks(B, H, T, dk, dv, sp, outp, prefixes, [&](int64_t token, int64_t c0, int64_t w, int64_t stride,
                                                          float*& state, float*& spare, float* rows) {
    const float *qt = qp + token * dk, *kt = kp + token * dk, *vt = vp + token * dv + c0;
    const float* gate = ap ? ap + token * dk : nullptr;
    if (eighthed) {  // (the trees' first three levels made with the rows: an eighth of them written and read back)
      tree(rows, stored_rows_eighthed(qt, kt, vt, gate, false, state, dk, stride, w, rows), w);
      copy_floats(rows, op + token * dv + c0, w);
    } else {
      linear_block(qt, kt, vt, gate, state, op + token * dv + c0, dk, w, spare, stride);  // (spare: its tree)
    }
  });
  return {o, out};
}

// one column block [c0, c0 + w) of one (row, head) of RWKV-7's rule
inline void dplr_block(const float* r, const float* d, const float* k, const float* v, const float* a, const float* b,
                       const float* S, float* S_new, float* o, int64_t dk, int64_t dv, int64_t w, float* buf) {
  for (int64_t i = 0; i < dk; ++i) {  // a ⊙ S
    const float* __restrict s = S + i * dv;
    float* __restrict row = buf + i * w;
    const float ai = a[i];
#pragma GCC ivdep
    for (int64_t c = 0; c < w; ++c) row[c] = ai * s[c];
  }
  tree(buf, dk, w);
  float p[MAX_COLUMNS];
  std::copy(buf, buf + w, p);
  for (int64_t i = 0; i < dk; ++i) {  // S' = d ⊙ S + b ⊗ p + k ⊗ v; r ⊙ S'
    const float* __restrict s = S + i * dv;
    float* __restrict s1 = S_new + i * dv;
    float* __restrict row = buf + i * w;
    const float di = d[i], bi = b[i], ki = k[i], ri = r[i];
#pragma GCC ivdep
    for (int64_t c = 0; c < w; ++c) {
      const float decayed = di * s[c], read = bi * p[c];
      const float mixed = decayed + read, outer = ki * v[c];
      s1[c] = mixed + outer;
    }
#pragma GCC ivdep
    for (int64_t c = 0; c < w; ++c) row[c] = ri * s1[c];
  }
  tree(buf, dk, w);
  std::copy(buf, buf + w, o);
}

std::tuple<at::Tensor, at::Tensor> dplr_step(const at::Tensor& r, const at::Tensor& d, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& a, const at::Tensor& b,
                                             const at::Tensor& S) {
  TORCH_CHECK(S.dim() == 4 && S.scalar_type() == at::kFloat, "dplr_step: S must be fp32 (B, H, dk, dv)");
  const int64_t B = S.size(0), H = S.size(1), dk = S.size(2), dv = S.size(3);
  for (const at::Tensor* t : {&r, &d, &k, &v, &a, &b})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "dplr_step: every operand must be fp32");
  for (const at::Tensor* t : {&r, &d, &k, &a, &b})
    TORCH_CHECK(t->sizes() == at::IntArrayRef({B, H, dk}), "dplr_step: r, decay, k, a, b must be (B, H, dk)");
  TORCH_CHECK(v.sizes() == at::IntArrayRef({B, H, dv}), "dplr_step: v must be (B, H, dv)");
  const at::Tensor rc = r.contiguous(), dc = d.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor ac = a.contiguous(), bc = b.contiguous(), Sc = S.contiguous();
  at::Tensor S_new = at::empty_like(Sc);
  at::Tensor o = at::empty({B, H, dv}, S.options());
  const float *rp = rc.data_ptr<float>(), *dp = dc.data_ptr<float>(), *kp = kc.data_ptr<float>();
  const float *vp = vc.data_ptr<float>(), *ap = ac.data_ptr<float>(), *bp = bc.data_ptr<float>();
  const float* sp = Sc.data_ptr<float>();
  float *np = S_new.data_ptr<float>(), *op = o.data_ptr<float>();
  for_each_block(B * H, dk, dv, [&](int64_t bh, int64_t c0, int64_t w, float* buf) {
    dplr_block(rp + bh * dk, dp + bh * dk, kp + bh * dk, vp + bh * dv + c0, ap + bh * dk, bp + bh * dk,
               sp + bh * dk * dv + c0, np + bh * dk * dv + c0, op + bh * dv + c0, dk, dv, w, buf);
  });
  return {o, S_new};
}

// delta_scan: q, k (B, H, T, dk), v (B, H, T, dv), beta (B, H, T), alpha (B, H, T) or none, S (B, H, dk, dv) →
// o (B, H, T, dv) and the state after the T tokens — or, with `prefixes`, after every prefix (B, T, H, dk, dv).
// Token by token each element gets block_step's roundings, so the bits are those of T single-token scans whatever
// T is. A (row, head)'s column block is carried across the tokens in the thread's aligned scratch, where it stays
// in the cache (the one-token op this replaced — a fresh state a token and layer, 3 MiB through memory at 340M Gated
// DeltaNet's shape — was 54% of a 32-token prompt's time); for a d_k that 8 divides the two passes a token fold the
// trees' first three levels (predicted_rows, stored_rows_eighthed), else block_step alternates between two copies
// of the block.
std::tuple<at::Tensor, at::Tensor> delta_scan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& beta, const c10::optional<at::Tensor>& alpha,
                                              const at::Tensor& S, bool prefixes) {
  TORCH_CHECK(S.dim() == 4 && S.scalar_type() == at::kFloat, "delta_scan: S must be fp32 (B, H, dk, dv)");
  const int64_t B = S.size(0), H = S.size(1), dk = S.size(2), dv = S.size(3);
  for (const at::Tensor* t : {&q, &k, &v, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "delta_scan: q, k, v, beta must be fp32");
  TORCH_CHECK(q.dim() == 4, "delta_scan: q must be (B, H, T, dk)");
  const int64_t T = q.size(2);
  TORCH_CHECK(q.sizes() == at::IntArrayRef({B, H, T, dk}) && k.sizes() == q.sizes(), "delta_scan: q, k must be (B, H, T, dk)");
  TORCH_CHECK(v.sizes() == at::IntArrayRef({B, H, T, dv}), "delta_scan: v must be (B, H, T, dv)");
  TORCH_CHECK(beta.sizes() == at::IntArrayRef({B, H, T}), "delta_scan: beta must be (B, H, T)");
  const bool gated = alpha.has_value() && alpha->defined();
  at::Tensor a;
  if (gated) {
    TORCH_CHECK(alpha->scalar_type() == at::kFloat && alpha->sizes() == beta.sizes(), "delta_scan: alpha must be fp32 (B, H, T)");
    a = alpha->contiguous();
  }
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), bc = beta.contiguous();
  const at::Tensor Sc = S.contiguous();
  at::Tensor o = at::empty({B, H, T, dv}, S.options());
  at::Tensor out = prefixes ? at::empty({B, T, H, dk, dv}, S.options()) : at::empty_like(Sc);
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const float *bp = bc.data_ptr<float>(), *ap = gated ? a.data_ptr<float>() : nullptr, *sp = Sc.data_ptr<float>();
  float *outp = out.data_ptr<float>(), *op = o.data_ptr<float>();
  const bool eighthed = dk % 8 == 0 && dk >= 8;
  carried_blocks(B, H, T, dk, dv, sp, outp, prefixes, [&](int64_t token, int64_t c0, int64_t w, int64_t stride,
                                                          float*& state, float*& spare, float* buf) {
    const float *qt = qp + token * dk, *kt = kp + token * dk, *vt = vp + token * dv + c0;
    const float* gate = ap ? ap + token : nullptr;
    if (eighthed) {
      float u[MAX_COLUMNS];
      tree(buf, predicted_rows(kt, gate, state, dk, stride, w, buf), w);  // p = S_{t-1}ᵀk, decayed
      for (int64_t c = 0; c < w; ++c) u[c] = bp[token] * (vt[c] - buf[c]);
      tree(buf, stored_rows_eighthed(qt, kt, u, gate, true, state, dk, stride, w, buf), w);  // S ← S·α + k ⊗ u; q ⊙ S
      copy_floats(buf, op + token * dv + c0, w);
    } else {
      block_step(qt, kt, vt, bp[token], gate, state, spare, op + token * dv + c0, dk, stride, w, buf);
      std::swap(state, spare);
    }
  });
  return {o, out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def("delta_scan(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor? alpha, Tensor S, bool prefixes) -> (Tensor, Tensor)");
  m.def("linear_scan(Tensor q, Tensor k, Tensor v, Tensor? alpha, Tensor S, bool prefixes) -> (Tensor, Tensor)");
  m.def("dplr_step(Tensor r, Tensor d, Tensor k, Tensor v, Tensor a, Tensor b, Tensor S) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("delta_scan", &delta_scan);
  m.impl("linear_scan", &linear_scan);
  m.impl("dplr_step", &dplr_step);
}

extern "C" AOTITorchError aoti_torch_cpu_dplr_step(AtenTensorHandle r, AtenTensorHandle d, AtenTensorHandle k,
                                                    AtenTensorHandle v, AtenTensorHandle a, AtenTensorHandle b,
                                                    AtenTensorHandle S, AtenTensorHandle* ret0, AtenTensorHandle* ret1) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    auto [o, S_new] = dplr_step(*tensor_handle_to_tensor_pointer(r), *tensor_handle_to_tensor_pointer(d),
                                *tensor_handle_to_tensor_pointer(k), *tensor_handle_to_tensor_pointer(v),
                                *tensor_handle_to_tensor_pointer(a), *tensor_handle_to_tensor_pointer(b),
                                *tensor_handle_to_tensor_pointer(S));
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(o));
    *ret1 = torch::aot_inductor::new_tensor_handle(std::move(S_new));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_linear_scan(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                      AtenTensorHandle* alpha, AtenTensorHandle S, int32_t prefixes,
                                                      AtenTensorHandle* ret0, AtenTensorHandle* ret1) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    auto [o, S_new] = linear_scan(*tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k),
                                  *tensor_handle_to_tensor_pointer(v),
                                  torch::aot_inductor::pointer_to_optional<at::Tensor>(alpha),
                                  *tensor_handle_to_tensor_pointer(S), prefixes != 0);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(o));
    *ret1 = torch::aot_inductor::new_tensor_handle(std::move(S_new));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_delta_scan(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                     AtenTensorHandle beta, AtenTensorHandle* alpha,
                                                     AtenTensorHandle S, int32_t prefixes, AtenTensorHandle* ret0,
                                                     AtenTensorHandle* ret1) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    auto [o, S_new] = delta_scan(*tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k),
                                 *tensor_handle_to_tensor_pointer(v), *tensor_handle_to_tensor_pointer(beta),
                                 torch::aot_inductor::pointer_to_optional<at::Tensor>(alpha),
                                 *tensor_handle_to_tensor_pointer(S), prefixes != 0);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(o));
    *ret1 = torch::aot_inductor::new_tensor_handle(std::move(S_new));
  });
}
