// The CUDA kernels in C++ of graphar::all_reduce and graphar::all_reduce_add_rms_norm: the eager
// fast path.
//
// An eager call that goes through the dispatcher into Python spends most of its host time outside
// the CUDA library: boxing the arguments, the Python kernel's checks, the outputs allocated from
// Python. These kernels serve the common call themselves: a healthy communicator, eligible inputs,
// and for the all-reduce a stream that is not capturing. Every other call goes unchanged to the op's
// Python kernel (registered for CompositeExplicitAutograd): captures of the all-reduce
// (graphar.graph records its calls, and a capture may pick another kernel), a communicator that
// timed out (Python raises) or whose group was destroyed (Python closes it), inputs the custom
// kernels cannot take (NCCL, or the norm apart). What they accept, the Python kernels accept too
// and serve with the same CUDA kernel and arguments (the kernel choice is the Python policy's,
// published per group), so whichever serves a call, every rank runs the same CUDA kernel. The fused
// kernel is a push kernel, which needs no registration in any capture, so its C++ kernel serves
// captures as well.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "graphar_op.h"

namespace {

thread_local std::string t_last_error;

using AllReduceFn = int (*)(void*, const graphar_all_reduce_args*);
using AllReduceNormFn = int (*)(void*, const graphar_all_reduce_norm_args*);
using LastErrorFn = const char* (*)();

// A group's state as Python published it, and the process group it was published for. torch gives
// a destroyed group's name to the next group it makes, whose ranks may differ: a call serves the
// name only while it still resolves to that group. A weak reference: it keeps the group's address
// from being reused, not its backends alive (destroying a group releases them as before).
struct Published {
  graphar_op_group state;
  c10::weak_intrusive_ptr<c10d::ProcessGroup> process_group;
};

// A group as published (null once withdrawn) and its call count, which outlives republishing.
struct Entry {
  std::shared_ptr<const Published> group;
  std::atomic<uint64_t> calls{0};
};

// Group name -> entry. Entries are never erased (a process has a handful of groups), so a call may
// keep its Entry* after the lock; the shared_ptr keeps the state it read alive.
std::mutex g_mutex;
std::unordered_map<std::string, std::unique_ptr<Entry>> g_entries;

int dtype_code(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return GRAPHAR_FLOAT32;
    case c10::ScalarType::Half: return GRAPHAR_FLOAT16;
    case c10::ScalarType::BFloat16: return GRAPHAR_BFLOAT16;
    default: return -1;
  }
}

int32_t algo_for(const graphar_op_group& g, uint64_t nbytes) {
  for (int i = 0; i < g.rows; i++) {
    if (nbytes <= g.bounds[i]) return g.algos[i];
  }
  return 0;
}

// Whether `name` still names the process group `pg` (about 50 ns: c10d's registry under its lock).
bool names(const std::string& name, const c10d::ProcessGroup* pg) {
  try {
    return c10d::resolve_process_group(name).get() == pg;
  } catch (const std::exception&) {  // no group of that name: destroyed
    return false;
  }
}

// The group's published state and its entry, or a null state when none is published or the group it
// was published for is gone (the Python kernel then closes its communicator and serves the call).
std::pair<Entry*, std::shared_ptr<const Published>> find(c10::string_view group_name) {
  const std::string name(group_name);
  std::shared_ptr<const Published> group;
  Entry* entry = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_entries.find(name);
    if (it == g_entries.end()) return {nullptr, nullptr};
    entry = it->second.get();
    group = entry->group;
  }
  if (group && !names(name, group->process_group._unsafe_get_target())) group = nullptr;
  return {entry, std::move(group)};
}

bool timed_out(const graphar_op_group& g) { return *reinterpret_cast<const volatile uint32_t*>(g.failed) != 0; }

// t's dtype code when the custom kernels can read it as it is (graphar.comm.allreduce.ineligible_reason
// on a contiguous tensor), else -1. A strided tensor goes to Python, which makes a contiguous copy: a
// copy made here would be recorded into a capture that then declines the call.
int eligible(const graphar_op_group& g, const at::Tensor& t) {
  const int dtype = dtype_code(t.scalar_type());
  const uint64_t nbytes = t.nbytes();
  if (dtype < 0 || nbytes == 0 || nbytes % 16 != 0 || nbytes > g.max_bytes || !t.is_cuda() ||
      t.get_device() != g.device || !t.is_contiguous() || reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0) {
    return -1;
  }
  return dtype;
}

uint64_t address(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()); }

uint64_t current_stream(const graphar_op_group& g) {
  return reinterpret_cast<uintptr_t>(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(g.device)).stream());
}

