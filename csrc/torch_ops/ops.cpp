// The CUDA kernels in C++ of graphar::all_reduce and graphar::all_reduce_add_rms_norm: the eager fast
// path, host code on torch's stable ABI as of 2.11, so one build loads under every torch from 2.11 on.
// They serve a call the CUDA library's plan takes (graphar_comm_plan: the one place a call's kernel is
// chosen) and hand every other one to the op's Python kernel: all-reduce captures, a group no
// communicator serves here, calls the library declines. A group that timed out raises here. What the
// stable ABI lacks and what stands in for it (c10d's name check, calling one dispatch key's kernel,
// the current stream): docs/design.md, decision 1a, and each stand-in's own comment below.

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

using PlanFn = int (*)(void*, const graphar_tensor*, uint64_t, int, int, int32_t*, int32_t*);
using PlanNormFn = int (*)(void*, const graphar_tensor*, const graphar_tensor*, const graphar_tensor*, uint64_t);
using AllReduceFn = int (*)(void*, const graphar_all_reduce_args*);
using AllReduceNormFn = int (*)(void*, const graphar_all_reduce_norm_args*);
using LastErrorFn = const char* (*)();

// A group as served (null once withdrawn) and its call count, which outlives serving anew. The stable
// ABI cannot ask c10d what a name names: graphar.allreduce.native_op withdraws a group when torch
// unregisters its name (torch gives it to the next group it makes).
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

// t as the library's plans judge it.
graphar_tensor describe(const Tensor& t) {
  graphar_tensor d{};
  d.data = address(t);
  d.dtype = dtype_code(torch_dtype(t));
  d.nbytes = nbytes(t);
  d.device = t.is_cuda() ? t.get_device_index() : -1;
  d.contiguous = t.is_contiguous();
  return d;
}

// The current CUDA stream, through libtorch_cuda's shim function, looked up (torch_symbol), not linked:
// linked, the library failed to load into torch 2.11 ("undefined symbol"), and it must load into a CPU
// torch too.
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

// Whether the library's plan took the call: false where it declined (the Python kernel then serves it,
// and logs why). An error (a group that timed out: its peers may be gone) raises here, not in the
// Python kernel: behind torch_call_dispatcher an error loses its type, and on torch 2.11 its message.
bool planned(const graphar_op_group& g, int rc, const char* op, const std::string& name) {
  if (rc == GRAPHAR_DECLINED || rc == GRAPHAR_CAPTURING) return false;
  check(g, rc, op, name);
  return true;
}

// The sum, or nothing when the call is the Python kernel's. Nothing is launched or allocated before
// the plan's verdict, so a declined call inside a capture records nothing.
std::optional<Tensor> try_all_reduce(const graphar_op_group& g, const Tensor& x, const std::string& name) {
  const graphar_tensor in = describe(x);
  const uint64_t stream = in.device < 0 ? 0 : current_stream(g);  // no GPU, no stream: the plan declines it first
  int32_t algo = 0, path = 0;
  const int rc = reinterpret_cast<PlanFn>(g.plan)(reinterpret_cast<void*>(g.comm), &in, stream,
                                                  GRAPHAR_PLAN_EAGER_ONLY, 0, &algo, &path);
  if (!planned(g, rc, "all_reduce", name)) return std::nullopt;
  Tensor out = empty_like(x);
  graphar_all_reduce_args a{};
  a.input = in.data;
  a.output = address(out);
  a.nbytes = in.nbytes;
  a.stream = stream;
  a.dtype = in.dtype;
  a.algo = algo;
  a.path = path;  // GRAPHAR_UNCAPTURED: the plan asked the stream
  check(g, reinterpret_cast<AllReduceFn>(g.all_reduce)(reinterpret_cast<void*>(g.comm), &a), "all_reduce", name);
  return out;
}

using NormOutputs = std::pair<Tensor, Tensor>;

// (normed, sum + residual) by the fused kernel, or nothing when the call is the Python kernel's
// (graphar.allreduce.kernels.AllReduce.try_all_reduce_norm takes the same shapes).
std::optional<NormOutputs> try_all_reduce_norm(const graphar_op_group& g, const Tensor& x,
                                               const std::optional<Tensor>& residual,
                                               const std::optional<Tensor>& weight, double eps, bool weight_first,
                                               const std::string& name) {
  if (x.dim() == 0) return std::nullopt;
  if (residual && residual->sizes() != x.sizes()) return std::nullopt;  // the sum would broadcast it
  if (weight && weight->dim() != 1) return std::nullopt;
  const graphar_tensor in = describe(x);
  const graphar_tensor res = residual ? describe(*residual) : graphar_tensor{};
  const graphar_tensor w = weight ? describe(*weight) : graphar_tensor{};
  const uint64_t row_bytes = static_cast<uint64_t>(x.size(-1)) * x.element_size();
  const int rc = reinterpret_cast<PlanNormFn>(g.plan_norm)(reinterpret_cast<void*>(g.comm), &in, &res, &w, row_bytes);
  if (!planned(g, rc, "all_reduce_add_rms_norm", name)) return std::nullopt;
  Tensor normed = empty_like(x);
  Tensor summed = empty_like(x);
  graphar_all_reduce_norm_args a{};
  a.input = in.data;
  a.residual = res.data;
  a.weight = w.data;
  a.output = address(normed);
  a.residual_output = address(summed);
  a.nbytes = in.nbytes;
  a.row_bytes = row_bytes;
  a.stream = current_stream(g);
  a.eps = static_cast<float>(eps);
  a.dtype = in.dtype;
  a.weight_first = weight_first;
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
// leaves the results there. The private op holds that kernel alone: torch_call_dispatcher dispatches
// anew, and the public op would bring a CUDA call back here. An error it raises arrives as a
// RuntimeError with its message (2.13; 2.11 prints it), its type lost.
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

int graphar_op_serve(const char* group_name, const graphar_op_group* group) {
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
