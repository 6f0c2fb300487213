// The all-to-all exchange: its buffers (made, mapped and dropped), its lease and its copies into the
// output (all_to_all.cuh's kernels, instantiated here alone).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "all_to_all.cuh"
#include "comm.cuh"
#include "graphar_cuda.h"
#include "host.h"
#include "launch.cuh"

using namespace graphar;

namespace graphar {

int drop_exchange(Comm* c, bool keep) {
  FirstError first;
  if (keep && c->exchange_own.get() != nullptr) {
    c->retired_own.push_back(std::move(c->exchange_own));
    for (auto& m : c->exchange_peer) {
      if (m.get() != nullptr) c->retired_peer.push_back(std::move(m));
    }
  }
  first.note(c->exchange_own.release(), "cudaFree(exchange)");
  for (auto& m : c->exchange_peer) first.note(m.release(), "cudaIpcCloseMemHandle(exchange)");
  c->exchange_bytes = 0;
  return first.rc;
}

}  // namespace graphar

namespace {

using GatherKernel = void (*)(AllToAllParams);

GatherKernel gather_kernel_for(int ranks) {
  return by_ranks(ranks, [](auto r) -> GatherKernel { return gather_all_to_all<r.value>; });
}

}  // namespace

extern "C" {

int graphar_comm_exchange_alloc(void* comm, uint64_t nbytes, int keep_old, uint64_t* ptr_out, void* handle_out) {
  Comm* c = as_comm(comm);
  *ptr_out = 0;
  if (!c->opened) return fail(GRAPHAR_EINVAL, "exchange buffer before the peers' buffers were opened");
  if (nbytes == 0 || nbytes % 16 != 0) {
    return fail(GRAPHAR_EINVAL, "exchange buffer of %llu bytes: not a positive multiple of 16",
                static_cast<unsigned long long>(nbytes));
  }
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  // Peers read this rank's buffer only inside kernels that end after this rank's own do (exit
  // barrier), so once this device is idle nobody reads the old buffers.
  CUDA_TRY(cudaDeviceSynchronize());
  if (int rc = close_unused_mappings(c)) return rc;  // idle anyway
  if (int rc = drop_exchange(c, keep_old != 0)) return rc;
  if (int rc = device_alloc(c->exchange_own, nbytes, "cudaMalloc(exchange)")) return rc;
  cudaIpcMemHandle_t h;
  CUDA_TRY(cudaIpcGetMemHandle(&h, c->exchange_own.get()));
  memcpy(handle_out, &h, sizeof(h));
  *ptr_out = reinterpret_cast<uint64_t>(c->exchange_own.get());
  return 0;
}

int graphar_comm_exchange_open(void* comm, uint64_t nbytes, const void* handles, uint64_t* ptrs_out) {
  Comm* c = as_comm(comm);
  if (c->exchange_own.get() == nullptr) return fail(GRAPHAR_EINVAL, "no exchange buffer of this rank to open with");
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  const auto* h = static_cast<const cudaIpcMemHandle_t*>(handles);
  for (int r = 0; r < c->ranks; r++) {
    if (r == c->rank) continue;
    if (int rc = open_peer(c->exchange_peer[r], h[r], "cudaIpcOpenMemHandle(exchange)")) return rc;
  }
  for (int r = 0; r < c->ranks; r++) ptrs_out[r] = reinterpret_cast<uint64_t>(c->exchange_of(r));
  c->exchange_bytes = nbytes;
  return 0;
}

int graphar_comm_exchange_lease(void* comm, int mode, uint64_t stream_handle, uint64_t* lease) {
  Comm* c = as_comm(comm);
  if (c->exchange_bytes == 0) return fail(GRAPHAR_EINVAL, "no exchange buffers are open");
  if (mode != GRAPHAR_EAGER && mode != GRAPHAR_CAPTURED_COPY) return fail(GRAPHAR_EINVAL, "unknown path %d", mode);
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  BarrierParams p = barrier_params(c, mode == GRAPHAR_EAGER);
  *lease = p.tag;
  return launch(c, mode == GRAPHAR_EAGER, reinterpret_cast<const void*>(exchange_lease), &p, 1, 1,
                reinterpret_cast<cudaStream_t>(stream_handle), false);
}

int graphar_comm_all_to_all(void* comm, int mode, uint64_t output, uint64_t src_offset, uint64_t chunk_bytes,
                            uint64_t row_bytes, uint64_t dst_row_stride, uint64_t dst_chunk_stride, int flags,
                            int blocks, uint64_t lease, uint64_t stream_handle) {
  Comm* c = as_comm(comm);
  const GatherKernel kernel = gather_kernel_for(c->ranks);
  if (kernel == nullptr || c->exchange_bytes == 0) return fail(GRAPHAR_EINVAL, "no exchange buffers are open");
  if (mode != GRAPHAR_EAGER && mode != GRAPHAR_CAPTURED_COPY) return fail(GRAPHAR_EINVAL, "unknown path %d", mode);
  if (blocks < 1 || blocks > kMaxBlocks) return fail(GRAPHAR_EINVAL, "%d blocks out of [1, %d]", blocks, kMaxBlocks);
  if ((flags & ~(GRAPHAR_A2A_PUSHED | GRAPHAR_A2A_OWN_PLACED | GRAPHAR_A2A_LAST)) != 0) {
    return fail(GRAPHAR_EINVAL, "unknown flags %d", flags);
  }
  if (lease == 0 || lease > c->launches) return fail(GRAPHAR_EINVAL, "lease %llu was never taken", static_cast<unsigned long long>(lease));
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
  p.barrier = barrier_params(c, mode == GRAPHAR_EAGER, lease);  // counted in beside the lease (exchange_lease)
  p.give_back = (flags & GRAPHAR_A2A_LAST) != 0;
  p.out = reinterpret_cast<void*>(output);
  const bool pushed = (flags & GRAPHAR_A2A_PUSHED) != 0;
  for (int r = 0; r < c->ranks; r++) {  // pushed: slot r of this rank's buffer; pulled: slot `rank` of rank r's
    const char* buffer = c->exchange_of(pushed ? c->rank : r);
    p.chunks.ptrs[r] = buffer + src_offset + (pushed ? r : c->rank) * chunk_bytes;
  }
  p.skip = (flags & GRAPHAR_A2A_OWN_PLACED) != 0 ? c->rank : -1;
  p.place = {static_cast<int64_t>(chunk_bytes / 16), static_cast<int64_t>(row_bytes / 16),
             static_cast<int64_t>(dst_row_stride / 16), static_cast<int64_t>(dst_chunk_stride / 16)};
  const int64_t wanted = (p.place.chunk_packs + kPullThreads - 1) / kPullThreads;
  blocks = static_cast<int>(std::min<int64_t>(blocks, wanted));

  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  return launch(c, mode == GRAPHAR_EAGER, reinterpret_cast<const void*>(kernel), &p, blocks, kPullThreads, stream,
                false);
}

}  // extern "C"
