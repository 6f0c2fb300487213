// The testing library (graphar_testing.h): built beside the shipped libgraphar_cuda.so, never in it.
#include <cuda_runtime.h>

#include <climits>
#include <cstdarg>
#include <cstdio>
#include <string>

#include "comm.cuh"
#include "flags.cuh"
#include "graphar_testing.h"
#include "norm_grid.h"

using namespace graphar;

namespace {

thread_local std::string t_error;

int fail(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  t_error = buf;
  return -1;
}

#define TRY(call)                                                                   \
  do {                                                                              \
    const cudaError_t e_ = (call);                                                  \
    if (e_ != cudaSuccess) return fail("%s: %s", #call, cudaGetErrorString(e_));    \
  } while (0)

// The slot this rank reads as rank 1's, one flag past its own Signal: a loopback's peer signal.
Signal* loopback_peer(Comm* c) { return reinterpret_cast<Signal*>(reinterpret_cast<Flag*>(c->meta.get()) + 1); }

}  // namespace

extern "C" {

const char* graphar_testing_last_error(void) { return t_error.c_str(); }

int graphar_testing_set_barrier_counters(void* comm, uint32_t value) {
  Comm* c = as_comm(comm);
  TRY(cudaSetDevice(c->device));
  Signal s{};
  for (int b = 0; b < kMaxBlocks; b++) {
    for (int r = 0; r < kMaxRanks; r++) {
      s.self_counter[b][r] = value;  // the flags as eager calls store them (flags.cuh flag_value)
      s.peer_counter[value & 1][b][r] = value & kCount;
      s.peer_counter[(value + 1) & 1][b][r] = (value - 1) & kCount;
    }
    s.push_epoch[0][b] = s.push_epoch[1][b] = value;
  }
  TRY(cudaDeviceSynchronize());
  TRY(cudaMemcpy(c->meta.get(), &s, sizeof(Signal), cudaMemcpyHostToDevice));
  TRY(cudaDeviceSynchronize());
  return 0;
}

int graphar_testing_registered_buffer(void* comm, uint64_t* ptr_out) {
  *ptr_out = reinterpret_cast<uint64_t>(as_comm(comm)->buffer.get());
  return 0;
}

int graphar_testing_loopback(void* comm, uint64_t nbytes) {
  Comm* c = as_comm(comm);
  const bool looped = c->opened && c->signals.signals[1] == loopback_peer(c);
  if (c->ranks != 2 || c->rank != 0 || (c->opened && !looped)) {
    return fail("a loopback takes a world-size-2 communicator of rank 0, never opened");
  }
  if (nbytes == 0 || nbytes > c->max_bytes) return fail("a loopback for %llu bytes", (unsigned long long)nbytes);
  // No peer is mapped: destroy has nothing of a peer's to close.
  c->signals.signals[0] = reinterpret_cast<Signal*>(c->meta.get());
  // The kernel stores its call word for rank 1 at signals[1]->push_calls[...][0], one flag on: its
  // own word from rank 1, which it checks.
  c->signals.signals[1] = loopback_peer(c);
  char* own = push_region(c->meta.get(), c->max_bytes);
  c->regions.ptrs[0] = own;
  c->regions.ptrs[1] = own + nbytes;  // + epoch + pack i: its slot for rank 1's pack i
  c->opened = true;
  return 0;
}

int graphar_testing_graph_mappings(void* comm, int* open, int* unused) {
  const Comm* c = as_comm(comm);
  *open = static_cast<int>(c->graph_mappings.size());
  *unused = static_cast<int>(c->unused_mappings.size());
  return 0;
}

int graphar_testing_norm_split(void* comm, int max_split) {
  if (max_split < 0) return fail("max_split %d", max_split);
  as_comm(comm)->norm_max_split = max_split;
  return 0;
}

int graphar_testing_norm_grid(void* comm, uint64_t nbytes, uint64_t row_bytes, int block_limit, uint64_t scratch_words,
                              int max_split, int* blocks, int* threads, int* split) {
  if (comm != nullptr) {
    const Comm* c = as_comm(comm);
    block_limit = c->block_limit;
    scratch_words = norm_scratch(c, reinterpret_cast<Signal*>(c->meta.get())).count;
    max_split = c->norm_max_split;
  }
  if (row_bytes == 0 || row_bytes % 16 != 0 || row_bytes > kNormMaxRowBytes || nbytes == 0 || nbytes % row_bytes != 0 ||
      nbytes / 16 > INT_MAX || block_limit < 1 || block_limit > kMaxBlocks) {
    return fail("no grid for %llu bytes in rows of %llu over %d blocks", (unsigned long long)nbytes,
                (unsigned long long)row_bytes, block_limit);
  }
  const NormGrid g = norm_grid(static_cast<int64_t>(nbytes / row_bytes), static_cast<int>(row_bytes / 16), block_limit,
                               scratch_words, max_split);
  *blocks = g.blocks;
  *threads = g.threads;
  *split = g.split;
  return 0;
}

}  // extern "C"
