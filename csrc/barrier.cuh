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

// ---- one kernel at a time ------------------------------------------------------------------
//
// The kernels of one communicator share the barrier counters, the registered buffer, the push epochs
// and the peers' slots, so two of them running at once on a rank (a graph replay and an eager call on
// streams that are not ordered, say) would corrupt each other. Each block adds (its launch's claim
// word << 16) + 1 to Signal::running when it starts and takes it away when it ends: a block that finds
// a block of another kernel running (the sum is not n times its own word) has lost, writes poison and
// marks the group failed. It touches nothing shared, but for the arrival that claim_and_start stores
// beside the claim and takes back; the kernel it met then fails too, or is undisturbed; the peers fail
// at their next meeting with this rank. The word is an odd 48-bit hash of the launch's tag, not the tag itself:
// with three launches at once, tags t - 1 and t + 1 sum like two blocks of t, and launch t would
// believe itself alone; hashed, other launches' words sum to a multiple of this one's only by a chance
// of about 2^-48 a claim. Odd, so that n blocks of one launch never sum like m != n blocks of it.
//
// The count-out is relaxed: a release would fence every block's end (0.3 us a launch on a loopback).
// Kernels of one stream are ordered by it (PDL's wait included), so the count-out orders only kernels
// on streams that are not ordered, and there nothing needs it. What a kernel stores after its last
// barrier is its output (the caller's), flags, counts, epochs, call words and emptied slots: a later
// kernel reads those as it polls or ahead of its claim (Arrival), unordered either way, and an old
// value there fails a barrier or a wait, or shows another launch's number, never passes. Its data
// (buffers, slots' packs) a kernel reads only after a barrier or an arrival that orders it.

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
