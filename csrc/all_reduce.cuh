// graphar's custom all-reduce kernels: the v1 design (a per-block spin barrier over CUDA IPC,
// barrier.cuh, then a pull-style one-stage reduce or a reduce-scatter + all-gather two-stage reduce).
//
// Each rank owns one IPC allocation laid out as [Signal | tmp buffer] and one registered input
// buffer. A call reads the ws input pointers of its RankData slot: the registered buffers for
// eager calls, the caller's tensors (pointers filled in after capture) inside graphar.graph.
// A block that finds another kernel of the communicator running, or whose barrier fails (a peer never
// came or gave up, or the group failed before), writes its share of the output as poison (flags.cuh)
// and meets no later barrier. 1stage's exit barrier
// counts too: a peer that gave up after this rank passed the entry may have refilled the buffer this
// rank was reading. Both kernels start with the PDL wait (pdl.cuh), before they read anything.
#pragma once

#include "barrier.cuh"
#include "pack.cuh"
#include "pdl.cuh"

namespace graphar {

constexpr int kThreads = 512;
static_assert(kThreads >= 64, "claim_and_start's claimer and named barrier take warps 0 and 1");

struct Params {
  BarrierParams barrier;
  const RankData* data;  // the ws input pointers of this call
  const void* copy_in;   // non-null: first copy this rank's input into data->ptrs[rank] (all but zero copy)
  void* out;
  int packs;             // message size in 16-byte packs
};

// ---- kernels -------------------------------------------------------------------------------

// Every rank pulls every rank's input and sums in rank order 0..ws-1.
template <typename T, int kRanks>
__global__ void __launch_bounds__(kThreads, 1) one_stage(Params p) {
  pdl_enter();
  const BarrierParams& bp = p.barrier;
  const RankData dp = *p.data;  // in a graph this slot holds the pointers filled in after capture
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int stride = gridDim.x * blockDim.x;
  const uint4* in = static_cast<const uint4*>(p.copy_in);
  // The first pack to copy in and the entry barrier's arrival, in flight while the block claims the
  // communicator.
  uint4 first{};
  if (in != nullptr && tid < p.packs) first = in[tid];
  bool ok = claim_and_enter<kRanks>(bp, kOneStageEntry, in != nullptr, [&] {
    // Same idx -> block mapping as the reduce loop: block b's barrier covers what block b copied.
    uint4* mine = static_cast<uint4*>(const_cast<void*>(p.data->ptrs[bp.rank]));
    if (tid < p.packs) mine[tid] = first;
    for (int idx = tid + stride; idx < p.packs; idx += stride) mine[idx] = in[idx];
  });
  const uint4* src[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; r++) src[r] = static_cast<const uint4*>(dp.ptrs[r]);
  uint4* out = static_cast<uint4*>(p.out);
  for (int idx = tid; idx < p.packs; idx += stride) {
    out[idx] = ok ? reduce_in_order<T, kRanks>(src, idx) : poison_pack();
  }
  if (ok) {
    if (multi_gpu_barrier<kRanks, Form::kEnd>(bp, kOneStageExit)) {
      // Passed: the barrier's closing block sync already follows every thread's last shared access.
      if (threadIdx.x == 0) leave_running(bp);
      return;
    }
    poison_packs(out, tid, p.packs, stride);
  }
  release_block(bp);
}

// Reduce-scatter into the tmp buffers (rank r owns shard r, the last shard takes the remainder),
// then all-gather from them. No exit barrier: the inputs' last readers passed the mid barrier,
// and the next call writes tmp only after its own entry barrier.
template <typename T, int kRanks>
__global__ void __launch_bounds__(kThreads, 1) two_stage(Params p) {
  pdl_enter();
  const BarrierParams& bp = p.barrier;
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int stride = gridDim.x * blockDim.x;
  const int part = p.packs / kRanks;
  const int largest = part + p.packs % kRanks;
  const int start = bp.rank * part;
  const int end = bp.rank == kRanks - 1 ? p.packs : start + part;
  // Inputs in rank order, summed in that order like every other kernel's (pack.cuh): from 3 ranks up
  // a rotated order would round differently. The gather is rotated so that the ranks start on
  // different peers.
  const uint4* src[kRanks];
  const uint4* tmps[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; r++) {
    src[r] = static_cast<const uint4*>(p.data->ptrs[r]);  // in a graph: filled after capture
    tmps[r] = tmp_buffer<uint4>(nth<kRanks>(bp.signals.signals, (bp.rank + r) % kRanks));
  }
  uint4* tmp_out = tmp_buffer<uint4>(bp.self);
  bool ok = claim_and_enter<kRanks>(bp, kTwoStageEntry, p.copy_in != nullptr, [&] {
    // Shard s, offset i is copied by thread i mod stride, the thread that reduces it on rank s.
    const uint4* in = static_cast<const uint4*>(p.copy_in);
    uint4* mine = const_cast<uint4*>(nth<kRanks>(src, bp.rank));
    for (int idx = tid; idx < largest; idx += stride) {
#pragma unroll
      for (int s = 0; s < kRanks; s++) {
        if (s == kRanks - 1 || idx < part) mine[s * part + idx] = in[s * part + idx];
      }
    }
  });
  if (ok) {
    for (int idx = start + tid; idx < end; idx += stride) {
      tmp_out[idx - start] = reduce_in_order<T, kRanks>(src, idx);
    }
    ok = multi_gpu_barrier<kRanks, Form::kFenced>(bp, kTwoStageMid);  // ok is block-uniform
  }
  // The same tid -> offset mapping as stage 1: the barrier only orders block b with block b.
  uint4* out = static_cast<uint4*>(p.out);
  for (int idx = tid; idx < largest; idx += stride) {
#pragma unroll
    for (int i = 0; i < kRanks; i++) {
      const int from = (bp.rank + i) % kRanks;
      if (from == kRanks - 1 || idx < part) out[from * part + idx] = ok ? tmps[i][idx] : poison_pack();
    }
  }
  release_block(bp);
}

}  // namespace graphar
