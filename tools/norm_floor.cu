// Where the fused norm kernel's local time goes on one GPU: a ladder of kernels that each add one of
// its fixed steps, on the fused kernel's own grid, against the kernel itself (a communicator made its
// own peer by the testing library, as `python bench/norm_local.py` runs it) and a plain add + RMSNorm
// with no protocol; then the fused kernel with its split capped at each of kSplitCaps blocks per row.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Icsrc -o /tmp/norm_floor tools/norm_floor.cu \
//     tools/graphar_testing.cu -Lgraphar -lgraphar_cuda -Xlinker -rpath=$PWD/graphar && /tmp/norm_floor
// (a diagnostic, not part of the library; needs graphar/libgraphar_cuda.so built for this GPU).
// Each figure: us per launch (graph_timing.cuh).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>

#include "../csrc/push_norm.cuh"
#include "graph_timing.cuh"
#include "graphar_testing.h"

#define TESTING(call)                                                                               \
  do {                                                                                              \
    if ((call) != 0) {                                                                              \
      std::fprintf(stderr, "%s failed at line %d: %s\n", #call, __LINE__, graphar_testing_last_error()); \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

using namespace graphar;
using T = __nv_bfloat16;

constexpr float kEps = 1e-6f;

// ---- the ladder: each kernel adds one step of push_one_shot_norm to the one before ----------------

// Nothing but the launch, with the fused kernel's parameters.
__global__ void launch_only(NormParams p) {
  if (p.row_packs < 0) asm volatile("trap;");
}

// + the claim: each block counted in and out of Signal::running (an acquire atomic, a release reduction).
__global__ void claim_only(NormParams p) {
  if (threadIdx.x == 0) enter_alone(p.push.barrier, kPushEntry);
  release_block(p.push.barrier);  // its block barrier is the one that ends a claim
}

// The claim's two atomics made relaxed: what its acquire and release orderings cost beyond the round
// trips themselves (not a safe claim: the orderings are what let a kernel on another stream start
// after it).
__global__ void claim_relaxed(NormParams p) {
  const BarrierParams& bp = p.push.barrier;
  if (threadIdx.x == 0) {
    unsigned long long before;
    asm volatile("atom.relaxed.gpu.global.add.u64 %0, [%1], %2;"
                 : "=l"(before)
                 : "l"(&bp.self->running), "l"(running_entry(bp))
                 : "memory");
    if (before == ~0ull) asm volatile("trap;");  // the result is used, as the claim uses it
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(&bp.self->running), "l"(0ull - running_entry(bp))
                 : "memory");
  }
}

// + the epoch: read with the claim at entry and advanced right after it, as every push kernel does.
__global__ void epoch_and_claim(NormParams p) {
  bool refused;
  enter_epoch(p.push.barrier, refused);
  release_block(p.push.barrier);
}

// + the packs through this rank's own slots, as the loopback moves them: push, load and arrival test,
// reset, output.
__global__ void own_slot_round_trip(NormParams p) {
  const PushParams& q = p.push;
  const BarrierParams& bp = q.barrier;
  bool refused;
  const uint32_t epoch = enter_epoch(bp, refused);
  uint4* region[2];
  epoch_regions<2>(q, epoch, region);
  bool ok = !refused;
  CallWatch no_word(bp, epoch, -1);  // the fused kernel's call words are not on this rung
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; ok && i < q.packs; i += gridDim.x * blockDim.x) {
    st_slot(region[1] + i, sendable(static_cast<const uint4*>(q.in)[i]));  // rank 0's slot at "rank 1"
    uint4* slot = region[0] + q.packs + i;                                  // the same slot, read as rank 1's
    uint4 got = ld_slot(slot);
    ok = await_slot(slot, got, bp, kPushOneShot, 1, no_word);
    if (ok) {
      reset_slot(slot);
      static_cast<uint4*>(q.out)[i] = got;
    }
  }
  release_block(bp);
}

// The add and RMSNorm alone, no protocol: a block per row, rows up to 8 packs a thread (as Inductor's
// unfused kernel: one launch that reads x, residual and weight and writes both outputs).
__global__ void plain_add_norm(NormParams p) {
  const int row = blockIdx.x;
  const uint4* x = static_cast<const uint4*>(p.push.in) + static_cast<int64_t>(row) * p.row_packs;
  const uint4* res = static_cast<const uint4*>(p.residual) + static_cast<int64_t>(row) * p.row_packs;
  const uint4* w = static_cast<const uint4*>(p.weight);
  uint4* out = static_cast<uint4*>(p.push.out) + static_cast<int64_t>(row) * p.row_packs;
  uint4* res_out = static_cast<uint4*>(p.residual_out) + static_cast<int64_t>(row) * p.row_packs;
  uint4 h[kNormPacksPerThread];
  float squares = 0.f;
#pragma unroll
  for (int k = 0; k < kNormPacksPerThread; k++) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < p.row_packs) {
      h[k] = add_packs<T>(x[i], res[i]);
      res_out[i] = h[k];
      squares += sum_of_squares<T>(h[k]);
    }
  }
  __shared__ float warp_sums[kNormThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = squares;
  __syncthreads();
  const float total = row_sum(warp_sums, blockDim.x / 32);
  const float scale = rsqrtf(total / static_cast<float>(p.row_packs * Pack<T>::kLanes) + kEps);
#pragma unroll
  for (int k = 0; k < kNormPacksPerThread; k++) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < p.row_packs) out[i] = normalise<T>(h[k], scale, w[i], true, false);
  }
}

