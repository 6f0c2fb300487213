// The CUDA kernels in C++ of graphar::all_reduce and graphar::all_reduce_add_rms_norm: the eager
// fast path. Host code alone, built by nvcc beside the CUDA library (graphar/_cuda.py) against torch's
// stable ABI as of 2.11 (TORCH_TARGET_VERSION): one build loads under every torch from 2.11 on.
//
// An eager call that goes through the dispatcher into Python spends most of its host time outside
// the CUDA library: boxing the arguments, the Python kernel's checks, the outputs allocated from
// Python. These kernels serve the common call themselves: a healthy communicator, eligible inputs,
// and for the all-reduce a stream that is not capturing. Every other call goes unchanged to the op's
// Python kernel: captures of the all-reduce (graphar.graph records its calls, and a capture may pick
// another kernel), a group without a published communicator, inputs the custom kernels cannot take
// (NCCL, or the norm apart). A communicator that timed out raises here. What they
// accept, the Python kernels accept too and serve with the same CUDA kernel and arguments (the kernel
// choice is the Python policy's, published per group), so whichever serves a call, every rank runs
// the same CUDA kernel. The fused kernel is a push kernel, which needs no registration in any
// capture, so its C++ kernel serves captures as well.
//
// What the stable ABI lacks, and what stands in for it:
// - c10d, which told whether a name still names the group a state was published for (torch gives a
//   destroyed group's name to the next group it makes): graphar.native_op withdraws a group's state
//   when torch unregisters its name.
// - calling an op's kernel for one dispatch key: torch_call_dispatcher dispatches anew, which would
//   bring a CUDA call back here. A declined call goes to graphar::_all_reduce_python or
//   graphar::_all_reduce_add_rms_norm_python (graphar/ops.py), the op with its Python kernel alone.
//   An error that kernel raises reaches the caller as a RuntimeError with its message (torch >= 2.13;
//   2.11 prints the message to stderr): the shim keeps no exception type.
// - the CUDA stream: libtorch_cuda's aoti_torch_get_current_cuda_stream, looked up at the first call,
//   not linked, so that the library also loads into a CPU build of torch (which never calls it).

#include <dlfcn.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "graphar_op.h"

