// The push one-shot all-reduce fused with the residual add and RMSNorm (push_norm.cuh, instantiated
// here alone): its grid, its scratch words, the checks of a call and its launch, between ranks or
// on one GPU (loopback).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "comm.cuh"
#include "graphar_cuda.h"
#include "host.h"
#include "launch.cuh"
#include "push_norm.cuh"

using namespace graphar;

namespace {

const void* norm_kernel_for(int dtype, int ranks) {
  return by_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    return by_ranks(ranks, [](auto r) { return reinterpret_cast<const void*>(push_one_shot_norm<T, r.value>); });
  });
}

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

NormGrid norm_grid(int64_t rows, int row_packs, int block_limit, uint64_t scratch_words, int max_split) {
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

NormScratch norm_scratch(const Comm* c, Signal* self) {
  const uint64_t two_stage = 16 * (c->max_bytes / 16 / c->ranks + c->ranks);
  const uint64_t start = (two_stage + 127) / 128 * 128;
  if (start >= c->max_bytes) return {nullptr, 0};
  char* tmp = reinterpret_cast<char*>(self + 1);  // tmp_buffer(self), on the host
  return {reinterpret_cast<unsigned long long*>(tmp + start), (c->max_bytes - start) / 8};
}

// Launches the fused norm on the communicator's rank. loopback (a benchmark's and a test's, one GPU):
// a world-size-2 communicator of rank 0 whose peers were never opened, its own rank standing in for
// rank 1: rank 1's region is placed so that this rank's pushes land in the slots this rank reads as
// rank 1's (its own memory, not a peer's over NVLink), and the kernel runs as it runs between two
// GPUs whose peer's data has arrived, summing its input twice. grid (may be null): the launch's.
int launch_norm(Comm* c, const graphar_all_reduce_norm_args& a, bool loopback, int max_split, NormGrid* grid) {
  const void* kernel = norm_kernel_for(a.dtype, c->ranks);
  if (kernel == nullptr) return fail(GRAPHAR_EINVAL, "no fused kernel for dtype %d", a.dtype);
  if (loopback && (c->ranks != 2 || c->rank != 0 || c->opened)) {
    return fail(GRAPHAR_EINVAL, "a loopback launch takes a world-size-2 communicator of rank 0, never opened");
  }
  if (!loopback && !c->opened) return fail(GRAPHAR_EINVAL, "launch before the peers' buffers were opened");
  if (a.row_bytes == 0 || a.row_bytes % 16 != 0 || a.row_bytes > kNormMaxRowBytes || a.nbytes == 0 ||
      a.nbytes % a.row_bytes != 0 || a.nbytes > c->max_bytes) {
    return fail(GRAPHAR_EINVAL, "%llu bytes in rows of %llu: rows must be multiples of 16 bytes up to %llu",
                static_cast<unsigned long long>(a.nbytes), static_cast<unsigned long long>(a.row_bytes),
                static_cast<unsigned long long>(kNormMaxRowBytes));
  }
  if ((a.input | a.residual | a.weight | a.output | a.residual_output) % 16 != 0) {
    return fail(GRAPHAR_EINVAL, "every tensor must be 16-byte aligned");
  }
  if (int rc = check_push_room(c, true, a.nbytes)) return rc;
  auto stream = reinterpret_cast<cudaStream_t>(a.stream);
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  bool eager = false;
  if (int rc = is_eager(stream, &eager)) return rc;
  NormParams p{};
  p.push = push_params(c, eager, a.input, a.output, a.nbytes);
  if (loopback) {
    Signal* self = reinterpret_cast<Signal*>(c->meta);
    c->signals.signals[c->rank] = self;  // as graphar_comm_open sets it: destroy marks it failed for graphs
    p.push.barrier.self = self;
    for (int r = 0; r < kMaxRanks; r++) p.push.barrier.signals.signals[r] = self;  // the kernel reads its own only
    // ... and stores its call word for rank 1 at signals[1]->push_calls[...][0]: one word on, that is
    // its own word from rank 1, which it checks.
    p.push.barrier.signals.signals[1] = reinterpret_cast<Signal*>(reinterpret_cast<Flag*>(self) + 1);
    char* own = push_region(c->meta, c->max_bytes);
    p.push.regions.ptrs[0] = own;
    p.push.regions.ptrs[1] = own + a.nbytes;  // + epoch + 0 * packs + i: this rank's slot for rank 1's pack i
  }
  const NormScratch scratch = norm_scratch(c, p.push.barrier.self);
  const NormGrid grid_ = norm_grid(static_cast<int64_t>(a.nbytes / a.row_bytes), static_cast<int>(a.row_bytes / 16),
                                   c->block_limit, scratch.count, max_split);
  p.residual = reinterpret_cast<const void*>(a.residual);
  p.weight = reinterpret_cast<const void*>(a.weight);
  p.residual_out = reinterpret_cast<void*>(a.residual_output);
  p.partials = scratch.words;
  p.row_packs = static_cast<int>(a.row_bytes / 16);
  p.split = grid_.split;
  p.slice_segments = grid_.slice_segments;
  p.weight_first = a.weight_first;
  p.eps = a.eps;
  if (grid != nullptr) *grid = grid_;
  return launch(c, eager, kernel, &p, grid_.blocks, grid_.threads, stream, c->kernels.pdl != 0);
}

}  // namespace

extern "C" {

int graphar_comm_all_reduce_norm(void* comm, const graphar_all_reduce_norm_args* args) {
  return launch_norm(as_comm(comm), *args, false, 0, nullptr);
}

int graphar_comm_norm_loopback(void* comm, const graphar_all_reduce_norm_args* args, int max_split, int* blocks,
                               int* threads, int* split) {
  NormGrid g{};
  const int rc = launch_norm(as_comm(comm), *args, true, max_split, &g);
  *blocks = g.blocks;
  *threads = g.threads;
  *split = g.split;
  return rc;
}

int graphar_norm_grid(uint64_t nbytes, uint64_t row_bytes, int block_limit, uint64_t scratch_words, int max_split,
                      int* blocks, int* threads, int* split) {
  if (row_bytes == 0 || row_bytes % 16 != 0 || row_bytes > kNormMaxRowBytes || nbytes == 0 || nbytes % row_bytes != 0 ||
      nbytes / 16 > INT_MAX || block_limit < 1 || block_limit > kMaxBlocks) {
    return fail(GRAPHAR_EINVAL, "no grid for %llu bytes in rows of %llu over %d blocks",
                static_cast<unsigned long long>(nbytes), static_cast<unsigned long long>(row_bytes), block_limit);
  }
  const NormGrid g = norm_grid(static_cast<int64_t>(nbytes / row_bytes), static_cast<int>(row_bytes / 16), block_limit,
                               scratch_words, max_split);
  *blocks = g.blocks;
  *threads = g.threads;
  *split = g.split;
  return 0;
}

}  // extern "C"
