// The push one-shot all-reduce fused with what follows it in a tensor-parallel transformer block: the
// residual add and RMSNorm. Each block owns whole rows (the last dim): it pushes their packs, sums
// them as push_one_shot does (same slots, epochs and arrival test, push.cuh), adds the residual,
// reduces the row's mean square in fp32 and writes both the normalised row and the new residual.
//
// Rounding follows the unfused graph: the all-reduce's sum is rounded to T, the residual add is a T
// add (fp32, rounded), the norm is fp32 and the weight multiplies either the result cast to T (HF's
// LlamaRMSNorm: weight * normed.to(T)) or, with weight_first, the fp32 result before the cast
// (F.rms_norm). Only the mean square's summation order differs from PyTorch's.
#pragma once

#include "push.cuh"

namespace graphar {

constexpr int kNormThreads = 512;
constexpr int kNormPacksPerThread = 8;  // rows of up to 4096 packs: hidden 32768 (16-bit) or 16384 (fp32)
constexpr uint64_t kNormMaxRowBytes = static_cast<uint64_t>(kNormThreads) * kNormPacksPerThread * 16;

struct NormParams {
  PushParams push;        // in: x, out: the normalised rows; packs: the whole message
  const void* residual;   // null: no residual add
  const void* weight;     // null: no weight (one pack per 16 bytes of a row)
  void* residual_out;     // the sum plus the residual
  int row_packs;
  int weight_first;
  float eps;
};

// a + b per lane, rounded to T as a T add rounds.
template <typename T>
__device__ __forceinline__ uint4 add_packs(const uint4& a, const uint4& b) {
  Pack<T> x = unpack<T>(a);
  const Pack<T> y = unpack<T>(b);
#pragma unroll
  for (int j = 0; j < Pack<T>::kLanes; j++) x.v[j] += y.v[j];
  return repack<T>(x);
}

template <typename T>
__device__ __forceinline__ float sum_of_squares(const uint4& a) {
  const Pack<T> x = unpack<T>(a);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < Pack<T>::kLanes; j++) s += x.v[j] * x.v[j];
  return s;
}

// h * scale, times the weight in the order the matched graph uses.
template <typename T>
__device__ __forceinline__ uint4 normalise(const uint4& h, float scale, const uint4* w, bool weight_first) {
  Pack<T> n = unpack<T>(h);
#pragma unroll
  for (int j = 0; j < Pack<T>::kLanes; j++) n.v[j] *= scale;
  if (w == nullptr) return repack<T>(n);
  const Pack<T> wt = unpack<T>(*w);
  if (weight_first) {
#pragma unroll
    for (int j = 0; j < Pack<T>::kLanes; j++) n.v[j] *= wt.v[j];
    return repack<T>(n);
  }
  Pack<T> rounded = unpack<T>(repack<T>(n));  // normed.to(T), then a T multiply
#pragma unroll
  for (int j = 0; j < Pack<T>::kLanes; j++) rounded.v[j] *= wt.v[j];
  return repack<T>(rounded);
}

// The block's sum of v, in every thread; the order is fixed, so every rank gets the same bits.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kNormThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < blockDim.x / 32; w++) s += partial[w];
  __syncthreads();  // partial is reused by the next row
  return s;
}

template <typename T, int kRanks>
__global__ void __launch_bounds__(kNormThreads, 1) push_one_shot_norm(NormParams p) {
  const PushParams& q = p.push;
  const PushCall<kRanks> c(q);
  const BarrierParams& bp = q.barrier;
  uint4* mine = c.mine;
  const uint4* in = c.in;
  uint4* out = c.out;
  const uint4* residual = static_cast<const uint4*>(p.residual);
  const uint4* weight = static_cast<const uint4*>(p.weight);
  uint4* residual_out = static_cast<uint4*>(p.residual_out);
  const int rows = q.packs / p.row_packs;
  auto fail = [&](int from_row) {  // the block's rows from from_row on, both outputs
    for (int row = from_row; row < rows; row += gridDim.x) {
      poison_packs(out + row * p.row_packs, threadIdx.x, p.row_packs, blockDim.x);
      poison_packs(residual_out + row * p.row_packs, threadIdx.x, p.row_packs, blockDim.x);
    }
  };
  // The first row whose receive timed out (every thread of the block agrees), or -1.
  auto run = [&]() -> int {
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
      const int start = row * p.row_packs;
      push_packs<PushBatch<kRanks>::value>(in + start, p.row_packs, threadIdx.x, blockDim.x,
                                           [&](int i, const uint4& v) { send_one_shot(c, bp.rank, q.packs, start + i, v); });
    }
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
      uint4 h[kNormPacksPerThread];
      float squares = 0.f;
      bool timed_out = false;
#pragma unroll
      for (int k = 0; k < kNormPacksPerThread; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i >= p.row_packs || timed_out) continue;
        const int idx = row * p.row_packs + i;
        uint4 got[kRanks];
#pragma unroll
        for (int r = 0; r < kRanks; r++) got[r] = r == bp.rank ? sendable(in[idx]) : ld_slot(mine + r * q.packs + idx);
#pragma unroll
        for (int r = 0; r < kRanks; r++) {
          if (r != bp.rank && !timed_out) timed_out = !await_slot(mine + r * q.packs + idx, got[r], bp, kPushOneShot, r);
        }
        if (timed_out) continue;
#pragma unroll
        for (int r = 0; r < kRanks; r++) {
          if (r != bp.rank) reset_slot(mine + r * q.packs + idx);
        }
        const uint4 sum = sum_in_order<T, kRanks>(got);  // the all-reduce's output, rounded to T
        h[k] = residual != nullptr ? add_packs<T>(sum, residual[idx]) : sum;
        squares += sum_of_squares<T>(h[k]);
      }
      // Every thread reaches the block's barriers, timed out or not; then all leave together.
      if (__syncthreads_or(timed_out)) return row;
      const float mean = block_sum(squares) / static_cast<float>(p.row_packs * Pack<T>::kLanes);
      const float scale = rsqrtf(mean + p.eps);
#pragma unroll
      for (int k = 0; k < kNormPacksPerThread; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i >= p.row_packs) continue;
        const int idx = row * p.row_packs + i;
        residual_out[idx] = h[k];
        out[idx] = normalise<T>(h[k], scale, weight != nullptr ? weight + i : nullptr, p.weight_first != 0);
      }
    }
    return -1;
  };
  const int failed_row = c.failed ? static_cast<int>(blockIdx.x) : run();
  if (failed_row >= 0) fail(failed_row);
  c.finish(bp, failed_row < 0);
}

}  // namespace graphar
