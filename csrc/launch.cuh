// The launch entry points: kernel choice by dtype, algorithm and world size, the checks of each
// call, and the eager ordering (one op in flight per communicator) both launches share.
#pragma once

#include <algorithm>
#include <type_traits>

#include "all_reduce.cuh"
#include "all_to_all.cuh"
#include "comm.cuh"
#include "push_norm.cuh"

using namespace graphar;

namespace {

// The kernels are instantiated per element type and world size: these call f(Type<T>{}) for a dtype
// code and f(Ranks<kRanks>{}) for a world size, and return nullptr for a value without kernels.
template <typename T>
struct Type {
  using type = T;
};
template <int kRanks>
using Ranks = std::integral_constant<int, kRanks>;

template <typename F>
auto by_dtype(int dtype, F f) -> decltype(f(Type<float>{})) {
  switch (dtype) {
    case GRAPHAR_FLOAT32: return f(Type<float>{});
    case GRAPHAR_FLOAT16: return f(Type<__half>{});
    case GRAPHAR_BFLOAT16: return f(Type<__nv_bfloat16>{});
    default: return nullptr;
  }
}

template <typename F>
auto by_ranks(int ranks, F f) -> decltype(f(Ranks<2>{})) {
  switch (ranks) {
    case 2: return f(Ranks<2>{});
    case 4: return f(Ranks<4>{});
    case 6: return f(Ranks<6>{});
    case 8: return f(Ranks<8>{});
    default: return nullptr;
  }
}

// The all-reduce kernel for a dtype, world size and algorithm code; the launch passes its parameters by address.
const void* kernel_for(int dtype, int ranks, int algo) {
  return by_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    return by_ranks(ranks, [&](auto r) -> const void* {
      switch (algo) {
        case GRAPHAR_ONE_STAGE: return reinterpret_cast<const void*>(one_stage<T, r.value>);
        case GRAPHAR_TWO_STAGE: return reinterpret_cast<const void*>(two_stage<T, r.value>);
        case GRAPHAR_PUSH_ONE_SHOT: return reinterpret_cast<const void*>(push_one_shot<T, r.value>);
        case GRAPHAR_PUSH_TWO_SHOT: return reinterpret_cast<const void*>(push_two_shot<T, r.value>);
        default: return nullptr;
      }
    });
  });
}

const void* norm_kernel_for(int dtype, int ranks) {
  return by_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    return by_ranks(ranks, [](auto r) { return reinterpret_cast<const void*>(push_one_shot_norm<T, r.value>); });
  });
}

using GatherKernel = void (*)(AllToAllParams);

GatherKernel gather_kernel_for(int ranks) {
  return by_ranks(ranks, [](auto r) -> GatherKernel { return gather_all_to_all<r.value>; });
}

bool is_push(int algo) { return algo == GRAPHAR_PUSH_ONE_SHOT || algo == GRAPHAR_PUSH_TWO_SHOT; }

// One op in flight per communicator: an eager launch on another stream waits for the previous one
// instead of racing it for the Signal and the registered buffers.
int wait_for_previous(Comm* c, cudaStream_t stream) {
  if (c->launched && stream != c->last_stream) CUDA_TRY(cudaStreamWaitEvent(stream, c->last_event, 0));
  return 0;
}

// What the next launch's barrier reads, from the communicator; eager: not captured.
BarrierParams barrier_params(const Comm* c, bool eager) {
  BarrierParams b{};
  b.signals = c->signals;
  b.self = c->signals.signals[c->rank];
  b.error = c->error_device;
  b.timeout_ns = c->timeout_ns;
  b.tag = c->launches + 1;
  b.rank = c->rank;
  b.graph = eager ? 0 : 1;
  return b;
}

