// graphar's CUDA library: a plain C ABI (no torch headers), loaded by graphar/_cuda.py with ctypes.
//
// Every function returns 0 on success, otherwise a CUDA error code or GRAPHAR_EINVAL, and leaves a
// message for graphar_last_error() (per thread); GRAPHAR_CAPTURING alone is a verdict, not an error.
// Nothing here exits the process.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
// The library is built with hidden visibility (graphar/_cuda.py): it exports what this header declares.
#pragma GCC visibility push(default)

#define GRAPHAR_EINVAL (-1)
// Not an error: a GRAPHAR_PLAN_EAGER_ONLY plan found its stream capturing.
#define GRAPHAR_CAPTURING (-2)
// Not an error: no kernel of the communicator takes the call (graphar_comm_plan, graphar_comm_plan_norm);
// graphar_last_error() says why. The caller runs the collective instead.
#define GRAPHAR_DECLINED (-3)
#define GRAPHAR_IPC_HANDLE_BYTES 64

// dtype codes of graphar_comm_all_reduce
enum { GRAPHAR_FLOAT32 = 0, GRAPHAR_FLOAT16 = 1, GRAPHAR_BFLOAT16 = 2 };
// algorithm codes: the v1 pull kernels (behind a barrier) and the barrier-free push kernels
enum { GRAPHAR_ONE_STAGE = 1, GRAPHAR_TWO_STAGE = 2, GRAPHAR_PUSH_ONE_SHOT = 3, GRAPHAR_PUSH_TWO_SHOT = 4 };
// input paths of graphar_comm_all_reduce (push kernels: GRAPHAR_EAGER or GRAPHAR_CAPTURED_COPY, both in place)
enum {
  GRAPHAR_EAGER = 0,          // v1: copy into the registered buffer inside the kernel. Outside a capture
                              // (the library asks the stream) calls are serialized across streams.
  GRAPHAR_CAPTURED_COPY = 1,  // the same, known to be inside someone else's CUDA-graph capture
  GRAPHAR_ZERO_COPY = 2,      // read the inputs through a graph slot filled in after capture
  GRAPHAR_STAGED = 3,         // the kernel copies into the registered buffer; peers read it through a graph slot
  GRAPHAR_UNCAPTURED = 4,     // GRAPHAR_EAGER on a stream a plan found not capturing: the stream is not asked again
};
// the capture modes of a kernel table (graphar_kernels)
enum { GRAPHAR_ROWS_EAGER = 0, GRAPHAR_ROWS_GRAPH = 1, GRAPHAR_ROWS_GRAPHAR_GRAPH = 2, GRAPHAR_ROW_MODES = 3 };
#define GRAPHAR_MAX_ROWS 32
// how graphar_comm_plan finds a call's capture mode
enum {
  GRAPHAR_PLAN_EAGER_ONLY = 0,     // the eager rows; a capturing stream: GRAPHAR_CAPTURING
  GRAPHAR_PLAN_STREAM = 1,         // the eager rows, or the graph rows where the stream is capturing
  GRAPHAR_PLAN_GRAPHAR_GRAPH = 2,  // the rows of a capture graphar owns (graphar.graph)
};
// flags of graphar_comm_all_to_all
enum {
  GRAPHAR_A2A_PUSHED = 1,      // rank i pushed its chunk j into rank j's buffer (else packed it into its own)
  GRAPHAR_A2A_OWN_PLACED = 2,  // this rank's pack already wrote its own chunk into the output: skip it
  GRAPHAR_A2A_LAST = 4,        // the exchange's last copy: it gives the exchange's lease back
};

const char* graphar_last_error(void);
// Hash of the sources this library was built from.
const char* graphar_build_id(void);
// The targets it was built for, comma-separated: sm_XX (machine code) and compute_XX (PTX); "" if unknown.
const char* graphar_targets(void);
int graphar_device_pci_bus_id(int device, char* out, int len);

// Range and legacy-IPC capability of the allocation holding ptr (expandable segments: not capable).
int graphar_pointer_info(uint64_t ptr, uint64_t* base, uint64_t* size, int* ipc_capable);
int graphar_ipc_handle(uint64_t base, void* handle_out);

// On the current device: zeroed Signal+tmp and input buffers of max_bytes, a push receive region
// (two epochs of about 2 x max_bytes, every word 0xFFFFFFFF), graph slots, and a host-mapped error record. Synchronizes before returning, so the handles may be shared at once.
int graphar_comm_create(int rank, int world_size, uint64_t max_bytes, int block_limit, uint64_t timeout_ns,
                        int graph_slots, void** comm_out);
