// The launches: launch() every kernel of a communicator goes through (with the eager ordering) and
// the parameters the kernels' barrier and push reads take from the communicator (launch.cuh), and
// graphar_comm_all_reduce: the v1 and push kernels' instances by dtype, algorithm and world size
// (instantiated here alone), the checks of a call and its launch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "all_reduce.cuh"
#include "comm.cuh"
#include "graphar_cuda.h"
#include "host.h"
#include "launch.cuh"
#include "push.cuh"

using namespace graphar;

namespace {

// One op in flight per communicator: an eager launch on another stream waits for the previous one
// instead of racing it for the Signal and the registered buffers.
int wait_for_previous(Comm* c, cudaStream_t stream) {
  if (c->launched && stream != c->last_stream) CUDA_TRY(cudaStreamWaitEvent(stream, c->last_event.get(), 0));
  return 0;
}

}  // namespace

namespace graphar {

BarrierParams barrier_params(const Comm* c, bool eager, uint64_t tag) {
  BarrierParams b{};
  b.signals = c->signals;
  b.self = c->signals.signals[c->rank];
  b.error = c->error_device;
  b.timeout_ns = c->timeout_ns;
  b.tag = tag != 0 ? tag : c->launches + 1;
  b.claim = claim_word(b.tag);
  b.rank = c->rank;
  b.graph = eager ? 0 : 1;
  b.call = eager ? 0 : static_cast<uint32_t>(c->captured_launches + 1);
  return b;
}

PushParams push_params(const Comm* c, bool eager, uint64_t input, uint64_t output, uint64_t nbytes) {
  PushParams p{};
  p.barrier = barrier_params(c, eager);
  p.regions = c->regions;
  p.in = reinterpret_cast<const void*>(input);
  p.out = reinterpret_cast<void*>(output);
  p.packs = static_cast<int>(nbytes / 16);
  p.epoch_packs = static_cast<int>(c->epoch_packs);
  return p;
}

int check_push_room(const Comm* c, bool one_shot, uint64_t nbytes) {
  if (push_epoch_packs_needed(one_shot, static_cast<int64_t>(nbytes / 16), c->ranks) > c->epoch_packs) {
    return fail(GRAPHAR_EINVAL, "%llu bytes exceed the push region (graphar_comm_push_limits)",
                static_cast<unsigned long long>(nbytes));
  }
  return 0;
}

int is_eager(cudaStream_t stream, bool* eager) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CUDA_TRY(cudaStreamIsCapturing(stream, &status));
  *eager = status == cudaStreamCaptureStatusNone;
  return 0;
}

int launch(Comm* c, bool eager, const void* kernel, void* params, int blocks, int threads, cudaStream_t stream,
           bool pdl) {
  if (eager) {
    if (int rc = wait_for_previous(c, stream)) return rc;
  }
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = pdl && c->pdl ? 1 : 0;
  void* args[] = {params};
  CUDA_TRY(cudaLaunchKernelExC(&config, kernel, args));
  c->launches++;  // the tag barrier_params gave this launch is taken, and its call number
  if (!eager) {
    c->captured_launches++;
    return 0;
  }
  CUDA_TRY(cudaEventRecord(c->last_event.get(), stream));
  c->last_stream = stream;
  c->launched = true;
  return 0;
}

}  // namespace graphar

namespace {

// The all-reduce kernel for a dtype, world size and algorithm code; the launch passes its parameters by address.
const void* kernel_for(int dtype, int ranks, int algo) {
  return by_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    return by_ranks(ranks, [&](auto r) -> const void* {
      switch (algo) {
        case GRAPHAR_ONE_STAGE: return reinterpret_cast<const void*>(one_stage<T, r.value>);
        case GRAPHAR_TWO_STAGE: return reinterpret_cast<const void*>(two_stage<T, r.value>);
        case GRAPHAR_PUSH_ONE_SHOT: return reinterpret_cast<const void*>(push_one_shot<T, r.value>);
        case GRAPHAR_PUSH_TWO_SHOT: return reinterpret_cast<const void*>(push_two_shot<T, r.value>);
        default: return nullptr;
      }
    });
  });
}

bool is_push(int algo) { return algo == GRAPHAR_PUSH_ONE_SHOT || algo == GRAPHAR_PUSH_TWO_SHOT; }

