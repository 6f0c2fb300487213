// The push one-shot all-reduce fused with the residual add and RMSNorm (push_norm.cuh, instantiated
// here alone): the checks of a call and its launch on the grid of norm_grid.h.
#include <cuda_runtime.h>

#include <cstdint>

#include "comm.cuh"
#include "graphar_cuda.h"
#include "host.h"
#include "launch.cuh"
#include "norm_grid.h"
#include "push_norm.cuh"

using namespace graphar;

namespace {

const void* norm_kernel_for(int dtype, int ranks) {
  return by_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    return by_ranks(ranks, [](auto r) { return reinterpret_cast<const void*>(push_one_shot_norm<T, r.value>); });
  });
}

int launch_norm(Comm* c, const graphar_all_reduce_norm_args& a) {
  const void* kernel = norm_kernel_for(a.dtype, c->ranks);
  if (kernel == nullptr) return fail(GRAPHAR_EINVAL, "no fused kernel for dtype %d", a.dtype);
  if (!c->opened) return fail(GRAPHAR_EINVAL, "launch before the peers' buffers were opened");
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
  const NormScratch scratch = norm_scratch(c, p.push.barrier.self);
  const NormGrid grid = norm_grid(static_cast<int64_t>(a.nbytes / a.row_bytes), static_cast<int>(a.row_bytes / 16),
                                   c->block_limit, scratch.count, c->norm_max_split);
  p.residual = reinterpret_cast<const void*>(a.residual);
  p.weight = reinterpret_cast<const void*>(a.weight);
  p.residual_out = reinterpret_cast<void*>(a.residual_output);
  p.partials = scratch.words;
  p.row_packs = static_cast<int>(a.row_bytes / 16);
  p.split = grid.split;
  p.slice_segments = grid.slice_segments;
  p.weight_first = a.weight_first;
  p.eps = a.eps;
  return launch(c, eager, kernel, &p, grid.blocks, grid.threads, stream, c->kernels.pdl != 0);
}

}  // namespace

extern "C" {

int graphar_comm_all_reduce_norm(void* comm, const graphar_all_reduce_norm_args* args) {
  return launch_norm(as_comm(comm), *args);
}

}  // extern "C"
