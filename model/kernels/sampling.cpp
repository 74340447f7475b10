// The decode program's sampling, one pass a row (server/engine/sampling.py, whose tokens these are, to the bit):
//
// linserve::choose_tokens — `choose_tokens`: each row's parameters gathered from its slot, its logits checked finite
//   (a row that is not samples from zeros), logit_bias and the penalties (`process_logits`: each elementwise step
//   rounded as torch rounds it), its counter-based uniform (`counter_uniforms`), the draw below, and the flag of a
//   row whose filters only the host applies (top-p, a k above 64, min-p alone).
// linserve::tempered_draw — `_draw_in_program`, the draw alone (what the tests hold against torch's form; the
//   programs call choose_tokens), over processed logits: what torch did in a
//   division, exponentials over the whole vocabulary, two `topk` calls, the tie mask and the window:
//
//   greedy   = argmax(logits) (the first of equals) where temperature ≤ 0 — nothing else is computed for the row
//   scaled   = logits / temperature (fp32), m = max(scaled)
//   weight   = exp(double(scaled − m)): unnormalised (the largest is 1) — the draw below is the same whatever the
//              scale, so the sum over the vocabulary is never taken; exp is SLEEF's vector exp (u10), what torch's
//              CPU kernels and Inductor's CPU code compute (std::exp where the kernel is built without vectors)
//   k ≥ 1:   kth = the row's k-th largest weight (with multiplicity); survivor = w > kth, or w == kth among the
//              first (k − #{w > kth}) such ids in vocabulary order (the ranks a stable descending sort gives), and
//              w ≥ min_p · max(w)   (min_p widened to double first)
//            cdf = the survivors' weights summed one by one in vocabulary order (double, as torch's cumsum)
//            token = the first survivor whose cdf > u · cdf_last (searchsorted, right), else V − 1 (the window's clamp)
//   k ≤ 0:   no filter — the inverse CDF over the whole row (`_inverse_cdf`: a cumsum's additions, searchsorted).
//
// With a top-k only the weights that can survive are computed: the k-th largest weight is at least the weight of
// the k-th largest of the row's block maxima of `scaled` (those are k of the row's values, and exp keeps order), so
// only values at or above that bound are candidates — gathered in vocabulary order, a few dozen of a model's 4,096.
// Every other value is below the bound, its weight at most exp(double(below − m)) for the float just below it; where
// that is not strictly less than the candidates' k-th weight (weights that underflow to 0, or tie at 1 across
// floats nearer m than double resolves) the row takes every weight, as torch does.
// logits (B, V) fp32, temperature (B,) fp32, k (B,) int64 ≤ 64 (the caller clamps; a larger k is the host's),
// min_p (B,) fp32, uniforms (B,) fp32 → tokens (B,) int64. Rows are independent tasks: nothing depends on the batch.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include "work_pool.h"

#if defined(LINSERVE_LANES) || defined(LINSERVE_AVX2)
#include <immintrin.h>
#include <sleef.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr int64_t DRAW_MAX_K = 64;    // sampling.TOP_K_IN_PROGRAM
constexpr int64_t DRAW_BLOCKS = 128;  // the row's blocks whose maxima bound its k-th largest value from below

struct DrawScratch {  // a thread's buffers, reused call after call
  std::vector<double> weights, values, sorted;
  std::vector<float> scaled;
  std::vector<int64_t> ids;
};

DrawScratch& draw_scratch(int64_t V) {
  thread_local DrawScratch buffers;
  if (static_cast<int64_t>(buffers.weights.size()) < V + 8) {
    buffers.weights.resize(V + 8);
    buffers.values.resize(V + 8);
    buffers.sorted.resize(V + 8);
    buffers.ids.resize(V + 8);
    buffers.scaled.resize(V + 8);
  }
  return buffers;
}