int check_all_reduce(const Comm* c, const graphar_all_reduce_args& a) {
  if (!c->opened) return fail(GRAPHAR_EINVAL, "launch before the peers' buffers were opened");
  if (a.nbytes == 0 || a.nbytes % 16 != 0 || a.nbytes > c->max_bytes) {
    return fail(GRAPHAR_EINVAL, "%llu bytes: not a positive multiple of 16 up to %llu",
                static_cast<unsigned long long>(a.nbytes), static_cast<unsigned long long>(c->max_bytes));
  }
  if (a.input % 16 != 0 || a.output % 16 != 0) return fail(GRAPHAR_EINVAL, "input and output must be 16-byte aligned");
  const bool graph_slot = a.path == GRAPHAR_ZERO_COPY || a.path == GRAPHAR_STAGED;
  if (!graph_slot && a.path != GRAPHAR_EAGER && a.path != GRAPHAR_UNCAPTURED && a.path != GRAPHAR_CAPTURED_COPY) {
    return fail(GRAPHAR_EINVAL, "unknown input path %d", a.path);
  }
  if (graph_slot && (a.slot < 1 || a.slot >= c->graph_slots)) {
    return fail(GRAPHAR_EINVAL, "graph slot %d out of [1, %d)", a.slot, c->graph_slots);
  }
  if (!is_push(a.algo)) return 0;
  if (graph_slot) return fail(GRAPHAR_EINVAL, "push kernels read their input in place: no graph slot");
  return check_push_room(c, a.algo == GRAPHAR_PUSH_ONE_SHOT, a.nbytes);
}

int launch_v1(Comm* c, const graphar_all_reduce_args& a, const void* kernel, bool eager, cudaStream_t stream) {
  const bool graph_slot = a.path == GRAPHAR_ZERO_COPY || a.path == GRAPHAR_STAGED;
  const int packs = static_cast<int>(a.nbytes / 16);
  Params p{};
  p.barrier = barrier_params(c, eager);
  p.data = c->slots.get() + (graph_slot ? a.slot : 0);
  // A staged input (graphar.graph, where legacy IPC cannot share it) is copied in by the kernel after its
  // claim, as an eager call's is: a copy before the kernel could run while another kernel of the
  // communicator (an eager call on another stream) holds the registered buffer.
  p.copy_in = a.path == GRAPHAR_ZERO_COPY ? nullptr : reinterpret_cast<const void*>(a.input);
  p.out = reinterpret_cast<void*>(a.output);
  p.packs = packs;
  const int blocks = std::min(c->block_limit, (packs + kThreads - 1) / kThreads);
  return launch(c, eager, kernel, &p, blocks, kThreads, stream, c->kernels.pdl != 0);
}

int launch_push(Comm* c, const graphar_all_reduce_args& a, const void* kernel, bool eager, cudaStream_t stream) {
  PushParams p = push_params(c, eager, a.input, a.output, a.nbytes);
  const int blocks = std::min(c->block_limit, (p.packs + kPushThreads - 1) / kPushThreads);
  return launch(c, eager, kernel, &p, blocks, kPushThreads, stream, c->kernels.pdl != 0);
}

}  // namespace

extern "C" {

int graphar_comm_all_reduce(void* comm, const graphar_all_reduce_args* args) {
  Comm* c = as_comm(comm);
  const graphar_all_reduce_args& a = *args;
  const void* kernel = kernel_for(a.dtype, c->ranks, a.algo);
  if (kernel == nullptr) return fail(GRAPHAR_EINVAL, "no kernel for dtype %d, algorithm %d", a.dtype, a.algo);
  if (int rc = check_all_reduce(c, a)) return rc;
  auto stream = reinterpret_cast<cudaStream_t>(a.stream);
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  bool eager = a.path == GRAPHAR_UNCAPTURED;  // a plan asked the stream; the other paths are captures
  if (a.path == GRAPHAR_EAGER) {
    if (int rc = is_eager(stream, &eager)) return rc;
  }
  return is_push(a.algo) ? launch_push(c, a, kernel, eager, stream) : launch_v1(c, a, kernel, eager, stream);
}

}  // extern "C"
