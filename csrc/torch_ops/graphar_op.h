// graphar's op library, libgraphar_torch.so: the CUDA kernels in C++ of graphar::all_reduce and
// graphar::all_reduce_add_rms_norm (ops.cpp), the eager fast path. Built beside the CUDA library against
// torch's stable ABI, which the CUDA library stays free of; it calls the CUDA library through the
// function pointers each group's state carries. Python calls these functions with ctypes.
//
// Every function returns 0 on success, otherwise GRAPHAR_EINVAL with a message for
// graphar_op_last_error() (per thread).
#pragma once

#include <stdint.h>

#include "../graphar_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif
// The library is built with hidden visibility (graphar/_cuda.py): it exports what this header declares.
#pragma GCC visibility push(default)

// One group's communicator as the C++ kernels call it: the CUDA library's handle and the entry points
// they call through (the library decides, this library only converts tensors and dispatches).
typedef struct graphar_op_group {
  uint64_t comm;             // the CUDA library's communicator handle
  uint64_t plan;             // graphar_comm_plan
  uint64_t plan_norm;        // graphar_comm_plan_norm
  uint64_t all_reduce;       // graphar_comm_all_reduce
  uint64_t all_reduce_norm;  // graphar_comm_all_reduce_norm
  uint64_t last_error;       // graphar_last_error
  int32_t device;
  int32_t rank;
} graphar_op_group;

const char* graphar_op_last_error(void);
// Registers the C++ kernels for CUDA tensors (once per process; again: no-op). Both ops must be
// defined already, and graphar::_all_reduce_python and graphar::_all_reduce_add_rms_norm_python, which
// the kernels hand the calls they decline to (graphar/ops.py).
int graphar_op_install(void);
// Serves a group by name through its communicator from now on (once, at its set-up), replacing the
// previous one; group NULL withdraws it. Every call of the group goes to the Python kernel while none
// is served. Python withdraws it when the communicator closes or torch unregisters the name
// (graphar/allreduce/native_op.py).
int graphar_op_serve(const char* group_name, const graphar_op_group* group);
// How many calls the C++ kernel has served on the group since the process started.
uint64_t graphar_op_calls(const char* group_name);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif
