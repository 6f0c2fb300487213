// One owner for each CUDA resource a communicator holds (host code only). An Owned frees its resource
// when it goes, so every way out of an entry point (a create or an open that fails half-way
// included) frees what was made; release() frees it now and returns the CUDA error, for a teardown
// that reports; keep() gives it up to the process, for what a captured graph still reads.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "host.h"

namespace graphar {

template <typename T, auto Free>
class Owned {
 public:
  Owned() = default;
  Owned(Owned&& o) noexcept : p_(std::exchange(o.p_, T{})) {}
  Owned& operator=(Owned&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, T{});
    }
    return *this;
  }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() { release(); }

  T get() const { return p_; }
  // Takes p (from the call that made it); whatever was held is freed first.
  void adopt(T p) {
    release();
    p_ = p;
  }
  cudaError_t release() {
    const T p = std::exchange(p_, T{});
    return p ? Free(p) : cudaSuccess;
  }
  void keep() { p_ = T{}; }

 private:
  T p_{};
};

template <typename T>
using DeviceMemory = Owned<T*, cudaFree>;
template <typename T>
using PeerMapping = Owned<T*, cudaIpcCloseMemHandle>;  // a peer's allocation, mapped over CUDA IPC
template <typename T>
using PinnedMemory = Owned<T*, cudaFreeHost>;
using Event = Owned<cudaEvent_t, cudaEventDestroy>;

// cudaMalloc into owner.
template <typename T>
int device_alloc(DeviceMemory<T>& owner, size_t nbytes, const char* what) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, nbytes);
  if (e != cudaSuccess) return cuda_fail(e, what);
  owner.adopt(static_cast<T*>(p));
  return 0;
}

// Maps a peer's allocation, by its IPC handle, into owner.
template <typename T>
int open_peer(PeerMapping<T>& owner, const cudaIpcMemHandle_t& handle, const char* what) {
  void* p = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) return cuda_fail(e, what);
  owner.adopt(static_cast<T*>(p));
  return 0;
}

// The first failure of a teardown that goes on past failures (what graphar_last_error keeps).
struct FirstError {
  int rc = 0;
  void note(int r) {
    if (rc == 0) rc = r;
  }
  void note(cudaError_t e, const char* what) {
    if (e != cudaSuccess && rc == 0) rc = cuda_fail(e, what);
  }
};

}  // namespace graphar