// exp of n doubles in place, elementwise as torch's CPU exp computes them (SLEEF's u10 in the vector forms)
void exp_in_place(double* x, int64_t n) {
#if defined(LINSERVE_LANES)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm512_storeu_pd(x + i, Sleef_expd8_u10(_mm512_loadu_pd(x + i)));
  if (i < n) {
    alignas(64) double tail[8] = {};
    std::copy(x + i, x + n, tail);
    _mm512_store_pd(tail, Sleef_expd8_u10(_mm512_load_pd(tail)));
    std::copy(tail, tail + (n - i), x + i);
  }
#elif defined(LINSERVE_AVX2)
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) _mm256_storeu_pd(x + i, Sleef_expd4_u10(_mm256_loadu_pd(x + i)));
  if (i < n) {
    alignas(32) double tail[4] = {};
    std::copy(x + i, x + n, tail);
    _mm256_store_pd(tail, Sleef_expd4_u10(_mm256_load_pd(tail)));
    std::copy(tail, tail + (n - i), x + i);
  }
#else
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
#endif
}

// whether any of n floats is a NaN
bool any_nan(const float* x, int64_t n) {
  uint32_t nan = 0;
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
  for (int64_t i = 0; i < n; ++i) nan |= (bits[i] & 0x7fffffffu) > 0x7f800000u;  // (a plain loop: vectorised)
  return nan != 0;
}

// whether all n floats are finite
bool all_finite(const float* x, int64_t n) {
  uint32_t bad = 0;
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
  for (int64_t i = 0; i < n; ++i) bad |= (bits[i] & 0x7f800000u) == 0x7f800000u;
  return bad == 0;
}

// the largest of n ≥ 1 floats without a NaN among them (the order of comparisons cannot change it)
float largest(const float* x, int64_t n) {
  float best = x[0];
  int64_t i = 0;
#if defined(LINSERVE_LANES) || defined(LINSERVE_AVX2)
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    best = *std::max_element(lanes, lanes + 8);
  }
#endif
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// torch.argmax: the first of the largest (a NaN counts as the largest)
int64_t first_argmax(const float* row, int64_t V) {
  if (any_nan(row, V)) {
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(row[i])) return i;
  }
  const float best = largest(row, V);
  int64_t i = 0;
  while (row[i] != best) ++i;
  return i;
}

// the inverse CDF over n weights in vocabulary order (`_inverse_cdf`: a cumsum, searchsorted right, clamped)
int64_t inverse_cdf(const double* weights, int64_t n, float uniform, double* cdf) {
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) cdf[i] = total += weights[i];  // torch's cumsum: one addition after another
  const double target = static_cast<double>(uniform) * total;
  return std::min<int64_t>(std::upper_bound(cdf, cdf + n, target) - cdf, n - 1);
}

// k in [1, 64] over candidates (values: their weights, ids: their ids, in vocabulary order; every weight that can
// survive among them): `_draw_survivors`' token. Min-p is against the row's largest weight, exp(m − m) = 1 exactly
int64_t draw_candidates(const double* values, const int64_t* ids, int64_t n, double kth, int64_t k, float min_p,
                        float uniform, int64_t V) {
  int64_t above = 0;
  for (int64_t j = 0; j < n; ++j) above += values[j] > kth;
  const int64_t room = k - above;  // how many at the k-th value survive (≥ 1), the lowest ids first
  const double floor = static_cast<double>(min_p);  // min_p · max(w), widened first: max(w) is 1
  int64_t kept_ids[DRAW_MAX_K];
  double cdf[DRAW_MAX_K];
  int64_t kept = 0, level = 0;
  double total = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double w = values[j];
    bool survives = w > kth;
    if (w == kth) survives = ++level <= room;
    if (survives && w >= floor) {
      cdf[kept] = total += w;
      kept_ids[kept++] = ids[j];
    }
  }
  const double target = static_cast<double>(uniform) * total;
  for (int64_t j = 0; j < kept; ++j) {
    if (cdf[j] > target) return kept_ids[j];
  }
  return V - 1;
}

// the k-th largest of n values (with multiplicity), found in a copy
double kth_largest(const double* values, int64_t n, int64_t k, double* sorted) {
  std::copy(values, values + n, sorted);
  std::nth_element(sorted, sorted + (k - 1), sorted + n, std::greater<double>());
  return sorted[k - 1];
}

