// linserve::invariant_linear — y = x Wᵀ + b whose every output is one fixed sequence of roundings, whatever the
// number of rows, the blocking or the threads: a request's projections never depend on what shares its batch.
// Threads and register blocks split rows and outputs only, never K. Two families of forms, one per kind of CPU:
//
// AMX (AMX-BF16 CPUs): W packed once into B tiles (pack_weight: (N/16, K/32, 16, 32)); each output accumulates in
// a C tile over the K blocks in order (TDPBF16PS). A tile row is computed from its own A row alone — checked: a
// row's bits are the same with 1 or 16 rows configured — so one row, a decode batch and a prefill chunk agree.
// AMX's internal rounding is its own (it matched no sequential or fused emulation), hence no scalar twin.
//
// Lanes (AVX512-BF16; on an AVX512 CPU without it, its arithmetic in plain AVX512 instructions; on an AVX2 CPU, the
// same in two 8-float halves; else scalar code — the same bits, all four), over W packed once into groups of 16
// outputs whose 32-wide chunks lie side by side (pack_weight: (N/16, K/32, 16, 32), so a one-row pass over a group
// reads one stream; W as it is (N, K) is read too, and by the scalar code), one output y[m, n]:
//   lanes[j] = 0 (j < 16); for each 32-wide chunk c of K (the tail read as zeros), in order:
//       lanes[j] = fma(x[32c + 2j + 1], w[32c + 2j + 1], lanes[j]);  lanes[j] = fma(x[32c + 2j], w[32c + 2j], lanes[j])
//     (VDPBF16PS: bf16 products are exact in fp32, inputs' subnormals read as zero, results' flushed, RNE);
//   s = Σ lanes as the fixed tree of halves (j + j+8, then j + j+4, j + j+2, j + j+1).
// Both: y = bf16_rne(s + bias[n]) (int8 weights: bf16_rne(s · scale[n] + bias[n]); every int8 is a bf16, so the
// weights are widened exactly). The threads set FTZ/DAZ for the kernel's length so their fp32 adds round alike.
// The forms live in linear_scalar.h, linear_lanes.h, linear_avx2.h and linear_amx.h; packing in packed_weights.h; the
// threads' shares in task_shares.h; here the op, its checks and its registrations.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include "linear_amx.h"
#include "linear_avx2.h"
#include "linear_lanes.h"
#include "linear_scalar.h"
#include "packed_weights.h"
#include "task_shares.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#ifdef LINSERVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// a task grain: tasks (each a group of 16 outputs over a block of rows) until K × rows × tasks reaches this; a call of
// at most one grain runs on the calling thread alone. The shipped model's batch-1 step on 2 threads of the AVX2 host:
// 0.52-0.56 ms at 2,048 (one row over K = 256: 8 groups, 64 KB of bf16 a grain) against 0.69-0.94 at 16,384, where
// its calls ran on one thread; 1,024-4,096 alike (docs/benchmarks.md, "One row's projections over two threads")
constexpr int64_t GRAIN_K_ROWS = 2048;

#ifdef LINSERVE_AVX512BF16
std::atomic<bool> fused_rows{false};  // set at load (Init): multi-row calls fused where that is faster here
#endif

#if defined(LINSERVE_AVX2) || defined(LINSERVE_AVX512BF16)
// x split into fp32 once a call (the form's `split_rows`: AVX2's every packed call, AVX512-BF16's fused rows), into
// the calling thread's buffer on a 64-byte boundary (a 32-byte load across two cache lines costs two: a 16-byte
// aligned buffer made half of them so, 0.5x the speed). The buffer grows to the largest call's and is kept for the
// next up to SPLIT_KEPT_BYTES (64 rows × 2,816 × 4 B is 0.7 MB; a 2,048-token prompt's 23 MB is freed)
constexpr size_t SPLIT_KEPT_BYTES = 8u << 20;

std::vector<float>& split_buffer() {
  thread_local std::vector<float> split;
  return split;
}

const float* split_x(const uint16_t* x, int64_t M, int64_t K) {
  std::vector<float>& split = split_buffer();
  split.resize(static_cast<size_t>(M * split_stride(K) + 16));
  float* aligned = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(split.data()) + 63) & ~uintptr_t{63});
  split_rows(x, M, K, aligned);
  return aligned;
}

void release_split() {
  std::vector<float>& split = split_buffer();
  if (split.capacity() * sizeof(float) > SPLIT_KEPT_BYTES) std::vector<float>().swap(split);
}
#endif

template <typename W>
void run(const uint16_t* x, const float* xs, const Parts<W>& parts, uint16_t* y, int64_t ys, int64_t M, int64_t K,
         bool force_scalar, bool lanes_packed, bool fused) {  // xs: x split (AVX2; AVX512-BF16 fused), else null
  // tasks: each part's groups of outputs × blocks of rows, the parts' tasks in one range (one parallel region a
  // call); every output's arithmetic is the same whichever task holds it
  const int64_t row_block = M <= 64 ? M : 64;
  const int64_t row_blocks = (M + row_block - 1) / row_block;
  const int64_t per_task = std::max<int64_t>(1, GRAIN_K_ROWS / std::max<int64_t>(1, K * std::min<int64_t>(M, 64)));
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
      // the next task's group, which this thread most likely runs next (its share is taken from the front)
      const W* after = g + 1 < groups ? part.w + packed_group(n0 + GROUP, K) : nullptr;
      if (fused)  // (AVX512-BF16: xs, the rows four at a time fused; plain AVX512: every step fused)
        rows_avx512<W, Packed, true>(x, part.w, part.scale, part.bias, yp, m0, m1, n0, n1, K, ys, after, xs);
      else
        rows_avx512<W, Packed>(x, part.w, part.scale, part.bias, yp, m0, m1, n0, n1, K, ys, after);
      return;
    }
    if (lanes_path && !force_scalar) {
      rows_avx512<W, RowMajor>(x, part.w, part.scale, part.bias, yp, m0, m1, n0, n1, K, ys);
      return;
    }