// Two IPC handles: [Signal+tmp+push region, input buffer].
int graphar_comm_handles(void* comm, void* handles_out);
// world_size x two handles (as from graphar_comm_handles, rank order); the own entry is ignored.
int graphar_comm_open(void* comm, const void* handles);
// phase 0: store a pattern into every peer's memory; phase 1 (after every rank finished phase 0):
// load everything back. *bad_peer is the first peer whose pattern did not round-trip, or -1.
int graphar_comm_probe(void* comm, int phase, int* bad_peer);
// Host address of the error record {failed, where, peer, block, cause} (uint32 each).
int graphar_comm_error_record(void* comm, void** record_out);
// Device address of this rank's Signal::failed (uint32, nonzero once a kernel of the group gave up):
// code outside the library that writes what the kernels share (the exchanges' packs) reads it first.
int graphar_comm_failed_flag(void* comm, void** flag_out);
// The communicator's kernel choice and launch settings, which graphar_comm_set_kernels replaces (every
// rank sets equal ones): per capture mode, a call of n bytes runs algos[m][i] for the first i with
// n <= bounds[m][i] (rows ascending); algo 0, or no such row: no kernel, the collective serves.
typedef struct graphar_kernels {
  uint64_t bounds[GRAPHAR_ROW_MODES][GRAPHAR_MAX_ROWS];
  int32_t algos[GRAPHAR_ROW_MODES][GRAPHAR_MAX_ROWS];
  int32_t rows[GRAPHAR_ROW_MODES];
  int32_t pdl;              // launch with programmatic dependent launch (where the loaded code waits for it)
  uint64_t fused_norm_max;  // the fused norm's largest input in bytes; 0: off
} graphar_kernels;
int graphar_comm_set_kernels(void* comm, const graphar_kernels* kernels);
// A tensor as the plans judge it: the kernels read it as it is, or not at all.
typedef struct graphar_tensor {
  uint64_t data;  // address of its first element; 0: no tensor (an absent residual or weight)
  uint64_t nbytes;
  int32_t dtype;   // GRAPHAR_FLOAT32 ...; -1: another
  int32_t device;  // its CUDA device; -1: not on a GPU
  int32_t contiguous;
  int32_t reserved;
} graphar_tensor;
// The one place a call's kernel is chosen: the kernel (GRAPHAR_ONE_STAGE ...) of an all-reduce of x on
// stream in *algo_out, algo 0 the table's, else that kernel where it can take x; in *path_out the
// path to launch it on (GRAPHAR_UNCAPTURED, or GRAPHAR_CAPTURED_COPY inside a capture: a v1 kernel in
// graphar.graph's takes a graph slot instead), so the stream is asked once. GRAPHAR_DECLINED when none
// takes x, GRAPHAR_CAPTURING (GRAPHAR_PLAN_EAGER_ONLY), an error once the group timed out.
int graphar_comm_plan(void* comm, const graphar_tensor* x, uint64_t stream, int how, int algo, int32_t* algo_out,
                      int32_t* path_out);
// Whether the fused norm takes x in rows of row_bytes, with residual (x's size) and weight (one row):
// 0, GRAPHAR_DECLINED, or an error once the group timed out.
int graphar_comm_plan_norm(void* comm, const graphar_tensor* x, const graphar_tensor* residual,
                           const graphar_tensor* weight, uint64_t row_bytes);
