// The push one-shot all-reduce fused with what follows it in a tensor-parallel transformer block: the
// residual add and RMSNorm. Each block pushes its packs, sums them as push_one_shot does (same slots,
// epochs and arrival test, push.cuh), adds the residual, reduces the row's mean square in fp32 and
// writes both the normalised row and the new residual.
//
// The grid (norm_grid.h). With at least as many rows as blocks, a block owns whole rows
// (every gridDim.x-th). With fewer, each row is split between `split` blocks: block b takes slice
// b % split (a run of whole segments, below) of row b / split, so that a long row is not left to a
// block with several packs a thread. The blocks of a split row hand each other their
// segments' partial sums through this rank's scratch words (below).
//
// The mean square's bits depend on the row's size alone, never on the grid: a row is cut into
// segments of kNormSegmentPacks packs; a pack's lanes are summed in order (sum_of_squares), a
// segment's packs by a butterfly over the 8 neighbouring lanes that hold them, and the row's
// segments as lane l of a warp sums segments l, l + 32, ... in order, then a butterfly over the 32
// lanes. Every block of a split row computes that same total from the same partials, every rank
// too (they sum the same bits: the all-reduce's sums agree bitwise), and a token's result does not
// change with how many tokens share the call.
//
// Rounding follows the unfused graph: the all-reduce's sum is rounded to T, the residual add is a T
// add (fp32, rounded), the norm is fp32 and the weight multiplies either the result cast to T (HF's
// LlamaRMSNorm: weight * normed.to(T)) or, with weight_first, the fp32 result before the cast
// (F.rms_norm). Only the mean square's summation order differs from PyTorch's.
//
// Scratch words (split rows only). Reader block b's copy of segment s of its row is word
// b * row_segments + s: 64 bits, the launch's tag (BarrierParams::tag, top bit set) above the
// partial's float bits, 0 when empty. Each word has one writer (the segment's block) and one reader,
// which resets it to 0 right after reading, so the next call, which starts after this one ended,
// finds every word empty; the tag tells a word of another launch (two kernels of the communicator
// on unordered streams) from this one's. A reader waits for its siblings' words until the group is
// marked failed (a block that gave up or lost the claim publishes nothing, and it, or the kernel
// before it, marked the group failed) or the time bound passes (recorded as a push receive of this
// rank itself). The words live in the tail of this rank's 2stage tmp buffer, which that kernel never
// reaches (norm_grid.h norm_scratch).
#pragma once

#include "push.cuh"

