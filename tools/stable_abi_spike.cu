// The first step of issue "Ships like a CUDA library": can graphar's ops be registered with torch's
// dispatcher from an nvcc-built library through the LibTorch stable ABI, one build for every torch from
// 2.11 on? One op, graphar_spike::add_one_(Tensor(a!) x), takes a tensor, reads torch's current stream
// and launches a kernel on it, as graphar's all-reduce must.
//
// What the stable ABI gives and lacks here, targeting 2.11 (TORCH_TARGET_VERSION):
// - registration (STABLE_TORCH_LIBRARY, _IMPL, TORCH_BOX), the tensor's device, dtype, layout and data
//   pointer: all of it;
// - the current CUDA stream: only through the AOTI shim's aoti_torch_get_current_cuda_stream, declared
//   under USE_CUDA and exported by libtorch_cuda, so the library loads only into torch's CUDA builds
//   (graphar's kernels need one anyway); the device-generic Stream::native_handle needs 2.13.
//
// Build (tools/gpu_session.sh stage stable-spike; tests/test_tools.py builds it too, with the
// installed torch's headers):
//   nvcc -O2 -std=c++17 -shared -Xcompiler -fPIC -DUSE_CUDA -DTORCH_TARGET_VERSION=0x020b000000000000 \
//     -I$TORCH/include -o /tmp/stable_abi_spike.so tools/stable_abi_spike.cu -L$TORCH/lib -ltorch_cpu
// then torch.ops.load_library("/tmp/stable_abi_spike.so"); torch.ops.graphar_spike.add_one_(x).
#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

namespace {

__global__ void add_one(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] += 1.0f;
}

void add_one_(torch::stable::Tensor x) {
  STD_TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::headeronly::ScalarType::Float && x.is_contiguous(),
                  "add_one_ takes a contiguous float32 CUDA tensor");
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(x.get_device_index(), &stream));
  add_one<<<64, 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<float*>(x.data_ptr()), x.numel());
  const cudaError_t e = cudaGetLastError();
  STD_TORCH_CHECK(e == cudaSuccess, "add_one_: ", cudaGetErrorString(e));
}

}  // namespace

STABLE_TORCH_LIBRARY(graphar_spike, m) { m.def("add_one_(Tensor(a!) x) -> ()"); }

STABLE_TORCH_LIBRARY_IMPL(graphar_spike, CUDA, m) { m.impl("add_one_", TORCH_BOX(&add_one_)); }
