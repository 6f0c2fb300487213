// Host-side plumbing of the C ABI's entry points: the per-thread error message behind
// graphar_last_error, CUDA_TRY, and the guard that runs an entry point on its communicator's device.
#pragma once

#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>
#include <string>

namespace {

thread_local std::string t_last_error;

int fail(int code, const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  t_last_error = buf;
  return code;
}

int cuda_fail(cudaError_t e, const char* what) {
  cudaGetLastError();  // clear a non-sticky error so that it does not surface in a later check
  return fail(e, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

#define CUDA_TRY(call)                                 \
  do {                                                 \
    const cudaError_t e_ = (call);                     \
    if (e_ != cudaSuccess) return cuda_fail(e_, #call); \
  } while (0)

// Makes `device` current for the scope and restores the caller's device (torch's, usually).
class DeviceGuard {
 public:
  int enter(int device) {
    CUDA_TRY(cudaGetDevice(&prev_));
    if (prev_ != device) CUDA_TRY(cudaSetDevice(device));
    device_ = device;
    return 0;
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && prev_ != device_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
  int device_ = -1;
};

}  // namespace
