// graphar::all_reduce's CUDA kernel in C++: the eager fast path.
//
// An eager call that goes through the dispatcher into Python spends most of its host time outside
// the CUDA library: boxing the arguments, the Python kernel's checks, the output allocated from
// Python. This kernel serves the common call itself: a stream that is not capturing, a healthy
// communicator, an eligible input. Every other call goes unchanged to the Python kernel
// (registered for CompositeExplicitAutograd): captures (graphar.graph records its calls, and a
// capture may pick another kernel), a communicator that timed out (Python raises), inputs the
// custom kernels cannot take (NCCL). The kernel choice is the Python policy's, published per group
// as rows, and the launch is the CUDA library's: whichever kernel serves a call, every rank runs the
// same CUDA kernel with the same arguments.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "graphar_op.h"

namespace {

thread_local std::string t_last_error;

using AllReduceFn = int (*)(void*, const graphar_all_reduce_args*);
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

// The sum, or nothing when the call is the Python kernel's. Nothing is launched or copied before
// the verdict, so a declined call inside a capture records nothing.
std::optional<at::Tensor> try_all_reduce(const graphar_op_group& g, const at::Tensor& x, c10::string_view name) {
  if (*reinterpret_cast<const volatile uint32_t*>(g.failed) != 0) return std::nullopt;
  const int dtype = dtype_code(x.scalar_type());
  const uint64_t nbytes = x.nbytes();
  // A strided input goes to Python, which sums a contiguous copy: a copy made here would be recorded
  // into a capture that then declines the call.
  if (dtype < 0 || nbytes == 0 || nbytes % 16 != 0 || nbytes > g.max_bytes || !x.is_cuda() ||
      x.get_device() != g.device || !x.is_contiguous() || reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 != 0) {
    return std::nullopt;
  }
  const int32_t algo = algo_for(g, nbytes);
  if (algo == 0) return std::nullopt;
  at::Tensor out = at::empty(x.sizes(), x.options());
  graphar_all_reduce_args a{};
  a.input = reinterpret_cast<uintptr_t>(x.const_data_ptr());
  a.output = reinterpret_cast<uintptr_t>(out.mutable_data_ptr());
  a.nbytes = nbytes;
  a.stream = reinterpret_cast<uintptr_t>(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(g.device)).stream());
  a.dtype = dtype;
  a.algo = algo;
  a.path = GRAPHAR_EAGER_ONLY;  // a capturing stream: no launch, GRAPHAR_CAPTURING
  a.pdl = g.pdl;
  const int rc = reinterpret_cast<AllReduceFn>(g.all_reduce)(reinterpret_cast<void*>(g.comm), &a);
  if (rc == GRAPHAR_CAPTURING) return std::nullopt;
  TORCH_CHECK(rc == 0, "graphar all_reduce on group '", name, "' (rank ", g.rank,
              "): ", reinterpret_cast<LastErrorFn>(g.last_error)());
  return out;
}

// The Python kernel of graphar::all_reduce (graphar/ops.py), called with this call's arguments.
at::Tensor python_all_reduce(const at::Tensor& x, c10::string_view group_name) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("graphar::all_reduce", "");
  torch::jit::Stack stack{x, std::string(group_name)};
  op.callBoxedForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd, stack);
  return std::move(stack.back()).toTensor();
}

at::Tensor all_reduce(const at::Tensor& x, c10::string_view group_name) {
  Entry* entry = nullptr;
  std::shared_ptr<const graphar_op_group> group;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_entries.find(std::string(group_name));
    if (it != g_entries.end()) {
      entry = it->second.get();
      group = entry->group;
    }
  }
  if (group) {
    if (std::optional<at::Tensor> out = try_all_reduce(*group, x, group_name)) {
      entry->calls.fetch_add(1, std::memory_order_relaxed);
      return *std::move(out);
    }
  }
  return python_all_reduce(x, group_name);
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
