// The library's own entry points, that need no communicator: the per-thread error message (fail()
// and cuda_fail() leave it, graphar_last_error reads it), the build id, the PCI bus id, pointer and
// IPC queries.
#include <cuda.h>  // driver types only: the driver entry point is resolved at run time, no -lcuda
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "graphar_cuda.h"
#include "host.h"

using namespace graphar;

namespace graphar {

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

}  // namespace graphar

// -DGRAPHAR_BUILD_ID=<hash of the sources>, set by graphar/_cuda.py
#define GRAPHAR_STRINGIFY_(...) #__VA_ARGS__  // variadic: GRAPHAR_TARGETS holds commas
#define GRAPHAR_STRINGIFY(x) GRAPHAR_STRINGIFY_(x)
#ifdef GRAPHAR_BUILD_ID
#define GRAPHAR_BUILD_ID_STRING GRAPHAR_STRINGIFY(GRAPHAR_BUILD_ID)
#else
#define GRAPHAR_BUILD_ID_STRING "unversioned"
#endif
// -DGRAPHAR_TARGETS=sm_80,sm_90a,compute_80 (say): what the build compiled in, set by graphar/_cuda.py, so
// that a user without the CUDA toolkit (no cuobjdump) can still be told whether it covers their GPU.
#ifdef GRAPHAR_TARGETS
#define GRAPHAR_TARGETS_STRING GRAPHAR_STRINGIFY(GRAPHAR_TARGETS)
#else
#define GRAPHAR_TARGETS_STRING ""
#endif

namespace {

using GetAttributes = CUresult (*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);

int pointer_info(uint64_t ptr, uint64_t* base, uint64_t* size, int* ipc_capable) {
  static GetAttributes get_attributes = nullptr;
  if (get_attributes == nullptr) {
    cudaDriverEntryPointQueryResult found;
    void* fn = nullptr;
    CUDA_TRY(cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &fn, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
      return fail(GRAPHAR_EINVAL, "the CUDA driver has no cuPointerGetAttributes");
    }
    get_attributes = reinterpret_cast<GetAttributes>(fn);
  }
  CUdeviceptr start = 0;
  size_t range = 0;
  unsigned int capable = 0;  // the driver writes a boolean; a zeroed int reads it either way
  CUpointer_attribute attrs[3] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                  CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE};
  void* data[3] = {&start, &range, &capable};
  const CUresult r = get_attributes(3, attrs, data, static_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) {
    return fail(static_cast<int>(r), "cuPointerGetAttributes(0x%llx) failed with CUresult %d",
                static_cast<unsigned long long>(ptr), static_cast<int>(r));
  }
  *base = start;
  *size = range;
  *ipc_capable = capable != 0;
  return 0;
}

}  // namespace

extern "C" {

const char* graphar_last_error(void) { return t_last_error.c_str(); }

const char* graphar_build_id(void) { return GRAPHAR_BUILD_ID_STRING; }

const char* graphar_targets(void) { return GRAPHAR_TARGETS_STRING; }

int graphar_device_pci_bus_id(int device, char* out, int len) {
  CUDA_TRY(cudaDeviceGetPCIBusId(out, len, device));
  return 0;
}

int graphar_pointer_info(uint64_t ptr, uint64_t* base, uint64_t* size, int* ipc_capable) {
  // Called during capture: a query enqueues nothing, so relax the capture mode around it rather
  // than let a strict mode count it as an unsafe call and invalidate the capture.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  CUDA_TRY(cudaThreadExchangeStreamCaptureMode(&mode));
  const int rc = pointer_info(ptr, base, size, ipc_capable);
  CUDA_TRY(cudaThreadExchangeStreamCaptureMode(&mode));
  return rc;
}

int graphar_ipc_handle(uint64_t base, void* handle_out) {
  cudaIpcMemHandle_t h;
  CUDA_TRY(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)));
  memcpy(handle_out, &h, sizeof(h));
  return 0;
}

}  // extern "C"