#endif
#ifdef LINSERVE_AVX2
    if (lanes_packed) {  // ((N, K) weights: the scalar code below)
      // the next task's group, which this thread most likely runs next (its share is taken from the front)
      const W* after = g + 1 < groups ? part.w + packed_group(n0 + GROUP, K) : nullptr;
      if (fused)
        rows_avx2<W, true>(xs, part.w, part.scale, part.bias, yp, m0, m1, n0, n1, K, ys, after);
      else
        rows_avx2<W>(xs, part.w, part.scale, part.bias, yp, m0, m1, n0, n1, K, ys, after);
      return;
    }
#endif
    rows_scalar<W>(x, part.w, part.scale, part.bias, yp, m0, m1, n0, n1, K, ys);
  });
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
  TORCH_CHECK(!tiles || lanes_path, "invariant_linear: packed weights on a CPU without the lanes form's instructions");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
#ifdef LINSERVE_AVX512BF16
  // rows four at a time in fused multiply-adds where this CPU runs them faster than VDPBF16PS (`fused_rows`): packed
  // bf16 weights, at least FUSED_ROWS rows (a streamed call's after its first: they read the group from the cache),
  // every product in range — the same bits either way
  const bool first_streams = M <= streamed_rows_limit.load(std::memory_order_relaxed) && weights_streamed();
  bool fused = tiles && std::is_same<W, uint16_t>::value && M >= FUSED_ROWS + first_streams &&
               fused_rows.load(std::memory_order_relaxed);
  for (int j = 0; fused && j < parts.count; ++j) fused = packed_in_fused_range(weights[j].data_ptr());
  fused = fused && in_fused_range(xp, M * K);
#else
  // packed weights, every product in range: fused at one row too (bound by arithmetic where the weights stay cached:
  // the shipped model's head 110 -> 64 µs a call on the 2-vCPU AVX512 Xeon, its x checked in ~0.03 µs)
  bool fused = tiles;
  for (int j = 0; fused && j < parts.count; ++j)  // the weights known first (a lookup), then x's scan
    fused = std::is_same<W, int8_t>::value || packed_in_fused_range(weights[j].data_ptr());
  fused = fused && in_fused_range(xp, M * K);
#endif
#if defined(LINSERVE_AVX2) || defined(LINSERVE_AVX512BF16)
#ifdef LINSERVE_AVX2
  const bool split = tiles;  // (every packed call reads x split)
#else
  const bool split = fused;
#endif
  run<W>(xp, split ? split_x(xp, M, K) : nullptr, parts, yp, ys, M, K, force_scalar, tiles, fused);
  release_split();
#else
  run<W>(xp, nullptr, parts, yp, ys, M, K, force_scalar, tiles, fused);
#endif
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
#if defined(LINSERVE_AVX2)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#elif defined(LINSERVE_LANES)
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
    lanes_path = has_lanes();
#ifdef LINSERVE_AMX
    amx_path = lanes_path && has_amx();
#endif
#ifdef LINSERVE_AVX512BF16
    // LINSERVE_FUSED_ROWS=on|off decides for an A/B run; else timed (fused_rows_pay)
    const char* asked = std::getenv("LINSERVE_FUSED_ROWS");
    const std::string choice = asked ? asked : "auto";
    fused_rows = lanes_path && (choice == "on" || (choice != "off" && fused_rows_pay()));
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

// a call of up to this many rows streams each group with its first row alone (0: the weights fit the cache)
extern "C" int linserve_streamed_rows() {
#ifdef LINSERVE_AMX
  if (amx_path) return 0;  // (tiles: run_amx)
#endif
  return lanes_path && weights_streamed() ? static_cast<int>(streamed_rows_limit.load()) : 0;
}

extern "C" int linserve_fused_rows() {  // 1: multi-row calls run as fused multiply-adds (AVX512-BF16; see run_parts)
#ifdef LINSERVE_AVX512BF16
  return fused_rows.load() ? 1 : 0;
#else
  return 0;
#endif
}

extern "C" int linserve_set_fused_rows(int on) {  // tests' and benchmarks' switch; returns what it was
#ifdef LINSERVE_AVX512BF16
  return fused_rows.exchange(on != 0 && lanes_path) ? 1 : 0;
#else
  (void)on;
  return 0;
#endif
}

extern "C" int64_t linserve_set_streamed_rows(int64_t rows) {  // tests' and benchmarks' switch; returns what it was
  return streamed_rows_limit.exchange(rows);
}

extern "C" int64_t linserve_last_level_cache_bytes() { return last_level_cache_bytes(); }

extern "C" int linserve_int8_through_fp16() {  // 1: load_w widens int8 through AVX512-FP16 (built with its flag)
#ifdef __AVX512FP16__
  return 1;
#else
  return 0;
#endif
}

extern "C" int linserve_kernel_form() {  // 2: AMX tiles, 1: AVX512-BF16 lanes, 3: AVX512 lanes, 4: AVX2 lanes, 0: scalar
#ifdef LINSERVE_AMX
  if (amx_path) return 2;
#endif
#if defined(LINSERVE_AVX2)
  return lanes_path ? 4 : 0;
#elif defined(LINSERVE_AVX512BF16)
  return lanes_path ? 1 : 0;
#else
  return lanes_path ? 3 : 0;
#endif
}
