// graphar's IPC all-to-all, in one of two ways; either way a byte copy (any dtype, exact bits)
// that places rows by a two-level stride, so the receive-side relayout of the Ulysses exchanges
// happens inside the copy.
// - pull: every rank packs its chunks (one per destination rank) into its own exchange buffer, then
//   reads chunk `rank` of every peer's buffer over the link into its output;
// - push: every rank packs chunk j straight into rank j's exchange buffer, at its own slot (the
//   link crossed by stores, which need no round trip), then copies its buffer into its output.
// exchange.cu alone includes it: exchange_lease, no template, is defined here for that one file.
#pragma once

#include "barrier.cuh"

namespace graphar {

// Where chunk i (from rank i) lands: `rows` rows of `row_packs` contiguous 16-byte packs, row k at
// out + i * dst_chunk_stride + k * dst_row_stride (all in packs).
struct Placement {
  int64_t chunk_packs;  // rows * row_packs: one destination's chunk in the send buffer
  int64_t row_packs;
  int64_t dst_row_stride;
  int64_t dst_chunk_stride;
};

struct AllToAllParams {
  BarrierParams barrier;
  // Where chunk i (from rank i) starts: in rank i's buffer (pulled) or in this rank's (pushed). By
  // value, so a captured launch keeps the buffers it saw.
  RankData chunks;
  void* out;
  Placement place;
  int skip;  // the rank whose chunk the pack already placed in the output (this one), or -1
  int give_back;  // the exchange's last copy: block 0 gives the lease back when it is done
};

// An exchange's lease. The packs of an exchange write the exchange buffers (this rank's, or pushed,
// the peers') before any of its copies claims the communicator, so another exchange's copy running
// beside them on another stream would read half of each. One thread counts the exchange in at
// Signal::running under the tag its copies will carry (count_in: the copies' blocks then find
// only their own tag) before the first pack; the last copy counts it out. A lease taken beside
// another kernel of the communicator marks the group failed, and every pack reads that flag before
// it stores (graphar/ulysses/pack.py): the loser writes nothing shared, its copies and the kernel it
// met write poison, and the next host call raises.
__global__ void exchange_lease(BarrierParams p) { enter_alone(p, kAllToAllLease); }

// Packs per thread per rank in flight: 16 loads per thread at ws 2 and 4, 8 at ws 6 and 8.
template <int kRanks>
constexpr int kPullUnroll = kRanks >= 6 ? 1 : 16 / kRanks;

// Half the all-reduce's block: a pull block fits on an SM beside the next stage's pack kernel instead
// of waiting for a whole SM to drain, which would serialize the pipeline.
constexpr int kPullThreads = 256;

// Entry: the pack wrote the exchange buffers (own or, pushed, the peers') in an earlier kernel that
// ended with a system-scope fence (graphar/ulysses/pack.py), so its stores, the pushed ones over the
// link included, were performed before this kernel started; the release/acquire then makes this
// block's arrival the peers' signal to read.
// Exit: a buffer may be written again (the next pack: own buffer when pulled, the peers' when
// pushed) only once every rank has copied out of it; only arrival matters, so volatile. A block whose
// exit fails poisons its share of the output: a peer that gave up may already be packing over what
// this block copied.
template <int kRanks>
__global__ void __launch_bounds__(kPullThreads, 1) gather_all_to_all(AllToAllParams p) {
  const BarrierParams& bp = p.barrier;
  // Failed: every chunk of this thread's share, the own one placed by the pack too, is poison instead.
  Arrival entry;
  const bool ok = claim_block<kRanks>(bp, kAllToAllEntry, entry) &&
                  multi_gpu_barrier<kRanks, Form::kFenced>(bp, kAllToAllEntry, entry);
  const Placement pl = p.place;
  const uint4* src[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; r++) src[r] = static_cast<const uint4*>(p.chunks.ptrs[r]);
  uint4* out = static_cast<uint4*>(p.out);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // Pack idx of every chunk but `skip`, v[r] for chunk r, placed in the output.
  auto place = [&](int64_t idx, const uint4 (&v)[kRanks], int skip) {
    const int64_t row = idx / pl.row_packs;
    const int64_t at = row * pl.dst_row_stride + (idx - row * pl.row_packs);
#pragma unroll
    for (int r = 0; r < kRanks; r++) {
      if (r != skip) out[r * pl.dst_chunk_stride + at] = v[r];
    }
  };
  uint4 poison[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; r++) poison[r] = poison_pack();
  auto fail = [&] {
    for (int64_t idx = first; idx < pl.chunk_packs; idx += stride) place(idx, poison, -1);
  };
  if (ok) {
    for (int64_t base = first; base < pl.chunk_packs; base += kPullUnroll<kRanks> * stride) {
      uint4 v[kPullUnroll<kRanks>][kRanks];
#pragma unroll
      for (int u = 0; u < kPullUnroll<kRanks>; u++) {
        const int64_t idx = base + u * stride;
#pragma unroll
        for (int r = 0; r < kRanks; r++) {
          if (idx < pl.chunk_packs && r != p.skip) v[u][r] = src[r][idx];  // every load in flight before any store
        }
      }
#pragma unroll
      for (int u = 0; u < kPullUnroll<kRanks>; u++) {
        const int64_t idx = base + u * stride;
        if (idx >= pl.chunk_packs) break;
        place(idx, v[u], p.skip);
      }
    }
    if (!multi_gpu_barrier<kRanks, Form::kEnd>(bp, kAllToAllExit)) fail();
  } else {
    fail();
  }
  release_block(bp);
  // After this block's own count: until the last block is out, the copy's other blocks still hold the tag.
  if (p.give_back && blockIdx.x == 0 && threadIdx.x == 0) leave_running(bp);
}

}  // namespace graphar
