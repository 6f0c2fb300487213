// Programmatic dependent launch (PDL), which every all-reduce kernel starts with (pdl_enter).
// Launched with programmatic stream serialization, a kernel may start while the kernel before it on
// the stream still runs, so its launch overlaps that kernel's end. griddepcontrol.wait holds every
// thread until that kernel has completed and its writes are visible (the input; the previous call's
// counts, epochs and resets; its count-out of Signal::running, so the claim finds it gone), and
// nothing is read or written before it. launch_dependents then lets the next kernel's launch start,
// to meet the same wait. Both are no-ops in a launch without the attribute, and compiled out below
// sm_90.
#pragma once

namespace graphar {

__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// A kernel's first step: wait for the kernel before it, then let the next one launch.
__device__ __forceinline__ void pdl_enter() {
  griddep_wait();
  griddep_launch_dependents();
}

}  // namespace graphar
