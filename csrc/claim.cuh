// One kernel of a communicator at a time on each rank: the claim every block counts in and out of
// Signal::running, and what a block that lost does.
#pragma once

#include <cstdint>

#include "flags.cuh"
#include "signal.cuh"

namespace graphar {

// ---- one kernel at a time ------------------------------------------------------------------
//
// The kernels of one communicator share its counters, buffers, epochs and slots, so two of them at once
// on a rank would corrupt each other. Each block adds (its launch's claim word << 16) + 1 to
// Signal::running while it runs; a block that finds another kernel's block there has lost: it writes
// poison and marks the group failed. The word is an odd 48-bit hash of the launch's tag, so other
// launches' words sum to a multiple of it only by chance (about 2^-48); the count-out is relaxed.
// Why each of these holds: docs/design.md, "One kernel at a time".

constexpr int kRunningCountBits = 16;
constexpr unsigned long long kRunningCount = (1ull << kRunningCountBits) - 1;
constexpr unsigned long long kClaimMask = (1ull << (64 - kRunningCountBits)) - 1;

// BarrierParams::claim for a launch's tag: splitmix64's finalizer, to 48 odd bits.
__host__ __device__ constexpr uint64_t claim_word(uint64_t tag) {
  uint64_t z = tag + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return ((z ^ (z >> 31)) & kClaimMask) | 1;
}

// Whether Signal::running, as count_in found it, held only blocks of the launch with this claim word.
__host__ __device__ constexpr bool only_this_launch(unsigned long long running, uint64_t claim) {
  return (running >> kRunningCountBits) == (((running & kRunningCount) * claim) & kClaimMask);
}

__device__ __forceinline__ unsigned long long running_entry(const BarrierParams& p) {
  return (p.claim << kRunningCountBits) + 1;
}

// One thread of each block: counts the block in, and returns the word as it was before. The atomic's
// result is not waited for here: accesses the caller issues next are in flight beside it.
__device__ __forceinline__ unsigned long long count_in(const BarrierParams& p) {
  unsigned long long before;  // acquire: no line in this SM's L1 that a kernel beside it loaded is read
  asm volatile("atom.acquire.gpu.global.add.u64 %0, [%1], %2;"
               : "=l"(before)
               : "l"(&p.self->running), "l"(running_entry(p))
               : "memory");
  return before;
}

// Whether the block counted in alone (`before`: count_in's result): false when another kernel's block
// is running, after recording it (found at `where`).
__device__ __forceinline__ bool alone(const BarrierParams& p, unsigned long long before, Where where) {
  const bool only_ours = only_this_launch(before, p.claim);
  if (!only_ours) record_failure(p.self, p.error, where, p.rank, kConcurrent);
  return only_ours;
}

// Thread 0 of each block, after every thread of the block is done with the shared buffers: counts it
// out. Relaxed (above): the block's loads are done, as their values were used before the block sync.
__device__ __forceinline__ void leave_running(const BarrierParams& p) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(&p.self->running), "l"(0ull - running_entry(p))
               : "memory");
}

// One thread of each block: counts it in; false, recorded, when another kernel's block is running.
__device__ __forceinline__ bool enter_alone(const BarrierParams& p, Where where) { return alone(p, count_in(p), where); }

// The block is done with everything shared (every thread reaches this, the block's losers too).
__device__ __forceinline__ void release_block(const BarrierParams& p) {
  __syncthreads();
  if (threadIdx.x == 0) leave_running(p);
}

// The same, with whether this thread's share came out right: whether every thread's did. A block that
// did not then poisons its output, which is the caller's tensor: no kernel of the communicator shares it.
__device__ __forceinline__ bool release_block(const BarrierParams& p, bool ok) {
  const bool block_ok = __syncthreads_and(ok);
  if (threadIdx.x == 0) leave_running(p);
  return block_ok;
}

}  // namespace graphar
