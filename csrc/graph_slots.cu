// The graph slots of graphar.graph captures: filled on every rank when a capture ends with the
// peers' allocations its calls read in place (mapped once, counted by the slots that read them), and
// forgotten when the graph dies, after which a mapping no slot reads is closed at the next idle point.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>
#include <utility>

#include "comm.cuh"
#include "graphar_cuda.h"
#include "host.h"

using namespace graphar;

namespace {

// The slot no longer reads what it was filled with: each mapping no other slot reads becomes unused.
void forget_slot(Comm* c, int slot) {
  auto it = c->slot_mappings.find(slot);
  if (it == c->slot_mappings.end()) return;
  for (const std::string& key : it->second) {
    auto m = c->graph_mappings.find(key);
    if (--m->second.slots > 0) continue;
    c->unused_mappings.push_back(std::move(m->second.base));
    c->graph_mappings.erase(m);
  }
  c->slot_mappings.erase(it);
}

}  // namespace

extern "C" {

int graphar_comm_register_graph(void* comm, const int32_t* slots, int count, const void* handles,
                                const uint64_t* offsets, const uint8_t* staged, const uint64_t* own_ptrs) {
  Comm* c = as_comm(comm);
  if (count <= 0) return 0;
  for (int i = 0; i < count; i++) {
    if (slots[i] < 1 || slots[i] >= c->graph_slots) {
      return fail(GRAPHAR_EINVAL, "graph slot %d out of [1, %d)", slots[i], c->graph_slots);
    }
  }
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  // A recycled slot, or a mapping no slot reads any more, may still be read by a replay of the
  // destroyed graph that held it: let it end, then close what is unused before opening anew.
  CUDA_TRY(cudaDeviceSynchronize());
  if (int rc = close_unused_mappings(c)) return rc;
  const auto* h = static_cast<const cudaIpcMemHandle_t*>(handles);
  std::vector<RankData> filled(count);
  for (int i = 0; i < count; i++) {
    forget_slot(c, slots[i]);  // normally forgotten when its graph died; this keeps the counts right
    std::vector<std::string>& reads = c->slot_mappings[slots[i]];
    for (int r = 0; r < c->ranks; r++) {
      const int k = i * c->ranks + r;
      if (staged[k]) {
        filled[i].ptrs[r] = c->buffer_of(r);
      } else if (r == c->rank) {
        filled[i].ptrs[r] = reinterpret_cast<const void*>(own_ptrs[i]);
      } else {
        const std::string key(reinterpret_cast<const char*>(&h[k]), sizeof(cudaIpcMemHandle_t));
        auto it = c->graph_mappings.find(key);
        if (it == c->graph_mappings.end()) {
          Comm::Mapping m{};
          if (int rc = open_peer(m.base, h[k], "cudaIpcOpenMemHandle(graph buffer)")) return rc;
          it = c->graph_mappings.emplace(key, std::move(m)).first;
        }
        it->second.slots++;
        reads.push_back(key);
        filled[i].ptrs[r] = it->second.base.get() + offsets[k];
      }
    }
  }
  for (int i = 0; i < count; i++) {
    CUDA_TRY(cudaMemcpy(c->slots.get() + slots[i], &filled[i], sizeof(RankData), cudaMemcpyHostToDevice));
  }
  // A pageable host-to-device copy may return before it lands; no replay may see an empty slot.
  CUDA_TRY(cudaDeviceSynchronize());
  return 0;
}

int graphar_comm_forget_graph_slots(void* comm, const int32_t* slots, int count) {
  Comm* c = as_comm(comm);
  for (int i = 0; i < count; i++) forget_slot(c, slots[i]);
  return 0;
}

int graphar_comm_close_unused_mappings(void* comm) {
  Comm* c = as_comm(comm);
  if (c->unused_mappings.empty()) return 0;
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  CUDA_TRY(cudaDeviceSynchronize());
  return close_unused_mappings(c);
}

}  // extern "C"
