// What the one-GPU diagnostics in tools/ (norm_floor.cu, all_reduce_floor.cu) time with: a checked
// call, and a launch's time as the mean over a CUDA graph of kLaunches back-to-back launches, median of
// kReplays replays of that graph. Needs graphar/libgraphar_cuda.so linked (graphar_last_error).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../csrc/graphar_cuda.h"

#define CHECK(call)                                                                     \
  do {                                                                                  \
    const int rc_ = static_cast<int>(call);                                             \
    if (rc_ != 0) {                                                                     \
      std::fprintf(stderr, "%s failed (%d) at line %d: %s\n", #call, rc_, __LINE__,     \
                   rc_ > 0 ? cudaGetErrorString(static_cast<cudaError_t>(rc_)) : graphar_last_error()); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

constexpr int kLaunches = 50;
constexpr int kReplays = 9;

// us per launch of launch(i): i = 0 once outside the graph (warm-up), then 1..kLaunches captured.
// With `also`, a second stream that launch(i) launches on too, forked from s at the capture's start
// and joined to it at its end.
template <typename Launch>
double us_per_launch(cudaStream_t s, Launch launch, cudaStream_t also = nullptr) {
  launch(0);
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t fork, join;
  CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  if (also != nullptr) {
    CHECK(cudaEventRecord(fork, s));
    CHECK(cudaStreamWaitEvent(also, fork, 0));
  }
  for (int i = 0; i < kLaunches; i++) launch(i + 1);
  if (also != nullptr) {
    CHECK(cudaEventRecord(join, also));
    CHECK(cudaStreamWaitEvent(s, join, 0));
  }
  CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaGraphLaunch(exec, s));
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  std::vector<float> ms(kReplays);
  for (float& m : ms) {
    CHECK(cudaEventRecord(start, s));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(end, s));
    CHECK(cudaEventSynchronize(end));
    CHECK(cudaEventElapsedTime(&m, start, end));
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(end));
  CHECK(cudaEventDestroy(fork));
  CHECK(cudaEventDestroy(join));
  return ms[kReplays / 2] * 1000.0 / kLaunches;
}

// A stream to time on, after the report's first line: the GPU, how each figure was timed, and what
// the rows are (`rows`).
inline cudaStream_t open_report(const char* rows) {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s; us per launch, CUDA graph of %d launches, median of %d replays; %s\n\n", prop.name, kLaunches,
              kReplays, rows);
  return s;
}