// Launches kernel(*params) on the communicator's device (current already); an eager launch first
// waits for the previous eager op and then becomes the op the next one waits for. pdl: the kernel may
// start before the previous kernel on the stream ends (it waits for it with griddepcontrol.wait).
int launch(Comm* c, bool eager, const void* kernel, void* params, int blocks, int threads, cudaStream_t stream,
           bool pdl) {
  if (eager) {
    if (int rc = wait_for_previous(c, stream)) return rc;
  } else {
    c->captured = true;
  }
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = pdl ? 1 : 0;
  void* args[] = {params};
  CUDA_TRY(cudaLaunchKernelExC(&config, kernel, args));
  c->launches++;  // the tag barrier_params gave this launch is taken
  if (!eager) return 0;
  CUDA_TRY(cudaEventRecord(c->last_event, stream));
  c->last_stream = stream;
  c->launched = true;
  return 0;
}

// A call on a stream that is not capturing is eager: it is ordered after the communicator's previous
// eager op. A capture records no ordering event (the graph's own edges order it).
int is_eager(cudaStream_t stream, bool* eager) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CUDA_TRY(cudaStreamIsCapturing(stream, &status));
  *eager = status == cudaStreamCaptureStatusNone;
  return 0;
}

// Whether a push kernel's message of nbytes fits the receive region's epoch.
int check_push_room(const Comm* c, bool one_shot, uint64_t nbytes) {
  if (push_epoch_packs_needed(one_shot, static_cast<int64_t>(nbytes / 16), c->ranks) > c->epoch_packs) {
    return fail(GRAPHAR_EINVAL, "%llu bytes exceed the push region (graphar_comm_push_limits)",
                static_cast<unsigned long long>(nbytes));
  }
  return 0;
}

int check_all_reduce(const Comm* c, const graphar_all_reduce_args& a) {
  if (!c->opened) return fail(GRAPHAR_EINVAL, "launch before the peers' buffers were opened");
  if (a.nbytes == 0 || a.nbytes % 16 != 0 || a.nbytes > c->max_bytes) {
    return fail(GRAPHAR_EINVAL, "%llu bytes: not a positive multiple of 16 up to %llu",
                static_cast<unsigned long long>(a.nbytes), static_cast<unsigned long long>(c->max_bytes));
  }
  if (a.input % 16 != 0 || a.output % 16 != 0) return fail(GRAPHAR_EINVAL, "input and output must be 16-byte aligned");
  const bool graph_slot = a.path == GRAPHAR_ZERO_COPY || a.path == GRAPHAR_STAGED;
  if (!graph_slot && a.path != GRAPHAR_EAGER && a.path != GRAPHAR_CAPTURED_COPY && a.path != GRAPHAR_EAGER_ONLY) {
    return fail(GRAPHAR_EINVAL, "unknown input path %d", a.path);
  }
  if (graph_slot && (a.slot < 1 || a.slot >= c->graph_slots)) {
    return fail(GRAPHAR_EINVAL, "graph slot %d out of [1, %d)", a.slot, c->graph_slots);
  }
  if (!is_push(a.algo)) return 0;
  if (graph_slot) return fail(GRAPHAR_EINVAL, "push kernels read their input in place: no graph slot");
  return check_push_room(c, a.algo == GRAPHAR_PUSH_ONE_SHOT, a.nbytes);
}

int launch_v1(Comm* c, const graphar_all_reduce_args& a, const void* kernel, bool eager, cudaStream_t stream) {
  const bool graph_slot = a.path == GRAPHAR_ZERO_COPY || a.path == GRAPHAR_STAGED;
  const int packs = static_cast<int>(a.nbytes / 16);
  Params p{};
  p.barrier = barrier_params(c, eager);
  p.data = c->slots + (graph_slot ? a.slot : 0);
  p.copy_in = graph_slot ? nullptr : reinterpret_cast<const void*>(a.input);
  p.out = reinterpret_cast<void*>(a.output);
  p.packs = packs;
  if (a.path == GRAPHAR_STAGED) {
    CUDA_TRY(cudaMemcpyAsync(c->buffer, reinterpret_cast<const void*>(a.input), a.nbytes, cudaMemcpyDeviceToDevice,
                             stream));
  }
  const int blocks = std::min(c->block_limit, (packs + kThreads - 1) / kThreads);
  return launch(c, eager, kernel, &p, blocks, kThreads, stream, false);
}

