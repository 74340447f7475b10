// linserve::run_program — one call of a loaded AOTInductor program (its container's `…Run` entry point) with the
// tensors' handles made and taken here, in C++, instead of one Python-level ctypes call per input and output.
//
// A compiled CPU bucket reads the model's weights as inputs (every bucket shares the process's one copy), so a
// decode step passes ~40 tensors. Made from Python (torch._C._aoti's helpers, a capsule and a ctypes call per
// tensor, a ctypes array each way) that was ~40 µs of a ~0.8 ms one-row step on a 2-vCPU Xeon; here it is one
// `new at::Tensor` per input and one move per output. Called through torch.ops, whose call releases the GIL for
// the op's whole length — the program runs while the server's other Python threads do.
//
// run: the address of the artifact's `AOTInductorModelContainerRun`; container: its model container handle. The
// container takes ownership of the input handles; each output handle is ours. A call the container refuses (its
// inputs checked first) raises here as a Python RuntimeError with its message, where a ctypes call would abort.
#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include "work_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// AOTInductor's stable C ABI (torch/csrc/inductor/aoti_runtime/interface.h): status 0 is success
using ContainerRun = int32_t (*)(void* container, AtenTensorHandle* inputs, size_t num_inputs,
                                 AtenTensorHandle* outputs, size_t num_outputs, void* stream, void* proxy_executor);

// One run of the container over the handles given (the container's to free); the outputs as tensors
std::vector<at::Tensor> call_container(int64_t run, int64_t container, std::vector<AtenTensorHandle>& handles,
                                       int64_t num_outputs) {
  std::vector<AtenTensorHandle> outputs(static_cast<size_t>(num_outputs), nullptr);
  const int32_t status =
      reinterpret_cast<ContainerRun>(run)(reinterpret_cast<void*>(container), handles.data(), handles.size(),
                                          outputs.data(), outputs.size(), nullptr, nullptr);
  std::vector<at::Tensor> result;
  result.reserve(outputs.size());
  for (AtenTensorHandle output : outputs) {  // (none is set when the run failed)
    if (output != nullptr) {
      at::Tensor* tensor = torch::aot_inductor::tensor_handle_to_tensor_pointer(output);
      result.push_back(std::move(*tensor));
      aoti_torch_delete_tensor_object(output);
    }
  }
  TORCH_CHECK(status == 0, "AOTInductor container run failed (status ", status, "; its message is on stderr)");
  return result;
}

void add_handles(std::vector<AtenTensorHandle>& handles, at::TensorList tensors) {
  for (const at::Tensor& tensor : tensors) {
    handles.push_back(torch::aot_inductor::new_tensor_handle(at::Tensor(tensor)));  // the container's to free
  }
}

std::vector<at::Tensor> run_program(int64_t run, int64_t container, at::TensorList inputs, int64_t num_outputs) {
  TORCH_CHECK(run != 0 && container != 0, "run_program: no program loaded");
  TORCH_CHECK(num_outputs >= 0, "run_program: num_outputs < 0");
  std::vector<AtenTensorHandle> handles;
  handles.reserve(inputs.size());
  add_handles(handles, inputs);
  return call_container(run, container, handles, num_outputs);
}

// A program bound to the inputs it reads the same tensors of on every call (the pool's buffers, the sampling
// tables, the weights: ~75 of a decode step's ~77): a call passes only its leading few (the io rows), so the ~70
// others are not boxed into a list, converted and checked by the dispatcher on every step — 12.6-16.0 µs of a
// one-row step on the AVX2 host (docs/engine.md). Kept here, by number, until unbound.
struct Binding {
  int64_t run, container, num_outputs;
  std::vector<at::Tensor> tail;  // after the leading inputs, in the program's order
};

std::mutex& bindings_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<int64_t, std::shared_ptr<const Binding>>& bindings() {
  static auto* table = new std::unordered_map<int64_t, std::shared_ptr<const Binding>>();  // (never destroyed)
  return *table;
}

