// graphar's custom all-reduce kernels: the v1 design (a per-block spin barrier over CUDA IPC, then
// a pull-style one-stage reduce or a reduce-scatter + all-gather two-stage reduce).
//
// Each rank owns one IPC allocation laid out as [Signal | tmp buffer] and one registered input
// buffer. A call reads the ws input pointers of its RankData slot: the registered buffers for
// eager calls, the caller's tensors (pointers filled in after capture) inside graphar.graph.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace graphar {

constexpr int kMaxRanks = 8;
// Signal slots per rank; a launch never uses more blocks than this.
constexpr int kMaxBlocks = 64;
constexpr int kThreads = 512;

using Flag = uint32_t;

struct Signal {
  // Barrier count of (block, lane); only its own rank touches it, so a plain increment suffices.
  alignas(128) Flag self_counter[kMaxBlocks][kMaxRanks];
  // [phase][block][peer]: peer stores its count here over NVLink, this rank polls it locally.
  // Two phases because a peer may store its count for barrier k+1 while this rank still polls
  // for barrier k; it gets no further, as passing k+1 needs this rank's arrival there.
  alignas(128) Flag peer_counter[2][kMaxBlocks][kMaxRanks];
};

struct __align__(16) RankData {
  const void* ptrs[kMaxRanks];
};

struct __align__(16) RankSignals {
  Signal* signals[kMaxRanks];
};

// Where a spin loop gave up; written by the kernel into host-mapped memory.
enum Where : uint32_t {
  kOneStageEntry = 1,
  kOneStageExit = 2,
  kTwoStageEntry = 3,
  kTwoStageMid = 4,
  kAllToAllEntry = 5,
  kAllToAllExit = 6,
};

struct ErrorRecord {
  volatile uint32_t failed;
  volatile uint32_t where;
  volatile uint32_t peer;
  volatile uint32_t block;
};

struct Params {
  const RankData* data;  // the ws input pointers of this call
  RankSignals signals;
  Signal* self;
  const void* copy_in;   // non-null: first copy this rank's input into data->ptrs[rank] (eager path)
  void* out;
  ErrorRecord* error;
  uint64_t timeout_ns;   // 0: spin without bound
  int rank;
  int packs;             // message size in 16-byte packs
};

template <typename P>
__device__ __forceinline__ P* tmp_buffer(Signal* sg) {
  return reinterpret_cast<P*>(sg + 1);
}

// ---- flag accesses -------------------------------------------------------------------------

