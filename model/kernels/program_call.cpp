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

#include <cstdint>
#include <utility>
#include <vector>

namespace {

// AOTInductor's stable C ABI (torch/csrc/inductor/aoti_runtime/interface.h): status 0 is success
using ContainerRun = int32_t (*)(void* container, AtenTensorHandle* inputs, size_t num_inputs,
                                 AtenTensorHandle* outputs, size_t num_outputs, void* stream, void* proxy_executor);

std::vector<at::Tensor> run_program(int64_t run, int64_t container, at::TensorList inputs, int64_t num_outputs) {
  TORCH_CHECK(run != 0 && container != 0, "run_program: no program loaded");
  TORCH_CHECK(num_outputs >= 0, "run_program: num_outputs < 0");
  std::vector<AtenTensorHandle> handles;
  handles.reserve(inputs.size());
  for (const at::Tensor& input : inputs) {
    handles.push_back(torch::aot_inductor::new_tensor_handle(at::Tensor(input)));  // the container's to free
  }
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
  m.def("use_work_pool(bool on) -> bool", &use_work_pool);
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) { m.impl("run_program", &run_program); }