namespace {

using torch::stable::Tensor;
using torch::stable::detail::from;
using torch::stable::detail::to;

thread_local std::string t_last_error;

using AllReduceFn = int (*)(void*, const graphar_all_reduce_args*);
using AllReduceNormFn = int (*)(void*, const graphar_all_reduce_norm_args*);
using LastErrorFn = const char* (*)();

// A group as published (null once withdrawn) and its call count, which outlives republishing.
struct Entry {
  std::shared_ptr<const graphar_op_group> group;
  std::atomic<uint64_t> calls{0};
};

// Group name -> entry. Entries are never erased (a process has a handful of groups), so a call may
// keep its Entry* after the lock; the shared_ptr keeps the state it read alive.
std::mutex g_mutex;
std::unordered_map<std::string, std::unique_ptr<Entry>> g_entries;

// A function of a torch library that is loaded already, looked up rather than linked: libtorch_cuda's
// (a CPU build of torch has none, and Python loads it out of this library's reach) and libtorch_cpu's
// newer than the ABI this build targets. Null where there is none.
void* torch_symbol(const char* library, const char* name) {
  void* handle = dlopen(library, RTLD_NOLOAD | RTLD_NOW);
  return handle == nullptr ? nullptr : dlsym(handle, name);
}

// Raises with torch's message when a shim call failed (torch_exception_get_what_without_backtrace is
// 2.13's; 2.11 printed it to stderr).
void check_torch(AOTITorchError rc, const char* call) {
  if (rc == AOTI_TORCH_SUCCESS) return;
  using WhatFn = const char* (*)();
  static const auto what =
      reinterpret_cast<WhatFn>(torch_symbol("libtorch_cpu.so", "torch_exception_get_what_without_backtrace"));
  throw std::runtime_error(what != nullptr ? what() : std::string(call) + " failed (torch printed why)");
}

std::pair<Entry*, std::shared_ptr<const graphar_op_group>> find(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_entries.find(name);
  if (it == g_entries.end()) return {nullptr, nullptr};
  return {it->second.get(), it->second->group};
}

int32_t algo_for(const graphar_op_group& g, uint64_t nbytes) {
  for (int i = 0; i < g.rows; i++) {
    if (nbytes <= g.bounds[i]) return g.algos[i];
  }
  return 0;
}

bool timed_out(const graphar_op_group& g) { return *reinterpret_cast<const volatile uint32_t*>(g.failed) != 0; }

int32_t torch_dtype(const Tensor& t) {
  int32_t dtype = 0;
  check_torch(aoti_torch_get_dtype(t.get(), &dtype), "aoti_torch_get_dtype");
  return dtype;
}

// Compared by the shim's codes: torch::stable's ScalarType raises on dtypes it does not map.
int dtype_code(int32_t dtype) {
  if (dtype == aoti_torch_dtype_float32()) return GRAPHAR_FLOAT32;
  if (dtype == aoti_torch_dtype_float16()) return GRAPHAR_FLOAT16;
  if (dtype == aoti_torch_dtype_bfloat16()) return GRAPHAR_BFLOAT16;
  return -1;
}

uint64_t nbytes(const Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

uint64_t address(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()); }

// t's dtype code when the custom kernels can read it as it is (graphar.comm.allreduce.ineligible_reason
// on a contiguous tensor), else -1. A strided tensor goes to Python, which makes a contiguous copy: a
// copy made here would be recorded into a capture that then declines the call.
int eligible(const graphar_op_group& g, const Tensor& t) {
  const int dtype = dtype_code(torch_dtype(t));
  const uint64_t n = dtype < 0 ? 0 : nbytes(t);
  if (n == 0 || n % 16 != 0 || n > g.max_bytes || !t.is_cuda() || t.get_device_index() != g.device ||
      !t.is_contiguous() || address(t) % 16 != 0) {
    return -1;
  }
  return dtype;
}

uint64_t current_stream(const graphar_op_group& g) {
  static const auto get = reinterpret_cast<decltype(&aoti_torch_get_current_cuda_stream)>(
      torch_symbol("libtorch_cuda.so", "aoti_torch_get_current_cuda_stream"));
  STD_TORCH_CHECK(get != nullptr, "graphar: libtorch_cuda.so's aoti_torch_get_current_cuda_stream not found");
  void* stream = nullptr;
  check_torch(get(g.device, &stream), "aoti_torch_get_current_cuda_stream");
  return reinterpret_cast<uintptr_t>(stream);
}

// A new contiguous tensor of x's sizes, dtype and device, from the shim directly (torch::stable's
// factory functions go through the dispatcher).
Tensor empty_like(const Tensor& x) {
  const auto sizes = x.sizes();
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<int64_t>(sizes[i], 1);
  }
  AtenTensorHandle out = nullptr;
  check_torch(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(),
                                       torch_dtype(x), aoti_torch_device_type_cuda(), x.get_device_index(), &out),
              "aoti_torch_empty_strided");
  return Tensor(out);
}

void check(const graphar_op_group& g, int rc, const char* op, const std::string& name) {
  STD_TORCH_CHECK(rc == 0, "graphar ", op, " on group '", name, "' (rank ", g.rank,
                  "): ", reinterpret_cast<LastErrorFn>(g.last_error)());
}

// A group whose kernel gave up raises here, not in the Python kernel: an error raised behind
// torch_call_dispatcher loses its type, and on torch 2.11 its message too.
void check_not_timed_out(const graphar_op_group& g, const char* op, const std::string& name) {
  STD_TORCH_CHECK(!timed_out(g), "graphar ", op, " on group '", name, "' (rank ", g.rank,
                  "): the group timed out (a kernel of it gave up waiting for a peer), so every call raises; "
                  "graphar's GrapharTimeoutError (the communicator's check()) says where");
}

