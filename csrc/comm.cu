// The communicator's lifecycle: its buffers (Signal + tmp + push receive region, registered input,
// graph slots, error record), the IPC mappings of the peers' buffers, the P2P probe, the push limits
// and teardown. Its graph slots are filled in graph_slots.cu, its exchange buffers made in exchange.cu.
#include <cuda_runtime.h>

#include <climits>
#include <cstring>
#include <string>
#include <utility>

#include "flags.cuh"
#include "comm.cuh"
#include "graphar_cuda.h"
#include "host.h"

using namespace graphar;

namespace graphar {

int close_unused_mappings(Comm* c) {
  FirstError first;
  for (auto& m : c->unused_mappings) first.note(m.release(), "cudaIpcCloseMemHandle(graph buffer)");
  c->unused_mappings.clear();
  return first.rc;
}

}  // namespace graphar

namespace {

// Everything the communicator owns, closed and freed now (the device idle), the first error reported.
int close_and_free(Comm* c) {
  FirstError first;
  for (auto& kv : c->graph_mappings) c->unused_mappings.push_back(std::move(kv.second.base));
  c->graph_mappings.clear();
  first.note(close_unused_mappings(c));
  first.note(drop_exchange(c, false));
  for (auto& m : c->retired_peer) first.note(m.release(), "cudaIpcCloseMemHandle(retired exchange)");
  for (auto& m : c->retired_own) first.note(m.release(), "cudaFree(retired exchange)");
  for (int r = 0; r < c->ranks; r++) {
    first.note(c->peer_meta[r].release(), "cudaIpcCloseMemHandle(signal)");
    first.note(c->peer_buffer[r].release(), "cudaIpcCloseMemHandle(buffer)");
  }
  first.note(c->meta.release(), "cudaFree(meta)");
  first.note(c->buffer.release(), "cudaFree(buffer)");
  first.note(c->slots.release(), "cudaFree(slots)");
  first.note(c->error.release(), "cudaFreeHost(error record)");
  first.note(c->last_event.release(), "cudaEventDestroy");
  delete c;
  return first.rc;
}

// A communicator whose launches a CUDA graph holds: the graph's kernels carry its buffers, the
// peers' mappings and the error record by address, and nothing tells graphar when the graph dies.
// So they stay allocated and mapped for the rest of the process, and the group is marked failed: a
// replay after destroy writes NaN (flags.cuh) instead of touching freed or reused memory. The
// communicator itself is never deleted: it owns them.
int retire_for_graphs(Comm* c) {
  const Flag failed = 1;
  FirstError first;
  first.note(cudaMemcpy(&c->signals.signals[c->rank]->failed, &failed, sizeof(failed), cudaMemcpyHostToDevice),
             "cudaMemcpy(failed flag)");
  first.note(c->last_event.release(), "cudaEventDestroy");  // only eager calls wait on it
  return first.rc;
}

// Two epochs per launch class (push.cuh epoch_regions).
uint64_t push_region_bytes(const Comm* c) { return 4 * static_cast<uint64_t>(c->epoch_packs) * 16; }

__global__ void compiled_arch() {}

// Whether the kernels running on this device wait for the previous kernel with griddepcontrol.wait,
// which only their code for sm_90 and up holds (pdl.cuh). A GPU newer than the build's targets
// runs the library's compute_80 PTX instead, whose kernels would read what the previous kernel has
// not written yet if they were launched with programmatic dependent launch.
int pdl_compiled_in(bool* yes) {
  cudaFuncAttributes attributes{};
  // Every .cu file of the library is built for the same targets: this kernel's code is the kernels'.
  CUDA_TRY(cudaFuncGetAttributes(&attributes, compiled_arch));
  *yes = attributes.ptxVersion >= 90;
  return 0;
}

int create(Comm* c) {
  if (int rc = pdl_compiled_in(&c->pdl)) return rc;
  if (int rc = device_alloc(c->meta, sizeof(Signal) + c->max_bytes + push_region_bytes(c), "cudaMalloc(meta)")) return rc;
  if (int rc = device_alloc(c->buffer, c->max_bytes, "cudaMalloc(buffer)")) return rc;
  if (int rc = device_alloc(c->slots, sizeof(RankData) * c->graph_slots, "cudaMalloc(slots)")) return rc;
  void* error = nullptr;
  CUDA_TRY(cudaHostAlloc(&error, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  c->error.adopt(static_cast<ErrorRecord*>(error));
  memset(error, 0, sizeof(ErrorRecord));
  CUDA_TRY(cudaHostGetDevicePointer(&c->error_device, error, 0));
  cudaEvent_t event = nullptr;
  CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  c->last_event.adopt(event);
  // Zeroed before any handle leaves this process: a peer's first flag must never be wiped.
  CUDA_TRY(cudaMemset(c->meta.get(), 0, sizeof(Signal) + c->max_bytes));
  CUDA_TRY(cudaMemset(push_region(c->meta.get(), c->max_bytes), 0xFF, push_region_bytes(c)));  // every slot kEmpty
  CUDA_TRY(cudaMemset(c->buffer.get(), 0, c->max_bytes));
  CUDA_TRY(cudaMemset(c->slots.get(), 0, sizeof(RankData) * c->graph_slots));
  CUDA_TRY(cudaDeviceSynchronize());
  return 0;
}

__host__ __device__ constexpr uint32_t probe_value(int writer, int owner) { return 0x6a000000u | (writer << 8) | owner; }

__global__ void p2p_probe(RankSignals sg, int rank, int ranks, int phase, uint32_t* result) {
  const int peer = threadIdx.x;
  if (peer >= ranks) return;
  Flag* theirs = tmp_buffer<Flag>(sg.signals[peer]);
  Flag* mine = tmp_buffer<Flag>(sg.signals[rank]);
  if (phase == 0) {
    st_flag<false>(&theirs[rank], probe_value(rank, peer));
  } else {
    result[peer] = ld_flag<false>(&theirs[rank]);            // our store, loaded back from the peer
    result[kMaxRanks + peer] = ld_flag<false>(&mine[peer]);  // the peer's store into our memory
  }
}

}  // namespace

extern "C" {

int graphar_comm_create(int rank, int world_size, uint64_t max_bytes, int block_limit, uint64_t timeout_ns,
                        int graph_slots, void** comm_out) {
  *comm_out = nullptr;
  if (world_size != 2 && world_size != 4 && world_size != 6 && world_size != 8) {
    return fail(GRAPHAR_EINVAL, "world size %d is not one of 2, 4, 6, 8", world_size);
  }
  if (rank < 0 || rank >= world_size) return fail(GRAPHAR_EINVAL, "rank %d out of [0, %d)", rank, world_size);
  // The push region's epoch (2 * max_bytes and a few packs) must be indexable with an int.
  if (max_bytes == 0 || max_bytes % 16 != 0 || max_bytes / 16 > static_cast<uint64_t>(INT_MAX / 2 - 1024)) {
    return fail(GRAPHAR_EINVAL, "max_bytes %llu must be a positive multiple of 16 below 16 GiB",
                static_cast<unsigned long long>(max_bytes));
  }
  if (block_limit < 1 || block_limit > kMaxBlocks) {
    return fail(GRAPHAR_EINVAL, "block limit %d out of [1, %d]", block_limit, kMaxBlocks);
  }
  if (graph_slots < 1) return fail(GRAPHAR_EINVAL, "graph_slots %d must be positive", graph_slots);
  Comm* c = new Comm;
  c->rank = rank;
  c->ranks = world_size;
  c->max_bytes = max_bytes;
  c->block_limit = block_limit;
  c->timeout_ns = timeout_ns;
  c->graph_slots = graph_slots;
  // Room for a two-shot of max_bytes: 2 * ws slots of the largest shard, at most packs / ws + ws.
  c->epoch_packs = 2 * static_cast<int64_t>(max_bytes / 16) + 2 * kMaxRanks * kMaxRanks;
  const cudaError_t e = cudaGetDevice(&c->device);
  int rc = e != cudaSuccess ? cuda_fail(e, "cudaGetDevice") : create(c);
  if (rc != 0) {
    delete c;  // its owners free what it made
    return rc;
  }
  *comm_out = c;
  return 0;
}

int graphar_comm_handles(void* comm, void* handles_out) {
  Comm* c = as_comm(comm);
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  cudaIpcMemHandle_t h[2];
  CUDA_TRY(cudaIpcGetMemHandle(&h[0], c->meta.get()));
  CUDA_TRY(cudaIpcGetMemHandle(&h[1], c->buffer.get()));
  memcpy(handles_out, h, sizeof(h));
  return 0;
}

int graphar_comm_open(void* comm, const void* handles) {
  Comm* c = as_comm(comm);
  if (c->opened) return fail(GRAPHAR_EINVAL, "the peers' buffers are already open");
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  const auto* h = static_cast<const cudaIpcMemHandle_t*>(handles);
  c->opened = true;  // an open that fails half-way is not tried again; destroy closes what it opened
  for (int r = 0; r < c->ranks; r++) {
    if (r == c->rank) {
      c->signals.signals[r] = reinterpret_cast<Signal*>(c->meta.get());
      continue;
    }
    if (int rc = open_peer(c->peer_meta[r], h[2 * r], "cudaIpcOpenMemHandle(signal)")) return rc;
    c->signals.signals[r] = reinterpret_cast<Signal*>(c->peer_meta[r].get());
    if (int rc = open_peer(c->peer_buffer[r], h[2 * r + 1], "cudaIpcOpenMemHandle(buffer)")) return rc;
  }
  RankData eager{};
  for (int r = 0; r < c->ranks; r++) {
    eager.ptrs[r] = c->buffer_of(r);
    c->regions.ptrs[r] = push_region(c->signals.signals[r], c->max_bytes);
  }
  CUDA_TRY(cudaMemcpy(c->slots.get(), &eager, sizeof(eager), cudaMemcpyHostToDevice));
  CUDA_TRY(cudaDeviceSynchronize());
  return 0;
}

int graphar_comm_probe(void* comm, int phase, int* bad_peer) {
  Comm* c = as_comm(comm);
  *bad_peer = -1;
  if (!c->opened) return fail(GRAPHAR_EINVAL, "probe before the peers' buffers were opened");
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  uint32_t* result = nullptr;
  CUDA_TRY(cudaMalloc(&result, 2 * kMaxRanks * sizeof(uint32_t)));
  p2p_probe<<<1, 32>>>(c->signals, c->rank, c->ranks, phase, result);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  uint32_t host[2 * kMaxRanks] = {};
  if (e == cudaSuccess && phase != 0) e = cudaMemcpy(host, result, sizeof(host), cudaMemcpyDeviceToHost);
  const cudaError_t freed = cudaFree(result);
  if (e == cudaSuccess) e = freed;
  if (e != cudaSuccess) return cuda_fail(e, "p2p probe");
  for (int r = 0; phase != 0 && r < c->ranks; r++) {
    if (host[r] != probe_value(c->rank, r) || host[kMaxRanks + r] != probe_value(r, c->rank)) {
      *bad_peer = r;
      break;
    }
  }
  return 0;
}

int graphar_comm_error_record(void* comm, void** record_out) {
  *record_out = as_comm(comm)->error.get();
  return 0;
}

int graphar_comm_failed_flag(void* comm, void** flag_out) {
  const Comm* c = as_comm(comm);
  *flag_out = &c->signals.signals[c->rank]->failed;
  return 0;
}

int graphar_comm_push_limits(void* comm, uint64_t* one_shot, uint64_t* two_shot) {
  const Comm* c = as_comm(comm);
  *one_shot = one_shot_limit(c);
  *two_shot = c->max_bytes;  // the epoch was sized for it
  return 0;
}

int graphar_comm_destroy(void* comm) {
  Comm* c = as_comm(comm);
  if (c == nullptr) return 0;
  DeviceGuard g;
  int rc = g.enter(c->device);
  // Graph replays or eager launches may still read these buffers.
  const cudaError_t e = cudaDeviceSynchronize();
  // Mappings no live graph reads can go even when the communicator stays for graphs.
  const int closed = e == cudaSuccess ? close_unused_mappings(c) : 0;
  int freed = c->captured_launches != 0 ? retire_for_graphs(c) : close_and_free(c);
  if (freed == 0) freed = closed;
  if (rc == 0 && e != cudaSuccess) rc = cuda_fail(e, "cudaDeviceSynchronize");
  return rc != 0 ? rc : freed;
}

}  // extern "C"