// One all-reduce on the kernel a plan chose: its arguments in one struct, so that an eager call crosses
// into the library once.
typedef struct graphar_all_reduce_args {
  uint64_t input;   // device pointers, 16-byte aligned
  uint64_t output;
  uint64_t nbytes;  // a positive multiple of 16, up to max_bytes (push kernels: graphar_comm_push_limits)
  uint64_t stream;  // cudaStream_t
  int32_t dtype;    // GRAPHAR_FLOAT32 ...
  int32_t algo;     // GRAPHAR_ONE_STAGE ...
  int32_t path;     // GRAPHAR_EAGER ...
  int32_t slot;     // the graph slot of GRAPHAR_ZERO_COPY and GRAPHAR_STAGED
} graphar_all_reduce_args;
int graphar_comm_all_reduce(void* comm, const graphar_all_reduce_args* args);
// The push one-shot all-reduce of rows of row_bytes, then per row: h = sum + residual, and
// RMSNorm(h) * weight (weight_first: the weight multiplies before the cast back to dtype, as
// F.rms_norm; else after, as HF's LlamaRMSNorm). residual and weight may be 0 (none); every tensor
// has dtype, and weight one row. Writes output (the normalised rows) and residual_output (h).
typedef struct graphar_all_reduce_norm_args {
  uint64_t input;
  uint64_t residual;
  uint64_t weight;
  uint64_t output;
  uint64_t residual_output;
  uint64_t nbytes;     // a multiple of row_bytes, within the push one-shot's limit
  uint64_t row_bytes;  // a multiple of 16, at most kNormThreads * kNormPacksPerThread * 16 (push_norm.cuh)
  uint64_t stream;
  float eps;
  int32_t dtype;
  int32_t weight_first;
  int32_t reserved;
} graphar_all_reduce_norm_args;
int graphar_comm_all_reduce_norm(void* comm, const graphar_all_reduce_norm_args* args);
// The largest message of each push kernel (bytes).
int graphar_comm_push_limits(void* comm, uint64_t* one_shot, uint64_t* two_shot);
// Before an exchange's first pack: takes the exchange's lease on the communicator (a one-thread
// kernel on `stream`; eager, ordered after the previous eager op like every launch), so that no other
// kernel of the communicator runs between its packs and its last copy. *lease: the number its copies
// pass to graphar_comm_all_to_all; the copy with GRAPHAR_A2A_LAST gives it back.
int graphar_comm_exchange_lease(void* comm, int mode, uint64_t stream, uint64_t* lease);
// Collective (every rank, same nbytes): waits for the device, frees the exchange buffers (keep_old:
// retires them, for graphs captured with them) and allocates this rank's new one; its IPC handle
// goes to the peers, then graphar_comm_exchange_open with every rank's handle (rank order).
int graphar_comm_exchange_alloc(void* comm, uint64_t nbytes, int keep_old, uint64_t* ptr_out, void* handle_out);
// ptrs_out[r]: rank r's buffer as this process maps it (a pushing pack writes there).
int graphar_comm_exchange_open(void* comm, uint64_t nbytes, const void* handles, uint64_t* ptrs_out);
// All-to-all of chunks in the exchange buffers: chunk j of rank i goes to rank j, where chunk i
// arrives as rows of row_bytes, row k at output + i * dst_chunk_stride + k * dst_row_stride. Without
// GRAPHAR_A2A_PUSHED in flags, chunk j was packed at src_offset + j * chunk_bytes of rank i's own
// buffer (pulled over the link); with it, rank i pushed it to src_offset + i * chunk_bytes of rank
// j's buffer. blocks: at most this many (1..64). mode: GRAPHAR_EAGER or GRAPHAR_CAPTURED_COPY
// (inside any capture). lease: the exchange's (graphar_comm_exchange_lease).
int graphar_comm_all_to_all(void* comm, int mode, uint64_t output, uint64_t src_offset, uint64_t chunk_bytes,
                            uint64_t row_bytes, uint64_t dst_row_stride, uint64_t dst_chunk_stride, int flags,
                            int blocks, uint64_t lease, uint64_t stream);
// Fill slots[0..count) after a capture (each in [1, graph_slots); a slot of a destroyed graph may be
// filled again: the device is synchronized first, and unused mappings closed). Per call i and rank r (index i*ws+r):
// a 64-byte IPC handle of the allocation base, the offset into it, and whether the rank staged the
// call through its registered buffer; own_ptrs[i] is this rank's own input of call i.
int graphar_comm_register_graph(void* comm, const int32_t* slots, int count, const void* handles,
                                const uint64_t* offsets, const uint8_t* staged, const uint64_t* own_ptrs);
// The graph owning these slots is gone: the peers' allocations they read are mapped for no other slot
// become unused. No CUDA call (safe from a finalizer, during a capture): they are closed at the next
// idle point: graphar_comm_close_unused_mappings, a graph registration, an exchange growth, destroy.
int graphar_comm_forget_graph_slots(void* comm, const int32_t* slots, int count);
// Waits for the device (when any mapping is unused) and closes the unused mappings.
int graphar_comm_close_unused_mappings(void* comm);
// Waits for the device, closes the peers' mappings and frees everything, even after an error. If a
// launch of it was captured into a CUDA graph, which may outlive it, it instead marks the group failed
// and keeps its buffers and mappings for the rest of the process: a later replay writes NaN.
int graphar_comm_destroy(void* comm);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif
