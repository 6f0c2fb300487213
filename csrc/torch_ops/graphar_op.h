// graphar's op library: the CUDA kernels in C++ of graphar::all_reduce and
// graphar::all_reduce_add_rms_norm (all_reduce_op.cpp), the eager fast path. It includes torch's headers, so graphar/native_op.py builds it per torch version with
// the host compiler; the CUDA library stays torch-free. Python calls these functions with ctypes.
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
// defined already, each with its Python kernel for CompositeExplicitAutograd.
int graphar_op_install(void);
// Publishes a group's state for the process group `group_name` names now (c10d's registry),
// replacing the previous one; group NULL withdraws it. Every call of the group goes to the Python
// kernel while none is published, or once the name no longer names that process group.
int graphar_op_publish(const char* group_name, const graphar_op_group* group);
// How many calls the C++ kernel has served on the group since the process started.
uint64_t graphar_op_calls(const char* group_name);

#ifdef __cplusplus
}
#endif
