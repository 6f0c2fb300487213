// What each rank shares over CUDA IPC and what every kernel's barrier reads: the Signal (flags, the
// claim word, the failed flag), the per-rank pointer tables, the host-mapped error record and its
// codes, and BarrierParams, which every kernel's parameters embed. Layouts only: the host reads
// them too (comm.cuh), and Python mirrors the codes and the record (tests/test_abi_mirrors.py).
#pragma once

#include <cstdint>

namespace graphar {

constexpr int kMaxRanks = 8;
// Signal slots per rank; a launch never uses more blocks than this.
constexpr int kMaxBlocks = 64;

using Flag = uint32_t;

// Each rank's IPC allocation is [Signal | tmp buffer]; the tmp buffer is the 2stage all-reduce's.
struct Signal {
  // Barrier count of (block, lane); only its own rank touches it, so a plain increment suffices.
  alignas(128) Flag self_counter[kMaxBlocks][kMaxRanks];
  // [phase][block][peer]: peer stores its count here over NVLink, this rank polls it locally.
  // Two phases because a peer may store its count for barrier k+1 while this rank still polls
  // for barrier k; it gets no further, as passing k+1 needs this rank's arrival there.
  alignas(128) Flag peer_counter[2][kMaxBlocks][kMaxRanks];
  // Calls of the push kernels so far, one copy per block (push.cuh), per launch class (eager,
  // captured: see BarrierParams::graph): every entry is equal between calls, so each block reads the
  // call's epoch without waiting for another block.
  alignas(128) Flag push_epoch[2][kMaxBlocks];
  // [launch class][epoch parity][block][peer]: the call word (call_word) the peer's block stored when
  // it pushed its packs of that epoch, 0 when empty; the receiving block resets it, as it does a slot.
  alignas(128) Flag push_calls[2][2][kMaxBlocks][kMaxRanks];
  // The blocks of this rank's kernels that are running now: (sum of their tags << 16) + their count
  // (count_in). Only this GPU touches it.
  alignas(128) unsigned long long running;
  // Set by this rank's kernel whose spin gave up: the ranks are out of step from then on. Every later
  // kernel reads it at entry and writes poison instead of communicating (see poison_packs).
  alignas(128) Flag failed;
};

template <typename P>
__device__ __forceinline__ P* tmp_buffer(Signal* sg) {
  return reinterpret_cast<P*>(sg + 1);
}

struct __align__(16) RankData {
  const void* ptrs[kMaxRanks];
};

struct __align__(16) RankSignals {
  Signal* signals[kMaxRanks];
};

// Where a spin loop gave up; written by the kernel into host-mapped memory.
enum Where : uint32_t {
  kOneStageEntry = 1,
  kOneStageExit = 2,
  kTwoStageEntry = 3,
  kTwoStageMid = 4,
  kAllToAllEntry = 5,
  kAllToAllExit = 6,
  kPushOneShot = 7,
  kPushScatter = 8,
  kPushGather = 9,
  kPushEntry = 10,     // a push kernel's start (where it found another kernel running)
  kAllToAllLease = 11,  // an exchange's lease, taken before its first pack (all_to_all.cuh)
};

// Why a kernel gave up on a peer.
enum Cause : uint32_t {
  kTimedOut = 0,    // the peer did not arrive within the bound
  kPeerGaveUp = 1,  // the peer had given up on this barrier first, and took its arrival back
  kConcurrent = 2,  // another kernel of this communicator ran at the same time on this rank
  kOutOfStep = 3,   // the peer met this barrier in a graph replay and this rank in an eager call, or the reverse
  kSwapped = 4,     // the peer met it in another captured launch: the ranks replayed graphs in different orders
};

struct ErrorRecord {
  volatile uint32_t failed;
  volatile uint32_t where;
  volatile uint32_t peer;
  volatile uint32_t block;
  volatile uint32_t cause;
};

// What the barrier reads; every kernel's parameters embed one.
struct BarrierParams {
  RankSignals signals;
  Signal* self;
  ErrorRecord* error;
  uint64_t timeout_ns;  // 0: spin without bound
  // This launch's number on this rank (1, 2, ...). A replay of a graph repeats it, and replays of one
  // graph never overlap.
  uint64_t tag;
  // What count_in adds for each block of this launch, so that alone tells its blocks from another
  // kernel's: claim_word(tag), mixed on the host.
  uint64_t claim;
  int rank;
  // 1 when the launch was captured into a CUDA graph, 0 when eager: equal on every rank for the same
  // call, so a peer met in the other class is in another call (calls on unordered streams).
  int graph;
  // This launch's number among the communicator's captured launches (1, 2, ... in capture order),
  // 0 when eager. Equal on every rank for the same launch, as the ranks capture in one order; replays
  // of different graphs on streams that are not ordered may still run in different orders on
  // different ranks, and a peer found in another launch is told apart by it (barrier flags, push call
  // words). Eager calls need none: each rank runs them in the order it issued them (launch.cu).
  uint32_t call;
};

}  // namespace graphar
