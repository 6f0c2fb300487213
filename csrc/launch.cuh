// What the launches of every kernel share (defined in launch.cu): the dispatch to a kernel template's
// instance by dtype and world size, the parameters the barrier and the push kernels take from the
// communicator, and launch() with the eager ordering (one op in flight per communicator).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "barrier.cuh"
#include "comm.cuh"
#include "graphar_cuda.h"
#include "push.cuh"

namespace graphar {

// The kernels are instantiated per element type and world size: these call f(Type<T>{}) for a dtype
// code and f(Ranks<kRanks>{}) for a world size, and return nullptr for a value without kernels.
template <typename T>
struct Type {
  using type = T;
};
template <int kRanks>
using Ranks = std::integral_constant<int, kRanks>;

template <typename F>
auto by_dtype(int dtype, F f) -> decltype(f(Type<float>{})) {
  switch (dtype) {
    case GRAPHAR_FLOAT32: return f(Type<float>{});
    case GRAPHAR_FLOAT16: return f(Type<__half>{});
    case GRAPHAR_BFLOAT16: return f(Type<__nv_bfloat16>{});
    default: return nullptr;
  }
}

template <typename F>
auto by_ranks(int ranks, F f) -> decltype(f(Ranks<2>{})) {
  switch (ranks) {
    case 2: return f(Ranks<2>{});
    case 4: return f(Ranks<4>{});
    case 6: return f(Ranks<6>{});
    case 8: return f(Ranks<8>{});
    default: return nullptr;
  }
}

// What the next launch's barrier reads, from the communicator; eager: not captured. tag: the launch's,
// when not the next launch's own (an exchange's copies count in under their lease's).
BarrierParams barrier_params(const Comm* c, bool eager, uint64_t tag = 0);

// A push kernel's parameters for a message of nbytes from input to output.
PushParams push_params(const Comm* c, bool eager, uint64_t input, uint64_t output, uint64_t nbytes);

// Whether a push kernel's message of nbytes fits the receive region's epoch.
int check_push_room(const Comm* c, bool one_shot, uint64_t nbytes);

// A call on a stream that is not capturing is eager: it is ordered after the communicator's previous
// eager op. A capture records no ordering event (the graph's own edges order it).
int is_eager(cudaStream_t stream, bool* eager);

// Launches kernel(*params) on the communicator's device (current already); an eager launch first
// waits for the previous eager op and then becomes the op the next one waits for. pdl: the kernel may
// start before the previous kernel on the stream ends (it waits for it with griddepcontrol.wait), where
// the loaded code holds that wait (Comm::pdl); otherwise it launches without the attribute.
int launch(Comm* c, bool eager, const void* kernel, void* params, int blocks, int threads, cudaStream_t stream,
           bool pdl);

}  // namespace graphar