namespace graphar {

constexpr int kNormThreads = 512;
constexpr int kNormPacksPerThread = 8;  // rows of up to 4096 packs: hidden 32768 (16-bit) or 16384 (fp32)
constexpr uint64_t kNormMaxRowBytes = static_cast<uint64_t>(kNormThreads) * kNormPacksPerThread * 16;
// Packs of a segment: the unit of the mean square's tree and of a row's split between blocks.
constexpr int kNormSegmentPacks = 8;
// Packs of a split row's slice, about (norm_grid.h): a pack per thread, as push_one_shot.
constexpr int kNormSlicePacks = kPushThreads;
static_assert(kNormSlicePacks % kNormSegmentPacks == 0, "a slice is whole segments: never more slices than segments");
constexpr int kNormMaxSegments = kNormThreads * kNormPacksPerThread / kNormSegmentPacks;
constexpr uint32_t kPartialTagBit = 0x80000000u;

struct NormParams {
  PushParams push;        // in: x, out: the normalised rows; packs: the whole message
  const void* residual;   // null: no residual add
  const void* weight;     // null: no weight (one pack per 16 bytes of a row)
  void* residual_out;     // the sum plus the residual
  unsigned long long* partials;  // this rank's scratch words (split > 1 only)
  int row_packs;
  int split;           // blocks per row; above 1, gridDim.x == rows * split
  int slice_segments;  // segments per block of a split row (the last block's slice may be shorter)
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

// h * scale, times the weight w (with_weight) in the order the matched graph uses.
template <typename T>
__device__ __forceinline__ uint4 normalise(const uint4& h, float scale, const uint4& w, bool with_weight,
                                          bool weight_first) {
  Pack<T> n = unpack<T>(h);
#pragma unroll
  for (int j = 0; j < Pack<T>::kLanes; j++) n.v[j] *= scale;
  if (!with_weight) return repack<T>(n);
  const Pack<T> wt = unpack<T>(w);
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

// The sum of v over the 8 lanes that hold one segment, in every one of them (a butterfly: each lane
// adds the same two halves, so they agree bitwise). Every lane of the warp takes part.
__device__ __forceinline__ float segment_sum(float v) {
#pragma unroll
  for (int o = kNormSegmentPacks / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The row's sum of its n segment partials, in every lane of the warp: lane l sums segments l, l + 32,
// ... in order, then a butterfly over the lanes. Fixed by n alone.
__device__ __forceinline__ float row_sum(const float* partial, int n) {
  float v = 0.f;
  for (int s = threadIdx.x % 32; s < n; s += 32) v += partial[s];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ void prefetch_l1(const void* addr) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(addr));
}

// Scratch words: relaxed, system scope (volatile), as the slots; the tag and the value travel in one
// aligned 64-bit access, seen whole.
__device__ __forceinline__ void st_word(unsigned long long* addr, unsigned long long v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(addr), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long ld_word(const unsigned long long* addr) {
  unsigned long long v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
  return v;
}
__device__ __forceinline__ bool tagged(unsigned long long word, uint32_t tag) {
  return static_cast<uint32_t>(word >> 32) == tag;
}

// Reloads a sibling's scratch word until it holds this launch's partial (word: the first load), then
// empties it; false once the group failed or on timeout.
__device__ __forceinline__ bool await_partial(unsigned long long* addr, unsigned long long& word, uint32_t tag,
                                              const BarrierParams& bp) {
  Deadline deadline;
  while (!tagged(word, tag)) {
    if (group_failed(bp) || !deadline.keep_waiting(bp, kPushOneShot, bp.rank)) return false;
    word = ld_word(addr);
  }
  st_word(addr, 0ull);
  return true;
}

// Scratch loads in flight per thread while a block gathers its siblings' partials; weight loads while
// it writes a row. A thread keeps its first kKeptPacks packs of h (the sum plus the residual) in
// registers until the row's scale is known and stores the others as residual_out at once, to read them
// back: slices of a few packs per thread (every split row, rows up to hidden 8192 in 16 bits) keep
// everything, and the registers stay within __launch_bounds__'s 128 without spilling.
constexpr int kPartialBatch = 2;
constexpr int kWeightBatch = 2;
constexpr int kKeptPacks = 2;

template <typename T, int kRanks>
__global__ void __launch_bounds__(kNormThreads, 1) push_one_shot_norm(NormParams p) {
  const PushParams& q = p.push;
  const BarrierParams& bp = q.barrier;
  const uint4* in = static_cast<const uint4*>(q.in);
  uint4* out = static_cast<uint4*>(q.out);
  const uint4* residual = static_cast<const uint4*>(p.residual);
  const uint4* weight = static_cast<const uint4*>(p.weight);
  uint4* residual_out = static_cast<uint4*>(p.residual_out);
  const int rows = q.packs / p.row_packs;
  const int row_segments = (p.row_packs + kNormSegmentPacks - 1) / kNormSegmentPacks;
  // This block's rows (first_row, + row_step, ...) and its slice [begin, end) of each, in packs.
  const int first_row = blockIdx.x / p.split;
  const int row_step = gridDim.x / p.split;
  const int first_segment = static_cast<int>(blockIdx.x % p.split) * p.slice_segments;
  const int last_segment = min(row_segments, first_segment + p.slice_segments);
  const int begin = first_segment * kNormSegmentPacks;
  const int end = min(p.row_packs, last_segment * kNormSegmentPacks);
  const int lane = threadIdx.x % 32;

  pdl_enter();  // before any access: the previous kernel wrote the input, the epoch and the resets
  const int i0 = begin + threadIdx.x;
  bool refused;
  const uint32_t epoch = enter_epoch(bp, refused);
  // The thread's first pack of input and weight, and its residual's way into L1. Not before the claim:
  // loads issued ahead of its atomic made the kernel slower on one H200 (tools/norm_floor.cu), and
  // the acquire's L1 invalidation (CCTL.IVALL) may drop the prefetched line.
  uint4 in0{}, weight0{};
  if (i0 < end) {
    in0 = in[first_row * p.row_packs + i0];
    if (residual != nullptr) prefetch_l1(residual + first_row * p.row_packs + i0);
    if (weight != nullptr) weight0 = weight[i0];
  }
  uint4* region[kRanks];  // each rank's receive region at this epoch
  epoch_regions<kRanks>(q, epoch, region);
  uint4* mine = nth<kRanks>(region, bp.rank);

  const int peer = refused ? -1 : word_peer<kRanks>(bp);  // call words (push.cuh)
  if (!refused) {  // push every pack of the block's slices into every peer's slot, kBatch loads in flight
    send_call<kRanks>(bp, epoch, peer);
    constexpr int kBatch = PushBatch<kRanks>::value;
    for (int row = first_row; row < rows; row += row_step) {
      const int base = row * p.row_packs;
#pragma unroll 1
      for (int k0 = 0; k0 < kNormPacksPerThread; k0 += kBatch) {
        if (begin + k0 * static_cast<int>(blockDim.x) >= end) break;  // the block's slice is done
        uint4 v[kBatch];
#pragma unroll
        for (int k = k0; k < k0 + kBatch; k++) {
          const int i = i0 + k * blockDim.x;
          v[k - k0] = in0;
          if (i < end && (row != first_row || k > 0)) v[k - k0] = in[base + i];
        }
#pragma unroll
        for (int k = k0; k < k0 + kBatch; k++) {
          const int i = i0 + k * blockDim.x;
#pragma unroll
          for (int r = 0; r < kRanks; r++) {
            if (i < end && r != bp.rank) st_slot(region[r] + bp.rank * q.packs + base + i, sendable(v[k - k0]));
          }
        }
      }
    }
  }

  CallWatch w(bp, epoch, peer);

  // Segment partials of the row at hand, double-buffered: a warp may start the next row while
  // another still sums this one's (the block meets once per row).
  __shared__ float partials[2][kNormMaxSegments];
  const uint32_t tag = static_cast<uint32_t>(bp.tag) | kPartialTagBit;
  int failed_row = refused ? first_row : -1;  // the first row not written (every thread agrees)
  int parity = 0;
  for (int row = first_row; failed_row < 0 && row < rows; row += row_step, parity ^= 1) {
    float* partial = partials[parity];
    const int base = row * p.row_packs;
    uint4 h[kKeptPacks];
    bool bad = false;  // a receive of this thread timed out, or a sibling's partial never came
#pragma unroll
    for (int k = 0; k < kNormPacksPerThread; k++) {
      if (begin + k * static_cast<int>(blockDim.x) >= end) break;  // the block's slice is done
      const int i = i0 + k * blockDim.x;
      float squares = 0.f;
      if (i < end && !bad) {
        const int idx = base + i;
        // This rank's pack and the residual (both in L1 by now) loaded with the slots.
        const uint4 res = residual != nullptr ? residual[idx] : uint4{};
        uint4 got[kRanks];
#pragma unroll
        for (int r = 0; r < kRanks; r++) {
          got[r] = r == bp.rank ? sendable(in[idx]) : ld_slot(mine + r * q.packs + idx);
        }
#pragma unroll
        for (int r = 0; r < kRanks; r++) {
          if (r != bp.rank && !bad) bad = !await_slot(mine + r * q.packs + idx, got[r], bp, kPushOneShot, r, w);
        }
        if (!bad) {
#pragma unroll
          for (int r = 0; r < kRanks; r++) {
            if (r != bp.rank) reset_slot(mine + r * q.packs + idx);
          }
          const uint4 sum = sum_in_order<T, kRanks>(got);  // the all-reduce's output, rounded to T
          const uint4 hk = residual != nullptr ? add_packs<T>(sum, res) : sum;
          if (k < kKeptPacks) h[k] = hk;
          else residual_out[idx] = hk;
          squares = sum_of_squares<T>(hk);
        }
      }
      // The segment's lanes: lane m of the 8 holds its pack m. A segment with a lane that gave up is
      // not handed on (the block fails below; its siblings see the group failed).
      const float segment = segment_sum(squares);
      const unsigned gave_up = __ballot_sync(0xffffffffu, bad);
      const int first_pack = i - lane % kNormSegmentPacks;
      if (first_pack < end && ((gave_up >> (lane & ~(kNormSegmentPacks - 1))) & 0xFFu) == 0) {
        const int s = first_pack / kNormSegmentPacks;
        if (lane % kNormSegmentPacks == 0) partial[s] = segment;
        // A split row: lane m writes the copies of siblings m, m + 8, ... (blocks row * split + sibling).
        const unsigned long long word = (static_cast<unsigned long long>(tag) << 32) | __float_as_uint(segment);
        for (int sibling = lane % kNormSegmentPacks; p.split > 1 && sibling < p.split;
             sibling += kNormSegmentPacks) {
          const int reader = row * p.split + sibling;
          if (reader != static_cast<int>(blockIdx.x)) {
            st_word(p.partials + static_cast<int64_t>(reader) * row_segments + s, word);
          }
        }
      }
    }
    if (p.split > 1 && !bad) {  // the siblings' partials, kPartialBatch loads in flight
      unsigned long long* words = p.partials + static_cast<int64_t>(blockIdx.x) * row_segments;
      const int stride = blockDim.x;
      for (int s0 = threadIdx.x; s0 < row_segments && !bad; s0 += kPartialBatch * stride) {
        unsigned long long word[kPartialBatch];
#pragma unroll
        for (int b = 0; b < kPartialBatch; b++) {
          const int s = s0 + b * stride;
          const bool theirs = s < row_segments && (s < first_segment || s >= last_segment);
          word[b] = theirs ? ld_word(words + s) : 0ull;
        }
#pragma unroll
        for (int b = 0; b < kPartialBatch; b++) {
          const int s = s0 + b * stride;
          if (bad || s >= row_segments || (s >= first_segment && s < last_segment)) continue;
          bad = !await_partial(words + s, word[b], tag, bp);
          if (!bad) partial[s] = __uint_as_float(static_cast<uint32_t>(word[b]));
        }
      }
    }
    // The peers' data of this call, not another's, before the block's first row stands.
    if (row == first_row && !bad) bad = !w.check(bp, kPushOneShot);
    // Every thread reaches the block's barrier, given up or not; then all leave together.
    if (__syncthreads_or(bad)) {
      failed_row = row;
      break;
    }
    const float mean = row_sum(partial, row_segments) / static_cast<float>(p.row_packs * Pack<T>::kLanes);
    const float scale = rsqrtf(mean + p.eps);
#pragma unroll
    for (int k0 = 0; k0 < kNormPacksPerThread; k0 += kWeightBatch) {  // weight loads in flight together
      uint4 w[kWeightBatch];
#pragma unroll
      for (int k = k0; k < k0 + kWeightBatch; k++) {
        const int i = i0 + k * blockDim.x;
        w[k - k0] = weight0;
        if (k > 0 && i < end && weight != nullptr) w[k - k0] = weight[i];
      }
#pragma unroll
      for (int k = k0; k < k0 + kWeightBatch; k++) {
        const int i = i0 + k * blockDim.x;
        if (i >= end) continue;
        uint4 hk;
        if (k < kKeptPacks) {
          hk = h[k];
          residual_out[base + i] = hk;
        } else {
          hk = residual_out[base + i];
        }
        out[base + i] = normalise<T>(hk, scale, w[k - k0], weight != nullptr, p.weight_first != 0);
      }
    }
  }
  if (failed_row >= 0) {  // the block's slices from that row on, both outputs
    for (int row = failed_row; row < rows; row += row_step) {
      poison_packs(out + row * p.row_packs, i0, end, blockDim.x);
      poison_packs(residual_out + row * p.row_packs, i0, end, blockDim.x);
    }
  }
  release_block(bp);
}

}  // namespace graphar