int64_t draw_row(const float* row, int64_t V, float temperature, int64_t k, float min_p, float uniform) {
  if (!(temperature > 0)) return first_argmax(row, V);
  DrawScratch& s = draw_scratch(V);
  double* weights = s.weights.data();
  float* scaled = s.scaled.data();
  for (int64_t i = 0; i < V; ++i) scaled[i] = row[i] / temperature;  // (B, V) / T, rounded as torch divides
  if (any_nan(scaled, V)) return V - 1;  // (processed logits are finite or -inf: a NaN is no distribution)
  const int64_t width = std::max<int64_t>(1, V / DRAW_BLOCKS);  // ≥ min(V, DRAW_BLOCKS) ≥ k blocks
  float maxima[2 * DRAW_BLOCKS + 1];
  int64_t blocks = 0;
  for (int64_t start = 0; start < V; start += width)
    maxima[blocks++] = largest(scaled + start, std::min(width, V - start));
  const float m = largest(maxima, blocks);
  if (!(m > -std::numeric_limits<float>::infinity())) return V - 1;  // every token masked: torch's form says V − 1
  auto all_weights = [&] {
    for (int64_t i = 0; i < V; ++i) weights[i] = static_cast<double>(scaled[i] - m);
    exp_in_place(weights, V);
  };
  if (k <= 0) {
    all_weights();
    return inverse_cdf(weights, V, uniform, s.values.data());
  }
  k = std::min<int64_t>(std::min<int64_t>(k, DRAW_MAX_K), V);
  std::nth_element(maxima, maxima + (k - 1), maxima + blocks, std::greater<float>());
  const float bound = maxima[k - 1];
  double* values = s.values.data();
  int64_t* ids = s.ids.data();
  int64_t n = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (scaled[i] >= bound) {
      values[n] = static_cast<double>(scaled[i] - m);
      ids[n++] = i;
    }
  }
  double below = static_cast<double>(std::nextafter(bound, -std::numeric_limits<float>::infinity()) - m);
  values[n] = below;  // (exp'd with the candidates, then read back)
  exp_in_place(values, n + 1);
  below = values[n];
  const double kth = kth_largest(values, n, k, s.sorted.data());  // (n ≥ k: the block maxima at the bound)
  if (!(kth > below)) {  // a value outside the candidates could tie with the k-th: every weight, as torch takes them
    all_weights();
    for (int64_t i = 0; i < V; ++i) ids[i] = i;
    return draw_candidates(weights, ids, V, kth_largest(weights, V, k, s.sorted.data()), k, min_p, uniform, V);
  }
  return draw_candidates(values, ids, n, kth, k, min_p, uniform, V);
}

at::Tensor tempered_draw(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& k,
                         const at::Tensor& min_p, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "tempered_draw: logits must be (B, V) fp32");
  TORCH_CHECK(k.scalar_type() == at::kLong && temperature.scalar_type() == at::kFloat &&
                  min_p.scalar_type() == at::kFloat && uniforms.scalar_type() == at::kFloat,
              "tempered_draw: k int64, temperature, min_p and uniforms fp32");
  const auto x = logits.contiguous();
  const auto ts = temperature.contiguous(), ks = k.contiguous(), floors = min_p.contiguous(), us = uniforms.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(ts.numel() == B && ks.numel() == B && floors.numel() == B && us.numel() == B,
              "tempered_draw: one temperature, k, min_p, uniform a row");
  TORCH_CHECK(V > 0, "tempered_draw: an empty vocabulary");
  auto tokens = at::detail::empty_cpu({B}, at::kLong, false, c10::nullopt);  // (B,) (no dispatch: CPU only)
  const float* data = x.data_ptr<float>();
  const float* t_data = ts.data_ptr<float>();
  const int64_t* k_data = ks.data_ptr<int64_t>();
  const float* m_data = floors.data_ptr<float>();
  const float* u_data = us.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  linserve::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      out[b] = draw_row(data + b * V, V, t_data[b], k_data[b], m_data[b], u_data[b]);
  });
  return tokens;
}

constexpr int64_t MASK32 = 0xFFFFFFFFLL;

int64_t mix32(int64_t h) {  // sampling.py's `_mix32`: 32-bit values in int64, the products exact
  for (const int64_t multiplier : {0x7FEB352DLL, 0x2C1B3C6DLL}) {
    h ^= h >> 16;
    h = (h * multiplier) & MASK32;
  }
  return h ^ (h >> 15);
}

float counter_uniform(int64_t seed, int64_t position) {  // `counter_uniforms`: 24 bits in [0, 1)
  int64_t h = mix32((seed & MASK32) ^ 0x1B873593LL);
  h = mix32(h ^ ((seed >> 32) & MASK32));
  h = mix32(h ^ (position & MASK32));
  return static_cast<float>(h >> 8) * (1.0f / static_cast<float>(1 << 24));
}

