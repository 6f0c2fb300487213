// The testing library's C ABI (tools/graphar_testing.cu): what tests, benchmarks and the floor tools
// do to a communicator of the shipped library that no user may: set its counters, read its buffers,
// make it its own peer. Built from the same csrc/ as the loaded library (tools/testing_library.py
// checks the build id), as it reads struct Comm by its handle. Every function returns 0 or -1, the
// reason in graphar_testing_last_error().
#pragma once
#include <stdint.h>

// Built with hidden visibility, as the shipped library: it exports what this header declares.
#pragma GCC visibility push(default)
#ifdef __cplusplus
extern "C" {
#endif

const char* graphar_testing_last_error(void);
// Set every barrier counter as if `value` barriers (and `value` push calls) had passed, to reach a
// counter's wrap. Every rank calls it with the same value while no kernel of the group runs anywhere.
int graphar_testing_set_barrier_counters(void* comm, uint32_t value);
// Where this rank's registered input buffer (max_bytes) starts.
int graphar_testing_registered_buffer(void* comm, uint64_t* ptr_out);
// Make a world-size-2 communicator of rank 0, never opened, its own peer for calls of nbytes: its
// pushes for rank 1 land in the slots it reads as rank 1's, so the push one-shot and the fused norm
// run their whole protocol on one GPU with the peer's data arrived at once (the kernels' local work;
// the sum is the input twice). Call it again for another size.
int graphar_testing_loopback(void* comm, uint64_t nbytes);
// Peers' allocations mapped for graph slots: open (read by some slot), unused (not closed yet).
int graphar_testing_graph_mappings(void* comm, int* open, int* unused);
// n > 0: the fused norm splits a row between at most n blocks; 0: as the library chooses.
int graphar_testing_norm_split(void* comm, int max_split);
// The fused norm's grid for nbytes in rows of row_bytes: of this communicator's launch (comm), or of
// block_limit blocks, scratch_words scratch words and max_split (comm null). Writes blocks, threads
// per block and blocks per row.
int graphar_testing_norm_grid(void* comm, uint64_t nbytes, uint64_t row_bytes, int block_limit, uint64_t scratch_words,
                              int max_split, int* blocks, int* threads, int* split);

#ifdef __cplusplus
}
#endif
#pragma GCC visibility pop