int64_t bind_program(int64_t run, int64_t container, at::TensorList tail, int64_t num_outputs) {
  TORCH_CHECK(run != 0 && container != 0, "bind_program: no program loaded");
  TORCH_CHECK(num_outputs >= 0, "bind_program: num_outputs < 0");
  static int64_t next = 0;
  auto binding = std::make_shared<const Binding>(Binding{run, container, num_outputs, tail.vec()});
  std::lock_guard<std::mutex> lock(bindings_mutex());
  bindings()[++next] = std::move(binding);
  return next;
}

bool unbind_program(int64_t id) {
  std::lock_guard<std::mutex> lock(bindings_mutex());
  return bindings().erase(id) > 0;
}

std::vector<at::Tensor> run_bound(int64_t id, at::TensorList leading) {
  std::shared_ptr<const Binding> binding;
  {
    std::lock_guard<std::mutex> lock(bindings_mutex());
    auto found = bindings().find(id);
    TORCH_CHECK(found != bindings().end(), "run_bound: no program bound as ", id);
    binding = found->second;  // (kept alive for the call, whatever unbinds it meanwhile)
  }
  std::vector<AtenTensorHandle> handles;
  handles.reserve(leading.size() + binding->tail.size());
  add_handles(handles, leading);
  add_handles(handles, binding->tail);
  return call_container(binding->run, binding->container, handles, binding->num_outputs);
}

// run_bound with the leading inputs made here from the io rows' values: `io` is (rows, width) int64 flattened, and
// `spans` says which rows make each leading input, in order — (start, 0): row `start` as a (width,) tensor; (start,
// count): rows start … start + count - 1 as a (count, width) one. No tensor is made in Python for a step, and none
// of the dispatcher's views of it
std::vector<at::Tensor> run_bound_rows(int64_t id, at::IntArrayRef io, int64_t rows, at::IntArrayRef spans) {
  TORCH_CHECK(rows > 0 && !io.empty() && io.size() % static_cast<size_t>(rows) == 0,
              "run_bound_rows: ", io.size(), " values are not ", rows, " whole rows");
  TORCH_CHECK(spans.size() % 2 == 0, "run_bound_rows: spans are (start, count) pairs");
  const int64_t width = static_cast<int64_t>(io.size()) / rows;
  std::vector<at::Tensor> leading;
  leading.reserve(spans.size() / 2);
  for (size_t i = 0; i < spans.size(); i += 2) {
    const int64_t start = spans[i], count = spans[i + 1], taken = std::max<int64_t>(count, 1);
    TORCH_CHECK(start >= 0 && count >= 0 && start + taken <= rows, "run_bound_rows: rows ", start, " + ", taken,
                " of ", rows);
    at::Tensor input = count ? at::detail::empty_cpu({count, width}, at::kLong, false, c10::nullopt)
                             : at::detail::empty_cpu({width}, at::kLong, false, c10::nullopt);
    std::memcpy(input.data_ptr<int64_t>(), io.data() + start * width, sizeof(int64_t) * taken * width);
    leading.push_back(std::move(input));
  }
  return run_bound(id, leading);
}

// whether this thread's kernels run their parallel regions on linserve's work pool (work_pool.h); returns the
// setting it replaces
bool use_work_pool(bool on) {
  const bool before = linserve::pool_wanted();
  linserve::pool_wanted() = on;
  return before;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def("run_program(int run, int container, Tensor[] inputs, int num_outputs) -> Tensor[]");
  m.def("bind_program(int run, int container, Tensor[] tail, int num_outputs) -> int");
  m.def("unbind_program(int binding) -> bool", &unbind_program);
  m.def("run_bound(int binding, Tensor[] leading) -> Tensor[]");
  m.def("run_bound_rows(int binding, int[] io, int rows, int[] spans) -> Tensor[]", &run_bound_rows);
  m.def("use_work_pool(bool on) -> bool", &use_work_pool);
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("run_program", &run_program);
  m.impl("bind_program", &bind_program);
  m.impl("run_bound", &run_bound);
}