void check(const graphar_op_group& g, int rc, const char* op, c10::string_view name) {
  TORCH_CHECK(rc == 0, "graphar ", op, " on group '", name, "' (rank ", g.rank,
              "): ", reinterpret_cast<LastErrorFn>(g.last_error)());
}

// The sum, or nothing when the call is the Python kernel's. Nothing is launched or copied before
// the verdict, so a declined call inside a capture records nothing.
std::optional<at::Tensor> try_all_reduce(const graphar_op_group& g, const at::Tensor& x, c10::string_view name) {
  const int dtype = eligible(g, x);
  const int32_t algo = dtype < 0 ? 0 : algo_for(g, x.nbytes());
  if (algo == 0 || timed_out(g)) return std::nullopt;
  at::Tensor out = at::empty(x.sizes(), x.options());
  graphar_all_reduce_args a{};
  a.input = address(x);
  a.output = address(out);
  a.nbytes = x.nbytes();
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

using NormOutputs = std::tuple<at::Tensor, at::Tensor>;

// (normed, sum + residual) by the fused kernel, or nothing when the call is the Python kernel's
// (graphar.comm.allreduce.AllReduce.try_all_reduce_norm takes the same shapes).
std::optional<NormOutputs> try_all_reduce_norm(const graphar_op_group& g, const at::Tensor& x,
                                               const std::optional<at::Tensor>& residual,
                                               const std::optional<at::Tensor>& weight, double eps, bool weight_first,
                                               c10::string_view name) {
  const int dtype = eligible(g, x);
  if (dtype < 0 || x.dim() == 0 || x.nbytes() > g.fused_norm_max || timed_out(g)) return std::nullopt;
  const uint64_t row_bytes = static_cast<uint64_t>(x.size(-1)) * x.element_size();
  if (row_bytes % 16 != 0 || row_bytes > g.norm_max_row_bytes) return std::nullopt;
  if (residual && (residual->sizes() != x.sizes() || eligible(g, *residual) != dtype)) return std::nullopt;
  if (weight && (weight->dim() != 1 || weight->size(0) != x.size(-1) || eligible(g, *weight) != dtype)) {
    return std::nullopt;
  }
  at::Tensor normed = at::empty(x.sizes(), x.options());
  at::Tensor summed = at::empty(x.sizes(), x.options());
  graphar_all_reduce_norm_args a{};
  a.input = address(x);
  a.residual = residual ? address(*residual) : 0;
  a.weight = weight ? address(*weight) : 0;
  a.output = address(normed);
  a.residual_output = address(summed);
  a.nbytes = x.nbytes();
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

c10::OperatorHandle op_named(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

// Runs the op's Python kernel (graphar/ops.py) on `stack`, the call's arguments; leaves the results there.
void call_python(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  op.callBoxedForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd, stack);
}

at::Tensor all_reduce(const at::Tensor& x, c10::string_view group_name) {
  auto [entry, group] = find(group_name);
  if (group) {
    if (std::optional<at::Tensor> out = try_all_reduce(group->state, x, group_name)) {
      entry->calls.fetch_add(1, std::memory_order_relaxed);
      return *std::move(out);
    }
  }
  torch::jit::Stack stack{x, std::string(group_name)};
  static const c10::OperatorHandle op = op_named("graphar::all_reduce");
  call_python(op, stack);
  return std::move(stack.back()).toTensor();
}

NormOutputs all_reduce_add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                    const std::optional<at::Tensor>& weight, double eps, c10::string_view group_name,
                                    bool weight_first) {
  auto [entry, group] = find(group_name);
  if (group) {
    if (auto out = try_all_reduce_norm(group->state, x, residual, weight, eps, weight_first, group_name)) {
      entry->calls.fetch_add(1, std::memory_order_relaxed);
      return *std::move(out);
    }
  }
  torch::jit::Stack stack{x, residual, weight, eps, std::string(group_name), weight_first};
  static const c10::OperatorHandle op = op_named("graphar::all_reduce_add_rms_norm");
  call_python(op, stack);
  return NormOutputs(std::move(stack[0]).toTensor(), std::move(stack[1]).toTensor());
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
    // Lives as long as the process: the registration ends with the Library object.
    static torch::Library* lib = [] {
      auto* l = new torch::Library(torch::Library::IMPL, "graphar", c10::DispatchKey::CUDA, __FILE__, __LINE__);
      l->impl("all_reduce", TORCH_FN(all_reduce));
      l->impl("all_reduce_add_rms_norm", TORCH_FN(all_reduce_add_rms_norm));
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
    // The group the name resolves to now, as Python publishes for a live group; no such group throws.
    auto state = group ? std::make_shared<const Published>(
                             Published{*group, c10::weak_intrusive_ptr(c10d::resolve_process_group(group_name))})
                       : nullptr;
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