// ---- one shape ------------------------------------------------------------------------------------

// One shape's tensors (bf16 0x3c3c, about 0.011, finite; weight 0x3f3f) and the library's arguments.
struct Shape {
  int packs, row_packs;
  void *x, *residual, *weight, *out, *residual_out;
  graphar_all_reduce_norm_args args{};

  Shape(int hidden, int tokens, cudaStream_t s) {
    const uint64_t row_bytes = static_cast<uint64_t>(hidden) * sizeof(T);
    const uint64_t nbytes = row_bytes * tokens;
    packs = static_cast<int>(nbytes / 16);
    row_packs = static_cast<int>(row_bytes / 16);
    for (void** t : {&x, &residual, &out, &residual_out}) {
      CHECK(cudaMalloc(t, nbytes));
      CHECK(cudaMemset(*t, 0x3c, nbytes));
    }
    CHECK(cudaMalloc(&weight, row_bytes));
    CHECK(cudaMemset(weight, 0x3f, row_bytes));
    args.input = reinterpret_cast<uint64_t>(x);
    args.residual = reinterpret_cast<uint64_t>(residual);
    args.weight = reinterpret_cast<uint64_t>(weight);
    args.output = reinterpret_cast<uint64_t>(out);
    args.residual_output = reinterpret_cast<uint64_t>(residual_out);
    args.nbytes = nbytes;
    args.row_bytes = row_bytes;
    args.stream = reinterpret_cast<uint64_t>(s);
    args.eps = kEps;
    args.dtype = GRAPHAR_BFLOAT16;
  }
  ~Shape() {
    for (void* t : {x, residual, out, residual_out, weight}) CHECK(cudaFree(t));
  }

  // us per launch of the library's fused kernel, its communicator its own peer, its split capped at
  // max_split (0: the library's own grid); the grid it used in *grid.
  double fused_us(void* comm, cudaStream_t s, int pdl, int max_split, int grid[3]) {
    graphar_kernels kernels{};  // no rows: a direct launch needs no plan, only PDL
    kernels.pdl = pdl;
    CHECK(graphar_comm_set_kernels(comm, &kernels));
    TESTING(graphar_testing_loopback(comm, args.nbytes));
    TESTING(graphar_testing_norm_split(comm, max_split));
    TESTING(graphar_testing_norm_grid(comm, args.nbytes, args.row_bytes, 0, 0, 0, &grid[0], &grid[1], &grid[2]));
    return us_per_launch(s, [&](int) { CHECK(graphar_comm_all_reduce_norm(comm, &args)); });
  }
};

// The ladder's parameters: a rank-0 Signal of its own, a receive region laid out as the loopback's
// (rank 1's region starts `packs` packs after rank 0's), graph launches (BarrierParams::graph).
NormParams ladder_params(const Shape& b, Signal* self, ErrorRecord* error, uint4* region) {
  NormParams p{};
  BarrierParams& bp = p.push.barrier;
  for (int r = 0; r < kMaxRanks; r++) bp.signals.signals[r] = self;
  bp.self = self;
  bp.error = error;
  bp.timeout_ns = 10ull * 1000 * 1000 * 1000;
  bp.graph = 1;
  p.push.regions.ptrs[0] = region;
  p.push.regions.ptrs[1] = region + b.packs;
  p.push.in = b.x;
  p.push.out = b.out;
  p.push.packs = b.packs;
  p.push.epoch_packs = 2 * b.packs;
  p.residual = b.residual;
  p.weight = b.weight;
  p.residual_out = b.residual_out;
  p.row_packs = b.row_packs;
  p.eps = kEps;
  return p;
}

