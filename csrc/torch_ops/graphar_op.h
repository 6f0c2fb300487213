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

#define GRAPHAR_OP_MAX_ROWS 16

#ifdef __cplusplus
extern "C" {
#endif
// The library is built with hidden visibility (graphar/_cuda.py): it exports what this header declares.
#pragma GCC visibility push(default)

// What the C++ kernel needs of one group's communicator; the Python side fills it.
typedef struct graphar_op_group {
  uint64_t comm;        // the CUDA library's communicator handle
  uint64_t all_reduce;  // the CUDA library's graphar_comm_all_reduce
  uint64_t last_error;  // the CUDA library's graphar_last_error
  uint64_t failed;      // host address of the error record's `failed` word (nonzero after a timeout)
  uint64_t max_bytes;
  uint64_t all_reduce_norm;     // the CUDA library's graphar_comm_all_reduce_norm
  uint64_t fused_norm_max;      // the fused kernel's largest input (bytes; 0: off)
  uint64_t norm_max_row_bytes;  // the fused kernel's longest row
  // The eager kernel choice: a message of n bytes runs algos[i] for the first i with n <= bounds[i]
  // (rows ascending); algo 0, or no such row: the C++ kernel does not serve it.
  uint64_t bounds[GRAPHAR_OP_MAX_ROWS];
  int32_t algos[GRAPHAR_OP_MAX_ROWS];
  int32_t rows;
  int32_t device;
  int32_t rank;
  int32_t pdl;
} graphar_op_group;

const char* graphar_op_last_error(void);
// Registers the C++ kernels for CUDA tensors (once per process; again: no-op). Both ops must be
// defined already, and graphar::_all_reduce_python and graphar::_all_reduce_add_rms_norm_python, which
// the kernels hand the calls they decline to (graphar/ops.py).
int graphar_op_install(void);
// Publishes a group's state, replacing the previous one; group NULL withdraws it. Every call of the
// group goes to the Python kernel while none is published. Python publishes for a live group and
// withdraws the state when torch unregisters the name (graphar/native_op.py).
int graphar_op_publish(const char* group_name, const graphar_op_group* group);
// How many calls the C++ kernel has served on the group since the process started.
uint64_t graphar_op_calls(const char* group_name);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif
