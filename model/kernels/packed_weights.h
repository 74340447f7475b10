// invariant_linear.cpp's weights packed once at load: on huge pages, in the form the CPU's kernel reads,
// and (the lanes forms) whether every product of a call is exact and normal, so that a fused multiply-add keeps the bits.
#pragma once

#include <ATen/ATen.h>

#include "linear_amx.h"
#include "linear_avx2.h"
#include "linear_lanes.h"

#include <memory>
#include <mutex>
#include <unordered_set>

#include <sys/mman.h>

namespace {

bool lanes_path = false;  // set at load when the CPU has the lanes form's instructions (the library was built for it)

// The lanes forms' fused step (AVX512's dot_chunk<true>, AVX2's dot_half<true>, AVX512-BF16's fused rows: fused_quad)
// gives the unfused step's (VDPBF16PS's) bits when every product is
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
  if (lanes_path) {
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
#ifdef LINSERVE_AVX2
  if (lanes_path) {  // the same test on 16 exponents at a time: e == 0, or low <= e <= high (unsigned: min/max)
    const __m256i low = _mm256_set1_epi16(FUSED_EXPONENT_LOW), high = _mm256_set1_epi16(FUSED_EXPONENT_HIGH);
    const __m256i field = _mm256_set1_epi16(0xff), zero = _mm256_setzero_si256();
    __m256i all = _mm256_set1_epi16(-1);
    for (; i + 16 <= n; i += 16) {
      const __m256i e = _mm256_and_si256(
          _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i)), 7), field);
      const __m256i inside = _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_max_epu16(e, low), e),
                                              _mm256_cmpeq_epi16(_mm256_min_epu16(e, high), e));
      all = _mm256_and_si256(all, _mm256_or_si256(_mm256_cmpeq_epi16(e, zero), inside));
    }
    if (_mm256_movemask_epi8(all) != -1) return false;
  }
#endif
  for (; i < n; ++i) {
    const int e = (v[i] >> 7) & 0xff;
    if (e != 0 && (e < FUSED_EXPONENT_LOW || e > FUSED_EXPONENT_HIGH)) return false;
  }
  return true;
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
  if (!lanes_path) return weight.contiguous();  // the scalar form reads (N, K)
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
#ifdef LINSERVE_AVX2
  if (weight.scalar_type() == at::kChar)  // each half of a chunk odd elements first (linear_avx2.h's load_weight_half):
    // [nb][kb][n][h][1 - e][j] = w[16nb + n][32kb + 16h + 2j + e]
    packed.view({Nb, Kb, 16, 2, 2, 8}).copy_(padded.view({Nb, 16, Kb, 2, 8, 2}).permute({0, 2, 1, 3, 5, 4}).flip({4}));
  else
#endif
    packed.copy_(padded.view({Nb, 16, Kb, 32}).permute({0, 2, 1, 3}));
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
}

}  // namespace
