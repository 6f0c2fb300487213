// The cross-GPU barrier every graphar kernel meets its peers at: each rank's Signal (flags over
// CUDA IPC), the bounded spin on a flag, the host-mapped record of a spin that gave up, and the
// per-rank pointer tables the kernels' parameters carry. Apart from the kernels so that each kernel
// family embeds BarrierParams and the orderings are written once (tests/test_csrc_build.py pins
// them in the PTX).
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
  // Calls of the push kernels so far, one copy per block (push.cuh): every entry is equal between
  // calls, so each block reads the call's epoch without waiting for another block.
  alignas(128) Flag push_epoch[kMaxBlocks];
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
};

// Why a kernel gave up on a peer.
enum Cause : uint32_t {
  kTimedOut = 0,    // the peer did not arrive within the bound
  kPeerGaveUp = 1,  // the peer had given up on this barrier first, and took its arrival back
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
  int rank;
};

// ---- flag accesses -------------------------------------------------------------------------
//
// kOrdered: st.release.sys / ld.acquire.sys, which carry the data written before the store to the
// peer that loads it; otherwise volatile, an arrival count only.

template <bool kOrdered>
__device__ __forceinline__ void st_flag(Flag* addr, Flag v) {
  if constexpr (kOrdered) {
    asm volatile("st.release.sys.global.u32 [%1], %0;" ::"r"(v), "l"(addr) : "memory");
  } else {
    asm volatile("st.volatile.global.u32 [%1], %0;" ::"r"(v), "l"(addr) : "memory");
  }
}
template <bool kOrdered>
__device__ __forceinline__ Flag ld_flag(Flag* addr) {
  Flag v;
  if constexpr (kOrdered) {
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  } else {
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  }
  return v;
}
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Marks the group failed for this rank's later kernels, then tells the host where and why.
__device__ __noinline__ void record_failure(Signal* self, ErrorRecord* e, Where where, int peer, Cause cause) {
  st_flag<false>(&self->failed, 1);
  if (e->failed) return;
  e->where = where;
  e->peer = peer;
  e->block = blockIdx.x;
  e->cause = cause;
  __threadfence_system();  // the details become visible before the flag the host polls
  e->failed = 1;
}

// Whether an earlier kernel of this rank gave up a spin (volatile: it may have run on another stream).
__device__ __forceinline__ bool group_failed(const BarrierParams& p) { return ld_flag<false>(&p.self->failed) != 0; }

// What a kernel writes instead of its result once the group failed (or when its own spin gave up):
// all ones, a NaN in every lane of every float dtype, so that a CUDA-graph replay after a timeout,
// which no host check sees, yields NaN rather than plausible numbers. Packs first, first + stride, ...
// below n: the thread's share, as the kernel's own output loop walks it.
__device__ __forceinline__ uint4 poison_pack() { return make_uint4(~0u, ~0u, ~0u, ~0u); }
__device__ __forceinline__ void poison_packs(uint4* out, int64_t first, int64_t n, int64_t stride) {
  for (int64_t i = first; i < n; i += stride) out[i] = poison_pack();
}

// The time bound of one spin loop: the clock starts at the first miss, so a wait that succeeds at
// once never reads it.
struct Deadline {
  uint64_t start = 0;
  // False once timeout_ns has passed since the first call (0: never), after recording where.
  __device__ __forceinline__ bool keep_waiting(const BarrierParams& p, Where where, int peer) {
    if (p.timeout_ns == 0) return true;
    const uint64_t now = global_timer_ns();
    if (start == 0) start = now;
    if (now - start <= p.timeout_ns) return true;
    record_failure(p.self, p.error, where, peer, kTimedOut);
    return false;
  }
};

// A rank whose block gave up on a barrier stores its count back into every peer's slot with this bit
// flipped: a peer that has not read the count yet must not pass and read what the rank leaves behind
// (its registered buffer refilled by its next call, a graph input rewritten by later kernels).
constexpr Flag kRetracted = 0x80000000u;

