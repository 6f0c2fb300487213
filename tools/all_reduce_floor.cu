// The all-reduce kernels' local time on one GPU: 1stage (the graph path, inputs read in place, and
// the eager path's copy-in) and the push one-shot, each with and without PDL, launched by this tool on a
// world-size-2 rank 0 that stands in for its peer, against a launch of the same grid that does
// nothing. Rank 1's Signal is rank 0's own, one Flag on, and rank 1's receive region is rank 0's,
// one message on, so that every flag and pack the kernel sends "to rank 1" lands where it reads rank
// 1's (as tools/graphar_testing.cu's loopback places the fused norm's): the kernel runs its whole protocol
// with the peer's part already there. The kernels come from csrc's headers, so this tool built from
// two trees compares two versions of them in one session.
//
// A second table runs the two ranks for real, as two streams of one process on one GPU, each rank
// with its own memory: every flag, call word and pack then comes from another SM through L2, where
// the loopback finds what its own thread stored. Not NVLink's latency, but the protocol's waits as
// two ranks meet them; a pair's time is one launch of each rank, running at once.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/all_reduce_floor \
//     tools/all_reduce_floor.cu -Lgraphar -lgraphar_cuda -Xlinker -rpath=$PWD/graphar && /tmp/all_reduce_floor
// (a diagnostic, not part of the library). Each figure: us per launch (graph_timing.cuh). With the
// argument `no-v1-pdl` 1stage is never launched with PDL: for kernels from a tree whose 1stage does
// not wait for the kernel before it.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "../csrc/all_reduce.cuh"
#include "../csrc/push.cuh"
#include "graph_timing.cuh"

using namespace graphar;
using T = __nv_bfloat16;

constexpr uint64_t kMaxBytes = 2ull << 20;
constexpr int kBlockLimit = 64;
constexpr uint16_t kInput = 0x3c3c;  // bf16, about 0.0115: twice it is exact
constexpr uint16_t kTwice = 0x3cbc;

__global__ void launch_only(Params p) {
  if (p.packs < 0) asm volatile("trap;");
}

// 1stage's claim and entry barrier alone, as its graph path meets them.
__global__ void one_stage_entry(Params p) {
  claim_and_start<2>(p.barrier, kOneStageEntry);
  release_block(p.barrier);
}

// One rank's memory: its Signal, its receive region (2 launch classes x 2 epochs of two messages of
// kMaxBytes, every slot kEmpty), its input (kInput everywhere), registered buffer and output.
struct RankMemory {
  Signal* signal;
  ErrorRecord* error;
  uint4* region;
  void *in, *registered, *out;

  RankMemory() {
    CHECK(cudaMalloc(&signal, sizeof(Signal)));
    CHECK(cudaMemset(signal, 0, sizeof(Signal)));
    CHECK(cudaHostAlloc(&error, sizeof(ErrorRecord), cudaHostAllocMapped));
    *error = ErrorRecord{};
    CHECK(cudaMalloc(&region, 8 * kMaxBytes));
    CHECK(cudaMemset(region, 0xFF, 8 * kMaxBytes));
    for (void** t : {&in, &registered, &out}) CHECK(cudaMalloc(t, kMaxBytes));
    const std::vector<uint16_t> x(kMaxBytes / 2, kInput);
    CHECK(cudaMemcpy(in, x.data(), kMaxBytes, cudaMemcpyHostToDevice));
  }
  // The kernel wrote every pack of its output, each twice the input, and gave up no wait.
  void check_output(uint64_t nbytes, const char* what) const {
    std::vector<uint16_t> got(nbytes / 2);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(got.data(), out, nbytes, cudaMemcpyDeviceToHost));
    for (uint16_t v : got) {
      if (v != kTwice || error->failed) {
        std::fprintf(stderr, "%s, %llu bytes: output %#x (failed %u, where %u, cause %u)\n", what,
                     static_cast<unsigned long long>(nbytes), v, error->failed, error->where, error->cause);
        std::exit(1);
      }
    }
    CHECK(cudaMemset(out, 0, kMaxBytes));
  }
};

RankData* rank_data(const void* rank0, const void* rank1) {
  RankData host{}, *device;
  host.ptrs[0] = rank0;
  host.ptrs[1] = rank1;
  CHECK(cudaMalloc(&device, sizeof(RankData)));
  CHECK(cudaMemcpy(device, &host, sizeof(RankData), cudaMemcpyHostToDevice));
  return device;
}

// The ranks of one table, kRanks of them launched: 1, rank 0 alone standing in for rank 1 (the header
// says how); 2, each rank with its own memory, on two streams that run at once.
template <int kLaunched>
struct Ranks {
  static constexpr int kRanks = kLaunched;
  RankMemory m[kRanks];
  RankData* in_place = rank_data(m[0].in, m[kRanks - 1].in);                    // 1stage's graph path
  RankData* staged = rank_data(m[0].registered, m[kRanks - 1].registered);  // its copy-in

  Signal* signal(int rank) const {
    if (kRanks == 1 && rank == 1) return reinterpret_cast<Signal*>(reinterpret_cast<Flag*>(m[0].signal) + 1);
    return m[rank].signal;
  }
  // In the loopback rank 0's slot of rank 1's pack idx is at epoch + 0 * packs + idx.
  uint4* region(int rank, int packs) const { return kRanks == 1 ? m[0].region + rank * packs : m[rank].region; }

