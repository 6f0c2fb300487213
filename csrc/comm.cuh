// The communicator every entry point with a handle takes (struct Comm), and what the files of its
// entry points share of it: the layout of its meta allocation, the mappings its graph slots read
// (closed in comm.cu) and its exchange buffers (dropped in exchange.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "graphar_cuda.h"
#include "owned.h"
#include "signal.cuh"

namespace graphar {

struct Comm {
  int device = -1, rank = 0, ranks = 0, block_limit = 0, graph_slots = 0;
  uint64_t max_bytes = 0, timeout_ns = 0;
  int64_t epoch_packs = 0;  // packs per epoch of the push receive region
  bool pdl = false;         // the kernels may use programmatic dependent launch (pdl_compiled_in)
  graphar_kernels kernels{};  // which kernel serves which call (plan.cu): none until set
  int norm_max_split = 0;     // n > 0: the fused norm splits a row between at most n blocks (norm_grid.h)
  // What it owns (owned.h): graphar_comm_destroy frees it and reports the first error; any other way
  // out (a create that fails half-way) frees it through the owners.
  DeviceMemory<char> meta;     // Signal, the 2stage tmp buffer (max_bytes), the push region (2 epochs)
  DeviceMemory<char> buffer;   // registered input buffer (max_bytes)
  DeviceMemory<RankData> slots;  // slot 0: the registered buffers; 1..: graph calls
  PinnedMemory<ErrorRecord> error;  // host-mapped: read by the host, written by kernels through error_device
  ErrorRecord* error_device = nullptr;
  // The peers' meta and input buffers, mapped by graphar_comm_open (this rank's own: none).
  PeerMapping<char> peer_meta[kMaxRanks], peer_buffer[kMaxRanks];
  RankSignals signals{};  // every rank's Signal as the kernels read it: meta, or the peer's mapping
  RankData regions{};  // every rank's push receive region, inside its meta allocation
  bool opened = false;
  // Peers' allocations that graph slots read, by IPC handle: opened by the first slot that needs one,
  // closed once no slot does (after the device is idle, as a replay of a freed graph may still run).
  struct Mapping {
    PeerMapping<char> base;
    int slots;  // graph slots that read it
  };
  std::map<std::string, Mapping> graph_mappings;
  std::map<int, std::vector<std::string>> slot_mappings;  // what each filled graph slot reads
  std::vector<PeerMapping<char>> unused_mappings;  // no slot reads them: closed at the next idle point
  Event last_event;
  cudaStream_t last_stream = nullptr;
  bool launched = false;
  uint64_t launches = 0;  // launches so far, captured ones too: the next one's tag is launches + 1
  // Of them captured, into CUDA graphs that may be replayed after destroy: the next one's call is
  // this + 1 (BarrierParams::call).
  uint64_t captured_launches = 0;
  // All-to-all exchange buffers: this rank's and the peers' mappings, all of exchange_bytes; zero
  // until graphar_comm_exchange_open. Buffers a captured graph may still use are retired (kept until
  // destroy) when they are replaced.
  uint64_t exchange_bytes = 0;
  DeviceMemory<char> exchange_own;
  PeerMapping<char> exchange_peer[kMaxRanks];
  std::vector<DeviceMemory<char>> retired_own;
  std::vector<PeerMapping<char>> retired_peer;

  // Rank r's input buffer as this process maps it.
  void* buffer_of(int r) const { return r == rank ? buffer.get() : peer_buffer[r].get(); }
  // Rank r's exchange buffer as this process maps it.
  char* exchange_of(int r) const { return r == rank ? exchange_own.get() : exchange_peer[r].get(); }
};

inline Comm* as_comm(void* p) { return static_cast<Comm*>(p); }

// The push one-shot's largest message: each rank's packs land in every peer's epoch.
inline uint64_t one_shot_limit(const Comm* c) {
  const uint64_t room = static_cast<uint64_t>(c->epoch_packs / c->ranks) * 16;
  return room < c->max_bytes ? room : c->max_bytes;
}

// Where the push receive region starts in a meta allocation.
inline char* push_region(void* meta, uint64_t max_bytes) {
  return static_cast<char*>(meta) + sizeof(Signal) + max_bytes;
}

// Closes the mappings no graph slot reads any more; the device must be idle (no replay reads them).
int close_unused_mappings(Comm* c);

// Frees (or, with keep, retires) the exchange buffers; the device must be idle.
int drop_exchange(Comm* c, bool keep);

}  // namespace graphar
