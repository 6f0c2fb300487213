// graphar's IPC all-to-all: every rank packs its send buffer (one chunk per destination rank) into
// its registered exchange buffer, then every rank pulls chunk `rank` from each peer's exchange
// buffer straight into its output, placing it by a two-level stride so that the receive-side
// relayout of the Ulysses exchanges happens inside the copy. A byte copy: any dtype, exact bits.
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
  RankData sends;   // every rank's exchange buffer, by value: a captured launch keeps the buffers it saw
  void* out;
  int64_t src_offset;  // packs into every exchange buffer where this call's chunks start
  Placement place;
};

// Packs per thread per rank in flight: 16 loads per thread at ws 2 and 4, 8 at ws 6 and 8.
template <int kRanks>
constexpr int kPullUnroll = kRanks >= 6 ? 1 : 16 / kRanks;

// Half the all-reduce's block: a pull block fits on an SM beside the next stage's pack kernel instead
// of waiting for a whole SM to drain, which would serialize the pipeline.
constexpr int kPullThreads = 256;

// Entry: the pack wrote the exchange buffer in an earlier kernel; release/acquire carries it to the
// peers without leaning on kernel boundaries for cross-GPU visibility (free next to the copy).
// Exit: a rank may overwrite its exchange buffer (the next pack) only once every peer has pulled
// from it; only arrival matters, so volatile.
template <int kRanks>
__global__ void __launch_bounds__(kPullThreads, 1) pull_all_to_all(AllToAllParams p) {
  const BarrierParams& bp = p.barrier;
  if (!multi_gpu_barrier<kRanks, Form::kFenced>(bp, kAllToAllEntry)) return;
  const Placement pl = p.place;
  const uint4* src[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; r++) {
    src[r] = static_cast<const uint4*>(p.sends.ptrs[r]) + p.src_offset + bp.rank * pl.chunk_packs;
  }
  uint4* out = static_cast<uint4*>(p.out);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < pl.chunk_packs;
       base += kPullUnroll<kRanks> * stride) {
    uint4 v[kPullUnroll<kRanks>][kRanks];
#pragma unroll
    for (int u = 0; u < kPullUnroll<kRanks>; u++) {
      const int64_t idx = base + u * stride;
#pragma unroll
      for (int r = 0; r < kRanks; r++) {
        if (idx < pl.chunk_packs) v[u][r] = src[r][idx];  // every load in flight before any store
      }
    }
#pragma unroll
    for (int u = 0; u < kPullUnroll<kRanks>; u++) {
      const int64_t idx = base + u * stride;
      if (idx >= pl.chunk_packs) break;
      const int64_t row = idx / pl.row_packs;
      const int64_t at = row * pl.dst_row_stride + (idx - row * pl.row_packs);
#pragma unroll
      for (int r = 0; r < kRanks; r++) out[r * pl.dst_chunk_stride + at] = v[u][r];
    }
  }
  multi_gpu_barrier<kRanks, Form::kEnd>(bp, kAllToAllExit);
}

}  // namespace graphar