  // Launch i of a graph (i = 0: the warm-up) by `rank`, as the call number and tag tell launches apart.
  BarrierParams barrier(int rank, int i) const {
    BarrierParams bp{};
    bp.signals.signals[0] = signal(0);
    bp.signals.signals[1] = signal(1);
    bp.self = m[rank].signal;
    bp.error = m[rank].error;
    bp.timeout_ns = 10ull * 1000 * 1000 * 1000;
    bp.tag = static_cast<uint64_t>(i) + 1;
    bp.claim = claim_word(bp.tag);
    bp.rank = rank;
    bp.graph = 1;
    bp.call = static_cast<uint32_t>(i) + 1;
    return bp;
  }
  Params one_stage(int rank, int i, int packs, bool copy_in) const {
    Params p{};
    p.barrier = barrier(rank, i);
    p.data = copy_in ? staged : in_place;
    p.copy_in = copy_in ? m[rank].in : nullptr;
    p.out = m[rank].out;
    p.packs = packs;
    return p;
  }
  // Two epochs of ws = 2 slots in each rank's receive region.
  PushParams push(int rank, int i, int packs) const {
    PushParams p{};
    p.barrier = barrier(rank, i);
    p.regions.ptrs[0] = region(0, packs);
    p.regions.ptrs[1] = region(1, packs);
    p.in = m[rank].in;
    p.out = m[rank].out;
    p.packs = packs;
    p.epoch_packs = 2 * packs;
    return p;
  }
  void check_output(uint64_t nbytes, const char* what) const {
    for (const RankMemory& r : m) r.check_output(nbytes, what);
  }
};

template <typename Kernel, typename Args>
void launch(Kernel kernel, int blocks, int threads, bool pdl, cudaStream_t s, Args args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.stream = s;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  CHECK(cudaLaunchKernelEx(&config, kernel, args));
}

// us per launch of `kernel` by each rank g launches, rank r on streams[r], params(r, i) its parameters.
template <typename Group, typename Kernel, typename MakeParams>
double us_per_ranks(const cudaStream_t* streams, Kernel kernel, int blocks, int threads, bool pdl, MakeParams params) {
  return us_per_launch(
      streams[0],
      [&](int i) {
        for (int r = 0; r < Group::kRanks; r++) launch(kernel, blocks, threads, pdl, streams[r], params(r, i));
      },
      Group::kRanks > 1 ? streams[1] : nullptr);
}

// One row of a table; the loopback's also has the launch-only and claim + entry floors.
template <typename Group>
void run_size(const Group& g, uint64_t nbytes, bool v1_pdl, const cudaStream_t* streams) {
  const int packs = static_cast<int>(nbytes / 16);
  const int v1_blocks = std::min(kBlockLimit, (packs + kThreads - 1) / kThreads);
  const int push_blocks = std::min(kBlockLimit, (packs + kPushThreads - 1) / kPushThreads);
  auto v1 = [&](auto kernel, bool copy_in, bool pdl) {
    return us_per_ranks<Group>(streams, kernel, v1_blocks, kThreads, pdl,
                               [&](int r, int i) { return g.one_stage(r, i, packs, copy_in); });
  };
  auto one_stage_us = [&](bool copy_in, bool pdl) {
    if (pdl && !v1_pdl) return -1.0;
    const double us = v1(one_stage<T, 2>, copy_in, pdl);
    g.check_output(nbytes, copy_in ? "1stage copy-in" : "1stage in place");
    return us;
  };
  auto push = [&](bool pdl) {
    const double us = us_per_ranks<Group>(streams, push_one_shot<T, 2>, push_blocks, kPushThreads, pdl,
                                          [&](int r, int i) { return g.push(r, i, packs); });
    g.check_output(nbytes, "push one-shot");
    return us;
  };
  std::printf("| %llu KB | %d x %d", static_cast<unsigned long long>(nbytes >> 10), v1_blocks, kThreads);
  if (Group::kRanks == 1) std::printf(" | %.2f | %.2f", v1(launch_only, false, false), v1(one_stage_entry, false, false));
  for (bool copy_in : {false, true}) {
    for (bool pdl : {false, true}) {
      const double us = one_stage_us(copy_in, pdl);
      us < 0 ? std::printf(" | -") : std::printf(" | %.2f", us);
    }
  }
  std::printf(" | %d x %d | %.2f | %.2f |\n", push_blocks, kPushThreads, push(false), push(true));
}

int main(int argc, char** argv) {
  const bool v1_pdl = !(argc > 1 && std::string(argv[1]) == "no-v1-pdl");
  cudaStream_t streams[2];
  streams[0] = open_report("bf16, 2 ranks");
  CHECK(cudaStreamCreateWithFlags(&streams[1], cudaStreamNonBlocking));
  const char* columns =
      " | 1stage in place | in place, PDL | 1stage copy-in | copy-in, PDL | push grid | push one-shot | push "
      "one-shot, PDL |\n";
  std::printf("Loopback (rank 0 alone):\n\n| message | 1stage grid | launch only | claim + entry%s"
              "|---|---|---|---|---|---|---|---|---|---|---|\n", columns);
  const Ranks<1> lb;
  for (uint64_t kb : {8, 32, 128, 512, 2048}) run_size(lb, kb << 10, v1_pdl, streams);
  std::printf("\nTwo ranks on two streams (us per pair of launches):\n\n| message | 1stage grid%s"
              "|---|---|---|---|---|---|---|---|---|\n", columns);
  const Ranks<2> pair;
  for (uint64_t kb : {8, 32, 128, 512, 2048}) run_size(pair, kb << 10, v1_pdl, streams);
  return 0;
}