__device__ __forceinline__ void st_flag_volatile(Flag* addr, Flag v) {
  asm volatile("st.volatile.global.u32 [%1], %0;" ::"r"(v), "l"(addr) : "memory");
}
__device__ __forceinline__ Flag ld_flag_volatile(Flag* addr) {
  Flag v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_flag_release(Flag* addr, Flag v) {
  asm volatile("st.release.sys.global.u32 [%1], %0;" ::"r"(v), "l"(addr) : "memory");
}
__device__ __forceinline__ Flag ld_flag_acquire(Flag* addr) {
  Flag v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __noinline__ void record_timeout(ErrorRecord* e, Where where, int peer) {
  if (e->failed) return;
  e->where = where;
  e->peer = peer;
  e->block = blockIdx.x;
  __threadfence_system();  // the details become visible before the flag the host polls
  e->failed = 1;
}

// Spins until *flag == val; false once timeout_ns has passed (0: never). Equality, not >=,
// because the counter wraps; the stale value in a slot is always val - 2, never val.
template <bool kAcquire>
__device__ __forceinline__ bool wait_flag(Flag* flag, Flag val, const Params& p, Where where, int peer) {
  uint64_t start = 0;
  while ((kAcquire ? ld_flag_acquire(flag) : ld_flag_volatile(flag)) != val) {
    if (p.timeout_ns == 0) continue;
    const uint64_t now = global_timer_ns();
    if (start == 0) {
      start = now;
    } else if (now - start > p.timeout_ns) {
      record_timeout(p.error, where, peer);
      return false;
    }
  }
  return true;
}

// signals.signals[i] without a runtime index into the kernel parameters, which would copy them
// to local memory in every thread.
template <int kRanks>
__device__ __forceinline__ Signal* select(const RankSignals& signals, int i) {
  Signal* s = signals.signals[0];
#pragma unroll
  for (int r = 1; r < kRanks; r++) s = i == r ? signals.signals[r] : s;
  return s;
}

// ---- barrier -------------------------------------------------------------------------------
//
// Block b of every rank meets block b of every other rank; lane i of the block handles the
// edge to rank i. Returns false (in every thread of the block) when a peer never arrived.
enum class Form {
  // Entry, when the data was written before this kernel: kernel completion already made it
  // visible, so the flag is only an arrival count (volatile), and no work precedes it.
  kStart,
  // Data this kernel just wrote (2stage tmp, fused copy-in) is read by peers after the barrier:
  // block sync gathers the block's writes, st.release.sys / ld.acquire.sys carry them across
  // GPUs, and the trailing block sync hands the acquired view to every thread.
  kFenced,
  // 1stage exit: the peers' reads of our input must end before a later copy or kernel may
  // overwrite it; only arrival matters (volatile), and nothing follows in the kernel.
  kEnd,
};

template <int kRanks, Form kForm>
__device__ __forceinline__ bool multi_gpu_barrier(const Params& p, Where where) {
  if constexpr (kForm != Form::kStart) __syncthreads();
  bool timed_out = false;
  if (threadIdx.x < kRanks) {
    const int peer = threadIdx.x;
    const Flag val = p.self->self_counter[blockIdx.x][peer] + 1;
    p.self->self_counter[blockIdx.x][peer] = val;
    Flag* theirs = &select<kRanks>(p.signals, peer)->peer_counter[val & 1][blockIdx.x][p.rank];
    Flag* mine = &p.self->peer_counter[val & 1][blockIdx.x][peer];
    if constexpr (kForm == Form::kFenced) {
      st_flag_release(theirs, val);
      timed_out = !wait_flag<true>(mine, val, p, where, peer);
    } else {
      st_flag_volatile(theirs, val);
      timed_out = !wait_flag<false>(mine, val, p, where, peer);
    }
  }
  if constexpr (kForm == Form::kEnd) {
    return !timed_out;
  } else {
    return !__syncthreads_or(timed_out);  // tells the whole block whether to go on
  }
}

// ---- 16-byte packs, fp32 accumulation ------------------------------------------------------

template <typename T>
struct Pack {
  static constexpr int kLanes = 16 / sizeof(T);
  float v[kLanes];
};

// The 2-lane vector of a 16-bit float type and its conversions from and to a float pair.
template <typename T>
struct Vec2;
template <>
struct Vec2<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 widen(type h) { return __half22float2(h); }
  static __device__ __forceinline__ type narrow(float a, float b) { return __floats2half2_rn(a, b); }
};
template <>
struct Vec2<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 widen(type h) { return __bfloat1622float2(h); }
  static __device__ __forceinline__ type narrow(float a, float b) { return __floats2bfloat162_rn(a, b); }
};

// 16-bit floats: a pack is four 2-lane vectors.
template <typename T>
__device__ __forceinline__ Pack<T> unpack(const uint4& u) {
  const auto* h = reinterpret_cast<const typename Vec2<T>::type*>(&u);
  Pack<T> a;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 f = Vec2<T>::widen(h[i]);
    a.v[2 * i] = f.x;
    a.v[2 * i + 1] = f.y;
  }
  return a;
}
template <typename T>
__device__ __forceinline__ uint4 repack(const Pack<T>& a) {
  uint4 u;
  auto* h = reinterpret_cast<typename Vec2<T>::type*>(&u);
#pragma unroll
  for (int i = 0; i < 4; i++) h[i] = Vec2<T>::narrow(a.v[2 * i], a.v[2 * i + 1]);
  return u;
}

template <>
__device__ __forceinline__ Pack<float> unpack<float>(const uint4& u) {
  return {{__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z), __uint_as_float(u.w)}};
}
template <>
__device__ __forceinline__ uint4 repack<float>(const Pack<float>& a) {
  return make_uint4(__float_as_uint(a.v[0]), __float_as_uint(a.v[1]), __float_as_uint(a.v[2]),
                    __float_as_uint(a.v[3]));
}

// Sum of src[0..kRanks)[idx] in that order: every rank that sums the same list gets the same bits.
template <typename T, int kRanks>
__device__ __forceinline__ uint4 reduce_in_order(const uint4* const (&src)[kRanks], int idx) {
  uint4 loaded[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; r++) loaded[r] = src[r][idx];  // all loads in flight at once
  Pack<T> acc = unpack<T>(loaded[0]);
#pragma unroll
  for (int r = 1; r < kRanks; r++) {
    const Pack<T> x = unpack<T>(loaded[r]);
#pragma unroll
    for (int j = 0; j < Pack<T>::kLanes; j++) acc.v[j] += x.v[j];
  }
  return repack<T>(acc);
}

