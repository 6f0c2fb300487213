// The cross-GPU barrier every graphar kernel meets its peers at: block b of every rank meets block b
// of every other rank, with the claim's arrival beside it at a kernel's entry. The layouts, the flags
// and the claim it builds on are in signal.cuh, flags.cuh and claim.cuh; tests/test_csrc_build.py
// pins the orderings in the PTX.
#pragma once

#include <cstdint>

#include "claim.cuh"
#include "flags.cuh"
#include "signal.cuh"

namespace graphar {

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

// What lane i < kRanks reads before it meets peer i, as loaded: the group's failed flag (the exit skips
// it: its kernel passed the check at entry) and its count for the edge, which the barrier advances.
// At a kernel's entry these loads go out beside the claim (claim_block), where no acquire orders them
// after the previous kernel's count-out, so both are volatile (never a stale L1 line). A count read
// before that kernel's stores to it is short and meets the peer's flag of one of that kernel's
// barriers, which carries another launch's bits (barrier flags below: an eager call follows the
// previous eager call in stream order, and replays of one graph never overlap) or nothing:
// kOutOfStep, kSwapped or a timeout, never a pass.
struct Arrival {
  Flag failed = 0;
  Flag counter = 0;
};

template <int kRanks>
__device__ __forceinline__ Arrival arrival(const BarrierParams& p, bool check_failed) {
  Arrival a;
  if (threadIdx.x < kRanks) {
    if (check_failed) a.failed = failed_flag(p);
    a.counter = ld_flag<false>(&p.self->self_counter[blockIdx.x][threadIdx.x]);
  }
  return a;
}

// A kernel's claim (one kernel at a time, above) and its entry barrier's arrival, whose loads travel
// beside the claim's atomic: they go out first (a load after the acquire would wait for it), and
// nothing reads them before the atomic went out (the compiler would wait for them there). Every thread
// learns whether the block may go on: it won the claim and the group had not failed. Before the block
// touches anything shared.
template <int kRanks>
__device__ __forceinline__ bool claim_block(const BarrierParams& p, Where where, Arrival& entry) {
  entry = arrival<kRanks>(p, true);
  const bool lost = threadIdx.x == 0 && !enter_alone(p, where);
  asm volatile("" : "+r"(entry.failed), "+r"(entry.counter));  // their first use is after the atomic went out
  // A group that failed before this kernel goes no further either: its copy-in would refill the buffer
  // a late peer may still be reading. The block sync's reduction tells every thread.
  return __syncthreads_or(lost || entry.failed != 0) == 0;
}

// The barrier, with the arrival its lanes read before (at a kernel's entry, beside the claim), and whether
// the block lost its claim meanwhile (claim_and_start: `lost` in the claimer, which the block's vote tells
// all, and `lost_claim` in shared memory, which the waiting lanes poll). Only a block that passed
// advances its count: a block that lost its claim leaves the counts to the kernel that won.
template <int kRanks, Form kForm>
__device__ __forceinline__ bool multi_gpu_barrier(const BarrierParams& p, Where where, const Arrival& a,
                                                  bool lost = false, const uint32_t* lost_claim = nullptr) {
  constexpr bool kOrdered = kForm == Form::kFenced;
  if constexpr (kForm != Form::kStart) __syncthreads();
  bool timed_out = false;
  Flag* theirs = nullptr;  // where this lane stored its arrival
  const Flag count = a.counter + 1;
  const Flag val = flag_value(count, p);
  if (threadIdx.x < kRanks) {
    const int peer = threadIdx.x;
    if (a.failed != 0) {
      timed_out = true;  // meets no peer: they give up too, then fail alike
    } else {
      theirs = &nth<kRanks>(p.signals.signals, peer)->peer_counter[val & 1][blockIdx.x][p.rank];
      Flag* mine = &p.self->peer_counter[val & 1][blockIdx.x][peer];
      st_flag<kOrdered>(theirs, val);
      timed_out = !wait_flag<kOrdered>(mine, val, p, where, peer, lost_claim);
    }
  }
  const bool block_failed = __syncthreads_or(timed_out || lost);  // tells the whole block whether to go on
  if (theirs != nullptr) {
    if (block_failed) {
      st_flag<false>(theirs, val ^ kRetracted);
    } else {
      p.self->self_counter[blockIdx.x][threadIdx.x] = count;
    }
  }
  return !block_failed;
}

// The barrier in the middle or at the end of a kernel: the arrival's loads are in flight during the
// leading block sync.
template <int kRanks, Form kForm>
__device__ __forceinline__ bool multi_gpu_barrier(const BarrierParams& p, Where where) {
  return multi_gpu_barrier<kRanks, kForm>(p, where, arrival<kRanks>(p, kForm != Form::kEnd));
}

// The claim and the entry barrier of a kernel whose input was written before it (Form::kStart), at
// once: the lanes store their arrival and wait while thread kClaimer, in another warp (its acquire
// stalls its warp, not theirs), counts the block in. A block that lost has stored its arrival but read
// nothing shared; its claimer says so in shared memory, so the lanes stop waiting at once (not when
// the peers come, or the timeout), and it takes the arrival back like a block whose peer never came, so
// a peer that passed on it fails at its next barrier with this rank, which this rank never reaches.
// The verdict word is cleared by warp 0 before the claimer may write it: named barrier kClaimBarrier,
// which warp 0 passes without waiting (bar.arrive) and warp 1 waits at (bar.sync), orders the two.
constexpr int kClaimer = 32;
constexpr int kClaimBarrier = 1;  // 0 is __syncthreads'

template <int kRanks>
__device__ __forceinline__ bool claim_and_start(const BarrierParams& p, Where where) {
  __shared__ uint32_t lost_claim;
  const Arrival a = arrival<kRanks>(p, true);
  bool lost = false;
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) lost_claim = 0;
    __syncwarp();  // the lanes that poll the word see it cleared
    asm volatile("bar.arrive %0, 64;" ::"n"(kClaimBarrier) : "memory");
  } else if (threadIdx.x < 64) {
    asm volatile("bar.sync %0, 64;" ::"n"(kClaimBarrier) : "memory");
    lost = threadIdx.x == kClaimer && !enter_alone(p, where);
    if (lost) *static_cast<volatile uint32_t*>(&lost_claim) = 1;
  }
  return multi_gpu_barrier<kRanks, Form::kStart>(p, where, a, lost, &lost_claim);
}

// A v1 kernel's claim and entry, either way: with copy-in (`copy` writes this rank's registered buffer,
// which peers read) the claim comes first and the barrier is fenced; without, claim_and_start.
template <int kRanks, typename Copy>
__device__ __forceinline__ bool claim_and_enter(const BarrierParams& p, Where where, bool copy_in, Copy&& copy) {
  if (!copy_in) return claim_and_start<kRanks>(p, where);
  Arrival entry;
  if (!claim_block<kRanks>(p, where, entry)) return false;
  copy();
  return multi_gpu_barrier<kRanks, Form::kFenced>(p, where, entry);
}

}  // namespace graphar
