// graphar's push all-reduce kernels: no barrier. Each rank stores its input, read in place from any
// pointer, straight into its slots in every peer's receive region (CUDA IPC), and learns that a
// peer's data has arrived from the data itself.
//
// Arrival. Every 32-bit word of an unwritten slot holds kEmpty (0xFFFFFFFF). A pack has arrived when
// none of its four words is kEmpty: an aligned 32-bit store is seen whole, a 16-byte store may be
// seen in parts. Real data can carry that pattern: it is a NaN in float32 (sign, exponent and
// mantissa all ones) and two NaNs (0xFFFF each) in float16 and bfloat16. Senders replace such a word
// by kStandIn (0x7FFFFFFF), a NaN in every lane of every dtype too, and the sum does not change:
// every output element is an fp32 sum of ws >= 2 values, and an fp32 add with a NaN operand gives
// the canonical NaN whatever the operand's payload. -0.0, +-Inf and every other pattern travel
// unchanged. A rank applies the same replacement to its own data, so every rank sums the same bits
// in the same order (rank 0..ws-1): the ranks agree bitwise.
//
// Epochs. The receive region has two epochs that calls alternate between; whoever reads a slot
// writes kEmpty back right after. A peer writes epoch e again two calls later, after it completed
// the call in between, which needs data this rank sends when that call starts, after this call
// ended: directly, or (two-shot with fewer packs than ranks, where only the last rank owns a shard)
// through the last rank, which needs every rank's. So the reset always lands first. The epoch count
// is in the rank's Signal (push_epoch), one sequence per launch class, advanced by the kernel; as
// with the barrier, every rank must issue the group's calls in one order.
//
// Call words. Two graphs replayed in different orders on two ranks (unordered streams) meet at one
// epoch, and each rank would sum its data of one call with the peer's of the other. So each block
// also stores its launch's call word (BarrierParams::call) into every peer, in the peer's Signal at
// the same epoch, and compares the word it receives from every peer with its own before any of the
// block's output stands: another word poisons the block (kSwapped). One word per block and peer, as
// the data: a word written again two calls later finds the reset done, as a slot does, and for the
// reason a slot does: the writer completed the call in between, which needed data the reader sent
// after it emptied the word, directly or through the last rank. Every pair, not only the pairs that
// exchange data: in a two-shot with fewer packs than ranks, rank i's sums come from the last rank
// alone, and a rank j in another call is seen only in j's own word (the last rank forwards sums
// before it checks words); a word from every peer makes every rank see it, and fail itself.
#pragma once

#include "barrier.cuh"
#include "pack.cuh"
#include "pdl.cuh"

