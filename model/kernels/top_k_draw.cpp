// linserve::top_k_draw — the decode program's top-k (and min-p) draw, one pass over each row's probabilities
// instead of torch's two `topk` calls, the tie mask and the window (server/engine/sampling.py `_draw_survivors`,
// whose tokens these are, to the bit):
//
//   kth      = the row's k-th largest probability (with multiplicity; found among the values at or above the
//              k-th largest of the row's block maxima — a few dozen of a model's 4,096)
//   survivor = p > kth, or p == kth among the first (k − #{p > kth}) such ids in vocabulary order (the ranks a
//              stable descending sort gives), and p ≥ min_p · max(p)   (min_p widened to double first)
//   cdf      = the survivors' probabilities summed one by one in vocabulary order (double, as torch's cumsum)
//   token    = the first survivor whose cdf > u · cdf_last (searchsorted, right), else V − 1 (as the window's clamp)
//
// A row with k ≤ 0 has no filter: the inverse CDF over the whole row (`_inverse_cdf`, its cumsum's additions).
// probs (B, V) float64, k (B,) int64 ≤ 64 (the caller clamps; a larger k is the host's), min_p (B,) fp32,
// uniforms (B,) fp32 → tokens (B,) int64. Rows are independent tasks: no result depends on the batch or threads.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include "work_pool.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

namespace {

constexpr int64_t MAX_K = 64;    // sampling.TOP_K_IN_PROGRAM
constexpr int64_t BLOCKS = 128;  // the row's blocks whose maxima bound its k-th largest value from below

struct Scratch {  // a thread's buffers, reused call after call
  std::vector<double> values, sorted;
  std::vector<int64_t> ids;
};

Scratch& scratch(int64_t V) {
  thread_local Scratch buffers;
  if (static_cast<int64_t>(buffers.values.size()) < V) {
    buffers.values.resize(V);
    buffers.sorted.resize(V);
    buffers.ids.resize(V);
  }
  return buffers;
}

// k ≤ 0: no filter — the inverse CDF over the whole row (sampling.py's `_inverse_cdf`: a cumsum, searchsorted).
int64_t draw_whole_row(const double* row, int64_t V, float uniform) {
  double* cdf = scratch(V).values.data();
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) cdf[i] = total += row[i];  // torch's cumsum: one addition after another
  const double target = static_cast<double>(uniform) * total;
  const int64_t at = std::upper_bound(cdf, cdf + V, target) - cdf;  // the first cdf > target
  return std::min(at, V - 1);
}

// k in [1, 64]: the k-th largest value is at least the k-th largest of the row's block maxima (those are k values
// of the row), so only values at or above that bound can matter — gathered in vocabulary order (on a row of model
// probabilities a few dozen of 4,096), their k-th largest found among them, the survivors walked among them.
int64_t draw_row(const double* row, int64_t V, int64_t k, float min_p, float uniform) {
  if (k <= 0) return draw_whole_row(row, V, uniform);
  k = std::min<int64_t>(std::min<int64_t>(k, MAX_K), V);
  const int64_t width = std::max<int64_t>(1, V / BLOCKS);  // ≥ min(V, BLOCKS) ≥ k blocks
  double maxima[2 * BLOCKS + 1];
  int64_t blocks = 0;
  for (int64_t start = 0; start < V; start += width, ++blocks) {
    double m = row[start];
    for (int64_t i = start + 1; i < std::min(start + width, V); ++i) m = std::max(m, row[i]);
    maxima[blocks] = m;
  }
  const double top = *std::max_element(maxima, maxima + blocks);
  std::nth_element(maxima, maxima + (k - 1), maxima + blocks, std::greater<double>());
  const double bound = maxima[k - 1];
  Scratch& buffers = scratch(V);
  double* values = buffers.values.data();
  int64_t* ids = buffers.ids.data();
  int64_t n = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (row[i] >= bound) {
      values[n] = row[i];
      ids[n++] = i;
    }
  }
  double* sorted = buffers.sorted.data();
  std::copy(values, values + n, sorted);
  std::nth_element(sorted, sorted + (k - 1), sorted + n, std::greater<double>());
  const double kth = sorted[k - 1];  // (n ≥ k: every block maximum at or above the bound is a candidate)
  int64_t above = 0;
  for (int64_t j = 0; j < n; ++j) above += values[j] > kth;
  const int64_t room = k - above;  // how many at the k-th value survive (≥ 1), the lowest ids first
  const double floor = static_cast<double>(min_p) * top;
  int64_t kept_ids[MAX_K];
  double cdf[MAX_K];
  int64_t kept = 0, level = 0;
  double total = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double p = values[j];
    bool survives = p > kth;
    if (p == kth) survives = ++level <= room;
    if (survives && p >= floor) {
      cdf[kept] = total += p;
      kept_ids[kept++] = ids[j];
    }
  }
  const double target = static_cast<double>(uniform) * total;
  for (int64_t j = 0; j < kept; ++j) {
    if (cdf[j] > target) return kept_ids[j];
  }
  return V - 1;
}

at::Tensor top_k_draw(const at::Tensor& probs, const at::Tensor& k, const at::Tensor& min_p,
                      const at::Tensor& uniforms) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kDouble, "top_k_draw: probs must be (B, V) float64");
  TORCH_CHECK(k.scalar_type() == at::kLong && min_p.scalar_type() == at::kFloat &&
                  uniforms.scalar_type() == at::kFloat,
              "top_k_draw: k int64, min_p and uniforms fp32");
  const auto p = probs.contiguous();
  const auto ks = k.contiguous(), floors = min_p.contiguous(), us = uniforms.contiguous();
  const int64_t B = p.size(0), V = p.size(1);
  TORCH_CHECK(ks.numel() == B && floors.numel() == B && us.numel() == B, "top_k_draw: one k, min_p, uniform a row");
  TORCH_CHECK(V > 0, "top_k_draw: an empty vocabulary");
  auto tokens = at::detail::empty_cpu({B}, at::kLong, false, c10::nullopt);  // (B,) (no dispatch: CPU only)
  const double* data = p.data_ptr<double>();
  const int64_t* k_data = ks.data_ptr<int64_t>();
  const float* m_data = floors.data_ptr<float>();
  const float* u_data = us.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  linserve::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) out[b] = draw_row(data + b * V, V, k_data[b], m_data[b], u_data[b]);
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def("top_k_draw(Tensor probs, Tensor k, Tensor min_p, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) { m.impl("top_k_draw", &top_k_draw); }

extern "C" AOTITorchError aoti_torch_cpu_top_k_draw(AtenTensorHandle probs, AtenTensorHandle k,
                                                     AtenTensorHandle min_p, AtenTensorHandle uniforms,
                                                     AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    auto tokens = top_k_draw(*tensor_handle_to_tensor_pointer(probs), *tensor_handle_to_tensor_pointer(k),
                             *tensor_handle_to_tensor_pointer(min_p), *tensor_handle_to_tensor_pointer(uniforms));
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(tokens));
  });
}
