// The communicator's lifecycle: its buffers (Signal + tmp + push receive region, registered input,
// graph slots, error record), the IPC mappings of the peers' buffers, the P2P probe, the push limits
// and teardown. Its graph slots are filled in graph_slots.cu, its exchange buffers made in exchange.cu.
#include <cuda_runtime.h>

#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "flags.cuh"
#include "comm.cuh"
#include "graphar_cuda.h"
#include "host.h"

using namespace graphar;

namespace graphar {

int close_unused_mappings(Comm* c) {
  int first = 0;
  for (char* base : c->unused_mappings) {
    const cudaError_t e = cudaIpcCloseMemHandle(base);
    if (e != cudaSuccess && first == 0) first = cuda_fail(e, "cudaIpcCloseMemHandle(graph buffer)");
  }
  c->unused_mappings.clear();
  return first;
}

}  // namespace graphar

namespace {

int close_and_free(Comm* c) {
  int first = 0;
  auto note = [&](cudaError_t e, const char* what) {
    if (e != cudaSuccess && first == 0) first = cuda_fail(e, what);
  };
  for (auto& kv : c->graph_mappings) c->unused_mappings.push_back(kv.second.base);
  c->graph_mappings.clear();
  if (const int rc = close_unused_mappings(c); rc != 0 && first == 0) first = rc;
  if (const int rc = drop_exchange(c, false); rc != 0 && first == 0) first = rc;
  for (void* p : c->retired_peer) note(cudaIpcCloseMemHandle(p), "cudaIpcCloseMemHandle(retired exchange)");
  for (void* p : c->retired_own) note(cudaFree(p), "cudaFree(retired exchange)");
  for (int r = 0; r < c->ranks && c->opened; r++) {
    if (r == c->rank) continue;
    if (c->signals.signals[r]) note(cudaIpcCloseMemHandle(c->signals.signals[r]), "cudaIpcCloseMemHandle(signal)");
    if (c->peer_buffers[r]) note(cudaIpcCloseMemHandle(c->peer_buffers[r]), "cudaIpcCloseMemHandle(buffer)");
  }
  if (c->meta) note(cudaFree(c->meta), "cudaFree(meta)");
  if (c->buffer) note(cudaFree(c->buffer), "cudaFree(buffer)");
  if (c->slots) note(cudaFree(c->slots), "cudaFree(slots)");
  if (c->error) note(cudaFreeHost(c->error), "cudaFreeHost(error record)");
  if (c->last_event) note(cudaEventDestroy(c->last_event), "cudaEventDestroy");
  delete c;
  return first;
}

// A communicator whose launches a CUDA graph holds: the graph's kernels carry its buffers, the
// peers' mappings and the error record by address, and nothing tells graphar when the graph dies.
// So they stay allocated and mapped for the rest of the process, and the group is marked failed: a
// replay after destroy writes NaN (flags.cuh) instead of touching freed or reused memory.
int retire_for_graphs(Comm* c) {
  const Flag failed = 1;
  const cudaError_t marked = cudaMemcpy(&c->signals.signals[c->rank]->failed, &failed, sizeof(failed),
                                        cudaMemcpyHostToDevice);
  // Only eager calls wait on the event: it goes.
  const cudaError_t destroyed = c->last_event ? cudaEventDestroy(c->last_event) : cudaSuccess;
  delete c;
  if (marked != cudaSuccess) return cuda_fail(marked, "cudaMemcpy(failed flag)");
  return destroyed == cudaSuccess ? 0 : cuda_fail(destroyed, "cudaEventDestroy");
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
  CUDA_TRY(cudaMalloc(&c->meta, sizeof(Signal) + c->max_bytes + push_region_bytes(c)));
  CUDA_TRY(cudaMalloc(&c->buffer, c->max_bytes));
  CUDA_TRY(cudaMalloc(&c->slots, sizeof(RankData) * c->graph_slots));
  CUDA_TRY(cudaHostAlloc(&c->error, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  memset(c->error, 0, sizeof(ErrorRecord));
  CUDA_TRY(cudaHostGetDevicePointer(&c->error_device, c->error, 0));
  CUDA_TRY(cudaEventCreateWithFlags(&c->last_event, cudaEventDisableTiming));
  // Zeroed before any handle leaves this process: a peer's first flag must never be wiped.
  CUDA_TRY(cudaMemset(c->meta, 0, sizeof(Signal) + c->max_bytes));
  CUDA_TRY(cudaMemset(push_region(c->meta, c->max_bytes), 0xFF, push_region_bytes(c)));  // every slot kEmpty
  CUDA_TRY(cudaMemset(c->buffer, 0, c->max_bytes));
  CUDA_TRY(cudaMemset(c->slots, 0, sizeof(RankData) * c->graph_slots));
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
    const std::string msg = t_last_error;
    close_and_free(c);
    t_last_error = msg;
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
  CUDA_TRY(cudaIpcGetMemHandle(&h[0], c->meta));
  CUDA_TRY(cudaIpcGetMemHandle(&h[1], c->buffer));
  memcpy(handles_out, h, sizeof(h));
  return 0;
}

int graphar_comm_open(void* comm, const void* handles) {
  Comm* c = as_comm(comm);
  if (c->opened) return fail(GRAPHAR_EINVAL, "the peers' buffers are already open");
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  const auto* h = static_cast<const cudaIpcMemHandle_t*>(handles);
  c->opened = true;  // from here on close_and_free closes whatever got opened
  for (int r = 0; r < c->ranks; r++) {
    if (r == c->rank) {
      c->signals.signals[r] = reinterpret_cast<Signal*>(c->meta);
      c->peer_buffers[r] = c->buffer;
      continue;
    }
    void* meta = nullptr;
    void* buffer = nullptr;
    CUDA_TRY(cudaIpcOpenMemHandle(&meta, h[2 * r], cudaIpcMemLazyEnablePeerAccess));
    c->signals.signals[r] = static_cast<Signal*>(meta);
    CUDA_TRY(cudaIpcOpenMemHandle(&buffer, h[2 * r + 1], cudaIpcMemLazyEnablePeerAccess));
    c->peer_buffers[r] = buffer;
  }
  RankData eager{};
  for (int r = 0; r < c->ranks; r++) {
    eager.ptrs[r] = c->peer_buffers[r];
    c->regions.ptrs[r] = push_region(c->signals.signals[r], c->max_bytes);
  }
  CUDA_TRY(cudaMemcpy(c->slots, &eager, sizeof(eager), cudaMemcpyHostToDevice));
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
  *record_out = as_comm(comm)->error;
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

int graphar_comm_set_barrier_counters(void* comm, uint32_t value) {
  Comm* c = as_comm(comm);
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  std::vector<Signal> host(1);
  Signal& s = host[0];
  for (int b = 0; b < kMaxBlocks; b++) {
    for (int r = 0; r < kMaxRanks; r++) {
      s.self_counter[b][r] = value;  // the flags as eager calls store them (flags.cuh flag_value)
      s.peer_counter[value & 1][b][r] = value & kCount;
      s.peer_counter[(value + 1) & 1][b][r] = (value - 1) & kCount;
    }
    s.push_epoch[0][b] = s.push_epoch[1][b] = value;
  }
  CUDA_TRY(cudaDeviceSynchronize());
  CUDA_TRY(cudaMemcpy(c->meta, &s, sizeof(Signal), cudaMemcpyHostToDevice));
  CUDA_TRY(cudaDeviceSynchronize());
  return 0;
}

int graphar_comm_registered_buffer(void* comm, uint64_t* ptr_out) {
  *ptr_out = reinterpret_cast<uint64_t>(as_comm(comm)->buffer);
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
