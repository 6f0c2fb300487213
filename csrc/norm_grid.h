// The fused norm's launch shape, a host computation: its grid (norm_grid) and the scratch words its
// split rows exchange partial sums through (norm_scratch). launch_norm.cu launches with them; the
// testing library (tools/graphar_testing.cu) reports them.
#pragma once

#include <algorithm>
#include <cstdint>

#include "comm.cuh"
#include "push_norm.cuh"

namespace graphar {

// How push_one_shot_norm covers `rows` rows of row_packs packs with at most block_limit blocks
// (push_norm.cuh). A row of up to kNormThreads packs goes to one block whole (every gridDim-th row, a
// pack per thread). A longer one is split between `split` blocks of slice_segments segments each,
// slices of about kNormSlicePacks packs, while rows * split stays within block_limit (at and above
// block_limit rows, a block per row). Fewer blocks are faster here: each adds its claim, epoch and
// call word, and a split row the exchange of partial sums, which blocks of kNormThreads threads pay
// more for than blocks of kNormSlicePacks (bench/results/norm-floor-h200.md, the split sweep). A split
// needs rows * split * segments scratch words (the partials each block hands its siblings), at most
// scratch_words: a split that needs more is cut down to fit. max_split > 0 caps the split (1: a block
// per row). The threads cover the slice with at most kNormPacksPerThread packs each, in whole warps.
// Ranks may be split differently without their results differing: the kernel's mean square does not
// depend on the grid.
struct NormGrid {
  int blocks, threads, split, slice_segments;
};

inline NormGrid norm_grid(int64_t rows, int row_packs, int block_limit, uint64_t scratch_words, int max_split) {
  const int64_t segments = (row_packs + kNormSegmentPacks - 1) / kNormSegmentPacks;
  const int64_t slices = row_packs <= kNormThreads ? 1 : (row_packs + kNormSlicePacks - 1) / kNormSlicePacks;
  int64_t split = std::min<int64_t>(slices, block_limit / rows);  // slices <= segments (push_norm.cuh)
  if (max_split > 0) split = std::min<int64_t>(split, max_split);
  if (split > 1) split = std::min<int64_t>(split, static_cast<int64_t>(scratch_words / (rows * segments)));
  split = std::max<int64_t>(split, 1);
  NormGrid g{};
  g.slice_segments = static_cast<int>((segments + split - 1) / split);
  g.split = static_cast<int>((segments + g.slice_segments - 1) / g.slice_segments);  // no block without packs
  g.blocks = g.split > 1 ? static_cast<int>(rows * g.split) : static_cast<int>(std::min<int64_t>(rows, block_limit));
  const int slice_packs = std::min(row_packs, g.slice_segments * kNormSegmentPacks);
  const int per_thread = (slice_packs + kNormThreads - 1) / kNormThreads;  // at most kNormPacksPerThread
  g.threads = ((slice_packs + per_thread - 1) / per_thread + 31) / 32 * 32;
  return g;
}

// The fused norm's scratch words in a rank's allocation: the tail of its 2stage tmp buffer (Signal |
// tmp of max_bytes | push region). 2stage writes at most a shard of max_bytes: max_bytes / ws + ws
// packs, the first half at most; the P2P probe a few words at its start; nothing else writes tmp.
struct NormScratch {
  unsigned long long* words;
  uint64_t count;
};

inline NormScratch norm_scratch(const Comm* c, Signal* self) {
  const uint64_t two_stage = 16 * (c->max_bytes / 16 / c->ranks + c->ranks);
  const uint64_t start = (two_stage + 127) / 128 * 128;
  if (start >= c->max_bytes) return {nullptr, 0};
  char* tmp = reinterpret_cast<char*>(self + 1);  // tmp_buffer(self), on the host
  return {reinterpret_cast<unsigned long long*>(tmp + start), (c->max_bytes - start) / 8};
}

}  // namespace graphar