namespace graphar {

constexpr int kPushThreads = 256;
constexpr uint32_t kEmpty = 0xFFFFFFFFu;
constexpr uint32_t kStandIn = 0x7FFFFFFFu;

struct PushParams {
  BarrierParams barrier;  // the Signals (epochs) and the error record; no barrier is met
  RankData regions;       // every rank's receive region: two epochs of epoch_packs packs
  const void* in;
  void* out;
  int packs;        // message size in 16-byte packs
  int epoch_packs;  // packs per epoch of a receive region
};

// Packs in flight per thread: loads issued together hide the memory latency of large messages.
template <int kRanks>
struct PushBatch {
  static constexpr int value = kRanks == 2 ? 4 : 2;
};

__device__ __forceinline__ uint32_t sendable(uint32_t w) { return w == kEmpty ? kStandIn : w; }
__device__ __forceinline__ uint4 sendable(const uint4& v) {
  return make_uint4(sendable(v.x), sendable(v.y), sendable(v.z), sendable(v.w));
}
__device__ __forceinline__ bool arrived(const uint4& v) {
  return (v.x != kEmpty) & (v.y != kEmpty) & (v.z != kEmpty) & (v.w != kEmpty);
}

// Volatile (relaxed, system scope) slot accesses: the data is its own flag, so no access orders
// another; volatile keeps a poll from being served by a stale cached copy.
__device__ __forceinline__ void st_slot(uint4* addr, const uint4& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 ld_slot(const uint4* addr) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void reset_slot(uint4* addr) { st_slot(addr, make_uint4(kEmpty, kEmpty, kEmpty, kEmpty)); }

// ---- call words ----------------------------------------------------------------------------

// The call word a receiving block finds from a peer: never 0, which marks an empty word.
__device__ __forceinline__ Flag call_word(const BarrierParams& p) { return p.call | 0x80000000u; }

// This thread's peer for the call words: threadIdx.x, when it is another rank; -1 otherwise.
template <int kRanks>
__device__ __forceinline__ int word_peer(const BarrierParams& p) {
  const int peer = threadIdx.x;
  return peer < kRanks && peer != p.rank ? peer : -1;
}

// The call word into peer `peer`'s Signal at this epoch, where its block blockIdx.x reads it (-1: none).
template <int kRanks>
__device__ __forceinline__ void send_call(const BarrierParams& p, uint32_t epoch, int peer) {
  if (peer < 0) return;
  Signal* theirs = nth<kRanks>(p.signals.signals, peer);
  st_flag<false>(&theirs->push_calls[p.graph][epoch & 1][blockIdx.x][p.rank], call_word(p));
}

// The call word this thread checks: peer `peer`'s at this epoch (-1: none). It is reloaded beside the
// packs the thread waits for (await_slot), so that the check costs no round trip of its own.
struct CallWatch {
  Flag* word;
  int peer;
  Flag seen;  // what the word held at the last load; 0: not there yet

  __device__ __forceinline__ CallWatch(const BarrierParams& p, uint32_t epoch, int peer_)
      : word(peer_ < 0 ? nullptr : &p.self->push_calls[p.graph][epoch & 1][blockIdx.x][peer_]), peer(peer_), seen(0) {
    poll();
  }
  __device__ __forceinline__ void poll() {
    if (word != nullptr && seen == 0) seen = ld_flag<false>(word);
  }
  // Waits for the word, then empties it; false on timeout or when it is another launch's (the ranks
  // run different calls at this epoch), recorded at `where`.
  __device__ __forceinline__ bool check(const BarrierParams& p, Where where) {
    if (word == nullptr) return true;
    Deadline deadline;
    while (seen == 0) {
      if (!deadline.keep_waiting(p, where, peer)) return false;
      seen = ld_flag<false>(word);
    }
    st_flag<false>(word, 0);
    if (seen == call_word(p)) return true;
    record_failure(p.self, p.error, where, peer, kSwapped);
    return false;
  }
};

// Reloads the slot until its pack has arrived (v: the first load), the call word w beside it; false
// on timeout.
__device__ __forceinline__ bool await_slot(const uint4* slot, uint4& v, const BarrierParams& p, Where where,
                                           int peer, CallWatch& w) {
  Deadline deadline;
  while (!arrived(v)) {
    if (!deadline.keep_waiting(p, where, peer)) return false;
    w.poll();
    v = ld_slot(slot);
  }
  return true;
}

// Each rank's receive region at this call's epoch: two epochs per launch class (BarrierParams::graph),
// so an eager call and a graph replay never meet in one region, even when unordered streams run them
// in different orders on different ranks (they then wait for data that never comes, and time out).
template <int kRanks>
__device__ __forceinline__ void epoch_regions(const PushParams& p, uint32_t epoch, uint4* (&out)[kRanks]) {
  const int64_t offset = static_cast<int64_t>(2 * p.barrier.graph + (epoch & 1)) * p.epoch_packs;
#pragma unroll
  for (int r = 0; r < kRanks; r++) out[r] = static_cast<uint4*>(const_cast<void*>(p.regions.ptrs[r])) + offset;
}

// The call's epoch, and whether the group failed before it or another kernel of the communicator is
// running (claim.cuh), read once per block before any thread of it works. The epoch and failed flag
// are loaded before the claim's atomic (a load after its acquire would wait for it) and read after it
// went out, so that the three round trips overlap; the epoch's load is then not ordered after the
// acquire, so it is volatile (barrier.cuh arrival says why that suffices). A block that may go on
// advances its epoch copy at once, so that the store reaches memory while the call works instead of
// at the block's end. Block 0's threads advance those of blocks this launch does not have, one each,
// after the block sync: thread 0 storing them before it held the whole block back (up to 62 stores in
// a row, 0.37 us at 8 KB on one H100). The next call reads the copies after its griddepcontrol.wait
// (or stream order), so after this kernel completed. A call that then fails leaves them advanced,
// which no call reads: the group is marked failed, and every later kernel refuses. The verdict travels
// beside the epoch in shared memory, one 64-bit load after the sync that every thread needs anyway;
// a __syncthreads_or vote (claim_block's) added its reduction to that load: 0.05 us a launch.
__device__ __forceinline__ uint32_t enter_epoch(const BarrierParams& p, bool& failed) {
  __shared__ uint32_t epoch, refused;
  Flag* epochs = p.self->push_epoch[p.graph];
  if (threadIdx.x == 0) {
    Flag e = ld_flag<false>(&epochs[blockIdx.x]);
    Flag failed_before = failed_flag(p);
    const unsigned long long before = count_in(p);
    asm volatile("" : "+r"(e), "+r"(failed_before));  // their first use is after the atomic went out
    epoch = e;
    refused = !alone(p, before, kPushEntry) || failed_before != 0;
    if (!refused) epochs[blockIdx.x] = e + 1;
  }
  __syncthreads();
  const uint32_t e = epoch;
  failed = refused != 0;
  if (blockIdx.x == 0 && gridDim.x < kMaxBlocks && !failed) {
    for (int b = gridDim.x + threadIdx.x; b < kMaxBlocks; b += blockDim.x) epochs[b] = e + 1;
  }
  return e;
}

// What every push kernel starts with, in this order: wait for the kernel before it (PDL), let the
// next one launch, read the call's epoch and count the block in. Then the epoch's regions and the
// thread's place in the grid. A failed call (failed at entry, another kernel running, a receive that
// timed out or a peer in another call) sends nothing more and writes the block's share of the output
// as poison. Thread r < kRanks (r != rank) sends this launch's call word to peer r and checks the one
// peer r sent (send_call, CallWatch).
template <int kRanks>
struct PushCall {
  uint32_t epoch;
  bool failed;  // the group failed before this call, or another kernel is running
  uint4* region[kRanks];  // each rank's receive region at this epoch
  uint4* mine;            // this rank's
  const uint4* in;
  uint4* out;
  int first, stride;

  __device__ __forceinline__ explicit PushCall(const PushParams& p) {
    pdl_enter();
    epoch = enter_epoch(p.barrier, failed);
    epoch_regions<kRanks>(p, epoch, region);
    mine = nth<kRanks>(region, p.barrier.rank);
    in = static_cast<const uint4*>(p.in);
    out = static_cast<uint4*>(p.out);
    first = blockIdx.x * blockDim.x + threadIdx.x;
    stride = gridDim.x * blockDim.x;
  }
};

// send(idx, v) for each of this thread's packs idx < packs of `in`, v made sendable; kBatch loads in
// flight at a time.
template <int kBatch, typename Send>
__device__ __forceinline__ void push_packs(const uint4* in, int packs, int first, int stride, Send send) {
  for (int base = first; base < packs; base += kBatch * stride) {
    uint4 v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; b++) {
      if (base + b * stride < packs) v[b] = sendable(in[base + b * stride]);
    }
#pragma unroll
    for (int b = 0; b < kBatch; b++) {
      if (base + b * stride < packs) send(base + b * stride, v[b]);
    }
  }
}

// For each of this thread's packs i < n: waits for every peer's pack i in this rank's region (rank r's
// at mine + r * span + i), sums it with own[i] in rank order, hands the sum to done(i, sum) and
// resets the peers' slots for a later call; kBatch packs in flight at a time. False on a timeout
// (recorded at `where`).
template <typename T, int kRanks, int kBatch, typename Call, typename Done>
__device__ __forceinline__ bool receive_sums(const uint4* own, uint4* mine, int span, int n, const Call& c,
                                             const BarrierParams& bp, Where where, CallWatch& w, Done done) {
  for (int base = c.first; base < n; base += kBatch * c.stride) {
    uint4 got[kBatch][kRanks];
#pragma unroll
    for (int b = 0; b < kBatch; b++) {
      const int i = base + b * c.stride;
#pragma unroll
      for (int r = 0; r < kRanks; r++) {
        if (i < n) got[b][r] = r == bp.rank ? sendable(own[i]) : ld_slot(mine + r * span + i);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; b++) {
      const int i = base + b * c.stride;
      if (i >= n) continue;
#pragma unroll
      for (int r = 0; r < kRanks; r++) {
        if (r != bp.rank && !await_slot(mine + r * span + i, got[b][r], bp, where, r, w)) return false;
      }
      done(i, sum_in_order<T, kRanks>(got[b]));
#pragma unroll
      for (int r = 0; r < kRanks; r++) {
        if (r != bp.rank) reset_slot(mine + r * span + i);
      }
    }
  }
  return true;
}

// ---- one shot: every rank receives every rank's whole input and sums it ----------------------------
//
// Epoch region: rank r's slot at r * packs.

// Pack idx of this rank's message of `packs` packs into its slot of every peer's region.
template <int kRanks>
__device__ __forceinline__ void send_one_shot(const PushCall<kRanks>& c, int rank, int packs, int idx, const uint4& v) {
#pragma unroll
  for (int r = 0; r < kRanks; r++) {
    if (r != rank) st_slot(c.region[r] + rank * packs + idx, v);
  }
}

template <typename T, int kRanks>
__global__ void __launch_bounds__(kPushThreads, 1) push_one_shot(PushParams p) {
  const PushCall<kRanks> c(p);
  const BarrierParams& bp = p.barrier;
  constexpr int kBatch = PushBatch<kRanks>::value;
  const int peer = c.failed ? -1 : word_peer<kRanks>(bp);
  if (!c.failed) {
    send_call<kRanks>(bp, c.epoch, peer);
    push_packs<kBatch>(c.in, p.packs, c.first, c.stride,
                       [&](int idx, const uint4& v) { send_one_shot(c, bp.rank, p.packs, idx, v); });
  }
  CallWatch w(bp, c.epoch, peer);
  const bool ok = !c.failed &&
                  receive_sums<T, kRanks, kBatch>(c.in, c.mine, p.packs, p.packs, c, bp, kPushOneShot, w,
                                                  [&](int idx, const uint4& sum) { c.out[idx] = sum; }) &&
                  w.check(bp, kPushOneShot);
  if (!release_block(bp, ok)) poison_packs(c.out, c.first, p.packs, c.stride);
}

// ---- two shot: reduce-scatter by push, then all-gather by push --------------------------------------
//
// Shard s is packs [s * part, s * part + size): part = packs / ws, the last shard takes the
// remainder (largest). Epoch region: scatter slots (rank r's share of this rank's shard at
// r * largest), then gather slots (the sum of shard s at (ws + s) * largest). Each shard is summed
// once, by its owner, so every rank gathers the same bits.
struct Shards {
  int part, largest;
  __device__ __forceinline__ Shards(int packs, int ranks)
      : part(packs / ranks), largest(packs - (ranks - 1) * (packs / ranks)) {}
  __device__ __forceinline__ int owner(int idx, int ranks) const {
    return part == 0 ? ranks - 1 : min(idx / part, ranks - 1);
  }
};

template <typename T, int kRanks>
__global__ void __launch_bounds__(kPushThreads, 1) push_two_shot(PushParams p) {
  const PushCall<kRanks> c(p);
  const BarrierParams& bp = p.barrier;
  constexpr int kBatch = PushBatch<kRanks>::value;
  const Shards sh(p.packs, kRanks);
  const int start = bp.rank * sh.part;
  const int size = bp.rank == kRanks - 1 ? sh.largest : sh.part;
  const int peer = word_peer<kRanks>(bp);
  // This thread's share, false at the first receive that timed out.
  auto run = [&]() -> bool {
    send_call<kRanks>(bp, c.epoch, peer);
    // 1. Scatter: each pack of a shard another rank owns goes to its owner's scatter slot.
    push_packs<kBatch>(c.in, p.packs, c.first, c.stride, [&](int idx, const uint4& v) {
      const int o = sh.owner(idx, kRanks);
      if (o != bp.rank) st_slot(nth<kRanks>(c.region, o) + bp.rank * sh.largest + idx - o * sh.part, v);
    });

    // 2. Reduce this rank's shard, keep the sum and push it to every peer's gather slot.
    CallWatch w(bp, c.epoch, peer);
    const bool received = receive_sums<T, kRanks, kBatch>(
        c.in + start, c.mine, sh.largest, size, c, bp, kPushScatter, w, [&](int i, const uint4& total) {
          const uint4 sum = sendable(total);  // a sum is never kEmpty; kept uniform
          c.out[start + i] = sum;
#pragma unroll
          for (int r = 0; r < kRanks; r++) {
            if (r != bp.rank) st_slot(c.region[r] + (kRanks + bp.rank) * sh.largest + i, sum);
          }
        });
    if (!received) return false;

    // 3. Gather the other shards' sums.
    for (int base = c.first; base < p.packs; base += kBatch * c.stride) {
      uint4 got[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; b++) {
        const int idx = base + b * c.stride;
        const int o = sh.owner(idx, kRanks);
        if (idx < p.packs && o != bp.rank) got[b] = ld_slot(c.mine + (kRanks + o) * sh.largest + idx - o * sh.part);
      }
#pragma unroll
      for (int b = 0; b < kBatch; b++) {
        const int idx = base + b * c.stride;
        const int o = sh.owner(idx, kRanks);
        if (idx >= p.packs || o == bp.rank) continue;
        uint4* slot = c.mine + (kRanks + o) * sh.largest + idx - o * sh.part;
        if (!await_slot(slot, got[b], bp, kPushGather, o, w)) return false;
        c.out[idx] = got[b];
        reset_slot(slot);
      }
    }
    return w.check(bp, kPushGather);
  };
  if (!release_block(bp, !c.failed && run())) {  // the thread's share: the gathered packs and its own shard's
    poison_packs(c.out, c.first, p.packs, c.stride);
    poison_packs(c.out + start, c.first, size, c.stride);
  }
}

// Packs an epoch needs: the one-shot's ws slots of the message, the two-shot's 2 * ws of its largest shard.
__host__ __device__ constexpr int64_t push_epoch_packs_needed(bool one_shot, int64_t packs, int ranks) {
  return one_shot ? ranks * packs : 2 * ranks * (packs - (ranks - 1) * (packs / ranks));
}

}  // namespace graphar
