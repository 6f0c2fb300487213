// Host cost of the CUDA runtime calls one eager graphar all-reduce makes, each timed alone:
//   nvcc -O2 -std=c++17 -o /tmp/launch_costs tools/launch_costs.cu && /tmp/launch_costs
// (a diagnostic for the eager path's breakdown, not part of the library).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <functional>

__global__ void empty_kernel(int4 params) {
  if (params.x == -1) asm volatile("trap;");
}

static double per_call_us(const char* what, const std::function<void()>& fn) {
  constexpr int kCalls = 400, kLoops = 25;
  double best = 1e30;
  for (int loop = 0; loop < kLoops; loop++) {
    cudaDeviceSynchronize();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; i++) fn();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
    best = us / kCalls < best ? us / kCalls : best;
  }
  cudaDeviceSynchronize();
  std::printf("%8.3f us  %s\n", best, what);
  return best;
}

int main() {
  cudaStream_t s, other;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking);
  cudaEvent_t ev;
  cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  int4 p{1, 2, 3, 4};
  void* args[] = {&p};
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(4);
  config.blockDim = dim3(256);
  config.stream = s;
  config.attrs = &attr;
  std::printf("best of 25 loops of 400 calls\n");
  per_call_us("cudaGetDevice", [] { int d; cudaGetDevice(&d); });
  per_call_us("cudaStreamIsCapturing", [&] { cudaStreamCaptureStatus st; cudaStreamIsCapturing(s, &st); });
  per_call_us("cudaEventRecord (timing disabled)", [&] { cudaEventRecord(ev, s); });
  per_call_us("cudaStreamWaitEvent", [&] { cudaStreamWaitEvent(other, ev, 0); });
  per_call_us("kernel<<<4, 256>>> (16-byte parameters)", [&] { empty_kernel<<<4, 256, 0, s>>>(p); });
  config.numAttrs = 0;
  per_call_us("cudaLaunchKernelExC, no attributes", [&] { cudaLaunchKernelExC(&config, (const void*)empty_kernel, args); });
  config.numAttrs = 1;
  per_call_us("cudaLaunchKernelExC, PDL attribute", [&] { cudaLaunchKernelExC(&config, (const void*)empty_kernel, args); });
  per_call_us("cudaGetLastError", [] { cudaGetLastError(); });
  return 0;
}
