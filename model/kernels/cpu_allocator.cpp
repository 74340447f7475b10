// A caching CPU allocator for torch's CPU tensors: freed blocks of up to a megabyte kept by size class and handed
// out again, instead of glibc's posix_memalign and free on every tensor a step makes.
//
// A compiled decode step allocates its intermediate buffers (~70 a step) and frees them before it returns; torch's
// default CPU allocator takes each from glibc's heap with 64-byte alignment, and a memalign'd chunk of a kilobyte
// or more goes through glibc's bins (`_int_malloc`, `unlink_chunk`, `malloc_consolidate` on the way back): ~8% of
// the shipped model's one-row step on a 2-vCPU Xeon (perf). Here a block's size is rounded up to one of four
// classes an octave (at most 25% more), a freed block goes on its class's list (at most 64 a class, 64 MB in all;
// beyond that, or over a megabyte, it goes back to glibc) and the next request of its class takes it back.
//
// A block is 64 bytes of header (its class) then the data, 64-byte aligned like torch's own (c10::gAlignment);
// the DataPtr's context is the data itself, so `is_simple_data_ptr` and raw_allocate/raw_deallocate hold. The
// allocator is never destroyed (a tensor may outlive any static), and a tensor made before it was installed keeps
// its own deleter. Not seen by torch's CPU memory profiler. Installed by `linserve_cpu_allocator(1)` (the kernels'
// loader, unless LINSERVE_CPU_ALLOCATOR=default), `linserve_cpu_allocator(0)` gives torch's own back.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

#include <pthread.h>

namespace {

constexpr size_t kAlign = 64;                    // = c10::gAlignment on x86-64
constexpr size_t kHeader = kAlign;               // (the class index in its first 4 bytes)
constexpr int kMinShift = 6;                     // the smallest class: 64 bytes
constexpr int kMaxShift = 20;                    // the largest cached class: 1 MB
constexpr int kPerOctave = 4;
constexpr int kClasses = (kMaxShift - kMinShift) * kPerOctave + 1;
constexpr uint32_t kUncached = 0xFFFFFFFFu;      // a block straight from glibc and back to it
constexpr size_t kMaxPerClass = 64;
constexpr size_t kMaxCachedBytes = size_t{64} << 20;

// class c's bytes: 64 · 2^(c/4) · (1 + (c%4)/4) — 64, 80, 96, 112, 128, 160, …, 1 MB
constexpr size_t class_bytes(int c) {
  return (size_t{1} << (kMinShift + c / kPerOctave)) / kPerOctave * (kPerOctave + c % kPerOctave);
}

int class_of(size_t n) {  // the smallest class of at least n bytes, or -1 past the largest
  if (n <= class_bytes(0)) return 0;
  if (n > class_bytes(kClasses - 1)) return -1;
  const int shift = 63 - __builtin_clzll(n - 1);  // 2^shift < n ≤ 2^(shift + 1)
  const size_t quarter = size_t{1} << (shift - 2);
  const int sub = static_cast<int>((n - 1 - (size_t{1} << shift)) / quarter);  // 0..3: which quarter above 2^shift
  const int c = (shift - kMinShift) * kPerOctave + sub + 1;
  return c;  // class_bytes(c) = 2^shift + (sub + 1) · quarter ≥ n
}

struct FreeList {
  std::mutex lock;
  std::vector<void*> blocks;  // (blocks' starts, header included)
};

struct Cache {
  std::array<FreeList, kClasses> lists;
  std::atomic<size_t> cached_bytes{0};
};

void lock_all();
void unlock_all();

Cache& cache() {
  static Cache* instance = [] {
    Cache* made = new Cache();  // never destroyed: tensors freed at exit still find it
    // a fork while another thread holds a list's lock would leave the child's list locked for good (and maybe
    // half-changed): the forking thread holds them all across the fork, and both sides let go after
    pthread_atfork(&lock_all, &unlock_all, &unlock_all);
    return made;
  }();
  return *instance;
}

void lock_all() {
  for (FreeList& list : cache().lists) list.lock.lock();
}

void unlock_all() {
  for (FreeList& list : cache().lists) list.lock.unlock();
}

void* block_from_glibc(size_t bytes) {
  void* block = nullptr;
  if (posix_memalign(&block, kAlign, kHeader + bytes) != 0 || block == nullptr) return nullptr;
  return block;
}

void release(void* data) {
  if (data == nullptr) return;
  char* block = static_cast<char*>(data) - kHeader;
  const uint32_t c = *reinterpret_cast<uint32_t*>(block);
  if (c != kUncached) {
    Cache& all = cache();
    const size_t bytes = class_bytes(static_cast<int>(c));
    if (all.cached_bytes.fetch_add(bytes, std::memory_order_relaxed) + bytes <= kMaxCachedBytes) {
      FreeList& list = all.lists[c];
      std::lock_guard<std::mutex> guard(list.lock);
      if (list.blocks.size() < kMaxPerClass) {
        list.blocks.push_back(block);
        return;
      }
    }
    all.cached_bytes.fetch_sub(bytes, std::memory_order_relaxed);
  }
  std::free(block);
}

class CachingCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
    const int c = class_of(n);
    void* block = nullptr;
    if (c >= 0) {
      Cache& all = cache();
      FreeList& list = all.lists[c];
      {
        std::lock_guard<std::mutex> guard(list.lock);
        if (!list.blocks.empty()) {
          block = list.blocks.back();
          list.blocks.pop_back();
        }
      }
      if (block != nullptr) {
        all.cached_bytes.fetch_sub(class_bytes(c), std::memory_order_relaxed);
      } else {
        block = block_from_glibc(class_bytes(c));
      }
    } else {
      block = block_from_glibc(n);
    }
    if (block == nullptr) throw std::bad_alloc();
    *static_cast<uint32_t*>(block) = c >= 0 ? static_cast<uint32_t>(c) : kUncached;
    void* data = static_cast<char*>(block) + kHeader;
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CachingCPUAllocator* caching_allocator() {
  static CachingCPUAllocator* instance = new CachingCPUAllocator();  // (never destroyed, as the cache)
  return instance;
}

}  // namespace

extern "C" {

// 1: torch's CPU tensors from here on come from the caching allocator; 0: from torch's default. Returns whether the
// caching allocator was the one in force before. (Priority 1: above torch's own registration, 0.)
int linserve_cpu_allocator(int caching) {
  const bool was = c10::GetCPUAllocator() == caching_allocator();
  c10::SetCPUAllocator(caching ? static_cast<c10::Allocator*>(caching_allocator()) : c10::GetDefaultCPUAllocator(),
                       /*priority=*/1);
  return was ? 1 : 0;
}

// The bytes the cache holds in freed blocks (tests: bounded; a block taken again leaves it).
int64_t linserve_cpu_allocator_cached_bytes() {
  return static_cast<int64_t>(cache().cached_bytes.load(std::memory_order_relaxed));
}

}  // extern "C"
