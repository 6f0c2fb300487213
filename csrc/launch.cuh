// The launch entry points: kernel choice by dtype, algorithm and world size, the checks of each
// call, and the eager ordering (one op in flight per communicator) both launches share.
#pragma once

#include <algorithm>

#include "all_reduce.cuh"
#include "all_to_all.cuh"
#include "comm.cuh"

using namespace graphar;

namespace {

using Kernel = void (*)(Params);

template <typename T>
Kernel pick(int ranks, int algo) {
  const bool one = algo == GRAPHAR_ONE_STAGE;
  switch (ranks) {
    case 2: return one ? one_stage<T, 2> : two_stage<T, 2>;
    case 4: return one ? one_stage<T, 4> : two_stage<T, 4>;
    case 6: return one ? one_stage<T, 6> : two_stage<T, 6>;
    case 8: return one ? one_stage<T, 8> : two_stage<T, 8>;
    default: return nullptr;
  }
}

using PullKernel = void (*)(AllToAllParams);

PullKernel pull_kernel_for(int ranks) {
  switch (ranks) {
    case 2: return pull_all_to_all<2>;
    case 4: return pull_all_to_all<4>;
    case 6: return pull_all_to_all<6>;
    case 8: return pull_all_to_all<8>;
    default: return nullptr;
  }
}

Kernel kernel_for(int dtype, int ranks, int algo) {
  if (algo != GRAPHAR_ONE_STAGE && algo != GRAPHAR_TWO_STAGE) return nullptr;
  switch (dtype) {
    case GRAPHAR_FLOAT32: return pick<float>(ranks, algo);
    case GRAPHAR_FLOAT16: return pick<__half>(ranks, algo);
    case GRAPHAR_BFLOAT16: return pick<__nv_bfloat16>(ranks, algo);
    default: return nullptr;
  }
}

// One op in flight per communicator: an eager launch on another stream waits for the previous one
// instead of racing it for the Signal and the registered buffers.
int wait_for_previous(Comm* c, cudaStream_t stream) {
  if (c->launched && stream != c->last_stream) CUDA_TRY(cudaStreamWaitEvent(stream, c->last_event, 0));
  return 0;
}

// What every launch's barrier reads, from the communicator.
BarrierParams barrier_params(const Comm* c) {
  BarrierParams b{};
  b.signals = c->signals;
  b.self = c->signals.signals[c->rank];
  b.error = c->error_device;
  b.timeout_ns = c->timeout_ns;
  b.rank = c->rank;
  return b;
}

// Launches kernel(p) on the communicator's device (current already); an eager launch first waits
// for the previous eager op and then becomes the op the next one waits for.
template <typename P>
int launch(Comm* c, int mode, void (*kernel)(P), int blocks, int threads, cudaStream_t stream, const P& p) {
  const bool eager = mode == GRAPHAR_EAGER;
  if (eager) {
    if (int rc = wait_for_previous(c, stream)) return rc;
  }
  kernel<<<blocks, threads, 0, stream>>>(p);
  CUDA_TRY(cudaGetLastError());
  if (!eager) return 0;
  CUDA_TRY(cudaEventRecord(c->last_event, stream));
  c->last_stream = stream;
  c->launched = true;
  return 0;
}

}  // namespace

