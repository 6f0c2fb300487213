// Whether a rank's GPU memory outlives its process for a peer that mapped it: the fact under the failure
// model's "a peer dies" row (docs/design.md). A process forks a child before either touches CUDA; the
// child allocates 1 MiB and shares it, either over legacy CUDA IPC (cudaIpcGetMemHandle, what graphar's
// buffers use) or as a virtual-memory allocation exported as a POSIX file descriptor (cuMemCreate, what
// NCCL and PyTorch's symmetric memory use), passed over a socket. The parent maps it, starts a kernel
// that stores into it for a second, tells the child to exit (without freeing anything), and then:
//   during  the kernel that stored while the child exited,
//   after   a kernel that stores into the mapping after the child is gone,
//   fresh   a new allocation and kernel: whether the parent's context still works.
// Each prints `ok` or the CUDA error. Run it alone and under MPS (tools/gpu_session.sh stage peer-exit):
// under MPS a fault in any client reaches every client of the GPU.
//
//   nvcc -O2 -std=c++17 -arch=sm_90a -o /tmp/peer_exit tools/peer_exit.cu && /tmp/peer_exit legacy|vmm
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr size_t kBytes = 2 << 20;  // the VMM granularity on the GPUs graphar targets

__global__ void store_for(uint32_t* p, size_t words, uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    for (size_t i = threadIdx.x; i < words; i += blockDim.x) p[i] = static_cast<uint32_t>(i);
    __threadfence_system();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    exit(2);
  }
}

void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "%s: CUresult %d\n", what, static_cast<int>(r));
    exit(2);
  }
}

template <typename F>
F driver(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  check(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found), name);
  if (fn == nullptr || found != cudaDriverEntryPointSuccess) {
    fprintf(stderr, "%s: not in this driver\n", name);
    exit(2);
  }
  return reinterpret_cast<F>(fn);
}

// One file descriptor over a socket (SCM_RIGHTS), or, with fd < 0, plain bytes.
void send_bytes(int sock, const void* data, size_t n, int fd = -1) {
  iovec io{const_cast<void*>(data), n};
  msghdr msg{};
  msg.msg_iov = &io;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  if (sendmsg(sock, &msg, 0) != static_cast<ssize_t>(n)) exit(3);
}

int recv_bytes(int sock, void* data, size_t n) {
  iovec io{data, n};
  msghdr msg{};
  msg.msg_iov = &io;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  if (recvmsg(sock, &msg, MSG_WAITALL) != static_cast<ssize_t>(n)) exit(3);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  int fd = -1;
  if (c != nullptr && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof(int));
  return fd;
}

CUmemAllocationProp vmm_prop() {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

void* vmm_map(CUmemGenericAllocationHandle h) {
  CUdeviceptr p = 0;
  check(driver<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve")(&p, kBytes, 0, 0, 0), "cuMemAddressReserve");
  check(driver<PFN_cuMemMap_v10020>("cuMemMap")(p, kBytes, 0, h, 0), "cuMemMap");
  CUmemAccessDesc access{};
  access.location = vmm_prop().location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(driver<PFN_cuMemSetAccess_v10020>("cuMemSetAccess")(p, kBytes, &access, 1), "cuMemSetAccess");
  return reinterpret_cast<void*>(p);
}

// The child: allocate, share, wait for the word, exit with everything still allocated.
[[noreturn]] void exporter(int sock, bool vmm) {
  check(cudaSetDevice(0), "cudaSetDevice");
  if (vmm) {
    CUmemGenericAllocationHandle h = 0;
    const CUmemAllocationProp prop = vmm_prop();
    check(driver<PFN_cuMemCreate_v10020>("cuMemCreate")(&h, kBytes, &prop, 0), "cuMemCreate");
    check(cudaMemset(vmm_map(h), 0, kBytes), "cudaMemset");
    int fd = -1;
    check(driver<PFN_cuMemExportToShareableHandle_v10020>("cuMemExportToShareableHandle")(
              &fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          "cuMemExportToShareableHandle");
    const char tag = 'v';
    send_bytes(sock, &tag, 1, fd);
  } else {
    void* p = nullptr;
    check(cudaMalloc(&p, kBytes), "cudaMalloc");
    check(cudaMemset(p, 0, kBytes), "cudaMemset");
    cudaIpcMemHandle_t h;
    check(cudaIpcGetMemHandle(&h, p), "cudaIpcGetMemHandle");
    send_bytes(sock, &h, sizeof(h));
  }
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  char go = 0;
  recv_bytes(sock, &go, 1);
  _exit(0);
}

void* importer_map(int sock, bool vmm) {
  if (vmm) {
    char tag = 0;
    const int fd = recv_bytes(sock, &tag, 1);
    CUmemGenericAllocationHandle h = 0;
    check(driver<PFN_cuMemImportFromShareableHandle_v10020>("cuMemImportFromShareableHandle")(
              &h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          "cuMemImportFromShareableHandle");
    close(fd);
    return vmm_map(h);
  }
  cudaIpcMemHandle_t h;
  recv_bytes(sock, &h, sizeof(h));
  void* p = nullptr;
  check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return p;
}

const char* verdict(cudaError_t e) { return e == cudaSuccess ? "ok" : cudaGetErrorString(e); }

}  // namespace

int main(int argc, char** argv) {
  const bool vmm = argc > 1 && strcmp(argv[1], "vmm") == 0;
  if (argc < 2 || (!vmm && strcmp(argv[1], "legacy") != 0)) {
    fprintf(stderr, "usage: %s legacy|vmm\n", argv[0]);
    return 1;
  }
  int socks[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, socks) != 0) return 3;
  const pid_t child = fork();
  if (child == 0) exporter(socks[1], vmm);
  check(cudaSetDevice(0), "cudaSetDevice");
  auto* mapped = static_cast<uint32_t*>(importer_map(socks[0], vmm));
  const size_t words = kBytes / sizeof(uint32_t);
  store_for<<<1, 256>>>(mapped, words, 0);
  check(cudaDeviceSynchronize(), "a store while the peer lives");

  store_for<<<1, 256>>>(mapped, words, 1000000000ull);
  const char go = 1;
  send_bytes(socks[0], &go, 1);
  int status = 0;
  waitpid(child, &status, 0);
  const cudaError_t during = cudaDeviceSynchronize();
  store_for<<<1, 256>>>(mapped, words, 0);
  cudaError_t after = cudaGetLastError();
  if (after == cudaSuccess) after = cudaDeviceSynchronize();
  void* fresh_p = nullptr;
  cudaError_t fresh = cudaMalloc(&fresh_p, kBytes);
  if (fresh == cudaSuccess) {
    store_for<<<1, 256>>>(static_cast<uint32_t*>(fresh_p), words, 0);
    fresh = cudaDeviceSynchronize();
  }
  printf("peer_exit %s: child exit %d; during: %s; after: %s; fresh: %s\n", vmm ? "vmm" : "legacy",
         WIFEXITED(status) ? WEXITSTATUS(status) : -1, verdict(during), verdict(after), verdict(fresh));
  return during == cudaSuccess && after == cudaSuccess && fresh == cudaSuccess ? 0 : 4;
}