// The sum, or nothing when the call is the Python kernel's. Nothing is launched or copied before
// the verdict, so a declined call inside a capture records nothing.
std::optional<Tensor> try_all_reduce(const graphar_op_group& g, const Tensor& x, const std::string& name) {
  check_not_timed_out(g, "all_reduce", name);
  const int dtype = eligible(g, x);
  const int32_t algo = dtype < 0 ? 0 : algo_for(g, nbytes(x));
  if (algo == 0) return std::nullopt;
  Tensor out = empty_like(x);
  graphar_all_reduce_args a{};
  a.input = address(x);
  a.output = address(out);
  a.nbytes = nbytes(x);
  a.stream = current_stream(g);
  a.dtype = dtype;
  a.algo = algo;
  a.path = GRAPHAR_EAGER_ONLY;  // a capturing stream: no launch, GRAPHAR_CAPTURING
  a.pdl = g.pdl;
  const int rc = reinterpret_cast<AllReduceFn>(g.all_reduce)(reinterpret_cast<void*>(g.comm), &a);
  if (rc == GRAPHAR_CAPTURING) return std::nullopt;
  check(g, rc, "all_reduce", name);
  return out;
}

using NormOutputs = std::pair<Tensor, Tensor>;

// (normed, sum + residual) by the fused kernel, or nothing when the call is the Python kernel's
// (graphar.comm.allreduce.AllReduce.try_all_reduce_norm takes the same shapes).
std::optional<NormOutputs> try_all_reduce_norm(const graphar_op_group& g, const Tensor& x,
                                               const std::optional<Tensor>& residual,
                                               const std::optional<Tensor>& weight, double eps, bool weight_first,
                                               const std::string& name) {
  check_not_timed_out(g, "all_reduce_add_rms_norm", name);
  const int dtype = eligible(g, x);
  if (dtype < 0 || x.dim() == 0 || nbytes(x) > g.fused_norm_max) return std::nullopt;
  const uint64_t row_bytes = static_cast<uint64_t>(x.size(-1)) * x.element_size();
  if (row_bytes % 16 != 0 || row_bytes > g.norm_max_row_bytes) return std::nullopt;
  if (residual && (residual->sizes() != x.sizes() || eligible(g, *residual) != dtype)) return std::nullopt;
  if (weight && (weight->dim() != 1 || weight->size(0) != x.size(-1) || eligible(g, *weight) != dtype)) {
    return std::nullopt;
  }
  Tensor normed = empty_like(x);
  Tensor summed = empty_like(x);
  graphar_all_reduce_norm_args a{};
  a.input = address(x);
  a.residual = residual ? address(*residual) : 0;
  a.weight = weight ? address(*weight) : 0;
  a.output = address(normed);
  a.residual_output = address(summed);
  a.nbytes = nbytes(x);
  a.row_bytes = row_bytes;
  a.stream = current_stream(g);
  a.eps = static_cast<float>(eps);
  a.dtype = dtype;
  a.weight_first = weight_first;
  a.pdl = g.pdl;
  check(g, reinterpret_cast<AllReduceNormFn>(g.all_reduce_norm)(reinterpret_cast<void*>(g.comm), &a),
        "all_reduce_add_rms_norm", name);
  return NormOutputs(std::move(normed), std::move(summed));
}

// A str argument, taken off the stack (torch::stable's to<std::string> leaks a copy per call).
std::string take_string(StableIValue value) {
  const auto handle = to<StringHandle>(value);
  size_t length = 0;
  const char* data = nullptr;
  check_torch(torch_string_length(handle, &length), "torch_string_length");
  check_torch(torch_string_c_str(handle, &data), "torch_string_c_str");
  std::string s(data, length);
  check_torch(torch_delete_string(handle), "torch_delete_string");
  return s;
}

// The group name as the private ops take it, its bytes: torch 2.11 to 2.13 leak their copy of a str
// handed to torch_call_dispatcher (pytorch#191340).
StableIValue name_bytes(const std::string& name) {
  std::vector<int64_t> bytes;
  for (const unsigned char c : name) bytes.push_back(c);
  return from(bytes);
}

// Runs the Python kernel (graphar/ops.py) on a declined call, whose arguments are back on `stack`;
// leaves the results there.
void call_python(const char* op, StableIValue* stack) {
  check_torch(torch_call_dispatcher(op, "", stack, TORCH_ABI_VERSION), op);
}

