// 16-byte packs of float32, float16 or bfloat16 and their sum in fp32, in rank order: the arithmetic
// every all-reduce kernel shares, so that every kernel rounds alike.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace graphar {

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

// Sum of packs[0..kRanks) in that order, in fp32: every rank that sums the same list gets the same bits.
template <typename T, int kRanks>
__device__ __forceinline__ uint4 sum_in_order(const uint4 (&packs)[kRanks]) {
  Pack<T> acc = unpack<T>(packs[0]);
#pragma unroll
  for (int r = 1; r < kRanks; r++) {
    const Pack<T> x = unpack<T>(packs[r]);
#pragma unroll
    for (int j = 0; j < Pack<T>::kLanes; j++) acc.v[j] += x.v[j];
  }
  return repack<T>(acc);
}

// Sum of src[0..kRanks)[idx] in that order.
template <typename T, int kRanks>
__device__ __forceinline__ uint4 reduce_in_order(const uint4* const (&src)[kRanks], int idx) {
  uint4 loaded[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; r++) loaded[r] = src[r][idx];  // all loads in flight at once
  return sum_in_order<T, kRanks>(loaded);
}

}  // namespace graphar