// ---- kernels -------------------------------------------------------------------------------

// Every rank pulls every rank's input and sums in rank order 0..ws-1.
template <typename T, int kRanks>
__global__ void __launch_bounds__(kThreads, 1) one_stage(Params p) {
  const RankData dp = *p.data;  // in a graph this slot holds the pointers filled in after capture
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int stride = gridDim.x * blockDim.x;
  bool ok;
  if (p.copy_in != nullptr) {
    // Same idx -> block mapping as the reduce loop: block b's barrier covers what block b copied.
    const uint4* in = static_cast<const uint4*>(p.copy_in);
    uint4* mine = static_cast<uint4*>(const_cast<void*>(p.data->ptrs[p.rank]));
    for (int idx = tid; idx < p.packs; idx += stride) mine[idx] = in[idx];
    ok = multi_gpu_barrier<kRanks, Form::kFenced>(p, kOneStageEntry);
  } else {
    ok = multi_gpu_barrier<kRanks, Form::kStart>(p, kOneStageEntry);
  }
  if (!ok) return;
  const uint4* src[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; r++) src[r] = static_cast<const uint4*>(dp.ptrs[r]);
  uint4* out = static_cast<uint4*>(p.out);
  for (int idx = tid; idx < p.packs; idx += stride) out[idx] = reduce_in_order<T, kRanks>(src, idx);
  multi_gpu_barrier<kRanks, Form::kEnd>(p, kOneStageExit);
}

// Reduce-scatter into the tmp buffers (rank r owns shard r, the last shard takes the remainder),
// then all-gather from them. No exit barrier: the inputs' last readers passed the mid barrier,
// and the next call writes tmp only after its own entry barrier.
template <typename T, int kRanks>
__global__ void __launch_bounds__(kThreads, 1) two_stage(Params p) {
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int stride = gridDim.x * blockDim.x;
  const int part = p.packs / kRanks;
  const int largest = part + p.packs % kRanks;
  const int start = p.rank * part;
  const int end = p.rank == kRanks - 1 ? p.packs : start + part;
  // Rotated so that the ranks start on different peers; shard r is summed only by rank r in
  // this order, so every rank gathers the same bits.
  const uint4* src[kRanks];
  const uint4* tmps[kRanks];
#pragma unroll
  for (int i = 0; i < kRanks; i++) {
    const int target = (p.rank + i) % kRanks;
    src[i] = static_cast<const uint4*>(p.data->ptrs[target]);  // in a graph: filled after capture
    tmps[i] = tmp_buffer<uint4>(select<kRanks>(p.signals, target));
  }
  uint4* tmp_out = tmp_buffer<uint4>(p.self);
  bool ok;
  if (p.copy_in != nullptr) {
    // Shard s, offset i is copied by thread i mod stride, the thread that reduces it on rank s.
    const uint4* in = static_cast<const uint4*>(p.copy_in);
    uint4* mine = const_cast<uint4*>(src[0]);
    for (int idx = tid; idx < largest; idx += stride) {
#pragma unroll
      for (int s = 0; s < kRanks; s++) {
        if (s == kRanks - 1 || idx < part) mine[s * part + idx] = in[s * part + idx];
      }
    }
    ok = multi_gpu_barrier<kRanks, Form::kFenced>(p, kTwoStageEntry);
  } else {
    ok = multi_gpu_barrier<kRanks, Form::kStart>(p, kTwoStageEntry);
  }
  if (!ok) return;
  for (int idx = start + tid; idx < end; idx += stride) {
    tmp_out[idx - start] = reduce_in_order<T, kRanks>(src, idx);
  }
  if (!multi_gpu_barrier<kRanks, Form::kFenced>(p, kTwoStageMid)) return;
  // The same tid -> offset mapping as stage 1: the barrier only orders block b with block b.
  uint4* out = static_cast<uint4*>(p.out);
  for (int idx = tid; idx < largest; idx += stride) {
#pragma unroll
    for (int i = 0; i < kRanks; i++) {
      const int from = (p.rank + i) % kRanks;
      if (from == kRanks - 1 || idx < part) out[from * part + idx] = tmps[i][idx];
    }
  }
}

}  // namespace graphar