// The kernels, boxed by hand: the arguments are taken off the stack (torch's boxing leaves them to
// the kernel), and a declined call puts them back for the Python kernel.

// graphar::all_reduce(Tensor x, str group_name) -> Tensor
void all_reduce(StableIValue* stack, uint64_t /*num_args*/, uint64_t /*num_outputs*/) {
  Tensor x = to<Tensor>(stack[0]);
  const std::string group_name = take_string(stack[1]);
  auto [entry, group] = find(group_name);
  if (group) {
    if (std::optional<Tensor> out = try_all_reduce(*group, x, group_name)) {
      entry->calls.fetch_add(1, std::memory_order_relaxed);
      stack[0] = from(*out);
      return;
    }
  }
  stack[0] = from(x);
  stack[1] = name_bytes(group_name);
  call_python("graphar::_all_reduce_python", stack);
}

// graphar::all_reduce_add_rms_norm(Tensor x, Tensor? residual, Tensor? weight, float eps, str group_name,
// bool weight_first=False) -> (Tensor, Tensor)
void all_reduce_add_rms_norm(StableIValue* stack, uint64_t /*num_args*/, uint64_t /*num_outputs*/) {
  Tensor x = to<Tensor>(stack[0]);
  const auto residual = to<std::optional<Tensor>>(stack[1]);
  const auto weight = to<std::optional<Tensor>>(stack[2]);
  const auto eps = to<double>(stack[3]);
  const std::string group_name = take_string(stack[4]);
  const auto weight_first = to<bool>(stack[5]);
  auto [entry, group] = find(group_name);
  if (group) {
    if (auto out = try_all_reduce_norm(*group, x, residual, weight, eps, weight_first, group_name)) {
      entry->calls.fetch_add(1, std::memory_order_relaxed);
      stack[0] = from(out->first);
      stack[1] = from(out->second);
      return;
    }
  }
  stack[0] = from(x);
  stack[1] = from(residual);
  stack[2] = from(weight);
  stack[4] = name_bytes(group_name);
  call_python("graphar::_all_reduce_add_rms_norm_python", stack);
}

int failed(const std::exception& e) {
  t_last_error = e.what();
  return GRAPHAR_EINVAL;
}

}  // namespace

extern "C" {

const char* graphar_op_last_error(void) { return t_last_error.c_str(); }

int graphar_op_install(void) {
  try {
    // Here, not at load (STABLE_TORCH_LIBRARY_IMPL): graphar/ops.py defines the ops, and ctypes may
    // load the library first. The registration lasts as long as its library object: the process.
    static const TorchLibraryHandle lib = [] {
      TorchLibraryHandle l = nullptr;
      check_torch(aoti_torch_library_init_impl("graphar", "CUDA", __FILE__, __LINE__, &l),
                  "aoti_torch_library_init_impl");
      check_torch(torch_library_impl(l, "all_reduce", &all_reduce, TORCH_ABI_VERSION), "torch_library_impl");
      check_torch(torch_library_impl(l, "all_reduce_add_rms_norm", &all_reduce_add_rms_norm, TORCH_ABI_VERSION),
                  "torch_library_impl");
      return l;
    }();
    (void)lib;
    return 0;
  } catch (const std::exception& e) {
    return failed(e);
  }
}

int graphar_op_publish(const char* group_name, const graphar_op_group* group) {
  if (group != nullptr && (group->rows < 0 || group->rows > GRAPHAR_OP_MAX_ROWS)) {
    t_last_error = "rows out of [0, GRAPHAR_OP_MAX_ROWS]";
    return GRAPHAR_EINVAL;
  }
  try {
    auto state = group ? std::make_shared<const graphar_op_group>(*group) : nullptr;
    std::lock_guard<std::mutex> lock(g_mutex);
    std::unique_ptr<Entry>& entry = g_entries[group_name];
    if (!entry) entry = std::make_unique<Entry>();
    entry->group = std::move(state);
    return 0;
  } catch (const std::exception& e) {
    return failed(e);
  }
}

uint64_t graphar_op_calls(const char* group_name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_entries.find(group_name);
  return it == g_entries.end() ? 0 : it->second->calls.load(std::memory_order_relaxed);
}

}  // extern "C"
