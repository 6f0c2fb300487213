// The host side every entry point shares (defined in graphar_cuda.cu): the per-thread error message
// behind graphar_last_error, fail() and CUDA_TRY that leave it, and the guard that runs an entry
// point on its communicator's device.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace graphar {

// The calling thread's last error message: what graphar_last_error returns.
extern thread_local std::string t_last_error;

// Leaves the printf-formatted message for graphar_last_error and returns code.
int fail(int code, const char* fmt, ...);
// fail() with the CUDA error e of the call `what`; clears a non-sticky error first.
int cuda_fail(cudaError_t e, const char* what);

#define CUDA_TRY(call)                                             \
  do {                                                             \
    const cudaError_t e_ = (call);                                 \
    if (e_ != cudaSuccess) return ::graphar::cuda_fail(e_, #call); \
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

}  // namespace graphar