// Spins until *flag == val; false on timeout or when the peer took its arrival back. Equality, not
// >=, because the counter wraps; the stale value in a slot is always val - 2, never val.
template <bool kOrdered>
__device__ __forceinline__ bool wait_flag(Flag* flag, Flag val, const BarrierParams& p, Where where, int peer) {
  Deadline deadline;
  for (Flag v; (v = ld_flag<kOrdered>(flag)) != val;) {
    if (v == (val ^ kRetracted)) {
      record_failure(p.self, p.error, where, peer, kPeerGaveUp);
      return false;
    }
    if (!deadline.keep_waiting(p, where, peer)) return false;
  }
  return true;
}

// a[i] for i < kRanks without a runtime index into the array (kernel parameters or registers),
// which would copy it to local memory in every thread.
template <int kRanks, typename P, int N>
__device__ __forceinline__ P nth(const P (&a)[N], int i) {
  static_assert(kRanks <= N, "more ranks than entries");
  P x = a[0];
#pragma unroll
  for (int r = 1; r < kRanks; r++) x = i == r ? a[r] : x;
  return x;
}

// ---- barrier -------------------------------------------------------------------------------
//
// Block b of every rank meets block b of every other rank; lane i of the block handles the
// edge to rank i. Returns false (in every thread of the block) when a peer never arrived or gave up,
// or, at entry and middle, when the group had already failed. A block that fails takes its arrival
// back from every peer (kRetracted), so a late peer fails instead of reading data that is gone; a
// late peer that read before the retraction landed fails at its next barrier with this rank, which
// this rank never reaches: every barrier's failure poisons the block's output (at the exit too).
enum class Form {
  // Entry, when the data was written before this kernel: kernel completion already made it
  // visible, so the flag is only an arrival count (volatile), and no work precedes it.
  kStart,
  // Data this kernel just wrote (2stage tmp, fused copy-in) is read by peers after the barrier:
  // block sync gathers the block's writes, st.release.sys / ld.acquire.sys carry them across
  // GPUs, and the trailing block sync hands the acquired view to every thread.
  kFenced,
  // Exit (1stage, all-to-all): the peers' reads of our buffers must end before a later copy or
  // kernel may overwrite them; only arrival matters (volatile).
  kEnd,
};

template <int kRanks, Form kForm>
__device__ __forceinline__ bool multi_gpu_barrier(const BarrierParams& p, Where where) {
  constexpr bool kOrdered = kForm == Form::kFenced;
  if constexpr (kForm != Form::kStart) __syncthreads();
  bool timed_out = false;
  Flag* theirs = nullptr;  // where this lane stored its arrival
  Flag val = 0;
  if (threadIdx.x < kRanks) {
    const int peer = threadIdx.x;
    // Loaded beside the counter, so the check costs no extra round trip. The exit needs none: its
    // kernel passed this check at entry.
    const bool failed = kForm != Form::kEnd && group_failed(p);
    val = p.self->self_counter[blockIdx.x][peer] + 1;
    if (failed) {
      timed_out = true;  // meets no peer: they give up too, then fail alike
    } else {
      p.self->self_counter[blockIdx.x][peer] = val;
      theirs = &nth<kRanks>(p.signals.signals, peer)->peer_counter[val & 1][blockIdx.x][p.rank];
      Flag* mine = &p.self->peer_counter[val & 1][blockIdx.x][peer];
      st_flag<kOrdered>(theirs, val);
      timed_out = !wait_flag<kOrdered>(mine, val, p, where, peer);
    }
  }
  const bool block_failed = __syncthreads_or(timed_out);  // tells the whole block whether to go on
  if (block_failed && theirs != nullptr) st_flag<false>(theirs, val ^ kRetracted);
  return !block_failed;
}

}  // namespace graphar
