// The flags the kernels meet their peers by: ordered and unordered stores and loads, the bounded spin
// on a flag and its deadline, what a flag's value holds (count, call, launch class, retraction), the
// record of a spin that gave up, and the poison a failed kernel writes. tests/test_csrc_build.py pins
// the orderings in the PTX.
#pragma once

#include <cstdint>

#include "signal.cuh"

namespace graphar {

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

// Marks the group failed for this rank's later kernels, then tells the host where and why. `inline`:
// each .cu file that includes this header defines it (nvcc keeps a host stub of it in each).
inline __device__ __noinline__ void record_failure(Signal* self, ErrorRecord* e, Where where, int peer, Cause cause) {
  st_flag<false>(&self->failed, 1);
  if (e->failed) return;
  e->where = where;
  e->peer = peer;
  e->block = blockIdx.x;
  e->cause = cause;
  __threadfence_system();  // the details become visible before the flag the host polls
  e->failed = 1;
}

// Nonzero once an earlier kernel of this rank gave up a spin (volatile: it may have run on another
// stream). As loaded, for the entries that read it only after the claim's atomic went out.
__device__ __forceinline__ Flag failed_flag(const BarrierParams& p) { return ld_flag<false>(&p.self->failed); }
__device__ __forceinline__ bool group_failed(const BarrierParams& p) { return failed_flag(p) != 0; }

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

// What a barrier flag holds: the barrier's count (16 bits, wrapping), the low 14 bits of the launch's
// call number, the launch class (graph) and a retraction bit. A rank whose block gave up on a barrier
// stores its flag back into every peer's slot with kRetracted set: a peer that has not read it yet
// must not pass and read what the rank leaves behind (its registered buffer refilled by its next
// call, a graph input rewritten by later kernels).
constexpr Flag kCount = 0xFFFFu;
constexpr int kCallShift = 16;
constexpr Flag kCallBits = 0x3FFFu << kCallShift;
constexpr Flag kGraphCall = 0x40000000u;
constexpr Flag kRetracted = 0x80000000u;

__device__ __forceinline__ Flag flag_value(Flag count, const BarrierParams& p) {
  return (count & kCount) | ((p.call << kCallShift) & kCallBits) | (p.graph ? kGraphCall : 0u);
}

// Why a peer's flag holds this barrier's count but not its value: it took its arrival back, or it is in
// another call (the other launch class, or another captured launch).
__device__ __forceinline__ Cause mismatch_cause(Flag seen, Flag val) {
  if (seen & kRetracted) return kPeerGaveUp;
  return ((seen ^ val) & kGraphCall) ? kOutOfStep : kSwapped;
}

// Spins until *flag == val; false on timeout, when the peer took its arrival back, when it arrived in
// another call, or once *lost_claim (in shared memory, where given) says the block lost its claim:
// then no peer's arrival can let it on, and the claimer recorded why. Equality, not >=, because the
// count wraps; the stale value in a slot is always two counts back, never this count.
template <bool kOrdered>
__device__ __forceinline__ bool wait_flag(Flag* flag, Flag val, const BarrierParams& p, Where where, int peer,
                                          const uint32_t* lost_claim) {
  Deadline deadline;
  for (Flag v; (v = ld_flag<kOrdered>(flag)) != val;) {
    if ((v & kCount) == (val & kCount)) {  // this count, but retracted or of another call
      record_failure(p.self, p.error, where, peer, mismatch_cause(v, val));
      return false;
    }
    if (lost_claim != nullptr && *static_cast<const volatile uint32_t*>(lost_claim) != 0) return false;
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

}  // namespace graphar