// `process_logits` over one row (finite: else the row's logits read as zeros): logit_bias, then repetition (over
// seen), frequency and presence (over generated) — each step rounded on its own, as torch's elementwise ops
void process_row(const float* logits, bool finite, const float* bias, const float* counts, const bool* seen,
                 float rep, float presence, float frequency, float* out, int64_t V) {
  const uint8_t* flags = reinterpret_cast<const uint8_t*>(seen);  // (torch's bools: 0 or 1)
  int64_t i = 0;
#if defined(LINSERVE_LANES) || defined(LINSERVE_AVX2)
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), by = _mm256_set1_ps(rep);
  const __m256 per_count = _mm256_set1_ps(frequency), once = _mm256_set1_ps(presence);
  for (; i + 8 <= V; i += 8) {  // (the same roundings as the scalar loop below, 8 at a time)
    __m256 x = _mm256_add_ps(finite ? _mm256_loadu_ps(logits + i) : zero, _mm256_loadu_ps(bias + i));
    const __m256 c = _mm256_loadu_ps(counts + i);
    const __m256 penalised = _mm256_blendv_ps(_mm256_mul_ps(x, by), _mm256_div_ps(x, by),
                                              _mm256_cmp_ps(x, zero, _CMP_GT_OQ));
    const __m256i flag = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(flags + i)));
    const __m256 generated = _mm256_cmp_ps(c, zero, _CMP_GT_OQ);
    const __m256 hit = _mm256_or_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(flag, _mm256_setzero_si256())), generated);
    x = _mm256_blendv_ps(x, penalised, hit);
    x = _mm256_sub_ps(x, _mm256_mul_ps(per_count, c));
    _mm256_storeu_ps(out + i, _mm256_sub_ps(x, _mm256_mul_ps(once, _mm256_and_ps(generated, one))));
  }
#endif
  for (; i < V; ++i) {
    float x = (finite ? logits[i] : 0.0f) + bias[i];
    const float c = counts[i];
    const float penalised = x > 0 ? x / rep : x * rep;
    x = (flags[i] || c > 0) ? penalised : x;
    x = x - frequency * c;
    out[i] = x - presence * (c > 0 ? 1.0f : 0.0f);
  }
}

// the SlotSampling tensors both ops read (floats (6, N), seed (N,), bias and counts fp32 (N, V), seen bool (N, V)):
// checked, N returned
int64_t check_slot_sampling(const char* op, const at::Tensor& floats, const at::Tensor& seed, const at::Tensor& bias,
                            const at::Tensor& counts, const at::Tensor& seen, int64_t V) {
  TORCH_CHECK(floats.dim() == 2 && floats.size(0) == 6 && floats.scalar_type() == at::kFloat, op,
              ": floats must be fp32 (6, N)");
  const int64_t N = floats.size(1);
  TORCH_CHECK(seed.dim() == 1 && seed.size(0) == N && seed.scalar_type() == at::kLong, op, ": seed must be int64 (N,)");
  TORCH_CHECK(bias.sizes() == at::IntArrayRef({N, V}) && bias.scalar_type() == at::kFloat &&
                  counts.sizes() == at::IntArrayRef({N, V}) && counts.scalar_type() == at::kFloat &&
                  seen.sizes() == at::IntArrayRef({N, V}) && seen.scalar_type() == at::kBool,
              op, ": bias and counts must be fp32 (N, V), seen bool (N, V)");
  return N;
}