void run_ladder(int hidden, int tokens, void* comm, Signal* self, ErrorRecord* error, uint4* region, cudaStream_t s) {
  Shape b(hidden, tokens, s);
  int grid[3] = {};  // blocks, threads, split
  const double fused_us = b.fused_us(comm, s, 0, 0, grid);
  const double fused_pdl_us = b.fused_us(comm, s, 1, 0, grid);
  const int blocks = grid[0], threads = grid[1];

  NormParams p = ladder_params(b, self, error, region);
  auto ladder = [&](auto kernel, int grid_blocks, int block) {
    return us_per_launch(s, [&, kernel, grid_blocks, block](int launch) {
      p.push.barrier.tag = static_cast<uint64_t>(launch) + 1;
      p.push.barrier.claim = claim_word(p.push.barrier.tag);
      kernel<<<grid_blocks, block, 0, s>>>(p);
      CHECK(cudaGetLastError());
    });
  };
  const double empty_us = ladder(launch_only, blocks, threads);
  const double claim_us = ladder(claim_only, blocks, threads);
  const double relaxed_us = ladder(claim_relaxed, blocks, threads);
  const double epoch_us = ladder(epoch_and_claim, blocks, threads);
  const double slot_us = ladder(own_slot_round_trip, blocks, threads);
  const int norm_threads = std::min(kNormThreads, (b.row_packs + 31) / 32 * 32);
  const double plain_us =
      b.row_packs <= kNormThreads * kNormPacksPerThread ? ladder(plain_add_norm, tokens, norm_threads) : -1;
  if (error->failed) {
    std::fprintf(stderr, "a kernel gave up a wait (where %u, cause %u): times are void\n", error->where, error->cause);
    std::exit(1);
  }
  std::printf("| %d | %d | %d x %d, %d/row | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", hidden,
              tokens, blocks, threads, grid[2], empty_us, relaxed_us, claim_us, epoch_us, slot_us, plain_us, fused_us,
              fused_pdl_us);
}

// The fused kernel with PDL at each cap on its split: what spreading a few rows over more blocks buys
// or costs locally.
constexpr int kSplitCaps[] = {0, 32, 16, 8, 4, 2, 1};

void run_split_sweep(int hidden, int tokens, void* comm, cudaStream_t s) {
  Shape b(hidden, tokens, s);
  std::printf("| %d | %d |", hidden, tokens);
  for (int cap : kSplitCaps) {
    int grid[3] = {};
    const double us = b.fused_us(comm, s, 1, cap, grid);
    std::printf(" %.2f (%d) |", us, grid[0]);
  }
  std::printf("\n");
}

int main() {
  constexpr uint64_t kMaxBytes = 8ull << 20;
  void* comm = nullptr;
  CHECK(graphar_comm_create(0, 2, kMaxBytes, kMaxBlocks, 10ull * 1000 * 1000 * 1000, 1, &comm));
  Signal* self;
  CHECK(cudaMalloc(&self, sizeof(Signal)));
  CHECK(cudaMemset(self, 0, sizeof(Signal)));
  uint4* region;
  const size_t region_bytes = 8 * kMaxBytes;  // 4 epochs of 2 messages: the largest shape's
  CHECK(cudaMalloc(&region, region_bytes));
  CHECK(cudaMemset(region, 0xFF, region_bytes));  // every slot kEmpty
  ErrorRecord* error;
  CHECK(cudaHostAlloc(&error, sizeof(ErrorRecord), cudaHostAllocMapped));
  *error = ErrorRecord{};
  const cudaStream_t s = open_report("bf16 [tokens, hidden]");
  std::printf("| hidden | tokens | fused grid | launch only | + claim, relaxed | + claim | + epoch | + own slots | "
              "plain add + norm | fused local | fused local, PDL |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int hidden : {4096, 8192}) {
    for (int tokens : {1, 8, 64}) run_ladder(hidden, tokens, comm, self, error, region, s);
  }
  std::printf("\nFused local, PDL, by the cap on blocks per row (blocks in brackets):\n\n| hidden | tokens |");
  for (int cap : kSplitCaps) cap > 0 ? std::printf(" <= %d/row |", cap) : std::printf(" library's grid |");
  std::printf("\n|---|---|");
  for (size_t i = 0; i < std::size(kSplitCaps); i++) std::printf("---|");
  std::printf("\n");
  for (int hidden : {4096, 8192}) {
    for (int tokens : {1, 2, 4, 8, 16, 32}) run_split_sweep(hidden, tokens, comm, s);
  }
  CHECK(cudaStreamSynchronize(s));
  CHECK(graphar_comm_destroy(comm));
  return 0;
}