PushParams push_params(const Comm* c, bool eager, uint64_t input, uint64_t output, uint64_t nbytes) {
  PushParams p{};
  p.barrier = barrier_params(c, eager);
  p.regions = c->regions;
  p.in = reinterpret_cast<const void*>(input);
  p.out = reinterpret_cast<void*>(output);
  p.packs = static_cast<int>(nbytes / 16);
  p.epoch_packs = static_cast<int>(c->epoch_packs);
  return p;
}

int launch_push(Comm* c, const graphar_all_reduce_args& a, const void* kernel, bool eager, cudaStream_t stream) {
  PushParams p = push_params(c, eager, a.input, a.output, a.nbytes);
  const int blocks = std::min(c->block_limit, (p.packs + kPushThreads - 1) / kPushThreads);
  return launch(c, eager, kernel, &p, blocks, kPushThreads, stream, a.pdl != 0 && c->pdl);
}

// ---- the fused norm ------------------------------------------------------------------------------

// How push_one_shot_norm covers `rows` rows of row_packs packs with at most block_limit blocks
// (push_norm.cuh): as many rows as blocks or more, a block per row (every gridDim-th row); fewer, each
// row split between `split` blocks of slice_segments segments each, so that a few tokens spread over
// up to block_limit SMs. A split needs rows * split * segments scratch words (the partials each block
// hands its siblings), at most scratch_words: a split that needs more is cut down to fit. max_split > 0
// caps the split (1: a block per row). The threads cover the slice with at most kNormPacksPerThread
// packs each, in whole warps. Ranks may be split differently without their results differing: the
// kernel's mean square does not depend on the grid.
struct NormGrid {
  int blocks, threads, split, slice_segments;
};

NormGrid norm_grid(int64_t rows, int row_packs, int block_limit, uint64_t scratch_words, int max_split) {
  const int64_t segments = (row_packs + kNormSegmentPacks - 1) / kNormSegmentPacks;
  int64_t split = rows >= block_limit ? 1 : std::min<int64_t>(block_limit / rows, segments);
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
  return launch(c, eager, kernel, &p, grid_.blocks, grid_.threads, stream, a.pdl != 0 && c->pdl);
}

}  // namespace