// every row's slot within the N slots
void check_slots(const char* op, const int64_t* slot_of, int64_t rows, int64_t N) {
  for (int64_t b = 0; b < rows; ++b)
    TORCH_CHECK(slot_of[b] >= 0 && slot_of[b] < N, op, ": slot ", slot_of[b], " is outside the ", N, " slots");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> choose_tokens(
    const at::Tensor& logits, const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& floats,
    const at::Tensor& top_k, const at::Tensor& seed, const at::Tensor& bias, const at::Tensor& counts,
    const at::Tensor& seen) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "choose_tokens: logits must be (B, V) fp32");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "choose_tokens: an empty vocabulary");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == B && positions.scalar_type() == at::kLong,
              "choose_tokens: slots and positions must be int64 (B,)");
  const int64_t N = check_slot_sampling("choose_tokens", floats, seed, bias, counts, seen, V);
  TORCH_CHECK(top_k.dim() == 1 && top_k.size(0) == N && top_k.scalar_type() == at::kLong,
              "choose_tokens: top_k must be int64 (N,)");
  const auto x = logits.contiguous(), sl = slots.contiguous(), ps = positions.contiguous();
  const auto fl = floats.contiguous(), ks = top_k.contiguous(), sd = seed.contiguous();
  const auto bi = bias.contiguous(), co = counts.contiguous(), se = seen.contiguous();
  const int64_t* slot_of = sl.data_ptr<int64_t>();
  check_slots("choose_tokens", slot_of, B, N);
  auto tokens = at::detail::empty_cpu({B}, at::kLong, false, c10::nullopt);  // (B,)
  auto finite = at::detail::empty_cpu({B}, at::kBool, false, c10::nullopt);  // (B,)
  auto uniforms = at::detail::empty_cpu({B}, at::kFloat, false, c10::nullopt);  // (B,)
  auto processed = at::detail::empty_cpu({B, V}, at::kFloat, false, c10::nullopt);  // (B, V)
  auto redraw = at::detail::empty_cpu({B}, at::kBool, false, c10::nullopt);  // (B,)
  const float *xp = x.data_ptr<float>(), *fp = fl.data_ptr<float>(), *bp = bi.data_ptr<float>();
  const float* cp = co.data_ptr<float>();
  const bool* seen_p = se.data_ptr<bool>();
  const int64_t *pos = ps.data_ptr<int64_t>(), *kp = ks.data_ptr<int64_t>(), *seeds = sd.data_ptr<int64_t>();
  int64_t* out = tokens.data_ptr<int64_t>();
  bool *ok = finite.data_ptr<bool>(), *again = redraw.data_ptr<bool>();
  float *up = uniforms.data_ptr<float>(), *pp = processed.data_ptr<float>();
  linserve::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t slot = slot_of[b];
      const float* row = xp + b * V;
      const bool finite_row = all_finite(row, V);
      const float temperature = fp[slot], top_p = fp[N + slot], min_p = fp[2 * N + slot];
      float* processed_row = pp + b * V;
      process_row(row, finite_row, bp + slot * V, cp + slot * V, seen_p + slot * V, fp[3 * N + slot],
                  fp[4 * N + slot], fp[5 * N + slot], processed_row, V);
      const float uniform = counter_uniform(seeds[slot], pos[b]);
      const int64_t k = kp[slot];
      const bool filters = k > 0 || top_p < 1 || min_p > 0;  // SamplingParams.uses_filters
      const int64_t window = filters ? std::min<int64_t>(std::max<int64_t>(k, 1), DRAW_MAX_K) : 0;
      out[b] = draw_row(processed_row, V, temperature, window, min_p, uniform);
      ok[b] = finite_row;
      up[b] = uniform;
      again[b] = temperature > 0 && filters && (k <= 0 || k > DRAW_MAX_K || top_p < 1);
    }
  });
  return std::make_tuple(tokens, finite, uniforms, processed, redraw);
}

