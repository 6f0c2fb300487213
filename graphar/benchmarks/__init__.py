"""graphar's benchmarks, run as `python -m graphar bench NAME` (graphar.benchmarks.cli).

common     launch, CUDA-graph capture, timing, the per-unit report and where it goes
ranks      decisions every rank takes alike: agreed checks, captures and cells, max over ranks
plot       the PNG beside each table (matplotlib, an optional extra: graphar[plot])
winners    the fastest kernel per size and capture mode, and graphar.comm.policy's rows from it
allreduce  all-reduce latency: NCCL, PyTorch symmetric memory and graphar, graphs and eager
allreduce_columns   its columns: what each times and how each is set up on every rank
attention  a Ulysses attention block compiled by Inductor + NCCL and by graphar, against its compute floor
capture    BatchGraphs over a serving loop's 64 batch sizes: graphar's capture time and memory against local copies
chunking   the pipelined Ulysses attention's chunking tax, on one GPU: chunked against unchunked, per backend
compile    cold compile time with backend="graphar" against "inductor" and graphar's passes' share (CPU)
decode     one decode step of a tensor-parallel Llama-style model: Inductor + NCCL against graphar
norm       the fused all-reduce + residual add + RMSNorm against the all-reduce alone and unfused
pack       the Ulysses pack kernel against copy_ of the same bytes, on one GPU, with a tile sweep
shapes     the attention shapes chunking and pack share
ulysses    the Ulysses exchanges: three all_to_all_singles against graphar's, over NCCL and IPC
"""