extern "C" {

int graphar_comm_all_reduce(void* comm, int dtype, int algo, int mode, uint64_t input, uint64_t output,
                            uint64_t nbytes, int slot, uint64_t stream_handle) {
  Comm* c = as_comm(comm);
  if (!c->opened) return fail(GRAPHAR_EINVAL, "launch before the peers' buffers were opened");
  const Kernel kernel = kernel_for(dtype, c->ranks, algo);
  if (kernel == nullptr) return fail(GRAPHAR_EINVAL, "no kernel for dtype %d, algorithm %d", dtype, algo);
  if (nbytes == 0 || nbytes % 16 != 0 || nbytes > c->max_bytes) {
    return fail(GRAPHAR_EINVAL, "%llu bytes: not a positive multiple of 16 up to %llu",
                static_cast<unsigned long long>(nbytes), static_cast<unsigned long long>(c->max_bytes));
  }
  if (input % 16 != 0 || output % 16 != 0) return fail(GRAPHAR_EINVAL, "input and output must be 16-byte aligned");
  const bool graph_slot = mode == GRAPHAR_ZERO_COPY || mode == GRAPHAR_STAGED;
  if (graph_slot && (slot < 1 || slot >= c->graph_slots)) {
    return fail(GRAPHAR_EINVAL, "graph slot %d out of [1, %d)", slot, c->graph_slots);
  }
  if (!graph_slot && mode != GRAPHAR_EAGER && mode != GRAPHAR_CAPTURED_COPY) {
    return fail(GRAPHAR_EINVAL, "unknown input path %d", mode);
  }
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int packs = static_cast<int>(nbytes / 16);
  const int blocks = std::min(c->block_limit, (packs + kThreads - 1) / kThreads);

  Params p{};
  p.barrier = barrier_params(c);
  p.data = c->slots + (graph_slot ? slot : 0);
  p.copy_in = graph_slot ? nullptr : reinterpret_cast<const void*>(input);
  p.out = reinterpret_cast<void*>(output);
  p.packs = packs;

  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  if (mode == GRAPHAR_STAGED) {
    CUDA_TRY(cudaMemcpyAsync(c->buffer, reinterpret_cast<const void*>(input), nbytes, cudaMemcpyDeviceToDevice,
                             stream));
  }
  return launch(c, mode, kernel, blocks, kThreads, stream, p);
}

int graphar_comm_order(void* comm, uint64_t stream_handle) {
  Comm* c = as_comm(comm);
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  return wait_for_previous(c, reinterpret_cast<cudaStream_t>(stream_handle));
}

int graphar_comm_all_to_all(void* comm, int mode, uint64_t output, uint64_t src_offset, uint64_t chunk_bytes,
                            uint64_t row_bytes, uint64_t dst_row_stride, uint64_t dst_chunk_stride, int blocks,
                            uint64_t stream_handle) {
  Comm* c = as_comm(comm);
  const PullKernel kernel = pull_kernel_for(c->ranks);
  if (kernel == nullptr || c->exchange_bytes == 0) return fail(GRAPHAR_EINVAL, "no exchange buffers are open");
  if (mode != GRAPHAR_EAGER && mode != GRAPHAR_CAPTURED_COPY) return fail(GRAPHAR_EINVAL, "unknown path %d", mode);
  if (blocks < 1 || blocks > kMaxBlocks) return fail(GRAPHAR_EINVAL, "%d blocks out of [1, %d]", blocks, kMaxBlocks);
  if (chunk_bytes == 0 || row_bytes == 0 || chunk_bytes % row_bytes != 0 || src_offset > c->exchange_bytes ||
      chunk_bytes > (c->exchange_bytes - src_offset) / c->ranks) {
    return fail(GRAPHAR_EINVAL, "%d chunks of %llu bytes in rows of %llu from offset %llu do not fit %llu bytes",
                c->ranks, static_cast<unsigned long long>(chunk_bytes), static_cast<unsigned long long>(row_bytes),
                static_cast<unsigned long long>(src_offset), static_cast<unsigned long long>(c->exchange_bytes));
  }
  if ((output | src_offset | row_bytes | dst_row_stride | dst_chunk_stride) % 16 != 0) {
    return fail(GRAPHAR_EINVAL, "output, offset, row size and strides must be multiples of 16 bytes");
  }
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  AllToAllParams p{};
  p.barrier = barrier_params(c);
  p.out = reinterpret_cast<void*>(output);
  for (int r = 0; r < c->ranks; r++) p.sends.ptrs[r] = c->exchange_ptrs[r];
  p.src_offset = static_cast<int64_t>(src_offset / 16);
  p.place = {static_cast<int64_t>(chunk_bytes / 16), static_cast<int64_t>(row_bytes / 16),
             static_cast<int64_t>(dst_row_stride / 16), static_cast<int64_t>(dst_chunk_stride / 16)};
  const int64_t wanted = (p.place.chunk_packs + kPullThreads - 1) / kPullThreads;
  blocks = static_cast<int>(std::min<int64_t>(blocks, wanted));

  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  return launch(c, mode, kernel, blocks, kPullThreads, stream, p);
}

}  // extern "C"