// `accept_drafts` (server/engine/spec/verify_program.py), one row at a time: logits (P, T, V) fp32 of feeding
// ids (P, T) = [pending, d1 … dk] →
// (emitted (P, T) int64, kept (P,) int64, finite (P,) bool, uniforms (P,) fp32, processed (P, V), last (P, V)).
// Position j is processed as a decode step after d1 … dj would be: the slot's counts and seen flags with d1 … dj
// added (exact: small integers in fp32), the same penalties (`process_row`), the uniform of (seed, position + j) and
// the unfiltered draw (`sample_plain`: draw_row with no window). The row stops at the first position whose choice
// is not the next draft or past its limit: that choice is the next token (`kept` drafts accepted), and
// `emitted`'s later positions are −1 (the torch form computes them; nothing reads them). A row whose logits
// are not all finite reads zeros at every position, its `last` zeros, as the torch form.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_choose(
    const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& limits, const at::Tensor& slots,
    const at::Tensor& positions, const at::Tensor& floats, const at::Tensor& seed, const at::Tensor& bias,
    const at::Tensor& counts, const at::Tensor& seen) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == at::kFloat, "verify_choose: logits must be (P, T, V) fp32");
  const int64_t P = logits.size(0), T = logits.size(1), V = logits.size(2);
  TORCH_CHECK(V > 0 && T > 0, "verify_choose: an empty vocabulary or no position");
  TORCH_CHECK(ids.sizes() == at::IntArrayRef({P, T}) && ids.scalar_type() == at::kLong,
              "verify_choose: ids must be int64 (P, T)");
  for (const at::Tensor* t : {&limits, &slots, &positions})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == P && t->scalar_type() == at::kLong,
                "verify_choose: limits, slots and positions must be int64 (P,)");
  const int64_t N = check_slot_sampling("verify_choose", floats, seed, bias, counts, seen, V);
  const auto x = logits.contiguous(), id = ids.contiguous(), li = limits.contiguous(), sl = slots.contiguous();
  const auto ps = positions.contiguous(), fl = floats.contiguous(), sd = seed.contiguous();
  const auto bi = bias.contiguous(), co = counts.contiguous(), se = seen.contiguous();
  const int64_t *slot_of = sl.data_ptr<int64_t>(), *idp = id.data_ptr<int64_t>(), *lim = li.data_ptr<int64_t>();
  check_slots("verify_choose", slot_of, P, N);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t j = 1; j < T; ++j)
      TORCH_CHECK(idp[p * T + j] >= 0 && idp[p * T + j] < V, "verify_choose: draft ", idp[p * T + j],
                  " is outside the vocabulary");
  auto emitted = at::detail::empty_cpu({P, T}, at::kLong, false, c10::nullopt);  // (P, T)
  auto kept = at::detail::empty_cpu({P}, at::kLong, false, c10::nullopt);  // (P,)
  auto finite = at::detail::empty_cpu({P}, at::kBool, false, c10::nullopt);  // (P,)
  auto uniforms = at::detail::empty_cpu({P}, at::kFloat, false, c10::nullopt);  // (P,)
  auto processed = at::detail::empty_cpu({P, V}, at::kFloat, false, c10::nullopt);  // (P, V)
  auto last = at::detail::empty_cpu({P, V}, at::kFloat, false, c10::nullopt);  // (P, V)
  const float *xp = x.data_ptr<float>(), *fp = fl.data_ptr<float>(), *bp = bi.data_ptr<float>();
  const float* cp = co.data_ptr<float>();
  const bool* seen_p = se.data_ptr<bool>();
  const int64_t *pos = ps.data_ptr<int64_t>(), *seeds = sd.data_ptr<int64_t>();
  int64_t *out = emitted.data_ptr<int64_t>(), *kp = kept.data_ptr<int64_t>();
  bool* ok = finite.data_ptr<bool>();
  float *up = uniforms.data_ptr<float>(), *pp = processed.data_ptr<float>(), *lp = last.data_ptr<float>();
  linserve::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> row_counts;
    thread_local std::vector<uint8_t> row_seen;
    row_counts.resize(V);
    row_seen.resize(V);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t slot = slot_of[p];
      const float* row = xp + p * T * V;
      const bool finite_row = all_finite(row, T * V);
      std::copy(cp + slot * V, cp + (slot + 1) * V, row_counts.data());
      std::copy(seen_p + slot * V, seen_p + (slot + 1) * V, reinterpret_cast<bool*>(row_seen.data()));
      const float temperature = fp[slot];
      float* processed_row = pp + p * V;
      int64_t j = 0;
      for (;; ++j) {
        if (j > 0) {  // position j sees d1 … dj
          const int64_t draft = idp[p * T + j];
          row_counts[draft] += 1.0f;
          row_seen[draft] = 1;
        }
        process_row(row + j * V, finite_row, bp + slot * V, row_counts.data(),
                    reinterpret_cast<const bool*>(row_seen.data()), fp[3 * N + slot], fp[4 * N + slot],
                    fp[5 * N + slot], processed_row, V);
        const float uniform = counter_uniform(seeds[slot], pos[p] + j);
        const int64_t chosen = draw_row(processed_row, V, temperature, 0, 0.0f, uniform);
        out[p * T + j] = chosen;
        if (j + 1 >= T || j >= lim[p] || chosen != idp[p * T + j + 1]) {
          up[p] = uniform;
          break;
        }
      }
      for (int64_t rest = j + 1; rest < T; ++rest) out[p * T + rest] = -1;
      kp[p] = j;
      ok[p] = finite_row;
      if (finite_row)
        std::copy(row + j * V, row + (j + 1) * V, lp + p * V);
      else
        std::fill(lp + p * V, lp + (p + 1) * V, 0.0f);
    }
  });
  return std::make_tuple(emitted, kept, finite, uniforms, processed, last);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def("tempered_draw(Tensor logits, Tensor temperature, Tensor k, Tensor min_p, Tensor uniforms) -> Tensor");
  m.def("choose_tokens(Tensor logits, Tensor slots, Tensor positions, Tensor floats, Tensor top_k, Tensor seed, "
        "Tensor bias, Tensor counts, Tensor seen) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("verify_choose(Tensor logits, Tensor ids, Tensor limits, Tensor slots, Tensor positions, Tensor floats, "
        "Tensor seed, Tensor bias, Tensor counts, Tensor seen) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("tempered_draw", &tempered_draw);
  m.impl("choose_tokens", &choose_tokens);
  m.impl("verify_choose", &verify_choose);
}

extern "C" AOTITorchError aoti_torch_cpu_choose_tokens(AtenTensorHandle logits, AtenTensorHandle slots,
                                                        AtenTensorHandle positions, AtenTensorHandle floats,
                                                        AtenTensorHandle top_k, AtenTensorHandle seed,
                                                        AtenTensorHandle bias, AtenTensorHandle counts,
                                                        AtenTensorHandle seen, AtenTensorHandle* ret0,
                                                        AtenTensorHandle* ret1, AtenTensorHandle* ret2,
                                                        AtenTensorHandle* ret3, AtenTensorHandle* ret4) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    auto [tokens, finite, uniforms, processed, redraw] = choose_tokens(
        *tensor_handle_to_tensor_pointer(logits), *tensor_handle_to_tensor_pointer(slots),
        *tensor_handle_to_tensor_pointer(positions), *tensor_handle_to_tensor_pointer(floats),
        *tensor_handle_to_tensor_pointer(top_k), *tensor_handle_to_tensor_pointer(seed),
        *tensor_handle_to_tensor_pointer(bias), *tensor_handle_to_tensor_pointer(counts),
        *tensor_handle_to_tensor_pointer(seen));
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(tokens));
    *ret1 = torch::aot_inductor::new_tensor_handle(std::move(finite));
    *ret2 = torch::aot_inductor::new_tensor_handle(std::move(uniforms));
    *ret3 = torch::aot_inductor::new_tensor_handle(std::move(processed));
    *ret4 = torch::aot_inductor::new_tensor_handle(std::move(redraw));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_verify_choose(AtenTensorHandle logits, AtenTensorHandle ids,
                                                        AtenTensorHandle limits, AtenTensorHandle slots,
                                                        AtenTensorHandle positions, AtenTensorHandle floats,
                                                        AtenTensorHandle seed, AtenTensorHandle bias,
                                                        AtenTensorHandle counts, AtenTensorHandle seen,
                                                        AtenTensorHandle* ret0, AtenTensorHandle* ret1,
                                                        AtenTensorHandle* ret2, AtenTensorHandle* ret3,
                                                        AtenTensorHandle* ret4, AtenTensorHandle* ret5) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    auto [emitted, kept, finite, uniforms, processed, last] = verify_choose(
        *tensor_handle_to_tensor_pointer(logits), *tensor_handle_to_tensor_pointer(ids),
        *tensor_handle_to_tensor_pointer(limits), *tensor_handle_to_tensor_pointer(slots),
        *tensor_handle_to_tensor_pointer(positions), *tensor_handle_to_tensor_pointer(floats),
        *tensor_handle_to_tensor_pointer(seed), *tensor_handle_to_tensor_pointer(bias),
        *tensor_handle_to_tensor_pointer(counts), *tensor_handle_to_tensor_pointer(seen));
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(emitted));
    *ret1 = torch::aot_inductor::new_tensor_handle(std::move(kept));
    *ret2 = torch::aot_inductor::new_tensor_handle(std::move(finite));
    *ret3 = torch::aot_inductor::new_tensor_handle(std::move(uniforms));
    *ret4 = torch::aot_inductor::new_tensor_handle(std::move(processed));
    *ret5 = torch::aot_inductor::new_tensor_handle(std::move(last));
  });
}