extern "C" {

int graphar_comm_all_reduce(void* comm, const graphar_all_reduce_args* args) {
  Comm* c = as_comm(comm);
  const graphar_all_reduce_args& a = *args;
  const void* kernel = kernel_for(a.dtype, c->ranks, a.algo);
  if (kernel == nullptr) return fail(GRAPHAR_EINVAL, "no kernel for dtype %d, algorithm %d", a.dtype, a.algo);
  if (int rc = check_all_reduce(c, a)) return rc;
  auto stream = reinterpret_cast<cudaStream_t>(a.stream);
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  bool eager = false;  // the other paths are graph slots or known captures
  if (a.path == GRAPHAR_EAGER || a.path == GRAPHAR_EAGER_ONLY) {
    if (int rc = is_eager(stream, &eager)) return rc;
    if (!eager && a.path == GRAPHAR_EAGER_ONLY) return GRAPHAR_CAPTURING;
  }
  return is_push(a.algo) ? launch_push(c, a, kernel, eager, stream) : launch_v1(c, a, kernel, eager, stream);
}

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

int graphar_comm_exchange_lease(void* comm, int mode, uint64_t stream_handle, uint64_t* lease) {
  Comm* c = as_comm(comm);
  if (c->exchange_bytes == 0) return fail(GRAPHAR_EINVAL, "no exchange buffers are open");
  if (mode != GRAPHAR_EAGER && mode != GRAPHAR_CAPTURED_COPY) return fail(GRAPHAR_EINVAL, "unknown path %d", mode);
  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  BarrierParams p = barrier_params(c, mode == GRAPHAR_EAGER);
  *lease = p.tag;
  return launch(c, mode == GRAPHAR_EAGER, reinterpret_cast<const void*>(exchange_lease), &p, 1, 1,
                reinterpret_cast<cudaStream_t>(stream_handle), false);
}

int graphar_comm_all_to_all(void* comm, int mode, uint64_t output, uint64_t src_offset, uint64_t chunk_bytes,
                            uint64_t row_bytes, uint64_t dst_row_stride, uint64_t dst_chunk_stride, int flags,
                            int blocks, uint64_t lease, uint64_t stream_handle) {
  Comm* c = as_comm(comm);
  const GatherKernel kernel = gather_kernel_for(c->ranks);
  if (kernel == nullptr || c->exchange_bytes == 0) return fail(GRAPHAR_EINVAL, "no exchange buffers are open");
  if (mode != GRAPHAR_EAGER && mode != GRAPHAR_CAPTURED_COPY) return fail(GRAPHAR_EINVAL, "unknown path %d", mode);
  if (blocks < 1 || blocks > kMaxBlocks) return fail(GRAPHAR_EINVAL, "%d blocks out of [1, %d]", blocks, kMaxBlocks);
  if ((flags & ~(GRAPHAR_A2A_PUSHED | GRAPHAR_A2A_OWN_PLACED | GRAPHAR_A2A_LAST)) != 0) {
    return fail(GRAPHAR_EINVAL, "unknown flags %d", flags);
  }
  if (lease == 0 || lease > c->launches) return fail(GRAPHAR_EINVAL, "lease %llu was never taken", static_cast<unsigned long long>(lease));
  if (chunk_bytes == 0 || row_bytes == 0 || chunk_bytes % row_bytes != 0 || src_offset > c->exchange_bytes ||
      chunk_bytes > (c->exchange_bytes - src_offset) / c->ranks) {
    return fail(GRAPHAR_EINVAL, "%d chunks of %llu bytes in rows of %llu from offset %llu do not fit %llu bytes",
                c->ranks, static_cast<unsigned long long>(chunk_bytes), static_cast<unsigned long long>(row_bytes),
                static_cast<unsigned long long>(src_offset), static_cast<unsigned long long>(c->exchange_bytes));
  }
  if ((output | src_offset | row_bytes | dst_row_stride | dst_chunk_stride) % 16 != 0) {
    return fail(GRAPHAR_EINVAL, "output, offset, row size and strides must be multiples of 16 bytes");
  }
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  AllToAllParams p{};
  p.barrier = barrier_params(c, mode == GRAPHAR_EAGER);
  p.barrier.tag = lease;  // the exchange's copies count in beside its lease (exchange_lease)
  p.give_back = (flags & GRAPHAR_A2A_LAST) != 0;
  p.out = reinterpret_cast<void*>(output);
  const bool pushed = (flags & GRAPHAR_A2A_PUSHED) != 0;
  for (int r = 0; r < c->ranks; r++) {  // pushed: slot r of this rank's buffer; pulled: slot `rank` of rank r's
    const auto* buffer = static_cast<const char*>(c->exchange_ptrs[pushed ? c->rank : r]);
    p.chunks.ptrs[r] = buffer + src_offset + (pushed ? r : c->rank) * chunk_bytes;
  }
  p.skip = (flags & GRAPHAR_A2A_OWN_PLACED) != 0 ? c->rank : -1;
  p.place = {static_cast<int64_t>(chunk_bytes / 16), static_cast<int64_t>(row_bytes / 16),
             static_cast<int64_t>(dst_row_stride / 16), static_cast<int64_t>(dst_chunk_stride / 16)};
  const int64_t wanted = (p.place.chunk_packs + kPullThreads - 1) / kPullThreads;
  blocks = static_cast<int>(std::min<int64_t>(blocks, wanted));

  DeviceGuard g;
  if (int rc = g.enter(c->device)) return rc;
  return launch(c, mode == GRAPHAR_EAGER, reinterpret_cast<const void*>(kernel), &p, blocks, kPullThreads, stream,
                false);
}

}  // extern "C"
